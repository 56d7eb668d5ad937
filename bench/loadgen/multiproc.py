"""One benchmark run sent by several client processes, so that the load client's own
event loop is not what limits a fast server (at 5,000+ output tok/s one Python process
spends most of a core parsing SSE chunks and its loop delays the chunks it reads).

Every child builds the whole request list from the same ``BenchConfig`` (same seed, same
prompts; or is handed its part of a list the caller built), takes every
``num_processes``-th request and a share of ``max_concurrency``, waits at a barrier until
all are ready, sends, and returns its records, its start/end times and its CPU seconds.
The parent merges the records, in the requests' order, into one ``BenchResult`` whose
duration runs from the earliest start to the latest end (``time.perf_counter`` is the
system-wide monotonic clock on Linux, so the children's times compare).
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import queue
import time
from collections.abc import Sequence
from typing import Any

from bench.loadgen.client import RequestOutput
from bench.loadgen.config import BenchConfig
from bench.loadgen.dataset import SampleRequest
from bench.loadgen.report import BenchResult
from bench.loadgen.runner import build_requests, drive, make_result

#: Longest wait for the children to build their prompts and reach the barrier, s.
READY_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True, slots=True)
class ChildRun:
    """What one client process measured."""

    model: str
    outputs: list[RequestOutput]
    start_s: float
    end_s: float
    cpu_s: float


def concurrency_shares(max_concurrency: int | None, num_processes: int) -> list[int | None]:
    """``max_concurrency`` split as evenly as possible over the processes (None: no cap).

    Raises:
        ValueError: fewer streams than processes.
    """
    if max_concurrency is None:
        return [None] * num_processes
    if max_concurrency < num_processes:
        raise ValueError(f"concurrency {max_concurrency} is less than {num_processes} client processes")
    base, extra = divmod(max_concurrency, num_processes)
    return [base + (i < extra) for i in range(num_processes)]


def _child(cfg: BenchConfig, index: int, num_processes: int, concurrency: int | None,
           barrier: Any, results: Any, requests: list[SampleRequest] | None = None,
           offsets_s: list[float] | None = None) -> None:
    cpu0_s = time.process_time()
    if requests is None:
        requests = build_requests(cfg)[index::num_processes]
    barrier.wait(READY_TIMEOUT_S)
    model, outputs, start_s, end_s = asyncio.run(
        drive(dataclasses.replace(cfg, max_concurrency=concurrency, show_progress=False), requests,
              offsets_s=offsets_s))
    results.put((index, ChildRun(model, outputs, start_s, end_s, time.process_time() - cpu0_s)))


def run_split(cfg: BenchConfig, num_processes: int, requests: Sequence[SampleRequest] | None = None,
              offsets_s: Sequence[float] | None = None) -> tuple[BenchResult, float]:
    """Run ``cfg`` from ``num_processes`` client processes; returns the merged result and
    the clients' CPU seconds in all. ``requests`` (default: ``cfg``'s random prompts) and
    their send times ``offsets_s`` (``drive``'s; default: ``cfg``'s arrival schedule) are
    dealt out the same way, every ``num_processes``-th to one child.

    Raises:
        ValueError: fewer concurrent streams than processes, ``cfg.model`` unset (each
            child would ask the server; name it), or ``offsets_s`` without ``requests``.
        RuntimeError: a child failed or never reported.
    """
    if cfg.model is None:
        raise ValueError("run_split needs cfg.model")
    if offsets_s is not None and requests is None:
        raise ValueError("run_split takes offsets_s only with the requests they time")
    shares = concurrency_shares(cfg.max_concurrency, num_processes)

    def deal(items: Sequence[Any] | None, i: int) -> list[Any] | None:
        return None if items is None else list(items[i::num_processes])

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(num_processes)
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(cfg, i, num_processes, shares[i], barrier, results,
                                              deal(requests, i), deal(offsets_s, i)), daemon=True)
             for i in range(num_processes)]
    for p in procs:
        p.start()
    runs: dict[int, ChildRun] = {}
    try:
        while len(runs) < num_processes:
            try:
                index, run = results.get(timeout=5.0)
            except queue.Empty:  # check that the children live
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise RuntimeError(f"client process exited with {dead[0].exitcode}") from None
                continue
            runs[index] = run
    finally:
        for p in procs:
            p.join(timeout=10.0)
            if p.is_alive():
                p.kill()
    ordered = [runs[i] for i in range(num_processes)]
    outputs: list[RequestOutput] = [RequestOutput() for _ in range(sum(len(r.outputs) for r in ordered))]
    for i, r in enumerate(ordered):  # back in the order of the requests: child i sent every i-th
        outputs[i::num_processes] = r.outputs
    duration_s = max(r.end_s for r in ordered) - min(r.start_s for r in ordered)
    return make_result(cfg, ordered[0].model, None, outputs, duration_s), sum(r.cpu_s for r in ordered)
