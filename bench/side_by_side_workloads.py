"""The workloads of ``bench/side_by_side.py``: their requests, the engine settings each
needs, and the figures taken from what the load client recorded.

Every prompt is random token ids (``bench.placement_workloads.random_ids``); every request
is greedy with ``ignore_eos``, so it yields exactly its ``max_tokens``. Sizes in ``Sizes``
(defaults: the GPU run):

- ``decode_b1``: one prompt of ``decode_input_len`` tokens, ``decode_output_len`` out,
  alone (offline only): ms per output token.
- ``short``: ``short_requests`` x ``short_input_len`` in / ``short_output_len`` out, all at
  once: output tok/s.
- ``lognormal``: ``lognormal_requests`` with lognormal prompt and output lengths
  (``placement_workloads.lognormal_lengths``) around their medians, capped; offline all at
  once, served at ``lognormal_concurrency`` streams.
- ``shared_prefix``: ``prefix_groups`` system prompts of ``prefix_len`` tokens, each with
  ``prefix_prompts_per_group`` questions of ``prefix_question_len`` tokens (SGLang's
  generated-shared-prefix: ``placement_workloads.shared_prefix_prompts``), all at once,
  with prefix caching on.
- ``long_prompt`` (served only): ``long_streams`` short streams first, then, ``long_delay_s``
  later, ``long_requests`` prompts of ``long_input_len`` tokens: the long ones' TTFT, and
  the short streams' ITL while the long ones prefill (from the first long send to the
  last long first token) against their ITL before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.loadgen.client import RequestOutput
from bench.loadgen.metrics import summarize_ms
from bench.loadgen.report import BenchResult
from bench.placement_workloads import Sizes as PlacementSizes
from bench.placement_workloads import lognormal_lengths, random_ids, shared_prefix_prompts

WORKLOADS = ("decode_b1", "short", "lognormal", "shared_prefix", "long_prompt")
OFFLINE, SERVE = "offline", "serve"
#: The modes each workload runs in.
MODES = {"decode_b1": (OFFLINE,), "short": (OFFLINE, SERVE), "lognormal": (OFFLINE, SERVE),
         "shared_prefix": (OFFLINE, SERVE), "long_prompt": (SERVE,)}
#: A raised ``max_model_len`` is a multiple of this many tokens.
MAX_MODEL_LEN_STEP = 1024
LONG, SHORT = "long", "short"


@dataclass(frozen=True, slots=True)
class Sizes:
    """Workload sizes (module docstring); lengths in tokens, times in seconds."""

    decode_input_len: int = 256
    decode_output_len: int = 512
    decode_repeats: int = 3
    short_requests: int = 1000
    short_input_len: int = 256
    short_output_len: int = 64
    lognormal_requests: int = 800
    lognormal_input_median: int = 500
    lognormal_output_median: int = 150
    lognormal_input_max: int = 3000
    lognormal_output_max: int = 512
    lognormal_sigma: float = PlacementSizes().throughput_sigma
    lognormal_concurrency: int = 256
    prefix_groups: int = 32
    prefix_prompts_per_group: int = 8
    prefix_len: int = 2000
    prefix_question_len: int = 100
    prefix_output_len: int = 64
    long_requests: int = 8
    long_input_len: int = 24000
    long_output_len: int = 64
    long_streams: int = 64
    long_stream_input_len: int = 256
    long_stream_output_len: int = 256
    long_delay_s: float = 1.0

    def __post_init__(self) -> None:
        """Raises: ValueError: a count or length below 1, a decode of fewer than 2 tokens,
        a negative sigma or delay, a cap below its median, long prompts no longer than the
        short streams' (the figures tell them apart by length)."""
        counts = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("lognormal_sigma", "long_delay_s")}
        low = [k for k, v in counts.items() if v < 1]
        if low:
            raise ValueError(f"sizes must be at least 1: {', '.join(low)}")
        if self.decode_output_len < 2:
            raise ValueError("decode_output_len must be at least 2 (decode is timed between the first token and the last)")
        if self.lognormal_sigma < 0 or self.long_delay_s < 0:
            raise ValueError("lognormal_sigma and long_delay_s must not be negative")
        if self.lognormal_input_max < self.lognormal_input_median or \
                self.lognormal_output_max < self.lognormal_output_median:
            raise ValueError("a lognormal cap is below its median")
        if self.long_input_len <= self.long_stream_input_len:
            raise ValueError("long_input_len must exceed long_stream_input_len")


