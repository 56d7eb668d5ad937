"""Benchmark statistics from per-request records, computed as ``vllm bench serve`` does.

Only successful requests enter the latency stats and token totals; a failed request counts
in ``failed`` and gets output length 0. TPOT per request is ``(e2el - ttft) / (output_tokens - 1)``
and is defined only when more than one token came back. ITL stats pool every gap of every
request. A request is "good" for goodput when each SLO metric it is given is at or under the
limit (TPOT of a one-token request counts as 0, as in vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bench.loadgen.client import RequestOutput

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Summary of one latency metric in milliseconds; ``percentiles_ms`` maps p -> value."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[float, float]


@dataclass(frozen=True, slots=True)
class BenchMetrics:
    """Aggregates over one run. Throughputs are per second of ``duration_s``."""

    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    duration_s: float
    request_throughput: float  # completed requests / s
    request_goodput: float | None  # good requests / s; None without SLOs
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    output_lens: list[int]  # per request, 0 for failures
    latency: dict[str, LatencyStats] = field(default_factory=dict)  # keyed by LATENCY_METRICS


def summarize_ms(values_s: list[float], percentiles: tuple[float, ...]) -> LatencyStats:
    """Mean/median/std/percentiles of ``values_s`` (seconds) in ms; all zeros for an empty list."""
    if not values_s:
        return LatencyStats(0.0, 0.0, 0.0, {p: 0.0 for p in percentiles})
    arr_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return LatencyStats(
        mean_ms=float(np.mean(arr_ms)),
        median_ms=float(np.median(arr_ms)),
        std_ms=float(np.std(arr_ms)),
        percentiles_ms={p: float(np.percentile(arr_ms, p)) for p in percentiles},
    )


def request_tpot_s(out: RequestOutput) -> float | None:
    """Time per output token after the first, in seconds; None for fewer than two tokens."""
    if out.output_tokens <= 1:
        return None
    return (out.latency_s - out.ttft_s) / (out.output_tokens - 1)


def is_good(out: RequestOutput, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO in ``slos_ms`` (``ttft``/``tpot``/``e2el`` in ms)."""
    values_s = {"ttft": out.ttft_s, "tpot": request_tpot_s(out) or 0.0, "e2el": out.latency_s}
    return all(values_s[name] * 1000.0 <= limit_ms for name, limit_ms in slos_ms.items())


def compute_metrics(
    outputs: list[RequestOutput],
    duration_s: float,
    percentiles: tuple[float, ...] = (99.0,),
    goodput_slos_ms: dict[str, float] | None = None,
) -> BenchMetrics:
    """Aggregate per-request records over a run that took ``duration_s`` seconds (must be > 0)."""
    assert duration_s > 0.0
    ok = [o for o in outputs if o.success]
    output_lens = [o.output_tokens if o.success else 0 for o in outputs]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(output_lens)
    tpots_s = [t for o in ok if (t := request_tpot_s(o)) is not None]
    goodput = None
    if goodput_slos_ms:
        goodput = sum(is_good(o, goodput_slos_ms) for o in ok) / duration_s
    samples_s = {
        "ttft": [o.ttft_s for o in ok],
        "tpot": tpots_s,
        "itl": [gap for o in ok for gap in o.itls_s],
        "e2el": [o.latency_s for o in ok],
    }
    return BenchMetrics(
        completed=len(ok),
        failed=len(outputs) - len(ok),
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        duration_s=duration_s,
        request_throughput=len(ok) / duration_s,
        request_goodput=goodput,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        output_lens=output_lens,
        latency={name: summarize_ms(samples_s[name], percentiles) for name in LATENCY_METRICS},
    )
