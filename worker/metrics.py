"""Prometheus metrics of one worker, served on its own port (``--metrics-port``).

Values are read from the engine at scrape time by a custom collector, so the step
loop pays nothing for them. Names follow vLLM's where they exist, under ``inferq:``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from worker.service import Worker


class WorkerCollector(Collector):
    """Exposes the engine's queue, KV-cache and prefix-cache state."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Any]:
        w = self.worker
        s = w.backend.stats()
        labels = ["model", "worker_id"]
        values = [w.model, w.worker_id]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("inferq:num_requests_running", "Requests in the engine's running set", s.num_running)
        yield gauge("inferq:num_requests_waiting", "Requests admitted but waiting for KV blocks", s.num_waiting)
        yield gauge("inferq:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1)", s.kv_usage)
        yield gauge("inferq:kv_cache_num_blocks", "KV-cache blocks in all", s.num_blocks)
        yield counter("inferq:num_preemptions", "Requests preempted (recompute)", s.num_preemptions)
        yield counter("inferq:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      s.prefix_cache_queries)
        yield counter("inferq:prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits)
        yield counter("inferq:engine_steps", "Engine steps run", w.num_steps)


def start_metrics_server(port: int, worker: Worker) -> Any:
    """Serve ``/metrics`` for ``worker`` on ``port`` in a daemon thread; returns the server."""
    registry = CollectorRegistry()
    registry.register(WorkerCollector(worker))
    server, _thread = start_http_server(port, registry=registry)
    return server
