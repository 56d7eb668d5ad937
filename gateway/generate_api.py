"""``POST /v1/generate``: one prompt in, its whole text out, as the serving prototypes
that inferq grew from answer it (docs/operations.md, "Endpoints").

The body, ``{"prompt": str, "max_new_tokens": int, ...}`` with the sampling fields of
``/v1/completions`` (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
``stop``, the penalties), an optional ``model`` (the served one when left out), ``user``
and ``priority``, becomes a completions request that runs through ``admit``
(gateway/handlers.py): the same checks, auth, tenants, rate limits, priority class,
admission, placement, failover, stop strings and metrics. The answer is
``{"request_id", "text", "generated_tokens", "latency_ms", "finish_reason", "model"}``;
errors are OpenAI error objects (the route is under ``/v1``). It does not stream
(``stream: true`` is a 400): ``/v1/completions`` and ``/generate_stream`` do.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from gateway.errors import OpenAIError
from gateway.generation import ClientDisconnected
from gateway.handlers import admit
from gateway.openapi import add_body_schemas, error_responses, generation_extra
from gateway.schemas import CompletionRequest, SamplingKnobs, parse_body
from gateway.state import GatewayState
from gateway.tenants import Caller

#: ``max_new_tokens`` when the body gives none (the prototypes' default).
DEFAULT_MAX_NEW_TOKENS = 64
#: The completions field names that the pipeline's errors use -> this route's.
_PARAMS = {"max_tokens": "max_new_tokens"}


class GenerateRequest(SamplingKnobs):
    """Body of ``POST /v1/generate``: the sampling fields of the OpenAI bodies
    (``SamplingKnobs``), parsed as they are (``BODY_CONFIG``)."""

    prompt: str
    max_new_tokens: Annotated[int, Field(ge=1)] = DEFAULT_MAX_NEW_TOKENS
    model: str | None = None
    stream: bool = False

    def to_completion(self, served_model: str) -> CompletionRequest:
        """The completions request of this body (the served model when none is named).

        Raises:
            OpenAIError: 400 ``stream`` when asked to stream.
        """
        if self.stream:
            raise OpenAIError(400, "/v1/generate answers one body; stream with /v1/completions or /generate_stream",
                              param="stream")
        fields = self.model_dump(exclude={"max_new_tokens", "stream"}, exclude_none=True)
        return CompletionRequest.model_validate({**fields, "model": self.model or served_model,
                                                 "max_tokens": self.max_new_tokens})


class GenerateResponse(BaseModel):
    """The answer of ``POST /v1/generate`` (documents it in the OpenAPI schema)."""

    request_id: str
    text: str
    generated_tokens: int
    latency_ms: float
    finish_reason: str
    model: str


def _renamed(exc: OpenAIError) -> OpenAIError:
    """``exc`` naming this route's field where the pipeline named the completions one."""
    if exc.param in _PARAMS:
        exc.param = _PARAMS[exc.param]
    return exc


async def handle_generate_v1(state: GatewayState, request: Request) -> Response:
    """Serve ``POST /v1/generate``. ``latency_ms``: from the request's arrival to its
    last token, ms."""
    arrival_s = time.monotonic()

    async def parse(_: Caller, body: bytes) -> CompletionRequest:
        req: GenerateRequest = parse_body(GenerateRequest, body)
        return req.to_completion(state.served_model_name)

    try:
        admitted = await admit(state, request, parse, id_prefix="gen-", batch_allowed=False)
    except OpenAIError as exc:
        return _renamed(exc).response()
    gen = admitted.gens[0]
    try:
        text = await gen.result()
    except OpenAIError as exc:
        return exc.response()
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        gen.close()
    body: dict[str, Any] = {"request_id": admitted.request_id, "text": text, "generated_tokens": gen.num_output_tokens,
                            "latency_ms": round((time.monotonic() - arrival_s) * 1000, 3),
                            "finish_reason": gen.finish_reason, "model": state.served_model_name}
    return JSONResponse(body, headers={"X-Request-Id": admitted.request_id, **admitted.rate_headers})


def install_generate_route(app: FastAPI) -> None:
    """Add ``POST /v1/generate`` to ``app`` (served directly when it is a
    ``gateway.app.GatewayApp``: ``serve_directly``)."""

    @app.post("/v1/generate", responses={200: {"model": GenerateResponse},
                                         **error_responses(400, 401, 404, 409, 413, 429, 500, 503, 504)},
              openapi_extra=generation_extra(GenerateRequest))
    async def generate_v1(request: Request) -> Response:
        return await handle_generate_v1(request.app.state.inferq, request)

    serve_directly = getattr(app, "serve_directly", None)
    if serve_directly is not None:
        serve_directly("/v1/generate", generate_v1)
    add_body_schemas(app, (GenerateRequest,))
