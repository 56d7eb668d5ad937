"""The gateway's view of its model's Redis stream, as gauges refreshed about once a
second by a background task on the gateway's async Redis client (so nothing blocks the
event loop and a scrape never waits on Redis).

- ``queue_depth``: entries not yet delivered to any worker, XLEN minus pending (workers
  XDEL what they finish, so the stream holds only queued and running requests;
  ``shared.streams.read_depth``, as admission uses);
- ``num_pending_entries``: delivered and not yet acknowledged (XPENDING summary), i.e.
  requests running on some worker;
- ``num_redelivered_entries``: pending entries whose delivery count is above 1, i.e.
  reclaimed by a worker from a dead one (XPENDING extended form, at most
  ``MAX_SCANNED_PENDING`` entries looked at per refresh; the gauge then undercounts).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
import redis.exceptions

from shared.streams import MAX_SCANNED_PENDING, pending_entries, read_depth

if TYPE_CHECKING:
    from gateway.state import GatewayState

log = logging.getLogger(__name__)

#: How often the queue gauges are refreshed, seconds.
QUEUE_METRICS_INTERVAL_S = 1.0


async def read_queue(client: aioredis.Redis, stream: str) -> tuple[int, int, int]:
    """``(queue_depth, num_pending_entries, num_redelivered_entries)`` of ``stream``. A
    missing stream or consumer group counts as empty.

    Raises:
        redis.exceptions.RedisError, OSError: Redis unreachable.
    """
    depth = await read_depth(client, stream)
    redelivered = 0
    if depth.num_pending:
        entries = await pending_entries(client, stream, min(depth.num_pending, MAX_SCANNED_PENDING))
        redelivered = sum(e.redelivered for e in entries)
    return depth.num_waiting, depth.num_pending, redelivered


async def queue_metrics_loop(state: GatewayState) -> None:
    """Refresh the queue gauges forever (first at once). A Redis error is counted in
    ``inferq:queue_metrics_errors_total`` and the gauges keep their last values."""
    metrics = state.metrics
    while True:
        try:
            depth, pending, redelivered = await read_queue(state.redis, state.stream)
        except (redis.exceptions.RedisError, OSError) as exc:
            metrics.queue_metrics_errors.labels(metrics.model_name).inc()
            log.debug("queue metrics refresh failed: %s", exc)
        else:
            metrics.set_queue(depth, pending, redelivered)
        await asyncio.sleep(QUEUE_METRICS_INTERVAL_S)
