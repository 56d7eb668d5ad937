"""bench/side_by_side.py: the pure parts (workload requests and settings, the throughput
bins, the long-prompt figures, the decode timing, the ratio table, the GPU sampler where no
GPU is) and one tiny run end to end on the CPU: inferq's offline engine and `inferq serve`
(embedded Redis, the CPU engine, the load client in two processes) on two workloads, vLLM
skipped for want of its site folder. No speed is asserted."""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import side_by_side
from bench.gpu_sampler import GPUSample, GPUSampler, busy_power_clock, trace_columns
from bench.loadgen.client import RequestOutput
from bench.side_by_side_report import comparison_rows, markdown_table, number, ratios
from bench.side_by_side_workloads import (
    LONG,
    SHORT,
    Request,
    Sizes,
    build_workload,
    engine_settings,
    long_prompt_figures,
    throughput_bins,
    token_events,
)
from bench.vllm_offline_child import Generation, decode_figures, ms_per_output_token

ROOT = Path(__file__).resolve().parent.parent

TINY = Sizes(decode_input_len=8, decode_output_len=4, short_requests=6, short_input_len=16, short_output_len=4,
             lognormal_requests=50, lognormal_input_median=20, lognormal_output_median=6, lognormal_input_max=30,
             lognormal_output_max=8, prefix_groups=3, prefix_prompts_per_group=2, prefix_len=24,
             prefix_question_len=4, prefix_output_len=3, long_requests=2, long_input_len=64, long_output_len=4,
             long_streams=4, long_stream_input_len=16, long_stream_output_len=16, long_delay_s=0.3)


# -- workloads ---------------------------------------------------------------------------------
def test_workloads_have_the_asked_shapes() -> None:
    short = build_workload("short", TINY, 0)
    assert [(len(r.prompt), r.max_tokens) for r in short.requests] == [(16, 4)] * 6 and short.concurrency == 6
    assert build_workload("short", TINY, 0) == short  # the same seed, the same prompts
    logn = build_workload("lognormal", TINY, 0)
    assert all(1 <= len(r.prompt) <= 30 and 1 <= r.max_tokens <= 8 for r in logn.requests)
    assert max(len(r.prompt) for r in logn.requests) == 30  # the cap is reached: lengths vary around 20
    assert len({len(r.prompt) for r in logn.requests}) > 5
    prefix = build_workload("shared_prefix", TINY, 0)
    assert len(prefix.requests) == 6 and {len(r.prompt) for r in prefix.requests} == {28}
    assert len({tuple(r.prompt[:24]) for r in prefix.requests}) == 3  # 3 system prompts, 2 questions each
    long = build_workload("long_prompt", TINY, 0)
    assert [(r.role, len(r.prompt), r.offset_s) for r in long.requests] == \
        [(SHORT, 16, 0.0)] * 4 + [(LONG, 64, 0.3)] * 2
    assert build_workload("decode_b1", TINY, 0).decode_repeats == TINY.decode_repeats
    with pytest.raises(KeyError, match="unknown workload"):
        build_workload("nope", TINY, 0)
    with pytest.raises(ValueError, match="at least 1: short_requests"):
        Sizes(short_requests=0)
    with pytest.raises(ValueError, match="long_input_len must exceed"):
        Sizes(long_input_len=16, long_stream_input_len=16)


def test_engine_settings_raise_max_model_len_and_group_the_workloads() -> None:
    gpu = Sizes()
    long = build_workload("long_prompt", gpu, 0)
    assert engine_settings(long, 256, 4096) == {"max_num_seqs": 256, "max_model_len": 24576,
                                               "enable_prefix_caching": False}
    assert engine_settings(build_workload("shared_prefix", gpu, 0), 256, 4096)["enable_prefix_caching"]
    assert engine_settings(build_workload("lognormal", gpu, 0), 256, 4096)["max_model_len"] == 4096
    names = ["decode_b1", "short", "shared_prefix", "lognormal", "long_prompt"]
    groups = side_by_side.plan([build_workload(n, gpu, 0) for n in names], 256, 4096)
    assert [(g.mode, [w.name for w in g.workloads]) for g in groups] == [
        ("offline", ["decode_b1", "short", "lognormal"]), ("serve", ["short", "lognormal"]),
        ("offline", ["shared_prefix"]), ("serve", ["shared_prefix"]), ("serve", ["long_prompt"])]


