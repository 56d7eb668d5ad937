"""A worker's KV-cache gauges sampled while a benchmark pass runs: its ``/metrics``
(``worker/metrics.py``) scraped every ``interval_s`` on a background thread, keeping the
samples taken while requests ran (an idle worker reads 0, which would only dilute the
figures). Per gauge: the mean and the peak over those samples.

The gauges (docs/operations.md, "Metrics"): ``kv_cache_usage_perc`` (blocks in use),
``kv_internal_fragmentation`` (share of the running requests' KV slots that hold no
token) and ``kv_contiguous_waste_ratio`` (share a contiguous ``max_model_len``
reservation per running request would leave empty), each 0..1.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

#: Short name in the result -> the worker's gauge.
GAUGES = {"kv_usage": "inferq:kv_cache_usage_perc",
          "internal_fragmentation": "inferq:kv_internal_fragmentation",
          "contiguous_waste_ratio": "inferq:kv_contiguous_waste_ratio"}
RUNNING = "inferq:num_requests_running"


def scrape_gauges(metrics_url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """The worker's gauges of ``GAUGES`` and ``RUNNING`` by metric name (summed over label
    sets: one worker has one).

    Raises:
        httpx.HTTPError: the scrape failed.
    """
    response = httpx.get(metrics_url, timeout=timeout_s, trust_env=False)
    response.raise_for_status()
    wanted = {*GAUGES.values(), RUNNING}
    return {f.name: sum(s.value for s in f.samples)
            for f in text_string_to_metric_families(response.text) if f.name in wanted}


class KVSampler:
    """Samples ``metrics_url`` every ``interval_s`` seconds between ``start`` and ``stop``
    (None: a no-op sampler, for a run without the worker's metrics). ``cpu_s``: the CPU
    seconds its thread spent (set by ``stop``), for a caller that measures its process's
    CPU to leave out.
    """

    def __init__(self, metrics_url: str | None, interval_s: float = 0.5) -> None:
        assert interval_s > 0, interval_s
        self.metrics_url = metrics_url
        self.interval_s = interval_s
        self.samples: list[dict[str, float]] = []
        self.num_failed = 0
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> KVSampler:
        """Start the sampling thread (none without a URL); returns self."""
        if self.metrics_url is not None:
            self._thread = threading.Thread(target=self._run, name="kv-sampler", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        assert self.metrics_url is not None
        start_cpu_s = time.thread_time()
        try:
            self._sample(self.metrics_url)
        finally:
            self.cpu_s = time.thread_time() - start_cpu_s

    def _sample(self, metrics_url: str) -> None:
        while not self._stop.is_set():
            try:
                values = scrape_gauges(metrics_url)
            except httpx.HTTPError:
                self.num_failed += 1
            else:
                if values.get(RUNNING, 0) > 0:
                    self.samples.append({short: values.get(name, 0.0) for short, name in GAUGES.items()})
            self._stop.wait(self.interval_s)

    def stop(self) -> dict[str, Any]:
        """Stop sampling and summarise: ``samples`` (taken while requests ran),
        ``failed_scrapes``, and per gauge of ``GAUGES`` ``{"mean", "max"}`` (absent with no
        sample)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        out: dict[str, Any] = {"samples": len(self.samples), "failed_scrapes": self.num_failed}
        for short in GAUGES:
            values = [s[short] for s in self.samples]
            if values:
                out[short] = {"mean": sum(values) / len(values), "max": max(values)}
        return out
