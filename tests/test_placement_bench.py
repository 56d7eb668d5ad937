"""The placement benchmark: its workloads' prompts and its counters' arithmetic (fast), and
the whole script end to end with the smallest sizes (embedded Redis, a real gateway and
two ``sim`` worker processes: one stack, as each takes seconds to start): the JSON's
shape, and that what the workers and gateway counted adds up to what the client sent."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from bench import placement_bench
from bench.placement_stack import cache_stats
from bench.placement_workloads import (
    MAX_LENGTH_OVER_MEDIAN,
    TOKEN_ID_HIGH,
    TOKEN_ID_LOW,
    WORKLOADS,
    Sizes,
    burst_prompts,
    first_turns,
    lognormal_lengths,
    next_turn,
    shared_prefix_prompts,
    throughput_requests,
)

SMALL = Sizes(burst_requests=4, burst_prompt_len=40, burst_output_len=3, users=3, rounds=3, first_prompt_len=33,
              turn_len=5, turn_output_len=4, groups=3, prompts_per_group=4, system_prompt_len=32, question_len=8,
              shared_output_len=2, throughput_requests=20, throughput_concurrency=4, throughput_input_len=30,
              throughput_output_len=5)


def test_prompts_have_the_workloads_shapes() -> None:
    rng = np.random.default_rng(0)
    burst = burst_prompts(SMALL, rng)
    assert len(burst) == 4 and {len(p) for p in burst} == {40}
    assert all(TOKEN_ID_LOW <= t < TOKEN_ID_HIGH for p in burst for t in p)
    firsts = first_turns(SMALL, rng)
    assert len(firsts) == 3 and {len(p) for p in firsts} == {33}
    follow = next_turn(firsts[0], [7, 8, 9, 10], SMALL, rng)
    assert follow[:37] == [*firsts[0], 7, 8, 9, 10] and len(follow) == 33 + 4 + 5
    shared = shared_prefix_prompts(SMALL, rng)
    assert len(shared) == 12 and {len(p) for _, p in shared} == {40}
    systems = {g: {tuple(p[:32]) for gg, p in shared if gg == g} for g in range(3)}
    assert all(len(s) == 1 for s in systems.values())  # one system prompt per group...
    assert len({next(iter(s)) for s in systems.values()}) == 3  # ...and a different one per group
    assert [g for g, _ in shared] != sorted(g for g, _ in shared)  # shuffled, as SGLang's
    reqs = throughput_requests(SMALL, rng)
    assert len(reqs) == 20 and all(1 <= len(p) <= 4 * 30 and 1 <= n <= 4 * 5 for p, n in reqs)
    # The same seed gives the same prompts (every point of a run sends the same ones).
    assert burst_prompts(SMALL, np.random.default_rng(1)) == burst_prompts(SMALL, np.random.default_rng(1))


def test_lognormal_lengths_center_on_the_median() -> None:
    lengths = lognormal_lengths(np.random.default_rng(0), 500, 0.5, 20_000)
    assert statistics.median(lengths) == pytest.approx(500, rel=0.03)
    assert min(lengths) >= 1 and max(lengths) <= MAX_LENGTH_OVER_MEDIAN * 500
    assert lognormal_lengths(np.random.default_rng(0), 7, 0.0, 3) == [7, 7, 7]


def test_max_total_len_covers_each_workload() -> None:
    assert SMALL.max_total_len(["burst"]) == 43
    assert SMALL.max_total_len(["multi_turn"]) == 33 + 2 * (4 + 5) + 4
    assert SMALL.max_total_len(["shared_prefix"]) == 42
    assert SMALL.max_total_len(WORKLOADS) == 4 * 35


def test_cache_stats_are_deltas_between_snapshots() -> None:
    before = {"workers": {"w0": {"queries": 100.0, "hits": 50.0, "prompt": None},
                          "w1": {"queries": 0.0, "hits": 0.0, "prompt": None}},
              "placements": {"w0": {"cache": 3.0}}, "monotonic_s": 10.0,
              "cpu_s": {"gateway-0": 1.0, "worker-0": 1.0, "worker-1": 2.0, "redis": 0.0, "client": 5.0}}
    after = {"workers": {"w0": {"queries": 400.0, "hits": 200.0, "prompt": None},
                         "w1": {"queries": 100.0, "hits": 50.0, "prompt": None}},
             "placements": {"w0": {"cache": 5.0, "load": 1.0}, "w1": {"load": 1.0}, "shared": {"shared": 2.0}},
             "monotonic_s": 12.0,
             "cpu_s": {"gateway-0": 2.0, "worker-0": 1.5, "worker-1": 3.0, "redis": 0.5, "client": 6.0}}
    s = cache_stats(before, after)
    assert s["cache_queries"] == 400 and s["cache_hits"] == 200 and s["hit_rate"] == 0.5
    assert s["worker_shares"] == {"w0": 0.75, "w1": 0.25} and s["max_worker_share"] == 0.75
    assert s["placements"] == {"w0": {"cache": 2, "load": 1}, "w1": {"load": 1}, "shared": {"shared": 2}}
    assert s["to_shared_stream"] == 2
    assert s["cpu_cores"] == {"gateways": 0.5, "workers": 0.75, "worker_max": 0.5, "redis": 0.25, "client": 0.5,
                              "all": 2.0}
    # A worker that exports its prompt tokens is shared out by them, not by its lookups.
    after["workers"]["w1"]["prompt"], before["workers"]["w1"]["prompt"] = 300.0, 0.0
    assert cache_stats(before, after)["worker_shares"]["w1"] == pytest.approx(300 / 600)
    idle = cache_stats(after, after)
    assert idle["hit_rate"] is None and idle["max_worker_share"] is None and idle["placements"] == {}
    assert idle["cpu_cores"] == {}


def test_speedups_against_the_fewest_workers() -> None:
    def point(n: int, policy: str, wall_s: float, tok_s: float) -> dict[str, object]:
        return {"num_workers": n, "policy": policy, "workloads": {
            "burst": {"wall_s": wall_s, "hit_rate": 0.0, "max_worker_share": 1 / n, "failed": 0,
                      "to_shared_stream": 0},
            "throughput": {"output_tok_s": tok_s, "hit_rate": None, "max_worker_share": 1 / n, "failed": 0,
                           "to_shared_stream": 0}}}

    points = [point(1, "cache_aware", 10.0, 100.0), point(2, "cache_aware", 5.0, 150.0),
              point(2, "random", 8.0, 200.0), {"num_workers": 2, "policy": "load", "error": "x"}]
    rows = placement_bench.add_speedups(points, ["burst", "throughput"])
    got = {(r["workload"], r["num_workers"], r["policy"]): (r["speedup"], r["scaling"]) for r in rows}
    assert got == {("burst", 1, "cache_aware"): (1.0, 1.0), ("burst", 2, "cache_aware"): (2.0, 1.0),
                   ("burst", 2, "random"): (1.25, 0.625), ("throughput", 1, "cache_aware"): (1.0, 1.0),
                   ("throughput", 2, "cache_aware"): (1.5, 0.75), ("throughput", 2, "random"): (2.0, 1.0)}


def test_points_run_one_worker_once() -> None:
    _, settings, _ = placement_bench.parse_args(["--workers", "1,2", "--policies", "load,random"])
    assert settings is not None and settings.points() == [(1, "load"), (2, "load"), (2, "random")]
    with pytest.raises(SystemExit):
        placement_bench.parse_args(["--policies", "round_robin"])
    with pytest.raises(SystemExit):
        placement_bench.parse_args(["--workers", "1,2", "--cuda-devices", "0"])


def test_tensor_parallel_workers_get_their_own_gpus() -> None:
    """``--tensor-parallel-size 2``: worker ``i`` leads a group over GPUs ``2i`` and ``2i+1``,
    and four devices are too few for three such workers."""
    argv = ["--backend", "inferq", "--workers", "1,2", "--cuda-devices", "0,1,2,3", "--tensor-parallel-size", "2"]
    _, settings, _ = placement_bench.parse_args(argv)
    assert settings is not None
    flags, env = settings.stack.worker_argv(1, 9000)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert flags[flags.index("--tensor-parallel-size") + 1] == "2"
    assert settings.stack.worker_argv(0, 9000)[1]["CUDA_VISIBLE_DEVICES"] == "0,1"
    with pytest.raises(SystemExit):
        placement_bench.parse_args([*argv[:3], "1,3", *argv[4:]])
    with pytest.raises(SystemExit):
        placement_bench.parse_args(["--workers", "1,2", "--tensor-parallel-size", "2"])  # sim workers


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("client_processes", [1, 3])
def test_sim_run_writes_sane_result(tmp_path: Path, client_processes: int) -> None:
    """End to end, the load client in this process and in a pool of three (whose
    completions must come back in the requests' order: the follow-ups' hit rate below
    needs each answer appended to its own conversation)."""
    out, logs = tmp_path / "placement.json", tmp_path / "logs"
    sizes = [f"--{k.replace('_', '-')}={v}" for k, v in (
        ("burst_requests", 4), ("burst_prompt_len", 64), ("burst_output_len", 4), ("users", 4), ("rounds", 2),
        ("first_prompt_len", 160), ("turn_len", 16), ("turn_output_len", 4), ("groups", 2), ("prompts_per_group", 3),
        ("system_prompt_len", 64), ("question_len", 16), ("shared_output_len", 4), ("shared_concurrency", 1),
        ("throughput_requests", 6),
        ("throughput_concurrency", 3), ("throughput_input_len", 32), ("throughput_output_len", 4))]
    code = placement_bench.main(["--backend", "sim", "--workers", "2", "--policies", "cache_aware",
                                 "--sim-step-time-ms", "2", *sizes, "--log-dir", str(logs), "--out", str(out),
                                 "--client-processes", str(client_processes)])
    assert code == 0, "\n".join(log.read_text()[-2000:] for log in logs.glob("*.log"))
    data = json.loads(out.read_text())
    assert data["command"].startswith("python -m bench.placement_bench --backend sim")
    assert data["date"] and data["host"] and data["device"] and data["settings"]["workloads"] == list(WORKLOADS)
    assert data["settings"]["client_processes"] == client_processes
    assert [(p["num_workers"], p["policy"]) for p in data["points"]] == [(2, "cache_aware")]
    for p in data["points"]:
        assert p["startup_s"] > 0 and set(p["exit_codes"].values()) == {0}
        n = p["num_workers"]
        for name, w in p["workloads"].items():
            phases = w["rounds"] if name == "multi_turn" else [w]
            for r in phases:
                # Every request completed with its max_tokens; the workers looked up exactly
                # the prompt tokens sent; the gateway placed each request once.
                assert r["completed"] == r["sent"] and r["failed"] == 0 and r["errors"] == []
                assert r["output_tokens"] == r["output_tokens_expected"]
                assert r["cache_queries"] == r["prompt_tokens_sent"] == r["prompt_tokens_usage"]
                assert r["usage_mismatches"] == 0  # each completion is its own request's
                assert 0 <= r["cache_hits"] <= r["cache_queries"]
                assert sum(sum(v.values()) for v in r["placements"].values()) == r["sent"]
                assert set(r["workers"]) == {f"w{i}" for i in range(n)}
                assert sum(r["worker_shares"].values()) == pytest.approx(1.0)
                assert r["wall_s"] > 0 and r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
                assert r["cpu_cores"]["client"] > 0
        burst, multi, shared = (p["workloads"][k] for k in ("burst", "multi_turn", "shared_prefix"))
        assert burst["hit_rate"] == 0.0  # random prompts share no block
        assert len(multi["rounds"]) == 2 and multi["rounds"][0]["hit_rate"] == 0.0
        assert multi["follow_up_wall_s"] == pytest.approx(multi["rounds"][1]["wall_s"])
        assert multi["answer_ids"] in ({"sim_echo": 4}, {"stream": 4})
        # A follow-up finds at most its last prompt (160 tokens: 10 blocks) of its 180
        # cached: the answer's last block is not full, so not cached; placed by cache (its
        # history looked up to the block, and over MIN_CACHED_TOKENS), every follow-up finds it.
        assert multi["follow_up_hit_rate"] == pytest.approx(160 / 180)
        assert shared["hit_rate"] > 0
    rows = data["summary"]
    assert {(r["workload"], r["num_workers"]) for r in rows} == {(w, 2) for w in WORKLOADS}
    assert all(r["speedup"] == 1.0 and r["scaling"] == 1.0 for r in rows)  # the base point itself
