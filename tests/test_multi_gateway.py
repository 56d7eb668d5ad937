"""Gateways and real workers together, in one process: gateways under uvicorn (the app of
``gateway/app.py``), workers (``worker/service.py``) with the sim backend (20 ms steps;
its output echoes the prompt), one real redis-server. Covers what needs both sides: a
deadline that passes while a worker holds the request (docs/operations.md, "Limits":
504 ``deadline_exceeded``, the worker is told to abort), and several gateways on one
Redis: an abort through one of them, failover of both gateways' requests when their
worker dies, one ``X-Request-Id`` sent to two gateways at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.app import create_app
from shared import protocol
from shared.keys import Keys
from shared.protocol import AbortMessage
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, GatewaySettings, ModelSettings, RedisSettings
from shared.streams import read_depth
from tests.gateway_harness import serving
from worker.backends.sim import SimBackend
from worker.service import Worker

pytestmark = pytest.mark.timeout(120)
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 2048
STEP_TIME_MS = 20.0


class RecordingSim(SimBackend):
    """The sim backend, recording what it was given: ``added`` (request id, number of
    outputs it resumes after) and ``aborted`` ids."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.added: list[tuple[str, int]] = []
        self.aborted: list[str] = []

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    output_token_ids: list[int] | None = None, priority: int = 0, tenant: str = "",
                    **kwargs: Any) -> None:
        super().add_request(request_id, prompt_token_ids, sampling, output_token_ids, priority, tenant, **kwargs)
        self.added.append((request_id, len(output_token_ids or ())))

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return super().abort(request_id)


@dataclass
class Stack:
    """Gateways and workers on one Redis namespace; everything is stopped by the fixture."""

    redis_url: str
    source: Any
    tokenizer: Any
    keys: Keys = field(default_factory=lambda: Keys(f"t{uuid.uuid4().hex[:8]}"))
    workers: dict[str, tuple[Worker, asyncio.Task[None]]] = field(default_factory=dict)
    _gateways: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    _clients: list[aioredis.Redis] = field(default_factory=list)
    _probe: aioredis.Redis | None = None

    def redis(self) -> aioredis.Redis:
        client = aioredis.from_url(self.redis_url)
        self._clients.append(client)
        return client

    async def add_gateway(self, **settings: Any) -> httpx.AsyncClient:
        """Start a gateway; returns an HTTP client for it."""
        app = create_app(GatewaySettings(**settings), RedisSettings(redis_url=self.redis_url,
                                                                    namespace=self.keys.namespace),
                         ModelSettings(max_model_len=MAX_MODEL_LEN), self.source, tokenizer=self.tokenizer)
        base_url = await self._gateways.enter_async_context(serving(app, relay_timeout_s=10))
        return await self._gateways.enter_async_context(httpx.AsyncClient(base_url=base_url, timeout=60))

    def add_worker(self, worker_id: str) -> Worker:
        backend = RecordingSim(ModelSettings(max_model_len=MAX_MODEL_LEN), EngineSettings(max_num_seqs=8),
                               step_time_ms=STEP_TIME_MS, config=self.source.config)
        worker = Worker(self.redis(), self.keys, MODEL, worker_id, backend)
        self.workers[worker_id] = (worker, asyncio.create_task(worker.run()))
        return worker

    async def kill(self, worker_id: str) -> None:
        """Stop a worker at once, mid-step, as a crash would (no drain; its heartbeat
        goes, as after a drain that timed out)."""
        worker, task = self.workers.pop(worker_id)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        worker.engine_thread.close()

    async def close(self) -> None:
        for worker_id in list(self.workers):
            await self.kill(worker_id)
        await self._gateways.aclose()
        for client in self._clients:
            await client.aclose()

    async def stream_empty(self) -> bool:
        if self._probe is None:
            self._probe = self.redis()
        depth = await read_depth(self._probe, self.keys.requests_stream(MODEL))
        return (depth.length, depth.num_pending) == (0, 0)


@pytest.fixture()
async def stack(redis_server, smollm_source, smollm_tokenizer) -> AsyncIterator[Stack]:
    s = Stack(redis_server.url, smollm_source, smollm_tokenizer)
    try:
        yield s
    finally:
        await s.close()


@dataclass
class Streamed:
    """One streamed completion as the client saw it."""

    status: int
    request_id: str = ""
    text: str = ""
    num_chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int = -1
    error: dict[str, Any] | None = None