# -- figures -----------------------------------------------------------------------------------
def test_throughput_bins_spread_tokens_over_seconds() -> None:
    events = [(10.2, 5.0), (10.9, 5.0), (11.5, 4.0), (12.2, 3.0), (9.0, 100.0), (13.0, 100.0)]
    bins = throughput_bins(events, 10.0, 12.5)  # 2.5 s: the last bin is half a second
    assert bins == pytest.approx([10.0, 4.0, 6.0])
    assert sum(b * w for b, w in zip(bins, [1.0, 1.0, 0.5], strict=True)) == pytest.approx(17.0)
    assert throughput_bins(events, 10.0, 10.0) == []
    with pytest.raises(ValueError, match="bin_s"):
        throughput_bins(events, 10.0, 12.0, 0.0)


def output(start_s: float, ttft_s: float, itls_s: list[float], tokens: int | None = None) -> RequestOutput:
    return RequestOutput(output_tokens=tokens or len(itls_s) + 1, ttft_s=ttft_s, itls_s=itls_s,
                         latency_s=ttft_s + sum(itls_s), start_s=start_s, success=True)


def test_token_events_add_up_to_each_request_s_tokens() -> None:
    outs = [output(1.0, 0.5, [0.1, 0.1]), output(1.0, 0.2, [0.3], tokens=4), RequestOutput(start_s=1.0)]
    events = token_events(outs)
    assert [t for t, _ in events] == pytest.approx([1.5, 1.6, 1.7, 1.2, 1.5])
    assert sum(w for _, w in events) == pytest.approx(3 + 4)  # the failed one adds nothing


def test_long_prompt_figures_split_the_short_streams_gaps_at_the_prefill_window() -> None:
    # Two short streams from t=0 (first tokens at 0.1, then every 0.1 s, slower while the
    # long ones prefill), two long prompts sent at 0.35 with first tokens at 0.8 and 1.0.
    shorts = [output(0.0, 0.1, [0.1, 0.1, 0.3, 0.3, 0.3, 0.1]), output(0.0, 0.1, [0.1, 0.1, 0.3, 0.3, 0.3, 0.1])]
    longs = [output(0.35, 0.45, [0.05]), output(0.35, 0.65, [0.05])]
    requests = [Request([1], 7, 0.0, SHORT)] * 2 + [Request([1] * 9, 2, 0.35, LONG)] * 2
    f = long_prompt_figures(requests, shorts + longs)
    assert f["long_completed"] == 2 and f["prefill_window_s"] == pytest.approx([0.35, 1.0])
    assert f["long_ttft_ms"]["mean"] == pytest.approx(550.0)
    # Chunks at 0.2, 0.3 before the window; 0.6, 0.9 inside; 1.2, 1.3 after.
    assert f["num_itls_during_prefill"] == 4 and f["short_itl_during_prefill_ms"]["median"] == pytest.approx(300.0)
    assert f["short_itl_before_ms"]["mean"] == pytest.approx(100.0)
    assert f["short_running_at_long_send"] == 2
    assert long_prompt_figures(requests[:2], shorts) == {"long_completed": 0}


def test_decode_time_leaves_the_prefill_out() -> None:
    assert ms_per_output_token(0.05, 0.55, 101) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="at least 2"):
        ms_per_output_token(0.05, 0.05, 1)
    # A generate whose every call costs 40 ms of prefill plus 6 ms per token after the first.
    clock = [100.0]

    def generate(prompts: Any, max_tokens: Any) -> Generation:
        start = clock[0]
        clock[0] += 0.040 + 0.006 * (max_tokens[0] - 1)
        return Generation(start, clock[0], [max_tokens[0]], [(clock[0], max_tokens[0])])

    f = decode_figures(generate, [1, 2, 3], 51, 2)
    assert f["ms_per_output_token"] == pytest.approx(6.0) and len(f["repeats"]) == 2
    assert f["total_output_tokens"] == 51 and f["num_incomplete"] == 0 and f["prompt_len"] == 3


