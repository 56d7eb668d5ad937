"""The two generation endpoints: validate, tokenize, admit, enqueue, then answer with
one JSON body or an SSE stream (docs/architecture.md, "One request, step by step").

Order of checks, cheap before expensive: auth (401), body size (413), body (400: types,
list limits, tool fields, at most one structured-output constraint), model (404),
X-Request-Id (400), prompt characters (400, before tokenizing), tokenizing (503 past its
time budget), prompt tokens (400), the structured output's grammar (400, on the encode pool:
gateway/structured.py), sampling parameters (400), relay subscribed (503), queue depth
(429/503), XADD (503). docs/operations.md, "Limits", lists every limit.
"""

from __future__ import annotations

import hmac
import logging
import math
import re
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.admission import check_queue, enqueue
from gateway.errors import OpenAIError
from gateway.generation import ClientDisconnected, Generation
from gateway.logprobs import LogprobsFormatter
from gateway.output import OutputProcessor
from gateway.request_ids import releasing, wire_request_id
from gateway.responses import DONE_EVENT, ResponseShape, sse_event, usage
from gateway.schemas import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    REQUEST_ID_PATTERN,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from gateway.state import GatewayState
from gateway.tokenize import check_prompt_tokens
from gateway.tool_parser import ToolCallStream, parse_tool_calls
from gateway.tools import template_messages, template_renders_tools
from shared.protocol import GenerateRequest
from shared.sampling import SamplingParams

log = logging.getLogger(__name__)

#: How long a request waits for the relay's subscription before a 503, s.
RELAY_READY_TIMEOUT_S = 1.0
_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)
_REJECT_REASONS = {400: "invalid_request", 401: "unauthorized", 404: "unknown_model", 409: "duplicate_request",
                   413: "body_too_large", 429: "queue_full", 503: "unavailable"}


