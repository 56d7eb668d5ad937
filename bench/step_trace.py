"""Where a worker's wall time went, from its step trace (``--step-trace`` of
``bench.product_bench``; the worker's ``WorkerSettings.step_trace``, worker/progress.py).

Within a window (a pass's ``monotonic_s`` from the product benchmark's JSON, or the whole
trace), every second of wall time falls in one of:
- ``in_step``: the engine thread ran a step (``ran`` .. ``done``);
- ``handoff``: a step was handed over but the engine thread had not started it, plus the
  time from its end until the event loop had the result (thread hand-offs, the GIL);
- ``pull``: the loop pulled and admitted requests between steps (``pull_s``);
- ``loop``: the rest of the time between steps (aborts, the publish of the step before,
  the next hand-over);
- ``before_first`` / ``after_last``: no step yet, or none any more, in the window.

Beside them: quantiles of the engine thread's time per step (``step_ms``) and of the time
from one step's end to the next one's (``end_to_end_ms``, what a stream's inter-token
latency is made of), and the busy fraction and outputs per step in ten slices.

    python -m bench.step_trace logs/steps-c1000.jsonl --result product.json --concurrency 1000
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any


def load(path: Path) -> list[dict[str, float]]:
    """The trace's steps in order of ``handed``."""
    return sorted((json.loads(line) for line in path.read_text().splitlines() if line.strip()),
                  key=lambda s: s["handed"])


def breakdown(steps: list[dict[str, float]], start_s: float, end_s: float, num_buckets: int = 10) -> dict[str, Any]:
    """Seconds of ``[start_s, end_s]`` per category (module docstring), the steps in the
    window, and the busy fraction (``in_step`` / wall) in ``num_buckets`` equal slices."""
    inside = [s for s in steps if s["handed"] >= start_s and s["back"] <= end_s]
    wall_s = end_s - start_s
    out: dict[str, Any] = {"wall_s": wall_s, "steps": len(inside)}
    if not inside:
        return out
    out["in_step"] = sum(s["done"] - s["ran"] for s in inside)
    out["handoff"] = sum((s["ran"] - s["handed"]) + (s["back"] - s["done"]) for s in inside)
    gaps = [b["handed"] - a["back"] for a, b in itertools.pairwise(inside)]
    out["pull"] = sum(s["pull_s"] for s in inside[1:])
    out["loop"] = sum(gaps) - out["pull"]
    out["before_first"] = inside[0]["handed"] - start_s
    out["after_last"] = end_s - inside[-1]["back"]
    out["ms_per_step"] = out["in_step"] * 1000 / len(inside)
    out["gap_ms_per_step"] = sum(gaps) * 1000 / max(len(gaps), 1)
    # What a stream's inter-token latency is made of: the time from one step's end to
    # the next one's, as quantiles (ms), and the engine thread's time per step.
    ends_ms = [(b["done"] - a["done"]) * 1000 for a, b in itertools.pairwise(inside)]
    for name, values in (("step_ms", [(s["done"] - s["ran"]) * 1000 for s in inside]), ("end_to_end_ms", ends_ms)):
        if values:
            ordered = sorted(values)
            out[name] = {q: round(ordered[min(len(ordered) - 1, int(f * len(ordered)))], 1)
                         for q, f in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))}
    width = wall_s / num_buckets
    busy = [0.0] * num_buckets
    for s in inside:  # a step's time goes to the slices it overlaps
        for i in range(num_buckets):
            lo, hi = start_s + i * width, start_s + (i + 1) * width
            busy[i] += max(0.0, min(hi, s["done"]) - max(lo, s["ran"]))
    out["busy_by_slice"] = [round(b / width, 3) for b in busy]
    out["outputs_per_step_by_slice"] = [
        round(sum(s["outputs"] for s in sl) / len(sl), 1) if sl else 0
        for sl in ([s for s in inside if start_s + i * width <= s["handed"] < start_s + (i + 1) * width]
                   for i in range(num_buckets))]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--result", type=Path, help="bench.product_bench's JSON: one breakdown per pass")
    ap.add_argument("--concurrency", type=int, help="which serve start of --result the trace belongs to")
    args = ap.parse_args(argv)
    steps = load(args.trace)
    windows: list[tuple[str, float, float]] = []
    if args.result:
        for run in json.loads(args.result.read_text())["serve"]:
            if args.concurrency in (None, run["concurrency"]):
                windows += [(f"c{run['concurrency']} pass {p['pass']}", *p["monotonic_s"])
                            for p in run["passes"] if "monotonic_s" in p]
    if not windows and steps:
        windows = [("whole trace", steps[0]["handed"], steps[-1]["back"])]
    for name, lo, hi in windows:
        print(name, json.dumps(breakdown(steps, lo, hi)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
