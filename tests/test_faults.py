"""Fault tests on real processes and a real Redis: a worker killed mid-generation (real
model, text compared with the offline engine), a gateway killed, aborts on disconnect and
stop strings, the reaper, a graceful drain, expired deadlines, a Redis restart.

Where no model text is needed the workers run the ``sim`` backend: its output echoes the
prompt, and one step emits one token per running request, so the worker's step count in
its heartbeat is its record of how far a request ran. A request of ``LONG_MAX_TOKENS``
that leaves the worker idle in fewer steps was aborted; one that ran to the end was not.
Tests that leave the stack whole, or restore it (the drain restarts its worker), share one
(``shared_stack``); the worker kill on the real model and the Redis restart build their
own (``stack``). Every wait is bounded in time; none asserts a speed.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import redis

from shared import protocol
from shared.keys import CONSUMER_GROUP, STREAM_FIELD, Keys
from shared.protocol import ErrorMessage, GenerateRequest, WorkerStatus
from shared.sampling import SamplingParams
from tests import processes
from worker.service import REAP_MIN_IDLE_MS

if TYPE_CHECKING:
    from shared.embedded_redis import EmbeddedRedis

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "SmolLM2-135M-Instruct"
KEYS = Keys()
STREAM = KEYS.requests_stream(MODEL)
#: Step time of the sim workers, ms.
SIM_STEP_MS = 20
#: ``max_tokens`` of requests that must be aborted: at ``SIM_STEP_MS`` they would run
#: for 40 s (and fit ``max_model_len`` 2048 with a short prompt).
LONG_MAX_TOKENS = 2000
SIM_WORKER_ARGS = ("--backend", "sim", "--sim-step-time-ms", str(SIM_STEP_MS))
#: What a worker logs when a request's gateway no longer listens (worker/service.py;
#: once per publish that reached no subscriber, so possibly twice per request).
GATEWAY_GONE_LOG = re.compile(r"gateway of (\S+) is gone; aborting it")


class StreamError(AssertionError):
    """An SSE stream ended with an ``{"error": ...}`` event; ``error`` is its body."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"error event: {error}")
        self.error = error


@dataclass
class Stack:
    redis_url: str
    logs: Path
    server: EmbeddedRedis
    #: The gateway of ``shared_stack`` ("" in a test's own stack).
    gateway_url: str = ""
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

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def status(self, name: str) -> WorkerStatus | None:
        client = redis.from_url(self.redis_url)
        try:
            raw = client.get(KEYS.worker_key(name))
        finally:
            client.close()
        return None if raw is None else protocol.decode(raw)

    def num_steps(self, name: str) -> int:
        """Engine steps worker ``name`` has reported in its heartbeat."""
        s = self.status(name)
        assert s is not None, f"worker {name} has no heartbeat"
        return s.num_steps

    def wait_aborted(self, name: str, num_steps_before: int, max_tokens: int = LONG_MAX_TOKENS,
                     timeout_s: float = 120.0) -> WorkerStatus:
        """Wait until sim worker ``name`` holds no request, and check it got there in
        fewer than ``max_tokens`` steps after ``num_steps_before``: its requests of
        ``max_tokens`` tokens were aborted, none ran to its end. Only heartbeats written
        after this call count (an older one may predate the requests). Returns the idle
        status.

        Raises ``AssertionError`` when they ran to ``max_tokens``, or after ``timeout_s``.
        """
        called_unix_s = time.time()
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.status(name)
            if s is not None and s.updated_unix_s > called_unix_s:
                num_run = s.num_steps - num_steps_before
                assert num_run < max_tokens, f"worker {name} ran {num_run} steps: its requests were not aborted"
                if s.num_running == 0 and s.num_waiting == 0:
                    return s
            assert time.monotonic() < deadline, f"worker {name} still busy after {timeout_s} s: {s}"
            time.sleep(0.1)


def _start_stack(logs: Path) -> Stack:
    from shared.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis().start()
    return Stack(server.url, logs, server)


def _stop_stack(s: Stack) -> None:
    for proc in [*s.workers.values(), *s.gateways.values()]:
        processes.stop(proc, signal.SIGKILL)
    s.server.close()