def check_auth(state: GatewayState, request: Request) -> None:
    """Raises OpenAIError 401 unless the bearer token is one of ``api_keys`` (no keys: open).

    Compares UTF-8 bytes in constant time (``hmac.compare_digest`` raises TypeError on a
    ``str`` with non-ASCII characters); a missing, malformed or non-ASCII credential is a
    401, never a 500.
    """
    keys = state.settings.api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    given = token.encode("utf-8", "surrogateescape")
    valid = scheme.lower() == "bearer" and token.isascii() and token != ""
    # Every key is compared, so the time does not say which one nearly matched.
    matches = [hmac.compare_digest(given, k.encode("utf-8", "surrogateescape")) for k in keys]
    if not (valid and any(matches)):
        raise OpenAIError(401, "invalid or missing API key", code="invalid_api_key")


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
    """Serve ``POST /v1/completions`` (``chat=False``) or ``/v1/chat/completions``."""
    arrival_s = time.monotonic()
    try:
        check_auth(state, request)
        body = await read_body(request, state.settings.max_body_bytes)
        req: CompletionRequest | ChatCompletionRequest = parse_body(
            ChatCompletionRequest if chat else CompletionRequest, body)
        req.check()
        if req.model != state.served_model_name:
            raise OpenAIError(404, f"the model {req.model!r} does not exist", param="model", code="model_not_found")
        request_id = make_request_id(request, "chatcmpl-" if chat else "cmpl-")
        max_len = state.max_model_len
        tool_calls: ToolCallStream | None = None  # the output's tool-call parser (gateway/tool_parser.py)
        if isinstance(req, ChatCompletionRequest):
            renders_tools = template_renders_tools(getattr(state.tokenizer.tokenizer, "chat_template", None))
            messages, tools = template_messages([m.to_template() for m in req.messages], req.template_tools(),
                                                renders_tools)
            prompt_ids = await state.tokenizer.chat_prompt(messages, max_len, tools=tools)
            tool_calls = ToolCallStream(req.max_num_tool_calls) if req.parses_tool_calls else None
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            max_tokens = resolve_max_tokens(req.requested_max_tokens, None, len(prompt_ids), max_len,
                                            "messages", param)
        else:
            prompt_ids = await state.tokenizer.completion_prompt(req.prompt, max_len)
            max_tokens = resolve_max_tokens(req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, len(prompt_ids),
                                            max_len, "prompt", "max_tokens")
        constraint = req.constraint()
        structured = None if constraint is None else await state.tokenizer.run_blocking(
            constraint.build, param=constraint.param, action="checking", code="structured_output_timeout")
        params = req.sampling_params(max_tokens, vocab_size=state.tokenizer.vocab_size, structured=structured)
        gen = await submit(state, request, request_id, prompt_ids, params, req.stop_strings, arrival_s,
                           poll_disconnect=not req.stream)
    except OpenAIError as exc:
        state.metrics.rejected(_REJECT_REASONS.get(exc.status, str(exc.status)))
        return exc.response()
    shape = ResponseShape(request_id, state.served_model_name, int(time.time()), chat)
    headers = {"X-Request-Id": request_id}
    logprobs = None if params.logprobs is None else LogprobsFormatter(state.tokenizer.tokenizer, params.logprobs, chat)
    if req.stream:
        return GenerationStream(gen, stream_events(gen, shape, len(prompt_ids), req.include_usage, tool_calls,
                                                   logprobs),
                                media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await full_response(gen, shape, len(prompt_ids), headers, tool_calls, logprobs)


class GenerationStream(StreamingResponse):
    """A streaming response that always closes its generation, even when the client
    leaves before the body iterator starts (then its ``finally`` never runs)."""

    def __init__(self, gen: Generation, content: AsyncIterator[bytes], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._gen = gen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.close()


async def submit(state: GatewayState, request: Request, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, stops: list[str], arrival_s: float, *, poll_disconnect: bool) -> Generation:
    """Admit and enqueue one request; returns its ``Generation`` (registered in the
    relay, which owns it, before the XADD, so no reply can be missed). A client's
    ``X-Request-Id`` is reserved until the request ends and travels with a random suffix
    (``gateway/request_ids.py``); ``Generation.request_id`` is that wire id.

    Raises:
        OpenAIError: 409 duplicate request id, 429 queue full, 503 Redis or relay down.
    """
    if not await state.relay.wait_ready(RELAY_READY_TIMEOUT_S):
        raise OpenAIError(503, "not subscribed to the reply channel (Redis unavailable)", code="redis_unavailable")
    await check_queue(state.redis, state.stream, state.settings.max_queue_len)
    client_id = request.headers.get("x-request-id") is not None
    id_key = state.keys.request_id_key(request_id) if client_id else None
    request_id = wire_request_id(request_id, client_id)
    deadline_s = arrival_s + state.settings.request_timeout_s
    processor = OutputProcessor(state.tokenizer.tokenizer, prompt_ids, stops,
                                state.tokenizer.eos_token_ids | set(params.stop_token_ids))
    gen = Generation(request_id=request_id, processor=processor, arrival_s=arrival_s, deadline_s=deadline_s,
                     on_close=state.release if id_key is None else releasing(state, id_key, request_id),
                     is_disconnected=request.is_disconnected if poll_disconnect else None)
    try:
        state.relay.register(gen)
    except KeyError:
        raise OpenAIError(409, f"request {request_id} is already in flight", param="X-Request-Id",
                          code="duplicate_request") from None
    now_unix_s = time.time()
    message = GenerateRequest(
        request_id=request_id, model=state.served_model_name, prompt_token_ids=prompt_ids, sampling=params,
        reply_channel=state.relay.channel, deadline_unix_s=now_unix_s + (deadline_s - time.monotonic()),
        attempt=0, created_unix_s=now_unix_s)
    try:
        entry_id = await enqueue(state.redis, state.stream, message, id_key, math.ceil(state.settings.request_timeout_s))
    except BaseException:
        state.relay.unregister(request_id)
        raise
    state.metrics.prompt_tokens.labels(state.served_model_name).inc(len(prompt_ids))
    state.metrics.requests_in_flight.labels(state.served_model_name).inc()
    gen.submitted(message, entry_id)
    return gen


async def full_response(gen: Generation, shape: ResponseShape, num_prompt_tokens: int,
                        headers: dict[str, str], tool_calls: ToolCallStream | None = None,
                        logprobs: LogprobsFormatter | None = None) -> Response:
    """Wait for the whole output and answer one JSON body (or the error); with
    ``tool_calls``, the text is parsed into ``tool_calls`` and content; with
    ``logprobs``, every output token's logprobs."""
    try:
        text = await gen.result()
    except OpenAIError as exc:
        return exc.response()
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        gen.close()
    content: str | None = text
    calls: list[dict[str, Any]] = []
    if tool_calls is not None:
        content, calls = parse_tool_calls(text, tool_calls.max_num_calls)
    body = shape.body(content, _finish_reason(gen.finish_reason, bool(calls)),
                      usage(num_prompt_tokens, gen.num_output_tokens), calls,
                      None if logprobs is None else logprobs.format(*gen.output_logprobs()))
    return JSONResponse(body, headers=headers)


def _finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """``tool_calls`` for an output that ended by itself after calling a tool (vLLM's rule)."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def _tool_step_events(shape: ResponseShape, calls: ToolCallStream, text: str, finish_reason: str | None) -> bytes:
    """The SSE events of one step when its text is parsed for tool calls: content and
    tool-call deltas as they become known, then the finish_reason chunk."""
    events = calls.feed(text)
    if finish_reason is not None:
        events += calls.finish()
    out = [shape.chunk_event(e) if isinstance(e, str) else shape.delta_event({"tool_calls": [e]}) for e in events]
    if finish_reason is not None:
        out.append(shape.chunk_event("", _finish_reason(finish_reason, calls.num_calls > 0)))
    return b"".join(out)


async def stream_events(gen: Generation, shape: ResponseShape, num_prompt_tokens: int,
                        include_usage: bool, tool_calls: ToolCallStream | None = None,
                        logprobs: LogprobsFormatter | None = None) -> AsyncIterator[bytes]:
    """SSE body: chunks as text becomes final (each with the logprobs of its tokens when
    asked; not beside tool-call parsing), the finish_reason chunk, the usage chunk
    when asked, then ``[DONE]``. Steps that arrived while the previous write was under
    way go out in one write, one event each. An error mid-stream is an
    ``{"error": ...}`` event then ``[DONE]``. Cancellation (client gone) closes the
    generation, which aborts it."""
    try:
        first = shape.first_chunk()
        if first is not None:
            yield sse_event(first)
        async for steps in gen.updates():
            if tool_calls is None:
                yield b"".join([shape.chunk_event(s.text, s.finish_reason, logprobs.format(s.token_ids, s.logprobs)
                                                  if logprobs is not None and s.logprobs else None) for s in steps])
            else:
                yield b"".join([_tool_step_events(shape, tool_calls, s.text, s.finish_reason) for s in steps])
        usage_event = b""
        if include_usage:
            usage_event = sse_event(shape.usage_chunk(usage(num_prompt_tokens, gen.num_output_tokens)))
        yield usage_event + DONE_EVENT
    except OpenAIError as exc:
        yield sse_event(exc.body())
        yield DONE_EVENT
    except Exception as exc:
        log.exception("stream of %s failed", gen.request_id)
        gen.error = OpenAIError(500, f"internal error: {type(exc).__name__}")
        yield sse_event(gen.error.body())
        yield DONE_EVENT
    finally:
        gen.close()
