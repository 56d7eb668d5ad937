"""A sweep: one benchmark per value of max concurrency or of request rate, then a summary and plots.

Each point is a full :func:`run_benchmark` run with the same prompts (same seed), saved as its
own vLLM-compatible JSON (``concurrency-4.json``, ``rate-inf.json``). ``sweep.json`` holds the
sweep's settings and one row per point with every aggregate field of the point's JSON (vLLM's
names; the per-request lists stay in the point files). Plots come from
:mod:`bench.loadgen.plots`. Points run one after another against a server that stays up, so a
point inherits whatever warm state (prefix cache, CUDA graphs) the earlier points left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.loadgen.config import BenchConfig
from bench.loadgen.report import BenchResult, now_date, percentile_word
from bench.loadgen.runner import load_tokenizer, run_benchmark

# The two things a sweep can vary, as vLLM's result JSON names them, and their file-name stems.
CONCURRENCY_AXIS = "max_concurrency"
RATE_AXIS = "request_rate"
AXIS_STEMS = {CONCURRENCY_AXIS: "concurrency", RATE_AXIS: "rate"}
AXIS_TITLES = {CONCURRENCY_AXIS: "max concurrency (requests)", RATE_AXIS: "request rate (req/s)"}
SUMMARY_FILENAME = "sweep.json"
# Per-request lists of a point's JSON: left out of the summary rows (they are in the point files).
PER_REQUEST_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


def value_label(value: float) -> str:
    """``4.0 -> "4"``, ``0.5 -> "0.5"``, ``inf -> "inf"``: a sweep value in file names, JSON and plots."""
    return "inf" if math.isinf(value) else f"{value:g}"


@dataclass(frozen=True, slots=True)
class SweepPlan:
    """What to vary: ``axis`` is ``max_concurrency`` (values: requests in flight, whole numbers
    >= 1) or ``request_rate`` (values: requests/s > 0, ``inf`` sends all at once)."""

    axis: str
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        assert self.axis in AXIS_STEMS, f"sweep axis must be one of {list(AXIS_STEMS)}"
        assert self.values, "a sweep needs at least one value"
        assert len(set(self.values)) == len(self.values), "sweep values must be distinct"
        if self.axis == CONCURRENCY_AXIS:
            assert all(v >= 1 and float(v).is_integer() for v in self.values), "concurrencies must be integers >= 1"
        else:
            assert all(v > 0 for v in self.values), "request rates must be positive (inf for all at once)"

    @property
    def stem(self) -> str:
        """``concurrency`` or ``rate``."""
        return AXIS_STEMS[self.axis]

    def point_config(self, base: BenchConfig, value: float) -> BenchConfig:
        """``base`` with this point's value set (and its own progress bar off: the sweep draws bars)."""
        if self.axis == CONCURRENCY_AXIS:
            return dataclasses.replace(base, max_concurrency=int(value), show_progress=False)
        return dataclasses.replace(base, request_rate_per_s=value, show_progress=False)

    def point_filename(self, value: float) -> str:
        """``concurrency-4.json``, ``rate-inf.json``."""
        return f"{self.stem}-{value_label(value)}.json"


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One finished point: the swept value and the run's result."""

    value: float
    result: BenchResult


@dataclass(slots=True)
class SweepResult:
    """A finished sweep: its plan, the settings shared by every point, and the points in order."""

    plan: SweepPlan
    base: BenchConfig
    date: str
    points: list[SweepPoint]

    def summary_row(self, point: SweepPoint) -> dict[str, Any]:
        """The point's JSON without the per-request lists, plus ``sweep_value`` and ``result_file``."""
        data = point.result.to_dict()
        row = {"sweep_value": value_label(point.value), "result_file": self.plan.point_filename(point.value)}
        row.update((k, v) for k, v in data.items() if k not in PER_REQUEST_FIELDS)
        return row

    def summary_dict(self, plot_files: list[str]) -> dict[str, Any]:
        """``sweep.json``: settings, SLOs, the plots' file names and one row per point."""
        base = self.base
        fixed_rate: float | str = "inf" if math.isinf(base.request_rate_per_s) else base.request_rate_per_s
        return {
            "date": self.date,
            "sweep_axis": self.plan.axis,
            "sweep_values": [value_label(v) for v in self.plan.values],
            "endpoint_type": base.endpoint_type,
            "base_urls": [base.base_url, *base.extra_base_urls],
            "num_prompts": base.num_prompts,
            "random_input_len": base.random_input_len,
            "random_output_len": base.random_output_len,
            "random_range_ratio": base.random_range_ratio,
            "ignore_eos": base.ignore_eos,
            # The setting that stays fixed while the other one is swept.
            "request_rate": None if self.plan.axis == RATE_AXIS else fixed_rate,
            "max_concurrency": None if self.plan.axis == CONCURRENCY_AXIS else base.max_concurrency,
            "burstiness": base.burstiness,
            "seed": base.seed,
            "goodput_slos_ms": base.goodput_slos_ms,
            "plots": plot_files,
            "points": [self.summary_row(p) for p in self.points],
        }

    def save(self, out_dir: Path, plot_files: list[str]) -> Path:
        """Write each point's JSON and ``sweep.json`` into ``out_dir``; returns the summary's path."""
        out_dir.mkdir(parents=True, exist_ok=True)
        for point in self.points:
            point.result.save(out_dir, self.plan.point_filename(point.value))
        path = out_dir / SUMMARY_FILENAME
        path.write_text(json.dumps(self.summary_dict(plot_files), indent=2))
        return path


