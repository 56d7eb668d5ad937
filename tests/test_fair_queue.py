"""The fair queue (shared/fair_queue.py) on a real Redis: class order, fair share between
tenants, concurrent pulls, the doorbell, a dead worker's entries in a class stream reaped
and served by a sim worker, and the per-class snapshot (shared/queues.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis

from shared import protocol
from shared.fair_queue import JOIN_OFFSET, FairQueue, QueueFull, entry_cost
from shared.keys import CONSUMER_GROUP, STREAM_FIELD, Keys
from shared.protocol import ErrorMessage, GenerateRequest, TokenBatch
from shared.queues import snapshot
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from shared.streams import as_text
from worker import service
from worker.backends.sim import SimBackend
from worker.service import Worker

pytestmark = pytest.mark.timeout(60)

MODEL = "m"


def _keys() -> Keys:
    return Keys(f"tf{uuid.uuid4().hex[:8]}")


def _request(request_id: str, priority: int = 1, max_tokens: int = 4, channel: str = "") -> GenerateRequest:
    return GenerateRequest(request_id=request_id, model=MODEL, prompt_token_ids=[5, 6, 7],
                           sampling=SamplingParams(max_tokens=max_tokens), reply_channel=channel or "tf:gateway:g",
                           deadline_unix_s=time.time() + 60, priority=priority)


async def _put(queue: FairQueue, priority_class: str, tenant: str, request: GenerateRequest) -> bytes:
    ids = await queue.enqueue(queue.stream(priority_class, tenant), [request])
    assert ids is not None
    return ids[0]


def _ids(pulled: list[tuple[str, bytes, dict[bytes, bytes]]]) -> list[str]:
    return [protocol.decode(fields[STREAM_FIELD]).request_id for _, _, fields in pulled]


async def test_the_highest_class_is_pulled_first(client: aioredis.Redis) -> None:
    queue = FairQueue(client, _keys(), MODEL)
    for i in range(5):  # batch work queued first...
        await _put(queue, "batch", "t", _request(f"b{i}", priority=2))
    await _put(queue, "default", "anonymous", _request("d"))
    await _put(queue, "interactive", "t", _request("i", priority=0))  # ...interactive last
    assert _ids(await queue.pull("w1", 1)) == ["i"]
    assert _ids(await queue.pull("w1", 3)) == ["d", "b0", "b1"]
    assert _ids(await queue.pull("w1", 10)) == ["b2", "b3", "b4"]
    assert await queue.pull("w1", 10) == []


async def test_a_full_engine_still_takes_a_higher_class(client: aioredis.Redis) -> None:
    queue = FairQueue(client, _keys(), MODEL)
    for i in range(3):
        await _put(queue, "batch", "t", _request(f"b{i}", priority=2))
    await _put(queue, "interactive", "t", _request("i", priority=0))
    # Per class rank, what the engine admits (num_admittable(rank)): full of default work,
    # it has room only for interactive work, which it would preempt for.
    assert _ids(await queue.pull("w1", [2, 0, 0])) == ["i"]
    assert await queue.pull("w1", [2, 0, 0]) == []
    assert _ids(await queue.pull("w1", [0, 0, 2])) == ["b0", "b1"]


async def test_a_flooding_tenant_does_not_starve_another(client: aioredis.Redis) -> None:
    queue = FairQueue(client, _keys(), MODEL)
    for i in range(200):
        await _put(queue, "default", "A", _request(f"a{i}"))
    for _ in range(10):  # A is served a while alone: its counter grows
        await queue.pull("w1", 1)
    # B's stream name sorts after A's ("zB" > "A"): a tie at A's counter would go to A.
    await _put(queue, "default", "zB", _request("b"))
    # B joins just below A's counter (VTC's lift less JOIN_OFFSET), so it is next.
    assert _ids(await queue.pull("w1", 1)) == ["b"]
    # A's others all come after, each pulled once.
    rest = _ids(await queue.pull("w1", 500))
    assert len(rest) == 190 and all(r.startswith("a") for r in rest)
    assert entry_cost(_request("x")) == 3 + 2 * 4


async def test_joiners_go_before_the_smallest_counter_but_never_before_each_other(
        client: aioredis.Redis) -> None:
    queue = FairQueue(client, _keys(), MODEL)
    for i in range(5):
        await _put(queue, "default", "A", _request(f"a{i}"))
    await queue.pull("w1", 1)  # A's counter: one request's cost
    cost = entry_cost(_request("x"))
    # C joins, then B (whose name sorts first) joins at C's counter, not below it.
    await _put(queue, "default", "C", _request("c"))
    await _put(queue, "default", "B", _request("b"))
    active = queue.active_set("default")
    scores = {as_text(m): s for m, s in await client.zrange(active, 0, -1, withscores=True)}
    assert scores[queue.stream("default", "C")] == scores[queue.stream("default", "B")] == cost - JOIN_OFFSET
    assert scores[queue.stream("default", "A")] == cost
    # Both joiners come before A; between them the stream name decides.
    assert _ids(await queue.pull("w1", 3)) == ["b", "c", "a1"]


async def test_two_workers_pulling_at_once_never_get_the_same_entry(client: aioredis.Redis,
                                                                     redis_server) -> None:
    keys = _keys()
    queue = FairQueue(client, keys, MODEL)
    classes = [("interactive", 0), ("default", 1), ("batch", 2)]
    for i in range(300):
        name, rank = classes[i % 3]
        await _put(queue, name, f"t{i % 4}", _request(f"r{i}", priority=rank))
    other = aioredis.from_url(redis_server.url)
    try:
        queues = {"w1": queue, "w2": FairQueue(other, keys, MODEL)}

        async def drain(consumer: str) -> list[tuple[str, bytes]]:
            got = []
            while pulled := await queues[consumer].pull(consumer, 7):
                got += [(stream, entry_id) for stream, entry_id, _ in pulled]
                await asyncio.sleep(0)
            return got

        one, two = await asyncio.gather(drain("w1"), drain("w2"))
    finally:
        await other.aclose()
    assert one and two
    assert not set(one) & set(two) and len(set(one) | set(two)) == 300
    # Every entry is pending on exactly the consumer that got it.
    for consumer, got in (("w1", one), ("w2", two)):
        for stream in {s for s, _ in got}:
            pending = await client.xpending_range(stream, CONSUMER_GROUP, "-", "+", 1000, consumername=consumer)
            assert {p["message_id"] for p in pending} == {e for s, e in got if s == stream}


async def test_an_idle_worker_wakes_on_the_doorbell(client: aioredis.Redis, redis_server) -> None:
    keys = _keys()
    queue = FairQueue(client, keys, MODEL)
    assert await queue.pull("w1", 4) == []  # nothing waits: the doorbell is clear
    waiter = aioredis.from_url(redis_server.url)
    try:
        ringing = asyncio.create_task(FairQueue(waiter, keys, MODEL).wait(30.0))
        await asyncio.sleep(0.05)
        await _put(queue, "batch", "t", _request("x", priority=2))
        assert await ringing  # woken by the ring, not by the 30 s timeout
    finally:
        await waiter.aclose()
    assert _ids(await queue.pull("w1", 4)) == ["x"]


async def test_a_dead_workers_entry_in_a_class_stream_is_reaped_and_served(
        client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _keys()
    queue = FairQueue(client, keys, MODEL)
    channel = keys.gateway_channel("g")
    stream = queue.stream("batch", "tenant-x")
    await _put(queue, "batch", "tenant-x", _request("lost", priority=2, max_tokens=3, channel=channel))
    assert _ids(await queue.pull("dead-worker", 1)) == ["lost"]  # taken by a worker that then died
    monkeypatch.setattr(service, "REAP_MIN_IDLE_MS", 0)
    backend = SimBackend(ModelSettings(max_model_len=64), EngineSettings(max_num_seqs=4), step_time_ms=1.0)
    worker = Worker(client, keys, MODEL, "w-live", backend, drain_timeout_s=5.0)
    pubsub = client.pubsub()
    await pubsub.subscribe(channel)
    running = asyncio.create_task(worker.run())
    try:
        tokens: list[int] = []
        finish = None
        deadline_s = time.monotonic() + 20
        while finish is None:
            assert time.monotonic() < deadline_s, "the reaped request was never served"
            item = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if item is None:  # nothing yet, or the subscribe confirmation
                continue
            message = protocol.decode(item["data"])
            assert not isinstance(message, ErrorMessage), message
            assert isinstance(message, TokenBatch)
            for out in message.outputs:
                tokens += out.token_ids
                finish = out.finish_reason
        assert len(tokens) == 3 and worker.num_reclaimed == 1
        for _ in range(100):  # the finish's XACK + XDEL goes out with the last publish
            if await client.xlen(stream) == 0:
                break
            await asyncio.sleep(0.02)
        assert await client.xlen(stream) == 0
        assert (await client.xpending(stream, CONSUMER_GROUP))["pending"] == 0
    finally:
        worker.drain()
        await asyncio.wait_for(running, 10)
        await pubsub.aclose()


async def test_a_busy_worker_takes_interactive_work_before_its_batch_ends(client: aioredis.Redis) -> None:
    keys = _keys()
    queue = FairQueue(client, keys, MODEL)
    channel = keys.gateway_channel("g")
    backend = SimBackend(ModelSettings(max_model_len=512), EngineSettings(max_num_seqs=2), step_time_ms=2.0)
    worker = Worker(client, keys, MODEL, "w1", backend, drain_timeout_s=10.0)
    pubsub = client.pubsub()
    await pubsub.subscribe(channel)
    for i in range(4):  # two fill the engine, two wait in the batch class
        await _put(queue, "batch", "t", _request(f"b{i}", priority=2, max_tokens=300, channel=channel))
    running = asyncio.create_task(worker.run())
    try:
        seen: list[str] = []
        deadline_s = time.monotonic() + 30
        while "b0" not in seen:  # the batch requests have started
            assert time.monotonic() < deadline_s
            item = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if item is not None:
                seen += [o.request_id for o in protocol.decode(item["data"]).outputs]
        await _put(queue, "interactive", "u", _request("i", priority=0, max_tokens=2, channel=channel))
        finished: list[str] = []
        while "i" not in finished:
            assert time.monotonic() < deadline_s, finished
            item = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if item is not None:
                finished += [o.request_id for o in protocol.decode(item["data"]).outputs if o.finish_reason]
        # Pulled although the engine was full, and run by preempting a batch request.
        assert finished == ["i"] and backend.num_preemptions >= 1
    finally:
        worker.drain()  # finishes the batch requests (about a second)
        await asyncio.wait_for(running, 20)
        await pubsub.aclose()


async def test_snapshot_shows_each_class_and_tenant(client: aioredis.Redis) -> None:
    keys = _keys()
    queue = FairQueue(client, keys, MODEL)
    for i in range(2):
        await _put(queue, "interactive", "alice", _request(f"i{i}", priority=0))
    for i in range(3):
        await _put(queue, "batch", "bob", _request(f"b{i}", priority=2))
    assert _ids(await queue.pull("w1", 1)) == ["i0"]
    snap = await snapshot(client, keys)
    classes = {c.priority_class: c for c in snap.classes}
    assert set(classes) == {"interactive", "default", "batch"}  # default: the (empty) base stream
    assert (classes["interactive"].num_waiting, classes["interactive"].num_pending) == (1, 1)
    assert (classes["batch"].num_waiting, classes["batch"].num_pending, classes["batch"].num_tenants) == (3, 0, 1)
    assert classes["batch"].oldest_waiting_age_s is not None
    by_tenant = {(s.priority_class, s.tenant): s for s in snap.streams}
    assert set(by_tenant) == {("default", "anonymous"), ("interactive", "alice"), ("batch", "bob")}
    assert by_tenant[("interactive", "alice")].virtual_tokens == entry_cost(_request("x"))
    assert by_tenant[("batch", "bob")].virtual_tokens == 0.0  # joined, not yet charged


async def test_the_enqueue_scripts_admission_counts_what_depths_sums(client: aioredis.Redis) -> None:
    """With ``max_waiting``, the enqueue script counts what ``depths()`` reads stream by
    stream: entries taken by a worker do not count, a stream whose group does not exist
    yet counts whole, and a hand-made entry on the base stream counts. Refused, it writes
    nothing and says how many wait."""
    keys = _keys()
    queue = FairQueue(client, keys, MODEL)
    for i in range(3):
        await _put(queue, "interactive", "alice", _request(f"i{i}", priority=0))
    for i in range(4):
        await _put(queue, "batch", "bob", _request(f"b{i}", priority=2))
    assert _ids(await queue.pull("w1", 2)) == ["i0", "i1"]  # two taken: pending, not waiting
    no_group = queue.stream("default", "carol")  # listed, but no consumer group on it yet
    await client.xadd(no_group, {STREAM_FIELD: b"x"})
    await client.sadd(keys.model_streams(MODEL), no_group)
    await client.xadd(queue.base_stream, {STREAM_FIELD: b"y"})
    expected = sum(d.num_waiting for d in (await queue.depths()).values())
    assert expected == 1 + 4 + 1 + 1
    stream = queue.stream("default", "dave")
    with pytest.raises(QueueFull) as info:
        await queue.enqueue(stream, [_request("d0"), _request("d1")], max_waiting=expected + 1)
    assert info.value.num_waiting == expected
    assert await client.exists(stream) == 0 and stream.encode() not in await client.smembers(keys.model_streams(MODEL))
    assert len(await queue.enqueue(stream, [_request("d0"), _request("d1")], max_waiting=expected + 2)) == 2
    assert sum(d.num_waiting for d in (await queue.depths()).values()) == expected + 2
