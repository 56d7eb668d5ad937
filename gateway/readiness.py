"""Readiness, ``GET /ready``: can this gateway serve its model now? Yes when Redis
answers, the relay is subscribed to the reply channel, and at least one worker for the
served model is ready (a live heartbeat for that model whose engine is not stalled,
``shared/liveness.py``). ``/health`` stays the gateway's own liveness (Redis answers
PING); load balancers and compose health checks use ``/ready`` (docs/operations.md,
"Liveness and readiness")."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from shared.liveness import ready_workers

if TYPE_CHECKING:
    from gateway.state import GatewayState

log = logging.getLogger(__name__)

ReadyStatus = Literal["ok", "no_worker", "relay_not_subscribed", "redis_unavailable"]


class Readiness(BaseModel):
    """Body of ``/ready`` (200 when ``status`` is ``ok``, else 503)."""

    status: ReadyStatus
    model: str
    workers_ready: int


async def readiness(state: GatewayState, timeout_s: float) -> JSONResponse:
    """The ``/ready`` response: 200 and ``{"status": "ok", "model": ..., "workers_ready":
    n}`` when ready, else 503 with the reason in ``status``. Reading the heartbeats
    takes at most ``timeout_s`` seconds; a failure or timeout answers
    ``redis_unavailable``."""
    model = state.served_model_name
    try:
        workers = await asyncio.wait_for(ready_workers(state.redis, state.keys, model), timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure to read Redis means not ready
        log.debug("readiness check failed: %r", exc)
        return _answer("redis_unavailable", model, 0)
    if not state.relay.ready.is_set():
        return _answer("relay_not_subscribed", model, len(workers))
    return _answer("ok" if workers else "no_worker", model, len(workers))


def _answer(status: ReadyStatus, model: str, workers_ready: int) -> JSONResponse:
    body = Readiness(status=status, model=model, workers_ready=workers_ready)
    return JSONResponse(body.model_dump(), status_code=200 if status == "ok" else 503)
