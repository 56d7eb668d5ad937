"""KV events: what a worker's prefix cache gained and lost since they were last taken,
by block hash (``shared/block_hashes.py``, 16 bytes each). The worker publishes them
after each step into its KV index in Redis (``Keys.kv_index``: SADD stored, SREM
removed, DEL on cleared), where gateways read which worker holds a prompt's prefix
(``gateway/placement.py``). Dynamo's KV router and llm-d's precise prefix scorer feed
on vLLM's KV events the same way (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``).

Imports nothing of the engine: the block manager records them, every backend passes them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVEvents:
    """The net change of a prefix cache over an interval: with ``cleared``, the cache was
    emptied first (the index must be dropped), then ``stored`` hashes entered it and
    ``removed`` ones left it. ``stored`` and ``removed`` never share a hash, so the order
    of SADD and SREM does not matter."""

    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    cleared: bool = False

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)


#: No change.
NO_KV_EVENTS = KVEvents()


class KVEventLog:
    """Records cache changes and nets them until ``take``: a hash stored then removed
    counts as removed (it is gone; the SREM also drops a gateway's prediction of it,
    ``Keys.kv_index``), one removed then stored as stored. ``clear`` forgets everything
    recorded before it. Memory: one entry per hash changed since the last ``take``."""

    __slots__ = ("_cleared", "_removed", "_stored")

    def __init__(self) -> None:
        self._stored: dict[bytes, None] = {}  # insertion-ordered sets
        self._removed: dict[bytes, None] = {}
        self._cleared = False

    def store(self, block_hash: bytes) -> None:
        """``block_hash`` entered the cache."""
        self._removed.pop(block_hash, None)
        self._stored[block_hash] = None

    def remove(self, block_hash: bytes) -> None:
        """``block_hash`` left the cache (its block was evicted)."""
        self._stored.pop(block_hash, None)
        self._removed[block_hash] = None

    def clear(self) -> None:
        """The whole cache was dropped."""
        self._stored.clear()
        self._removed.clear()
        self._cleared = True

    def extend(self, events: KVEvents) -> None:
        """Record ``events`` (taken from another log) as if they happened now."""
        if events.cleared:
            self.clear()
        for h in events.stored:
            self.store(h)
        for h in events.removed:
            self.remove(h)

    def take(self) -> KVEvents:
        """The net change since the last ``take``; the log starts empty again."""
        if not (self._stored or self._removed or self._cleared):
            return NO_KV_EVENTS
        events = KVEvents(tuple(self._stored), tuple(self._removed), self._cleared)
        self._stored, self._removed, self._cleared = {}, {}, False
        return events


def merge_kv_events(first: KVEvents, then: KVEvents) -> KVEvents:
    """The net change of ``first`` followed by ``then``."""
    if not first:
        return then
    if not then:
        return first
    log = KVEventLog()
    log.extend(first)
    log.extend(then)
    return log.take()
