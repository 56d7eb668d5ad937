"""Engine progress as the worker's heartbeat reports it: steps completed, when the last
one ended, and how long the step in flight has been running (docs/operations.md,
"Liveness and readiness"); and how long its requests' outputs run (``OutputLengths``:
placement's price of a wait for a decode slot).

The worker's event loop calls ``started`` and ``finished`` around every step it runs on
the engine thread. A hung step never calls ``finished``, but the event loop keeps
beating, and ``running_s`` grows in each heartbeat until ``WorkerStatus.engine_stalled``
holds and gateways and reapers take the worker for dead (``shared/liveness.py``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


class StepClock:
    """When engine steps start and end. Times from ``clock`` (default
    ``time.monotonic``), seconds; ``stall_timeout_s`` 0 turns the stall rule off."""

    def __init__(self, stall_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if stall_timeout_s < 0:
            raise ValueError(f"stall_timeout_s must be >= 0, got {stall_timeout_s}")
        self.stall_timeout_s = stall_timeout_s
        self._clock = clock
        self.num_steps = 0
        #: Time spent inside completed steps, s: with the wall time, how busy the engine
        #: thread was (``inferq:engine_busy_seconds``).
        self.busy_s = 0.0
        #: Wall-clock end of the last completed step (0: none yet), for operators.
        self.last_step_unix_s = 0.0
        self._started_s: float | None = None
        self._stall_reported = False

    def started(self) -> None:
        """A step was handed to the engine thread."""
        self._started_s = self._clock()

    def finished(self, completed: bool = True) -> None:
        """The step handed over last returned (``completed``) or raised. Warns when it
        took more than half the stall timeout, or when it ended after being reported
        stalled (its requests have been failed over meanwhile)."""
        took_s = self.running_s()
        self._started_s = None
        if completed:
            self.num_steps += 1
            self.busy_s += took_s
            self.last_step_unix_s = time.time()
        if self._stall_reported:
            log.warning("the engine step ended after %.1f s; the worker counted as dead meanwhile and gateways "
                        "moved its requests (messages of their old attempts are ignored)", took_s)
            self._stall_reported = False
        elif self.stall_timeout_s and took_s > self.stall_timeout_s / 2:
            log.warning("an engine step took %.1f s, over half of engine_stall_timeout_s (%.0f s): raise the timeout "
                        "(or lower max_num_batched_tokens) before a slow step is taken for a hang",
                        took_s, self.stall_timeout_s)

    def running_s(self) -> float:
        """How long the step in flight has been running, s (0 when none is)."""
        return 0.0 if self._started_s is None else self._clock() - self._started_s

    @property
    def stalled(self) -> bool:
        """The step in flight has run longer than the stall timeout (the rule of
        ``WorkerStatus.engine_stalled``, applied here only to log it)."""
        return 0.0 < self.stall_timeout_s < self.running_s()

    def report_stall(self, num_held: int) -> None:
        """Log once per stalled step that the worker now counts as dead (the heartbeat
        calls this on every beat)."""
        if self.stalled and not self._stall_reported:
            self._stall_reported = True
            log.error("engine step %d has run %.1f s, longer than engine_stall_timeout_s (%.0f s): the heartbeat "
                      "reports the engine stalled; gateways fail over the %d requests held here",
                      self.num_steps + 1, self.running_s(), self.stall_timeout_s, num_held)


#: Weight of the newest finished request in ``OutputLengths``' moving average: about
#: the last 16 requests count.
OUTPUT_LENGTH_WEIGHT = 1 / 16


class OutputLengths:
    """A moving average of the output tokens of the requests a worker finished (its
    decode steps per request, one token per step without speculation): ``mean`` is 0
    until one finished, then that one's length, then an exponential moving average of
    weight ``OUTPUT_LENGTH_WEIGHT``. Heartbeat field ``WorkerStatus.mean_num_output_tokens``."""

    def __init__(self) -> None:
        self.mean = 0.0
        self.num_finished = 0

    def add(self, num_output_tokens: int) -> None:
        """Count one finished request that generated ``num_output_tokens`` here."""
        self.num_finished += 1
        if self.num_finished == 1:
            self.mean = float(num_output_tokens)
        else:
            self.mean += OUTPUT_LENGTH_WEIGHT * (num_output_tokens - self.mean)


class StepTrace:
    """One JSON line per engine step, for benchmarks (``WorkerSettings.step_trace``).

    Fields, times in seconds on ``time.monotonic`` (comparable within one host):
    ``handed`` (the event loop handed the step to the engine thread), ``ran`` and
    ``done`` (the engine thread started and ended it), ``back`` (the loop had its result),
    ``outputs`` (requests with new tokens), ``pulled`` (requests added since the previous
    step), ``pull_s`` (time the loop spent pulling them), and ``running`` and ``waiting``
    (the engine's requests after the step). Lines are kept in memory
    and appended to the file by ``close`` (at worker exit); 100,000 steps hold about 15 MB.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lines: list[str] = []
        self._ran = self._done = 0.0
        self.pulled = 0
        self.pull_s = 0.0

    def wrap(self, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn`` with its start and end recorded on the thread that runs it."""
        def traced() -> T:
            self._ran = time.monotonic()
            try:
                return fn()
            finally:
                self._done = time.monotonic()
        return traced

    def record(self, handed: float, num_outputs: int, num_running: int = 0, num_waiting: int = 0) -> None:
        """Write the step that just came back to the loop (``handed``: when it was handed over)."""
        line = {"handed": handed, "ran": self._ran, "done": self._done, "back": time.monotonic(),
                "outputs": num_outputs, "pulled": self.pulled, "pull_s": self.pull_s,
                "running": num_running, "waiting": num_waiting}
        self.pulled, self.pull_s = 0, 0.0
        self._lines.append(json.dumps(line) + "\n")

    def close(self) -> None:
        """Append the recorded lines to the file."""
        with self.path.open("a", encoding="utf-8") as f:
            f.writelines(self._lines)
        self._lines.clear()
