"""Admission's queue-depth check on a real Redis: one read shared by concurrent
admissions, each other's children counted, never a stale figure for a later request."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission import QueueDepthReader, check_queue
from gateway.errors import OpenAIError
from shared.fair_queue import FairQueue
from shared.keys import STREAM_FIELD, Keys

STREAM = "inferq:m:requests"


def _queue(client) -> FairQueue:
    return FairQueue(client, Keys(), "m")


async def num_xlen_calls(client) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_xlen", {}).get("calls", 0))


async def test_concurrent_admissions_share_one_read_and_count_each_other(client) -> None:
    reader = QueueDepthReader(_queue(client))
    await client.xadd(STREAM, {STREAM_FIELD: b"queued"})  # one request already waiting
    before = await num_xlen_calls(client)

    async def admit() -> int:
        try:
            await check_queue(reader, max_queue_len=11, num_new=2)
        except OpenAIError as exc:
            return exc.status
        return 200

    statuses = await asyncio.gather(*(admit() for _ in range(20)))
    # One read served all twenty; with 1 waiting, five admissions of 2 fit under 11.
    assert await num_xlen_calls(client) - before == 1
    assert statuses.count(200) == 5 and statuses.count(429) == 15


async def test_a_later_admission_reads_again(client) -> None:
    reader = QueueDepthReader(_queue(client))
    await check_queue(reader, max_queue_len=4)
    for _ in range(4):
        await client.xadd(STREAM, {STREAM_FIELD: b"queued"})
    with pytest.raises(OpenAIError) as info:  # the finished read (depth 0, 1 admitted) is not reused
        await check_queue(reader, max_queue_len=4)
    assert info.value.status == 429


async def test_redis_down_is_503_for_every_sharer(redis_server) -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_server.url)
    reader = QueueDepthReader(_queue(client))
    redis_server.close()
    try:
        results = await asyncio.gather(*(check_queue(reader, 10) for _ in range(3)), return_exceptions=True)
        assert [getattr(r, "status", r) for r in results] == [503, 503, 503]
    finally:
        await client.aclose()


def _request(i: int):
    from shared.protocol import GenerateRequest
    from shared.sampling import SamplingParams

    return GenerateRequest(request_id=f"r{i}", model="m", prompt_token_ids=[1, 2, i], sampling=SamplingParams(),
                           reply_channel="inferq:gateway:g", deadline_unix_s=1e10)


async def test_concurrent_lone_requests_are_group_committed(client) -> None:
    from gateway.admission import Enqueuer
    from shared import protocol

    enqueuer = Enqueuer(_queue(client))
    entry_ids = await asyncio.gather(*(enqueuer.enqueue(STREAM, [_request(i)]) for i in range(200)))
    # Each caller got the id of its own entry...
    entries = dict(await client.xrange(STREAM))
    assert len(entries) == 200 and all(len(ids) == 1 for ids in entry_ids)
    assert [protocol.decode(entries[ids[0]][STREAM_FIELD]).request_id for ids in entry_ids] == \
        [f"r{i}" for i in range(200)]
    # ...and the 200 XADDs went out over a connection or two, not one each.
    assert len(client.connection_pool._available_connections) + len(client.connection_pool._in_use_connections) <= 2


async def test_a_refused_batch_fails_every_request_and_writes_nothing(client) -> None:
    from gateway.admission import Enqueuer

    enqueuer = Enqueuer(_queue(client))
    await client.config_set("maxmemory-policy", "noeviction")
    await client.config_set("maxmemory", "1")
    try:
        results = await asyncio.gather(*(enqueuer.enqueue(STREAM, [_request(i)]) for i in range(5)), return_exceptions=True)
    finally:
        await client.config_set("maxmemory", "0")
    assert [getattr(r, "status", r) for r in results] == [503] * 5
    assert await client.xlen(STREAM) == 0
    assert await enqueuer.enqueue(STREAM, [_request(9)])  # the writer goes on after a refused batch
