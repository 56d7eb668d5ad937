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


# SET NX the request-id key and XADD in one atomic step: either both happen or neither
# (a duplicate id adds nothing to the stream).
_ENQUEUE_ONCE = """
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[2]) then
  return redis.call('XADD', KEYS[1], '*', ARGV[3], ARGV[1])
end
return false
"""


async def enqueue(client: aioredis.Redis, stream: str, request: GenerateRequest,
                  request_id_key: str | None = None, ttl_s: int = 0) -> bytes:
    """XADD ``request`` to ``stream``; returns the entry id. With ``request_id_key``
    (a client-supplied id), the XADD happens only if that key did not exist, and the key
    is kept for ``ttl_s`` seconds, so the same id sent twice does not run twice.

    Raises:
        OpenAIError: 409 duplicate request id; 503 when Redis is unreachable.
    """
    payload = protocol.encode(request)
    with redis_guard("enqueue"):
        if request_id_key is None:
            return await client.xadd(stream, {STREAM_FIELD: payload})
        entry_id = await client.eval(_ENQUEUE_ONCE, 2, stream, request_id_key, payload, max(1, ttl_s),
                                     STREAM_FIELD)
    if entry_id is None:
        raise OpenAIError(409, f"a request with id {request.request_id!r} was already submitted",
                          param="X-Request-Id", code="duplicate_request")
    return entry_id
