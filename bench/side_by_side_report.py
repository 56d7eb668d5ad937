"""What ``bench/side_by_side.py`` prints and draws from its result: the inferq / vLLM ratio
of each figure a reader compares (``FIGURES``), a markdown table of them, and one PNG per
workload with each system's output tok/s and GPU utilization over time.

A ratio is inferq's figure over vLLM's, for the same workload and mode (offline, or
served through the same load client); it exists only where both systems ran. Above 1 is
better for inferq in output tok/s, below 1 in milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.loadgen.plots import new_figure
from bench.side_by_side_workloads import OFFLINE, SERVE

#: The figures compared, per kind of run: (label, path into a run's figures).
FIGURES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "decode": (("ms per output token", ("ms_per_output_token",)),),
    OFFLINE: (("output tok/s", ("output_tok_s",)),),
    SERVE: (("output tok/s", ("output_tok_s",)), ("mean TTFT ms", ("ttft_ms", "mean")),
            ("median ITL ms", ("itl_ms", "median")), ("p99 ITL ms", ("itl_ms", "p99"))),
    "long_prompt": (("mean TTFT of the long prompts ms", ("long_prompt", "long_ttft_ms", "mean")),
                    ("median ITL of the short streams while they prefill ms",
                     ("long_prompt", "short_itl_during_prefill_ms", "median")),
                    ("p99 ITL of the short streams while they prefill ms",
                     ("long_prompt", "short_itl_during_prefill_ms", "p99"))),
    # Every run, where NVML reports them (bench/gpu_sampler.py, busy_power_clock).
    "gpu": (("GPU power while busy, median W", ("gpu", "busy_power_median_w")),
            ("SM clock while busy, median MHz", ("gpu", "busy_sm_clock_median_mhz"))),
}
#: The pair compared in each mode: (inferq's system, vLLM's).
PAIRS = {OFFLINE: ("inferq-offline", "vllm-offline"), SERVE: ("inferq-serve", "vllm-serve")}
COLORS = {"inferq": "tab:blue", "vllm": "tab:orange"}
LINESTYLES = {OFFLINE: "-", SERVE: "--"}


def figures_for(workload: str, mode: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The figures compared for ``workload`` in ``mode``, the GPU's power and clock last."""
    if mode == OFFLINE:
        return (FIGURES["decode"] if workload == "decode_b1" else FIGURES[OFFLINE]) + FIGURES["gpu"]
    return FIGURES[SERVE] + (FIGURES["long_prompt"] if workload == "long_prompt" else ()) + FIGURES["gpu"]


def value_at(run: dict[str, Any] | None, path: tuple[str, ...]) -> float | None:
    """The number at ``path`` in a run's figures; None where the run or the figure is missing."""
    node: Any = run
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, (int, float)) else None


