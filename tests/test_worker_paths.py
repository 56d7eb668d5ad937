"""The worker's Redis adapter (``worker/service.py``) on its less travelled paths, in
process against a real redis-server with the sim backend (its output echoes the prompt,
so lost or repeated tokens show): the drain (no pulling once draining, hand-back after
``drain_timeout_s``), a newer attempt replacing the running one, stream entries that do
not decode, removal of dead consumers, and the publish backlog after a Redis error (also
when a newer attempt replaces the run it holds outputs of).

An engine step that raises is tested in tests/test_streams.py (sim backend) and
tests/test_kv_pressure.py (the real engine)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from shared import protocol
from shared.keys import CONSUMER_GROUP, STREAM_FIELD, Keys
from shared.protocol import AbortMessage, ErrorMessage, GenerateRequest, TokenBatch, TokenOutput, WorkerStatus
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from shared.streams import as_text, read_depth
from worker import service
from worker.backends.sim import SimBackend
from worker.service import Worker

pytestmark = pytest.mark.timeout(60)

KEYS = Keys("twp")
MODEL = "m"
STREAM = KEYS.requests_stream(MODEL)
CHANNEL = KEYS.gateway_channel("g1")
PROMPT = [5, 6, 7]
#: One request's part of a reply: its entry of a ``TokenBatch``, or its ``ErrorMessage``.
Reply = TokenOutput | ErrorMessage


class RecordingSim(SimBackend):
    """The sim backend, recording the ids it was told to abort."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return super().abort(request_id)


def echo(start: int, stop: int) -> list[int]:
    """The sim's output tokens ``start .. stop - 1`` for ``PROMPT``."""
    return [PROMPT[i % len(PROMPT)] for i in range(start, stop)]


def make_worker(client: Any, *, step_time_ms: float = 1.0, drain_timeout_s: float = 5.0) -> Worker:
    backend = RecordingSim(ModelSettings(max_model_len=100_000), EngineSettings(max_num_seqs=4),
                           step_time_ms=step_time_ms)
    return Worker(client, KEYS, MODEL, "w1", backend, drain_timeout_s=drain_timeout_s)


def entry(request_id: str, max_tokens: int, *, attempt: int = 0, output_token_ids: list[int] | None = None
          ) -> dict[bytes, bytes]:
    request = GenerateRequest(request_id=request_id, model=MODEL, prompt_token_ids=PROMPT,
                              sampling=SamplingParams(max_tokens=max_tokens), reply_channel=CHANNEL,
                              deadline_unix_s=time.time() + 60, attempt=attempt,
                              output_token_ids=output_token_ids or [])
    return {STREAM_FIELD: protocol.encode(request)}


@pytest.fixture()
async def replies(client: aioredis.Redis) -> AsyncIterator[aioredis.client.PubSub]:
    """A subscription to the reply channel, made before any request is queued."""
    pubsub = client.pubsub()
    await pubsub.subscribe(CHANNEL)
    try:
        yield pubsub
    finally:
        await pubsub.aclose()


@asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[asyncio.Task[None]]:
    """``worker.run()`` as a task, cancelled (as SIGINT does) on exit."""
    task = asyncio.create_task(worker.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        worker.engine_thread.close()


def split_reply(payload: bytes) -> list[Reply]:
    """A published payload as per-request replies, in order (a ``TokenBatch`` holds one
    entry per request, or several after a publish that failed)."""
    message = protocol.decode(payload)
    if isinstance(message, TokenBatch):
        return list(message.outputs)
    assert isinstance(message, ErrorMessage), message
    return [message]


def is_last(reply: Reply) -> bool:
    return isinstance(reply, ErrorMessage) or reply.finish_reason is not None


async def next_replies(pubsub: aioredis.client.PubSub, timeout_s: float = 10.0) -> list[Reply]:
    """The replies of the next published payload."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        item = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
        if item is not None:
            return split_reply(item["data"])
    raise AssertionError("nothing published in time")


async def replies_until_finished(pubsub: aioredis.client.PubSub, request_ids: set[str]) -> dict[str, list[Reply]]:
    """Every reply until each of ``request_ids`` got its last one (an error or a finish)."""
    out: dict[str, list[Reply]] = {r: [] for r in request_ids}
    open_ids = set(request_ids)
    while open_ids:
        for reply in await next_replies(pubsub):
            out.setdefault(reply.request_id, []).append(reply)
            if is_last(reply):
                open_ids.discard(reply.request_id)
    return out


async def serve_one(client: aioredis.Redis, backend: Any, namespace: str, request_id: str, prompt: list[int],
                    params: SamplingParams, timeout_s: float = 60.0) -> list[Reply]:
    """Queue one request on ``namespace``'s stream, run a worker over ``backend`` until it
    finished, and return its replies in order (what its gateway would have received)."""
    keys = Keys(namespace)
    channel = keys.gateway_channel("g1")
    pubsub = client.pubsub()
    await pubsub.subscribe(channel)
    try:
        request = GenerateRequest(request_id=request_id, model="m", prompt_token_ids=prompt, sampling=params,
                                  reply_channel=channel, deadline_unix_s=time.time() + timeout_s)
        await client.xadd(keys.requests_stream("m"), {STREAM_FIELD: protocol.encode(request)})
        async with running(Worker(client, keys, "m", "w1", backend)):
            replies = await asyncio.wait_for(replies_until_finished(pubsub, {request_id}), timeout_s)
    finally:
        await pubsub.aclose()
    return replies[request_id]


def assert_contiguous(messages: list[Reply], first_index: int, num_tokens: int) -> None:
    """Token outputs numbered without gap or overlap from ``first_index``, echoing the
    prompt, the last one finishing with ``length`` after ``num_tokens`` tokens."""
    assert all(isinstance(m, TokenOutput) for m in messages), messages
    index = first_index
    for m in messages:
        assert m.first_index == index, [(m.first_index, m.token_ids) for m in messages]
        index += len(m.token_ids)
    assert [t for m in messages for t in m.token_ids] == echo(first_index, first_index + num_tokens)
    assert [m.finish_reason for m in messages] == [None] * (len(messages) - 1) + ["length"]


async def wait_until(predicate: Callable[[], Any], timeout_s: float = 10.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline_s, "condition not met in time"
        await asyncio.sleep(0.02)


async def stream_empty(client: aioredis.Redis) -> bool:
    depth = await read_depth(client, STREAM)
    return (depth.length, depth.num_pending) == (0, 0)


# -- drain ---------------------------------------------------------------------------------

async def test_drain_pulls_nothing_and_hands_back_after_the_timeout(client, replies) -> None:
    drain_timeout_s = 1.0
    worker = make_worker(client, step_time_ms=20.0, drain_timeout_s=drain_timeout_s)
    async with running(worker) as task:
        long_id = await client.xadd(STREAM, entry("long", 50_000))  # ~17 min of 20 ms steps
        assert all(isinstance(r, TokenOutput) for r in await next_replies(replies))
        assert await client.get(KEYS.worker_key("w1")) is not None
        worker.drain()
        drained_s = time.monotonic()
        new_id = await client.xadd(STREAM, entry("new", 3))
        num_before = worker.num_steps
        while worker.num_steps < num_before + 10:  # ten turns of the loop while draining
            assert not task.done()
            await asyncio.sleep(0.02)
        pending = await client.xpending_range(STREAM, CONSUMER_GROUP, min="-", max="+", count=10)
        assert [(p["message_id"], as_text(p["consumer"])) for p in pending] == [(long_id, "w1")]
        await asyncio.wait_for(task, drain_timeout_s + 10)  # returns by itself: handed back
        assert time.monotonic() - drained_s >= drain_timeout_s  # it held "long" until the timeout
    # The held request stays pending on w1 for a gateway to re-enqueue (its heartbeat is
    # gone); the new one was never delivered, so another worker can take it.
    pending = await client.xpending_range(STREAM, CONSUMER_GROUP, min="-", max="+", count=10)
    assert [(p["message_id"], as_text(p["consumer"])) for p in pending] == [(long_id, "w1")]
    assert [entry_id for entry_id, _ in await client.xrange(STREAM)] == [long_id, new_id]
    depth = await read_depth(client, STREAM)
    assert (depth.length, depth.num_pending, depth.num_waiting) == (2, 1, 1)
    assert await client.get(KEYS.worker_key("w1")) is None
    assert "long" not in worker.backend.aborted  # handed back, not aborted


# -- a newer attempt -----------------------------------------------------------------------

async def test_newer_attempt_replaces_the_running_one(client, replies) -> None:
    worker = make_worker(client, step_time_ms=10.0)
    max_tokens = 100  # 1 s of steps: attempt 0 still runs when attempt 1 arrives
    async with running(worker):
        old_id = await client.xadd(STREAM, entry("r", max_tokens))
        delivered: list[int] = []
        while len(delivered) < 3:
            for reply in await next_replies(replies):
                assert isinstance(reply, TokenOutput) and reply.attempt == 0
                assert reply.first_index == len(delivered)
                delivered += reply.token_ids
        # What a gateway's failover enqueues when it takes w1 for dead: attempt 1, resuming
        # after the tokens its client has.
        await client.xadd(STREAM, entry("r", max_tokens, attempt=1, output_token_ids=delivered))
        messages: list[Reply] = []
        while not messages or not is_last(messages[-1]):
            for reply in await next_replies(replies):
                if messages or reply.attempt == 1:
                    messages.append(reply)
                    if len(messages) == 1:
                        # A stale redelivery of the replaced attempt is acked and dropped.
                        stale_id = await client.xadd(STREAM, entry("r", max_tokens))
        await wait_until(lambda: stream_empty(client))
    assert all(m.attempt == 1 for m in messages), messages  # nothing more of attempt 0
    assert_contiguous(messages, len(delivered), max_tokens - len(delivered))
    assert worker.backend.aborted == ["r"]  # the old one, once; the new one ran to its end
    assert await client.xrange(STREAM, old_id, old_id) == []
    assert await client.xrange(STREAM, stale_id, stale_id) == []
    assert worker.inflight == {}


# -- entries that are not requests ---------------------------------------------------------

async def test_undecodable_entries_are_acked_and_dropped(client, replies) -> None:
    bad = [{STREAM_FIELD: b"\xc1 not msgpack"},
           {b"other-field": b"x"},
           {STREAM_FIELD: protocol.encode(AbortMessage(request_ids=["x"]))},
           {STREAM_FIELD: protocol.encode(GenerateRequest(
               request_id="v9", model=MODEL, prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=2),
               reply_channel=CHANNEL, deadline_unix_s=time.time() + 60, v=9))}]
    for fields in bad:
        await client.xadd(STREAM, fields)
    await client.xadd(STREAM, entry("ok", 4))
    worker = make_worker(client)
    async with running(worker):
        out = await replies_until_finished(replies, {"ok"})
        await wait_until(lambda: stream_empty(client))
    assert set(out) == {"ok"}  # no reply to anything else, no error
    assert_contiguous(out["ok"], 0, 4)
    assert worker.backend.aborted == []


# -- dead consumers --------------------------------------------------------------------------

def heartbeat(worker_id: str) -> bytes:
    now = time.time()
    return protocol.encode(WorkerStatus(
        worker_id=worker_id, model=MODEL, backend="sim", num_running=0, num_waiting=0, kv_usage=0.0,
        num_free_blocks=8, block_size=16, max_num_seqs=4, updated_unix_s=now, started_unix_s=now, pid=1))


async def consumers(client: aioredis.Redis) -> dict[str, int]:
    """Consumer name -> its pending entries."""
    return {as_text(c["name"]): int(c["pending"]) for c in await client.xinfo_consumers(STREAM, CONSUMER_GROUP)}


async def test_reap_removes_only_idle_dead_consumers_with_nothing_pending(client, monkeypatch) -> None:
    await client.xgroup_create(STREAM, CONSUMER_GROUP, id="0", mkstream=True)
    for name in ("ghost", "alive", "w1"):
        await client.xgroup_createconsumer(STREAM, CONSUMER_GROUP, name)
    await client.set(KEYS.worker_key("alive"), heartbeat("alive"), ex=60)
    await client.xadd(STREAM, entry("held", 4))
    assert await client.xreadgroup(CONSUMER_GROUP, "holder", {STREAM: ">"}, count=1)  # dead, holds one
    worker = make_worker(client)  # not running: reap() is called directly, as the loop does
    before = {"ghost": 0, "alive": 0, "w1": 0, "holder": 1}
    assert await worker.reap() == 0
    assert await consumers(client) == before  # nobody idle for DEAD_CONSUMER_IDLE_MS (60 s) yet
    # Every consumer is now idle longer than the limit; only the dead one with nothing
    # pending goes ("holder"'s entry, idle < REAP_MIN_IDLE_MS, is left for failover).
    monkeypatch.setattr(service, "DEAD_CONSUMER_IDLE_MS", 1)
    await asyncio.sleep(0.05)
    assert await worker.reap() == 0
    assert await consumers(client) == {"alive": 0, "w1": 0, "holder": 1}
    assert worker.inflight == {} and worker.num_reclaimed == 0
    worker.engine_thread.close()


# -- the publish backlog ---------------------------------------------------------------------

class FlakyPipelines:
    """A Redis client whose pipelines fail on demand, as a dropped connection makes them
    fail: ``execute`` raises ``ConnectionError`` before anything is sent. Everything
    else goes to the real client."""

    def __init__(self, client: aioredis.Redis, fail: Callable[[int, list[str]], bool]) -> None:
        self._client = client
        self._fail = fail  # (pipeline number from 0, its command names) -> fail it?
        self.num_pipelines = 0
        self.failed: list[list[str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = self._client.pipeline(*args, **kwargs)
        number = self.num_pipelines
        self.num_pipelines += 1
        execute = pipe.execute

        async def flaky_execute(*a: Any, **kw: Any) -> Any:
            commands = [str(cmd_args[0]).upper() for cmd_args, _ in pipe.command_stack]
            if self._fail(number, commands):
                self.failed.append(commands)
                raise redis.exceptions.ConnectionError("injected: connection lost")
            return await execute(*a, **kw)

        pipe.execute = flaky_execute
        return pipe


async def test_failed_publishes_go_out_with_the_next_one(client, replies) -> None:
    failed_xack = []

    def fail(number: int, commands: list[str]) -> bool:
        if number == 2:  # a publish mid-generation
            return True
        if "XACK" in commands and not failed_xack:  # the first publish that finishes a request
            failed_xack.append(number)
            return True
        return False

    flaky = FlakyPipelines(client, fail)
    worker = make_worker(flaky, step_time_ms=5.0)
    await client.xadd(STREAM, entry("a", 12))
    await client.xadd(STREAM, entry("b", 6))
    async with running(worker):
        out = await replies_until_finished(replies, {"a", "b"})
        await wait_until(lambda: stream_empty(client))
    assert len(flaky.failed) == 2 and all("PUBLISH" in commands for commands in flaky.failed)
    assert_contiguous(out["a"], 0, 12)  # every token once, in order
    assert_contiguous(out["b"], 0, 6)
    assert worker.inflight == {}


async def test_held_back_outputs_of_a_replaced_attempt_are_not_sent_as_the_new_one(client, replies) -> None:
    blackout = [False]
    flaky = FlakyPipelines(client, lambda number, commands: blackout[0] and "PUBLISH" in commands)
    worker = make_worker(flaky, step_time_ms=10.0)
    max_tokens = 100
    async with running(worker):
        await client.xadd(STREAM, entry("r", max_tokens))
        delivered: list[int] = []
        while len(delivered) < 3:
            for reply in await next_replies(replies):
                delivered += reply.token_ids
        blackout[0] = True  # attempt 0's next outputs pile up in the worker's backlog
        await wait_until(lambda: _true(len(flaky.failed) >= 2))
        assert any(out.request_id == "r" for out in worker._backlog)
        await client.xadd(STREAM, entry("r", max_tokens, attempt=1, output_token_ids=delivered))
        await wait_until(lambda: _true(worker.backend.aborted == ["r"]))
        blackout[0] = False
        messages: list[Reply] = []
        while not messages or not is_last(messages[-1]):
            messages += await next_replies(replies)
        await wait_until(lambda: stream_empty(client))
    assert all(m.attempt == 1 for m in messages), messages
    assert_contiguous(messages, len(delivered), max_tokens - len(delivered))


async def _true(value: bool) -> bool:
    """``value``, as the awaitable predicate ``wait_until`` takes."""
    return value


async def test_the_worker_freezes_its_startup_heap_before_it_serves(redis_server, smollm_source, monkeypatch) -> None:
    """``serve_worker`` moves the startup heap (the backend, its model, the imported modules)
    out of the collector's reach before the worker loop runs (``shared/gc_heap.py``)."""
    import gc

    from shared.settings import RedisSettings, WorkerSettings
    from worker import main as worker_main

    frozen_at_run: list[int] = []

    async def record(self: Worker) -> None:
        frozen_at_run.append(gc.get_freeze_count())

    monkeypatch.setattr(Worker, "run", record)
    gc.unfreeze()
    try:
        await worker_main.serve_worker(WorkerSettings(backend="sim"), RedisSettings(redis_url=redis_server.url),
                                       ModelSettings(), EngineSettings())
    finally:
        gc.unfreeze()  # this test process's heap goes back to the collector
    assert frozen_at_run and frozen_at_run[0] > 1000  # the imported modules at least