async def stream(http: httpx.AsyncClient, prompt: str, max_tokens: int, *, leave_after: int = 0,
                 on_chunk: Callable[[], None] | None = None) -> Streamed:
    """Stream one greedy completion (EOS ignored); ``leave_after`` > 0 disconnects after
    that many text chunks."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        out = Streamed(resp.status_code, resp.headers.get("x-request-id", ""))
        if resp.status_code != 200:
            out.error = json.loads(await resp.aread())["error"]
            return out
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                out.error = event["error"]
                continue
            if event["choices"]:
                out.text += event["choices"][0]["text"]
                out.finish_reason = event["choices"][0]["finish_reason"] or out.finish_reason
                out.num_chunks += 1
                if on_chunk is not None:
                    on_chunk()
                if out.num_chunks == leave_after:
                    return out  # leaves the stream: the connection closes mid-generation
            if event.get("usage"):
                out.completion_tokens = event["usage"]["completion_tokens"]
    return out


async def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = 10.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline_s, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


# -- a deadline that passes on the worker ----------------------------------------------------

@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "json"])
async def test_deadline_passing_on_the_worker_is_504_and_the_worker_drops_the_request(stack, streaming) -> None:
    http = await stack.add_gateway(request_timeout_s=1.5)
    worker = stack.add_worker("w1")
    control = stack.redis().pubsub()
    await control.subscribe(stack.keys.control_channel())
    max_tokens = 1000  # 20 s of 20 ms steps: far past the deadline
    if streaming:
        out = await stream(http, "Count the waves on the shore.", max_tokens)
        assert out.status == 200 and out.num_chunks > 0  # the worker was generating
        assert out.error is not None and out.error["code"] == "deadline_exceeded", out
    else:
        resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Count the waves on the shore.",
                                                        "max_tokens": max_tokens, "ignore_eos": True})
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "deadline_exceeded"
    ((request_id, _),) = worker.backend.added
    assert not streaming or request_id == out.request_id
    # The gateway told the workers why (before any late token could make it an orphan),
    # and the worker aborted the request and finished its entry.
    aborts: list[AbortMessage] = []
    deadline_s = time.monotonic() + 10
    while AbortMessage(request_ids=[request_id], reason="deadline") not in aborts:
        assert time.monotonic() < deadline_s, f"no abort with reason deadline: {aborts}"
        item = await control.get_message(ignore_subscribe_messages=True, timeout=0.5)
        if item is not None:
            aborts.append(protocol.decode(item["data"]))
    await control.aclose()
    await wait_until(lambda: worker.backend.aborted == [request_id], "the worker aborts the request")
    await wait_until(lambda: not worker.inflight and not worker.backend.has_unfinished_requests(), "worker idle")
    await wait_until(stack.stream_empty, "entry acked and deleted")


# -- several gateways ------------------------------------------------------------------------

async def test_client_leaving_gateway_a_stops_only_its_request(stack) -> None:
    gw_a, gw_b = await stack.add_gateway(), await stack.add_gateway()
    worker = stack.add_worker("w1")
    left, kept = await asyncio.gather(stream(gw_a, "Count the waves on the shore.", 1000, leave_after=5),
                                      stream(gw_b, "Name the stars in the sky.", 40))
    assert left.num_chunks == 5
    assert kept.error is None and kept.finish_reason == "length" and kept.completion_tokens == 40
    assert sorted(rid for rid, _ in worker.backend.added) == sorted([left.request_id, kept.request_id])
    await wait_until(lambda: worker.backend.aborted == [left.request_id], "the worker aborts A's request")
    await wait_until(lambda: not worker.inflight, "worker idle")
    await wait_until(stack.stream_empty, "entries acked and deleted")


async def test_requests_of_both_gateways_fail_over_when_their_worker_dies(stack) -> None:
    gw_a, gw_b = await stack.add_gateway(), await stack.add_gateway()
    stack.add_worker("w1")
    prompts = [(gw_a, "Count the waves on the shore."), (gw_a, "Name the stars in the sky."),
               (gw_b, "List the birds of the forest."), (gw_b, "Tell me about the old lighthouse.")]
    max_tokens = 100
    seen = [0] * len(prompts)

    def counter(i: int) -> Callable[[], None]:
        return lambda: seen.__setitem__(i, seen[i] + 1)

    tasks = [asyncio.create_task(stream(http, p, max_tokens, on_chunk=counter(i)))
             for i, (http, p) in enumerate(prompts)]
    await wait_until(lambda: min(seen) >= 5, "every stream under way")
    assert max(seen) < max_tokens
    w2 = stack.add_worker("w2")
    await stack.kill("w1")
    results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    # w2 ran a continuation of each request, resuming after what its client had.
    resumed = dict(w2.backend.added)
    assert sorted(resumed) == sorted(r.request_id for r in results)
    assert all(n >= 5 for n in resumed.values()), resumed
    expected = await asyncio.gather(*[stream(http, p, max_tokens) for http, p in prompts])  # undisturbed, on w2
    for got, want in zip(results, expected, strict=True):
        assert got.error is None and got.completion_tokens == max_tokens
        assert got.text == want.text  # nothing lost, nothing twice
    await wait_until(stack.stream_empty, "entries acked and deleted")


async def test_one_request_id_sent_to_two_gateways_runs_once(stack) -> None:
    gw_a, gw_b = await stack.add_gateway(), await stack.add_gateway()
    body = {"model": MODEL, "prompt": "Count the waves on the shore.", "max_tokens": 20, "ignore_eos": True}
    headers = {"X-Request-Id": "shared-id-1"}
    # No worker yet: the request that got the id waits in the queue, so the other one
    # meets it in flight however the two race.
    posts = [asyncio.create_task(gw.post("/v1/completions", json=body, headers=headers)) for gw in (gw_a, gw_b)]
    done, waiting = await asyncio.wait(posts, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1, "no request was refused"
    refused = done.pop().result()
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "duplicate_request"
    worker = stack.add_worker("w1")
    served = await asyncio.wait_for(waiting.pop(), 30)
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 20
    ((request_id, _),) = worker.backend.added  # ran once
    assert request_id.startswith("cmpl-shared-id-1#")
