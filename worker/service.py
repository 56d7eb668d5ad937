"""The worker's Redis adapter: a thin loop around an engine backend.

Each turn of the loop:
1. apply aborts received on the control channel;
2. pull only as many requests as the engine can admit (``num_admittable``), carrying at
   most ``max_waiting_prefill_tokens`` of prefill less what the engine holds uncomputed
   (``EngineStats.num_waiting_prefill_tokens``), with the fair queue's pull script
   (``shared/fair_queue.py``: per class, highest first, the worker's own placed stream,
   then the tenant with the smallest virtual token counter; a class the engine is full of
   still gets one request of a tenant that runs fewer of it than another, which the
   engine preempts one of the other's for; then, with room left, entries that waited
   ``steal_after_ms`` in another live worker's placed stream, or any in a dead one's:
   ``worker/placed.py``), and write the requests the engine holds plus those taken
   (``Keys.worker_held``, for placement); when the engine is idle and nothing waits,
   block briefly on the model's doorbell and the worker's own, which every enqueue rings;
3. run one engine step on the engine thread (``worker/engine_thread.py``), off the
   event loop, while the previous step's outputs are published;
4. start publishing this step's outputs: the step's KV events on the worker's KV index
   (``Keys.kv_index``: SADD stored, SREM removed, DEL cleared), the prompt tokens the
   engine holds uncomputed when that changed (``Keys.worker_load``), then one ``TokenBatch``
   per gateway (every request of that gateway with new tokens), and XACK + XDEL of the
   entries of finished requests, in one pipeline; requests whose gateway is gone (PUBLISH
   reached 0 subscribers) are aborted at the next turn.
A heartbeat task refreshes ``{ns}:worker:{id}`` with a TTL, carrying the engine's
progress (``worker/progress.py``: a step that hangs makes the worker read as dead); a
control task listens for aborts, and for announcements of requests queued in a class
above the lowest, which the engine may stop its step in progress or withhold a chained
one for, so that the next pull takes them (``worker/engine/arrivals.py``). On SIGTERM (``drain()``) the worker stops pulling, finishes what it holds, and
returns. The KV index is deleted when the worker starts and when it exits; the reaper
deletes a dead worker's (``worker/placed.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass

from redis.exceptions import RedisError, ResponseError

from shared import protocol
from shared.fair_queue import PREFILL_FIELD, PRIORITY_CLASSES, FairQueue, StealFrom, parse_arrival, stream_class_tenant
from shared.keys import CONSUMER_GROUP, HEARTBEAT_INTERVAL_S, HEARTBEAT_TTL_S, STREAM_FIELD, Keys
from shared.liveness import live_workers
from shared.protocol import AbortMessage, ErrorMessage, GenerateRequest, TokenBatch, TokenOutput, WorkerStatus
from shared.redis_connect import AsyncClient
from shared.redis_connect import pubsub as subscriber
from shared.settings import DEFAULT_STEAL_AFTER_MS
from shared.streams import add_finish, as_text, finish_entry
from worker.backends.base import EngineBackend, RequestOutput, RequestRejected
from worker.backends.kv_events import NO_KV_EVENTS, KVEvents, merge_kv_events
from worker.engine_thread import EngineThread
from worker.placed import add_kv_events, forget_dead_workers, placed_owners, steal_sources
from worker.progress import OutputLengths, StepClock, StepTrace

#: How often a worker replaces its KV index with its whole prefix cache, seconds
#: (``Worker._take_kv_events``). The rewrite is one DEL and one SADD in the step's publish
#: pipeline; it also drops the predictions of prompts placed here and not yet computed,
#: which then place by load for a moment.
KV_INDEX_RESYNC_S = 60.0

log = logging.getLogger(__name__)

#: How long an idle worker blocks on the doorbell (BLPOP) before it looks again, ms.
IDLE_BLOCK_MS = 100
#: Back-off after a Redis error, seconds.
RECONNECT_DELAY_S = 0.5
#: How often the reaper looks for entries held by dead consumers (and refreshes the
#: placed streams this worker may take entries from), seconds.
REAP_INTERVAL_S = 2.0
#: ``max_waiting_prefill_tokens`` -1 means this many steps' ``max_num_batched_tokens``.
DEFAULT_PREFILL_STEPS = 4
#: Entries of a dead consumer are claimed once idle this long (2 heartbeat TTLs: the
#: gateway's own failover, which reacts after one TTL, normally gets there first), ms.
REAP_MIN_IDLE_MS = 2 * HEARTBEAT_TTL_S * 1000
#: A dead consumer with nothing pending is removed from the group after this idle time, ms.
DEAD_CONSUMER_IDLE_MS = 60_000


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(slots=True)
class InFlight:
    """Where a running request came from (its stream and entry) and where its tokens go;
    ``num_resumed_tokens``: the outputs it came with (a continuation), not generated here."""

    stream: str
    entry_id: bytes
    reply_channel: str
    attempt: int
    num_resumed_tokens: int = 0


class Worker:
    """Consumes one model's request streams (``shared/fair_queue.py``) into an engine backend.

    ``max_waiting_prefill_tokens``: the pull budget (module docstring; -1:
    ``DEFAULT_PREFILL_STEPS`` x the backend's ``max_num_batched_tokens``, 0: no bound);
    ``steal_after_ms``: how long an entry waits in another live worker's placed stream
    before this one may take it (0: never). ``WorkerSettings`` documents both.
    """

    def __init__(self, client: AsyncClient, keys: Keys, model: str, worker_id: str,
                 backend: EngineBackend, drain_timeout_s: float = 60.0,
                 engine_thread: EngineThread | None = None, engine_stall_timeout_s: float = 0.0,
                 max_waiting_prefill_tokens: int = -1, steal_after_ms: int = DEFAULT_STEAL_AFTER_MS,
                 kv_resync_s: float = KV_INDEX_RESYNC_S) -> None:
        self.redis = client
        #: Where steps run; pass the thread that built the backend (one OpenMP team).
        self.engine_thread = engine_thread or EngineThread()
        self.keys = keys
        self.model = model
        self.worker_id = worker_id or default_worker_id()
        self.backend = backend
        #: The model's classes and tenants; ``stream`` is its base stream.
        self.queue = FairQueue(client, keys, model)
        self.stream = self.queue.base_stream
        self.inflight: dict[str, InFlight] = {}
        self._aborts: set[str] = set()
        self._draining = asyncio.Event()
        self._drain_deadline_s = 0.0
        self.drain_timeout_s = drain_timeout_s
        #: Seconds between two rewrites of the KV index from the whole cache (0: never).
        self.kv_resync_s = kv_resync_s
        self._next_kv_resync_s = time.monotonic() + kv_resync_s
        self._started_unix_s = time.time()
        self._next_reap_s = 0.0
        #: Step count and timing for the heartbeat's stall rule (0 s: rule off).
        self.steps = StepClock(engine_stall_timeout_s)
        #: What one engine step calls (``worker/faults.py`` wraps it in tests).
        self.step_fn = backend.step
        self.num_reclaimed = 0
        self._backlog: list[RequestOutput] = []
        #: Per-step timeline for benchmarks (``WorkerSettings.step_trace``; None: off).
        self.trace: StepTrace | None = None
        #: The pull budget, tokens (0: no bound).
        self.max_waiting_prefill_tokens = (DEFAULT_PREFILL_STEPS * backend.max_num_batched_tokens
                                           if max_waiting_prefill_tokens < 0 else max_waiting_prefill_tokens)
        self.steal_after_ms = steal_after_ms
        #: Placed streams of other workers this one may take from (the reaper refreshes it).
        self.steal: list[StealFrom] = []
        self.kv_index = keys.kv_index(model, self.worker_id)
        # KV events taken from the engine and not yet in Redis (a publish failed).
        self._kv_backlog: KVEvents = NO_KV_EVENTS
        # The load and held requests last written to the model's hashes (-1: none yet).
        self._published_load = self._published_held = -1
        #: Output tokens per finished request (the heartbeat's ``mean_num_output_tokens``).
        self.output_lengths = OutputLengths()

    @property
    def num_steps(self) -> int:
        """Engine steps completed."""
        return self.steps.num_steps

    def drain(self) -> None:
        """Stop pulling; ``run`` returns once every held request is finished, or after
        ``drain_timeout_s`` leaving the rest pending: with the heartbeat gone, gateways
        re-enqueue them as continuations (handing them back)."""
        if not self._draining.is_set():
            self._drain_deadline_s = time.monotonic() + self.drain_timeout_s
            self._draining.set()

    async def run(self) -> None:
        """Serve until drained. Background tasks are awaited and their errors raised."""
        await self._ensure_group()
        self.backend.take_kv_events()  # starts the recording: the KV index starts empty, as the cache
        await self.redis.delete(self.kv_index)
        main = asyncio.create_task(self._main_loop(), name="main")
        tasks = [main, asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
                 asyncio.create_task(self._control_loop(), name="control")]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # surface a crashed background task
        finally:  # also on cancellation (SIGINT): stop everything, drop the heartbeat
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                await self.redis.delete(self.keys.worker_key(self.worker_id), self.kv_index)
                await self.redis.hdel(self.keys.worker_load(self.model), self.worker_id)
                await self.redis.hdel(self.keys.worker_held(self.model), self.worker_id)
            except RedisError:
                pass
        log.info("worker %s drained after %d steps", self.worker_id, self.num_steps)

    # -- main loop ------------------------------------------------------------------
    async def _main_loop(self) -> None:
        # Step N's publish runs while step N+1 computes: it touches Redis and the in-flight
        # table, never the engine, so a Redis round trip is not added to every step. It
        # is awaited before the next publish starts, which keeps each stream in order.
        # The pull of new entries, by contrast, runs between steps, when the engine can
        # admit something: a pull overlapped with step N (started when it started) would
        # miss whatever arrived during it, and the slots that step N freed would sit
        # empty through step N + 1; pulled between them, a request that arrived during
        # step N is in step N + 1 (docs/operations.md, "Priority classes and fair share").
        publishing: asyncio.Task[None] | None = None
        try:
            while True:
                try:
                    await self._apply_aborts()
                    busy = self.backend.has_unfinished_requests()
                    if self._draining.is_set():
                        if not busy:
                            return
                        if time.monotonic() > self._drain_deadline_s:
                            log.warning("drain timeout: handing back %d requests", len(self.inflight))
                            return
                    else:
                        if time.monotonic() >= self._next_reap_s:
                            self._next_reap_s = time.monotonic() + REAP_INTERVAL_S
                            await self.reap()
                        pull_start_s = time.monotonic()
                        self.backend.note_arrival(None)  # what was announced so far, this pull sees
                        await self._pull(block_ms=None if busy else IDLE_BLOCK_MS)
                        if self.trace is not None and busy:
                            self.trace.pull_s += time.monotonic() - pull_start_s
                    if not self.backend.has_unfinished_requests():
                        await self._settle(publishing)
                        publishing = None
                        if self._backlog or self._kv_backlog:  # what a Redis error kept from going out
                            await self._publish([])
                        continue
                    self.steps.started()
                    handed_s = time.monotonic()
                    step = asyncio.ensure_future(self.engine_thread.run(
                        self.step_fn if self.trace is None else self.trace.wrap(self.step_fn)))
                    await self._settle(publishing)
                    publishing = None
                    try:
                        outputs = await step
                    except Exception as exc:  # noqa: BLE001 - reported to every client, then go on
                        self.steps.finished(completed=False)
                        await self._fail_all(exc)
                        continue
                    self.steps.finished()
                    if self.trace is not None:
                        stats = self.backend.stats()
                        self.trace.record(handed_s, len(outputs), stats.num_running, stats.num_waiting)
                    publishing = asyncio.create_task(self._publish(outputs, self._take_kv_events()))
                except RedisError as exc:
                    log.warning("redis error in worker loop: %s; retrying", exc)
                    await asyncio.sleep(RECONNECT_DELAY_S)
                    if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
                        await self._ensure_group()
        finally:
            await self._settle(publishing)

    @staticmethod
    async def _settle(publishing: asyncio.Task[None] | None) -> None:
        """Wait for a publish started after the previous step. A Redis error is logged, not
        raised: that publish's outputs stay in ``_backlog`` and go out with the next one,
        and the step running meanwhile must finish and publish too."""
        if publishing is None:
            return
        try:
            await publishing
        except RedisError as exc:
            log.warning("publish failed, kept for the next one: %s", exc)

    async def _ensure_group(self) -> None:
        await self.queue.ensure_base()

    async def _pull(self, block_ms: int | None) -> None:
        # Per class: what the engine can admit of it (a full engine still takes a higher
        # class than it runs, preempting for it); the pull script fills the highest first.
        counts = [self.backend.num_admittable(rank) for rank in range(len(PRIORITY_CLASSES))]
        # A class the engine is full of may still take one request of a tenant that runs
        # fewer of it than another tenant: the engine preempts one of that tenant's for it
        # (fair share of slots, worker/engine/fair_share.py).
        extra = [0] * len(PRIORITY_CLASSES)
        excluded: list[str] = []
        for rank, (name, count) in enumerate(zip(PRIORITY_CLASSES, counts, strict=True)):
            blocked = None if count > 0 else self.backend.fair_share_blocked(rank)
            if blocked is not None:
                extra[rank] = 1
                excluded += [self.queue.stream(name, tenant) for tenant in blocked]
        stats = self.backend.stats()
        budget = self.prefill_budget(stats.num_waiting_prefill_tokens)
        # The requests held, for placement (``Keys.worker_held``): the pull script writes
        # them plus what it takes, so a gateway finds each pulled request in this
        # worker's placed count or in its held one, never in neither. Written on the
        # loop, between steps, not by the publish: a publish runs beside the pull, and
        # its older count could reach Redis after the pull's.
        held = stats.num_running + stats.num_waiting
        if (max(counts) <= 0 or budget == 0) and not any(extra):
            if held != self._published_held:
                await self.redis.hset(self.keys.worker_held(self.model), self.worker_id, held)
                self._published_held = held
            if block_ms is not None:
                await asyncio.sleep(block_ms / 1000)
            return
        entries = await self.queue.pull(self.worker_id, counts, extra, excluded, prefill_budget=budget,
                                        steal=self.steal, num_held=held)
        if not entries and block_ms is not None and await self.queue.wait(block_ms / 1000, self.worker_id):
            entries = await self.queue.pull(self.worker_id, counts, extra, excluded, prefill_budget=budget,
                                            steal=self.steal, num_held=held)
        self._published_held = held + len(entries)
        for stream, entry_id, fields in entries:
            await self._admit(stream, entry_id, fields)

    def prefill_budget(self, num_waiting_prefill_tokens: int) -> int:
        """Prefill tokens the next pull may take (``FairQueue.pull``'s ``prefill_budget``):
        ``max_waiting_prefill_tokens`` less ``num_waiting_prefill_tokens``, what the
        engine holds uncomputed (its ``stats()``, taken between steps), at least 0; -1
        when unbounded."""
        if self.max_waiting_prefill_tokens == 0:
            return -1
        return max(0, self.max_waiting_prefill_tokens - num_waiting_prefill_tokens)

    async def reap(self) -> int:
        """Claim entries pending on dead consumers (as many as the engine admits) and run
        them; drop dead consumers with nothing pending; refresh ``steal`` (the placed
        streams of other workers this one may take from, ``worker/placed.py``); clean up
        after dead workers (``forget_dead_workers``: KV index, empty placed streams,
        placed tokens). Runs between engine steps. Returns the number of entries claimed.

        Dead means no live heartbeat: the key is gone, or it reports the engine stalled
        (``shared/liveness.py``). Never by idle time alone: a live worker's entry stays
        idle in the PEL for as long as its generation runs.
        """
        claimed = 0
        streams = await self.queue.streams()
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xinfo_consumers(stream, CONSUMER_GROUP)
            replies = await pipe.execute(raise_on_error=False)
        per_stream = [(s, r) for s, r in zip(streams, replies, strict=True) if not isinstance(r, Exception)]
        names = {as_text(c["name"]) for _, consumers in per_stream for c in consumers}
        names |= placed_owners(self.keys, self.model, streams)
        names.discard(self.worker_id)
        live = await live_workers(self.redis, self.keys, names)
        self.steal = steal_sources(self.keys, self.model, streams, self.worker_id, live, self.steal_after_ms)
        for stream, consumers in per_stream:
            claimed += await self._reap_stream(stream, consumers, live)
        await forget_dead_workers(self.redis, self.keys, self.model, names - live)
        self.num_reclaimed += claimed
        return claimed

    async def _reap_stream(self, stream: str, consumers: list[dict], live: set[str]) -> int:
        """``reap`` on one stream, given its XINFO CONSUMERS reply and the live workers."""
        claimed = 0
        for consumer in consumers:
            name = as_text(consumer["name"])
            if name == self.worker_id or name in live:
                continue
            if int(consumer["pending"]) == 0:
                if int(consumer["idle"]) > DEAD_CONSUMER_IDLE_MS:
                    await self.redis.xgroup_delconsumer(stream, CONSUMER_GROUP, name)
                continue
            room = self.backend.num_admittable()
            if room <= 0:
                break
            pending = await self.redis.xpending_range(stream, CONSUMER_GROUP, min="-", max="+", count=room,
                                                      consumername=name, idle=REAP_MIN_IDLE_MS)
            ids = [p["message_id"] for p in pending]
            if not ids:
                continue
            entries = await self.redis.xclaim(stream, CONSUMER_GROUP, self.worker_id, REAP_MIN_IDLE_MS, ids)
            # Redis 6.2 answers (None, None), in order, for an id deleted while pending
            # (it still moves to our PEL): ack it so nothing stays pending.
            for requested_id, (entry_id, fields) in zip(ids, entries):
                log.warning("reclaimed %s from dead consumer %s", requested_id, name)
                claimed += 1
                if entry_id is not None and fields:
                    await self._admit(stream, entry_id, fields)
                else:
                    await self._ack(stream, requested_id)
        return claimed

    async def _admit(self, stream: str, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            message = protocol.decode(fields[STREAM_FIELD])
        except (KeyError, protocol.ProtocolError) as exc:
            log.error("dropping undecodable stream entry %s: %s", entry_id, exc)
            await self._ack(stream, entry_id)
            return
        if not isinstance(message, GenerateRequest):
            log.error("dropping stream entry %s of type %s", entry_id, type(message).__name__)
            await self._ack(stream, entry_id)
            return
        if time.time() > message.deadline_unix_s:
            await self._fail(message, stream, entry_id, 504, "request deadline passed before a worker could start it")
            return
        held = self.inflight.get(message.request_id)
        if held is not None:
            if held.attempt >= message.attempt:  # a stale redelivery of what runs here
                await self._ack(stream, entry_id)
                return
            # The gateway took this worker for dead and re-enqueued a continuation: the
            # newer attempt replaces the one running here.
            self.backend.abort(message.request_id)
            del self.inflight[message.request_id]
            # Outputs of the replaced run that a Redis error held back must not go out under
            # the new attempt's number: the continuation resumes after what the client has.
            self._backlog = [out for out in self._backlog if out.request_id != message.request_id]
            await self._ack(held.stream, held.entry_id)
        # A placed stream names no tenant: the request carries it.
        tenant = message.tenant or stream_class_tenant(self.keys, self.model, stream)[1]
        try:
            self.backend.add_request(message.request_id, message.prompt_token_ids.tolist(), message.sampling,
                                     message.output_token_ids, priority=message.priority, tenant=tenant,
                                     num_cached_hint=_cached_hint(message, fields))
        except RequestRejected as exc:
            await self._fail(message, stream, entry_id, 400, str(exc))
            return
        self.inflight[message.request_id] = InFlight(stream, entry_id, message.reply_channel, message.attempt,
                                                     len(message.output_token_ids))
        if self.trace is not None:
            self.trace.pulled += 1

    async def _fail(self, message: GenerateRequest, stream: str, entry_id: bytes, status: int, text: str) -> None:
        error = ErrorMessage(request_id=message.request_id, attempt=message.attempt, worker_id=self.worker_id,
                             status=status, message=text)
        await finish_entry(self.redis, stream, entry_id, error=error, reply_channel=message.reply_channel)

    async def _ack(self, stream: str, entry_id: bytes | str) -> None:
        await finish_entry(self.redis, stream, entry_id)

    async def _fail_all(self, exc: Exception) -> None:
        """The engine raised: abort every request it holds and tell each client (500)."""
        log.exception("engine step failed; failing %d requests", len(self.inflight), exc_info=exc)
        for request_id, info in list(self.inflight.items()):
            self.backend.abort(request_id)
            error = ErrorMessage(request_id=request_id, attempt=info.attempt, worker_id=self.worker_id,
                                 status=500, message=f"engine error: {type(exc).__name__}: {exc}")
            await finish_entry(self.redis, info.stream, info.entry_id, error=error, reply_channel=info.reply_channel)
            del self.inflight[request_id]

    def _take_kv_events(self) -> KVEvents:
        """The backend's KV events since the last step; every ``kv_resync_s`` the whole
        cache instead (``take_kv_events(snapshot=True)``), which replaces the KV index:
        gateways add the blocks of prompts they place here before they are computed, and
        a prediction that never comes true (the request was taken over by another worker,
        or aborted before its prefill) would otherwise stay in the index, misleading
        placement and growing Redis, until this worker restarts."""
        now = time.monotonic()
        snapshot = self.kv_resync_s > 0 and now >= self._next_kv_resync_s
        if snapshot:
            self._next_kv_resync_s = now + self.kv_resync_s
        return self.backend.take_kv_events(snapshot)

    async def _publish(self, new_outputs: list[RequestOutput], kv_events: KVEvents = NO_KV_EVENTS) -> None:
        """One pipeline: the KV events on the KV index (first, so a gateway that reads a
        request's last tokens finds its blocks there), a PUBLISH of one ``TokenBatch`` per
        reply channel (every request of that gateway with new tokens), then XACK + XDEL
        per finished request; an output with an ``error`` (its grammar failed) goes as a
        400 ``ErrorMessage`` instead, after the batches. Outputs and KV events that a
        Redis error kept from going out stay in ``_backlog`` and ``_kv_backlog`` and go
        first next time, so a blip loses no tokens and no cache change; a batch that reached no subscriber (its gateway is
        gone) has its unfinished requests aborted at the next turn."""
        outputs = self._backlog + new_outputs
        self._backlog = outputs
        kv_events = self._kv_backlog = merge_kv_events(self._kv_backlog, kv_events)
        load = self.backend.stats().num_waiting_prefill_tokens
        if not outputs and not kv_events and load == self._published_load:
            return
        batches: dict[str, list[TokenOutput]] = {}
        errors: list[tuple[str, ErrorMessage]] = []
        finished: list[tuple[str, InFlight]] = []
        lengths: list[int] = []  # output tokens of each request that finished
        for out in outputs:
            info = self.inflight.get(out.request_id)
            if info is None:
                continue
            if out.error is not None:  # its grammar failed: a 400 instead of its last tokens
                errors.append((info.reply_channel, ErrorMessage(
                    request_id=out.request_id, attempt=info.attempt, worker_id=self.worker_id, status=400,
                    message=out.error)))
                finished.append((out.request_id, info))
                continue
            batches.setdefault(info.reply_channel, []).append(TokenOutput(
                request_id=out.request_id, attempt=info.attempt, first_index=out.first_index,
                token_ids=out.new_token_ids, finish_reason=out.finish_reason,
                num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
                logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs))
            if out.finish_reason is not None:
                finished.append((out.request_id, info))
                lengths.append(out.first_index + len(out.new_token_ids) - info.num_resumed_tokens)
        async with self.redis.pipeline(transaction=False) as pipe:
            num_kv = add_kv_events(pipe, self.kv_index, kv_events)
            if load != self._published_load:
                pipe.hset(self.keys.worker_load(self.model), self.worker_id, load)
                num_kv += 1
            for channel, entries in batches.items():
                pipe.publish(channel, protocol.encode(TokenBatch(worker_id=self.worker_id, outputs=entries)))
            for channel, error in errors:  # after the batches: results[num_kv:] starts with theirs
                pipe.publish(channel, protocol.encode(error))
            for _request_id, info in finished:
                add_finish(pipe, info.stream, info.entry_id)
            # Per-command errors (XACK after a Redis restart lost the group: NOGROUP) must
            # not make the PUBLISHes go out again; a lost connection still raises here.
            results = await pipe.execute(raise_on_error=False)
        self._backlog = []
        self._kv_backlog = NO_KV_EVENTS
        self._published_load = load
        for num_tokens in lengths:
            self.output_lengths.add(num_tokens)
        # Results come back in command order: the KV index's, the PUBLISHes, then XACK,
        # XDEL per finish.
        for (channel, entries), receivers in zip(batches.items(), results[num_kv:], strict=False):
            if isinstance(receivers, Exception):
                log.warning("publish to %s failed: %s", channel, receivers)
            elif receivers == 0:
                for entry in entries:
                    if entry.finish_reason is None:
                        log.info("gateway of %s is gone; aborting it", entry.request_id)
                        self._aborts.add(entry.request_id)
        for request_id, info in finished:
            if self.inflight.get(request_id) is info:
                del self.inflight[request_id]

    async def _apply_aborts(self) -> None:
        if not self._aborts:
            return
        ids, self._aborts = self._aborts, set()
        for request_id in ids:
            info = self.inflight.pop(request_id, None)
            if info is None:
                continue
            self.backend.abort(request_id)
            await self._ack(info.stream, info.entry_id)

    # -- background tasks ----------------------------------------------------------
    def status(self) -> WorkerStatus:
        """The heartbeat's value: the engine's load and sizes, and the step clock."""
        s = self.backend.stats()
        b = self.backend
        return WorkerStatus(worker_id=self.worker_id, model=self.model, backend=b.name,
                            num_running=s.num_running, num_waiting=s.num_waiting, kv_usage=s.kv_usage,
                            num_free_blocks=s.num_free_blocks, block_size=b.block_size,
                            max_num_seqs=b.max_num_seqs, updated_unix_s=time.time(),
                            started_unix_s=self._started_unix_s, pid=os.getpid(),
                            num_steps=self.steps.num_steps, last_step_unix_s=self.steps.last_step_unix_s,
                            step_running_s=self.steps.running_s(),
                            engine_stall_timeout_s=self.steps.stall_timeout_s,
                            num_waiting_prefill_tokens=s.num_waiting_prefill_tokens, num_blocks=s.num_blocks,
                            max_num_batched_tokens=b.max_num_batched_tokens, max_model_len=b.max_model_len,
                            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
                            mean_num_output_tokens=self.output_lengths.mean,
                            kv_internal_fragmentation=s.kv_internal_fragmentation,
                            kv_contiguous_waste_ratio=s.kv_contiguous_waste_ratio)

    async def _heartbeat_loop(self) -> None:
        key = self.keys.worker_key(self.worker_id)
        while True:
            self.steps.report_stall(len(self.inflight))
            try:
                await self.redis.set(key, protocol.encode(self.status()), ex=HEARTBEAT_TTL_S)
            except RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _control_loop(self) -> None:
        """Aborts (the control channel) and higher-class arrivals (the model's arrivals
        channel: ``EngineBackend.note_arrival``) over one subscription."""
        channel = self.keys.control_channel()
        arrivals = self.keys.arrivals_channel(self.model)
        while True:
            pubsub = None
            try:
                pubsub = await subscriber(self.redis, channel, ignore_subscribe_messages=True)
                await pubsub.subscribe(channel, arrivals)
                async for item in pubsub.listen():
                    if item.get("type") != "message":
                        continue
                    if as_text(item.get("channel", b"")) == arrivals:
                        if self._draining.is_set():
                            continue  # it pulls nothing more: stopping a step would only waste it
                        try:
                            self.backend.note_arrival(*parse_arrival(item["data"]))
                        except ValueError as exc:
                            log.warning("bad arrival message: %s", exc)
                        continue
                    try:
                        message = protocol.decode(item["data"])
                    except protocol.ProtocolError as exc:
                        log.warning("bad control message: %s", exc)
                        continue
                    if isinstance(message, AbortMessage):
                        self._aborts.update(r for r in message.request_ids if r in self.inflight)
            except RedisError as exc:
                log.warning("control channel lost (%s); resubscribing", exc)
                await asyncio.sleep(RECONNECT_DELAY_S)
            finally:
                try:
                    if pubsub is not None:
                        await pubsub.aclose()
                except RedisError:
                    pass


def _cached_hint(message: GenerateRequest, fields: dict[bytes, bytes]) -> int:
    """The prompt tokens that placement expects cached here: the prompt less the entry's
    ``PREFILL_FIELD`` (0 without one, or for a continuation, whose prompt grew)."""
    raw = fields.get(PREFILL_FIELD)
    if raw is None or message.output_token_ids:
        return 0
    try:
        return max(0, len(message.prompt_token_ids) - int(raw))
    except ValueError:
        return 0
