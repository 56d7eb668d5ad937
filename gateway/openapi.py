"""The gateway's OpenAPI schema (``GET /openapi.json``).

The generation handlers read the raw ``Request`` (so that every validation failure is
an OpenAI-style 400, not FastAPI's 422), which leaves FastAPI nothing to infer request
bodies from. Here the bodies are attached by hand (``openapi_extra`` naming the pydantic
models of gateway/schemas.py, whose JSON schemas ``install_openapi`` adds to the
components), and the responses are documented with small models that mirror
gateway/responses.py and gateway/errors.py. These models only document: nothing
validates responses against them at run time (tests/test_gateway_fuzz.py does).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from gateway.schemas import REQUEST_ID_PATTERN, ChatCompletionRequest, CompletionRequest
from gateway.tokenizer_routes import DetokenizeRequest, TokenizeRequest

_REF_TEMPLATE = "#/components/schemas/{model}"
_BODY_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                                             DetokenizeRequest)


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every non-2xx answer: ``{"error": {...}}`` (gateway/errors.py)."""

    error: ErrorObject


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: the part of ``prompt_tokens`` found in the worker's prefix cache."""

    cached_tokens: int


class Usage(BaseModel):
    """Token counts of a response (gateway/choices.py, ``usage_of``)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """``logprobs`` of a completions choice (gateway/logprobs.py); with ``echo``, the prompt's
    tokens come first, the first of them with null ``token_logprobs`` and ``top_logprobs``."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """``logprobs`` of a chat choice (gateway/logprobs.py)."""

    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class Health(BaseModel):
    status: Literal["ok"]
    relay_subscribed: bool


_ERRORS = {
    400: "Invalid body, field or X-Request-Id, or the prompt does not fit the context",
    401: "API keys are configured and the bearer token is missing, malformed or wrong",
    404: "Unknown model",
    409: "A request with this X-Request-Id is already in flight",
    413: "Body larger than the gateway's max_body_bytes",
    429: "Queue full (Retry-After says when to retry)",
    500: "The worker aborted the request",
    503: "Redis or the reply channel is unavailable, or tokenizing the prompt (or checking its structured "
         "output) overran its time budget",
    504: "The request's deadline passed",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` entries: the OpenAI error object for each status."""
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


def generation_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a generation endpoint: ``model`` as JSON, or an SSE stream."""
    # Before OpenAPI 3.2 (``itemSchema``), the ``schema`` of an event stream describes one event.
    event = {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "description": "One JSON chunk, an {\"error\": ...} object, or [DONE] (the last event)"}}}
    ok = {"model": model, "description": "The whole output, or (stream=true) Server-Sent Events ending in [DONE]",
          "content": {"text/event-stream": {"schema": event}}}
    return {200: ok, **error_responses(400, 401, 404, 409, 413, 429, 500, 503, 504)}


def body_extra(body: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra=`` of an endpoint that reads the raw request: its JSON body."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF_TEMPLATE.format(model=body.__name__)}}}}}


def generation_extra(body: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra=`` of a generation endpoint: its JSON body and X-Request-Id."""
    request_id = {"name": "X-Request-Id", "in": "header", "required": False,
                  "description": "Client request id: a second request with the same id while the first is "
                                 "in flight is a 409",
                  # ECMA-262 ``$`` (JSON Schema) matches only at the very end: no trailing newline.
                  "schema": {"type": "string", "pattern": f"^{REQUEST_ID_PATTERN}$"}}
    return {"parameters": [request_id], **body_extra(body)}


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` add the request-body models and bearer auth to the schema
    FastAPI generates (it is built once, on the first ``GET /openapi.json``)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {})
            schemas = components.setdefault("schemas", {})
            for model in _BODY_MODELS:
                body = model.model_json_schema(ref_template=_REF_TEMPLATE)
                schemas.update(body.pop("$defs", {}))
                schemas[model.__name__] = body
            # Optional: a gateway without api_keys takes requests without a token.
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{}, {"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def add_body_schemas(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Make ``app.openapi()`` also list ``models`` (request bodies of routes installed
    beside the app's own, which ``body_extra`` refers to) and the models they nest among
    its component schemas. Call after ``install_openapi``."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            if model.__name__ not in schemas:
                body = model.model_json_schema(ref_template=_REF_TEMPLATE)
                schemas.update(body.pop("$defs", {}))
                schemas[model.__name__] = body
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