@dataclass(frozen=True, slots=True)
class Request:
    """One request: prompt ids, ``max_tokens``, its send time after the run's start (s,
    served runs) and its part in the workload (``long``/``short`` in ``long_prompt``)."""

    prompt: list[int]
    max_tokens: int
    offset_s: float = 0.0
    role: str = ""


@dataclass(frozen=True, slots=True)
class Workload:
    """A workload's requests and how they are sent: ``concurrency`` streams at most (served)."""

    name: str
    requests: list[Request]
    concurrency: int
    decode_repeats: int = 0  # > 0: timed as batch-1 decode (decode_b1)

    @property
    def max_total_len(self) -> int:
        """Longest prompt + output of any request, tokens."""
        return max(len(r.prompt) + r.max_tokens for r in self.requests)


def build_workload(name: str, sizes: Sizes, seed: int) -> Workload:
    """The requests of workload ``name`` (one of ``WORKLOADS``); the same seed gives the same ones.

    Raises:
        KeyError: an unknown workload name.
    """
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r} (one of {', '.join(WORKLOADS)})")
    rng = np.random.default_rng(seed + WORKLOADS.index(name))
    s = sizes
    if name == "decode_b1":
        return Workload(name, [Request(random_ids(rng, s.decode_input_len), s.decode_output_len)], 1,
                        decode_repeats=s.decode_repeats)
    if name == "short":
        requests = [Request(random_ids(rng, s.short_input_len), s.short_output_len) for _ in range(s.short_requests)]
        return Workload(name, requests, len(requests))
    if name == "lognormal":
        n = s.lognormal_requests
        ins = lognormal_lengths(rng, s.lognormal_input_median, s.lognormal_sigma, n, s.lognormal_input_max)
        outs = lognormal_lengths(rng, s.lognormal_output_median, s.lognormal_sigma, n, s.lognormal_output_max)
        return Workload(name, [Request(random_ids(rng, i), o) for i, o in zip(ins, outs, strict=True)],
                        min(s.lognormal_concurrency, n))
    if name == "shared_prefix":
        shape = PlacementSizes(groups=s.prefix_groups, prompts_per_group=s.prefix_prompts_per_group,
                               system_prompt_len=s.prefix_len, question_len=s.prefix_question_len)
        requests = [Request(p, s.prefix_output_len) for _, p in shared_prefix_prompts(shape, rng)]
        return Workload(name, requests, len(requests))
    assert name == "long_prompt", name
    shorts = [Request(random_ids(rng, s.long_stream_input_len), s.long_stream_output_len, 0.0, SHORT)
              for _ in range(s.long_streams)]
    longs = [Request(random_ids(rng, s.long_input_len), s.long_output_len, s.long_delay_s, LONG)
             for _ in range(s.long_requests)]
    return Workload(name, shorts + longs, s.long_streams + s.long_requests)


def engine_settings(workload: Workload, max_num_seqs: int, max_model_len: int) -> dict[str, Any]:
    """The engine settings a workload runs under: ``max_num_seqs``; ``max_model_len``, raised
    to the next multiple of ``MAX_MODEL_LEN_STEP`` when a request needs more; prefix
    caching only for ``shared_prefix``."""
    need = workload.max_total_len
    if need > max_model_len:
        max_model_len = math.ceil(need / MAX_MODEL_LEN_STEP) * MAX_MODEL_LEN_STEP
    return {"max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
            "enable_prefix_caching": workload.name == "shared_prefix"}


# -- figures from the client's records ----------------------------------------------------------
def chunk_times(out: RequestOutput) -> list[float]:
    """perf_counter times at which a request's content chunks arrived (empty if it failed)."""
    if not out.success:
        return []
    t = out.start_s + out.ttft_s
    times = [t]
    for gap in out.itls_s:
        t += gap
        times.append(t)
    return times


def token_events(outputs: Sequence[RequestOutput]) -> list[tuple[float, float]]:
    """(perf_counter time, output tokens) per content chunk; a request's tokens are spread
    evenly over its chunks, so the events add up to its token count."""
    events = []
    for out in outputs:
        times = chunk_times(out)
        if times:
            weight = out.output_tokens / len(times)
            events += [(t, weight) for t in times]
    return events


