"""Liveness that means progress, and readiness (issue 19): the heartbeat's step clock,
the one rule that judges a heartbeat (``shared/liveness.py``), failover away from a
worker whose engine hangs, the reaper claiming a stalled consumer's entries, ``/ready``,
and ``inferq serve``'s ready line. Real Redis, real processes, the ``sim`` backend (its
output echoes the prompt, so token identity after a failover is cheap to check)."""

# ruff: noqa: F811 - the fixture imported from test_faults is redefined as a parameter
from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

import httpx
import pytest
import redis

from bench.procs import spawn
from shared import protocol
from shared.keys import CONSUMER_GROUP, STREAM_FIELD, Keys
from shared.liveness import is_alive, live_workers, ready_workers
from shared.protocol import GenerateRequest, WorkerStatus
from shared.sampling import SamplingParams
from shared.serve_ready import announce_when_ready
from tests import processes
from tests.test_faults import MODEL, STREAM, Stack, pending_total, read_tokens, stack, stream_completion  # noqa: F401
from worker.progress import StepClock, StepTrace

#: The stall timeout the process tests give their workers, s.
STALL_S = 2.0


def status(worker_id: str, *, model: str = MODEL, running_s: float = 0.0, stall_s: float = STALL_S) -> WorkerStatus:
    return WorkerStatus(worker_id=worker_id, model=model, backend="sim", num_running=1, num_waiting=0, kv_usage=0.1,
                        num_free_blocks=10, block_size=16, max_num_seqs=4, updated_unix_s=time.time(),
                        started_unix_s=time.time(), pid=1, num_steps=7, step_running_s=running_s,
                        engine_stall_timeout_s=stall_s)


# -- the rule ------------------------------------------------------------------------------

def test_step_clock_reports_the_running_step_and_stalls_past_the_timeout() -> None:
    now = [100.0]
    clock = StepClock(stall_timeout_s=5.0, clock=lambda: now[0])
    assert clock.running_s() == 0.0 and not clock.stalled
    clock.started()
    now[0] += 4.0
    assert clock.running_s() == 4.0 and not clock.stalled
    now[0] += 2.0
    assert clock.stalled
    clock.finished()
    assert clock.num_steps == 1 and clock.last_step_unix_s > 0 and clock.running_s() == 0.0 and not clock.stalled
    clock.started()
    now[0] += 60.0
    clock.finished(completed=False)  # a step that raised is not counted
    assert clock.num_steps == 1
    off = StepClock(stall_timeout_s=0.0, clock=lambda: now[0])
    off.started()
    now[0] += 1e6
    assert not off.stalled


def test_a_heartbeat_is_alive_unless_gone_or_stalled() -> None:
    assert is_alive(protocol.encode(status("w", running_s=1.0)))
    assert not is_alive(protocol.encode(status("w", running_s=2.5)))
    assert is_alive(protocol.encode(status("w", running_s=1e6, stall_s=0.0)))  # rule off
    assert not is_alive(None)
    assert is_alive(b"alive")  # another protocol version: no step time to judge


async def test_live_and_ready_workers_read_from_redis(redis_server) -> None:
    import redis.asyncio as aioredis

    keys = Keys("lv")
    client = aioredis.from_url(redis_server.url)
    try:
        await client.set(keys.worker_key("fresh"), protocol.encode(status("fresh", running_s=0.5)))
        await client.set(keys.worker_key("hung"), protocol.encode(status("hung", running_s=30.0)))
        await client.set(keys.worker_key("other"), protocol.encode(status("other", model="another-model")))
        await client.set(keys.worker_key("opaque"), b"alive")
        live = await live_workers(client, keys, ["fresh", "hung", "other", "opaque", "gone"])
        assert live == {"fresh", "other", "opaque"}
        assert [s.worker_id for s in await ready_workers(client, keys, MODEL)] == ["fresh"]
        assert await ready_workers(client, Keys("empty"), MODEL) == []
    finally:
        await client.aclose()


# -- processes -----------------------------------------------------------------------------

def get_ready(url: str) -> tuple[int, dict]:
    resp = httpx.get(f"{url}/ready", timeout=10, trust_env=False)
    return resp.status_code, resp.json()


