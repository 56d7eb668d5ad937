"""Fault tests on real processes, a real Redis and the real model (CPU): a worker
killed mid-generation, a gateway killed, aborts on disconnect and stop strings, a
graceful drain, expired deadlines. Each is bounded in time."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from shared import protocol
from shared.keys import CONSUMER_GROUP, STREAM_FIELD, Keys
from shared.protocol import ErrorMessage, GenerateRequest, WorkerStatus
from shared.sampling import SamplingParams
from tests import processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "SmolLM2-135M-Instruct"
KEYS = Keys()
STREAM = KEYS.requests_stream(MODEL)


@dataclass
class Stack:
    redis_url: str
    logs: Path
    server: object
    workers: dict[str, processes.subprocess.Popen[bytes]] = field(default_factory=dict)
    gateways: dict[str, processes.subprocess.Popen[bytes]] = field(default_factory=dict)

    def add_worker(self, name: str, *args: str) -> None:
        self.workers[name] = processes.start("worker", self.redis_url, "--worker-id", name, *args,
                                             log_path=self.logs / f"{name}.log")

    def add_gateway(self, name: str, *args: str) -> str:
        port = processes.free_port()
        proc = processes.start("gateway", self.redis_url, "--port", str(port), *args,
                               log_path=self.logs / f"{name}.log")
        self.gateways[name] = proc
        url = f"http://127.0.0.1:{port}"
        processes.wait_for_gateway(url, proc)
        return url

    def status(self, name: str) -> WorkerStatus | None:
        client = redis.from_url(self.redis_url)
        try:
            raw = client.get(KEYS.worker_key(name))
        finally:
            client.close()
        return None if raw is None else protocol.decode(raw)

    def wait_idle(self, name: str, timeout_s: float) -> float:
        """Seconds until worker ``name`` reports no running or waiting request."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            s = self.status(name)
            if s is not None and s.num_running == 0 and s.num_waiting == 0:
                return time.monotonic() - t0
            time.sleep(0.1)
        raise AssertionError(f"worker {name} still busy after {timeout_s} s: {self.status(name)}")


@pytest.fixture
def stack(tmp_path, smollm_source) -> Iterator[Stack]:
    from shared.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis().start()
    s = Stack(server.url, tmp_path, server)
    try:
        yield s
    finally:
        for proc in [*s.workers.values(), *s.gateways.values()]:
            processes.stop(proc, signal.SIGKILL)
        server.close()


@pytest.fixture(scope="module")
def offline():
    from worker.llm import LLM

    return LLM(max_num_seqs=1)


