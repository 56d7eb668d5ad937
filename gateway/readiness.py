"""Readiness, ``GET /ready``: can this gateway serve its model now? Yes when Redis
answers, the relay is subscribed to the reply channel, and at least one worker for the
served model is ready (a live heartbeat for that model whose engine is not stalled,
``shared/liveness.py``), and the ready workers agree on the KV block size and
``max_model_len`` their heartbeats announce (gateways place prompts by block hashes of
one size, and admit by one length). ``/health`` stays the gateway's own liveness (Redis
answers PING); load balancers and compose health checks use ``/ready``
(docs/operations.md, "Liveness and readiness")."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from shared.liveness import ready_workers
from shared.protocol import WorkerStatus

if TYPE_CHECKING:
    from gateway.state import GatewayState

log = logging.getLogger(__name__)

ReadyStatus = Literal["ok", "no_worker", "workers_disagree", "relay_not_subscribed", "redis_unavailable"]


class Readiness(BaseModel):
    """Body of ``/ready`` (200 when ``status`` is ``ok``, else 503)."""

    status: ReadyStatus
    model: str
    workers_ready: int
    #: What the workers disagree on, per worker (``workers_disagree`` only; absent otherwise).
    detail: str = ""


async def readiness(state: GatewayState, timeout_s: float) -> JSONResponse:
    """The ``/ready`` response: 200 and ``{"status": "ok", "model": ..., "workers_ready":
    n}`` when ready, else 503 with the reason in ``status`` (``workers_disagree`` with
    ``detail``: ``disagreement``). Reading the heartbeats takes at most ``timeout_s``
    seconds; a failure or timeout answers ``redis_unavailable``."""
    model = state.served_model_name
    try:
        workers = await asyncio.wait_for(ready_workers(state.redis, state.keys, model), timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure to read Redis means not ready
        log.debug("readiness check failed: %r", exc)
        return _answer("redis_unavailable", model, 0)
    if not state.relay.ready.is_set():
        return _answer("relay_not_subscribed", model, len(workers))
    if not workers:
        return _answer("no_worker", model, 0)
    detail = disagreement(workers)
    return _answer("workers_disagree" if detail else "ok", model, len(workers), detail)


def disagreement(workers: Sequence[WorkerStatus]) -> str:
    """What ``workers`` (ready, one model) disagree on: ``"block_size: w1 16, w2 32"``
    and/or ``"max_model_len: ..."`` (``; ``-separated), or "" when they agree. A
    ``max_model_len`` of 0 (a build before the field) is left out of the comparison."""
    parts = []
    for name in ("block_size", "max_model_len"):
        values = {w.worker_id: getattr(w, name) for w in workers if getattr(w, name) > 0}
        if len(set(values.values())) > 1:
            parts.append(f"{name}: " + ", ".join(f"{wid} {v}" for wid, v in values.items()))
    return "; ".join(parts)


def _answer(status: ReadyStatus, model: str, workers_ready: int, detail: str = "") -> JSONResponse:
    body = Readiness(status=status, model=model, workers_ready=workers_ready, detail=detail)
    # No empty ``detail``: a ready body stays {"status", "model", "workers_ready"}.
    return JSONResponse(body.model_dump(exclude_defaults=True), status_code=200 if status == "ok" else 503)
