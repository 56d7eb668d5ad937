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
