"""Gateway metrics in Prometheus text format, named like vLLM's and prefixed
``inferq:``. Each app has its own ``CollectorRegistry`` so several apps (tests) can
live in one process.

Request metrics (latencies, tokens, outcomes) are recorded by the gateway that served
the request, so summing over gateways is right. The queue gauges describe the shared
Redis stream, which every gateway of a model sees alike: aggregate them with ``max``,
not ``sum``. ``exported_names()`` lists every family (the compose test checks the
Grafana dashboard against it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                      10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_GAP_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                        1.0, 2.5, 5.0)


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

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format."""
        return generate_latest(self.registry)

    def rejected(self, reason: str) -> None:
        """Count one request refused before enqueue (``reason``: e.g. queue_full)."""
        self.requests_rejected.labels(self.model_name, reason).inc()

    def aborted(self, reason: str) -> None:
        """Count one abort published."""
        self.request_aborts.labels(self.model_name, reason).inc()



def exported_names() -> list[str]:
    """Every family the gateway exports, as the exposition names it (counters end in
    ``_total``), read from a fresh registry so the list cannot drift from the code."""
    registry = GatewayMetrics("_").registry
    return sorted(f.name + "_total" if f.type == "counter" else f.name for f in registry.collect())
