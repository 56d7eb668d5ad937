"""The gateway's view of its model's Redis streams, as gauges refreshed about once a
second by a background task on the gateway's async Redis client (so nothing blocks the
event loop and a scrape never waits on Redis). The facts come from
``shared.queues.snapshot`` (their one home, as for ``inferq queues`` and ``/stats``),
summed over the model's (class, tenant) streams:

- ``queue_depth``: entries not yet delivered to any worker, XLEN minus pending (workers
  XDEL what they finish, so the stream holds only queued and running requests;
  ``shared.streams.read_depth``, as admission uses);
- ``num_pending_entries``: delivered and not yet acknowledged (XPENDING summary), i.e.
  requests running on some worker;
- ``num_redelivered_entries``: pending entries whose delivery count is above 1, i.e.
  reclaimed by a worker from a dead one (XPENDING extended form, at most
  ``MAX_SCANNED_PENDING`` entries looked at per stream and refresh; the gauge then
  undercounts);
- per priority class and per tenant: waiting requests and the oldest one's wait
  (``GatewayMetrics.set_classes``, tenant series capped).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
import redis.exceptions

from gateway.metrics import GatewayMetrics
from shared.fair_queue import PRIORITY_CLASSES
from shared.keys import Keys
from shared.queues import QueueSnapshot, snapshot

if TYPE_CHECKING:
    from gateway.state import GatewayState

log = logging.getLogger(__name__)

#: How often the queue gauges are refreshed, seconds.
QUEUE_METRICS_INTERVAL_S = 1.0


async def read_queue(client: aioredis.Redis, keys: Keys, model: str) -> QueueSnapshot:
    """The snapshot of ``model``'s streams (no workers' view needed, but read alike).

    Raises:
        redis.exceptions.RedisError, OSError: Redis unreachable.
    """
    return await snapshot(client, keys, [model])


def queue_totals(snap: QueueSnapshot) -> tuple[int, int, int]:
    """``(queue_depth, num_pending_entries, num_redelivered_entries)`` summed over the
    snapshot's streams (a missing stream or group counts as empty)."""
    streams = snap.streams
    return (sum(s.num_waiting for s in streams), sum(s.num_pending for s in streams),
            sum(s.num_redelivered for s in streams))


def apply(metrics: GatewayMetrics, snap: QueueSnapshot) -> None:
    """Set every queue gauge from ``snap`` (one model's streams)."""
    streams = snap.streams
    metrics.set_queue(*queue_totals(snap))
    by_class = {c: (0, 0.0) for c in PRIORITY_CLASSES}
    by_class.update({c.priority_class: (c.num_waiting, c.oldest_waiting_age_s or 0.0) for c in snap.classes})
    by_tenant = {(s.priority_class, s.tenant): (s.num_waiting, s.oldest_waiting_age_s or 0.0)
                 for s in streams if s.num_waiting}
    metrics.set_classes(by_class, by_tenant)


async def queue_metrics_loop(state: GatewayState) -> None:
    """Refresh the queue gauges forever (first at once). A Redis error is counted in
    ``inferq:queue_metrics_errors_total`` and the gauges keep their last values."""
    metrics = state.metrics
    while True:
        try:
            snap = await read_queue(state.redis, state.keys, state.served_model_name)
        except (redis.exceptions.RedisError, OSError) as exc:
            metrics.queue_metrics_errors.labels(metrics.model_name).inc()
            log.debug("queue metrics refresh failed: %s", exc)
        else:
            apply(metrics, snap)
        await asyncio.sleep(QUEUE_METRICS_INTERVAL_S)
