"""Prometheus metrics of one worker, served on its own port (``--metrics-port``).

Values are read from the engine at scrape time by a custom collector, so the step
loop pays nothing for them. Names follow vLLM's where they exist, under ``inferq:``;
labels are ``model_name`` and ``worker_id``. Token counts and request latencies are
the gateway's (it sees every request end to end); the worker exports what only it
knows: its engine's queues, KV cache, prefix cache and preemptions, and the entries it
reclaimed from dead workers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # the worker service imports redis; the compose test reads FAMILIES without it
    from worker.backends.base import EngineStats
    from worker.service import Worker

LABELS = ["model_name", "worker_id"]


@dataclass(frozen=True, slots=True)
class _Family:
    """One exported family: ``name`` without the counter's ``_total``; ``read`` takes
    the worker and a stats snapshot taken once per scrape."""

    name: str
    kind: str  # "gauge" | "counter"
    doc: str
    read: Callable[[Worker, EngineStats], float]


FAMILIES = (
    _Family("inferq:num_requests_running", "gauge", "Requests in the engine's running set",
            lambda w, s: s.num_running),
    _Family("inferq:num_requests_waiting", "gauge", "Requests admitted but waiting for KV blocks",
            lambda w, s: s.num_waiting),
    _Family("inferq:kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (0..1)",
            lambda w, s: s.kv_usage),
    _Family("inferq:kv_cache_num_blocks", "gauge", "KV-cache blocks in all", lambda w, s: s.num_blocks),
    # KV fragmentation of the running requests (worker/engine/block_manager.py, ``fragmentation``).
    _Family("inferq:kv_internal_fragmentation", "gauge",
            "Share of the KV slots held by running requests that hold no token (0..1)",
            lambda w, s: s.kv_internal_fragmentation),
    _Family("inferq:kv_contiguous_waste_ratio", "gauge",
            "Share of the KV slots a contiguous max_model_len reservation per running request would leave "
            "empty (0..1)",
            lambda w, s: s.kv_contiguous_waste_ratio),
    _Family("inferq:num_preemptions", "counter", "Requests preempted (KV recomputed later)",
            lambda w, s: s.num_preemptions),
    _Family("inferq:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache",
            lambda w, s: s.prefix_cache_queries),
    _Family("inferq:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache",
            lambda w, s: s.prefix_cache_hits),
    _Family("inferq:num_reclaimed", "counter", "Stream entries this worker claimed from dead workers",
            lambda w, s: w.num_reclaimed),
    _Family("inferq:engine_steps", "counter", "Engine steps run", lambda w, s: w.num_steps),
    _Family("inferq:engine_busy_seconds", "counter",
            "Seconds the engine thread spent in steps (the rest of the wall time it waited for the worker loop)",
            lambda w, s: w.steps.busy_s),
    _Family("inferq:engine_async_steps", "counter",
            "Steps enqueued behind one still in flight (async scheduling: decode steps, and steps that carry "
            "prefill chunks)",
            lambda w, s: getattr(w.backend, "num_async_steps", 0)),
    _Family("inferq:engine_steps_stopped", "counter",
            "Eager steps stopped between layers because a request was announced of a class above the step's "
            "lowest one, or of a tenant that claims a slot of a full engine",
            lambda w, s: getattr(w.backend, "num_steps_stopped", 0)),
    _Family("inferq:engine_chains_withheld", "counter",
            "Async decode steps not chained because a request was announced of a class above the lowest "
            "running one, or of a tenant that claims a slot of a full engine (the late look)",
            lambda w, s: getattr(w.backend, "num_chains_withheld", 0)),
    # Speculative decoding (worker/engine/spec_decode.py); 0 when off or on another backend.
    # Counters only, so rates hold over any window: acceptance rate = rate(accepted) /
    # rate(draft tokens); mean accepted length = 1 + rate(accepted) / rate(verify steps).
    _Family("inferq:spec_decode_num_draft_tokens", "counter", "Draft tokens proposed and verified",
            lambda w, s: _spec(w, "num_draft_tokens")),
    _Family("inferq:spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted",
            lambda w, s: _spec(w, "num_accepted_tokens")),
    _Family("inferq:spec_decode_num_verify_steps", "counter", "Request-steps that verified drafts",
            lambda w, s: _spec(w, "num_verify_steps")),
    _Family("inferq:spec_decode_proposer_seconds", "counter", "Time spent proposing drafts (n-gram lookup or draft model), seconds",
            lambda w, s: _spec(w, "proposer_time_s")),
)


def _spec(worker: Worker, name: str) -> float:
    """A speculative-decoding counter of the worker's engine (``LLMEngine.spec_stats``)."""
    stats = getattr(worker.backend, "spec_stats", None)
    return float(getattr(stats, name)) if stats is not None else 0.0


def exported_names() -> list[str]:
    """Every family a worker exports, as the exposition names it (counters end in ``_total``)."""
    return sorted(f.name + "_total" if f.kind == "counter" else f.name for f in FAMILIES)


class WorkerCollector(Collector):
    """Exposes the engine's queue, KV-cache and prefix-cache state."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Any]:
        w = self.worker
        stats = w.backend.stats()
        values = [w.model, w.worker_id]
        for f in FAMILIES:
            cls = GaugeMetricFamily if f.kind == "gauge" else CounterMetricFamily
            family = cls(f.name, f.doc, labels=LABELS)
            family.add_metric(values, f.read(w, stats))
            yield family


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # one line per scrape otherwise
        pass


def start_metrics_server(port: int, worker: Worker) -> Any:
    """Serve ``/metrics`` for ``worker`` on ``port`` (all interfaces, so Prometheus can
    reach a container) in a daemon thread; returns the server (``shutdown()`` stops it).

    Always in the classic text format, as the gateway's: Prometheus 2.x asks for OpenMetrics
    first, and prometheus_client answers that with names escaped to underscores
    (``inferq_kv_cache_usage_perc``), which no dashboard query of ``inferq:...`` finds."""
    registry = CollectorRegistry()
    registry.register(WorkerCollector(worker))
    app = make_wsgi_app(registry)

    def classic_text(environ: dict[str, Any], start_response: Any) -> Any:
        environ.pop("HTTP_ACCEPT", None)
        return app(environ, start_response)

    server = make_server("0.0.0.0", port, classic_text, server_class=_Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
