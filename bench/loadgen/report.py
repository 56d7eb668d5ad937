"""The run's result: the JSON that ``vllm bench serve --save-result`` writes, and a rich table.

Field names match vLLM's result JSON so existing tooling reads ours: run info (``date``,
``endpoint_type``/``backend``, ``label``, ``model_id``, ``tokenizer_id``, ``num_prompts``,
``request_rate``, ``burstiness``, ``max_concurrency``), aggregates (``duration``, ``completed``,
``failed``, ``total_*_tokens``, ``*_throughput``, ``request_goodput``), per-request lists
(``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``generated_texts``, ``errors``; times in
seconds) and ``{mean,median,std,pXX}_{ttft,tpot,itl,e2el}_ms``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.loadgen.client import RequestOutput
from bench.loadgen.metrics import LATENCY_METRICS, BenchMetrics

METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
DATE_FORMAT = "%Y%m%d-%H%M%S"  # vLLM's format for ``date`` and file names


def percentile_word(p: float) -> str:
    """``99.0 -> "99"``, ``99.9 -> "99.9"``: the ``p*`` part of vLLM's key names."""
    return str(int(p)) if int(p) == p else str(p)


@dataclass(slots=True)
class BenchResult:
    """One finished run: its settings, aggregates and per-request records."""

    date: str
    endpoint_type: str
    label: str | None
    model_id: str
    tokenizer_id: str
    num_prompts: int
    request_rate_per_s: float
    burstiness: float
    max_concurrency: int | None
    percentiles: tuple[float, ...]
    metrics: BenchMetrics
    outputs: list[RequestOutput]

    def to_dict(self) -> dict[str, Any]:
        """The result as vLLM names it (``request_rate`` is the string ``"inf"`` when infinite)."""
        m = self.metrics
        rate: float | str = "inf" if math.isinf(self.request_rate_per_s) else self.request_rate_per_s
        result: dict[str, Any] = {
            "date": self.date,
            "endpoint_type": self.endpoint_type,
            "backend": self.endpoint_type,  # older vLLM (and tools written for it) read this name
            "label": self.label,
            "model_id": self.model_id,
            "tokenizer_id": self.tokenizer_id,
            "num_prompts": self.num_prompts,
            "request_rate": rate,
            "burstiness": self.burstiness,
            "max_concurrency": self.max_concurrency,
            "duration": m.duration_s,
            "completed": m.completed,
            "failed": m.failed,
            "total_input_tokens": m.total_input_tokens,
            "total_output_tokens": m.total_output_tokens,
            "request_throughput": m.request_throughput,
            "request_goodput": m.request_goodput,
            "output_throughput": m.output_throughput,
            "total_token_throughput": m.total_token_throughput,
            "input_lens": [o.prompt_len for o in self.outputs],
            "output_lens": m.output_lens,
            "ttfts": [o.ttft_s for o in self.outputs],
            "itls": [o.itls_s for o in self.outputs],
            "generated_texts": [o.generated_text for o in self.outputs],
            "errors": [o.error for o in self.outputs],
        }
        for name in LATENCY_METRICS:
            stats = m.latency[name]
            result[f"mean_{name}_ms"] = stats.mean_ms
            result[f"median_{name}_ms"] = stats.median_ms
            result[f"std_{name}_ms"] = stats.std_ms
            for p, value_ms in stats.percentiles_ms.items():
                result[f"p{percentile_word(p)}_{name}_ms"] = value_ms
        return result

    def to_json(self) -> str:
        """``to_dict()`` as indented JSON text."""
        return json.dumps(self.to_dict(), indent=2)

    def default_filename(self) -> str:
        """vLLM's naming: ``{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json``."""
        rate = "inf" if math.isinf(self.request_rate_per_s) else f"{self.request_rate_per_s:g}"
        concurrency = f"-concurrency{self.max_concurrency}" if self.max_concurrency is not None else ""
        model = self.model_id.rstrip("/").split("/")[-1]
        return f"{self.label or self.endpoint_type}-{rate}qps{concurrency}-{model}-{self.date}.json"

    def save(self, result_dir: str | Path, filename: str | None = None) -> Path:
        """Write ``to_json()`` to ``result_dir/filename`` (default name if None); returns the path."""
        path = Path(result_dir) / (filename or self.default_filename())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path


def now_date() -> str:
    """Current local time in vLLM's ``date`` format."""
    return datetime.now().strftime(DATE_FORMAT)


def render_table(result: BenchResult) -> Table:
    """Rich table with the lines vLLM prints after a run."""
    m = result.metrics
    table = Table(title="Serving Benchmark Result", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows: list[tuple[str, str]] = [
        ("Successful requests", str(m.completed)),
        ("Failed requests", str(m.failed)),
        ("Maximum request concurrency", str(result.max_concurrency)),
        ("Benchmark duration (s)", f"{m.duration_s:.2f}"),
        ("Total input tokens", str(m.total_input_tokens)),
        ("Total generated tokens", str(m.total_output_tokens)),
        ("Request throughput (req/s)", f"{m.request_throughput:.2f}"),
    ]
    if m.request_goodput is not None:
        rows.append(("Request goodput (req/s)", f"{m.request_goodput:.2f}"))
    rows += [
        ("Output token throughput (tok/s)", f"{m.output_throughput:.2f}"),
        ("Total Token throughput (tok/s)", f"{m.total_token_throughput:.2f}"),
    ]
    for label, value in rows:
        table.add_row(label, value)
    for name in LATENCY_METRICS:
        stats = m.latency[name]
        table.add_section()
        table.add_row(f"[bold]{METRIC_TITLES[name]}[/bold]", "")
        upper = name.upper()
        table.add_row(f"Mean {upper} (ms)", f"{stats.mean_ms:.2f}")
        table.add_row(f"Median {upper} (ms)", f"{stats.median_ms:.2f}")
        for p, value_ms in stats.percentiles_ms.items():
            table.add_row(f"P{percentile_word(p)} {upper} (ms)", f"{value_ms:.2f}")
    return table


def print_report(result: BenchResult, console: Console | None = None) -> None:
    """Print the result table (and the first distinct errors, if any) to ``console``."""
    console = console or Console()
    console.print(render_table(result))
    errors = sorted({o.error for o in result.outputs if o.error})
    for error in errors[:5]:
        console.print(f"[red]error:[/red] {error}")
