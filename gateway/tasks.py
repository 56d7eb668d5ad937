"""Background tasks that are kept (so they are not garbage-collected mid-flight) and
whose errors are logged and counted, never silently lost."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class BackgroundTasks:
    """A set of fire-and-forget tasks with error reporting.

    ``num_failed`` counts tasks that ended with an exception (each is logged).
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.num_failed = 0

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Schedule ``coro`` on the running loop and keep it until it ends."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.num_failed += 1
            log.error("background task %s failed: %r", task.get_name(), exc, exc_info=exc)

    async def close(self, timeout_s: float = 2.0) -> None:
        """Wait up to ``timeout_s`` seconds for pending tasks, then cancel the rest."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
