"""``GET /stats``: a JSON snapshot of the queues, the workers, the batches and this
gateway, for people and scripts that do not run Prometheus (docs/operations.md,
"The /stats snapshot").

The queue and worker facts are those of ``inferq queues`` (``shared.queues.snapshot``,
their one home), reshaped; batch counts come from ``BatchStore.count_by_status``. The
reads are not one atomic view, as for ``inferq queues``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from gateway.admission import redis_guard
from gateway.files import store_of
from gateway.handlers import check_auth
from gateway.openapi import error_responses
from gateway.state import GatewayState
from shared.queues import ClassInfo, QueueSnapshot, WorkerInfo, snapshot
from shared.redis_connect import is_cluster
from shared.settings import BatchSettings


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One worker with a heartbeat key (``WorkerStatus`` fields, docs/protocol.md).

    ``alive``: ``shared.liveness.is_alive``; ``stalled``: its engine step has run past its
    stall timeout. ``kv_usage``: fraction of KV blocks in use (0..1).
    ``last_step_age_s``: seconds since its last engine step completed (None: no step yet).
    ``heartbeat_age_s``: seconds since it last wrote its heartbeat. A heartbeat that does
    not decode shows as ``worker_id`` = its key, ``model`` "?" and zero counts.
    Placement's view of it: ``num_waiting_prefill_tokens`` (prompt tokens it holds
    uncomputed), ``prefix_cache_hit_rate`` (hits / queries in tokens since it started;
    None before its first lookup), ``block_size`` and ``max_model_len`` (tokens).
    ``prefix_cache_queries`` / ``prefix_cache_hits``: the prompt tokens it looked up in its
    prefix cache / found there since it started. KV fragmentation of its running requests
    (0..1, ``WorkerStatus``): ``kv_internal_fragmentation`` (share of their KV slots that
    hold no token) and ``kv_contiguous_waste_ratio`` (share a contiguous ``max_model_len``
    reservation per request would leave empty).
    """

    worker_id: str
    model: str
    backend: str
    alive: bool
    stalled: bool
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    max_num_seqs: int
    num_steps: int
    last_step_age_s: float | None
    heartbeat_age_s: float
    num_waiting_prefill_tokens: int = 0
    prefix_cache_hit_rate: float | None = None
    block_size: int = 0
    max_model_len: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_internal_fragmentation: float = 0.0
    kv_contiguous_waste_ratio: float = 0.0


@dataclass(frozen=True, slots=True)
class StreamStats:
    """One request stream of a model: one priority class and tenant
    (``shared/fair_queue.py``). ``num_waiting``: requests no worker has taken yet (the
    queue depth); ``num_pending``: taken, not finished (running); ``oldest_waiting_age_s``:
    seconds the oldest waiting request has waited (None: none waits); ``num_redelivered``:
    pending entries delivered more than once, among the first ``MAX_SCANNED_PENDING``;
    ``num_dead_consumers``: consumers without a live heartbeat. ``virtual_tokens``: the
    tenant's virtual token counter in its class (None: nothing of it waits)."""

    model: str
    priority_class: str
    tenant: str
    num_waiting: int
    num_pending: int
    oldest_waiting_age_s: float | None
    num_redelivered: int
    num_consumers: int
    num_dead_consumers: int
    virtual_tokens: float | None


@dataclass(frozen=True, slots=True)
class GatewayStats:
    """The gateway that answered. ``num_in_flight``: requests its relay holds (waiting for
    or receiving tokens); ``uptime_s``: since its app started (1 s resolution)."""

    gateway_id: str
    model: str
    num_in_flight: int
    uptime_s: float


@dataclass(frozen=True, slots=True)
class Stats:
    """Body of ``GET /stats``. ``batches``: number of batches per OpenAI status (every
    status present). ``taken_unix_s``: wall-clock time of the snapshot."""

    namespace: str
    taken_unix_s: float
    gateway: GatewayStats
    workers: list[WorkerStats]
    classes: list[ClassInfo]  # shared/queues.py: one priority class, summed over its tenants
    streams: list[StreamStats]
    batches: dict[str, int]


def _worker(w: WorkerInfo, now_unix_s: float) -> WorkerStats:
    st = w.status
    if st is None:
        return WorkerStats(worker_id=w.key, model="?", backend="?", alive=w.alive, stalled=False, num_running=0,
                           num_waiting=0, kv_usage=0.0, num_free_blocks=0, max_num_seqs=0, num_steps=0,
                           last_step_age_s=None, heartbeat_age_s=w.heartbeat_age_s)
    return WorkerStats(
        worker_id=st.worker_id, model=st.model, backend=st.backend, alive=w.alive, stalled=st.engine_stalled,
        num_running=st.num_running, num_waiting=st.num_waiting, kv_usage=st.kv_usage,
        num_free_blocks=st.num_free_blocks, max_num_seqs=st.max_num_seqs, num_steps=st.num_steps,
        last_step_age_s=now_unix_s - st.last_step_unix_s if st.last_step_unix_s else None,
        heartbeat_age_s=w.heartbeat_age_s, num_waiting_prefill_tokens=st.num_waiting_prefill_tokens,
        prefix_cache_hit_rate=st.prefix_cache_hits / st.prefix_cache_queries if st.prefix_cache_queries else None,
        block_size=st.block_size, max_model_len=st.max_model_len, prefix_cache_queries=st.prefix_cache_queries,
        prefix_cache_hits=st.prefix_cache_hits, kv_internal_fragmentation=st.kv_internal_fragmentation,
        kv_contiguous_waste_ratio=st.kv_contiguous_waste_ratio)


def build_stats(state: GatewayState, snap: QueueSnapshot, batches: dict[str, int]) -> Stats:
    """Reshape a queue snapshot, batch counts and the gateway's own state into ``Stats``."""
    now = snap.taken_unix_s
    return Stats(
        namespace=snap.namespace, taken_unix_s=now,
        gateway=GatewayStats(gateway_id=state.gateway_id, model=state.served_model_name,
                             num_in_flight=state.relay.num_in_flight,
                             uptime_s=max(0.0, now - state.created_unix_s)),
        workers=[_worker(w, now) for w in snap.workers],
        classes=list(snap.classes),
        streams=[StreamStats(model=s.model, priority_class=s.priority_class, tenant=s.tenant,
                             num_waiting=s.num_waiting, num_pending=s.num_pending,
                             oldest_waiting_age_s=s.oldest_waiting_age_s, num_redelivered=s.num_redelivered,
                             num_consumers=len(s.consumers), num_dead_consumers=len(s.dead_consumers),
                             virtual_tokens=s.virtual_tokens)
                 for s in snap.streams],
        batches=batches)


def install_stats_route(app: FastAPI, batch: BatchSettings) -> None:
    """Add ``GET /stats`` to ``app`` (whose ``state.inferq`` is the GatewayState): 200 with
    a ``Stats`` body; 401 without a valid API key (when keys are set); 503
    ``redis_unavailable`` when Redis does not answer."""

    @app.get("/stats", responses={200: {"model": Stats}, **error_responses(401, 503)})
    async def stats(request: Request) -> Response:
        state: GatewayState = request.app.state.inferq
        check_auth(state, request)
        with redis_guard("stats"):
            snap = await snapshot(state.redis, state.keys, now_unix_s=time.time())
            # No Batch API on a Redis Cluster (``store_of``): no batches to count.
            batches = {} if is_cluster(state.redis) else await store_of(request, batch).count_by_status()
        return Response(msgspec.json.encode(build_stats(state, snap, batches)), media_type="application/json")
