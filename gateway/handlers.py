"""Every generation route's pipeline, ``admit``: validate, tokenize, admit, enqueue
(docs/architecture.md, "One request, step by step"); and the completions and chat
endpoints, which answer with one JSON body or an SSE stream (other routes read their own
bodies and write their own answers around ``admit``: gateway/responses_api.py...).

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from gateway.choices import Choice, full_response, submit
from gateway.errors import OpenAIError
from gateway.generation import Generation
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
from gateway.tenants import Caller, check_key, identify, tenant_of
from gateway.tokenize import check_prompt_tokens
from gateway.tool_formats import tool_format_for_template
from gateway.tool_parser import ToolCallStream
from gateway.tools import template_messages, template_renders_tools
from shared.sampling import SamplingParams

log = logging.getLogger(__name__)

_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)
_REJECT_REASONS = {400: "invalid_request", 401: "unauthorized", 404: "unknown_model", 409: "duplicate_request",
                   413: "body_too_large", 429: "queue_full", 503: "unavailable"}
#: Rejections counted by their error code rather than their status (a 404 of a stored
#: response named by the body is no unknown model: gateway/response_store.py).
_REJECT_CODES = {RATE_LIMIT_CODE: "rate_limited", "response_not_found": "unknown_response"}


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


@dataclass(slots=True)
class Admitted:
    """A generation request past every check and on the queue (``admit``): its body
    (``req``), its caller and id, each prompt's token ids and sampling parameters, its
    children's records in choice-index order (``submit``), each prompt's text for
    completions ``echo`` (else None) and the tenant's ``x-ratelimit-*`` headers."""

    req: CompletionRequest | ChatCompletionRequest
    caller: Caller
    request_id: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    gens: list[Generation]
    echoes: list[str] | None
    rate_headers: dict[str, str]


#: How ``admit`` reads a body: (the caller, the raw body) -> the request. The caller is
#: there for bodies that name stored objects it must own (gateway/responses_api.py).
#: Raises OpenAIError (400 naming the field, 404 for an object it may not see).
BodyParser = Callable[[Caller, bytes], Awaitable[CompletionRequest | ChatCompletionRequest]]


async def _parse_completion(_: Caller, body: bytes) -> CompletionRequest:
    return parse_body(CompletionRequest, body)  # type: ignore[no-any-return]


async def _parse_chat(_: Caller, body: bytes) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, body)  # type: ignore[no-any-return]


async def admit(state: GatewayState, request: Request, parse: BodyParser, *, id_prefix: str,
                batch_allowed: bool = True,
                default_max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS) -> Admitted:
    """Take a generation request from its arrival to the queue, with the checks in the
    module docstring's order: ``parse`` reads the body (a completions or chat body, or
    another API's body translated into a chat request: gateway/responses_api.py), the
    request id is ``id_prefix`` + the client's X-Request-Id or random hex, and
    ``batch_allowed`` lets the batch worker name a tenant (``identify``).
    ``default_max_tokens``: a completions request's ``max_tokens`` when it gives none
    (None: fill the context, as chat; TGI's ``max_new_tokens``: gateway/tgi.py).

    Raises:
        OpenAIError: the first check that fails (counted in the rejection metrics; once
            the tenant's limits admitted the request, its ``headers`` carry x-ratelimit-*).
    """
    arrival_s = time.monotonic()
    rate_headers: dict[str, str] = {}  # x-ratelimit-* once the tenant's limits admitted the request
    queue_labels: tuple[str, str] | None = None  # (class, tenant label) once the class is known
    try:
        caller = await identify(state.settings, state.tenants, request, batch_allowed=batch_allowed)
        body = await read_body(request, state.settings.max_body_bytes)
        req = await parse(caller, body)
        req.check()
        if req.model != state.served_model_name:
            raise OpenAIError(404, f"the model {req.model!r} does not exist", param="model", code="model_not_found")
        request_id = make_request_id(request, id_prefix)
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
            max_tokens = [resolve_max_tokens(req.worker_max_tokens, default_max_tokens, len(p), max_len,
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
        state.metrics.rejected(_REJECT_CODES.get(exc.code or "") or _REJECT_REASONS.get(exc.status, str(exc.status)))
        if queue_labels is not None:
            state.metrics.class_rejected.labels(state.served_model_name, *queue_labels).inc()
        exc.headers = {**rate_headers, **exc.headers}
        raise
    assert queue_labels is not None  # set before submit, which admitted the request
    state.metrics.class_admitted.labels(state.served_model_name, *queue_labels).inc()
    return Admitted(req, caller, request_id, prompts, params, gens, echoes, rate_headers)


async def handle_generate(state: GatewayState, request: Request, *, chat: bool) -> Response:
    """Serve ``POST /v1/completions`` (``chat=False``) or ``/v1/chat/completions``: one
    child request per prompt and choice (gateway/choices.py)."""
    try:
        admitted = await admit(state, request, _parse_chat if chat else _parse_completion,
                               id_prefix="chatcmpl-" if chat else "cmpl-")
    except OpenAIError as exc:
        return exc.response()
    req, request_id, prompts, params, gens = (admitted.req, admitted.request_id, admitted.prompts, admitted.params,
                                              admitted.gens)
    n, echoes, rate_headers = req.num_choices, admitted.echoes, admitted.rate_headers
    created_unix_s = int(time.time())
    num_top = params[0].logprobs
    choices = [Choice(gen, ResponseShape(request_id, state.served_model_name, created_unix_s, chat, index=k),
                      tool_calls=ToolCallStream(req.max_num_tool_calls, req.tool_format)
                      if isinstance(req, ChatCompletionRequest) and req.parses_tool_calls else None,
                      logprobs=None if num_top is None else LogprobsFormatter(state.tokenizer.tokenizer, num_top, chat),
                      echo=None if echoes is None else echoes[k // n], prompt_ids=prompts[k // n],
                      prompt_only=isinstance(req, CompletionRequest) and req.scores_prompt_only,
                      first_of_prompt=k % n == 0)
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