@pytest.fixture
def stack(tmp_path, smollm_source) -> Iterator[Stack]:
    """A fresh Redis, for a test to add the gateways and workers it kills or drains."""
    s = _start_stack(tmp_path)
    try:
        yield s
    finally:
        _stop_stack(s)


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory, smollm_source) -> Iterator[Stack]:
    """Redis, gateway ``gw`` and sim worker ``ws`` (4 sequences), shared by the tests that
    leave them whole or restore them; each leaves the worker idle and nothing pending."""
    s = _start_stack(tmp_path_factory.mktemp("shared_stack"))
    try:
        add_shared_worker(s)
        s.gateway_url = s.add_gateway("gw")
        yield s
    finally:
        _stop_stack(s)


def add_shared_worker(s: Stack) -> None:
    """Start the shared stack's sim worker ``ws`` and wait for its heartbeat."""
    s.add_worker("ws", "--max-num-seqs", "4", *SIM_WORKER_ARGS)
    processes.wait_for_workers(s.redis_url, 1, [s.workers["ws"]])


async def stream_completion(url: str, prompt: str, max_tokens: int, on_token=None, **extra) -> tuple[str, int]:
    """Stream one completion; returns (text, completion_tokens).

    Raises ``StreamError`` when the stream carries an error event.
    """
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
            if "error" in event:
                raise StreamError(event["error"])
            if event["choices"]:
                text += event["choices"][0]["text"]
                if on_token is not None:
                    on_token()
            if event.get("usage"):
                used = event["usage"]["completion_tokens"]
    return text, used


def echo_text(tokenizer, prompt: str, num_tokens: int) -> str:
    """What a sim worker answers to ``prompt`` in ``num_tokens`` tokens (it echoes the
    prompt's ids, repeated; worker/backends/sim.py)."""
    ids = list(tokenizer(prompt)["input_ids"])
    return tokenizer.decode([ids[i % len(ids)] for i in range(num_tokens)], skip_special_tokens=True)


def pending_total(redis_url: str) -> int:
    client = redis.from_url(redis_url)
    try:
        return int(client.xpending(STREAM, CONSUMER_GROUP)["pending"])
    finally:
        client.close()


def read_tokens(pubsub: Any, num_tokens: int, timeout_s: float) -> list[int]:
    """Token ids of the ``TokenBatch`` messages on ``pubsub`` (a subscribed sync PubSub),
    in arrival order, until ``num_tokens`` came or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    tokens: list[int] = []
    while time.monotonic() < deadline and len(tokens) < num_tokens:
        msg = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
        if msg:
            tokens += [t for out in protocol.decode(msg["data"]).outputs for t in out.token_ids]
    return tokens


def wait_no_pending(redis_url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pending_total(redis_url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pending_total(redis_url) == 0


# -- a stack of their own: the real model, or Redis restarted ----------------------------------

def test_worker_sigkill_mid_generation_fails_over_without_loss(stack: Stack, offline) -> None:
    """Four streams over two real-model workers of two slots each (every slot busy, so
    both hold streams); one worker is killed once every stream has 5 tokens: the other
    finishes them all, each equal to the offline engine's greedy text."""
    max_tokens = 32
    stack.add_worker("wa", "--max-num-seqs", "2")
    stack.add_worker("wb", "--max-num-seqs", "2")
    url = stack.add_gateway("gw")
    processes.wait_for_workers(stack.redis_url, 2, list(stack.workers.values()))
    prompts = [f"Tell me a story about a {animal}." for animal in ("cat", "dog", "fox", "owl")]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    expected = offline.generate(prompts, params)
    seen = [0] * len(prompts)

    async def run() -> list[tuple[str, int]]:
        tasks = [asyncio.create_task(stream_completion(url, p, max_tokens, ignore_eos=True,
                                                       on_token=lambda i=i: seen.__setitem__(i, seen[i] + 1)))
                 for i, p in enumerate(prompts)]
        while min(seen) < 5:  # every stream has tokens: both workers are mid-generation
            assert not any(t.done() for t in tasks)
            await asyncio.sleep(0.05)
        victim = stack.workers["wa"]
        victim.send_signal(signal.SIGKILL)
        return await asyncio.gather(*tasks)

    results = asyncio.run(asyncio.wait_for(run(), 240))
    for (text, used), exp in zip(results, expected, strict=True):
        assert text == exp.text  # no duplicated, no missing tokens
        assert used == max_tokens
    assert "failover of" in stack.log("gw")  # the dead worker really held requests
    wait_no_pending(stack.redis_url)


