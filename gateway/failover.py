"""Failover: the gateway owns each request's progress, so when the worker running a
request dies, the gateway re-enqueues a continuation and the client never notices.

Every ``CHECK_INTERVAL_S`` the monitor finds the owner of each in-flight request (the
worker named in its last token batch, or the consumer holding its stream entry in
the group's pending entries list of the request's stream) and checks the owner's heartbeat key. When the key
is gone (TTL ``HEARTBEAT_TTL_S`` after a SIGKILL, at once after a drain that timed
out) or reports the engine stalled (one step running past the worker's
``engine_stall_timeout_s``, ``shared/liveness.py``), one enqueue script
(``shared/fair_queue.py``) replaces the old entry with a continuation on the request's
(class, tenant) stream (also when the old one was on the dead worker's placed stream):
XACK + XDEL the old entry, XADD a ``GenerateRequest`` with
``attempt + 1`` and ``output_token_ids`` = the tokens the client already has. Greedy output then equals an undisturbed run: the new
worker recomputes the KV of prompt + delivered tokens and continues, numbering its
tokens from ``len(output_token_ids)``; the request's ``Generation`` (the relay's record,
``Relay.requests``) drops late entries of the old attempt.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import msgspec
import redis.exceptions

from shared.keys import CONSUMER_GROUP
from shared.liveness import live_workers
from shared.streams import as_text

if TYPE_CHECKING:
    from gateway.generation import Generation
    from gateway.state import GatewayState

log = logging.getLogger(__name__)

#: How often in-flight requests' owners are checked, seconds.
CHECK_INTERVAL_S = 0.5


async def find_owners(state: GatewayState, gens: list[Generation]) -> dict[str, str]:
    """Request id -> worker id of the worker running it (requests still waiting in the
    stream, undelivered, have no owner and are left out)."""
    owners = {g.request_id: g.worker_id for g in gens if g.worker_id is not None}
    unknown = [g for g in gens if g.worker_id is None and g.entry_id is not None]
    if unknown:
        async with state.redis.pipeline(transaction=False) as pipe:
            for g in unknown:
                pipe.xpending_range(g.stream or state.stream, CONSUMER_GROUP, min=g.entry_id, max=g.entry_id,
                                    count=1)
            replies = await pipe.execute(raise_on_error=False)
        for g, reply in zip(unknown, replies, strict=True):
            if isinstance(reply, list) and reply:
                owners[g.request_id] = as_text(reply[0]["consumer"])
    return owners


async def dead_workers(state: GatewayState, worker_ids: set[str]) -> set[str]:
    """The subset of ``worker_ids`` without a live heartbeat: the key expired, or it
    reports the engine stalled (``shared/liveness.py``)."""
    return worker_ids - await live_workers(state.redis, state.keys, worker_ids)


async def reenqueue(state: GatewayState, gen: Generation) -> None:
    """Replace ``gen``'s stream entry with a continuation, atomically."""
    old = gen.message
    assert old is not None and gen.entry_id is not None
    cont = msgspec.structs.replace(old, attempt=old.attempt + 1, output_token_ids=list(gen.output_ids))
    gen.attempt = cont.attempt  # from now on, entries of the replaced attempt are dropped
    # The continuation goes to its (class, tenant) stream, for any live worker, whether
    # the old entry sat there or on the dead worker's placed stream.
    target = gen.class_stream or gen.stream or state.stream
    ids = await state.queue.enqueue(target, [cont], finish_stream=gen.stream or target, finish_entry_id=gen.entry_id)
    assert ids is not None  # None only with a request-id key
    entry_id = ids[0]
    log.warning("failover of %s from %s after %d tokens (attempt %d)", gen.request_id, gen.worker_id,
                len(gen.output_ids), cont.attempt)
    gen.resubmitted(cont, entry_id)
    gen.stream = target
    state.metrics.failovers.labels(state.served_model_name).inc()


async def check_once(state: GatewayState) -> int:
    """One pass over in-flight requests; returns how many were re-enqueued."""
    gens = [g for g in state.relay.requests.values() if not g.worker_done and g.message is not None]
    if not gens:
        return 0
    owners = await find_owners(state, gens)
    if not owners:
        return 0
    dead = await dead_workers(state, set(owners.values()))
    moved = 0
    for g in gens:
        owner = owners.get(g.request_id)
        if owner in dead and not g.worker_done and state.relay.requests.get(g.request_id) is g:
            g.worker_id = owner
            await reenqueue(state, g)
            moved += 1
    return moved


async def failover_loop(state: GatewayState) -> None:
    """Run ``check_once`` forever; Redis errors are logged and retried (the relay
    already fails requests when Redis itself is gone)."""
    while True:
        await asyncio.sleep(CHECK_INTERVAL_S)
        try:
            await check_once(state)
        except (redis.exceptions.RedisError, OSError) as exc:
            log.debug("failover check skipped: %s", exc)
