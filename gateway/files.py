"""``/v1/files``: upload (multipart, read as a stream straight to disk), list, retrieve,
download and delete batch input files (docs/operations.md, "Batches").

Every file belongs to the key tenant that uploaded it (a batch's output and error files
to the batch's owner); every route answers 404, as for a file that does not exist, to
any other key but an admin key (``Caller.owns``; docs/operations.md, "Tenants and
isolation").

An upload is validated line by line before it is stored: each line a JSON object with a
``custom_id`` unique in the file, ``method: POST``, a ``url`` in ``BATCH_ENDPOINTS`` and a
``body`` object whose ``model`` is the served model. A bad file is a 400 naming the first
``MAX_REPORTED_ERRORS`` offending lines.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

from gateway.errors import OpenAIError
from gateway.tenants import Caller, identify, owned_or_404
from shared.batch_store import BATCH_ENDPOINTS, BatchStore, StoredFile, new_id
from shared.redis_connect import is_cluster
from shared.settings import BatchSettings

#: How many bad lines a 400 for an invalid file names.
MAX_REPORTED_ERRORS = 10
#: Largest non-file form field (``purpose``), bytes.
MAX_FIELD_BYTES = 1024
#: Room for the multipart framing and fields on top of ``max_file_bytes`` before a
#: declared Content-Length is refused outright, bytes.
MULTIPART_OVERHEAD_BYTES = 64 * 1024


def list_page(data: list[dict[str, Any]], has_more: bool) -> JSONResponse:
    """OpenAI's list object over ``data`` (files or batches), with its first and last ids."""
    return JSONResponse({"object": "list", "data": data, "has_more": has_more,
                         "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})


async def caller_of(request: Request) -> Caller:
    """Who calls a files or batches route (``identify``; no batch credential here).

    Raises:
        OpenAIError: 401, or 503 when Redis is unreachable.
    """
    state = request.app.state.inferq
    return await identify(state.settings, state.tenants, request)


async def owned_file(request: Request, batch: BatchSettings, caller: Caller, file_id: str,
                     param: str = "file_id") -> StoredFile:
    """The file ``file_id`` if ``caller`` may see it.

    Raises:
        OpenAIError: 404 ``file_not_found`` (``param``) when it does not exist or belongs
            to another tenant: the same answer, so a tenant learns nothing of others' ids.
    """
    stored = await store_of(request, batch).get_file(file_id)
    return owned_or_404(stored, caller, f"No such File object: {file_id}", param, "file_not_found")


def store_of(request: Request, batch: BatchSettings) -> BatchStore:
    """The app's ``BatchStore`` (made on first use over the gateway's Redis client).

    Raises:
        OpenAIError: 501 on a Redis Cluster, where the Batch API does not run (its
            transactions and arq's jobs span hash slots: docs/operations.md, "A Redis that
            survives losing a node").
    """
    app_state = request.app.state
    store = getattr(app_state, "batch_store", None)
    if store is None:
        state = app_state.inferq
        if is_cluster(state.redis):
            raise OpenAIError(501, "the Batch API (files and batches) needs a Redis that is not a cluster",
                              code="batch_api_unavailable")
        store = app_state.batch_store = BatchStore(state.redis, state.keys, batch.files_dir)
    return store  # type: ignore[no-any-return]


async def receive_upload(request: Request, dest: Path, max_file_bytes: int) -> tuple[dict[str, str], str | None]:
    """Stream a ``multipart/form-data`` body: the part named ``file`` goes to ``dest``
    (at most ``max_file_bytes`` bytes), other parts are small text fields.

    Returns ``(fields, filename)``; ``filename`` is None when no ``file`` part came.
    Raises OpenAIError 400 (not multipart, a field too long), 413 (file too large).
    """
    mime, params = parse_options_header(request.headers.get("content-type", ""))
    if mime != b"multipart/form-data" or b"boundary" not in params:
        raise OpenAIError(400, "expected a multipart/form-data body with fields `file` and `purpose`")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_file_bytes + MULTIPART_OVERHEAD_BYTES:
        raise OpenAIError(413, f"file exceeds {max_file_bytes} bytes", param="file")
    fields: dict[str, str] = {}
    part: dict[str, Any] = {}
    header: list[bytes] = [b"", b""]
    out = open(dest, "wb")  # noqa: ASYNC230, SIM115 - local disk; closed in finally, the callbacks write to it
    state: dict[str, Any] = {"filename": None, "file_bytes": 0, "error": None}

    def on_part_begin() -> None:
        part.clear()
        part["headers"] = {}
        part["buf"] = bytearray()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header[0] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header[1] += data[start:end]

    def on_header_end() -> None:
        part["headers"][header[0].decode("latin-1").lower()] = header[1]
        header[0], header[1] = b"", b""

    def on_headers_finished() -> None:
        _, disp = parse_options_header(part["headers"].get("content-disposition", b""))
        part["name"] = disp.get(b"name", b"").decode("utf-8", "replace")
        part["is_file"] = part["name"] == "file"
        if part["is_file"]:
            state["filename"] = disp.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if state["error"] is not None:
            return
        if part.get("is_file"):
            state["file_bytes"] += end - start
            if state["file_bytes"] > max_file_bytes:
                state["error"] = OpenAIError(413, f"file exceeds {max_file_bytes} bytes", param="file")
                return
            out.write(data[start:end])
        else:
            part["buf"] += data[start:end]
            if len(part["buf"]) > MAX_FIELD_BYTES:
                state["error"] = OpenAIError(400, f"form field {part['name']!r} exceeds {MAX_FIELD_BYTES} bytes")

    def on_part_end() -> None:
        if not part.get("is_file") and state["error"] is None:
            fields[part["name"]] = part["buf"].decode("utf-8", "replace")

    parser = MultipartParser(params[b"boundary"], {
        "on_part_begin": on_part_begin, "on_header_field": on_header_field, "on_header_value": on_header_value,
        "on_header_end": on_header_end, "on_headers_finished": on_headers_finished,
        "on_part_data": on_part_data, "on_part_end": on_part_end})
    try:
        async for chunk in request.stream():
            parser.write(chunk)
            if state["error"] is not None:
                raise state["error"]
        parser.finalize()
    except (OpenAIError, ClientDisconnect):  # the client left mid-upload: one INFO line (gateway/errors.py)
        raise
    except Exception as exc:  # noqa: BLE001 - python-multipart's parse errors
        raise OpenAIError(400, f"malformed multipart body: {exc}") from None
    finally:
        out.close()
    return fields, state["filename"]


def validate_lines(path: Path, served_model: str, max_lines: int) -> tuple[int, list[str]]:
    """Check every line of the batch input file at ``path``.

    Returns ``(num_lines, errors)``: errors as ``"line N: what"`` (1-based), at most
    ``MAX_REPORTED_ERRORS`` plus one ``"... and K more"``; counting stops past ``max_lines``.
    """
    errors: list[str] = []
    num_bad = 0
    seen: set[str] = set()
    num_lines = 0
    with open(path, "rb") as f:
        for num_lines, raw in enumerate(f, start=1):
            if num_lines > max_lines:
                return num_lines, [f"the file has more than {max_lines} lines (the most a batch takes)"]
            problem = _line_problem(raw, seen, served_model)
            if problem is not None:
                num_bad += 1
                if len(errors) < MAX_REPORTED_ERRORS:
                    errors.append(f"line {num_lines}: {problem}")
    if num_lines == 0:
        errors.append("the file is empty")
    if num_bad > len(errors):
        errors.append(f"... and {num_bad - len(errors)} more bad lines")
    return num_lines, errors


def _line_problem(raw: bytes, seen: set[str], served_model: str) -> str | None:
    """What is wrong with one line, or None."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return f"not valid JSON ({exc})"
    if not isinstance(obj, dict):
        return "not a JSON object"
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "`custom_id` must be a non-empty string"
    if custom_id in seen:
        return f"duplicate `custom_id` {custom_id!r}"
    seen.add(custom_id)
    if obj.get("method") != "POST":
        return "`method` must be \"POST\""
    if obj.get("url") not in BATCH_ENDPOINTS:
        return f"`url` must be one of {', '.join(BATCH_ENDPOINTS)}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "`body` must be a JSON object"
    if body.get("model") != served_model:
        return f"`body.model` {body.get('model')!r} is not served here (served: {served_model!r})"
    return None


def install_file_routes(app: FastAPI, batch: BatchSettings) -> None:
    """Add the ``/v1/files`` routes to ``app`` (whose ``state.inferq`` is the GatewayState)."""

    @app.post("/v1/files", include_in_schema=False)
    async def upload_file(request: Request) -> Response:
        state = request.app.state.inferq
        caller = await caller_of(request)
        store = store_of(request, batch)
        tmp = store.temp_path()
        try:
            fields, filename = await receive_upload(request, tmp, batch.max_file_bytes)
            if fields.get("purpose") != "batch":
                raise OpenAIError(400, f"`purpose` must be \"batch\" (got {fields.get('purpose')!r})", param="purpose")
            if filename is None:
                raise OpenAIError(400, "no `file` part in the form", param="file")
            _, errors = await asyncio.to_thread(validate_lines, tmp, state.served_model_name, batch.max_file_lines)
            if errors:
                raise OpenAIError(400, "invalid batch input file: " + "; ".join(errors), param="file",
                                  code="invalid_file")
            return JSONResponse(await store.add_file(new_id("file"), tmp, filename, "batch", caller.key_tenant))
        finally:
            tmp.unlink(missing_ok=True)

    @app.get("/v1/files", include_in_schema=False)
    async def list_files(request: Request, purpose: str | None = None) -> Response:
        caller = await caller_of(request)
        owner = None if caller.is_admin else caller.key_tenant  # an admin key lists every file
        return list_page(await store_of(request, batch).list_files(owner, purpose), has_more=False)

    @app.get("/v1/files/{file_id}", include_in_schema=False)
    async def retrieve_file(file_id: str, request: Request) -> Response:
        stored = await owned_file(request, batch, await caller_of(request), file_id)
        return JSONResponse(stored.obj)

    @app.get("/v1/files/{file_id}/content", include_in_schema=False)
    async def file_content(file_id: str, request: Request) -> Response:
        await owned_file(request, batch, await caller_of(request), file_id)
        return FileResponse(store_of(request, batch).path(file_id), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}", include_in_schema=False)
    async def delete_file(file_id: str, request: Request) -> Response:
        stored = await owned_file(request, batch, await caller_of(request), file_id)
        await store_of(request, batch).delete_file(file_id, stored.owner)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})