def test_redis_restart_under_traffic_503_then_recovery(stack: Stack, smollm_tokenizer) -> None:
    stack.add_worker("wa", *SIM_WORKER_ARGS)
    url = stack.add_gateway("gw")
    processes.wait_for_workers(stack.redis_url, 1, list(stack.workers.values()))
    seen = [0]

    async def traffic_then_restart() -> list[object]:
        tasks = [asyncio.create_task(stream_completion(url, f"Count to {n}:", LONG_MAX_TOKENS, ignore_eos=True,
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
    assert all(isinstance(o, StreamError) and o.error["code"] == "redis_unavailable" for o in outcomes), outcomes
    processes.wait_for_workers(stack.redis_url, 1, list(stack.workers.values()), timeout_s=30)
    prompt = "The capital of France is"
    deadline = time.monotonic() + 60
    while True:  # the gateway re-subscribes by itself
        resp = httpx.post(f"{url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
        if resp.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == echo_text(smollm_tokenizer, prompt, 12)
    # The sequences cut off by the outage are aborted (orphaned tokens trigger an abort):
    # the worker, fresh in this test, goes idle long before they could reach max_tokens.
    stack.wait_aborted("wa", num_steps_before=0)
    wait_no_pending(stack.redis_url)


# -- one shared stack: gateway gw + sim worker ws --------------------------------------

def test_sigterm_drains_running_requests_then_exits_zero(shared_stack: Stack, smollm_tokenizer) -> None:
    stack = shared_stack
    seen = [0]
    prompt = "The weather today is"

    async def run() -> tuple[str, int]:
        task = asyncio.create_task(stream_completion(stack.gateway_url, prompt, 30, ignore_eos=True,
                                                     on_token=lambda: seen.__setitem__(0, seen[0] + 1)))
        while seen[0] < 3:
            await asyncio.sleep(0.05)
        stack.workers["ws"].send_signal(signal.SIGTERM)
        return await task

    try:
        text, used = asyncio.run(asyncio.wait_for(run(), 120))
        assert text == echo_text(smollm_tokenizer, prompt, 30) and used == 30
        assert stack.workers["ws"].wait(30) == 0
        assert stack.status("ws") is None  # heartbeat removed on exit
        assert pending_total(stack.redis_url) == 0
    finally:  # the next tests get a worker again
        processes.stop(stack.workers["ws"], signal.SIGKILL)
        add_shared_worker(stack)


def test_gateway_killed_frees_its_sequences(shared_stack: Stack) -> None:
    stack = shared_stack
    url = stack.add_gateway("gw-killed")
    num_steps_before = stack.num_steps("ws")
    gone_before = set(GATEWAY_GONE_LOG.findall(stack.log("ws")))
    seen = [0]

    async def start_streams() -> None:
        tasks = [asyncio.create_task(stream_completion(url, f"Count to {n}:", LONG_MAX_TOKENS, ignore_eos=True,
                                                       on_token=lambda: seen.__setitem__(0, seen[0] + 1)))
                 for n in (100, 200, 300)]
        while seen[0] < 6:
            await asyncio.sleep(0.05)
        # the heartbeat shows the sequences running before the gateway dies (the status is
        # read before the kill: afterwards the worker may abort them before its next beat)
        while not ((status := stack.status("ws")) and status.num_running == 3):
            await asyncio.sleep(0.05)
        stack.gateways["gw-killed"].send_signal(signal.SIGKILL)
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(asyncio.wait_for(start_streams(), 120))
    # No gateway is left to send an abort: the worker's next publish reached no
    # subscriber, and it aborted each of the three itself.
    idle = stack.wait_aborted("ws", num_steps_before)
    assert len(set(GATEWAY_GONE_LOG.findall(stack.log("ws"))) - gone_before) == 3
    assert idle.kv_usage == 0.0
    wait_no_pending(stack.redis_url)


def test_client_disconnect_aborts_the_sequence(shared_stack: Stack) -> None:
    stack = shared_stack
    url = stack.gateway_url
    num_steps_before = stack.num_steps("ws")

    async def disconnect_after_tokens() -> None:
        body = {"model": MODEL, "prompt": "Count to 500:", "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True,
                "temperature": 0, "stream": True}
        async with httpx.AsyncClient(timeout=60) as client, client.stream("POST", f"{url}/v1/completions",
                                                                            json=body) as resp:
            n = 0
            async for line in resp.aiter_lines():
                n += line.startswith("data: ")
                if n >= 5:
                    break  # leave mid-stream

    asyncio.run(disconnect_after_tokens())
    stack.wait_aborted("ws", num_steps_before)
    wait_no_pending(stack.redis_url)


def test_stop_string_aborts_the_sequence(shared_stack: Stack) -> None:
    # A stop string that matches early ends the request in the gateway; the worker,
    # which would otherwise run to max_tokens, is told to abort. (The sim echoes the
    # prompt, so " three" comes as the third token.)
    stack = shared_stack
    num_steps_before = stack.num_steps("ws")
    text, used = asyncio.run(stream_completion(stack.gateway_url, "one two three four", LONG_MAX_TOKENS,
                                               stop=[" three"], ignore_eos=True))
    assert text == "one two" and used < LONG_MAX_TOKENS
    stack.wait_aborted("ws", num_steps_before)
    wait_no_pending(stack.redis_url)


def test_reaper_claims_entries_of_a_dead_consumer(shared_stack: Stack) -> None:
    # A request delivered to a consumer that died before any gateway could fail it over
    # must not stay pending: a live worker claims and runs it.
    stack = shared_stack
    num_reclaimed_before = stack.log("ws").count("from dead consumer ghost")
    client = redis.from_url(stack.redis_url)
    pubsub = client.pubsub()
    pubsub.subscribe("test-replies")
    req = GenerateRequest(request_id="orphan", model=MODEL, prompt_token_ids=[5, 6, 7],
                          sampling=SamplingParams(max_tokens=3, temperature=0.0), reply_channel="test-replies",
                          deadline_unix_s=time.time() + 120)
    # Added and delivered to "ghost" (which never acks) in one transaction, so ws, blocked
    # on the stream, cannot take it first; then aged past the reaper's idle threshold
    # (XCLAIM ... IDLE) rather than waited for.
    with client.pipeline(transaction=True) as pipe:
        pipe.xadd(STREAM, {STREAM_FIELD: protocol.encode(req)})
        pipe.xreadgroup(CONSUMER_GROUP, "ghost", {STREAM: ">"}, count=1)
        entry_id, delivered = pipe.execute()
    assert delivered, "the entry was not delivered to ghost"
    client.xclaim(STREAM, CONSUMER_GROUP, "ghost", 0, [entry_id], idle=2 * REAP_MIN_IDLE_MS)
    assert read_tokens(pubsub, 3, timeout_s=60) == [5, 6, 7]
    wait_no_pending(stack.redis_url)
    assert stack.log("ws").count("from dead consumer ghost") == num_reclaimed_before + 1
    client.close()


def test_expired_entries_are_dropped_with_504(shared_stack: Stack) -> None:
    stack = shared_stack
    client = redis.from_url(stack.redis_url)
    pubsub = client.pubsub()
    pubsub.subscribe("late-replies")
    req = GenerateRequest(request_id="late", model=MODEL, prompt_token_ids=[1, 2, 3],
                          sampling=SamplingParams(max_tokens=3), reply_channel="late-replies",
                          deadline_unix_s=time.time() - 1)
    client.xadd(STREAM, {STREAM_FIELD: protocol.encode(req)})
    deadline = time.monotonic() + 90
    reply = None
    while reply is None and time.monotonic() < deadline:
        msg = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
        if msg:
            reply = protocol.decode(msg["data"])
    assert isinstance(reply, ErrorMessage) and reply.status == 504
    assert client.xlen(STREAM) == 0 and pending_total(stack.redis_url) == 0
    client.close()


def test_gateway_answers_504_when_no_worker_runs_the_request_in_time(shared_stack: Stack) -> None:
    # A namespace of its own on the shared Redis: no worker serves it.
    url = shared_stack.add_gateway("gw-alone", "--namespace", "alone", "--request-timeout-s", "1.5")
    resp = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}, timeout=30)
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "deadline_exceeded"
