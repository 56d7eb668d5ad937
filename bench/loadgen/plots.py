"""PNG plots of a sweep (matplotlib, Agg canvas: no display, no pyplot global state).

- ``throughput.png``: output tokens/s (left axis) and requests/s (right axis) per point;
- ``ttft.png`` and ``itl.png``: the empirical CDF of TTFT and of inter-token latency (ms), one
  line per point (successful requests only; ITLs pooled over every request of the point);
- ``goodput.png``: request goodput and request throughput (req/s) per point, with the share of
  requests that met the SLO, under the SLO given with ``--goodput`` (only when one was given).

The x axis of the per-point plots is categorical (one tick per swept value, in sweep order):
sweeps usually double the value each step, and ``inf`` has no place on a numeric axis.
matplotlib is an optional dependency (``pip install -e '.[bench]'``), imported when plotting.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bench.loadgen.sweep import AXIS_TITLES, SweepResult, value_label

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FIGURE_SIZE_IN = (7.0, 4.5)
DPI = 120
# A CDF whose samples span more than this ratio (max / min) gets a log x axis.
LOG_SCALE_MIN_RATIO = 20.0


def new_figure() -> Figure:
    """An empty figure on an Agg canvas."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError("plots need matplotlib: pip install -e '.[bench]'") from exc
    fig = Figure(figsize=FIGURE_SIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def set_point_axis(ax: Axes, sweep: SweepResult) -> np.ndarray:
    """Categorical x axis with one tick per point; returns the x positions, shape ``(num_points,)``."""
    xs = np.arange(len(sweep.points), dtype=np.float64)
    ax.set_xticks(xs, [value_label(p.value) for p in sweep.points])
    ax.set_xlabel(AXIS_TITLES[sweep.plan.axis])
    ax.grid(True, alpha=0.3)
    return xs


def title_suffix(sweep: SweepResult) -> str:
    """``"(200 prompts, in 1024 / out 128 tokens)"``: the workload, for plot titles."""
    b = sweep.base
    return f"({b.num_prompts} prompts, in {b.random_input_len} / out {b.random_output_len} tokens)"


def plot_throughput(sweep: SweepResult, path: Path) -> Path:
    """Output token throughput (tok/s) and request throughput (req/s) against the swept value."""
    fig = new_figure()
    ax = fig.add_subplot()
    xs = set_point_axis(ax, sweep)
    out_tps = [p.result.metrics.output_throughput for p in sweep.points]
    req_ps = [p.result.metrics.request_throughput for p in sweep.points]
    ax.plot(xs, out_tps, "o-", color="tab:blue", label="output tokens/s")
    ax.set_ylabel("output throughput (tok/s)", color="tab:blue")
    ax.set_ylim(bottom=0)
    right = ax.twinx()
    right.plot(xs, req_ps, "s--", color="tab:orange", label="requests/s")
    right.set_ylabel("request throughput (req/s)", color="tab:orange")
    right.set_ylim(bottom=0)
    ax.set_title(f"Throughput {title_suffix(sweep)}")
    fig.legend(loc="outside lower center", ncols=2)
    fig.savefig(path)
    return path


def latency_samples_ms(sweep: SweepResult, metric: str) -> list[np.ndarray]:
    """Per point, the sorted samples of ``metric`` (``ttft`` or ``itl``) in ms, successful requests only."""
    samples = []
    for point in sweep.points:
        ok = [o for o in point.result.outputs if o.success]
        values_s = [o.ttft_s for o in ok] if metric == "ttft" else [gap for o in ok for gap in o.itls_s]
        samples.append(np.sort(np.asarray(values_s, dtype=np.float64)) * 1000.0)
    return samples


def plot_latency_cdf(sweep: SweepResult, metric: str, path: Path) -> Path:
    """Empirical CDF of ``metric`` (``ttft`` or ``itl``, ms), one step line per point."""
    assert metric in ("ttft", "itl"), metric
    fig = new_figure()
    ax = fig.add_subplot()
    samples = latency_samples_ms(sweep, metric)
    for point, values_ms in zip(sweep.points, samples, strict=True):
        if values_ms.size:
            # Start at (first sample, 0): the CDF rises from 0 at the smallest sample.
            xs = np.concatenate((values_ms[:1], values_ms))
            fractions = np.arange(values_ms.size + 1) / values_ms.size
            ax.step(xs, fractions, where="post", label=f"{sweep.plan.stem} {value_label(point.value)}")
    pooled = np.concatenate(samples)
    if pooled.size and pooled.min() > 0 and pooled.max() / pooled.min() > LOG_SCALE_MIN_RATIO:
        ax.set_xscale("log")
    name = {"ttft": "time to first token", "itl": "inter-token latency"}[metric]
    ax.set_xlabel(f"{name} (ms)")
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"{metric.upper()} distribution {title_suffix(sweep)}")
    if ax.get_lines():
        ax.legend(loc="lower right")
    fig.savefig(path)
    return path


def slo_text(slos_ms: dict[str, float]) -> str:
    """``{"ttft": 500, "tpot": 50}`` -> ``"TTFT <= 500 ms, TPOT <= 50 ms"``."""
    return ", ".join(f"{name.upper()} <= {limit_ms:g} ms" for name, limit_ms in slos_ms.items())


def plot_goodput(sweep: SweepResult, path: Path) -> Path | None:
    """Request goodput and throughput (req/s) against the swept value; None when no SLO was given."""
    if not sweep.base.goodput_slos_ms:
        return None
    fig = new_figure()
    ax = fig.add_subplot()
    xs = set_point_axis(ax, sweep)
    goodput = [p.result.metrics.request_goodput or 0.0 for p in sweep.points]
    throughput = [p.result.metrics.request_throughput for p in sweep.points]
    ax.plot(xs, throughput, "s--", color="tab:gray", label="request throughput")
    ax.plot(xs, goodput, "o-", color="tab:green", label="request goodput (met the SLO)")
    for x, good, total in zip(xs, goodput, throughput, strict=True):
        share = good / total if total else 0.0
        ax.annotate(f"{share:.0%}", (x, good), textcoords="offset points", xytext=(0, 6), ha="center")
    ax.set_ylabel("requests/s")
    ax.set_ylim(0, 1.15 * max(throughput + goodput + [1e-9]))  # head room for the share labels
    ax.set_title(f"Goodput under SLO {slo_text(sweep.base.goodput_slos_ms)}")
    ax.legend(loc="best")
    fig.savefig(path)
    return path


def write_plots(sweep: SweepResult, out_dir: Path) -> list[Path]:
    """Every plot of the sweep as PNG in ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        plot_throughput(sweep, out_dir / "throughput.png"),
        plot_latency_cdf(sweep, "ttft", out_dir / "ttft.png"),
        plot_latency_cdf(sweep, "itl", out_dir / "itl.png"),
        plot_goodput(sweep, out_dir / "goodput.png"),
    ]
    return [p for p in paths if p is not None]
