"""Physical KV-cache blocks: allocation, reference counts and prefix caching.

A block holds ``block_size`` consecutive tokens of one sequence. A *full* block is
identified by a hash of (its parent block's hash, its token ids): ``shared/block_hashes.py``,
the one definition that gateways compute too, to place a prompt where its prefix is
cached. So two sequences with the same first ``k * block_size`` tokens share those
blocks (prefix caching, as in vLLM's automatic prefix caching and SGLang's
RadixAttention), and two that share a block's tokens but not every block before it never
do. Freed blocks keep their hash and stay findable until they are reused; reuse takes
the least recently freed block first (LRU). The tail of a freed sequence is freed first,
so it is evicted before the shared head.

KV events (``worker/backends/kv_events.py``): once ``take_kv_events`` has been called,
every hash that enters the cached map (``cache_full_blocks``), leaves it (a cached free
block reused by ``allocate``: eviction) or is dropped with the whole map
(``reset_prefix_cache``) is recorded, netted until the next call. Before the first call
nothing is recorded: an offline engine that never takes them keeps no log.

Sliding window (a model whose every layer attends to its last ``sliding_window``
positions only, as Mistral v0.1): a running request's blocks that no later query can see
are freed as its context grows (``free_outside_window``), so a long sequence holds about
``sliding_window / block_size + 1`` blocks. Their block-table entries become
``FREED_BLOCK``, keeping every later entry at its position's index; the attention kernels
never read a block wholly before the window (``kernels/paged_attention.py``). A freed
block keeps its hash, like any freed block: another request with the same prefix may
still find it until it is reused.

Fragmentation (``fragmentation``): of the slots in blocks held by requests, the share that
holds no token (internal fragmentation: the unfilled tail of each running request's last
block, and blocks reserved ahead of its tokens), beside what reserving ``max_model_len``
contiguous slots per running request would leave empty on the same requests: the
comparison of the PagedAttention paper (section 3, "Memory Management in Existing
Systems"), whose contiguous systems reserve a request's maximum length up front.

Source: Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention" (SOSP 2023); vLLM v1 ``KVCacheManager``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, mul, sub

from shared.block_hashes import BlockHasher
from worker.backends.kv_events import NO_KV_EVENTS, KVEventLog, KVEvents
from worker.engine.request import Request

#: ``Block.hash`` of a block that is not in the prefix cache.
NO_HASH = b""
#: Block-table entry of a block released by ``free_outside_window``: not a block id
#: (no block is ever read or written through it).
FREED_BLOCK = -1
_token_ids = attrgetter("token_ids")
_block_table = attrgetter("block_table")


@dataclass(slots=True)
class Block:
    """One physical block. ``hash`` (``shared/block_hashes.py``, 16 bytes) is
    ``NO_HASH`` until the block is full and registered in the prefix cache."""

    block_id: int
    ref_count: int = 0
    hash: bytes = NO_HASH


@dataclass(frozen=True, slots=True)
class KVFragmentation:
    """How full the KV slots of the running requests are, in slots (one slot holds one
    token's K and V in every layer).

    ``num_allocated_slots``: ``block_size`` times the blocks held by requests, each shared
    (prefix-cached) block once; ``num_empty_slots``: of those, the slots past each
    request's tokens (the unfilled end of its last block, and blocks reserved ahead);
    ``num_tokens``: the running requests' tokens (prompt and outputs so far), each request
    counting its own (a shared prefix once per request, as contiguous copies would hold
    it); ``num_contiguous_slots``: ``max_model_len`` per running request.
    """

    num_allocated_slots: int = 0
    num_empty_slots: int = 0
    num_tokens: int = 0
    num_contiguous_slots: int = 0

    @property
    def internal_fragmentation(self) -> float:
        """Share of the allocated slots that hold no token (0..1; 0 when none is allocated)."""
        return self.num_empty_slots / self.num_allocated_slots if self.num_allocated_slots else 0.0

    @property
    def contiguous_waste_ratio(self) -> float:
        """Share of ``num_contiguous_slots`` that would hold no token (0..1; 0 with no
        running request)."""
        return 1.0 - self.num_tokens / self.num_contiguous_slots if self.num_contiguous_slots else 0.0


class BlockManager:
    """Owns every KV block: which are free, which are cached, who holds which.

    Invariants: a block is in ``_free`` iff its ``ref_count`` is 0; a hash maps to at
    most one block in ``_cached``; ``num_free_blocks`` counts cached-but-free blocks
    as free (they are evictable).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        """``sliding_window``: tokens every layer of the model attends back to (the query
        at position p sees p - sliding_window < k <= p), or None (full attention)."""
        assert num_blocks > 0 and block_size > 0
        assert sliding_window is None or sliding_window > 0
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        # Per request: how many of its blocks ``cache_full_blocks`` has registered.
        self._num_registered: dict[str, int] = {}
        # Per request: how many of its first blocks ``free_outside_window`` released.
        self._num_freed: dict[str, int] = {}
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        #: Cache changes since the last ``take_kv_events`` (None: never taken, none kept).
        self._kv_events: KVEventLog | None = None

    # -- queries -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0..1)."""
        return 1.0 - len(self._free) / self.num_blocks

    def fragmentation(self, running: Iterable[Request], max_model_len: int) -> KVFragmentation:
        """The KV fragmentation of ``running``, every request that holds blocks
        (``KVFragmentation``; ``max_model_len`` in tokens).

        A request's slots are those of its block table (a sliding window's released
        blocks, ``FREED_BLOCK`` entries, count as holding their tokens, so they cancel
        out); its empty ones are those past its tokens, the prompt and the outputs sampled
        so far, whether their KV is written or being written by the step in flight (so a
        prefill chunk never reads as empty; a token sampled on the device and not yet
        appended does, for one step). Only full, computed blocks are ever shared, so each
        empty slot belongs to one request. Cost: C-level passes over ``running`` (it runs
        with every step's load figures).
        """
        running = list(running)
        bs = self.block_size
        num_tokens = list(map(len, map(_token_ids, running)))
        table_slots = map(mul, map(len, map(_block_table, running)), repeat(bs))
        num_empty = sum(map(max, map(sub, table_slots, num_tokens), repeat(0)))
        num_allocated = (self.num_blocks - len(self._free)) * bs
        return KVFragmentation(num_allocated_slots=num_allocated, num_empty_slots=min(num_empty, num_allocated),
                               num_tokens=sum(num_tokens), num_contiguous_slots=len(running) * max_model_len)

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so the request can hold ``num_computed_tokens + num_new_tokens``."""
        total = request.num_computed_tokens + num_new_tokens
        needed = -(-total // self.block_size)
        return max(0, needed - len(request.block_table))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request, num_new_tokens) <= len(self._free)

    # -- prefix caching ----------------------------------------------------------
    def block_hash_at(self, request: Request, index: int) -> bytes:
        """The hash of the request's full block ``index`` (``index < num_tokens //
        block_size``), which depends on every block before it (``shared.block_hashes``). Each
        block of a request is hashed once (``Request.block_hasher`` keeps them), however
        often it is looked up; blocks up to ``index`` not hashed yet are hashed in one go."""
        hasher = request.block_hasher
        if hasher is None:
            hasher = request.block_hasher = BlockHasher(self.block_size)
        hashes = hasher.hashes
        if index >= len(hashes):
            assert index < request.num_tokens // self.block_size, (index, request.num_tokens)
            hasher.extend(request.token_ids, index + 1)
        return hashes[index]

    def num_lookup_blocks(self, request: Request) -> int:
        """Full blocks a lookup may take from the cache: at most ``num_tokens - 1``
        tokens, so at least one token is computed and yields logits."""
        return (request.num_tokens - 1) // self.block_size

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids that already hold a prefix of the request's tokens (at most
        ``num_lookup_blocks``); hashes only up to the first miss."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        for i in range(self.num_lookup_blocks(request)):
            block_id = self._cached.get(self.block_hash_at(request, i))
            if block_id is None:
                break
            found.append(block_id)
        return found

    def allocate_prefix(self, request: Request, block_ids: list[int]) -> None:
        """Attach cached blocks to a request that holds none and mark them computed."""
        assert not request.block_table and request.num_computed_tokens == 0
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        request.block_table = list(block_ids)
        request.num_computed_tokens = len(block_ids) * self.block_size
        request.num_cached_tokens = request.num_computed_tokens
        self._num_registered[request.request_id] = len(block_ids)

    def num_registered_blocks(self, request: Request) -> int:
        """How many of the request's leading blocks ``cache_full_blocks`` has handled
        (registered in the prefix cache, or found there at admission): a block past
        them may be computed on the device already (a step in flight, ``Scheduler.ahead_of``)
        but no lookup finds it yet."""
        return self._num_registered.get(request.request_id, 0)

    def record_admission(self, request: Request) -> None:
        """Count an admitted request's prompt lookup in the hit-rate counters (tokens)."""
        if self.enable_prefix_caching:
            self.num_prefix_queries += request.num_tokens
            self.num_prefix_hits += request.num_cached_tokens

    # -- allocation --------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Grow the request's block table to hold ``num_new_tokens`` more tokens.

        Raises:
            RuntimeError: not enough free blocks (call ``can_allocate`` first).
        """
        needed = self.blocks_needed(request, num_new_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"need {needed} blocks, {len(self._free)} free")
        for _ in range(needed):
            block_id, _ = self._free.popitem(last=False)  # least recently freed
            block = self.blocks[block_id]
            if block.hash != NO_HASH:  # evict the cached content it held
                if self._cached.get(block.hash) == block_id:
                    del self._cached[block.hash]
                    if self._kv_events is not None:
                        self._kv_events.remove(block.hash)
                block.hash = NO_HASH
            block.ref_count = 1
            request.block_table.append(block_id)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly filled blocks (up to ``num_computed_tokens``)."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        first = max(self._num_registered.get(request.request_id, 0), self._num_freed.get(request.request_id, 0))
        self._num_registered[request.request_id] = max(first, num_full)
        for i in range(first, num_full):
            h = self.block_hash_at(request, i)
            block = self.blocks[request.block_table[i]]
            if block.hash == NO_HASH and h not in self._cached:
                block.hash = h
                self._cached[h] = block.block_id
                if self._kv_events is not None:
                    self._kv_events.store(h)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, and clear its block table."""
        for block_id in reversed(request.block_table):
            if block_id != FREED_BLOCK:
                self._release(block_id)
        request.block_table = []
        self._num_registered.pop(request.request_id, None)
        self._num_freed.pop(request.request_id, None)

    def free_tail(self, request: Request) -> int:
        """Release the request's blocks past the one that holds position
        ``num_computed_tokens - 1`` (speculative decoding's rollback: rejected drafts'
        KV lies beyond ``num_computed_tokens``). They were never full of computed tokens,
        so none is registered in the prefix cache.

        Returns:
            How many blocks this call released.
        """
        keep = -(-request.num_computed_tokens // self.block_size)
        table = request.block_table
        num_released = max(len(table) - keep, 0)
        for block_id in reversed(table[keep:]):
            self._release(block_id)
        del table[keep:]
        return num_released

    def free_outside_window(self, request: Request) -> int:
        """With a sliding window, release the request's blocks that lie wholly before the
        window of every query it will still run, and mark them ``FREED_BLOCK`` in its
        block table. Call after ``num_computed_tokens`` grew (and ``cache_full_blocks``).

        Every later query sits at a position ``p >= num_computed_tokens`` (a decode step
        already in flight included: its token is the one at ``num_computed_tokens``) and
        sees keys from ``p - sliding_window + 1`` on, so block ``i`` can go once
        ``(i + 1) * block_size <= num_computed_tokens - sliding_window + 1``.

        Returns:
            How many blocks this call released (0 without a window).
        """
        if self.sliding_window is None:
            return 0
        first_key = request.num_computed_tokens - self.sliding_window + 1
        num_out = max(first_key, 0) // self.block_size
        first = self._num_freed.get(request.request_id, 0)
        table = request.block_table
        for i in range(first, num_out):
            self._release(table[i])
            table[i] = FREED_BLOCK
        if num_out > first:
            self._num_freed[request.request_id] = num_out
        return max(num_out - first, 0)

    def _release(self, block_id: int) -> None:
        """Drop one reference to a block; at none it is free (and stays cached)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self._free[block_id] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their data); a "cleared" KV event."""
        for block in self.blocks:
            block.hash = NO_HASH
        self._cached.clear()
        self._num_registered.clear()  # running requests register their full blocks again
        if self._kv_events is not None:
            self._kv_events.clear()

    # -- KV events -----------------------------------------------------------------
    def take_kv_events(self, snapshot: bool = False) -> KVEvents:
        """The prefix cache's net changes since the last call (module docstring); the
        first call starts the recording and returns none. Never any with prefix caching
        off. ``snapshot``: instead, the whole cache as it is (``cleared`` and every cached
        hash ``stored``), so a KV index that drifted (a gateway's prediction that never
        came true) is replaced by the truth."""
        if self._kv_events is None:
            self._kv_events = KVEventLog()
            return NO_KV_EVENTS
        if snapshot:
            self._kv_events.take()
            return KVEvents(stored=tuple(self._cached), cleared=True)
        return self._kv_events.take()
