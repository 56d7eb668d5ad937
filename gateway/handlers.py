"""The two generation endpoints: validate, tokenize, admit, enqueue, then answer with
one JSON body or an SSE stream (docs/architecture.md, "One request, step by step").

Order of checks, cheap before expensive: auth (401), body size (413), body (400: types,
list limits, ``n`` and the number of prompts, tool fields, at most one structured-output
constraint), model (404), X-Request-Id (400), prompt characters (400, before
tokenizing), tokenizing (503 past its time budget), prompt tokens (400), the structured output's grammar (400, on the encode pool:
gateway/structured.py), sampling parameters (400), the priority class (400: gateway/priority.py), the tenant's rate limits (429
``rate_limit_exceeded``: gateway/rate_limits.py), then for all the request's child
requests at once (gateway/choices.py): relay subscribed (503), queue depth (429/503),
XADD (503). docs/operations.md, "Limits", lists every limit.
"""

from __future__ import annotations

import logging
import re
import secrets
import time

from fastapi import Request
from fastapi.responses import Response

from gateway.choices import Choice, full_response, submit
from gateway.errors import OpenAIError
from gateway.logprobs import LogprobsFormatter
from gateway.placement import session_of
from gateway.priority import request_class
from gateway.rate_limits import RATE_LIMIT_CODE
from gateway.responses import ResponseShape
from gateway.schemas import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    REQUEST_ID_PATTERN,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from gateway.sse import ChoicesStream
from gateway.state import GatewayState
from gateway.tenants import check_key, identify, tenant_of
from gateway.tokenize import check_prompt_tokens
from gateway.tool_formats import tool_format_for_template
from gateway.tool_parser import ToolCallStream
from gateway.tools import template_messages, template_renders_tools

log = logging.getLogger(__name__)

_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)
_REJECT_REASONS = {400: "invalid_request", 401: "unauthorized", 404: "unknown_model", 409: "duplicate_request",
                   413: "body_too_large", 429: "queue_full", 503: "unavailable"}


