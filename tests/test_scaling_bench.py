"""The scaling benchmark end to end with tiny sizes: embedded Redis, real gateway and `sim`
worker processes, 1 and 2 workers, 1 and 2 gateways; checks the result JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import scaling_bench
from bench.loadgen.client import RequestOutput


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sim_scaling_writes_result(tmp_path: Path) -> None:
    out = tmp_path / "scaling.json"
    with pytest.raises(SystemExit) as exited:
        scaling_bench.main(["--workers", "1,2", "--gateways", "1,2", "--max-num-seqs", "2", "--step-time-ms", "5",
                            "--input-len", "4", "--output-len", "4", "--rounds", "2", "--no-progress",
                            "--log-dir", str(tmp_path / "logs"), "--out", str(out)])
    assert exited.value.code == 0, "\n".join(log.read_text()[-2000:] for log in (tmp_path / "logs").glob("*.log"))
    data = json.loads(out.read_text())
    assert data["backend"] == "sim" and data["config"]["worker_counts"] == [1, 2]
    assert data["ideal_output_throughput_per_worker"] == pytest.approx(2 * 1000 / 5)
    assert "N * max_num_seqs" in data["ideal"] and data["host_cpu_count"] >= 1
    points = data["points"]
    assert [(p["num_workers"], p["num_gateways"]) for p in points] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for p in points:
        n = p["num_workers"]
        assert p["concurrency"] == 2 * n and p["sent"] == 2 * p["concurrency"]
        assert p["completed"] == p["sent"] and p["failed"] == 0 and p["errors"] == []
        assert p["total_output_tokens"] == p["expected_output_tokens"] == p["sent"] * 4
        # Throughputs are what was received over the measured duration (no speed threshold:
        # this host is shared; speed belongs in the benchmark's own runs).
        duration_s = p["duration_s"]
        assert duration_s > 0 and p["ideal_output_throughput"] == pytest.approx(n * 400)
        assert p["output_throughput"] == pytest.approx(p["total_output_tokens"] / duration_s)
        assert p["request_throughput"] == pytest.approx(p["completed"] / duration_s)
        assert p["fraction_of_ideal"] == pytest.approx(p["output_throughput"] / p["ideal_output_throughput"])
        # Efficiency: tput(N) / (N * tput(1 worker)), the reference at the same gateway count.
        (base,) = [b for b in points if (b["num_workers"], b["num_gateways"]) == (1, p["num_gateways"])]
        assert p["efficiency"] == pytest.approx(p["output_throughput"] / (n * base["output_throughput"]))
        assert p["steady_output_throughput"] > 0
        assert p["steady_efficiency"] == pytest.approx(
            p["steady_output_throughput"] / (n * base["steady_output_throughput"]))
        # CPU: one entry per process that ran (both gateways run at every point), cores = s / duration.
        cpu_s = p["cpu_s"]
        assert {f"worker-{i}" for i in range(n)} | {"gateway-0", "gateway-1", "redis", "client"} == set(cpu_s)
        assert all(v >= 0 for v in cpu_s.values())
        workers_s = [cpu_s[f"worker-{i}"] for i in range(n)]
        gateways_s = [cpu_s["gateway-0"], cpu_s["gateway-1"]]
        assert p["cpu_cores"] == pytest.approx({
            "gateway_max": max(gateways_s) / duration_s, "gateways": sum(gateways_s) / duration_s,
            "worker_max": max(workers_s) / duration_s, "workers": sum(workers_s) / duration_s,
            "redis": cpu_s["redis"] / duration_s, "client": cpu_s["client"] / duration_s,
            "all": sum(cpu_s.values()) / duration_s})
        assert cpu_s["client"] > 0  # measured (process_time), not left at zero


def test_steady_output_throughput_leaves_out_ramp_and_tail() -> None:
    # Chunks at 1, 2, ..., 10 s (one token each); a failed request counts for nothing.
    ok = RequestOutput(output_tokens=10, start_s=0.0, ttft_s=1.0, itls_s=[1.0] * 9, success=True)
    failed = RequestOutput(output_tokens=0, start_s=0.0, error="HTTP 500")
    # 10th/90th percentiles of the times: 1.9 s and 9.1 s; inside: the 8 chunks at 2..9 s.
    assert scaling_bench.steady_output_throughput([ok, failed]) == pytest.approx(8 / 7.2)
    merged = RequestOutput(output_tokens=20, start_s=0.0, ttft_s=1.0, itls_s=[1.0] * 9, success=True)
    assert scaling_bench.steady_output_throughput([merged]) == pytest.approx(16 / 7.2)  # 2 tokens per chunk
    assert scaling_bench.steady_output_throughput([failed]) == 0.0
