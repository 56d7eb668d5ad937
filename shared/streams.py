"""Operations on a model's request stream that the gateway, the worker and
``inferq queues`` share (async, ``redis.asyncio``).

Invariant behind the queue depth: a request's entry stays on the stream until it is
finished, and finishing it is XACK **and** XDEL (``add_finish``). The stream then holds
only queued and running requests, so ``XLEN - pending`` is the number of requests no
worker has taken yet (docs/architecture.md, "Design decisions"). Key names are in
``shared/keys.py``, payloads in ``shared/protocol.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared import protocol
from shared.keys import CONSUMER_GROUP
from shared.protocol import ErrorMessage

#: Most pending entries read per stream to count redeliveries (bounds the cost of one
#: read when thousands are pending; the count then covers only the first ones).
MAX_SCANNED_PENDING = 1000


def as_text(value: Any) -> str:
    """A reply field (``bytes`` from a client without ``decode_responses``) as ``str``."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _is_nogroup(reply: object) -> bool:
    return isinstance(reply, ResponseError) and "NOGROUP" in str(reply)


def num_waiting(length: int, num_pending: int) -> int:
    """Entries not yet delivered to any worker: ``XLEN - pending`` (never below 0; the
    two numbers may come from different moments)."""
    return max(0, length - num_pending)


def parse_pending_summary(summary: Any) -> int:
    """Number of pending entries in an XPENDING summary reply (redis-py answers a dict
    with ``pending``; a raw reply is a list whose first item is the count)."""
    return int(summary["pending"] if isinstance(summary, dict) else summary[0])


@dataclass(frozen=True, slots=True)
class QueueDepth:
    """A stream's length and its group's pending entries, read in one round trip.

    ``length``: XLEN (entries); ``num_pending``: delivered, not yet acknowledged
    (entries running on some worker); ``has_group``: the ``workers`` group exists.
    """

    length: int
    num_pending: int
    has_group: bool

    @property
    def num_waiting(self) -> int:
        """Entries no worker has taken yet (the queue depth)."""
        return num_waiting(self.length, self.num_pending)


async def read_depth(client: aioredis.Redis, stream: str) -> QueueDepth:
    """XLEN and the XPENDING summary of ``stream`` in one pipeline. A missing stream
    reads as empty, a missing group as nothing pending.

    Raises:
        redis.exceptions.RedisError, OSError: Redis unreachable (or a reply other than
        NOGROUP that is an error).
    """
    async with client.pipeline(transaction=False) as pipe:
        pipe.xlen(stream)
        pipe.xpending(stream, CONSUMER_GROUP)
        length, summary = await pipe.execute(raise_on_error=False)
    if isinstance(length, Exception):
        raise length
    if _is_nogroup(summary):
        return QueueDepth(length=int(length), num_pending=0, has_group=False)
    if isinstance(summary, Exception):
        raise summary
    return QueueDepth(length=int(length), num_pending=parse_pending_summary(summary), has_group=True)


async def queue_depth(client: aioredis.Redis, stream: str) -> int:
    """Requests waiting on ``stream``, not yet taken by a worker (``read_depth``).

    Raises:
        redis.exceptions.RedisError, OSError: Redis unreachable.
    """
    return (await read_depth(client, stream)).num_waiting


class PendingEntry(msgspec.Struct, kw_only=True):
    """One delivered, unacknowledged stream entry. ``idle_ms``: since its last delivery."""

    entry_id: str
    consumer: str
    idle_ms: int
    num_deliveries: int

    @property
    def redelivered(self) -> bool:
        """Delivered more than once: claimed from a dead consumer (or re-read after one)."""
        return self.num_deliveries > 1


async def pending_entries(client: aioredis.Redis, stream: str, count: int) -> list[PendingEntry]:
    """The first ``count`` pending entries of ``stream``'s group (XPENDING with a range),
    oldest first.

    Raises:
        redis.exceptions.ResponseError: no such stream or group.
        redis.exceptions.RedisError, OSError: Redis unreachable.
    """
    raw = await client.xpending_range(stream, CONSUMER_GROUP, min="-", max="+", count=count)
    return [PendingEntry(entry_id=as_text(p["message_id"]), consumer=as_text(p["consumer"]),
                         idle_ms=int(p["time_since_delivered"]), num_deliveries=int(p["times_delivered"]))
            for p in raw]


def add_finish(pipe: Any, stream: str, entry_id: bytes | str) -> None:
    """Queue the finish of an entry on ``pipe`` (a redis-py pipeline, transactional or
    not): XACK it in the ``workers`` group, then XDEL it (two replies on the pipeline)."""
    pipe.xack(stream, CONSUMER_GROUP, entry_id)
    pipe.xdel(stream, entry_id)


async def finish_entry(client: aioredis.Redis, stream: str, entry_id: bytes | str, *,
                       error: ErrorMessage | None = None, reply_channel: str = "") -> None:
    """Finish one entry (XACK + XDEL); with ``error``, first PUBLISH it on
    ``reply_channel``, all in one pipeline (one round trip, in this order).

    Without the group (Redis restarted and lost it) nothing is pending, so there is
    nothing to acknowledge: XACK then acks 0 entries, and a NOGROUP reply is ignored.

    Raises:
        ValueError: ``error`` without ``reply_channel``.
        redis.exceptions.RedisError, OSError: Redis unreachable, or a command failed
        otherwise than with NOGROUP.
    """
    if error is not None and not reply_channel:
        raise ValueError("an error message needs the reply_channel to publish it on")
    async with client.pipeline(transaction=False) as pipe:
        if error is not None:
            pipe.publish(reply_channel, protocol.encode(error))
        add_finish(pipe, stream, entry_id)
        replies = await pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, Exception) and not _is_nogroup(reply):
            raise reply