def throughput_bins(events: Sequence[tuple[float, float]], origin_s: float, end_s: float,
                    bin_s: float = 1.0) -> list[float]:
    """Output tok/s in consecutive bins of ``bin_s`` seconds from ``origin_s`` to ``end_s``
    (the last bin may be shorter: it is divided by its own length). Events outside the
    span are left out.

    Raises:
        ValueError: ``bin_s`` not positive.
    """
    if bin_s <= 0:
        raise ValueError(f"bin_s must be positive, got {bin_s}")
    span_s = end_s - origin_s
    if span_s <= 0:
        return []
    num_bins = math.ceil(span_s / bin_s)
    edges = origin_s + bin_s * np.arange(num_bins + 1)
    edges[-1] = end_s
    times = np.asarray([t for t, _ in events], dtype=np.float64)
    weights = np.asarray([w for _, w in events], dtype=np.float64)
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    return (counts / np.diff(edges)).tolist()


def client_span(outputs: Sequence[RequestOutput]) -> tuple[float, float] | None:
    """(first send, last content chunk) of a run, perf_counter seconds; None if no request
    got an answer."""
    ends = [times[-1] for out in outputs if (times := chunk_times(out))]
    return (min(out.start_s for out in outputs), max(ends)) if ends else None


def latency_ms(values_s: Sequence[float]) -> dict[str, float] | None:
    """``{"mean", "median", "p99"}`` in ms of samples in seconds; None for none."""
    if not values_s:
        return None
    s = summarize_ms(list(values_s), (99.0,))
    return {"mean": s.mean_ms, "median": s.median_ms, "p99": s.percentiles_ms[99.0]}


def long_prompt_figures(requests: Sequence[Request], outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """What ``long_prompt`` is about, from the records (in the requests' order): the long
    prompts' TTFT; the short streams' ITL while the long ones prefill (the gaps that end
    between the first long send and the last long first token) and before it; how many
    short streams were still running when the first long prompt was sent. Times in the
    window are seconds after the first request was sent."""
    pairs = list(zip(requests, outputs, strict=True))
    longs = [o for r, o in pairs if r.role == LONG and o.success]
    shorts = [o for r, o in pairs if r.role == SHORT and o.success]
    if not longs:
        return {"long_completed": 0}
    origin_s = min(o.start_s for _, o in pairs)
    begin_s = min(o.start_s for o in longs)
    end_s = max(o.start_s + o.ttft_s for o in longs)
    during, before = [], []
    for out in shorts:
        times = chunk_times(out)
        for gap, t in zip(out.itls_s, times[1:], strict=True):
            if begin_s <= t <= end_s:
                during.append(gap)
            elif t < begin_s:
                before.append(gap)
    return {"long_completed": len(longs), "long_ttft_ms": latency_ms([o.ttft_s for o in longs]),
            "short_itl_during_prefill_ms": latency_ms(during), "short_itl_before_ms": latency_ms(before),
            "num_itls_during_prefill": len(during), "prefill_window_s": [begin_s - origin_s, end_s - origin_s],
            "short_running_at_long_send": sum(1 for o in shorts if o.start_s + o.latency_s > begin_s)}


def served_figures(result: BenchResult, workload: Workload) -> dict[str, Any]:
    """One served run's figures from the client's result (records in the requests' order):
    counts, tokens asked for and received, output tok/s over the run, TTFT / ITL / TPOT
    (ms: mean, median, p99), the first distinct errors, and for ``long_prompt`` its own
    figures (``long_prompt_figures``)."""
    m = result.metrics
    pairs = list(zip(workload.requests, result.outputs, strict=True))

    def lat(name: str) -> dict[str, float]:
        s = m.latency[name]
        return {"mean": s.mean_ms, "median": s.median_ms, "p99": s.percentiles_ms[99.0]}

    figures = {"completed": m.completed, "failed": m.failed, "num_requests": len(pairs),
               "expected_output_tokens": sum(r.max_tokens for r, _ in pairs),
               "total_output_tokens": m.total_output_tokens,
               "num_incomplete": sum(o.output_tokens < r.max_tokens for r, o in pairs),
               "duration_s": m.duration_s, "output_tok_s": m.output_throughput,
               "ttft_ms": lat("ttft"), "itl_ms": lat("itl"), "tpot_ms": lat("tpot"),
               "errors": sorted({o.error for _, o in pairs if o.error})[:3]}
    if workload.name == "long_prompt":
        figures["long_prompt"] = long_prompt_figures(workload.requests, result.outputs)
    return figures
