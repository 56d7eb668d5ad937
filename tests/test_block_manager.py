"""Block manager: allocation, growth, free, prefix caching, LRU reuse, no leaks."""

from __future__ import annotations

import pytest

from shared.sampling import SamplingParams
from worker.engine.block_manager import NO_HASH, BlockManager
from worker.engine.request import Request


def req(rid: str, n: int, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=8))


def test_allocate_grow_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    r = req("a", 10)
    assert bm.blocks_needed(r, 10) == 3
    assert bm.can_allocate(r, 10)
    bm.allocate(r, 10)
    assert len(r.block_table) == 3 and len(set(r.block_table)) == 3
    assert bm.num_free_blocks == 5
    r.num_computed_tokens = 10
    # Tokens 11 and 12 fit in the third block; the 13th needs a fourth.
    assert bm.blocks_needed(r, 2) == 0
    assert bm.blocks_needed(r, 3) == 1
    bm.allocate(r, 3)
    assert len(r.block_table) == 4 and bm.num_free_blocks == 4
    bm.free(r)
    assert r.block_table == [] and bm.num_free_blocks == 8 and bm.usage == 0.0


def test_cannot_overallocate() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    r = req("a", 9)
    assert not bm.can_allocate(r, 9)
    with pytest.raises(RuntimeError):
        bm.allocate(r, 9)
    assert bm.num_free_blocks == 2 and r.block_table == []


def test_prefix_cache_hit_shares_blocks_and_refcounts() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = req("a", 10)
    bm.allocate_prefix(a, bm.find_cached_prefix(a))
    assert a.num_computed_tokens == 0
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)  # two full blocks get hashes
    assert [bm.blocks[b].hash != NO_HASH for b in a.block_table] == [True, True, False]

    b = Request("b", list(range(8)) + [99, 98, 97], SamplingParams())
    hit = bm.find_cached_prefix(b)
    assert hit == a.block_table[:2]
    bm.allocate_prefix(b, hit)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert all(bm.blocks[x].ref_count == 2 for x in hit)
    bm.allocate(b, 3)
    bm.free(a)
    assert all(bm.blocks[x].ref_count == 1 for x in hit)
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_prefix_never_covers_the_last_token() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", 8)
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    same = req("b", 8)
    # 8 tokens = 2 full blocks, but one token must be computed: only 1 block is reused.
    assert len(bm.find_cached_prefix(same)) == 1


def test_freed_cached_blocks_are_found_until_reused_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req("a", 5)
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    cached = list(a.block_table[:2])
    bm.free(a)
    assert bm.num_free_blocks == 4
    again = req("a2", 5)
    assert bm.find_cached_prefix(again) == cached
    # A new unrelated request takes the least recently freed blocks first: the one
    # never-used block, then a's tail block, and only then a's cached head.
    other = req("o", 4, start=100)
    bm.allocate(other, 4)
    assert not set(other.block_table) & set(cached)
    assert bm.find_cached_prefix(again) == cached
    bm.allocate(req("o2", 2, start=200), 2)
    assert bm.find_cached_prefix(again) == cached[:1]  # the prefix's tail goes first
    bm.allocate(req("o3", 2, start=300), 2)
    assert bm.find_cached_prefix(again) == []


def test_prefix_caching_off_finds_nothing() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = req("a", 9)
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    assert bm.find_cached_prefix(req("b", 9)) == []


# -- chained hashes (shared/block_hashes.py) and KV events ---------------------------------

def _compute(bm: BlockManager, r: Request) -> None:
    """Admit ``r`` with its cached prefix, compute all of its tokens, register its blocks."""
    bm.allocate_prefix(r, bm.find_cached_prefix(r))
    bm.allocate(r, r.num_tokens - r.num_computed_tokens)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)