# -- the table ---------------------------------------------------------------------------------
def recorded() -> dict[str, Any]:
    serve = {"output_tok_s": 4000.0, "ttft_ms": {"mean": 200.0, "median": 150.0, "p99": 900.0},
             "itl_ms": {"mean": 12.0, "median": 10.0, "p99": 40.0}}
    return {"command": "python -m bench.side_by_side", "date": "2026-12-01", "device": "NVIDIA H200",
            "versions": {"inferq": "abc", "vllm": "0.26.0", "torch": "2.11"},
            "settings": {"model": "Qwen2.5-7B", "max_num_seqs": 256, "max_model_len": 4096, "client_processes": 8},
            "skipped": {}, "workloads": {
                "decode_b1": {"runs": {"inferq-offline": {"ms_per_output_token": 5.5},
                                       "vllm-offline": {"ms_per_output_token": 5.0}}},
                "short": {"runs": {"inferq-offline": {"output_tok_s": 7500.0}, "vllm-offline": {"output_tok_s": 8000.0},
                                   "inferq-serve": serve, "vllm-serve": {**serve, "output_tok_s": 5000.0}}},
                "long_prompt": {"runs": {
                    "inferq-serve": {**serve, "long_prompt": {"long_ttft_ms": {"mean": 3000.0},
                                                              "short_itl_during_prefill_ms": None}},
                    "vllm-serve": {"error": "vLLM's api_server exited 1"}}}}}


def test_ratio_table_from_recorded_figures() -> None:
    res = recorded()
    r = ratios(res)
    assert r["decode_b1"] == {"offline": {"ms per output token": pytest.approx(1.1)}}
    assert r["short"]["offline"] == {"output tok/s": pytest.approx(0.9375)}
    assert r["short"]["serve"] == {"output tok/s": pytest.approx(0.8), "mean TTFT ms": 1.0, "median ITL ms": 1.0,
                                   "p99 ITL ms": 1.0}
    assert "long_prompt" not in r  # vLLM's side failed: nothing to divide by
    rows = {(row["workload"], row["mode"], row["figure"]): row for row in comparison_rows(res)}
    long = rows[("long_prompt", "serve", "mean TTFT of the long prompts ms")]
    assert long["inferq"] == 3000.0 and long["vllm"] is None and long["ratio"] is None
    assert ("long_prompt", "serve", "median ITL of the short streams while they prefill ms") not in rows
    table = markdown_table(res)
    assert "| short | serve | output tok/s | 4,000 | 5,000 | 0.80 |" in table
    assert "| decode_b1 | offline | ms per output token | 5.50 | 5.00 | 1.10 |" in table
    assert "| long_prompt | serve | mean TTFT of the long prompts ms | 3,000 | - | - |" in table


# -- the GPU sampler ---------------------------------------------------------------------------
def nvml_works() -> bool:
    sampler = GPUSampler().start()
    sampler.stop()
    return sampler.reason is None


def test_sampler_without_nvml_bindings_gives_an_empty_trace_and_says_so_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as where nvidia-ml-py is not installed
    caplog.set_level(logging.WARNING, logger="bench.gpu_sampler")
    reasons = []
    for _ in range(2):
        sampler = GPUSampler(interval_s=0.01).start()
        assert sampler.stop() == [] and sampler.device_name is None
        reasons.append(sampler.reason)
    assert reasons == ["no NVML bindings (pip install nvidia-ml-py)"] * 2
    assert [r.getMessage() for r in caplog.records].count("no GPU trace: no NVML bindings (pip install nvidia-ml-py)") \
        <= 1  # once per process (another test may have said it first)


def test_sampler_on_a_machine_without_a_gpu() -> None:
    if nvml_works():
        pytest.skip("a GPU answers NVML here")
    sampler = GPUSampler(interval_s=0.01).start()
    assert sampler.stop() == [] and sampler.reason and sampler.device_name is None
    with pytest.raises(ValueError, match="interval_s"):
        GPUSampler(interval_s=0)
    assert trace_columns([], 0.0) == {"t_s": [], "util_pct": [], "mem_used_bytes": [], "power_w": [],
                                      "sm_clock_mhz": []}


