"""bench/vllm_paired.py without running anything: its flags, the commands it starts, the
ratios it reports (the paired run itself is a benchmark, not a test)."""

from __future__ import annotations

import pytest

from bench.vllm_paired import (
    PairedConfig,
    inferq_worker_args,
    medians,
    parse_args,
    ratios,
    round_order,
    vllm_server_argv,
)


def test_flags_build_the_config() -> None:
    cfg, out, _ = parse_args(["--concurrency", "1,4", "--systems", "vllm,inferq", "--output-len", "8",
                              "--enforce-eager", "--out", "/tmp/x.json"])
    assert cfg.concurrency == (1, 4) and cfg.systems == ("vllm", "inferq") and cfg.output_len == 8
    assert cfg.enforce_eager and str(out) == "/tmp/x.json"
    assert cfg.num_prompts(1) == 8 and cfg.num_prompts(16) == 64
    with pytest.raises(AssertionError):
        PairedConfig(systems=("tgi",))


def test_vllm_runs_get_the_same_engine_settings() -> None:
    """(a) and (b) get the same dtype, lengths, batch limits, KV bytes and block size."""
    cfg = PairedConfig()
    server = vllm_server_argv("/m", 8000, cfg)
    worker = inferq_worker_args("vllm", cfg)
    for flag, value in [("--dtype", "float32"), ("--max-model-len", "2048"), ("--max-num-seqs", "64"),
                        ("--max-num-batched-tokens", "2048"), ("--block-size", "128")]:
        assert server[server.index(flag) + 1] == value and worker[worker.index(flag) + 1] == value
    assert server[server.index("--kv-cache-memory-bytes") + 1] == worker[worker.index("--kv-cache-bytes") + 1]
    assert "--block-size" not in inferq_worker_args("inferq", cfg)  # ours keeps its own default


def test_ratios_are_over_direct_vllm_per_concurrency() -> None:
    rows = [{"system": s, "concurrency": c, "output_throughput": t} for s, c, t in [
        ("vllm", 1, 40.0), ("inferq_vllm", 1, 38.0), ("inferq", 1, 50.0), ("vllm", 16, 160.0), ("inferq", 16, 80.0)]]
    assert ratios(rows) == [{"concurrency": 1, "inferq_vllm_over_vllm": 0.95, "inferq_over_vllm": 1.25},
                            {"concurrency": 16, "inferq_over_vllm": 0.5}]


def test_medians_are_per_system_and_concurrency_over_rounds() -> None:
    rows = [{"system": s, "concurrency": 1, "round": k, "output_throughput": t, "failed": 0}
            for s, k, t in [("vllm", 0, 40.0), ("inferq", 0, 30.0), ("vllm", 1, 44.0), ("inferq", 1, 38.0),
                            ("vllm", 2, 41.0), ("inferq", 2, 36.0)]]
    summary = medians(rows)
    assert [(r["system"], r["rounds"], r["output_throughput"], r["failed"]) for r in summary] == [
        ("vllm", 3, 41.0, 0), ("inferq", 3, 36.0, 0)]
    assert ratios(summary) == [{"concurrency": 1, "inferq_over_vllm": 36.0 / 41.0}]


def test_each_round_rotates_the_order_of_the_systems() -> None:
    systems = ("vllm", "inferq_vllm", "inferq")
    orders = [round_order(systems, k) for k in range(4)]
    assert orders[0] == list(systems)
    assert orders[1] == ["inferq_vllm", "inferq", "vllm"]
    assert orders[3] == orders[0]
    assert [o[0] for o in orders[:3]] == list(systems)  # each runs first once in three rounds
