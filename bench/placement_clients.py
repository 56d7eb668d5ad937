"""The placement benchmark's load client in several processes (``--client-processes``).

One Python process reading hundreds of SSE streams spends most of a core on the chunks
and reads them late: on 2 x H200 (2026-11-29, ``bench/results/placement/
placement_h200x2_s21.json``) the single client ran at 0.98-1.00 of a core through every
two-worker phase, and its median inter-token gap fell to 0.03 ms (chunks read in bunches)
against 7.3 ms at one worker, so the phases timed the client as much as the stack.

A ``ClientPool`` starts its processes once per point (spawned, each with its own event
loop and ``httpx.AsyncClient``, connections kept between phases). For each phase every
process takes every ``P``-th request (request ``i`` still goes to gateway ``i mod G``, as
with one process) and a share of the concurrency cap (``P`` = the processes, or the cap
where it is lower), waits at a barrier until all have their part, sends it, and reports
its completions with its start and end on the system-wide monotonic clock (``time.perf_counter`` on Linux), so the phase's wall time is
the latest end minus the earliest start. ``bench/loadgen/multiproc.py`` does the same for
one run of the load generator; a pool is kept here because a multi-turn point has a
phase per round.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import time
from collections.abc import Sequence
from typing import Any

import httpx

from bench.loadgen.multiproc import concurrency_shares
from bench.placement_workloads import Completion, Sent, send_timed

#: How often, s, a phase waiting for its parts checks that every client process lives
#: (the stack's request timeout bounds each request; this catches a process that died
#: without a word).
RESULT_POLL_S = 5.0


def _client_main(index: int, jobs: Any, results: Any, barrier: Any, max_connections: int,
                 timeout_s: float) -> None:
    """One client process: phases from ``jobs`` until ``None``; each part's completions and
    times to ``results`` as ``(index, completions, start_s, end_s)``."""

    async def serve() -> None:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s), trust_env=False) as client:
            while (job := jobs.get()) is not None:  # nothing in flight between phases: blocking is fine
                urls, model, requests, indices, concurrency = job
                barrier.wait()
                done, start_s, end_s = await send_timed(client, urls, model, requests, concurrency, indices)
                results.put((index, done, start_s, end_s))

    asyncio.run(serve())


class ClientPool:
    """``num_processes`` client processes for one point (module docstring); ``close`` ends them.

    Raises (constructor): ValueError: ``num_processes`` < 1.
    """

    def __init__(self, num_processes: int, max_connections: int, timeout_s: float) -> None:
        if num_processes < 1:
            raise ValueError(f"num_processes must be at least 1, got {num_processes}")
        ctx = multiprocessing.get_context("spawn")
        self._jobs = [ctx.Queue() for _ in range(num_processes)]
        self._results = ctx.Queue()
        # Kept on self: a spawned child unpickles it after start() returns, and a collected
        # semaphore is gone by then.
        self._barrier = ctx.Barrier(num_processes)
        self._procs = [ctx.Process(target=_client_main, daemon=True,
                                   args=(i, self._jobs[i], self._results, self._barrier, max_connections,
                                         timeout_s))
                       for i in range(num_processes)]
        for p in self._procs:
            p.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    async def send_all(self, urls: Sequence[str], model: str, requests: Sequence[Sent],
                       concurrency: int = 0) -> tuple[list[Completion], float]:
        """``placement_workloads.send_all`` over the pool: the completions in the requests'
        order and the phase's wall time, s.

        A cap below the number of processes leaves the processes past it idle.

        Raises:
            RuntimeError: a client process died.
        """
        n = len(self._procs)
        k = min(n, concurrency) if concurrency else n  # processes with requests: at least one stream each
        shares = concurrency_shares(concurrency or None, k) + [None] * (n - k)
        for i in range(n):
            part = list(requests[i::k]) if i < k else []
            self._jobs[i].put((list(urls), model, part, list(range(i, len(requests), k)) if i < k else [],
                               shares[i] or 0))
        parts: dict[int, tuple[list[Completion], float, float]] = {}
        while len(parts) < n:
            try:
                index, done, start_s, end_s = await asyncio.to_thread(self._results.get, True, RESULT_POLL_S)
            except queue.Empty:
                dead = [p for p in self._procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"client process {dead[0].pid} exited with {dead[0].exitcode}") from None
                continue
            parts[index] = (done, start_s, end_s)
        completions: list[Completion | None] = [None] * len(requests)
        for i, (done, _, _) in parts.items():
            if i < k:
                completions[i::k] = done
        busy = [(s, e) for done, s, e in parts.values() if done]
        wall_s = max(e for _, e in busy) - min(s for s, _ in busy) if busy else 0.0
        assert all(c is not None for c in completions)
        return completions, wall_s  # type: ignore[return-value]

    def close(self) -> None:
        """End every process: asked first, killed after 10 s."""
        for jobs in self._jobs:
            jobs.put(None)
        deadline = time.monotonic() + 10.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
