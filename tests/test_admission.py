"""Admission inside the enqueue script on a real Redis: exact under concurrent requests,
nothing written when refused, one round trip for a lone request, and the group commit."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission import Enqueuer
from gateway.errors import OpenAIError
from shared.fair_queue import FairQueue
from shared.keys import STREAM_FIELD, Keys

STREAM = Keys().requests_stream("m")


def _queue(client) -> FairQueue:
    return FairQueue(client, Keys(), "m")


async def _status(call) -> int:
    try:
        await call
    except OpenAIError as exc:
        return exc.status
    return 200


async def test_concurrent_admissions_are_exact(client) -> None:
    enqueuer = Enqueuer(_queue(client), max_queue_len=11)
    await client.xadd(STREAM, {STREAM_FIELD: b"queued"})  # one request already waiting
    statuses = await asyncio.gather(*(_status(enqueuer.enqueue(STREAM, [_request(i)])) for i in range(20)))
    # Ten lone requests fit beside the one waiting; the check and the XADD are one step,
    # so none overshoots however many arrive at once.
    assert statuses.count(200) == 10 and statuses.count(429) == 10
    assert await client.xlen(STREAM) == 11


async def test_every_child_counts_and_a_refusal_writes_nothing(client) -> None:
    queue = _queue(client)
    enqueuer = Enqueuer(queue, max_queue_len=4)
    await client.xadd(STREAM, {STREAM_FIELD: b"queued"})
    keys_before = sorted(await client.keys("*"))
    with pytest.raises(OpenAIError) as info:  # 1 waiting + 4 children > 4: no id key, no entry, no doorbell
        await enqueuer.enqueue(STREAM, [_request(i) for i in range(4)], request_id_key="inferq:rid:x", wire_id="x")
    assert info.value.status == 429 and info.value.headers == {"Retry-After": "1"}
    assert sorted(await client.keys("*")) == keys_before and await client.xlen(STREAM) == 1
    assert len((await enqueuer.enqueue(STREAM, [_request(i) for i in range(3)], request_id_key="inferq:rid:x",
                                       wire_id="x")).entry_ids) == 3


async def _calls(client, before: dict) -> dict[str, int]:
    """EVALSHA and SCRIPT calls since ``before`` (Redis < 7 counts every SCRIPT subcommand
    under ``cmdstat_script``, Redis 7 under ``cmdstat_script|<subcommand>``)."""
    after = await client.info("commandstats")
    delta = {name: int(after[name].get("calls", 0)) - int(before.get(name, {}).get("calls", 0))
             for name in after if name == "cmdstat_evalsha" or name.startswith("cmdstat_script")}
    return {"evalsha": delta.get("cmdstat_evalsha", 0),
            "script": sum(v for k, v in delta.items() if k.startswith("cmdstat_script"))}


async def test_requests_are_one_script_call_each_and_no_script_check(client) -> None:
    """No ``SCRIPT EXISTS`` before a batch, as redis-py sends before a pipeline that runs a
    registered script (a second round trip), for a lone request or a group commit."""
    enqueuer = Enqueuer(_queue(client), max_queue_len=100)
    await enqueuer.enqueue(STREAM, [_request(0)])  # loads the script
    before = await client.info("commandstats")
    await enqueuer.enqueue(STREAM, [_request(1)])
    assert await _calls(client, before) == {"evalsha": 1, "script": 0}
    before = await client.info("commandstats")
    await asyncio.gather(*(enqueuer.enqueue(STREAM, [_request(i)]) for i in range(2, 52)))
    assert await _calls(client, before) == {"evalsha": 50, "script": 0}


async def test_a_batch_survives_a_flushed_script_cache(client) -> None:
    """Redis restarted or ``SCRIPT FLUSH``: the batch's NOSCRIPT replies wrote nothing, so the
    requests go again once, after one ``SCRIPT LOAD``; each lands exactly once."""
    enqueuer = Enqueuer(_queue(client), max_queue_len=100)
    await enqueuer.enqueue(STREAM, [_request(0)])
    await client.script_flush()
    before = await client.info("commandstats")
    entry_ids = await asyncio.gather(*(enqueuer.enqueue(STREAM, [_request(i)]) for i in range(1, 11)))
    assert len({e.entry_ids[0] for e in entry_ids}) == 10 and await client.xlen(STREAM) == 11
    assert (await _calls(client, before))["script"] == 1  # the one SCRIPT LOAD


async def test_redis_down_is_503_for_every_request(redis_server) -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_server.url)
    enqueuer = Enqueuer(_queue(client), max_queue_len=10)
    redis_server.close()
    try:
        results = await asyncio.gather(*(enqueuer.enqueue(STREAM, [_request(i)]) for i in range(3)),
                                       return_exceptions=True)
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

    enqueuer = Enqueuer(_queue(client), max_queue_len=1000)
    entry_ids = await asyncio.gather(*(enqueuer.enqueue(STREAM, [_request(i)]) for i in range(200)))
    # Each caller got the id of its own entry...
    entries = dict(await client.xrange(STREAM))
    assert len(entries) == 200 and all(len(e.entry_ids) == 1 for e in entry_ids)
    assert [protocol.decode(entries[e.entry_ids[0]][STREAM_FIELD]).request_id for e in entry_ids] == \
        [f"r{i}" for i in range(200)]
    # ...and the 200 XADDs went out over a connection or two, not one each.
    assert len(client.connection_pool._available_connections) + len(client.connection_pool._in_use_connections) <= 2


async def test_a_refused_batch_fails_every_request_and_writes_nothing(client) -> None:
    from gateway.admission import Enqueuer

    enqueuer = Enqueuer(_queue(client), max_queue_len=1000)
    await client.config_set("maxmemory-policy", "noeviction")
    await client.config_set("maxmemory", "1")
    try:
        results = await asyncio.gather(*(enqueuer.enqueue(STREAM, [_request(i)]) for i in range(5)), return_exceptions=True)
    finally:
        await client.config_set("maxmemory", "0")
    assert [getattr(r, "status", r) for r in results] == [503] * 5
    assert await client.xlen(STREAM) == 0
    assert await enqueuer.enqueue(STREAM, [_request(9)])  # the writer goes on after a refused batch
