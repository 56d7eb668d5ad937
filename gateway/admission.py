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
from shared.keys import STREAM_FIELD
from shared.protocol import GenerateRequest
from shared.streams import queue_depth

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


# SET NX the request-id key (value: the wire request id, so only this request frees it)
# and XADD in one atomic step: either both happen or neither (a duplicate id adds
# nothing to the stream).
_ENQUEUE_ONCE = """
if redis.call('SET', KEYS[2], ARGV[4], 'NX', 'EX', ARGV[2]) then
  return redis.call('XADD', KEYS[1], '*', ARGV[3], ARGV[1])
end
return false
"""


async def enqueue(client: aioredis.Redis, stream: str, request: GenerateRequest,
                  request_id_key: str | None = None, ttl_s: int = 0) -> bytes:
    """XADD ``request`` to ``stream``; returns the entry id. With ``request_id_key``
    (a client-supplied id), the XADD happens only if that key did not exist; the key
    then holds ``request.request_id`` until the request ends (``gateway/request_ids.py``
    deletes it) or for ``ttl_s`` seconds at most, so the same id does not run twice at
    once.

    Raises:
        OpenAIError: 409 duplicate request id; 503 when Redis is unreachable.
    """
    payload = protocol.encode(request)
    with redis_guard("enqueue"):
        if request_id_key is None:
            return await client.xadd(stream, {STREAM_FIELD: payload})
        entry_id = await client.eval(_ENQUEUE_ONCE, 2, stream, request_id_key, payload, max(1, ttl_s),
                                     STREAM_FIELD, request.request_id)
    if entry_id is None:
        raise OpenAIError(409, "a request with this X-Request-Id is still in flight; send it again after it ends",
                          param="X-Request-Id", code="duplicate_request")
    return entry_id
