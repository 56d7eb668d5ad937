"""Gateway metrics in Prometheus text format, named like vLLM's and prefixed
``inferq:``. Each app has its own ``CollectorRegistry`` so several apps (tests) can
live in one process.

Request metrics (latencies, tokens, outcomes) are recorded by the gateway that served
the request, so summing over gateways is right. The queue gauges describe the shared
Redis stream, which every gateway of a model sees alike: aggregate them with ``max``,
not ``sum``. Per-class and per-tenant series (docs/operations.md, "Priority classes
and fair share"): ``priority_class`` has three values; ``tenant`` labels are capped at
``MAX_TENANT_LABELS`` values per gateway (the first tenants seen; later ones count as
``other``), and the per-tenant queue gauges show only the ``MAX_TENANT_LABELS`` tenants
with the most waiting requests per class, the rest summed under ``other``, so a
deployment with thousands of API keys does not make thousands of series.
``exported_names()`` lists every family (the compose test checks the
Grafana dashboard against it).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from gateway.placement import PlacementDecision
    from shared.protocol import WorkerStatus

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                      10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_GAP_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                        1.0, 2.5, 5.0)


#: Most distinct ``tenant`` label values per gateway (the rest are ``OTHER_TENANT``).
MAX_TENANT_LABELS = 20
OTHER_TENANT = "other"


class GatewayMetrics:
    """The gateway's counters and histograms (times in seconds, sizes in tokens)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.request_success = Counter("inferq:request_success", "Requests finished, by finish_reason",
                                       labels + ["finished_reason"], registry=r)
        self.requests_rejected = Counter("inferq:requests_rejected", "Requests refused before enqueue, by reason",
                                         labels + ["reason"], registry=r)
        self.rate_limited = Counter("inferq:rate_limited", "Requests refused by their tenant's rate limit, by kind "
                                    "(requests | tokens: the limit that waits longest)", labels + ["kind"], registry=r)
        self.request_errors = Counter("inferq:request_errors", "Requests that ended in an error after enqueue",
                                      labels + ["status"], registry=r)
        self.request_aborts = Counter("inferq:request_aborts", "Aborts published on the control channel, by reason",
                                      labels + ["reason"], registry=r)
        self.prompt_tokens = Counter("inferq:prompt_tokens", "Prompt tokens of enqueued requests", labels, registry=r)
        self.generation_tokens = Counter("inferq:generation_tokens", "Output tokens consumed", labels, registry=r)
        self.time_to_first_token = Histogram("inferq:time_to_first_token_seconds", "Arrival to first token, s",
                                             labels, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.inter_token_latency = Histogram("inferq:inter_token_latency_seconds", "Gap between token messages, s",
                                             labels, buckets=_TOKEN_GAP_BUCKETS_S, registry=r)
        self.time_per_output_token = Histogram("inferq:time_per_output_token_seconds",
                                               "Per request: (e2e - ttft) / (output tokens - 1), s",
                                               labels, buckets=_TOKEN_GAP_BUCKETS_S, registry=r)
        self.e2e_request_latency = Histogram("inferq:e2e_request_latency_seconds", "Arrival to last token, s",
                                             labels, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.failovers = Counter("inferq:failovers", "Requests re-enqueued because their worker died",
                                 labels, registry=r)
        self.requests_in_flight = Gauge("inferq:num_requests_in_flight", "Requests this gateway waits on",
                                        labels, registry=r)
        # Refreshed from Redis by gateway.queue_metrics (about once a second).
        self.queue_depth = Gauge("inferq:queue_depth", "Requests on the model's stream not yet taken by a worker",
                                 labels, registry=r)
        self.num_pending_entries = Gauge("inferq:num_pending_entries",
                                         "Entries delivered to a worker and not yet acknowledged (XPENDING)",
                                         labels, registry=r)
        self.num_redelivered_entries = Gauge("inferq:num_redelivered_entries",
                                             "Pending entries delivered more than once (reclaimed from a dead worker)",
                                             labels, registry=r)
        self.class_queue_depth = Gauge("inferq:class_queue_depth", "Requests waiting, per priority class",
                                       labels + ["priority_class"], registry=r)
        self.class_oldest_wait = Gauge("inferq:class_oldest_wait_seconds",
                                       "Wait of the oldest waiting request per priority class, s (0: none waits)",
                                       labels + ["priority_class"], registry=r)
        self.tenant_queue_depth = Gauge("inferq:tenant_queue_depth",
                                        "Requests waiting per class and tenant (top tenants, rest as other)",
                                        labels + ["priority_class", "tenant"], registry=r)
        self.tenant_oldest_wait = Gauge("inferq:tenant_oldest_wait_seconds",
                                        "Wait of a tenant's oldest waiting request per class, s (top tenants)",
                                        labels + ["priority_class", "tenant"], registry=r)
        self.class_admitted = Counter("inferq:class_admitted", "Requests enqueued, per priority class and tenant",
                                      labels + ["priority_class", "tenant"], registry=r)
        self.class_rejected = Counter("inferq:class_rejected",
                                      "Requests refused after their class was known (rate limit, queue full, ...), "
                                      "per priority class and tenant", labels + ["priority_class", "tenant"],
                                      registry=r)
        self.placements = Counter("inferq:placements",
                                  "Requests placed at enqueue, per worker (\"shared\": the shared stream) and "
                                  "reason (cache, load, session, random, shared)",
                                  labels + ["worker", "reason"], registry=r)
        self.placed_cached_tokens = Counter("inferq:placed_cached_tokens",
                                            "Prompt tokens expected cached on the worker a request was placed on",
                                            labels + ["worker"], registry=r)
        self.worker_waiting_prefill_tokens = Gauge(
            "inferq:worker_waiting_prefill_tokens",
            "Per worker: prompt tokens it holds uncomputed, from its heartbeat", labels + ["worker"], registry=r)
        self.worker_running = Gauge("inferq:worker_num_running", "Per worker: running requests, from its heartbeat",
                                    labels + ["worker"], registry=r)
        self.worker_prefix_cache_hit_rate = Gauge(
            "inferq:worker_prefix_cache_hit_rate",
            "Per worker: prefix-cache hits / queries (tokens) since it started, from its heartbeat",
            labels + ["worker"], registry=r)
        self._tenant_labels: set[str] = set()
        self.queue_metrics_errors = Counter("inferq:queue_metrics_errors",
                                            "Failed refreshes of the queue gauges (Redis unreachable)",
                                            labels, registry=r)
        self.model_name = model_name
        # Children of the metrics labelled by model only exist from the start (a scrape
        # shows 0 rather than nothing); the ones with a reason appear on first use.
        for metric in (self.prompt_tokens, self.generation_tokens, self.time_to_first_token,
                       self.inter_token_latency, self.time_per_output_token, self.e2e_request_latency,
                       self.failovers, self.requests_in_flight, self.queue_metrics_errors):
            metric.labels(model_name)

    def observe_finished(self, ttft_s: float | None, e2e_s: float, num_output_tokens: int) -> None:
        """Latencies of one request that finished normally: e2e always, and TPOT when it
        has a first token and at least two output tokens (vLLM's definition)."""
        name = self.model_name
        self.e2e_request_latency.labels(name).observe(e2e_s)
        if ttft_s is not None and num_output_tokens > 1:
            self.time_per_output_token.labels(name).observe((e2e_s - ttft_s) / (num_output_tokens - 1))

    def set_queue(self, depth: int, pending: int, redelivered: int) -> None:
        """Set the queue gauges (counts of stream entries)."""
        name = self.model_name
        self.queue_depth.labels(name).set(depth)
        self.num_pending_entries.labels(name).set(pending)
        self.num_redelivered_entries.labels(name).set(redelivered)

    def tenant_label(self, tenant: str) -> str:
        """``tenant`` as a label value: itself for the first ``MAX_TENANT_LABELS`` tenants
        this gateway counts, ``OTHER_TENANT`` for the rest."""
        if tenant in self._tenant_labels:
            return tenant
        if len(self._tenant_labels) < MAX_TENANT_LABELS:
            self._tenant_labels.add(tenant)
            return tenant
        return OTHER_TENANT

    def set_classes(self, by_class: dict[str, tuple[int, float]],
                    by_tenant: dict[tuple[str, str], tuple[int, float]]) -> None:
        """Set the per-class gauges (``class -> (waiting, oldest wait s)``) and the
        per-tenant ones (``(class, tenant) -> (waiting, oldest wait s)``): per class, the
        ``MAX_TENANT_LABELS`` tenants with most waiting, the rest summed as ``other``
        (its wait: the longest among them). Series of tenants no longer shown go away."""
        name = self.model_name
        for priority_class, (waiting, oldest_s) in by_class.items():
            self.class_queue_depth.labels(name, priority_class).set(waiting)
            self.class_oldest_wait.labels(name, priority_class).set(oldest_s)
        self.tenant_queue_depth.clear()
        self.tenant_oldest_wait.clear()
        shown: dict[tuple[str, str], tuple[int, float]] = {}
        for priority_class in by_class:
            tenants = sorted(((t, v) for (c, t), v in by_tenant.items() if c == priority_class),
                             key=lambda item: -item[1][0])
            for tenant, value in tenants[:MAX_TENANT_LABELS]:
                shown[(priority_class, tenant)] = value
            rest = [v for _, v in tenants[MAX_TENANT_LABELS:]]
            if rest:
                shown[(priority_class, OTHER_TENANT)] = (sum(w for w, _ in rest), max(o for _, o in rest))
        for (priority_class, tenant), (waiting, oldest_s) in shown.items():
            self.tenant_queue_depth.labels(name, priority_class, tenant).set(waiting)
            self.tenant_oldest_wait.labels(name, priority_class, tenant).set(oldest_s)

    def placed(self, decision: PlacementDecision | None, num_requests: int = 1) -> None:
        """Count ``num_requests`` enqueued with ``decision`` (None: no placement was made)."""
        if decision is None:
            self.placements.labels(self.model_name, "shared", "shared").inc(num_requests)
            return
        worker = decision.placement.worker_id or "shared"
        self.placements.labels(self.model_name, worker, decision.reason).inc(num_requests)
        if decision.num_cached_tokens:
            self.placed_cached_tokens.labels(self.model_name, worker).inc(decision.num_cached_tokens * num_requests)

    def set_workers(self, workers: Sequence[WorkerStatus]) -> None:
        """Set the per-worker gauges from the ready workers' heartbeats (workers that left
        are dropped)."""
        for gauge in (self.worker_waiting_prefill_tokens, self.worker_running, self.worker_prefix_cache_hit_rate):
            gauge.clear()
        for w in workers:
            self.worker_waiting_prefill_tokens.labels(self.model_name, w.worker_id).set(w.num_waiting_prefill_tokens)
            self.worker_running.labels(self.model_name, w.worker_id).set(w.num_running)
            if w.prefix_cache_queries:
                self.worker_prefix_cache_hit_rate.labels(self.model_name, w.worker_id).set(
                    w.prefix_cache_hits / w.prefix_cache_queries)

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format."""
        return generate_latest(self.registry)

    def rejected(self, reason: str) -> None:
        """Count one request refused before enqueue (``reason``: e.g. queue_full)."""
        self.requests_rejected.labels(self.model_name, reason).inc()

    def aborted(self, reason: str) -> None:
        """Count one abort published."""
        self.request_aborts.labels(self.model_name, reason).inc()



def observe_many(histogram: Any, values_s: Sequence[float]) -> None:
    """``histogram.observe(v)`` for each of ``values_s`` (a labelled ``Histogram``),
    with one increment per bucket and one of the sum: a request's inter-token gaps
    are one value per output token, and ``observe`` costs ~1 µs each (a lock per
    bucket and sum). Reads prometheus_client's ``_upper_bounds`` / ``_buckets`` /
    ``_sum`` (observe's own fields); without them it calls ``observe`` per value
    (tests/test_sse_stream.py checks both give the same series)."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values_s:
            histogram.observe(v)
        return
    if not values_s:
        return
    counts = [0] * len(bounds)
    for v in values_s:  # observe's bucket: the first bound >= v
        counts[bisect.bisect_left(bounds, v)] += 1
    total.inc(sum(values_s))
    for i, count in enumerate(counts):
        if count:
            buckets[i].inc(count)


def exported_names() -> list[str]:
    """Every family the gateway exports, as the exposition names it (counters end in
    ``_total``), read from a fresh registry so the list cannot drift from the code."""
    registry = GatewayMetrics("_").registry
    return sorted(f.name + "_total" if f.type == "counter" else f.name for f in registry.collect())