def test_power_and_clock_while_busy() -> None:
    """Medians over the busy samples that report both; idle and unreported ones left out;
    the columns keep None where a GPU did not report."""
    samples = [GPUSample(0.0, 0, 10, 80.0, 345), GPUSample(0.1, 95, 10, 690.0, 1590),
               GPUSample(0.2, 100, 10, 700.5, 1500), GPUSample(0.3, 99, 10, 650.0, 1980),
               GPUSample(0.4, 100, 10, None, None)]
    assert busy_power_clock(samples) == {"busy_power_median_w": 690.0, "busy_sm_clock_median_mhz": 1590}
    assert busy_power_clock(samples[:1]) == {} and busy_power_clock(samples[4:]) == {}
    cols = trace_columns(samples, 0.0, 0.3, None)
    assert cols["power_w"] == [650.0, None] and cols["sm_clock_mhz"] == [1980, None]
    res = {"settings": {"model": "m"}, "date": "d", "command": "c",
           "workloads": {"short": {"runs": {"inferq-offline": {"output_tok_s": 1.0, "gpu": busy_power_clock(samples)},
                                            "vllm-offline": {"output_tok_s": 1.0}}}}}
    rows = {row["figure"]: row for row in comparison_rows(res)}
    assert rows["GPU power while busy, median W"]["inferq"] == 690.0
    assert rows["SM clock while busy, median MHz"]["vllm"] is None


@pytest.mark.cuda
def test_sampler_on_a_gpu_reads_power_and_clock() -> None:
    if not nvml_works():
        pytest.skip("no GPU answers NVML here")
    sampler = GPUSampler(interval_s=0.01).start()
    time.sleep(0.2)
    samples = sampler.stop()
    assert samples and sampler.reason is None and sampler.device_name
    assert all(s.power_w is not None and 10 < s.power_w < 2000 for s in samples)
    assert all(s.sm_clock_mhz is not None and 100 <= s.sm_clock_mhz <= 4000 for s in samples)


