"""Losing the Redis primary under load, behind Sentinel: real processes only.

A primary and a replica ``redis-server`` watched by three ``redis-server --sentinel``
(``tests/redis_topologies.py``: a primary is called down after 1 s of silence), one
gateway and two sim workers connected through the ``redis+sentinel://`` URL. While
``NUM_STREAMS`` streaming completions run, the primary is SIGKILLed. What must hold:

- no stream hangs: each one completes or ends with an OpenAI error (an ``error`` event
  then ``[DONE]``, or an HTTP error with an OpenAI error body) within
  ``END_WITHIN_S`` of the kill;
- serving is back within ``BACK_WITHIN_S``: a new request completes, on the promoted
  replica;
- what the replication window lost is measured and printed: acknowledged writes of a
  counter that the new primary does not have, and how the streams ended. The numbers go
  to docs/operations.md ("A Redis that survives losing a node").

``NUM_STREAMS`` is 200 (the sim step is ``SIM_STEP_MS``, so the 2-core test machine
carries 200 streams of ``MAX_TOKENS`` tokens without falling behind).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from tests import processes
from tests.redis_topologies import SentinelSet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

MODEL = "SmolLM2-135M-Instruct"
NUM_STREAMS = 200
#: Output tokens of each stream: at ``SIM_STEP_MS`` a stream runs ~5 s undisturbed.
MAX_TOKENS = 100
SIM_STEP_MS = 50
WORKER_ARGS = ("--backend", "sim", "--sim-step-time-ms", str(SIM_STEP_MS), "--max-num-seqs", "128")
#: Every stream in flight at the kill ends (completes or errors) this soon after it, s.
END_WITHIN_S = 10.0
#: A new request completes this soon after the kill, s.
BACK_WITHIN_S = 15.0


@dataclass
class Outcome:
    """How one stream ended: ``kind`` is ``done`` (finish_reason and ``[DONE]``),
    ``error_event`` (an error event then ``[DONE]``), ``http_error`` (an error status
    with an OpenAI error body) or ``broken`` (anything else: a hang cut by the test, a
    body that is not SSE, a connection dropped without an error)."""

    kind: str
    num_tokens: int = 0
    code: str = ""
    ended_s: float = 0.0
    first_token_s: float | None = None


@dataclass
class Stack:
    redis: SentinelSet
    logs: Path
    procs: dict[str, processes.subprocess.Popen[bytes]] = field(default_factory=dict)
    url: str = ""


@pytest.fixture()
def stack() -> Iterator[Stack]:
    s = Stack(redis=SentinelSet().start(), logs=Path(tempfile.mkdtemp(prefix="inferq-sentinel-procs-")))
    try:
        for name in ("wa", "wb"):
            s.procs[name] = processes.start("worker", s.redis.url, "--worker-id", name, *WORKER_ARGS,
                                            log_path=s.logs / f"{name}.log")
        port = processes.free_port()
        s.procs["gw"] = processes.start("gateway", s.redis.url, "--port", str(port), log_path=s.logs / "gw.log")
        s.url = f"http://127.0.0.1:{port}"
        processes.wait_for_gateway(s.url, s.procs["gw"])
        processes.wait_for_workers(s.redis.url, 2, [s.procs["wa"], s.procs["wb"]])
        yield s
    finally:
        for proc in s.procs.values():
            processes.stop(proc, timeout_s=10)
        s.redis.close()


def _body(i: int, stream: bool, max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    prompt = [(i * 31 + k) % 5000 + 100 for k in range(8)]
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": stream}


async def _stream(client: httpx.AsyncClient, url: str, i: int, t0: float) -> Outcome:
    """One streaming completion, read to its end (``Outcome``)."""
    out = Outcome("broken")
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=_body(i, True)) as resp:
            if resp.status_code != 200:
                error = json.loads(await resp.aread()).get("error", {})
                out.kind = "http_error" if error.get("message") else "broken"
                out.code = str(error.get("code") or resp.status_code)
                return out
            finished = errored = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.kind = "done" if finished else "error_event" if errored else "broken"
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    errored, out.code = True, str(event["error"].get("code") or event["error"].get("type"))
                    continue
                choice = event["choices"][0]
                if choice.get("text"):
                    out.num_tokens += 1
                    if out.first_token_s is None:
                        out.first_token_s = time.monotonic() - t0
                finished = finished or choice.get("finish_reason") is not None
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.kind, out.code = "broken", type(exc).__name__
    finally:
        out.ended_s = time.monotonic() - t0
    return out


class AckedCounter:
    """INCRs a counter on the primary in a loop through its own Sentinel client, keeping
    the last value Redis acknowledged: what the new primary lacks of it is what the
    replication window lost."""

    KEY = "sentinel-test:acked"

    def __init__(self, url: str) -> None:
        from shared.redis_connect import connect_sync

        self.client = connect_sync(url, socket_timeout=1, socket_connect_timeout=1)
        self.last_acked = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.last_acked = int(self.client.incr(self.KEY))
            except redis.RedisError:
                time.sleep(0.05)

    def frozen_at_kill(self) -> int:
        return self.last_acked


def test_primary_killed_mid_load_streams_end_cleanly_and_serving_returns(stack: Stack) -> None:
    counter = AckedCounter(stack.redis.url)
    counter.thread.start()

    async def run() -> dict[str, object]:
        limits = httpx.Limits(max_connections=NUM_STREAMS + 20, max_keepalive_connections=NUM_STREAMS + 20)
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits, trust_env=False) as client:
            t0 = time.monotonic()
            tasks = [asyncio.create_task(_stream(client, stack.url, i, t0)) for i in range(NUM_STREAMS)]
            # Kill once the streams run: wait for tokens, at most a few seconds.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                if sum(1 for t in tasks if t.done()) >= NUM_STREAMS // 4:
                    break
                if time.monotonic() - t0 > 2.0:
                    break
            acked_before_kill = counter.last_acked
            kill_s = time.monotonic() - t0
            old_port = stack.redis.primary.port
            stack.redis.primary.kill()
            killed_at = time.monotonic()
            acked_at_kill = counter.last_acked
            done, pending = await asyncio.wait(tasks, timeout=END_WITHIN_S + 5)
            for t in pending:
                t.cancel()
            outcomes = [t.result() if t in done else Outcome("broken", code="hung") for t in tasks]
            # Serving again: a new request completes (retried while it gets errors).
            back_s = None
            probes: Counter[str] = Counter()
            while time.monotonic() - killed_at < BACK_WITHIN_S + 10:
                try:
                    resp = await client.post(f"{stack.url}/v1/completions", json=_body(999, False, 4), timeout=5)
                    if resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4:
                        back_s = time.monotonic() - killed_at
                        break
                    probes[str(resp.status_code)] += 1
                except httpx.HTTPError as exc:
                    probes[type(exc).__name__] += 1
                await asyncio.sleep(0.2)
            return {"outcomes": outcomes, "kill_s": kill_s, "killed_at": killed_at, "back_s": back_s,
                    "probes": probes, "acked_at_kill": acked_at_kill, "acked_before_kill": acked_before_kill,
                    "old_port": old_port}

    result = asyncio.run(run())
    counter.stop.set()
    counter.thread.join(5)
    outcomes: list[Outcome] = result["outcomes"]  # type: ignore[assignment]
    kill_s: float = result["kill_s"]  # type: ignore[assignment]
    # The promoted replica is the primary now, and lost what was not replicated.
    new_port = stack.redis.primary_port()
    assert new_port == stack.redis.replica.port != result["old_port"]
    replica = stack.redis.replica.client()
    try:
        on_new_primary = int(replica.get(AckedCounter.KEY) or 0)
    finally:
        replica.close()
    lost_writes = max(0, int(result["acked_at_kill"]) - on_new_primary)  # type: ignore[call-overload]

    kinds = Counter(o.kind for o in outcomes)
    codes = Counter(o.code for o in outcomes if o.kind != "done")
    in_flight = [o for o in outcomes if o.ended_s > kill_s]
    summary = {
        "streams": NUM_STREAMS, "killed_after_s": round(kill_s, 2),
        "streams_with_tokens_at_kill": sum(1 for o in outcomes if o.first_token_s is not None
                                           and o.first_token_s < kill_s),
        "outcomes": dict(kinds), "error_codes": dict(codes),
        "last_stream_end_after_kill_s": round(max((o.ended_s - kill_s for o in in_flight), default=0.0), 2),
        "serving_back_after_s": None if result["back_s"] is None else round(result["back_s"], 2),  # type: ignore[arg-type]
        "probe_failures": dict(result["probes"]),  # type: ignore[arg-type]
        "acked_counter_writes_lost": lost_writes, "acked_counter_at_kill": result["acked_at_kill"],
    }
    print("sentinel failover:", json.dumps(summary))
    assert kinds["broken"] == 0, [o for o in outcomes if o.kind == "broken"]
    for o in in_flight:
        assert o.ended_s - kill_s <= END_WITHIN_S, o
    assert all(o.code in ("redis_unavailable", "") for o in outcomes if o.kind != "done"), codes
    assert kinds["done"] + kinds["error_event"] + kinds["http_error"] == NUM_STREAMS
    assert result["back_s"] is not None and result["back_s"] <= BACK_WITHIN_S, summary
