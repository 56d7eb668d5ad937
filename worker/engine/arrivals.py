"""What the engine knows of requests queued in Redis but not pulled yet: the
announcements of the model's arrivals channel (docs/protocol.md), which the worker hands
over while a step runs (``LLMEngine.note_arrival``), and whether one of them would take
the place of work that the step in progress carries.

Two kinds of newcomer would: one of a class above the step's lowest class (the
scheduler's priority floor pauses that class for its prefill), and, in a full engine, one
of a tenant that may claim a sequence slot from another tenant of its class (fair share of
slots, ``fair_share.py``). For either, the engine stops an eager step between layers, a
replayed one between its pieces (``StepStop``), or withholds a chained async decode step,
so the worker pulls the newcomer sooner.

It also spaces the stops (``may_stop``, ``step_ended``): at most one every
``MIN_STEPS_BETWEEN_STOPS`` + 1 steps, for the engine and the sim backend alike.

Written by the worker's event loop (``note``), read on the engine thread (``above``,
``preempts``, ``StepStop``): one set, rebound to clear it and copied before it is read, each step
atomic under the GIL. A note that lands just after the worker's pull is stale by one step
at worst: it can cost one stopped or unchained step, never a lost request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.engine.scheduler import Scheduler

#: Completed steps between two steps stopped for an arrival, so that a stream of
#: arrivals slows the running work down but never stops it (``StepStop``, the sim
#: backend's step).
MIN_STEPS_BETWEEN_STOPS = 4
#: How long an announcement keeps the engine looking between the pieces of its replayed
#: steps (``Arrivals.worth_looking``), s. Each look costs the GPU the host's wake-up and
#: one graph launch; a worker that sees no such traffic runs its pieces back to back.
LOOK_WINDOW_S = 30.0
#: Tenants remembered for ``worth_looking`` (the most recent ones).
_TENANTS_SEEN = 64


class Arrivals:
    """The announcements since the worker last pulled, and the steps since the last stop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        #: ``(class rank, tenant)`` of every announcement.
        self.tenants: set[tuple[int, str]] = set()
        self.steps_since_stop = MIN_STEPS_BETWEEN_STOPS
        self._clock = clock
        # When each class rank, and each recent tenant, was last announced (seconds of
        # ``clock``); kept across pulls, for ``worth_looking``.
        self._class_seen: dict[int, float] = {}
        self._tenant_seen: dict[str, float] = {}

    def note(self, priority: int | None, tenant: str = "") -> None:
        """A request of class rank ``priority`` from ``tenant`` was queued; ``None``: the
        worker is about to pull, and what was announced so far, the pull sees."""
        if priority is None:
            self.tenants = set()
            return
        self.tenants.add((priority, tenant))
        now_s = self._clock()
        self._class_seen[priority] = now_s
        self._tenant_seen.pop(tenant, None)  # re-inserted last: the dict stays oldest first
        self._tenant_seen[tenant] = now_s
        if len(self._tenant_seen) > _TENANTS_SEEN:
            del self._tenant_seen[next(iter(self._tenant_seen))]

    def worth_looking(self, lowest_class: int, engine_full: bool) -> bool:
        """True when, in the last ``LOOK_WINDOW_S``, a request was announced that could
        have preempted a step whose lowest class is ``lowest_class``: one of a class above
        it, or, in a full engine (``engine_full``), one of a second tenant (which may claim
        a slot). A worker serving one tenant in one class never waits between pieces."""
        now_s = self._clock()
        if any(rank < lowest_class and now_s - seen_s < LOOK_WINDOW_S
               for rank, seen_s in tuple(self._class_seen.items())):
            return True
        return engine_full and sum(now_s - seen_s < LOOK_WINDOW_S for seen_s in tuple(self._tenant_seen.values())) >= 2

    def above(self, lowest_class: int) -> bool:
        """True when a request of a class above ``lowest_class`` was announced."""
        return any(priority < lowest_class for priority, _ in tuple(self.tenants))

    @property
    def may_stop(self) -> bool:
        """True when ``MIN_STEPS_BETWEEN_STOPS`` steps completed since the last stop."""
        return self.steps_since_stop >= MIN_STEPS_BETWEEN_STOPS

    def step_ended(self, stopped: bool) -> None:
        """Count a step that completed, or restart the count after a stopped one."""
        self.steps_since_stop = 0 if stopped else self.steps_since_stop + 1

    def preempts(self, scheduler: Scheduler, lowest_class: int) -> bool:
        """True when a newcomer would take the place of work in a step whose lowest class
        is ``lowest_class``: its class is above that one, or the engine is full and its
        tenant may claim a slot of its class (``Scheduler.fair_share_blocked``: neither
        blocked nor ``None``, every tenant blocked)."""
        if self.above(lowest_class):
            return True
        if len(scheduler.running) < scheduler.max_num_seqs:
            return False
        blocked_by_class: dict[int, set[str] | None] = {}
        for priority, tenant in tuple(self.tenants):
            if priority not in blocked_by_class:
                blocked_by_class[priority] = scheduler.fair_share_blocked(priority)
            blocked = blocked_by_class[priority]
            if blocked is not None and tenant not in blocked:
                return True
        return False


class StepStop:
    """The engine's look at the step in progress (``ModelRunner.step_stop``): between the
    layers of an eager step and between the pieces of a replayed one
    (``cuda_graphs.LayerPieces``), True when a request announced while it ran would take
    the place of work it carries (``Arrivals.preempts``, for the step's ``lowest_class``:
    its largest class rank, set by the engine before each step) and enough steps completed
    since the last stop (``Arrivals.may_stop``), so that a stream of arrivals slows the
    others down but never stops them. ``armed`` is False when no stop may come now, or
    none is likely (``Arrivals.worth_looking``): a replay then goes on without waiting at
    the boundary.

    On CPU a step of 16 sequences takes ~80 ms on 2 cores, longer than a short prompt's
    prefill (docs/benchmarks.md); on the GPU a step of 256 is ~12-25 ms: the newcomer
    then waits for a layer, or for a piece, not for the rest of the step."""

    def __init__(self, arrivals: Arrivals, scheduler: Scheduler) -> None:
        self.arrivals, self.scheduler = arrivals, scheduler
        self.lowest_class = 0

    @property
    def armed(self) -> bool:
        scheduler = self.scheduler
        return self.arrivals.may_stop and self.arrivals.worth_looking(
            self.lowest_class, len(scheduler.running) >= scheduler.max_num_seqs)

    def __call__(self) -> bool:
        return self.arrivals.may_stop and self.arrivals.preempts(self.scheduler, self.lowest_class)
