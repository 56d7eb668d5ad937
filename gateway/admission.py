"""Admission control and enqueue: refuse work when the model's queue is full (429),
answer 503 when Redis is unreachable, and put accepted requests on the stream with one
XADD (nothing half-written)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import redis.asyncio as aioredis
import redis.exceptions

from gateway.errors import OpenAIError
from shared import protocol
from shared.keys import CONSUMER_GROUP, STREAM_FIELD
from shared.protocol import GenerateRequest

#: ``Retry-After`` of a 429, seconds.
RETRY_AFTER_S = 1

_UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


@contextlib.contextmanager
def redis_guard(what: str) -> Iterator[None]:
    """Turn Redis connection failures inside the block into a 503 ``OpenAIError``."""
    try:
        yield
    except _UNAVAILABLE as exc:
        raise OpenAIError(503, f"Redis is unavailable ({what}): {exc}", code="redis_unavailable") from exc


async def queue_depth(client: aioredis.Redis, stream: str) -> int:
    """Requests waiting on ``stream``, not yet taken by a worker: XLEN minus the
    consumer group's pending entries (workers XDEL entries they finish). A missing
    stream or group counts as empty / nothing pending.

    Raises:
        redis.exceptions.ConnectionError: Redis unreachable.
    """
    length = int(await client.xlen(stream))
    if length == 0:
        return 0
    try:
        summary = await client.xpending(stream, CONSUMER_GROUP)
    except redis.exceptions.ResponseError as exc:
        if "NOGROUP" not in str(exc):
            raise
        return length
    pending = int(summary.get("pending", 0) if isinstance(summary, dict) else summary[0])
    return max(0, length - pending)


async def check_queue(client: aioredis.Redis, stream: str, max_queue_len: int) -> None:
    """Refuse a new request when ``stream`` holds ``max_queue_len`` waiting requests.

    The check and the later XADD are not atomic: concurrent requests can overshoot the
    limit by the number of gateways' in-flight admissions, which is acceptable for a soft
    limit.

    Raises:
        OpenAIError: 429 with ``Retry-After`` when full; 503 when Redis is unreachable.
    """
    with redis_guard("queue depth"):
        depth = await queue_depth(client, stream)
    if depth >= max_queue_len:
        raise OpenAIError(429, f"the request queue is full ({depth} waiting); retry later",
                          code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


async def enqueue(client: aioredis.Redis, stream: str, request: GenerateRequest) -> bytes:
    """XADD ``request`` to ``stream``; returns the entry id.

    Raises:
        OpenAIError: 503 when Redis is unreachable.
    """
    with redis_guard("enqueue"):
        return await client.xadd(stream, {STREAM_FIELD: protocol.encode(request)})