# -- the vLLM child stays importable without inferq --------------------------------------------
def test_vllm_child_imports_only_the_standard_library_at_the_top() -> None:
    path = ROOT / "bench" / "vllm_offline_child.py"
    top = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            top.add(node.module.split(".")[0])
    assert top and top <= set(sys.stdlib_module_names) | {"__future__"}, top
    # Run by path with the standard library alone (-I -S: no site-packages, nothing of
    # ours): a missing spec is one line and exit 2.
    done = subprocess.run([sys.executable, "-I", "-S", str(path), "/nonexistent/spec.json"], check=False,
                          capture_output=True,
                          text=True, cwd="/", timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "cannot read the spec" in done.stderr


def test_send_times_must_match_the_requests() -> None:
    from bench.loadgen.config import BenchConfig
    from bench.loadgen.dataset import SampleRequest
    from bench.loadgen.multiproc import run_split
    from bench.loadgen.runner import drive

    cfg = BenchConfig(base_url="http://127.0.0.1:9", model="m", num_prompts=2)
    requests = [SampleRequest([1, 2], 2, 1)] * 2
    for offsets in ([0.5, 0.0], [0.0]):
        with pytest.raises(ValueError, match="non-decreasing send time per request"):
            asyncio.run(drive(cfg, requests, offsets_s=offsets))
    with pytest.raises(ValueError, match="only with the requests"):
        run_split(cfg, 2, offsets_s=[0.0, 0.0])


def test_bad_selections_exit_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--workloads", "short,nope"], ["--systems", "vllm"], ["--short-requests", "0"]):
        with pytest.raises(SystemExit) as exc:
            side_by_side.parse_args(argv)
        assert exc.value.code == 2
    assert "nope" in capsys.readouterr().err


def test_inferq_settings_flags_pass_through_to_inferq_only() -> None:
    """Flags the script does not know are inferq's settings, as ``INFERQ_*`` variables for
    its offline child and ``serve`` (``Context.inferq_env``); a flag of neither is refused."""
    args = side_by_side.parse_args(["--workloads", "short", "--itl-target-ms", "30", "--no-mixed-cuda-graphs"])
    assert args.inferq_env == {"INFERQ_ITL_TARGET_MS": "30", "INFERQ_MIXED_CUDA_GRAPHS": "false"}
    assert side_by_side.parse_args([]).inferq_env == {}
    with pytest.raises(SystemExit):
        side_by_side.parse_args(["--no-such-flag", "1"])


# -- one tiny run on the CPU -------------------------------------------------------------------
def integral(throughput: dict[str, Any]) -> float:
    """Tokens under the bins: each bin's tok/s times its width (the last may be shorter)."""
    values = throughput["tok_s"]
    widths = [throughput["bin_s"]] * len(values)
    widths[-1] = throughput["span_s"] - throughput["bin_s"] * (len(values) - 1)
    return float(np.dot(values, widths))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_cpu_run_of_inferq_with_vllm_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sbs.json"
    code = side_by_side.main([
        "--model", "SmolLM2-135M", "--device", "cpu", "--vllm-site", str(tmp_path / "no-vllm"),
        "--workloads", "short,long_prompt", "--max-num-seqs", "8", "--max-model-len", "256",
        "--client-processes", "2", "--short-requests", "6", "--short-input-len", "16", "--short-output-len", "4",
        "--long-requests", "2", "--long-input-len", "64", "--long-output-len", "4", "--long-streams", "4",
        "--long-stream-input-len", "16", "--long-stream-output-len", "16", "--long-delay-s", "0.3",
        "--out", str(out), "--log-dir", str(tmp_path / "logs")])
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert code == 0, (res, [p.read_text()[-3000:] for p in (tmp_path / "logs").glob("*.log")])
    assert res["skipped"] == {s: f"--vllm-site {tmp_path / 'no-vllm'} does not exist"
                              for s in ("vllm-offline", "vllm-serve")}
    assert "vllm-offline skipped" in printed and "vllm-serve skipped" in printed
    assert res["date"] and res["device"] and res["versions"]["inferq"] and res["versions"]["torch"]
    assert "vllm" not in res["versions"] and res["stopped_early"] is None and res["ratios"] == {}
    assert list(res["workloads"]) == ["short", "long_prompt"]
    short, long = res["workloads"]["short"]["runs"], res["workloads"]["long_prompt"]["runs"]
    assert set(short) == {"inferq-offline", "inferq-serve"} and set(long) == {"inferq-serve"}
    offline = short["inferq-offline"]
    assert offline["num_requests"] == 6 and offline["num_incomplete"] == 0
    assert offline["total_output_tokens"] == offline["expected_output_tokens"] == 6 * 4
    assert offline["output_tok_s"] == pytest.approx(offline["total_output_tokens"] / offline["wall_s"])
    assert integral(offline["throughput"]) == pytest.approx(offline["total_output_tokens"])
    for run, expected in ((short["inferq-serve"], 6 * 4), (long["inferq-serve"], 4 * 16 + 2 * 4)):
        assert run["completed"] == run["num_requests"] and run["failed"] == 0 and run["errors"] == []
        assert run["total_output_tokens"] == run["expected_output_tokens"] == expected and run["num_incomplete"] == 0
        assert integral(run["throughput"]) == pytest.approx(expected)
        assert run["startup_s"] > 0 and run["ttft_ms"]["p99"] >= run["ttft_ms"]["median"] > 0
    lp = long["inferq-serve"]["long_prompt"]
    assert lp["long_completed"] == 2 and lp["long_ttft_ms"]["mean"] > 0
    begin, end = lp["prefill_window_s"]
    assert begin >= 0.3 - 0.05 and end > begin  # the long prompts go 0.3 s after the short streams
    runs = [offline, short["inferq-serve"], long["inferq-serve"]]
    if not nvml_works():  # this CPU machine: no trace, and the reason beside each run
        assert all(set(r["gpu"]) == {"reason"} and r["gpu"]["reason"] for r in runs)
    for workload in ("short", "long_prompt"):
        png = tmp_path / f"sbs_{workload}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"| short | serve | output tok/s | {number(short['inferq-serve']['output_tok_s'])} | - | - |" \
        in printed
    # The table again from the file alone.
    assert side_by_side.main(["--report", str(out)]) == 0
    assert "| long_prompt | serve | mean TTFT of the long prompts ms |" in capsys.readouterr().out