def test_a_block_is_shared_only_after_the_same_blocks_before_it() -> None:
    """Two prompts whose second blocks hold the same tokens after different first blocks
    cache two second blocks, and a third prompt that continues the second one finds that
    one's blocks, never the first prompt's second block (which holds KV computed after
    other tokens). Fails if a block's hash ignores its parent's."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Request("a", [1, 2, 3, 4, 9, 9, 9, 9, 5], SamplingParams(max_tokens=1))
    b = Request("b", [6, 6, 6, 6, 9, 9, 9, 9, 5], SamplingParams(max_tokens=1))
    _compute(bm, a)
    _compute(bm, b)
    assert b.num_cached_tokens == 0
    assert bm.block_hash_at(a, 1) != bm.block_hash_at(b, 1)
    assert all(bm.blocks[x].hash != NO_HASH for x in a.block_table[:2] + b.block_table[:2])
    c = Request("c", [6, 6, 6, 6, 9, 9, 9, 9, 8, 8], SamplingParams(max_tokens=1))
    assert bm.find_cached_prefix(c) == b.block_table[:2]


def test_block_hashes_are_the_shared_definition() -> None:
    """The block manager's hashes are ``shared.block_hashes.block_hashes`` of the tokens
    (what gateways compute), for the prompt and for output tokens appended later."""
    from shared.block_hashes import block_hashes, prefix_hash

    a, b = block_hashes([1] * 4 + [9] * 4, 4), block_hashes([2] * 4 + [9] * 4, 4)
    assert a[1] != b[1] and a[1] == prefix_hash([1] * 4 + [9] * 4, 4)
    bm = BlockManager(num_blocks=16, block_size=4)
    r = req("a", 10)
    assert [bm.block_hash_at(r, i) for i in range(2)] == block_hashes(r.token_ids, 4)
    r.token_ids += [70, 71]
    assert bm.block_hash_at(r, 2) == block_hashes(r.token_ids, 4)[2] and r.block_hashes == block_hashes(r.token_ids, 4)


def test_kv_events_record_stores_evictions_and_clears_netted() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a = req("a", 5)  # blocks 0, 1, 2; the first two cached
    _compute(bm, a)
    assert not bm.take_kv_events()  # the first call starts the recording
    b = req("b", 5, start=50)  # blocks 3, 4, 5
    _compute(bm, b)
    events = bm.take_kv_events()
    assert events.stored == tuple(b.block_hashes) and events.removed == () and not events.cleared
    assert not bm.take_kv_events()  # taken
    bm.free(a)  # free, tails first: 2, 1, 0, then 5, 4, 3
    bm.free(b)
    c = req("c", 5, start=100)
    _compute(bm, c)  # takes 2 (uncached), then 1 and 0: a's blocks evicted
    events = bm.take_kv_events()
    assert events.removed == (a.block_hashes[1], a.block_hashes[0]) and events.stored == tuple(c.block_hashes)
    # c's blocks stored, then evicted before the events are taken: reported removed only.
    bm.free(c)
    bm.allocate(req("d", 12, start=200), 12)
    events = bm.take_kv_events()
    assert set(events.removed) == {*b.block_hashes, *c.block_hashes} and events.stored == ()
    bm.reset_prefix_cache()
    assert bm.take_kv_events().cleared


def test_a_kv_snapshot_is_the_whole_cache_and_restarts_the_log() -> None:
    """``take_kv_events(snapshot=True)``: cleared, then every cached hash (free or held),
    and nothing recorded before it comes again."""
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.take_kv_events()
    a, b = req("a", 5), req("b", 5, start=50)
    _compute(bm, a)
    _compute(bm, b)
    bm.free(a)  # freed blocks keep their hashes: still cached
    snap = bm.take_kv_events(snapshot=True)
    assert snap.cleared and set(snap.stored) == {*a.block_hashes, *b.block_hashes}
    assert not bm.take_kv_events()  # what the log held went out with the snapshot


def test_no_kv_events_without_prefix_caching() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    bm.take_kv_events()
    _compute(bm, req("a", 9))
    assert not bm.take_kv_events()


def test_kv_event_log_nets_changes_until_taken() -> None:
    """Stored then removed: removed (the SREM also drops a gateway's prediction); removed
    then stored: stored; a clear forgets what came before it; ``extend`` replays."""
    from worker.backends.kv_events import KVEventLog, KVEvents

    log = KVEventLog()
    log.store(b"x")
    log.remove(b"x")
    log.remove(b"y")
    log.store(b"y")
    log.store(b"z")
    assert log.take() == KVEvents(stored=(b"y", b"z"), removed=(b"x",))
    assert not log.take()
    log.store(b"x")
    log.clear()
    log.store(b"w")
    events = log.take()
    assert events == KVEvents(stored=(b"w",), cleared=True)
    log.remove(b"w")
    log.extend(events)
    assert log.take() == events