@contextmanager
def sweep_progress(enabled: bool, plan: SweepPlan, num_prompts: int) -> Iterator[Callable[[float], Callable[[], None]]]:
    """Yields ``start_point(value) -> advance``: an overall bar over every request of the sweep and
    one bar per point, added as the point starts (no-ops when not ``enabled``)."""
    if not enabled:
        yield lambda value: lambda: None
        return
    columns = (TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as progress:
        overall = progress.add_task(f"sweep {plan.stem}", total=num_prompts * len(plan.values))

        def start_point(value: float) -> Callable[[], None]:
            task = progress.add_task(f"  {plan.stem}={value_label(value)}", total=num_prompts)

            def advance() -> None:
                progress.advance(task)
                progress.advance(overall)

            return advance

        yield start_point


async def run_sweep(base: BenchConfig, plan: SweepPlan) -> SweepResult:
    """Run one benchmark per value of ``plan`` (in the given order) with ``base``'s other settings.

    The tokenizer (if ``base.tokenizer``) is loaded once for all points. Raises what
    :func:`run_benchmark` raises; request failures are recorded in the points, not raised.
    """
    tokenizer = await asyncio.to_thread(load_tokenizer, base.tokenizer) if base.tokenizer else None
    points: list[SweepPoint] = []
    with sweep_progress(base.show_progress, plan, base.num_prompts) as start_point:
        for value in plan.values:
            cfg = plan.point_config(base, value)
            result = await run_benchmark(cfg, tokenizer=tokenizer, on_request_done=start_point(value))
            points.append(SweepPoint(value=value, result=result))
    return SweepResult(plan=plan, base=base, date=now_date(), points=points)


def render_sweep_table(sweep: SweepResult) -> Table:
    """One row per point: counts, throughputs, goodput and the main latencies."""
    table = Table(title=f"Sweep over {AXIS_TITLES[sweep.plan.axis]}")
    # The highest percentile asked for (99 by default), or the median when none was.
    p_hi = max(sweep.base.percentiles, default=None)
    p_word = "median" if p_hi is None else f"p{percentile_word(p_hi)}"
    headers = (sweep.plan.stem, "ok/failed", "req/s", "out tok/s", "goodput req/s", f"TTFT mean/{p_word} ms",
               "TPOT mean ms", f"ITL mean/{p_word} ms")
    for header in headers:
        table.add_column(header, justify="right")
    for point in sweep.points:
        m = point.result.metrics
        ttft, itl = m.latency["ttft"], m.latency["itl"]
        ttft_hi = ttft.median_ms if p_hi is None else ttft.percentiles_ms[p_hi]
        itl_hi = itl.median_ms if p_hi is None else itl.percentiles_ms[p_hi]
        goodput = "-" if m.request_goodput is None else f"{m.request_goodput:.2f}"
        table.add_row(
            value_label(point.value),
            f"{m.completed}/{m.failed}",
            f"{m.request_throughput:.2f}",
            f"{m.output_throughput:.1f}",
            goodput,
            f"{ttft.mean_ms:.1f}/{ttft_hi:.1f}",
            f"{m.latency['tpot'].mean_ms:.1f}",
            f"{itl.mean_ms:.1f}/{itl_hi:.1f}",
        )
    return table


def print_sweep(sweep: SweepResult, console: Console | None = None) -> None:
    """Print the sweep table (140 columns wide when stdout is not a terminal, e.g. a log file)."""
    console = console or (Console() if sys.stdout.isatty() else Console(width=140))
    console.print(render_sweep_table(sweep))
