"""Fault injection for tests. Off by default: nothing here runs unless a worker is started
with ``--fault-hang-after-steps N`` (``WorkerSettings.fault_hang_after_steps``); never set
it in a deployment.

``hang_after_steps`` makes the engine's step N+1 block its thread forever, as a
deadlocked kernel or lock would: the worker's event loop, heartbeat and control listener
keep running while the engine makes no progress. tests/test_liveness.py uses it to check
that such a worker is taken for dead and its requests fail over (docs/operations.md,
"Liveness and readiness").
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def hang_after_steps(step: Callable[[], T], num_steps: int) -> Callable[[], T]:
    """``step`` for its first ``num_steps`` calls; every later call blocks forever.

    Raises:
        ValueError: ``num_steps`` < 1.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    calls = itertools.count(1)

    def faulty_step() -> T:
        n = next(calls)
        if n > num_steps:
            log.warning("FAULT INJECTION: engine step %d hangs forever (--fault-hang-after-steps %d)", n, num_steps)
            threading.Event().wait()
        return step()

    return faulty_step
