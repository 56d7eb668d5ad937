"""Whether a worker is alive, and whether it is ready, judged from its heartbeat key
``{ns}:worker:{worker_id}`` (an encoded ``WorkerStatus``): the one rule that the
gateway's failover, the worker's reaper, the gateway's ``/ready`` and ``inferq serve``'s
ready line apply (docs/operations.md, "Liveness and readiness").

Alive: the key exists (the worker's event loop refreshed it within ``HEARTBEAT_TTL_S``)
and its engine is not stalled (``WorkerStatus.engine_stalled``: one step has been running
longer than that worker's ``engine_stall_timeout_s``). A hung engine thread does not stop
the event loop, so the key alone would keep a deadlocked worker's requests until their
deadline; the stall rule moves them in seconds. A value that does not decode (a worker of
another protocol version) counts as alive: there is no step time to judge, and taking a
live worker for dead would run its requests twice.

Ready for ``model``: alive, decodes, and its ``model`` is the served model name.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared import protocol
from shared.keys import Keys
from shared.protocol import WorkerStatus
from shared.redis_connect import AsyncClient, mget
from shared.streams import as_text

#: Keys read per SCAN call when listing heartbeats.
SCAN_COUNT = 1000


def decode_status(raw: bytes | None) -> WorkerStatus | None:
    """The ``WorkerStatus`` in a heartbeat value, or None (no key, or a value that does
    not decode as one)."""
    if raw is None:
        return None
    try:
        message = protocol.decode(raw)
    except protocol.ProtocolError:
        return None
    return message if isinstance(message, WorkerStatus) else None


def is_alive(raw: bytes | None) -> bool:
    """Judge one heartbeat value (None: the key is gone). See the module docstring."""
    if raw is None:
        return False
    status = decode_status(raw)
    return status is None or not status.engine_stalled


async def live_workers(client: AsyncClient, keys: Keys, worker_ids: Iterable[str]) -> set[str]:
    """The subset of ``worker_ids`` that are alive (one MGET).

    Raises:
        redis.exceptions.RedisError, OSError: Redis unreachable.
    """
    ids = sorted(set(worker_ids))
    if not ids:
        return set()
    values = await mget(client, [keys.worker_key(wid) for wid in ids])
    return {wid for wid, raw in zip(ids, values, strict=True) if is_alive(raw)}


async def ready_workers(client: AsyncClient, keys: Keys, model: str) -> list[WorkerStatus]:
    """Statuses of the workers ready to serve ``model``, ordered by worker id (SCAN of
    the heartbeat keys, then one MGET).

    Raises:
        redis.exceptions.RedisError, OSError: Redis unreachable.
    """
    names = sorted({as_text(k) async for k in client.scan_iter(match=keys.worker_pattern(), count=SCAN_COUNT)})
    if not names:
        return []
    ready = []
    for raw in await mget(client, names):
        status = decode_status(raw)
        if status is not None and status.model == model and not status.engine_stalled:
            ready.append(status)
    return ready
