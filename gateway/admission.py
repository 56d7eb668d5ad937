"""Admission control and enqueue: refuse work when the model's queue is full (429),
answer 503 when Redis is unreachable, and put accepted requests on their (class, tenant)
stream through the fair queue's enqueue script (``shared/fair_queue.py``): one request's
child requests (gateway/choices.py) in one atomic step, all of them or none."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import redis.exceptions

from gateway.errors import OpenAIError
from shared.fair_queue import FairQueue
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


class QueueDepthReader:
    """The model's queue depth for admission (waiting entries summed over every class and
    tenant stream, ``FairQueue.num_waiting``), one Redis read shared by every admission
    that arrives while it is in flight (single flight).

    A gateway admitting 1,000 requests at once used to read XLEN + XPENDING once per
    request: a pipeline round trip each, about a quarter of its CPU during the burst
    (py-spy, 2026-11-24). Now an admission joins the read in flight, or starts one when
    none is; a later admission never reuses a finished read, so sequential requests each
    see a fresh depth. Admissions that shared a read count each other's children.
    """

    def __init__(self, queue: FairQueue) -> None:
        self._queue = queue
        self._read: _SharedRead | None = None

    async def depth(self) -> tuple[int, _SharedRead]:
        """``(depth, read)``: waiting requests as of the shared read plus the children
        admitted on it so far; pass ``read`` to ``admitted`` once the check passes.

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable.
        """
        read = self._read
        if read is None:
            read = self._read = _SharedRead(asyncio.ensure_future(self._queue.num_waiting()))
            read.future.add_done_callback(lambda _: self._forget(read))
        return await asyncio.shield(read.future) + read.num_admitted, read

    def _forget(self, read: _SharedRead) -> None:
        if self._read is read:
            self._read = None


class _SharedRead:
    """One depth read in flight and the children admitted on its figure."""

    __slots__ = ("future", "num_admitted")

    def __init__(self, future: asyncio.Future[int]) -> None:
        self.future = future
        self.num_admitted = 0


async def check_queue(reader: QueueDepthReader, max_queue_len: int, num_new: int = 1) -> None:
    """Refuse ``num_new`` new requests (one client request's children) when they would
    take the stream past ``max_queue_len`` waiting requests.

    The check and the later XADD are not atomic: concurrent requests can overshoot the
    limit by the number of gateways' in-flight admissions, which is acceptable for a soft
    limit.

    Raises:
        OpenAIError: 429 with ``Retry-After`` when full; 503 when Redis is unreachable.
    """
    with redis_guard("queue depth"):
        depth, read = await reader.depth()
    if depth + num_new > max_queue_len:
        raise OpenAIError(429, f"the request queue is full ({depth} waiting); retry later",
                          code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    read.num_admitted += num_new


class Enqueuer:
    """Puts accepted requests on their (class, tenant) stream of the model's fair queue.

    A single-child request without an X-Request-Id (the common case) goes through a group
    commit: enqueue scripts that arrive while one batch is being written go out together
    in the next non-transactional pipeline, one round trip on one connection. Under a burst of
    1,000 requests, one XADD each had every request take its own pooled connection (the
    pool's lock and 1,000 connection handshakes) and a round trip; with this and the shared
    depth read the gateway's CPU for such a burst fell from 1.40 to 0.85 s (2-core CPU,
    docs/benchmarks.md, "Where the wall time goes, and two changes"). Each script
    is atomic on its own, so batching them changes nothing about what a failure leaves.
    """

    def __init__(self, queue: FairQueue) -> None:
        self._queue = queue
        self._batch: list[tuple[str, GenerateRequest, asyncio.Future[bytes]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def enqueue(self, stream: str, requests: list[GenerateRequest], request_id_key: str | None = None,
                      wire_id: str = "", ttl_s: int = 0) -> list[bytes]:
        """XADD ``requests`` (one client request's children, all of one class and tenant)
        to ``stream`` in one atomic step (``FairQueue.enqueue``; a lone request: the group
        commit): all of them or none. Returns their entry ids, in order. With
        ``request_id_key`` (a client-supplied id), the XADDs happen only if that key did
        not exist; the key then holds ``wire_id`` until the request ends
        (``gateway/request_ids.py`` deletes it) or for ``ttl_s`` seconds at most, so the
        same id does not run twice at once.

        Raises:
            OpenAIError: 409 duplicate request id; 503 when Redis is unreachable or refuses
                the write (e.g. out of memory).
        """
        with redis_guard("enqueue"):
            try:
                if request_id_key is None and len(requests) == 1:
                    return [await self._add_to_batch(stream, requests[0])]
                entry_ids = await self._queue.enqueue(stream, requests, request_id_key=request_id_key,
                                                      wire_id=wire_id, ttl_s=ttl_s)
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
                try:
                    async with self._queue.client.pipeline(transaction=False) as pipe:
                        for stream, request, _ in batch:
                            await self._queue.enqueue(stream, [request], pipe=pipe)
                        results = await pipe.execute(raise_on_error=False)
                except Exception as exc:  # noqa: BLE001 - connection lost: every enqueue of the batch fails
                    results = [exc] * len(batch)
                for (_, _, future), result in zip(batch, results, strict=True):
                    if future.done():
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result[0])
        finally:
            self._writer = None
            for _, _, future in batch + self._batch:
                if not future.done():
                    future.set_exception(redis.exceptions.ConnectionError("the enqueue writer stopped"))
            self._batch = []
