"""inferq against vLLM on one GPU, in one command: the same workloads through inferq's
offline engine, vLLM's offline ``LLM``, ``inferq serve`` and vLLM's OpenAI server, the
served ones driven by the same load client, with the GPU's utilization, memory, power
draw and SM clock sampled every 100 ms (``bench/gpu_sampler.py``) beside each run.

Workloads (``--workloads``; sizes and method: ``bench/side_by_side_workloads.py``):
``decode_b1`` (offline: ms per output token), ``short``, ``lognormal``, ``shared_prefix``
(offline and served: output tok/s; served also TTFT and ITL) and ``long_prompt`` (served:
the long prompts' TTFT, the short streams' ITL while they prefill). Systems
(``--systems``; how each runs: ``bench/side_by_side_systems.py``): ``inferq-offline``,
``vllm-offline``, ``inferq-serve``, ``vllm-serve``.

Engine settings: ``--max-num-seqs`` and ``--max-model-len`` (raised where a workload needs
more), prefix caching on for ``shared_prefix`` only, everything else at each engine's
defaults. Workloads that share settings share one engine start per system; the starts go
in the order of ``--workloads`` (offline before served), each system in turn. Without
vLLM under ``--vllm-site`` its systems are skipped (one line) and the rest runs.

Output: one JSON (``--out``; rewritten after every run, so a run cut short keeps what it
measured), one PNG per workload beside it (``x.json`` -> ``x_<workload>.png``) and a
markdown table of inferq / vLLM ratios (``bench/side_by_side_report.py``).
``--max-seconds`` starts no run after that many seconds. ``--report x.json`` prints the
table and redraws the plots of a finished run.

    python -m bench.side_by_side --tokenizer-dir .tokenizer --workloads short,lognormal
    python -m bench.side_by_side --model SmolLM2-135M --device cpu --systems inferq-offline,inferq-serve \\
        --workloads short --short-requests 8 --short-input-len 16 --short-output-len 4 --out /tmp/sbs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

from bench.gpu_sampler import GPUSample, GPUSampler, busy_power_clock, trace_columns
from bench.host import cpu_description
from bench.model_folder import build_model_folder
from bench.procs import ROOT
from bench.product_bench import Clock, passthrough_env
from bench.side_by_side_report import markdown_table, plot_path, plot_workload, ratios
from bench.side_by_side_systems import (
    ENGINE,
    MODE,
    SYSTEMS,
    Context,
    drive_served,
    run_offline,
    serving,
    vllm_site_problem,
    warm_up,
)
from bench.side_by_side_workloads import (
    MODES,
    WORKLOADS,
    Sizes,
    Workload,
    build_workload,
    client_span,
    engine_settings,
    served_figures,
    throughput_bins,
    token_events,
)
from shared.model_source import DUMMY_CONFIGS

#: Seconds of GPU trace kept on each side of a run.
TRACE_MARGIN_S = 1.0
BIN_S = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class Group:
    """Workloads that one engine start per system runs: same mode, same settings."""

    mode: str
    settings: dict[str, Any]
    workloads: list[Workload]


def plan(workloads: list[Workload], max_num_seqs: int, max_model_len: int) -> list[Group]:
    """Group the workloads by mode and engine settings, in the order given (a workload's
    offline group before its served one)."""
    groups: list[Group] = []
    for w in workloads:
        settings = engine_settings(w, max_num_seqs, max_model_len)
        for mode in MODES[w.name]:
            group = next((g for g in groups if g.mode == mode and g.settings == settings), None)
            if group is None:
                groups.append(Group(mode, settings, [w]))
            else:
                group.workloads.append(w)
    return groups


def inferq_commit() -> str:
    """The checkout's git commit (``-dirty`` with uncommitted changes); ``unknown`` without git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def gpu_figures(sampler: GPUSampler, samples: list[GPUSample], start_s: float, end_s: float) -> dict[str, Any]:
    """The GPU trace of one run (from ``TRACE_MARGIN_S`` before ``start_s`` to as long after
    ``end_s``; times after ``start_s``) with the mean utilization, peak memory and, while
    busy, the median power draw and SM clock inside the run (``busy_power_clock``);
    ``reason`` instead where there is no trace."""
    if not samples:
        return {"reason": sampler.reason or "no sample"}
    inside = [s for s in samples if start_s <= s.t_s <= end_s]
    out: dict[str, Any] = {"device": sampler.device_name, "interval_s": sampler.interval_s,
                           "trace": trace_columns(samples, start_s, start_s - TRACE_MARGIN_S, end_s + TRACE_MARGIN_S)}
    if inside:
        out["util_mean_pct"] = sum(s.util_pct for s in inside) / len(inside)
        out["mem_max_bytes"] = max(s.mem_used_bytes for s in inside)
        out |= busy_power_clock(inside)
    if sampler.reason:
        out["reason"] = sampler.reason
    return out


