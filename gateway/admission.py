"""Admission control and enqueue: put accepted requests on their (class, tenant) stream
through the fair queue's enqueue script (``shared/fair_queue.py``), which also refuses
them when the model's queue is full (429): one request's child requests
(gateway/choices.py) in one atomic step with the depth check, all of them or none; 503
when Redis is unreachable. An enqueue that could not reach Redis (no connection: e.g. the
primary just died and Sentinel has not promoted a replica yet) is sent again for up to
``ENQUEUE_RETRY_S`` (``shared/redis_connect.py``, ``retry_unsent``: it was never sent,
so it is never written twice), then answered 503."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import redis.exceptions
from redis.asyncio.client import Pipeline

from gateway.errors import OpenAIError
from gateway.placement import PlacementDecision, PlacementQuery, Placer
from shared.fair_queue import FairQueue, Placement, QueueFull
from shared.protocol import GenerateRequest
from shared.redis_connect import retry_unsent

log = logging.getLogger(__name__)

#: ``Retry-After`` of a 429, seconds.
RETRY_AFTER_S = 1
#: How long an enqueue that reached no Redis is tried again before its 503, s.
ENQUEUE_RETRY_S = 2.0

_UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


@contextlib.contextmanager
def redis_guard(what: str) -> Iterator[None]:
    """Turn Redis connection failures inside the block into a 503 ``OpenAIError``."""
    try:
        yield
    except _UNAVAILABLE as exc:
        raise OpenAIError(503, f"Redis is unavailable ({what}): {exc}", code="redis_unavailable") from exc


@dataclass(frozen=True, slots=True)
class Enqueued:
    """Where accepted requests went: their entry ids (in order), the stream that holds
    them (a worker's placed stream, or the (class, tenant) stream asked for) and the
    placement decision (None: no placement was made, the shared stream)."""

    entry_ids: list[bytes]
    stream: str
    decision: PlacementDecision | None


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
    1.40 to 0.85 s (2-core CPU, docs/benchmarks.md, "Admission and the enqueue path"). Each script is atomic on its own, so batching them changes nothing about
    what a failure leaves.
    """

    def __init__(self, queue: FairQueue, max_queue_len: int, placer: Placer | None = None) -> None:
        self._queue = queue
        self._max_waiting = max(0, max_queue_len)
        #: Chooses each request's worker (``gateway/placement.py``); None: shared streams only.
        self.placer = placer
        self._batch: list[tuple[str, GenerateRequest, PlacementQuery | None, asyncio.Future[Enqueued]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def enqueue(self, stream: str, requests: list[GenerateRequest], request_id_key: str | None = None,
                      wire_id: str = "", ttl_s: int = 0, query: PlacementQuery | None = None) -> Enqueued:
        """XADD ``requests`` (one client request's children, all of one class and tenant)
        to ``stream``, or to the worker that placement chooses for ``query`` (its prompt,
        ``Placer.query``; None: ``stream``), in one atomic step (``FairQueue.enqueue``; a
        lone request: the group commit): all of them or none, and none when the model's
        waiting requests plus them would exceed ``max_queue_len``. Returns where they
        went (``Enqueued``). With
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
                    return await self._add_to_batch(stream, requests[0], query)
                decision, predicted = (await self._place([query]))[0]
                placement = decision.placement if decision is not None else None
                entry_ids = await retry_unsent(lambda: self._queue.enqueue(
                    stream, requests, request_id_key=request_id_key, wire_id=wire_id, ttl_s=ttl_s,
                    max_waiting=self._max_waiting, placement=placement), ENQUEUE_RETRY_S)
                if entry_ids is not None and predicted and placement is not None and placement.worker_id \
                        and self.placer is not None:
                    async with self._queue.client.pipeline(transaction=False) as pipe:
                        self.placer.add_predictions(pipe, [(placement.worker_id, predicted)])
                        await pipe.execute(raise_on_error=False)
            except QueueFull as exc:
                raise OpenAIError(429, f"the request queue is full ({exc.num_waiting} waiting); retry later",
                                  code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
            except redis.exceptions.ResponseError as exc:
                raise OpenAIError(503, f"Redis refused the request ({exc})", code="redis_unavailable") from exc
        if entry_ids is None:
            raise OpenAIError(409, "a request with this X-Request-Id is still in flight; send it again after it ends",
                              param="X-Request-Id", code="duplicate_request")
        return Enqueued(list(entry_ids), self._target(stream, placement), decision)

    def _target(self, stream: str, placement: Placement | None) -> str:
        """The stream that requests for ``stream`` with ``placement`` land on."""
        if placement is None or placement.worker_id is None:
            return stream
        return self._queue.placed_stream_of(stream, placement.worker_id)

    async def _place(self, queries: list[PlacementQuery | None]) -> list[tuple[PlacementDecision | None,
                                                                                list[bytes]]]:
        """``Placer.place``; without a placer, or when placement fails (Redis refused the
        read script: logged), every request goes to its shared stream."""
        if self.placer is None or not any(q is not None for q in queries):
            return [(None, []) for _ in queries]
        try:
            return await self.placer.place(queries)
        except redis.exceptions.ResponseError as exc:
            log.warning("placement failed, using the shared streams: %s", exc)
            return [(None, []) for _ in queries]

    async def _add_to_batch(self, stream: str, request: GenerateRequest, query: PlacementQuery | None) -> Enqueued:
        """One enqueue through the group commit; where it went, or its error raised."""
        future: asyncio.Future[Enqueued] = asyncio.get_running_loop().create_future()
        self._batch.append((stream, request, query, future))
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_batches())
        # Shielded: a client that leaves must not cancel the write of everyone's batch.
        return await asyncio.shield(future)

    async def _write_batches(self) -> None:
        """Write batches until none is waiting; every future gets its entry id or error
        (also when this task is cancelled: the XADDs not confirmed fail as unreachable)."""
        batch: list[tuple[str, GenerateRequest, PlacementQuery | None, asyncio.Future[Enqueued]]] = []
        try:
            while self._batch:
                batch, self._batch = self._batch, []
                results: list[list[bytes] | Exception]
                decisions: list[tuple[PlacementDecision | None, list[bytes]]] = [(None, [])] * len(batch)
                try:
                    decisions = await self._place([query for _, _, query, _ in batch])
                    placements = [d.placement if d is not None else None for d, _ in decisions]
                    predictions = [(p.worker_id, predicted)
                                   for p, (_, predicted) in zip(placements, decisions, strict=True)
                                   if p is not None and p.worker_id is not None and predicted]
                    placer = self.placer
                    items = [(stream, request, p)
                             for (stream, request, _, _), p in zip(batch, placements, strict=True)]
                    after = None if placer is None or not predictions else functools.partial(_predict, placer,
                                                                                              predictions)
                    results = await retry_unsent(functools.partial(
                        self._queue.enqueue_batch, items, max_waiting=self._max_waiting, after=after),
                        ENQUEUE_RETRY_S)
                except Exception as exc:  # noqa: BLE001 - connection lost: every enqueue of the batch fails
                    results = [exc] * len(batch)
                for (stream, _, _, future), result, (decision, _) in zip(batch, results, decisions, strict=True):
                    if future.done():
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        placement = decision.placement if decision is not None else None
                        future.set_result(Enqueued(result, self._target(stream, placement), decision))
        finally:
            self._writer = None
            for _, _, _, future in batch + self._batch:
                if not future.done():
                    future.set_exception(redis.exceptions.ConnectionError("the enqueue writer stopped"))
            self._batch = []


def _predict(placer: Placer, predictions: list[tuple[str, list[bytes]]], pipe: Pipeline) -> None:
    """``Placer.add_predictions`` with its arguments first (the group commit's ``after``)."""
    placer.add_predictions(pipe, predictions)
