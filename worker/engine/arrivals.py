"""What the engine knows of requests queued in Redis but not pulled yet: the
announcements of the model's arrivals channel (docs/protocol.md), which the worker hands
over while a step runs (``LLMEngine.note_arrival``), and whether one of them would take
the place of work that the step in progress carries.

Two kinds of newcomer would: one of a class above the step's lowest class (the
scheduler's priority floor pauses that class for its prefill), and, in a full engine, one
of a tenant that may claim a sequence slot from another tenant of its class (fair share of
slots, ``fair_share.py``). For either, the engine stops an eager step between layers or
withholds a chained async decode step, so the worker pulls the newcomer one step sooner.

It also spaces the stops (``may_stop``, ``step_ended``): at most one every
``MIN_STEPS_BETWEEN_STOPS`` + 1 steps, for the engine and the sim backend alike.

Written by the worker's event loop (``note``), read on the engine thread (``above``,
``preempts``): one set, rebound to clear it and copied before it is read, each step
atomic under the GIL. A note that lands just after the worker's pull is stale by one step
at worst: it can cost one stopped or unchained step, never a lost request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.engine.scheduler import Scheduler

#: Completed steps between two steps stopped for an arrival, so that a stream of
#: arrivals slows the running work down but never stops it (``LLMEngine._stop_for_arrival``,
#: the sim backend's step).
MIN_STEPS_BETWEEN_STOPS = 4


class Arrivals:
    """The announcements since the worker last pulled, and the steps since the last stop."""

    def __init__(self) -> None:
        #: ``(class rank, tenant)`` of every announcement.
        self.tenants: set[tuple[int, str]] = set()
        self.steps_since_stop = MIN_STEPS_BETWEEN_STOPS

    def note(self, priority: int | None, tenant: str = "") -> None:
        """A request of class rank ``priority`` from ``tenant`` was queued; ``None``: the
        worker is about to pull, and what was announced so far, the pull sees."""
        if priority is None:
            self.tenants = set()
        else:
            self.tenants.add((priority, tenant))

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
