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
        assert p["output_throughput"] > 0 and p["ideal_output_throughput"] == pytest.approx(n * 400)
        assert 0 < p["efficiency"] <= 1.5 and 0 < p["fraction_of_ideal"] <= 1.5
        assert p["steady_output_throughput"] > 0 and p["steady_efficiency"] > 0
        assert {f"worker-{i}" for i in range(n)} | {"gateway-0", "gateway-1", "redis", "client"} == set(p["cpu_s"])
        assert all(v >= 0 for v in p["cpu_s"].values())
        assert set(p["cpu_cores"]) == {"gateway_max", "gateways", "worker_max", "workers", "redis", "client", "all"}
    assert points[0]["efficiency"] == pytest.approx(1.0)  # the one-worker point is its own reference


def test_steady_output_throughput_leaves_out_ramp_and_tail() -> None:
    # Chunks at 1, 2, ..., 10 s (one token each); a failed request counts for nothing.
    ok = RequestOutput(output_tokens=10, start_s=0.0, ttft_s=1.0, itls_s=[1.0] * 9, success=True)
    failed = RequestOutput(output_tokens=0, start_s=0.0, error="HTTP 500")
    # 10th/90th percentiles of the times: 1.9 s and 9.1 s; inside: the 8 chunks at 2..9 s.
    assert scaling_bench.steady_output_throughput([ok, failed]) == pytest.approx(8 / 7.2)
    merged = RequestOutput(output_tokens=20, start_s=0.0, ttft_s=1.0, itls_s=[1.0] * 9, success=True)
    assert scaling_bench.steady_output_throughput([merged]) == pytest.approx(16 / 7.2)  # 2 tokens per chunk
    assert scaling_bench.steady_output_throughput([failed]) == 0.0
