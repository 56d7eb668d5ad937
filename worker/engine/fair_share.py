"""Fair share of an engine's sequence slots between the tenants of a priority class
(docs/operations.md, "Priority classes and fair share").

The queue in Redis shares pulls between tenants by virtual token counters
(``shared/fair_queue.py``), but a worker pulls only when a slot is free: a tenant whose
flood took every slot would make another tenant's request wait for one of those to
finish. So, within a class, slots are shared max-min: a waiting request whose tenant runs
at least ``MIN_SLOT_GAP_TO_PREEMPT`` fewer requests of the class than the tenant that runs
the most may preempt (recompute) that tenant's most recently admitted request of the
class, as vLLM's priority policy preempts across classes. After the swap the larger
tenant still runs at least as many as the smaller, so swaps never go back and forth, and
the scheduler makes at most one such preemption per step (``Scheduler.schedule``). With
one tenant (or requests that name none: tenant ``""``) nothing changes.

Pure functions of the scheduler's queues: no torch, no redis.
"""

from __future__ import annotations

from collections.abc import Iterable

from worker.engine.request import Request

#: Slots of a class that the largest tenant must run beyond the waiting request's tenant
#: for that request to preempt one of them (``claim_victim``).
MIN_SLOT_GAP_TO_PREEMPT = 2


def tenant_counts(running: Iterable[Request], priority: int) -> dict[str, int]:
    """Running requests of class ``priority``, per tenant."""
    counts: dict[str, int] = {}
    for r in running:
        if r.priority == priority:
            counts[r.tenant] = counts.get(r.tenant, 0) + 1
    return counts


def claim_victim(running: list[Request], request: Request) -> Request | None:
    """The running request that the waiting ``request`` may preempt for a slot: the most
    recently admitted request of its class from the tenant that runs the most of the class
    (``running`` is in admission order within a class), when that tenant runs at least
    ``MIN_SLOT_GAP_TO_PREEMPT`` more than ``request``'s tenant; ``None`` otherwise."""
    counts = tenant_counts(running, request.priority)
    top = max(counts, key=counts.__getitem__, default=None)
    if top is None or counts[top] - counts.get(request.tenant, 0) < MIN_SLOT_GAP_TO_PREEMPT:
        return None
    return next(r for r in reversed(running) if r.priority == request.priority and r.tenant == top)


def blocked_tenants(running: list[Request], waiting: Iterable[Request], priority: int) -> set[str] | None:
    """The tenants whose next request of class ``priority`` would find no slot to claim in
    a full engine: ``None`` when every tenant's would find none (no tenant runs
    ``MIN_SLOT_GAP_TO_PREEMPT`` requests of the class), else those running at least the
    largest count less ``MIN_SLOT_GAP_TO_PREEMPT - 1``, and those with a request of the
    class already waiting (it claims first). Any other tenant's request would preempt one."""
    counts = tenant_counts(running, priority)
    top = max(counts.values(), default=0)
    if top < MIN_SLOT_GAP_TO_PREEMPT:
        return None
    blocked = {t for t, n in counts.items() if n > top - MIN_SLOT_GAP_TO_PREEMPT}
    blocked.update(r.tenant for r in waiting if r.priority == priority)
    return blocked
