"""Admission control and enqueue: put accepted requests on their (class, tenant) stream
through the fair queue's enqueue script (``shared/fair_queue.py``), which also refuses
them when the model's queue is full (429): one request's child requests
(gateway/choices.py) in one atomic step with the depth check, all of them or none; 503
when Redis is unreachable."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import redis.exceptions

from gateway.errors import OpenAIError
from shared.fair_queue import FairQueue, QueueFull
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


class Enqueuer:
    """Puts accepted requests on their (class, tenant) stream of the model's fair queue,
    refusing them when it holds ``max_queue_len`` waiting requests (the check is inside
    the enqueue script, so it is exact however many gateways admit at once).

    A single-child request without an X-Request-Id (the common case) goes through a group
    commit: enqueue scripts that arrive while one batch is being written go out together
    in the next non-transactional pipeline, one round trip on one connection
    (``FairQueue.enqueue_batch``). Under a burst of 1,000 requests, one XADD each had
    every request take its own pooled connection (the pool's lock and 1,000 connection
    handshakes) and a round trip; with the group commit (and a depth read shared then,
    before admission moved into the script) the gateway's CPU for such a burst fell from
    1.40 to 0.85 s (2-core CPU, docs/benchmarks.md, "Where the wall time goes, and two
    changes"). Each script is atomic on its own, so batching them changes nothing about
    what a failure leaves.
    """

    def __init__(self, queue: FairQueue, max_queue_len: int) -> None:
        self._queue = queue
        self._max_waiting = max(0, max_queue_len)
        self._batch: list[tuple[str, GenerateRequest, asyncio.Future[bytes]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def enqueue(self, stream: str, requests: list[GenerateRequest], request_id_key: str | None = None,
                      wire_id: str = "", ttl_s: int = 0) -> list[bytes]:
        """XADD ``requests`` (one client request's children, all of one class and tenant)
        to ``stream`` in one atomic step (``FairQueue.enqueue``; a lone request: the group
        commit): all of them or none, and none when the model's waiting requests plus them
        would exceed ``max_queue_len``. Returns their entry ids, in order. With
        ``request_id_key`` (a client-supplied id), the XADDs happen only if that key did
        not exist; the key then holds ``wire_id`` until the request ends
        (``gateway/request_ids.py`` deletes it) or for ``ttl_s`` seconds at most, so the
        same id does not run twice at once.

        Raises:
            OpenAIError: 409 duplicate request id; 429 queue full (with ``Retry-After``);
                503 when Redis is unreachable or refuses the write (e.g. out of memory).
        """
        with redis_guard("enqueue"):
            try:
                if request_id_key is None and len(requests) == 1:
                    return [await self._add_to_batch(stream, requests[0])]
                entry_ids = await self._queue.enqueue(stream, requests, request_id_key=request_id_key,
                                                      wire_id=wire_id, ttl_s=ttl_s, max_waiting=self._max_waiting)
            except QueueFull as exc:
                raise OpenAIError(429, f"the request queue is full ({exc.num_waiting} waiting); retry later",
                                  code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
            except redis.exceptions.ResponseError as exc:
                raise OpenAIError(503, f"Redis refused the request ({exc})", code="redis_unavailable") from exc
        if entry_ids is None:
            raise OpenAIError(409, "a request with this X-Request-Id is still in flight; send it again after it ends",
                              param="X-Request-Id", code="duplicate_request")
        return list(entry_ids)

    async def _add_to_batch(self, stream: str, request: GenerateRequest) -> bytes:
        """One enqueue through the group commit; its entry id, or its error raised."""
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._batch.append((stream, request, future))
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_batches())
        # Shielded: a client that leaves must not cancel the write of everyone's batch.
        return await asyncio.shield(future)

    async def _write_batches(self) -> None:
        """Write batches until none is waiting; every future gets its entry id or error
        (also when this task is cancelled: the XADDs not confirmed fail as unreachable)."""
        batch: list[tuple[str, GenerateRequest, asyncio.Future[bytes]]] = []
        try:
            while self._batch:
                batch, self._batch = self._batch, []
                results: list[list[bytes] | Exception]
                try:
                    results = await self._queue.enqueue_batch([(stream, request) for stream, request, _ in batch],
                                                              max_waiting=self._max_waiting)
                except Exception as exc:  # noqa: BLE001 - connection lost: every enqueue of the batch fails
                    results = [exc] * len(batch)
                for (_, _, future), result in zip(batch, results, strict=True):
                    if future.done():
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result[0])
        finally:
            self._writer = None
            for _, _, future in batch + self._batch:
                if not future.done():
                    future.set_exception(redis.exceptions.ConnectionError("the enqueue writer stopped"))
            self._batch = []
