"""bench/kv_sampler.py: the KV gauges sampled from a worker's real ``/metrics`` server
(``worker.metrics.start_metrics_server`` over a real sim backend) while a request runs,
nothing while none does, and a scrape that fails counted, not raised."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from bench.kv_sampler import KVSampler
from bench.procs import free_port
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from worker.backends.sim import SimBackend
from worker.metrics import start_metrics_server
from worker.progress import StepClock

pytestmark = pytest.mark.timeout(60)


def sample_for(url: str | None, duration_s: float = 0.4) -> tuple[dict, KVSampler]:
    sampler = KVSampler(url, interval_s=0.05).start()
    time.sleep(duration_s)
    return sampler.stop(), sampler


def test_samples_the_gauges_while_a_request_runs() -> None:
    sim = SimBackend(ModelSettings(max_model_len=128), EngineSettings(max_num_seqs=4, block_size=16),
                     step_time_ms=0.0)
    # What the collector reads of a worker besides its backend (worker/metrics.py, FAMILIES).
    worker = SimpleNamespace(backend=sim, model="m", worker_id="w1", num_reclaimed=0, num_steps=0,
                             steps=StepClock(0.0))
    port = free_port()
    server = start_metrics_server(port, worker)  # type: ignore[arg-type]
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        idle, _ = sample_for(url)
        assert idle == {"samples": 0, "failed_scrapes": 0}  # nothing runs: nothing kept
        sim.add_request("r", list(range(1, 21)), SamplingParams(max_tokens=30, ignore_eos=True))
        sim.step()  # its 20-token prompt and first output in 4 reserved blocks (64 slots)
        busy, sampler = sample_for(url)
        assert busy["samples"] >= 2 and busy["failed_scrapes"] == 0
        assert busy["internal_fragmentation"] == {"mean": (64 - 21) / 64, "max": (64 - 21) / 64}
        assert busy["contiguous_waste_ratio"] == {"mean": 1 - 21 / 128, "max": 1 - 21 / 128}
        assert busy["kv_usage"]["max"] == sim.stats().kv_usage > 0
        assert sampler.cpu_s > 0
    finally:
        server.shutdown()
        server.server_close()
    failed, _ = sample_for(url, 0.2)  # the server is gone: connections refused
    assert failed["samples"] == 0 and failed["failed_scrapes"] >= 1


def test_no_url_samples_nothing() -> None:
    out, sampler = sample_for(None, 0.05)
    assert out == {"samples": 0, "failed_scrapes": 0} and sampler.cpu_s == 0.0
