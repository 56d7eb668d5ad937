"""The gateway's view of its model's Redis stream, as gauges refreshed about once a
second by a background task on the gateway's async Redis client (so nothing blocks the
event loop and a scrape never waits on Redis).

- ``queue_depth``: entries not yet delivered to any worker, XLEN minus pending (workers
  XDEL what they finish, so the stream holds only queued and running requests; the same
  formula as admission's ``queue_depth``);
- ``num_pending_entries``: delivered and not yet acknowledged (XPENDING summary), i.e.
  requests running on some worker;
- ``num_redelivered_entries``: pending entries whose delivery count is above 1, i.e.
  reclaimed by a worker from a dead one (XPENDING extended form, at most
  ``MAX_SCANNED_PENDING`` entries looked at per refresh).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
import redis.exceptions

from shared.keys import CONSUMER_GROUP

if TYPE_CHECKING:
    from gateway.state import GatewayState

log = logging.getLogger(__name__)

#: How often the queue gauges are refreshed, seconds.
QUEUE_METRICS_INTERVAL_S = 1.0
#: Most pending entries whose delivery count is read per refresh (bounds the cost of one
#: refresh when thousands are pending; the gauge then undercounts).
MAX_SCANNED_PENDING = 1000


async def read_queue(client: aioredis.Redis, stream: str) -> tuple[int, int, int]:
    """``(queue_depth, num_pending_entries, num_redelivered_entries)`` of ``stream``. A
    missing stream or consumer group counts as empty.

    Raises:
        redis.exceptions.RedisError, OSError: Redis unreachable.
    """
    async with client.pipeline(transaction=False) as pipe:
        pipe.xlen(stream)
        pipe.xpending(stream, CONSUMER_GROUP)
        length, summary = await pipe.execute(raise_on_error=False)
    if isinstance(length, Exception):
        raise length
    if isinstance(summary, redis.exceptions.ResponseError) and "NOGROUP" in str(summary):
        return int(length), 0, 0
    if isinstance(summary, Exception):
        raise summary
    pending = int(summary["pending"] if isinstance(summary, dict) else summary[0])
    redelivered = 0
    if pending:
        entries = await client.xpending_range(stream, CONSUMER_GROUP, min="-", max="+",
                                              count=min(pending, MAX_SCANNED_PENDING))
        redelivered = sum(1 for e in entries if int(e["times_delivered"]) > 1)
    return max(0, int(length) - pending), pending, redelivered


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