def throughput(events: list[tuple[float, float]], start_s: float, end_s: float) -> dict[str, Any]:
    """Output tok/s over a run in ``BIN_S`` bins (``throughput_bins``), with the run's span
    (s): the bins times their widths add up to the run's output tokens."""
    return {"bin_s": BIN_S, "span_s": end_s - start_s, "tok_s": throughput_bins(events, start_s, end_s, BIN_S)}


def offline_run_figures(figures: dict[str, Any], sampler: GPUSampler, samples: list[GPUSample]) -> dict[str, Any]:
    """A child's figures of one workload with its throughput bins and GPU trace (the
    child's ``start_s``/``end_s`` read the same clock as the sampler)."""
    timeline = figures.pop("timeline")
    events = [(figures["start_s"] + t, n) for t, n in zip(timeline["t_s"], timeline["tokens"], strict=True)]
    figures["num_timeline_points"] = len(events)
    figures["throughput"] = throughput(events, figures["start_s"], figures["end_s"])
    figures["gpu"] = gpu_figures(sampler, samples, figures["start_s"], figures["end_s"])
    return figures


class Bench:
    """One invocation: the result being built, where it is saved, the clock and the context."""

    def __init__(self, args: argparse.Namespace, ctx: Context, argv: list[str]) -> None:
        self.args, self.ctx, self.clock = args, ctx, Clock(args.max_seconds)
        self.res: dict[str, Any] = {
            "benchmark": "bench.side_by_side", "command": "python -m bench.side_by_side " + shlex.join(argv),
            "date": date.today().isoformat(), "device": None, "host_cpu": cpu_description(),
            "versions": {"inferq": inferq_commit()},
            "settings": {"model": args.model, "systems": args.systems, "workloads": args.workloads,
                         "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
                         "client_processes": args.client_processes, "gateway_workers": args.gateway_workers or None,
                         "device": args.device, "seed": args.seed, "max_seconds": args.max_seconds,
                         "sizes": dataclasses.asdict(args.sizes)},
            "skipped": {}, "workloads": {}, "ratios": {}, "stopped_early": None}
        self.ok = True

    def save(self) -> None:
        """Write the result (with its ratios so far) to ``--out``."""
        self.res["elapsed_s"] = self.clock.elapsed_s()
        self.res["ratios"] = ratios(self.res)
        self.args.out.write_text(json.dumps(self.res, indent=1))

    def record(self, workload: Workload, system: str, settings: dict[str, Any], figures: dict[str, Any]) -> None:
        """Keep one run's figures, save, redraw the workload's plot, print one line."""
        entry = self.res["workloads"].setdefault(workload.name, {"settings": {}, "runs": {}})
        entry["settings"][MODE[system]] = settings
        entry["runs"][system] = figures
        self.ok = self.ok and "error" not in figures and figures.get("num_incomplete", 0) == 0 \
            and figures.get("failed", 0) == 0
        self.save()
        plot_workload(self.res, workload.name, plot_path(self.args.out, workload.name))
        if "error" in figures:
            print(f"{workload.name} / {system}: failed: {figures['error'][:500]}", flush=True)
        else:
            main = "ms_per_output_token" if "ms_per_output_token" in figures else "output_tok_s"
            print(f"{workload.name} / {system}: {main} {figures.get(main, float('nan')):,.2f}", flush=True)

    def run_group(self, group: Group, system: str) -> None:
        """One engine start of ``system`` for ``group``, its workloads run in order, the GPU
        sampled all along."""
        sampler = GPUSampler(self.args.gpu_index).start()
        try:
            if MODE[system] == "offline":
                self.run_offline_group(group, system, sampler)
            else:
                self.run_served_group(group, system, sampler)
        finally:
            sampler.stop()
            self.res["device"] = sampler.device_name or self.res["device"]

    def run_offline_group(self, group: Group, system: str, sampler: GPUSampler) -> None:
        """The offline child of ``system`` runs the group; each workload's figures are kept."""
        result = run_offline(system, group.workloads, group.settings, self.ctx,
                             time.perf_counter() + self.clock.left_s())
        samples = sampler.stop()
        self.res["device"] = self.res["device"] or result.get("device_name")
        versions = result.get("versions", {})
        if ENGINE[system] == "vllm" and "vllm" in versions:
            self.res["versions"]["vllm"] = versions["vllm"]
        if versions.get("torch"):
            self.res["versions"].setdefault("torch", versions["torch"])
        for w in group.workloads:
            if w.name in result.get("skipped", {}):
                self.res["stopped_early"] = f"--max-seconds {self.args.max_seconds:g} reached before " \
                                            f"{w.name} / {system}"
                continue
            if w.name in result.get("runs", {}):
                figures = offline_run_figures(result["runs"][w.name], sampler, samples)
                figures.update(build_s=result.get("build_s"), dtype=result.get("dtype"))
            else:
                figures = {"error": result.get("errors", {}).get(w.name) or result.get("error") or "no result"}
            self.record(w, system, group.settings, figures)

    def run_served_group(self, group: Group, system: str, sampler: GPUSampler) -> None:
        """One start of the server ``system``, a warm-up, then the group's workloads through
        the load client; a start that fails is each workload's error."""
        try:
            t0 = time.monotonic()
            with serving(system, group.settings, self.ctx) as (url, version):
                startup_s = time.monotonic() - t0
                if version:
                    self.res["versions"]["vllm"] = version
                warm_up(url, group.workloads, self.ctx)
                for w in group.workloads:
                    if self.clock.left_s() <= 0:
                        self.res["stopped_early"] = f"--max-seconds {self.args.max_seconds:g} reached before " \
                                                    f"{w.name} / {system}"
                        return
                    sent_s = time.perf_counter()
                    result = drive_served(url, w, self.ctx)
                    # The client's own span: its processes start before the first send.
                    start_s, end_s = client_span(result.outputs) or (sent_s, time.perf_counter())
                    figures = served_figures(result, w)
                    figures["startup_s"] = startup_s
                    figures["throughput"] = throughput(token_events(result.outputs), start_s, end_s)
                    figures["gpu"] = gpu_figures(sampler, sampler.samples(), start_s, end_s)
                    self.record(w, system, group.settings, figures)
        except RuntimeError as exc:
            for w in group.workloads:
                if system not in self.res["workloads"].get(w.name, {}).get("runs", {}):
                    self.record(w, system, group.settings, {"error": str(exc)})

    def run(self, groups: list[Group]) -> None:
        """Every group, each system of its mode in turn (skipped ones left out), until the
        time budget ends."""
        for group in groups:
            for system in self.args.systems:
                if MODE[system] != group.mode or system in self.res["skipped"]:
                    continue
                if self.clock.left_s() <= 0:
                    self.res["stopped_early"] = f"--max-seconds {self.args.max_seconds:g} reached before " \
                                                f"{system} ({', '.join(w.name for w in group.workloads)})"
                    return
                self.run_group(group, system)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.side_by_side", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ",".join(WORKLOADS))
    ap.add_argument("--model", default="Qwen2.5-7B", choices=sorted(DUMMY_CONFIGS), help="dummy config name")
    ap.add_argument("--tokenizer-dir", type=Path, help="tokenizer files (default: the converted SmolLM2 folder; "
                    "write them with python -m bench.product_bench --export-tokenizer DIR)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="inferq's device")
    ap.add_argument("--gpu-index", type=int, default=0, help="the GPU that NVML samples (NVML's numbering)")
    ap.add_argument("--vllm-site", type=Path, default=Path("/tmp/vsite"), help="vLLM's install tree (its PYTHONPATH)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096, help="raised where a workload needs more")
    ap.add_argument("--client-processes", type=int, default=8, help="load-client processes of each served run")
    ap.add_argument("--gateway-workers", type=int, default=0, help="inferq serve's gateway processes (0: its default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=420.0, help="start no run after this many seconds")
    ap.add_argument("--start-timeout-s", type=float, default=300.0, help="longest engine or server start")
    ap.add_argument("--run-timeout-s", type=float, default=600.0, help="longest workload run (and request)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/side_by_side/h200.json")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/inferq-side-by-side"), help="the systems' logs")
    ap.add_argument("--report", type=Path, metavar="JSON", help="only print the table and redraw the plots of JSON")
    sizes = ap.add_argument_group("workload sizes (bench/side_by_side_workloads.py)")
    for f in dataclasses.fields(Sizes):
        sizes.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args, extra = ap.parse_known_args(argv)
    try:  # the rest are inferq's settings flags, for its offline child and serve alike
        args.inferq_env = passthrough_env(extra)
    except ValueError as exc:
        ap.error(str(exc))
    args.systems = [s for s in args.systems.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    bad = [s for s in args.systems if s not in SYSTEMS] + [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.systems or not args.workloads:
        ap.error(f"unknown or no systems/workloads: {bad} (systems: {','.join(SYSTEMS)}; "
                 f"workloads: {','.join(WORKLOADS)})")
    if min(args.max_num_seqs, args.max_model_len, args.client_processes) < 1 or args.gateway_workers < 0:
        ap.error("--max-num-seqs, --max-model-len and --client-processes must be at least 1, "
                 "--gateway-workers at least 0")
    try:
        args.sizes = Sizes(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)})
    except ValueError as exc:
        ap.error(str(exc))
    return args


def report(path: Path) -> int:
    """``--report``: the table and the plots of a result file."""
    res = json.loads(path.read_text())
    for workload in res["workloads"]:
        plot_workload(res, workload, plot_path(path, workload))
    print(markdown_table(res))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0 when every run that was not skipped completed every
    request with every token asked for, else 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.report:
        return report(args.report)
    workloads = [build_workload(name, args.sizes, args.seed) for name in args.workloads]
    limit = DUMMY_CONFIGS[args.model].get("max_position_embeddings")
    for w in workloads:
        need = engine_settings(w, args.max_num_seqs, args.max_model_len)["max_model_len"]
        if limit and need > limit:
            print(f"side_by_side: {w.name} needs max_model_len {need}, past {args.model}'s {limit} positions",
                  file=sys.stderr)
            return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="inferq-side-by-side-"))
    try:
        model_dir, num_fillers = build_model_folder(args.model, work, args.tokenizer_dir)
        ctx = Context(model_dir=model_dir, work_dir=work, log_dir=args.log_dir, device=args.device,
                      vllm_site=args.vllm_site, gateway_workers=args.gateway_workers,
                      client_processes=args.client_processes, seed=args.seed,
                      start_timeout_s=args.start_timeout_s, run_timeout_s=args.run_timeout_s,
                      inferq_env=args.inferq_env)
        bench = Bench(args, ctx, argv)
        bench.res["settings"]["tokenizer_filler_tokens"] = num_fillers
        bench.res["settings"]["inferq_env"] = args.inferq_env
        problem = vllm_site_problem(args.vllm_site)
        for system in args.systems:
            if problem and ENGINE[system] == "vllm":
                bench.res["skipped"][system] = problem
                print(f"{system} skipped: {problem}", flush=True)
        try:
            bench.run(plan(workloads, args.max_num_seqs, args.max_model_len))
        finally:
            bench.save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(markdown_table(bench.res))
    print(f"\nwrote {args.out} and its plots", flush=True)
    return 0 if bench.ok and not bench.res["stopped_early"] else 1


if __name__ == "__main__":
    sys.exit(main())