def wait_ready(url: str, num_workers: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while get_ready(url) != (200, {"status": "ok", "model": MODEL, "workers_ready": num_workers}):
        assert time.monotonic() < deadline, get_ready(url)
        time.sleep(0.2)


def continuations(redis_url: str) -> list[GenerateRequest]:
    """Requests on the stream that failover re-enqueued (attempt >= 1)."""
    client = redis.from_url(redis_url)
    try:
        entries = client.xrange(STREAM)
    finally:
        client.close()
    messages = [protocol.decode(fields[STREAM_FIELD]) for _, fields in entries]
    return [m for m in messages if isinstance(m, GenerateRequest) and m.attempt >= 1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hung_engine_fails_over_within_the_stall_timeout(stack: Stack) -> None:
    url = stack.add_gateway("gw")
    assert get_ready(url) == (503, {"status": "no_worker", "model": MODEL, "workers_ready": 0})
    hang_after = 40  # sim steps of 20 ms: every request is mid-generation when the engine hangs
    stack.add_worker("wa", "--backend", "sim", "--sim-step-time-ms", "20", "--fault-hang-after-steps",
                     str(hang_after), "--engine-stall-timeout-s", str(STALL_S))
    wait_ready(url, 1)
    prompts = [f"Tell me a story about a {animal}." for animal in ("cat", "dog", "fox")]
    max_tokens = 100
    seen = [0] * len(prompts)

    async def run() -> tuple[list[tuple[str, int]], float, float]:
        tasks = [asyncio.create_task(stream_completion(url, p, max_tokens, ignore_eos=True,
                                                       on_token=lambda i=i: seen.__setitem__(i, seen[i] + 1)))
                 for i, p in enumerate(prompts)]
        while True:  # the engine hangs in step hang_after + 1; its heartbeat goes on
            s = stack.status("wa")
            if s is not None and s.num_steps == hang_after and s.step_running_s > 0:
                break
            assert not any(t.done() for t in tasks)
            await asyncio.sleep(0.05)
        hang_unix_s = s.updated_unix_s - s.step_running_s
        assert 0 < min(seen) and max(seen) < max_tokens
        while len(continuations(stack.redis_url)) < len(prompts):
            assert time.time() - hang_unix_s < STALL_S + 5, "no failover within the stall timeout + 5 s"
            await asyncio.sleep(0.05)
        failover_s = time.time() - hang_unix_s
        hung = stack.status("wa")  # still beating: the stall rule, not the heartbeat's TTL, moved the requests
        assert hung is not None and hung.engine_stalled and hung.num_steps == hang_after
        assert get_ready(url) == (503, {"status": "no_worker", "model": MODEL, "workers_ready": 0})
        stack.add_worker("wb", "--backend", "sim", "--sim-step-time-ms", "20")
        return await asyncio.gather(*tasks), failover_s, hang_unix_s

    results, failover_s, _ = asyncio.run(asyncio.wait_for(run(), 240))
    assert STALL_S <= failover_s < STALL_S + 5
    # Undisturbed runs of the same prompts, now on wb (wa stays hung and pulls nothing).
    async def undisturbed() -> list[tuple[str, int]]:
        return await asyncio.gather(*[stream_completion(url, p, max_tokens, ignore_eos=True) for p in prompts])

    expected = asyncio.run(asyncio.wait_for(undisturbed(), 120))
    assert results == expected  # token-identical: nothing lost, nothing duplicated
    assert all(used == max_tokens for _, used in results)
    assert (stack.logs / "gw.log").read_text().count("failover of") == len(prompts)
    assert "FAULT INJECTION" in (stack.logs / "wa.log").read_text()
    wait_ready(url, 1, timeout_s=10)  # wb only


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reaper_claims_entries_of_a_consumer_whose_engine_stalled(stack: Stack) -> None:
    # No gateway: a live worker's reaper must take over an entry held by a consumer whose
    # heartbeat is fresh but says its engine has hung.
    client = redis.from_url(stack.redis_url)
    client.xgroup_create(STREAM, CONSUMER_GROUP, id="0", mkstream=True)
    pubsub = client.pubsub()
    pubsub.subscribe("test-replies")
    req = GenerateRequest(request_id="stuck", model=MODEL, prompt_token_ids=[5, 6, 7],
                          sampling=SamplingParams(max_tokens=3, temperature=0.0), reply_channel="test-replies",
                          deadline_unix_s=time.time() + 120)
    entry_id = client.xadd(STREAM, {STREAM_FIELD: protocol.encode(req)})
    assert client.xreadgroup(CONSUMER_GROUP, "ghost", {STREAM: ">"}, count=1)
    client.xclaim(STREAM, CONSUMER_GROUP, "ghost", 0, [entry_id], idle=60_000)  # idle long enough to reap
    client.set(Keys().worker_key("ghost"), protocol.encode(status("ghost", running_s=30.0)), ex=120)
    stack.add_worker("wa", "--backend", "sim")
    deadline = time.monotonic() + 90
    assert read_tokens(pubsub, 3, timeout_s=90) == [5, 6, 7]
    while pending_total(stack.redis_url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pending_total(stack.redis_url) == 0
    assert "reclaimed" in (stack.logs / "wa.log").read_text()
    client.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ready_line_waits_for_a_worker(stack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    url = stack.add_gateway("gw")
    port = int(url.rsplit(":", 1)[1])
    stop = threading.Event()
    with caplog.at_level(logging.INFO, logger="shared.serve_ready"):
        thread = announce_when_ready("127.0.0.1", port, stop)
        try:
            time.sleep(2.0)  # four polls of a gateway without a worker
            assert "inferq ready" not in caplog.text
            stack.add_worker("wa", "--backend", "sim")
            thread.join(120)
            assert not thread.is_alive()
        finally:
            stop.set()
    assert caplog.text.count(f"inferq ready: {url} (model {MODEL}, 1 worker)") == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_logs_the_url_once_a_worker_is_ready(tmp_path, smollm_source) -> None:
    port = processes.free_port()
    log_path = tmp_path / "serve.log"
    proc = spawn(["-m", "shared.cli", "serve", "--backend", "sim", "--port", str(port)], log_path)
    line = f"inferq ready: http://127.0.0.1:{port} (model {MODEL}, 1 worker)"
    try:
        deadline = time.monotonic() + 240
        while "inferq ready:" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()[-2000:]
            assert time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.2)
        assert line in log_path.read_text()
        assert get_ready(f"http://127.0.0.1:{port}")[0] == 200
    finally:
        processes.stop(proc, signal.SIGINT, timeout_s=60)
    assert log_path.read_text().count("inferq ready:") == 1


def test_step_trace_writes_one_ordered_line_per_step(tmp_path) -> None:
    import json

    trace = StepTrace(tmp_path / "steps.jsonl")
    for num_outputs in (3, 1):
        trace.pulled, trace.pull_s = 2, 0.001
        handed_s = time.monotonic()
        assert trace.wrap(lambda: "out")() == "out"
        trace.record(handed_s, num_outputs)
    trace.close()
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [(s["outputs"], s["pulled"], s["pull_s"]) for s in lines] == [(3, 2, 0.001), (1, 2, 0.001)]
    for s in lines:
        assert s["handed"] <= s["ran"] <= s["done"] <= s["back"]
    assert lines[0]["back"] <= lines[1]["handed"]