def check_auth(state: GatewayState, request: Request) -> None:
    """Raises OpenAIError 401 unless the bearer token is one of ``api_keys`` or
    ``admin_api_keys`` (no ``api_keys``: open): ``gateway.tenants.check_key``. Routes
    that need to know who calls use ``gateway.tenants.identify``."""
    check_key(state.settings, request)


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The request body, at most ``max_body_bytes`` bytes. Raises OpenAIError 413."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise OpenAIError(413, f"request body exceeds {max_body_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise OpenAIError(413, f"request body exceeds {max_body_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def make_request_id(request: Request, prefix: str) -> str:
    """``<prefix><X-Request-Id>`` when the client sent one, else ``<prefix><random hex>``."""
    given = request.headers.get("x-request-id")
    if given is None:
        return prefix + secrets.token_hex(16)
    if _REQUEST_ID_RE.fullmatch(given) is None:
        raise OpenAIError(400, f"X-Request-Id must match {REQUEST_ID_PATTERN}", param="X-Request-Id")
    return prefix + given


def resolve_max_tokens(requested: int | None, default: int | None, num_prompt_tokens: int, max_model_len: int,
                       prompt_param: str, max_tokens_param: str) -> int:
    """The request's ``max_tokens``, checked against the context length.

    ``default`` None means "fill the context" (chat). Raises OpenAIError 400.
    """
    check_prompt_tokens(num_prompt_tokens, max_model_len, prompt_param)
    max_tokens = requested if requested is not None else (
        default if default is not None else max_model_len - num_prompt_tokens)
    if num_prompt_tokens + max_tokens > max_model_len:
        raise OpenAIError(400, f"max_tokens ({max_tokens}) + the prompt ({num_prompt_tokens} tokens) exceed this "
                          f"model's maximum context length of {max_model_len} tokens", param=max_tokens_param)
    return max_tokens


async def handle_generate(state: GatewayState, request: Request, *, chat: bool) -> Response:
    """Serve ``POST /v1/completions`` (``chat=False``) or ``/v1/chat/completions``: one
    child request per prompt and choice (gateway/choices.py)."""
    arrival_s = time.monotonic()
    rate_headers: dict[str, str] = {}  # x-ratelimit-* once the tenant's limits admitted the request
    queue_labels: tuple[str, str] | None = None  # (class, tenant label) once the class is known
    try:
        caller = await identify(state.settings, state.tenants, request, batch_allowed=True)
        body = await read_body(request, state.settings.max_body_bytes)
        req: CompletionRequest | ChatCompletionRequest = parse_body(
            ChatCompletionRequest if chat else CompletionRequest, body)
        req.check()
        if req.model != state.served_model_name:
            raise OpenAIError(404, f"the model {req.model!r} does not exist", param="model", code="model_not_found")
        request_id = make_request_id(request, "chatcmpl-" if chat else "cmpl-")
        max_len = state.max_model_len
        echoes: list[str] | None = None  # each prompt's text, for completions ``echo``
        if isinstance(req, ChatCompletionRequest):
            chat_template = getattr(state.tokenizer.tokenizer, "chat_template", None)
            renders_tools = template_renders_tools(chat_template)
            req.tool_format = tool_format_for_template(chat_template)  # what the grammar writes, the parser reads
            messages, tools = template_messages([m.to_template() for m in req.messages], req.template_tools(),
                                                renders_tools)
            prompts = [await state.tokenizer.chat_prompt(messages, max_len, tools=tools)]
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            max_tokens = [resolve_max_tokens(req.requested_max_tokens, None, len(prompts[0]), max_len,
                                             "messages", param)]
        else:
            prompts = await state.tokenizer.completion_prompts(req.prompts, max_len)
            max_tokens = [resolve_max_tokens(req.worker_max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, len(p), max_len,
                                             "prompt", "max_tokens") for p in prompts]
            if req.echo:
                echoes = await prompt_texts(state, req.prompts, prompts)
        constraint = req.constraint()
        structured = None if constraint is None else await state.tokenizer.run_blocking(
            constraint.build, state.tokenizer, param=constraint.param, action="checking",
            code="structured_output_timeout")
        params = [req.sampling_params(m, vocab_size=state.tokenizer.vocab_size, structured=structured)
                  for m in max_tokens]
        n = req.num_choices
        priority_class = request_class(request, req.priority)
        tenant = tenant_of(request, req.user, state.settings, caller.key_tenant)
        queue_labels = (priority_class, state.metrics.tenant_label(tenant))
        # Every child reserves its prompt and max_tokens (docs/operations.md, "Rate limits and tenants").
        rate_headers = await state.rate_limiter.admit(
            tenant, caller.key_tenant, n * sum(len(p) + m for p, m in zip(prompts, max_tokens, strict=True)))
        gens = await submit(state, request, request_id, prompts, params, n, req.stop_strings, arrival_s,
                            poll_disconnect=not req.stream, priority_class=priority_class, tenant=tenant,
                            id_scope=caller.key_tenant, session=session_of(request, req.user, state.settings),
                            constraint_param=None if constraint is None else constraint.param)
    except OpenAIError as exc:
        state.metrics.rejected("rate_limited" if exc.code == RATE_LIMIT_CODE
                               else _REJECT_REASONS.get(exc.status, str(exc.status)))
        if queue_labels is not None:
            state.metrics.class_rejected.labels(state.served_model_name, *queue_labels).inc()
        exc.headers = {**rate_headers, **exc.headers}
        return exc.response()
    assert queue_labels is not None  # set before submit, which admitted the request
    state.metrics.class_admitted.labels(state.served_model_name, *queue_labels).inc()
    created_unix_s = int(time.time())
    num_top = params[0].logprobs
    choices = [Choice(gen, ResponseShape(request_id, state.served_model_name, created_unix_s, chat, index=k),
                      tool_calls=ToolCallStream(req.max_num_tool_calls, req.tool_format)
                      if isinstance(req, ChatCompletionRequest) and req.parses_tool_calls else None,
                      logprobs=None if num_top is None else LogprobsFormatter(state.tokenizer.tokenizer, num_top, chat),
                      echo=None if echoes is None else echoes[k // n], prompt_ids=prompts[k // n],
                      prompt_only=isinstance(req, CompletionRequest) and req.scores_prompt_only)
               for k, gen in enumerate(gens)]
    num_prompt_tokens = sum(len(p) for p in prompts)  # each prompt once, however many choices share it
    headers = {"X-Request-Id": request_id, **rate_headers}
    if req.stream:
        return ChoicesStream(choices, num_prompt_tokens, req.include_usage,
                             headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await full_response(choices, num_prompt_tokens, headers)


async def prompt_texts(state: GatewayState, given: list[str | list[int]], prompts: list[list[int]]) -> list[str]:
    """Each prompt's text for ``echo``: a text prompt as given, a token-id prompt decoded
    (on the encode pool).

    Raises:
        OpenAIError: 503 when decoding overran the tokenizer's time budget.
    """
    decode = state.tokenizer.tokenizer.decode
    return [p if isinstance(p, str) else await state.tokenizer.run_blocking(decode, ids, param="prompt",
                                                                            action="decoding")
            for p, ids in zip(given, prompts, strict=True)]
