"""``/v1/batches``: create, retrieve, list and cancel batches (OpenAI's Batch API). The
gateway stores the batch object and enqueues an arq job; a batch worker
(``worker/batch_jobs.py``) runs it (docs/operations.md, "Batches").

A batch belongs to the key tenant that created it, from one of its own files; its lines
run as that tenant. Every route answers 404, as for a batch that does not exist, to any
other key but an admin key (docs/operations.md, "Tenants and isolation")."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gateway.errors import OpenAIError
from gateway.files import caller_of, list_page, owned_file, store_of
from gateway.handlers import read_body
from gateway.tenants import Caller, owned_or_404
from shared.batch_store import BATCH_ENDPOINTS, COMPLETION_WINDOW, StoredBatch, enqueue_run, new_id
from shared.settings import BatchSettings

#: Most ``metadata`` pairs on a batch, and the longest key and value (OpenAI's limits).
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
#: Page size bounds of ``GET /v1/batches``.
DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 100


def _parse_create(raw: bytes) -> dict[str, Any]:
    """The validated body of ``POST /v1/batches``. Raises OpenAIError 400."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise OpenAIError(400, f"the body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    if not isinstance(body.get("input_file_id"), str):
        raise OpenAIError(400, "`input_file_id` must be a string", param="input_file_id")
    if body.get("endpoint") not in BATCH_ENDPOINTS:
        raise OpenAIError(400, f"`endpoint` must be one of {', '.join(BATCH_ENDPOINTS)}", param="endpoint")
    if body.get("completion_window") != COMPLETION_WINDOW:
        raise OpenAIError(400, f"`completion_window` must be {COMPLETION_WINDOW!r}", param="completion_window")
    metadata = body.get("metadata")
    if metadata is not None:
        ok = (isinstance(metadata, dict) and len(metadata) <= MAX_METADATA_PAIRS
              and all(isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY_CHARS
                      and len(v) <= MAX_METADATA_VALUE_CHARS for k, v in metadata.items()))
        if not ok:
            raise OpenAIError(400, f"`metadata` must map at most {MAX_METADATA_PAIRS} strings (keys up to "
                                   f"{MAX_METADATA_KEY_CHARS} characters) to strings (up to "
                                   f"{MAX_METADATA_VALUE_CHARS})", param="metadata")
    return body


def install_batch_routes(app: FastAPI, batch: BatchSettings) -> None:
    """Add the ``/v1/batches`` routes to ``app`` (whose ``state.inferq`` is the GatewayState)."""

    async def owned_batch(request: Request, caller: Caller, batch_id: str) -> StoredBatch:
        """The batch ``batch_id`` if ``caller`` may see it. Raises OpenAIError 404
        ``batch_not_found`` when it does not exist or belongs to another tenant (the same
        answer)."""
        stored = await store_of(request, batch).get_batch(batch_id)
        return owned_or_404(stored, caller, f"No such Batch object: {batch_id}", "batch_id", "batch_not_found")

    async def batch_object(request: Request, batch_id: str) -> dict[str, Any]:
        stored = await store_of(request, batch).get_batch(batch_id)
        assert stored is not None  # batches are never deleted
        return stored.obj

    @app.post("/v1/batches", include_in_schema=False)
    async def create_batch(request: Request) -> Response:
        state = request.app.state.inferq
        caller = await caller_of(request)
        body = _parse_create(await read_body(request, state.settings.max_body_bytes))
        store = store_of(request, batch)
        file = (await owned_file(request, batch, caller, body["input_file_id"], param="input_file_id")).obj
        if file["purpose"] != "batch":
            raise OpenAIError(400, f"file {file['id']} has purpose {file['purpose']!r}, not \"batch\"",
                              param="input_file_id")
        now = int(time.time())
        obj = {"id": new_id("batch").replace("-", "_", 1), "object": "batch", "endpoint": body["endpoint"],
               "errors": None, "input_file_id": file["id"], "completion_window": COMPLETION_WINDOW,
               "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
               "in_progress_at": None, "expires_at": now + int(batch.batch_completion_window_s),
               "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
               "cancelling_at": None, "cancelled_at": None, "total": 0, "completed": 0, "failed": 0,
               "metadata": body.get("metadata")}
        # The batch is the caller's, whoever owns the file (an admin key may use any file).
        await store.create_batch(obj, owner=caller.key_tenant)
        await enqueue_run(store, obj["id"])
        return JSONResponse(await batch_object(request, obj["id"]))

    @app.get("/v1/batches", include_in_schema=False)
    async def list_batches(request: Request, limit: int = DEFAULT_LIST_LIMIT, after: str | None = None) -> Response:
        caller = await caller_of(request)
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise OpenAIError(400, f"`limit` must be between 1 and {MAX_LIST_LIMIT}", param="limit")
        owner = None if caller.is_admin else caller.key_tenant  # an admin key lists every batch
        return list_page(*await store_of(request, batch).list_batches(owner, limit, after))

    @app.get("/v1/batches/{batch_id}", include_in_schema=False)
    async def retrieve_batch(batch_id: str, request: Request) -> Response:
        return JSONResponse((await owned_batch(request, await caller_of(request), batch_id)).obj)

    @app.post("/v1/batches/{batch_id}/cancel", include_in_schema=False)
    async def cancel_batch(batch_id: str, request: Request) -> Response:
        obj = (await owned_batch(request, await caller_of(request), batch_id)).obj
        store = store_of(request, batch)
        if obj["status"] not in ("cancelling", "cancelled"):
            moved = await store.transition(batch_id, ("validating", "in_progress"), "cancelling",
                                           cancelling_at=int(time.time()))
            if not moved:
                raise OpenAIError(409, f"cannot cancel batch {batch_id}: its status is {obj['status']!r}",
                                  param="batch_id", code="batch_not_cancellable")
            # The runner sees the status within a moment; a batch nobody runs is finalized
            # by the job this enqueues.
            await enqueue_run(store, batch_id)
        return JSONResponse(await batch_object(request, batch_id))
