"""OpenAI-shaped errors: one exception type that carries the HTTP status, and the
handlers that turn it (and FastAPI's own validation errors) into
``{"error": {"message", "type", "param", "code"}}`` bodies.

A client that goes away before its request body is all in (Starlette's
``ClientDisconnect``, raised by any route's body read) is an ordinary event, not a
server error: one INFO line (``client_disconnected``), no traceback, and an answer that
nobody receives.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Scope

log = logging.getLogger(__name__)

#: OpenAI ``type`` of an error, by HTTP status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
#: Key of an HTTP scope whose body read the connection's body timeout ended
#: (gateway/http_timeouts.py); its value is the timeout, s.
BODY_TIMEOUT_KEY = "inferq.body_timeout_s"
#: Status of the answer to a client that left mid-body (nginx's "client closed request"):
#: nobody receives it; it only ends the ASGI call.
CLIENT_CLOSED_STATUS = 499


class OpenAIError(Exception):
    """An error answered to the client as an OpenAI error object with ``status``.

    ``param`` names the offending request field (400s); ``headers`` are added to the
    response (e.g. ``Retry-After`` on 429).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        """A ``JSONResponse`` with the status, body and headers."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """Build an OpenAI error object; ``code`` defaults to the status as a string."""
    return {"error": {
        "message": message,
        "type": _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
        "param": param,
        "code": code if code is not None else str(status),
    }}


def validation_error(errors: list[Any]) -> OpenAIError:
    """Turn pydantic/FastAPI validation errors into one 400 naming the first bad field."""
    if not errors:
        return OpenAIError(400, "invalid request body")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] in ("body", "query", "path", "header", "cookie"):
        loc = loc[1:]
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    return OpenAIError(400, f"{where}: {first.get('msg', 'invalid value')}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app answers an OpenAI error object (422 becomes 400)."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})).response()

    @app.exception_handler(ClientDisconnect)
    async def _client_disconnected(request: Request, _: ClientDisconnect) -> JSONResponse:
        return client_disconnected(request.scope)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc)


def internal_error(exc: Exception, scope: Scope | None = None) -> JSONResponse:
    """The 500 answer to an exception no handler expected; the exception is logged. A
    ``ClientDisconnect`` is no error: ``client_disconnected(scope)``."""
    if isinstance(exc, ClientDisconnect):
        return client_disconnected(scope or {})
    log.exception("unhandled error", exc_info=exc)
    return OpenAIError(500, f"internal error: {type(exc).__name__}").response()


def client_disconnected(scope: Scope) -> JSONResponse:
    """Log, in one INFO line, a client that went away (or was cut off by the body
    timeout) before its request body was all in; the answer goes nowhere."""
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "an unknown address"
    timeout_s = scope.get(BODY_TIMEOUT_KEY)
    what = "left" if timeout_s is None else f"was cut off (no body data for {timeout_s:g} s)"
    log.info("client %s %s before its request body was complete: %s %s", who, what, scope.get("method", "?"),
             scope.get("path", "?"))
    return OpenAIError(CLIENT_CLOSED_STATUS, "the client disconnected before the request body was complete",
                       code="client_disconnected").response()
