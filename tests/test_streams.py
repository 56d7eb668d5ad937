"""``shared.streams`` against a real redis-server: pending entries, finishing an entry
(XACK + XDEL, optionally after an error PUBLISH, NOGROUP tolerated), and the worker's
paths that finish entries, driven end to end with the sim backend: tokens to the end,
504 for an expired entry, 500 for every held request when an engine step raises."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from shared import protocol
from shared.keys import CONSUMER_GROUP, STREAM_FIELD, Keys
from shared.protocol import ErrorMessage, GenerateRequest, ReplyMessage, TokenBatch, TokenOutput
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from shared.streams import QueueDepth, finish_entry, pending_entries, queue_depth, read_depth
from worker.backends.sim import SimBackend
from worker.service import Worker

pytestmark = pytest.mark.timeout(60)

KEYS = Keys("ts")
STREAM = KEYS.requests_stream("m")
CHANNEL = KEYS.gateway_channel("g1")


async def _delivered(client: aioredis.Redis, num_entries: int, consumer: str = "w1") -> list[bytes]:
    await client.xgroup_create(STREAM, CONSUMER_GROUP, id="0", mkstream=True)
    for i in range(num_entries):
        await client.xadd(STREAM, {STREAM_FIELD: b"x%d" % i})
    reply = await client.xreadgroup(CONSUMER_GROUP, consumer, {STREAM: ">"}, count=num_entries)
    return [entry_id for entry_id, _ in reply[0][1]]


async def _next_message(pubsub: aioredis.client.PubSub, timeout_s: float = 10.0) -> ReplyMessage:
    """The next published payload, decoded (subscribe confirmations skipped)."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        item = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
        if item is not None:
            message = protocol.decode(item["data"])
            assert isinstance(message, (TokenBatch, ErrorMessage))
            return message
    raise AssertionError("nothing published in time")


async def test_pending_entries_name_consumer_and_deliveries(client: aioredis.Redis) -> None:
    first, second = await _delivered(client, 2)
    await client.xclaim(STREAM, CONSUMER_GROUP, "w2", 0, [first])
    entries = await pending_entries(client, STREAM, 10)
    assert [(e.entry_id, e.consumer, e.num_deliveries, e.redelivered) for e in entries] == [
        (first.decode(), "w2", 2, True), (second.decode(), "w1", 1, False)]


async def test_finish_entry_publishes_the_error_then_acks_and_deletes(client: aioredis.Redis) -> None:
    first, _ = await _delivered(client, 2)
    await client.xadd(STREAM, {STREAM_FIELD: b"waiting"})
    assert await read_depth(client, STREAM) == QueueDepth(length=3, num_pending=2, has_group=True)
    pubsub = client.pubsub()
    await pubsub.subscribe(CHANNEL)
    error = ErrorMessage(request_id="r1", attempt=0, worker_id="w1", status=504, message="late")
    await finish_entry(client, STREAM, first, error=error, reply_channel=CHANNEL)
    message = await _next_message(pubsub)
    await pubsub.aclose()
    assert message == error
    depth = await read_depth(client, STREAM)
    assert (depth.length, depth.num_pending, depth.num_waiting) == (2, 1, 1)  # gone from both
    assert await client.xrange(STREAM, first, first) == []


async def test_finish_entry_without_the_group_still_deletes(client: aioredis.Redis) -> None:
    (entry_id,) = await _delivered(client, 1)
    await client.xgroup_destroy(STREAM, CONSUMER_GROUP)  # as after a Redis restart lost it
    await finish_entry(client, STREAM, entry_id)  # XACK finds no group: acks nothing, no error
    assert await client.xlen(STREAM) == 0
    assert await queue_depth(client, STREAM) == 0
    with pytest.raises(ValueError, match="reply_channel"):
        await finish_entry(client, STREAM, entry_id, error=ErrorMessage(
            request_id="r", attempt=0, worker_id="w", status=500, message="x"))


class FailingSim(SimBackend):
    """The sim backend whose next ``num_failures`` steps raise, as a broken engine would."""

    num_failures = 0

    def step(self):
        if self.num_failures:
            self.num_failures -= 1
            raise RuntimeError("boom")
        return super().step()


def _request(request_id: str, max_tokens: int, deadline_s: float = 60.0) -> bytes:
    return protocol.encode(GenerateRequest(
        request_id=request_id, model="m", prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=max_tokens),
        reply_channel=CHANNEL, deadline_unix_s=time.time() + deadline_s))


async def _replies(pubsub: aioredis.client.PubSub, request_ids: set[str]
                   ) -> dict[str, list[TokenOutput | ErrorMessage]]:
    """Every reply (a token batch's entries, one by one) until each of ``request_ids`` got
    its last one (an error or a finish)."""
    out: dict[str, list[TokenOutput | ErrorMessage]] = {r: [] for r in request_ids}
    open_ids = set(request_ids)
    while open_ids:
        message = await _next_message(pubsub)
        for reply in message.outputs if isinstance(message, TokenBatch) else [message]:
            out[reply.request_id].append(reply)
            if isinstance(reply, ErrorMessage) or reply.finish_reason is not None:
                open_ids.discard(reply.request_id)
    return out


async def test_worker_finishes_every_entry_on_tokens_504_and_engine_error(client: aioredis.Redis) -> None:
    backend = FailingSim(ModelSettings(max_model_len=64), EngineSettings(max_num_seqs=4), step_time_ms=1.0)
    backend.num_failures = 1
    worker = Worker(client, KEYS, "m", "w1", backend, drain_timeout_s=5.0)
    pubsub = client.pubsub()
    await pubsub.subscribe(CHANNEL)
    for request_id in ("a", "b"):  # queued before the worker starts: both in its first step
        await client.xadd(STREAM, {STREAM_FIELD: _request(request_id, 50)})
    running = asyncio.create_task(worker.run())
    try:
        failed = await _replies(pubsub, {"a", "b"})
        for request_id in ("a", "b"):
            (error,) = failed[request_id]
            assert isinstance(error, ErrorMessage)
            assert (error.status, error.message) == (500, "engine error: RuntimeError: boom")
        await client.xadd(STREAM, {STREAM_FIELD: _request("late", 5, deadline_s=-1.0)})
        await client.xadd(STREAM, {STREAM_FIELD: _request("c", 3)})
        await client.xadd(STREAM, {STREAM_FIELD: _request("d", 4)})
        later = await _replies(pubsub, {"late", "c", "d"})
        (late,) = later["late"]
        assert isinstance(late, ErrorMessage) and late.status == 504
        for request_id, num_tokens in (("c", 3), ("d", 4)):
            tokens = later[request_id]
            assert all(isinstance(m, TokenOutput) for m in tokens)
            assert [t for m in tokens for t in m.token_ids] == [5, 6, 7, 5][:num_tokens]
            assert tokens[-1].finish_reason == "length"
        for _ in range(100):  # the last publish (with its XACK + XDEL) runs after the step
            if not worker.inflight:
                break
            await asyncio.sleep(0.02)
        assert worker.inflight == {}
        depth = await read_depth(client, STREAM)
        assert (depth.length, depth.num_pending) == (0, 0)  # every entry acked and deleted
    finally:
        worker.drain()
        await asyncio.wait_for(running, 10.0)
        worker.engine_thread.close()
        await pubsub.aclose()