async def stream_completion(url: str, prompt: str, max_tokens: int, on_token=None, **extra) -> tuple[str, int]:
    """Stream one completion; returns (text, completion_tokens)."""
    import json

    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    text, used = "", -1
    async with httpx.AsyncClient(timeout=120) as client, client.stream("POST", f"{url}/v1/completions",
                                                                        json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event["choices"]:
                text += event["choices"][0]["text"]
                if on_token is not None:
                    on_token()
            if event.get("usage"):
                used = event["usage"]["completion_tokens"]
    return text, used


def pending_total(redis_url: str) -> int:
    client = redis.from_url(redis_url)
    try:
        return int(client.xpending(STREAM, CONSUMER_GROUP)["pending"])
    finally:
        client.close()


def test_worker_sigkill_mid_generation_fails_over_without_loss(stack: Stack, offline) -> None:
    stack.add_worker("wa", "--max-num-seqs", "3")
    stack.add_worker("wb", "--max-num-seqs", "3")
    url = stack.add_gateway("gw")
    processes.wait_for_workers(stack.redis_url, 2, list(stack.workers.values()))
    prompts = [f"Tell me a story about a {animal}." for animal in ("cat", "dog", "fox", "owl", "eel", "bee")]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [offline.generate([p], params)[0] for p in prompts]
    seen = [0] * len(prompts)

    async def run() -> list[tuple[str, int]]:
        tasks = [asyncio.create_task(stream_completion(url, p, 40, on_token=lambda i=i: seen.__setitem__(i, seen[i] + 1),
                                                       ignore_eos=True)) for i, p in enumerate(prompts)]
        while min(seen) < 5:  # every stream has tokens: both workers are mid-generation
            assert not any(t.done() for t in tasks)
            await asyncio.sleep(0.05)
        victim = stack.workers["wa"]
        victim.send_signal(signal.SIGKILL)
        return await asyncio.gather(*tasks)

    results = asyncio.run(asyncio.wait_for(run(), 240))
    for (text, used), exp in zip(results, expected, strict=True):
        assert text == exp.text  # no duplicated, no missing tokens
        assert used == 40
    gw_log = (stack.logs / "gw.log").read_text()
    assert "failover of" in gw_log  # the dead worker really held requests
    deadline = time.monotonic() + 30
    while pending_total(stack.redis_url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pending_total(stack.redis_url) == 0


def test_reaper_claims_entries_of_a_dead_consumer(stack: Stack) -> None:
    # A request delivered to a consumer that died before any gateway could fail it over
    # (here: no gateway at all) must not stay pending: a live worker claims and runs it.
    client = redis.from_url(stack.redis_url)
    client.xgroup_create(STREAM, CONSUMER_GROUP, id="0", mkstream=True)
    pubsub = client.pubsub()
    pubsub.subscribe("test-replies")
    req = GenerateRequest(request_id="orphan", model=MODEL, prompt_token_ids=[1, 2, 3],
                          sampling=SamplingParams(max_tokens=3, temperature=0.0), reply_channel="test-replies",
                          deadline_unix_s=time.time() + 120)
    client.xadd(STREAM, {STREAM_FIELD: protocol.encode(req)})
    assert client.xreadgroup(CONSUMER_GROUP, "ghost", {STREAM: ">"}, count=1)  # "ghost" never acks
    stack.add_worker("wa")
    processes.wait_for_workers(stack.redis_url, 1, list(stack.workers.values()))
    deadline = time.monotonic() + 60
    tokens: list[int] = []
    while time.monotonic() < deadline and len(tokens) < 3:
        msg = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
        if msg:
            tokens += protocol.decode(msg["data"]).token_ids
    assert len(tokens) == 3
    while pending_total(stack.redis_url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pending_total(stack.redis_url) == 0
    client.close()


def test_gateway_killed_frees_its_sequences(stack: Stack) -> None:
    stack.add_worker("wa", "--max-num-seqs", "4")
    url = stack.add_gateway("gw")
    processes.wait_for_workers(stack.redis_url, 1, list(stack.workers.values()))
    seen = [0]

    async def start_streams() -> None:
        tasks = [asyncio.create_task(stream_completion(url, f"Count to {n}:", 500, ignore_eos=True,
                                                       on_token=lambda: seen.__setitem__(0, seen[0] + 1)))
                 for n in (100, 200, 300)]
        while seen[0] < 6:
            await asyncio.sleep(0.05)
        # the heartbeat shows the sequences running before the gateway dies (the status is
        # read before the kill: afterwards the worker may abort them before its next beat)
        while not ((status := stack.status("wa")) and status.num_running == 3):
            await asyncio.sleep(0.05)
        stack.gateways["gw"].send_signal(signal.SIGKILL)
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(asyncio.wait_for(start_streams(), 120))
    # 500 tokens each would take tens of seconds: idle within 5 s means the next publish
    # reached no subscriber and the worker aborted them
    assert stack.wait_idle("wa", 10) < 5
    assert stack.status("wa").kv_usage == 0.0


def test_client_disconnect_and_stop_string_abort_the_sequence(stack: Stack) -> None:
    stack.add_worker("wa")
    url = stack.add_gateway("gw")
    processes.wait_for_workers(stack.redis_url, 1, list(stack.workers.values()))

    async def disconnect_after_tokens() -> None:
        body = {"model": MODEL, "prompt": "Count to 500:", "max_tokens": 500, "ignore_eos": True,
                "temperature": 0, "stream": True}
        async with httpx.AsyncClient(timeout=60) as client, client.stream("POST", f"{url}/v1/completions",
                                                                            json=body) as resp:
            n = 0
            async for line in resp.aiter_lines():
                n += line.startswith("data: ")
                if n >= 5:
                    break  # leave mid-stream

    asyncio.run(disconnect_after_tokens())
    assert stack.wait_idle("wa", 10) < 5
    # A stop string that matches early ends the request in the gateway; the worker,
    # which would otherwise run to 500 tokens, is told to abort.
    text, used = asyncio.run(stream_completion(url, "Count from 1 to 100: 1, 2, 3,", 500, stop=[" 9"],
                                               ignore_eos=True))
    assert " 9" not in text and used < 100
    assert stack.wait_idle("wa", 10) < 5


def test_sigterm_drains_running_requests_then_exits_zero(stack: Stack, offline) -> None:
    stack.add_worker("wa")
    url = stack.add_gateway("gw")
    processes.wait_for_workers(stack.redis_url, 1, list(stack.workers.values()))
    seen = [0]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    expected = offline.generate(["The weather today is"], params)[0]

    async def run() -> tuple[str, int]:
        task = asyncio.create_task(stream_completion(url, "The weather today is", 30, ignore_eos=True,
                                                     on_token=lambda: seen.__setitem__(0, seen[0] + 1)))
        while seen[0] < 3:
            await asyncio.sleep(0.05)
        stack.workers["wa"].send_signal(signal.SIGTERM)
        return await task

    text, used = asyncio.run(asyncio.wait_for(run(), 120))
    assert text == expected.text and used == 30
    assert stack.workers["wa"].wait(30) == 0
    assert stack.status("wa") is None  # heartbeat removed on exit
    assert pending_total(stack.redis_url) == 0


def test_expired_entries_are_dropped_with_504(stack: Stack) -> None:
    client = redis.from_url(stack.redis_url)
    client.xgroup_create(STREAM, CONSUMER_GROUP, id="0", mkstream=True)
    pubsub = client.pubsub()
    pubsub.subscribe("late-replies")
    req = GenerateRequest(request_id="late", model=MODEL, prompt_token_ids=[1, 2, 3],
                          sampling=SamplingParams(max_tokens=3), reply_channel="late-replies",
                          deadline_unix_s=time.time() - 1)
    client.xadd(STREAM, {STREAM_FIELD: protocol.encode(req)})
    stack.add_worker("wa")
    deadline = time.monotonic() + 90
    reply = None
    while reply is None and time.monotonic() < deadline:
        msg = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
        if msg:
            reply = protocol.decode(msg["data"])
    assert isinstance(reply, ErrorMessage) and reply.status == 504
    assert client.xlen(STREAM) == 0 and pending_total(stack.redis_url) == 0
    client.close()


def test_gateway_answers_504_when_no_worker_runs_the_request_in_time(stack: Stack) -> None:
    url = stack.add_gateway("gw", "--request-timeout-s", "1.5")
    t0 = time.monotonic()
    resp = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}, timeout=30)
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "deadline_exceeded"
    assert 1.4 < time.monotonic() - t0 < 10


def test_redis_restart_under_traffic_503_then_recovery(stack: Stack, offline) -> None:
    stack.add_worker("wa")
    url = stack.add_gateway("gw")
    processes.wait_for_workers(stack.redis_url, 1, list(stack.workers.values()))
    seen = [0]

    async def traffic_then_restart() -> list[object]:
        tasks = [asyncio.create_task(stream_completion(url, f"Count to {n}:", 300, ignore_eos=True,
                                                       on_token=lambda: seen.__setitem__(0, seen[0] + 1)))
                 for n in (50, 60)]
        while seen[0] < 4:
            await asyncio.sleep(0.05)
        stack.server.stop()
        async with httpx.AsyncClient(timeout=10) as client:
            down = await client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            health = await client.get(f"{url}/health")
        assert down.status_code == 503 and down.json()["error"]["code"] == "redis_unavailable"
        assert health.status_code == 503
        stack.server.start()
        return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = asyncio.run(asyncio.wait_for(traffic_then_restart(), 120))
    # The streams cut by the outage ended with an error event, never silently.
    assert all(isinstance(o, AssertionError) and "error" in str(o) for o in outcomes), outcomes
    processes.wait_for_workers(stack.redis_url, 1, list(stack.workers.values()), timeout_s=30)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    expected = offline.generate(["The capital of France is"], params)[0]
    deadline = time.monotonic() + 60
    while True:  # the gateway re-subscribes by itself
        resp = httpx.post(f"{url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12,
                                "temperature": 0})
        if resp.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == expected.text
    # The sequences cut off by the outage are aborted (orphaned tokens trigger an abort).
    assert stack.wait_idle("wa", 20) < 15
    assert pending_total(stack.redis_url) == 0
