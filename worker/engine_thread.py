"""One long-lived thread for every call into the engine.

PyTorch's CPU kernels run on OpenMP (libgomp), which keeps one thread team per thread
that opens a parallel region. Steps run off the event loop; had they gone to asyncio's
default executor, the engine would run on whichever pool thread is free, and the pool
also serves asyncio's own blocking calls (``getaddrinfo`` of a Redis reconnect): two
pool threads then each own a team, the idle team's threads spin at their barrier, and
on a CPU with as many cores as one team a decode step took twice as long (SmolLM2
float32, 2 cores, batch 1: 110 -> 210 ms). Building the backend and stepping it on this
single thread keeps one team. On CUDA it costs nothing.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class EngineThread:
    """Runs functions on one dedicated thread, awaited from the event loop."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferq-engine")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the engine thread; its exception is raised here."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """``fn()`` on the engine thread, after the call in progress; its future, not
        awaited (for the worker's teardown, which runs as the event loop stops).

        Raises:
            RuntimeError: after ``close``.
        """
        return self._executor.submit(fn)

    def close(self) -> None:
        """Let the thread exit once its current call returns."""
        self._executor.shutdown(wait=False)
