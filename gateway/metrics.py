"""Gateway metrics in Prometheus text format, named like vLLM's and prefixed
``inferq:``. Each app has its own ``CollectorRegistry`` so several apps (tests) can
live in one process."""

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
        self.e2e_request_latency = Histogram("inferq:e2e_request_latency_seconds", "Arrival to last token, s",
                                             labels, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.failovers = Counter("inferq:failovers", "Requests re-enqueued because their worker died",
                                 labels, registry=r)
        self.requests_in_flight = Gauge("inferq:num_requests_in_flight", "Requests this gateway waits on",
                                        labels, registry=r)
        self.model_name = model_name

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format."""
        return generate_latest(self.registry)

    def rejected(self, reason: str) -> None:
        """Count one request refused before enqueue (``reason``: e.g. queue_full)."""
        self.requests_rejected.labels(self.model_name, reason).inc()

    def aborted(self, reason: str) -> None:
        """Count one abort published."""
        self.request_aborts.labels(self.model_name, reason).inc()
