"""Placement (gateway/placement.py) and the placed streams of the fair queue
(shared/fair_queue.py) on a real Redis: the shared block hashes chain on their parents,
the policies' choices, the read script's overlap and load, a placed request read first
by its worker, stolen by another only after ``min_age_ms``, the placed-tokens account,
and the group commit spreading a burst."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest
import redis.asyncio as aioredis

from gateway.admission import Enqueuer
from gateway.placement import (
    MIN_CACHED_TOKENS,
    PLACEMENT_TOKENS,
    Candidate,
    Placer,
    choose,
    placement_stride,
    rendezvous,
    slot_wait_tokens,
    wave_tokens,
)
from shared import protocol
from shared.block_hashes import (
    HASH_BYTES,
    BlockHasher,
    block_hashes,
    prefix_hash,
    sampled_block_hashes,
    sampled_prefix_lengths,
)
from shared.fair_queue import FairQueue, Placement, StealFrom
from shared.keys import HEARTBEAT_TTL_S, STREAM_FIELD, Keys
from shared.protocol import GenerateRequest, WorkerStatus
from shared.sampling import SamplingParams
from shared.streams import as_text, finish_entry
from worker.placed import forget_dead_workers

pytestmark = pytest.mark.timeout(60)

MODEL = "m"
BLOCK = 16


def _keys() -> Keys:
    return Keys(f"tp{uuid.uuid4().hex[:8]}")


def _request(request_id: str, prompt: list[int], priority: int = 1) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, model=MODEL, prompt_token_ids=prompt,
                           sampling=SamplingParams(max_tokens=4), reply_channel="tp:gateway:g",
                           deadline_unix_s=time.time() + 60, priority=priority, tenant="t")


def _ids(pulled: list[tuple[str, bytes, dict[bytes, bytes]]]) -> list[str]:
    return [protocol.decode(fields[STREAM_FIELD]).request_id for _, _, fields in pulled]


async def _heartbeat(client: aioredis.Redis, keys: Keys, worker_id: str, *, block_size: int = BLOCK,
                     waiting: int = 0, max_num_seqs: int = 8, mean_num_output_tokens: float = 0.0,
                     running: int = 0) -> None:
    status = WorkerStatus(worker_id=worker_id, model=MODEL, backend="sim", num_running=running, num_waiting=0,
                          kv_usage=0.0, num_free_blocks=100, block_size=block_size, max_num_seqs=max_num_seqs,
                          updated_unix_s=time.time(), started_unix_s=time.time(), pid=1,
                          num_waiting_prefill_tokens=waiting, max_num_batched_tokens=256, num_blocks=100,
                          mean_num_output_tokens=mean_num_output_tokens)
    await client.set(keys.worker_key(worker_id), protocol.encode(status), ex=HEARTBEAT_TTL_S)


# -- block hashes -------------------------------------------------------------------
def test_a_block_hash_depends_on_every_block_before_it() -> None:
    """Two prompts with the same second block after different first blocks share no hash
    (the contract a worker's KV events and a gateway's lookup both rely on)."""
    a = list(range(100, 100 + 2 * BLOCK))
    b = [7] * BLOCK + a[BLOCK:]
    ha, hb = block_hashes(a, BLOCK), block_hashes(b, BLOCK)
    assert len(ha) == len(hb) == 2
    assert ha[0] != hb[0] and ha[1] != hb[1]
    assert block_hashes(a, BLOCK) == ha  # deterministic
    assert ha == [prefix_hash(a[:BLOCK], BLOCK), prefix_hash(a, BLOCK)]
    assert block_hashes(a, 8)[1::2] != ha  # the block size is hashed too


def test_sampled_hashes_are_the_workers_block_hashes_at_every_stride() -> None:
    """What a gateway looks up (every stride-th block) is exactly what a worker announces
    for those blocks."""
    tokens = [random.Random(1).randrange(150_000) for _ in range(37 * BLOCK + 3)]
    every = block_hashes(tokens, BLOCK)
    for stride in (1, 2, 8, 37, 40):
        assert sampled_block_hashes(tokens, BLOCK, stride) == every[stride - 1::stride]
        # With the tail: every block after the last sampled one (of the 37 full blocks).
        tail = list(range(37 // stride * stride, 37))
        assert sampled_block_hashes(tokens, BLOCK, stride, with_tail=True) == (
            every[stride - 1::stride] + [every[b] for b in tail])
        lengths = sampled_prefix_lengths(len(tokens), BLOCK, stride, with_tail=True)
        assert lengths == [(k + 1) * stride * BLOCK for k in range(37 // stride)] + [(b + 1) * BLOCK for b in tail]
        # The first num_tokens alone, as the list cut there would give.
        for num_tokens in (0, 5 * BLOCK, 5 * BLOCK - 1, len(tokens) - 3):
            assert sampled_block_hashes(tokens, BLOCK, stride, True, num_tokens=num_tokens) == \
                sampled_block_hashes(tokens[:num_tokens], BLOCK, stride, True)
    with pytest.raises(ValueError):
        sampled_block_hashes(tokens, BLOCK, 0)
    with pytest.raises(ValueError):
        sampled_block_hashes(tokens, BLOCK, 2, num_tokens=len(tokens) + 1)


def test_the_incremental_hasher_equals_the_whole_prompt_function() -> None:
    tokens = [random.Random(0).randrange(50_000) for _ in range(10 * BLOCK + 5)]
    hasher = BlockHasher(BLOCK)
    hasher.extend(tokens, 3)
    hasher.extend(tokens, 3)
    assert hasher.extend(tokens, 10) == block_hashes(tokens, BLOCK)
    with pytest.raises(ValueError):
        hasher.extend(tokens, 11)


# -- the policies ------------------------------------------------------------------------
def _cand(worker_id: str, cached: int = 0, queued: int = 0, limit: int = 10_000) -> Candidate:
    return Candidate(worker_id, cached, queued, limit)


def test_cache_aware_follows_the_cache_until_the_queue_costs_more() -> None:
    both = [_cand("a", cached=960), _cand("b")]
    decision = choose("cache_aware", 1000, both)
    assert decision.placement == Placement("a", 40) and decision.reason == "cache"
    # a's queue costs more than what its cache saves (uncached tokens weigh 2): b.
    assert choose("cache_aware", 1000, [_cand("a", cached=960, queued=1900), _cand("b", queued=100)]).placement \
        == Placement("a", 40)
    busy = [_cand("a", cached=960, queued=2100), _cand("b", queued=100)]
    assert choose("cache_aware", 1000, busy).placement == Placement("b", 1000)


def test_an_overlap_under_min_cached_tokens_leaves_the_choice_to_load() -> None:
    """Short prompts that share only a chat template's first blocks spread by load; the
    worker that holds those blocks is booked for them where it is chosen."""
    short = [_cand("a", cached=MIN_CACHED_TOKENS - BLOCK, queued=50), _cand("b")]
    decision = choose("cache_aware", 150, short)
    assert decision.placement == Placement("b", 150) and decision.reason == "load"
    tie = [_cand("a", cached=MIN_CACHED_TOKENS - BLOCK), _cand("b", queued=1)]
    decision = choose("cache_aware", 150, tie)
    assert decision.placement == Placement("a", 150 - MIN_CACHED_TOKENS + BLOCK) and decision.reason == "load"
    # From MIN_CACHED_TOKENS on, the cache counts.
    decision = choose("cache_aware", 150, [_cand("a", cached=MIN_CACHED_TOKENS, queued=50), _cand("b")])
    assert decision.placement == Placement("a", 150 - MIN_CACHED_TOKENS) and decision.reason == "cache"


def test_cache_aware_without_any_cache_places_by_load() -> None:
    decision = choose("cache_aware", 500, [_cand("a", queued=300), _cand("b", queued=200)])
    assert decision.placement == Placement("b", 500) and decision.reason == "load"


def test_saturated_workers_send_uncached_work_to_the_shared_stream() -> None:
    full = [_cand("a", queued=5000, limit=4000), _cand("b", queued=4500, limit=4000)]
    assert choose("cache_aware", 500, full).placement == Placement(None, 500)
    assert choose("load", 500, full).reason == "shared"
    # ...but a prompt mostly cached on one still goes there (the cache dominates).
    cached = [_cand("a", cached=900, queued=5000, limit=4000), _cand("b", queued=4500, limit=4000)]
    assert choose("cache_aware", 1000, cached).placement == Placement("a", 100)


def test_a_session_sticks_to_one_worker_unless_it_is_saturated() -> None:
    workers = [_cand("a"), _cand("b"), _cand("c")]
    sticky = rendezvous("s-1", ["a", "b", "c"])
    assert all(choose("cache_aware", 100, workers, session="s-1").placement.worker_id == sticky for _ in range(3))
    assert choose("load", 100, workers, session="s-1").reason == "session"
    # Sessions spread: 300 sessions over 3 workers, none with more than half.
    counts = {w: 0 for w in "abc"}
    for i in range(300):
        counts[rendezvous(f"s{i}", ["a", "b", "c"])] += 1
    assert max(counts.values()) < 150
    overloaded = [_cand(w, queued=20_000 if w == sticky else 0) for w in "abc"]
    assert choose("cache_aware", 100, overloaded, session="s-1").placement.worker_id != sticky


def test_random_spreads_over_every_worker() -> None:
    rng = random.Random(1)
    picks = {choose("random", 10, [_cand("a"), _cand("b")], rng=rng).placement.worker_id for _ in range(50)}
    assert picks == {"a", "b"}


def test_a_wait_for_a_decode_slot_costs_whole_waves_of_outputs() -> None:
    """Behind R requests on S slots a new one waits R // S rounds of outputs, D steps
    each, a step worth B prefill tokens; nothing while a slot is free, and the same
    within a wave."""
    assert [slot_wait_tokens(r, 8, wave_tokens(2048, 32)) for r in range(8)] == [0] * 8
    assert [slot_wait_tokens(r, 8, wave_tokens(2048, 32)) for r in range(8, 16)] == [2048 * 32] * 8
    assert slot_wait_tokens(16, 8, wave_tokens(2048, 32)) == 2 * 2048 * 32


def test_a_wait_for_a_slot_does_not_saturate() -> None:
    """Saturation is prefill queued past the limit; a wait for a decode slot, however
    long, is not: a new prefix still goes to a worker (and its siblings can follow),
    not to the shared stream."""
    wait = slot_wait_tokens(16, 8, wave_tokens(2048, 32))
    waiting = Candidate("a", 0, 100 + wait, 1000, num_slot_wait_tokens=wait)
    assert not waiting.saturated
    assert Candidate("a", 0, 1001, 1000).saturated
    decision = choose("cache_aware", 500, [waiting, Candidate("b", 0, 200 + wait, 1000, num_slot_wait_tokens=wait)])
    assert decision.placement.worker_id == "a" and decision.reason == "load"


def _slots(worker_id: str, num_requests: int, queued: int = 0, cached: int = 0) -> Candidate:
    """A candidate of 8 slots, 2,048-token steps and 32-token answers holding ``num_requests``."""
    return _cand(worker_id, cached=cached, queued=queued + slot_wait_tokens(num_requests, 8, wave_tokens(2048, 32)))


def test_a_worker_with_full_slots_loses_a_request_to_one_with_a_free_slot() -> None:
    """a's slots are full (8 of 8), b has one free and a slightly longer prefill queue:
    b wins under both policies (a worker that caches the prompt's prefix keeps it one wave
    longer: ``test_a_worker_caching_the_prefix_keeps_its_requests_one_wave_longer``);
    with a free slot on a too, the choice is by prefill alone."""
    full, free = _slots("a", 8), _slots("b", 7, queued=300)
    for policy in ("cache_aware", "load"):
        assert choose(policy, 1000, [full, free]).placement.worker_id == "b"  # type: ignore[arg-type]
    for held in range(8):  # R < S: the term is 0, so the queues are the prefill tokens alone
        both = [_slots("a", held), _slots("b", 7, queued=300)]
        assert [c.num_queued_tokens for c in both] == [0, 300]
        assert choose("load", 1000, both).placement.worker_id == "a"
        assert choose("cache_aware", 1000, [_slots("a", held, queued=1900, cached=960), free]).placement == \
            Placement("a", 40)


# -- on Redis ------------------------------------------------------------------------------
async def test_the_read_script_finds_each_workers_overlap_and_queue(client: aioredis.Redis) -> None:
    """Workers announce every block's hash; a gateway looks up every
    ``placement_stride``-th one and finds, per worker, the sampled hashes held from the
    first to the first miss (in units of ``PLACEMENT_TOKENS``), its placed tokens and
    its load."""
    keys = _keys()
    for w in ("w1", "w2"):
        await _heartbeat(client, keys, w)
    stride = placement_stride(BLOCK)
    step = stride * BLOCK
    assert step == PLACEMENT_TOKENS
    prompt = list(range(1, 10 * step + 2))  # 10 lookup steps
    every = block_hashes(prompt[:-1], BLOCK)
    await client.sadd(keys.kv_index(MODEL, "w1"), *every[:6 * stride])
    # w2 lacks one block inside the third step: its lookup stops at 2 steps.
    await client.sadd(keys.kv_index(MODEL, "w2"), *every[:2 * stride], *every[3 * stride:])
    await client.hset(keys.placed_tokens(MODEL), "w2", 5)
    placer = Placer(client, keys, MODEL, "cache_aware", 8.0)
    await placer.refresh()
    query = placer.query(prompt)
    assert query is not None and query.hashes == every[stride - 1::stride] and query.prefix_lengths == [(k + 1) * step for k in range(10)]
    [(decision, predicted)] = await placer.place([query])
    assert decision is not None and decision.placement == Placement("w1", len(prompt) - 6 * step)
    assert decision.num_cached_tokens == 6 * step and predicted == query.hashes
    # Per worker: placed tokens, load (-1: none), placed requests (w1: the one placed
    # just now), held requests (-1: none), then per request the overlaps.
    await client.hset(keys.worker_load(MODEL), "w1", 7)
    await client.hset(keys.worker_held(MODEL), "w2", 3)
    await client.hset(keys.placed_requests(MODEL), "w1", 1)
    reply = await client.evalsha(placer._read.sha, 6, keys.kv_index(MODEL, "w1"), keys.kv_index(MODEL, "w2"),
                                 keys.placed_tokens(MODEL), keys.worker_load(MODEL), keys.placed_requests(MODEL),
                                 keys.worker_held(MODEL), "w1", "w2", HASH_BYTES,
                                 b"".join(query.hashes), b"".join(query.hashes[:1]))
    assert reply == [0, 5, 7, -1, 1, 0, -1, 3, 6, 2, 1, 1]
    async with client.pipeline(transaction=False) as pipe:
        placer.add_predictions(pipe, [("w2", predicted)])
        await pipe.execute()
    assert await client.sismember(keys.kv_index(MODEL, "w2"), query.hashes[2])


async def test_blocks_after_the_last_lookup_step_make_the_overlap_exact(client: aioredis.Redis) -> None:
    """A chat's next turn (its history cached, then a question) is looked up every
    ``PLACEMENT_TOKENS`` and then block by block, so the overlap placement sees is the
    cached history to the block (144 tokens here), not to the last step (128)."""
    keys = _keys()
    for w in ("w1", "w2"):
        await _heartbeat(client, keys, w)
    history = list(range(1, 9 * BLOCK + 1))  # 144 tokens: 9 blocks
    follow_up = [*history, *range(500, 500 + BLOCK + 5)]  # 10 full blocks of the lookup's 164
    assert len(history) > PLACEMENT_TOKENS
    await client.sadd(keys.kv_index(MODEL, "w2"), *block_hashes(history, BLOCK))
    await client.hset(keys.placed_tokens(MODEL), "w2", 40)  # w2 a little busier: load alone picks w1
    placer = Placer(client, keys, MODEL, "cache_aware", 8.0)
    await placer.refresh()
    query = placer.query(follow_up)
    assert query is not None and query.prefix_lengths == [PLACEMENT_TOKENS, 9 * BLOCK, 10 * BLOCK]
    [(decision, _)] = await placer.place([query])
    assert decision is not None and decision.reason == "cache" and decision.num_cached_tokens == 9 * BLOCK
    assert decision.placement == Placement("w2", len(follow_up) - 9 * BLOCK)


async def test_short_prompts_sharing_a_template_spread_by_load(client: aioredis.Redis) -> None:
    """A burst of short chats that share their first blocks (a chat template's system
    prompt), cached on one worker, spreads over the workers: neither the short overlap
    nor the shared first block (a new prefix's name) pins them to one."""
    keys = _keys()
    for w in ("w1", "w2", "w3"):
        await _heartbeat(client, keys, w)
    template = list(range(1, 2 * BLOCK + 1))
    await client.sadd(keys.kv_index(MODEL, "w1"), *block_hashes(template, BLOCK))
    prompts = [[*template, *range(1000 + 40 * i, 1000 + 40 * i + 20)] for i in range(9)]
    placer = Placer(client, keys, MODEL, "cache_aware", 8.0)
    await placer.refresh()
    decisions = await placer.place([placer.query(p) for p in prompts])
    counts = {w: sum(d is not None and d.placement.worker_id == w for d, _ in decisions) for w in ("w1", "w2", "w3")}
    # w1 computes less of each (its cache is booked), so it may take one more.
    assert sum(counts.values()) == 9 and all(2 <= n <= 4 for n in counts.values()), counts


async def test_no_placement_without_agreeing_workers(client: aioredis.Redis) -> None:
    keys = _keys()
    placer = Placer(client, keys, MODEL, "cache_aware", 8.0)
    await placer.refresh()
    assert placer.query([1, 2, 3]) is None  # no worker yet
    await _heartbeat(client, keys, "w1", block_size=16)
    await _heartbeat(client, keys, "w2", block_size=32)
    await placer.refresh()
    assert placer.view.block_size is None and placer.query(list(range(100))) is None


async def test_a_placed_request_is_its_workers_first_and_counts_its_prefill(client: aioredis.Redis) -> None:
    keys = _keys()
    queue = FairQueue(client, keys, MODEL)
    await queue.enqueue(queue.stream("default", "t"), [_request("shared-1", [1, 2, 3])])
    await queue.enqueue(queue.stream("default", "t"), [_request("placed-1", [4, 5, 6])],
                        placement=Placement("w1", 3))
    assert int(await client.hget(keys.placed_tokens(MODEL), "w1")) == 3
    assert await client.llen(keys.worker_doorbell(MODEL, "w1")) == 1
    # Another worker does not see it on its own streams...
    assert _ids(await queue.pull("w2", 5)) == ["shared-1"]
    # ...its worker takes it, and the placed tokens go back to 0.
    pulled = await queue.pull("w1", 5)
    assert _ids(pulled) == ["placed-1"] and pulled[0][0] == keys.placed_stream(MODEL, "w1", "default")
    assert int(await client.hget(keys.placed_tokens(MODEL), "w1")) == 0
    assert await client.llen(keys.worker_doorbell(MODEL, "w1")) == 0


async def test_an_entry_is_stolen_only_after_it_waited_long_enough(client: aioredis.Redis) -> None:
    keys = _keys()
    queue = FairQueue(client, keys, MODEL)
    await queue.enqueue(queue.stream("default", "t"), [_request("p", [1, 2, 3])], placement=Placement("w1", 3))
    steal = [StealFrom("w1", "default", 300)]
    assert await queue.pull("w2", 5, steal=steal) == []
    await asyncio.sleep(0.4)
    assert _ids(await queue.pull("w2", 5, steal=steal)) == ["p"]
    assert int(await client.hget(keys.placed_tokens(MODEL), "w1")) == 0
    assert await queue.pull("w1", 5) == []  # taken over: it never runs twice


async def test_racing_thieves_never_take_the_same_entry(client: aioredis.Redis) -> None:
    keys = _keys()
    queue = FairQueue(client, keys, MODEL)
    for i in range(30):
        await queue.enqueue(queue.stream("default", "t"), [_request(f"p{i}", [1, 2])], placement=Placement("dead", 2))
    steal = [StealFrom("dead", "default", 0)]
    results = await asyncio.gather(*(queue.pull(f"w{k}", 3, steal=steal) for k in range(8) for _ in range(3)))
    taken = [i for r in results for i in _ids(r)]
    assert sorted(taken) == sorted(f"p{i}" for i in range(30))


async def test_the_prefill_budget_bounds_a_pull(client: aioredis.Redis) -> None:
    keys = _keys()
    queue = FairQueue(client, keys, MODEL)
    for i in range(5):
        await queue.enqueue(queue.stream("default", "t"), [_request(f"r{i}", list(range(1000)))])
    # 2,500 tokens of budget: three 1,000-token prompts (the last one crosses it).
    assert _ids(await queue.pull("w1", 10, prefill_budget=2500)) == ["r0", "r1", "r2"]
    assert await queue.pull("w1", 10, prefill_budget=0) == []
    assert _ids(await queue.pull("w1", 10, prefill_budget=1)) == ["r3"]  # one, however long


async def test_a_burst_through_the_group_commit_spreads_over_the_workers(client: aioredis.Redis) -> None:
    """96 prompts without any cache, placed in one group commit: each placement counts
    the ones before it, so neither worker gets more than half (+1)."""
    keys = _keys()
    for w in ("w1", "w2"):
        await _heartbeat(client, keys, w)
    queue = FairQueue(client, keys, MODEL)
    placer = Placer(client, keys, MODEL, "cache_aware", 1000.0)
    await placer.refresh()
    enqueuer = Enqueuer(queue, 10_000, placer)
    prompts = [[i] * 300 for i in range(96)]
    done = await asyncio.gather(*(enqueuer.enqueue(queue.stream("default", "t"), [_request(f"r{i}", p)],
                                                   query=placer.query(p)) for i, p in enumerate(prompts)))
    per_worker = {w: sum(1 for e in done if e.stream == keys.placed_stream(MODEL, w, "default")) for w in ("w1", "w2")}
    assert per_worker["w1"] + per_worker["w2"] == 96 and max(per_worker.values()) <= 49
    # The next turn of conversation 5 finds its history where it was placed.
    first = done[5]  # gather keeps the order
    follow_up = prompts[5] + [7] * 50
    again = await enqueuer.enqueue(queue.stream("default", "t"), [_request("r5b", follow_up)],
                                   query=placer.query(follow_up))
    assert again.stream == first.stream and again.decision is not None and again.decision.reason == "cache"


async def test_a_burst_on_full_slots_spreads_by_requests_and_the_counts_go_back_to_zero(
        client: aioredis.Redis) -> None:
    """Three workers of 2 slots whose held prompts are all computed (no prefill queued,
    which is all the token figure sees): w1 holds 4 requests, w3 3 (its heartbeat's
    count: it writes no per-step figure), w2 none. 9 distinct prompts in one group commit
    leave every worker within one wave (2 requests) of the others (16 in all). The placed-request
    counts go back to 0 as workers pull their own entries and take over another's, the
    pull writes the puller's held requests, and the cleanup after a dead worker drops
    its fields."""
    keys = _keys()
    for w, running in (("w1", 0), ("w2", 0), ("w3", 3)):
        await _heartbeat(client, keys, w, max_num_seqs=2, mean_num_output_tokens=16, running=running)
    await client.hset(keys.worker_held(MODEL), mapping={"w1": 4, "w2": 0})
    await client.hset(keys.worker_load(MODEL), mapping={"w1": 0, "w2": 0, "w3": 0})
    placer = Placer(client, keys, MODEL, "cache_aware", 1000.0)
    await placer.refresh()
    prompts = [list(range(1000 * (i + 1), 1000 * (i + 1) + 300)) for i in range(9)]
    decisions = [d for d, _ in await placer.place([placer.query(p) for p in prompts])]
    queue = FairQueue(client, keys, MODEL)
    for i, d in enumerate(decisions):
        assert d is not None and d.placement.worker_id is not None
        await queue.enqueue(queue.stream("default", "t"), [_request(f"r{i}", prompts[i])], placement=d.placement)
    placed = {as_text(k): int(v) for k, v in (await client.hgetall(keys.placed_requests(MODEL))).items()}
    assert sum(placed.values()) == 9
    total = {w: placed.get(w, 0) + held for w, held in (("w1", 4), ("w2", 0), ("w3", 3))}
    assert max(total.values()) - min(total.values()) <= 2, total  # within one wave of 2 slots
    # w1 pulls its own; w3 takes over w2's (as after steal_after_ms), then its own.
    taken = await queue.pull("w1", 10, num_held=4)
    assert len(taken) == placed.get("w1", 0)
    assert int(await client.hget(keys.worker_held(MODEL), "w1")) == 4 + len(taken)
    stolen = await queue.pull("w3", [10, 10, 10], steal=[StealFrom("w2", "default", 0)], num_held=3)
    assert len(stolen) == placed.get("w2", 0) + placed.get("w3", 0)
    assert int(await client.hget(keys.worker_held(MODEL), "w3")) == 3 + len(stolen)
    counts = await client.hgetall(keys.placed_requests(MODEL))
    assert {int(v) for v in counts.values()} == {0}, counts
    for stream, entry_id, _ in stolen:  # finished: w3's placed stream is empty
        await finish_entry(client, stream, entry_id)
    await forget_dead_workers(client, keys, MODEL, ["w3"])
    assert await client.hget(keys.placed_requests(MODEL), "w3") is None
    assert await client.hget(keys.worker_held(MODEL), "w3") is None
    assert await client.hget(keys.worker_held(MODEL), "w1") is not None  # only the dead one's


async def test_a_worker_caching_the_prefix_keeps_its_requests_one_wave_longer(client: aioredis.Redis) -> None:
    """w1 caches the prompt's prefix; both have 8 slots, 32-token answers and 256-token
    steps (a wave: 32 x 256 = 8,192 prefill tokens), w2 holds 7 requests. With its slots
    full (8 to 15 held) w1 keeps the prompt, one wave forgiven; two waves behind (16) the
    second outweighs the prefill its cache saves (2 x 992) and the prompt goes to w2. A
    prompt cached nowhere leaves w1 as soon as its slots are full (the slack is the
    cache's)."""
    keys = _keys()
    for w in ("w1", "w2"):
        await _heartbeat(client, keys, w, max_num_seqs=8, mean_num_output_tokens=32)
    prompt = list(range(1, 1001))
    fresh = list(range(5001, 6001))
    placer = Placer(client, keys, MODEL, "cache_aware", 1000.0)
    await placer.refresh()
    for held, cached_to, fresh_to in ((7, "w1", None), (8, "w1", "w2"), (15, "w1", "w2"), (16, "w2", "w2")):
        await client.delete(keys.kv_index(MODEL, "w1"), keys.kv_index(MODEL, "w2"))  # no earlier predictions
        await client.sadd(keys.kv_index(MODEL, "w1"), *block_hashes(prompt[:-1], BLOCK))
        await client.hset(keys.worker_held(MODEL), mapping={"w1": held, "w2": 7})
        await client.hset(keys.worker_load(MODEL), mapping={"w1": 0, "w2": 0})
        [(decision, _)] = await placer.place([placer.query(prompt)])
        assert decision is not None and decision.placement.worker_id == cached_to, (held, decision)
        if fresh_to is not None:
            [(decision, _)] = await placer.place([placer.query(fresh)])
            assert decision is not None and decision.placement.worker_id == fresh_to, (held, decision)


async def test_the_load_written_each_step_overrides_a_stale_heartbeat(client: aioredis.Redis) -> None:
    """A heartbeat up to a second old may still show a finished burst's prefill: the
    per-step load hash says the worker is idle now, so its cached follow-up stays there."""
    keys = _keys()
    await _heartbeat(client, keys, "w1", waiting=100_000)
    await _heartbeat(client, keys, "w2")
    prompt = list(range(1, 40 * BLOCK + 2))
    await client.sadd(keys.kv_index(MODEL, "w1"), *block_hashes(prompt[:-1], BLOCK))
    placer = Placer(client, keys, MODEL, "cache_aware", 1000.0)
    await placer.refresh()
    [(stale, _)] = await placer.place([placer.query(prompt)])
    assert stale is not None and stale.placement.worker_id == "w2"
    await client.hset(keys.worker_load(MODEL), "w1", 0)
    [(fresh, _)] = await placer.place([placer.query(prompt)])
    assert fresh is not None and fresh.placement.worker_id == "w1" and fresh.reason == "cache"


async def test_prompts_of_one_prefix_in_one_commit_follow_the_first(client: aioredis.Redis) -> None:
    """4 system prompts of 640 tokens, 8 questions each, interleaved and placed in one call
    (one group commit): each group's first prompt goes by load and the other 7 follow it
    (its prediction counts within the call, before Redis holds it)."""
    keys = _keys()
    for w in ("w1", "w2"):
        await _heartbeat(client, keys, w)
    placer = Placer(client, keys, MODEL, "cache_aware", 1000.0)
    await placer.refresh()
    systems = [list(range(1000 * (g + 1), 1000 * (g + 1) + 40 * BLOCK)) for g in range(4)]
    prompts = [systems[g] + [7, q, q + 1, q + 2] * 8 for q in range(8) for g in range(4)]
    placed = await placer.place([placer.query(p) for p in prompts])
    decisions = [d for d, _ in placed]
    assert all(d is not None for d in decisions)
    for g in range(4):
        group = [d for k, d in enumerate(decisions) if k % 4 == g and d is not None]
        assert len({d.placement.worker_id for d in group}) == 1, g
        assert [d.reason for d in group][1:] == ["cache"] * 7


async def test_two_gateways_placing_one_new_prefix_at_once_agree(client: aioredis.Redis) -> None:
    """Two gateways each place, in one group commit and before either's predictions
    reach Redis, half of the prompts of 16 new system prompts (16 of each, 32 each): all
    prompts of one prefix land on one worker, because the workers near the cheapest are
    judged on the queue Redis shows both, not on each gateway's own commit so far."""
    keys = _keys()
    for w in ("w1", "w2"):  # slots to spare (a GPU's 256): no wait for a slot, the cache decides
        await _heartbeat(client, keys, w, max_num_seqs=256)
    gateways = [Placer(client, keys, MODEL, "cache_aware", 1000.0, rng=random.Random(g)) for g in range(2)]
    for placer in gateways:
        await placer.refresh()
    # Gateway 0 placed a long prompt a moment ago; both workers have since written their
    # per-step load, which shows it (or its absence) to both gateways alike.
    await gateways[0].place([gateways[0].query(list(range(50_000, 52_000)))])
    await client.hset(keys.worker_load(MODEL), mapping={"w1": 0, "w2": 0})
    systems = [list(range(1000 * (g + 1), 1000 * (g + 1) + 40 * BLOCK)) for g in range(16)]
    prompts = [(g, systems[g] + [7, q, q + 1, q + 2] * 8) for g in range(16) for q in range(16)]
    halves = [prompts[0::2], prompts[1::2]]  # a client alternating between the gateways
    placed = await asyncio.gather(*(p.place([p.query(t) for _, t in half]) for p, half in zip(gateways, halves)))
    where: dict[int, set[str]] = {}
    for half, decisions in zip(halves, placed):
        for (g, _), (decision, _) in zip(half, decisions):
            assert decision is not None and decision.placement.worker_id is not None
            where.setdefault(g, set()).add(decision.placement.worker_id)
    assert all(len(w) == 1 for w in where.values()), where
    assert {w for ws in where.values() for w in ws} == {"w1", "w2"}  # prefixes still spread


def test_a_new_prefix_goes_where_its_first_block_hashes_among_near_equal_workers() -> None:
    """Two gateways placing the first prompts of one new system prompt at once see no
    cache and nearly equal loads: the first block's rendezvous hash picks the same worker
    for both; a worker more than the margin busier is left out."""
    near = [_cand("a", queued=100), _cand("b", queued=0), _cand("c", queued=50)]
    picks = {choose("cache_aware", 500, near, prefix_key="block-0-of-prefix-x", margin_tokens=256,
                    rng=random.Random(seed)).placement.worker_id for seed in range(20)}
    assert len(picks) == 1
    far = [_cand("a", queued=5000), _cand("b", queued=0), _cand("c", queued=4000)]
    assert choose("cache_aware", 500, far, prefix_key="block-0-of-prefix-x", margin_tokens=256).placement == \
        Placement("b", 500)
    # Different prefixes spread over the near-equal workers.
    spread = {choose("cache_aware", 500, near, prefix_key=f"p{i}", margin_tokens=256).placement.worker_id
              for i in range(30)}
    assert spread == {"a", "b", "c"}
