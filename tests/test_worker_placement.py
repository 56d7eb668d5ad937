"""The worker's side of placement on a real Redis, with sim workers in this process:
KV events in the worker's KV index, the heartbeat's load fields, the prefill budget that
spreads a burst, taking entries from another live worker's placed stream after
``steal_after_ms`` (and not before), a dead worker's placed and pending entries served
once each (two workers racing for them), and the cleanup after a dead worker.
Processes (SIGKILL, a refused start): tests/test_worker_placement_processes.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import redis.asyncio as aioredis

from shared import protocol
from shared.block_hashes import block_hashes
from shared.fair_queue import PRIORITY_CLASSES, FairQueue, Placement, StealFrom
from shared.keys import CONSUMER_GROUP, Keys
from shared.protocol import ErrorMessage, GenerateRequest, TokenBatch, WorkerStatus
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from shared.streams import as_text
from worker import service
from worker.backends.sim import SimBackend
from worker.placed import steal_sources
from worker.service import Worker

pytestmark = pytest.mark.timeout(120)

MODEL = "m"


def _keys() -> Keys:
    return Keys(f"tw{uuid.uuid4().hex[:8]}")


def _request(keys: Keys, request_id: str, prompt: list[int], max_tokens: int, tenant: str = "") -> GenerateRequest:
    return GenerateRequest(request_id=request_id, model=MODEL, prompt_token_ids=prompt,
                           sampling=SamplingParams(max_tokens=max_tokens), reply_channel=keys.gateway_channel("g"),
                           deadline_unix_s=time.time() + 120, tenant=tenant)


def _echo(prompt: list[int], max_tokens: int) -> list[int]:
    """What the sim generates for ``prompt`` (worker/backends/sim.py)."""
    return [prompt[i % len(prompt)] for i in range(max_tokens)]


def _sim(max_model_len: int = 2048, step_time_ms: float = 2.0, **engine: int) -> SimBackend:
    return SimBackend(ModelSettings(max_model_len=max_model_len), EngineSettings(**engine), step_time_ms=step_time_ms)


@dataclass
class Replies:
    """The token messages of one gateway channel: per request, per output index, the
    (token, worker) pairs received (more than one: a duplicate), and the finishes."""

    tokens: dict[str, dict[int, list[tuple[int, str]]]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)

    def add(self, batch: TokenBatch) -> None:
        for out in batch.outputs:
            per_index = self.tokens.setdefault(out.request_id, {})
            for i, token in enumerate(out.token_ids):
                per_index.setdefault(out.first_index + i, []).append((token, batch.worker_id))
            if out.finish_reason is not None:
                self.finished[out.request_id] = out.finish_reason

    def output(self, request_id: str) -> list[int]:
        per_index = self.tokens[request_id]
        return [per_index[i][0][0] for i in range(len(per_index))]

    def workers(self, request_id: str) -> set[str]:
        return {w for pairs in self.tokens[request_id].values() for _, w in pairs}


async def _collect(pubsub: aioredis.client.PubSub, replies: Replies, request_ids: Iterable[str],
                   timeout_s: float) -> None:
    """Read the channel into ``replies`` until every request finished."""
    wanted = set(request_ids)
    deadline_s = time.monotonic() + timeout_s
    while not wanted <= set(replies.finished):
        assert time.monotonic() < deadline_s, f"unfinished: {sorted(wanted - set(replies.finished))}"
        item = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if item is None:
            continue
        message = protocol.decode(item["data"])
        assert not isinstance(message, ErrorMessage), message
        assert isinstance(message, TokenBatch)
        replies.add(message)


@asynccontextmanager
async def _running(*workers: Worker) -> AsyncIterator[None]:
    """Run ``workers`` (their ``run`` tasks), draining them on exit."""
    tasks = [asyncio.create_task(w.run()) for w in workers]
    try:
        yield
    finally:
        for w in workers:
            w.drain()
        await asyncio.wait_for(asyncio.gather(*tasks), 20)


@asynccontextmanager
async def _subscribed(client: aioredis.Redis, keys: Keys) -> AsyncIterator[aioredis.client.PubSub]:
    pubsub = client.pubsub()
    await pubsub.subscribe(keys.gateway_channel("g"))
    try:
        yield pubsub
    finally:
        await pubsub.aclose()


async def _wait_for(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline_s = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline_s, "condition not met in time"
        await asyncio.sleep(0.05)


async def _beat(client: aioredis.Redis, keys: Keys, worker_id: str, block_size: int = 16) -> None:
    """A heartbeat for ``worker_id``: alive for this test, though no process runs it."""
    status = WorkerStatus(worker_id=worker_id, model=MODEL, backend="sim", num_running=0, num_waiting=0,
                          kv_usage=0.0, num_free_blocks=8, block_size=block_size, max_num_seqs=4,
                          updated_unix_s=time.time(), started_unix_s=time.time(), pid=1)
    await client.set(keys.worker_key(worker_id), protocol.encode(status), ex=60)


# -- KV events and the heartbeat --------------------------------------------------------------

async def test_kv_events_reach_the_workers_kv_index_and_evictions_leave_it(client: aioredis.Redis) -> None:
    keys = _keys()
    queue = FairQueue(client, keys, MODEL)
    index = keys.kv_index(MODEL, "w1")
    await client.sadd(index, b"from an earlier life")
    # 8 blocks of 16 tokens: the second request's reservation evicts all of the first's.
    worker = Worker(client, keys, MODEL, "w1", _sim(max_model_len=256, num_kv_blocks=8, max_num_seqs=2),
                    drain_timeout_s=5.0)
    first, second = list(range(100, 150)), list(range(1000, 1120))
    async with _subscribed(client, keys) as pubsub, _running(worker):
        replies = Replies()
        await queue.enqueue(queue.stream("default", "t"), [_request(keys, "a", first, 2)])
        await _collect(pubsub, replies, ["a"], 10)
        # The step's SADD goes out before its tokens, in one pipeline.
        assert all(await client.smismember(index, block_hashes(first, 16)))
        assert not await client.sismember(index, b"from an earlier life")
        await queue.enqueue(queue.stream("default", "t"), [_request(keys, "b", second, 2)])
        await _collect(pubsub, replies, ["b"], 10)
        assert not any(await client.smismember(index, block_hashes(first, 16)))
        assert all(await client.smismember(index, block_hashes(second, 16)))
        # Its load, written with each step that changed it: nothing left to prefill.
        assert await client.hget(keys.worker_load(MODEL), "w1") == b"0"
    assert not await client.exists(index)  # deleted at exit
    assert await client.hget(keys.worker_load(MODEL), "w1") is None


async def test_a_resync_drops_predictions_that_never_came_true(client: aioredis.Redis) -> None:
    """A gateway predicted a prefix on this worker that it never computed (taken over,
    aborted): the next resync rewrites the index from the cache, so the prediction goes
    and the computed blocks stay."""
    keys = _keys()
    queue = FairQueue(client, keys, MODEL)
    index = keys.kv_index(MODEL, "w1")
    worker = Worker(client, keys, MODEL, "w1", _sim(max_model_len=256, num_kv_blocks=32, max_num_seqs=2),
                    drain_timeout_s=5.0, kv_resync_s=0.2)
    prompt = list(range(100, 150))
    async with _subscribed(client, keys) as pubsub, _running(worker):
        replies = Replies()
        await queue.enqueue(queue.stream("default", "t"), [_request(keys, "a", prompt, 2)])
        await _collect(pubsub, replies, ["a"], 10)
        await client.sadd(index, b"predicted, never computed")
        await asyncio.sleep(0.3)  # the resync is due at the next step
        await queue.enqueue(queue.stream("default", "t"), [_request(keys, "b", list(range(500, 520)), 2)])
        await _collect(pubsub, replies, ["b"], 10)
        assert not await client.sismember(index, b"predicted, never computed")
        assert all(await client.smismember(index, block_hashes(prompt, 16)))  # the truth stays


async def test_the_heartbeat_reports_load_sizes_and_prefix_cache_counters(client: aioredis.Redis) -> None:
    backend = _sim(max_model_len=512, max_num_batched_tokens=256, num_kv_blocks=40)
    worker = Worker(client, _keys(), MODEL, "w1", backend)
    backend.add_request("a", list(range(300)), SamplingParams(max_tokens=4))
    backend.step()  # 256 of its 300 prompt tokens
    s = worker.status()
    assert (s.num_waiting_prefill_tokens, s.num_blocks, s.max_num_batched_tokens, s.max_model_len) == (44, 40, 256, 512)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (300, 0)


async def test_the_pull_writes_the_requests_held_and_the_heartbeat_their_mean_output(client: aioredis.Redis) -> None:
    """Placement's inputs from a worker of 2 slots: the requests it holds, written by its
    pulls (2 while a third waits in its placed stream, 0 once all are done; gone at
    exit), and the moving average of the output tokens its requests generated here (a
    continuation's earlier outputs left out)."""
    keys = _keys()
    queue = FairQueue(client, keys, MODEL)
    worker = Worker(client, keys, MODEL, "w1", _sim(step_time_ms=10.0, max_num_seqs=2), drain_timeout_s=5.0)
    held_key, placed_key = keys.worker_held(MODEL), keys.placed_requests(MODEL)
    assert worker.status().mean_num_output_tokens == 0.0  # none finished: the gateway's default applies

    async def counts() -> tuple[int, int]:
        return int(await client.hget(held_key, "w1") or -1), int(await client.hget(placed_key, "w1") or 0)

    async with _subscribed(client, keys) as pubsub, _running(worker):
        replies = Replies()
        requests = [_request(keys, f"r{i}", [1, 2, 3], n) for i, n in enumerate((40, 80, 120))]
        for r in requests:
            await queue.enqueue(queue.stream("default", "t"), [r], placement=Placement("w1", 3))
        await _wait_for(lambda: _equals(counts(), (2, 1)))
        await _collect(pubsub, replies, [r.request_id for r in requests], 20)
        assert worker.output_lengths.mean == pytest.approx(40 + (80 - 40) / 16 + (120 - 42.5) / 16)
        resumed = _request(keys, "c", [1, 2, 3], 60)
        resumed.output_token_ids = [7] * 50  # 10 left to generate here
        await queue.enqueue(queue.stream("default", "t"), [resumed])
        await _collect(pubsub, replies, ["c"], 10)
        assert worker.status().mean_num_output_tokens == pytest.approx(47.34375 + (10 - 47.34375) / 16)
        await _wait_for(lambda: _equals(counts(), (0, 0)))
    assert await client.hget(held_key, "w1") is None


async def _equals(value, expected) -> bool:  # type: ignore[no-untyped-def]
    return await value == expected


# -- the prefill budget -------------------------------------------------------------------------

@pytest.mark.parametrize("max_waiting_prefill_tokens", [-1, 0])
async def test_the_prefill_budget_spreads_a_burst_over_two_workers(client: aioredis.Redis,
                                                                     max_waiting_prefill_tokens: int) -> None:
    """40 requests of 1,000 prompt tokens on the shared stream, two idle sim workers of 64
    slots: with the default budget (4 x 2,048 tokens) neither takes more than 60% of the
    prompt tokens; with no bound (0) the first pull takes them all."""
    keys = _keys()
    queue = FairQueue(client, keys, MODEL)
    requests = [_request(keys, f"r{i}", list(range(i * 1000, (i + 1) * 1000)), 2) for i in range(40)]
    await queue.enqueue(queue.stream("default", "t"), requests)
    workers = [Worker(client, keys, MODEL, wid, _sim(step_time_ms=5.0),
                      max_waiting_prefill_tokens=max_waiting_prefill_tokens) for wid in ("w1", "w2")]
    async with _subscribed(client, keys) as pubsub, _running(*workers):
        replies = Replies()
        await _collect(pubsub, replies, [r.request_id for r in requests], 60)
    share = {w.worker_id: 0 for w in workers}
    for r in requests:
        (wid,) = replies.workers(r.request_id)
        share[wid] += len(r.prompt_token_ids)
    largest = max(share.values()) / sum(share.values())
    if max_waiting_prefill_tokens == 0:
        assert largest == 1.0, share
    else:
        assert largest <= 0.6, share


# -- placed streams of other workers: live (after steal_after_ms), dead (at once) ----------------

def test_steal_sources_wait_on_live_workers_and_take_dead_ones_at_once() -> None:
    keys = _keys()
    streams = [keys.requests_stream(MODEL), keys.class_stream(MODEL, "default", "t"),
               *(keys.placed_stream(MODEL, w, c) for w in ("me", "live", "dead") for c in ("batch", "interactive"))]
    got = steal_sources(keys, MODEL, streams, "me", {"live"}, 1500)
    assert got == [StealFrom("dead", "interactive", 0), StealFrom("live", "interactive", 1500),
                   StealFrom("dead", "batch", 0), StealFrom("live", "batch", 1500)]
    assert steal_sources(keys, MODEL, streams, "me", {"live"}, 0) == [StealFrom("dead", "interactive", 0),
                                                                      StealFrom("dead", "batch", 0)]


async def test_an_idle_worker_takes_a_live_workers_entries_after_steal_after_ms_not_before(
        client: aioredis.Redis) -> None:
    keys = _keys()
    queue = FairQueue(client, keys, MODEL)
    await _beat(client, keys, "busy")  # alive, but it never pulls
    placed = keys.placed_stream(MODEL, "busy", "default")
    requests = [_request(keys, f"r{i}", [7, 8, 9], 3, tenant="acme") for i in range(3)]
    start_s = time.monotonic()
    for r in requests:
        await queue.enqueue(queue.stream("default", "acme"), [r], placement=Placement("busy", 3))
    assert int(await client.hget(keys.placed_tokens(MODEL), "busy")) == 9
    thief = Worker(client, keys, MODEL, "thief", _sim(), steal_after_ms=1500)
    never = Worker(client, keys, MODEL, "never", _sim(), steal_after_ms=0)
    tenants: list[str] = []
    add = thief.backend.add_request
    thief.backend.add_request = lambda *a, **kw: (tenants.append(kw["tenant"]), add(*a, **kw))[1]  # type: ignore[method-assign]
    async with _subscribed(client, keys) as pubsub, _running(thief, never):
        await asyncio.sleep(1.0)
        assert await client.xlen(placed) == 3 and (await client.xpending(placed, CONSUMER_GROUP))["pending"] == 0
        replies = Replies()
        await _collect(pubsub, replies, [r.request_id for r in requests], 10)
    assert time.monotonic() - start_s >= 1.5
    assert all(replies.workers(r.request_id) == {"thief"} and replies.output(r.request_id) == [7, 8, 9]
               for r in requests)
    assert tenants == ["acme"] * 3  # a placed stream names no tenant: the request does
    assert int(await client.hget(keys.placed_tokens(MODEL), "busy")) == 0


async def _place_on_dead(client: aioredis.Redis, keys: Keys, num: int, num_delivered: int) -> list[GenerateRequest]:
    """``num`` requests placed on worker "dead" (no heartbeat), the first ``num_delivered``
    of them delivered to it (pending there)."""
    queue = FairQueue(client, keys, MODEL)
    requests = [_request(keys, f"r{i}", [10 + i, 20 + i, 30 + i, 40 + i], 6) for i in range(num)]
    for r in requests:
        await queue.enqueue(queue.stream("default", "t"), [r], placement=Placement("dead", 4))
    taken = await queue.pull("dead", num_delivered) if num_delivered else []
    assert len(taken) == num_delivered
    return requests


async def test_a_dead_workers_placed_and_pending_entries_complete_and_its_traces_go(
        client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _keys()
    monkeypatch.setattr(service, "REAP_MIN_IDLE_MS", 0)
    monkeypatch.setattr(service, "REAP_INTERVAL_S", 0.2)
    requests = await _place_on_dead(client, keys, 5, 2)
    await client.sadd(keys.kv_index(MODEL, "dead"), b"a block it held")
    live = Worker(client, keys, MODEL, "live", _sim(), steal_after_ms=60_000)
    async with _subscribed(client, keys) as pubsub, _running(live):
        replies = Replies()
        await _collect(pubsub, replies, [r.request_id for r in requests], 20)
        for r in requests:
            assert replies.output(r.request_id) == _echo(r.prompt_token_ids, 6)
            assert all(len(pairs) == 1 for pairs in replies.tokens[r.request_id].values())
        assert live.num_reclaimed == 2
        placed = [keys.placed_stream(MODEL, "dead", c) for c in PRIORITY_CLASSES]
        streams_key = keys.model_streams(MODEL)

        async def gone() -> bool:
            return (not await client.exists(*placed, keys.kv_index(MODEL, "dead"),
                                            keys.worker_doorbell(MODEL, "dead"))
                    and not any(await client.smismember(streams_key, placed))
                    and await client.hget(keys.placed_tokens(MODEL), "dead") is None)

        await _wait_for(gone)


async def test_two_workers_racing_for_a_dead_workers_entries_run_each_once(
        client: aioredis.Redis, redis_server, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _keys()
    # Long enough that the second claimer's XCLAIM finds the entry busy (idle reset by
    # the first), as the 10 s default does.
    monkeypatch.setattr(service, "REAP_MIN_IDLE_MS", 300)
    monkeypatch.setattr(service, "REAP_INTERVAL_S", 0.1)
    requests = await _place_on_dead(client, keys, 30, 3)
    other = aioredis.from_url(redis_server.url)
    try:
        # Four slots each: every pull takes a few, so the two alternate.
        workers = [Worker(client, keys, MODEL, "w1", _sim(step_time_ms=5.0, max_num_seqs=4)),
                   Worker(other, keys, MODEL, "w2", _sim(step_time_ms=5.0, max_num_seqs=4))]
        async with _subscribed(client, keys) as pubsub, _running(*workers):
            replies = Replies()
            await _collect(pubsub, replies, [r.request_id for r in requests], 30)
    finally:
        await other.aclose()
    by_worker: dict[str, int] = {}
    for r in requests:
        assert replies.output(r.request_id) == _echo(r.prompt_token_ids, 6)
        assert all(len(pairs) == 1 for pairs in replies.tokens[r.request_id].values()), r.request_id  # ran once
        (wid,) = replies.workers(r.request_id)
        by_worker[wid] = by_worker.get(wid, 0) + 1
    assert len(by_worker) == 2, by_worker  # both took some
    for stream in await FairQueue(client, keys, MODEL).streams():
        info = await client.xinfo_groups(stream)
        assert all(g["pending"] == 0 for g in info), as_text(stream)



def test_a_waiting_request_counts_only_what_placement_expects_uncached() -> None:
    """A pulled follow-up whose history placement expects cached here is not counted as
    prefill work before admission (else the heartbeat and the pull budget call a worker
    full of cached follow-ups saturated); once admitted, the real hit counts."""
    from shared.sampling import SamplingParams
    from worker.engine.request import Request

    request = Request("r", list(range(1000)), SamplingParams(max_tokens=4), num_cached_hint=960)
    assert request.num_prefill_tokens_left == 40
    assert Request("r", list(range(1000)), SamplingParams(max_tokens=4)).num_prefill_tokens_left == 1000
    request.num_computed_tokens = 496  # admitted with a smaller hit than hinted, mid-prefill
    assert request.num_prefill_tokens_left == 504