def comparison_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per workload, mode and figure where inferq's side ran: ``workload``,
    ``mode``, ``figure``, ``inferq``, ``vllm`` (None where it did not run) and ``ratio``
    (inferq / vLLM; None without both, or with vLLM's figure 0)."""
    rows = []
    for workload, entry in res.get("workloads", {}).items():
        runs = entry.get("runs", {})
        for mode, (ours, theirs) in PAIRS.items():
            if ours not in runs and theirs not in runs:
                continue
            for label, path in figures_for(workload, mode):
                a, b = value_at(runs.get(ours), path), value_at(runs.get(theirs), path)
                if a is None and b is None:
                    continue
                rows.append({"workload": workload, "mode": mode, "figure": label, "inferq": a, "vllm": b,
                             "ratio": a / b if a is not None and b else None})
    return rows


def ratios(res: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """``{workload: {mode: {figure: inferq / vLLM}}}``, only where both sides measured it."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for row in comparison_rows(res):
        if row["ratio"] is not None:
            out.setdefault(row["workload"], {}).setdefault(row["mode"], {})[row["figure"]] = row["ratio"]
    return out


def number(value: float | None) -> str:
    """A figure for the table: thousands separated, one decimal under 100, '-' for none."""
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def markdown_table(res: dict[str, Any]) -> str:
    """The comparison as markdown: a heading line (model, device, date), the command and
    versions, then one row per ``comparison_rows`` row."""
    st, v = res["settings"], res.get("versions", {})
    lines = [f"## inferq and vLLM side by side: {st['model']} on {res.get('device') or '?'}, {res['date']}", "",
             (f"Command: `{res['command']}`. inferq {v.get('inferq', '?')}, vLLM {v.get('vllm', '-')}, "
             f"torch {v.get('torch', '?')}; max_num_seqs {st['max_num_seqs']}, max_model_len {st['max_model_len']} "
             f"(raised where a workload needs more), {st['client_processes']} client processes. "
             "inferq / vLLM: above 1 is better for inferq in tok/s, below 1 in ms."), "",
             "| workload | mode | figure | inferq | vLLM | inferq / vLLM |", "| --- | --- | --- | --- | --- | --- |"]
    for row in comparison_rows(res):
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        lines.append(f"| {row['workload']} | {row['mode']} | {row['figure']} | {number(row['inferq'])} "
                     f"| {number(row['vllm'])} | {ratio} |")
    for system, why in res.get("skipped", {}).items():
        lines.append(f"\n{system} skipped: {why}.")
    if res.get("stopped_early"):
        lines.append(f"\nStopped early: {res['stopped_early']}.")
    return "\n".join(lines)


def plot_path(out: Path, workload: str) -> Path:
    """Where the PNG of ``workload`` goes: ``x.json`` -> ``x_<workload>.png``."""
    return out.with_name(f"{out.stem}_{workload}.png")


def plot_workload(res: dict[str, Any], workload: str, path: Path) -> Path:
    """Each run of ``workload``: output tok/s (1-s bins of the client's or the engine's
    token times) above, with ``long_prompt``'s prefill window shaded, GPU utilization (%)
    below, against seconds since the run began."""
    fig = new_figure()
    fig.set_size_inches(8.0, 6.0)
    top, bottom = fig.subplots(2, 1, sharex=True)
    reasons = set()
    for system, run in res["workloads"][workload].get("runs", {}).items():
        engine, mode = system.split("-")
        style = {"color": COLORS[engine], "linestyle": LINESTYLES[mode], "label": f"{engine} {mode}"}
        bins = run.get("throughput", {})
        if bins.get("tok_s"):
            width = bins["bin_s"]
            top.step([i * width for i in range(len(bins["tok_s"]) + 1)], [*bins["tok_s"], bins["tok_s"][-1]],
                     where="post", **style)
        window = run.get("long_prompt", {}).get("prefill_window_s")
        if window:  # the long prompts' prefill, from the first send to the last first token
            top.axvspan(*window, color=COLORS[engine], alpha=0.12)
        gpu = run.get("gpu", {})
        if gpu.get("trace", {}).get("t_s"):
            bottom.plot(gpu["trace"]["t_s"], gpu["trace"]["util_pct"], **style)
        elif gpu.get("reason"):
            reasons.add(gpu["reason"])
    top.set_ylabel("output tok/s")
    top.set_ylim(bottom=0)
    top.grid(True, alpha=0.3)
    bottom.set_ylabel("GPU utilization (%)")
    bottom.set_ylim(0, 105)
    bottom.set_xlabel("seconds since the run began")
    bottom.grid(True, alpha=0.3)
    if reasons and not bottom.get_lines():
        bottom.text(0.5, 0.5, "no GPU trace: " + "; ".join(sorted(reasons)), ha="center", va="center",
                    transform=bottom.transAxes, wrap=True)
    if top.get_lines():
        top.legend(loc="best")
    top.set_title(f"{workload}: {res['settings']['model']} on {res.get('device') or '?'}, {res['date']}",
                  fontsize="medium")
    fig.savefig(path)
    return path
