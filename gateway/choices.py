"""One client request's choices: fan-out into child requests and merge of their outputs
(docs/architecture.md, "Choices: n and prompt lists"), as vLLM v1's frontend does.

A request with P prompts (a /v1/completions prompt list; chat has one) and ``n`` choices
becomes P * n child requests, choice ``index = prompt_index * n + choice_index``. Each
child is an ordinary request on the wire (its own wire id, ``Generation``, stream entry
and output state: detokenizer, stop strings, tool-call parser, logprobs offsets); the
worker's prefix cache shares the prompt's KV blocks between siblings. With a ``seed``,
choice ``j`` of a prompt samples with ``seed + j`` (vLLM's rule), so the choices differ
and repeat; greedy choices are identical.

- Wire ids: one child keeps the request's wire id; several get ``<wire id>-<k>``. A
  client's ``X-Request-Id`` stays reserved (gateway/request_ids.py) until the last child
  closes.
- Admission is all or nothing: one atomic Redis step checks the queue depth, counting
  every child, and XADDs them all or none (``admission.Enqueuer``), to the stream of the
  request's priority class and tenant (``shared/fair_queue.py``).
- Response: one body, choices in index order; ``usage`` counts each prompt's tokens once
  and every child's output tokens (``usage_of``, the one place a response's usage is
  counted). ``cached_tokens`` counts each prompt once too: the prefix-cache hit of its
  first choice (``Choice.first_of_prompt``); its siblings share the blocks it computed or
  found, and their own hits are not added. A stream merges the children's steps as they arrive,
  each chunk with its choice's index (gateway/sse.py); an error in any child ends the
  stream (error event, ``[DONE]``), and every child closes (aborted if its worker still
  runs it).
- ``echo`` (completions): each choice's text starts with its prompt's text; with
  ``logprobs``, the prompt tokens' logprobs (``TokenOutput.prompt_logprobs``) come first.
  ``echo`` with ``max_tokens: 0`` (``Choice.prompt_only``): the worker runs one step
  (``PROMPT_ONLY_MAX_TOKENS``) and the choice drops its output token: text and logprobs
  are the prompt's, ``completion_tokens`` 0, ``finish_reason`` "length".
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gateway.errors import OpenAIError
from gateway.generation import ClientDisconnected, Generation
from gateway.logprobs import LogprobsFormatter, join_completion_logprobs
from gateway.output import OutputProcessor, Step
from gateway.request_ids import releasing, wire_request_id
from gateway.responses import ResponseShape, usage
from gateway.state import GatewayState
from gateway.tool_parser import ToolCallStream, parse_tool_calls
from shared.fair_queue import DEFAULT_CLASS, class_rank
from shared.keys import ANONYMOUS_TENANT
from shared.protocol import GenerateRequest
from shared.sampling import SamplingParams
from shared.token_ids import TokenIds

log = logging.getLogger(__name__)

#: How long a request waits for the relay's subscription before a 503, s.
RELAY_READY_TIMEOUT_S = 1.0


def child_params(params: SamplingParams, choice_index: int) -> SamplingParams:
    """The sampling parameters of choice ``choice_index`` of a prompt: ``seed +
    choice_index`` when seeded (vLLM's rule), else ``params`` itself."""
    if params.seed is None or choice_index == 0:
        return params
    return msgspec.structs.replace(params, seed=params.seed + choice_index)


async def submit(state: GatewayState, request: Request, request_id: str, prompts: Sequence[list[int]],
                 params: Sequence[SamplingParams], n: int, stops: list[str], arrival_s: float, *,
                 poll_disconnect: bool, priority_class: str = DEFAULT_CLASS,
                 tenant: str = ANONYMOUS_TENANT, id_scope: str = ANONYMOUS_TENANT,
                 session: str = "", constraint_param: str | None = None) -> list[Generation]:
    """Admit and enqueue the ``len(prompts) * n`` children of one request (``params[p]``
    for prompt ``p``), all or none; returns their ``Generation``s in choice-index order,
    each registered in the relay (which owns it) before the XADD, so no reply can be
    missed. A client's ``X-Request-Id`` travels with a random suffix
    (``gateway/request_ids.py``); ``Generation.request_id`` is a child's wire id. The
    children go to the stream of (``priority_class``, ``tenant``), or to the placed
    stream of the worker that placement chooses (``gateway/placement.py``; ``session``:
    the request's session id for affinity, "" none). ``id_scope``: the
    caller's key tenant, whose ids the client's id is unique among. ``constraint_param``:
    the field of its structured-output constraint (``Generation.constraint_param``).

    Raises:
        OpenAIError: 409 duplicate request id, 429 queue full (counting every child),
            503 Redis or relay down or Redis refusing the write. Nothing stays registered
            or enqueued then.
    """
    if not await state.relay.wait_ready(RELAY_READY_TIMEOUT_S):
        raise OpenAIError(503, "not subscribed to the reply channel (Redis unavailable)", code="redis_unavailable")
    num_children = len(prompts) * n
    client_id = request.headers.get("x-request-id") is not None
    id_key = state.keys.request_id_key(state.served_model_name, id_scope, request_id) if client_id else None
    wire_id = wire_request_id(request_id, client_id)
    child_ids = [wire_id] if num_children == 1 else [f"{wire_id}-{k}" for k in range(num_children)]
    deadline_s = arrival_s + state.settings.request_timeout_s
    on_close = _on_close(state, id_key, wire_id, num_children)
    tok = state.tokenizer
    now_unix_s = time.time()
    deadline_unix_s = now_unix_s + (deadline_s - time.monotonic())
    rank = class_rank(priority_class)
    stream = state.queue.stream(priority_class, tenant)
    gens, messages = [], []
    # Each prompt's ids as queued (int32 bytes, encoded once: the entries and the
    # placement hashes share them).
    queued_ids = [TokenIds.of(p) for p in prompts]
    for k, child_id in enumerate(child_ids):
        prompt_ids, sampling = prompts[k // n], child_params(params[k // n], k % n)
        processor = OutputProcessor(tok.tokenizer, prompt_ids, stops, tok.eos_token_ids | set(sampling.stop_token_ids))
        gens.append(Generation(request_id=child_id, processor=processor, arrival_s=arrival_s, deadline_s=deadline_s,
                               on_close=on_close, is_disconnected=request.is_disconnected if poll_disconnect else None,
                               constraint_param=constraint_param))
        messages.append(GenerateRequest(
            request_id=child_id, model=state.served_model_name, prompt_token_ids=queued_ids[k // n], sampling=sampling,
            reply_channel=state.relay.channel, deadline_unix_s=deadline_unix_s, attempt=0, created_unix_s=now_unix_s,
            priority=rank, tenant=tenant))
    _register(state, gens)
    placer = state.enqueuer.placer
    # Children of several prompts go to one stream in one script: placed by the first prompt.
    query = placer.query(queued_ids[0], session) if placer is not None else None
    try:
        enqueued = await state.enqueuer.enqueue(stream, messages, id_key, wire_id,
                                                math.ceil(state.settings.request_timeout_s), query=query)
    except BaseException:
        for gen in gens:
            state.relay.unregister(gen.request_id)
        raise
    state.metrics.prompt_tokens.labels(state.served_model_name).inc(sum(len(p) for p in prompts))
    state.metrics.requests_in_flight.labels(state.served_model_name).inc(num_children)
    state.metrics.placed(enqueued.decision, num_children)
    for gen, message, entry_id in zip(gens, messages, enqueued.entry_ids, strict=True):
        gen.submitted(message, entry_id, enqueued.stream, class_stream=stream)
    return gens


def _register(state: GatewayState, gens: list[Generation]) -> None:
    """Register every child, or none. Raises OpenAIError 409 for an id in flight."""
    for i, gen in enumerate(gens):
        try:
            state.relay.register(gen)
        except KeyError:
            for done in gens[:i]:  # not gens[i]: that id belongs to the request in flight
                state.relay.unregister(done.request_id)
            raise OpenAIError(409, f"request {gen.request_id} is already in flight", param="X-Request-Id",
                              code="duplicate_request") from None


def _on_close(state: GatewayState, id_key: str | None, wire_id: str,
              num_children: int) -> Callable[[Generation], None]:
    """Every child's ``Generation.on_close``: ``state.release``, and once the last child
    closed, the client's id freed (``releasing``)."""
    last = state.release if id_key is None else releasing(state, id_key, wire_id)
    if num_children == 1:
        return last
    num_open = [num_children]

    def on_close(gen: Generation) -> None:
        num_open[0] -= 1
        (last if num_open[0] == 0 else state.release)(gen)

    return on_close


@dataclass(slots=True)
class Choice:
    """One choice of a response: its child request and its own output formatting state.

    ``echo``: the prompt text that the choice's text starts with (completions ``echo``),
    None once sent or when not asked; ``prompt_ids``: its prompt (for echoed logprobs);
    ``prompt_only``: echo with ``max_tokens: 0``, so every output token the worker sends
    (it runs one step to score the prompt) is dropped: no text, no logprobs, not counted,
    and the choice ends with "length". ``first_of_prompt``: the first choice of its prompt
    (choice index ``prompt_index * n``), whose prefix-cache hit ``usage_of`` counts.
    """

    gen: Generation
    shape: ResponseShape
    tool_calls: ToolCallStream | None = None
    logprobs: LogprobsFormatter | None = None
    echo: str | None = None
    prompt_ids: Sequence[int] = ()
    prompt_only: bool = False
    first_of_prompt: bool = True

    @property
    def num_output_tokens(self) -> int:
        """This choice's ``completion_tokens`` (0 when it scores its prompt only)."""
        return 0 if self.prompt_only else self.gen.num_output_tokens

    def _take_echo(self) -> tuple[str, dict[str, Any] | None]:
        """The echoed prompt's text and logprobs (formatted first, so the output's
        ``text_offset`` counts on from it), once; then ``("", None)``."""
        if self.echo is None:
            return "", None
        text, self.echo = self.echo, None
        prompt_logprobs = self.gen.prompt_logprobs
        if self.logprobs is None or prompt_logprobs is None:
            return text, None
        return text, self.logprobs.format_prompt(self.prompt_ids, prompt_logprobs)

    def body_choice(self, text: str) -> dict[str, Any]:
        """This choice of the non-streaming body, from its whole output ``text``."""
        gen = self.gen
        if self.prompt_only:
            echo, echo_logprobs = self._take_echo()
            return self.shape.choice(echo, "length", None, echo_logprobs)
        content: str | None = text
        calls: list[dict[str, Any]] = []
        if self.tool_calls is not None:
            content, calls = parse_tool_calls(text, self.tool_calls.max_num_calls, self.tool_calls.tool_format)
        echo, echo_logprobs = self._take_echo()
        logprobs = None if self.logprobs is None else self.logprobs.format(*gen.output_logprobs())
        if echo_logprobs is not None:
            logprobs = join_completion_logprobs(echo_logprobs, logprobs)
        return self.shape.choice(echo + content if content is not None else content,
                                 _finish_reason(gen.finish_reason, bool(calls)), calls, logprobs)

    def step_events(self, steps: list[Step]) -> bytes:
        """The SSE events of steps of this choice: chunks as text becomes final (each with
        the logprobs of its tokens when asked; not beside tool-call parsing; the echoed
        prompt before the first), then its finish_reason chunk."""
        if self.logprobs is None and self.echo is None and self.tool_calls is None and not self.prompt_only:
            chunk_event = self.shape.chunk_event  # the common case: text chunks only
            return b"".join([chunk_event(s.text, s.finish_reason) for s in steps])
        if self.tool_calls is not None:
            return b"".join([_tool_step_events(self.shape, self.tool_calls, s.text, s.finish_reason) for s in steps])
        if self.prompt_only:
            return self._prompt_only_events(steps)
        out = []
        for s in steps:
            echo, echo_logprobs = self._take_echo()
            logprobs = self.logprobs.format(s.token_ids, s.logprobs) if self.logprobs is not None and s.logprobs \
                else None
            if echo_logprobs is not None:
                logprobs = join_completion_logprobs(echo_logprobs, logprobs)
            out.append(self.shape.chunk_event(echo + s.text if echo else s.text, s.finish_reason, logprobs))
        return b"".join(out)

    def _prompt_only_events(self, steps: list[Step]) -> bytes:
        """``step_events`` of a ``prompt_only`` choice: the echoed prompt (with its
        logprobs when asked) once, then the "length" chunk when the output is over; the
        steps' own text and logprobs are dropped."""
        out = []
        if self.echo is not None:
            echo, echo_logprobs = self._take_echo()
            out.append(self.shape.chunk_event(echo, None, echo_logprobs))
        if any(s.finish_reason is not None for s in steps):
            out.append(self.shape.chunk_event("", "length"))
        return b"".join(out)


def close_all(choices: list[Choice]) -> None:
    """Close every child (unregister, abort where its worker still runs it). Idempotent."""
    for c in choices:
        c.gen.close()


def fail_siblings(choices: list[Choice], error: OpenAIError) -> None:
    """One child failed: the others end with the same error (so their aborts and
    metrics say why)."""
    for c in choices:
        c.gen.fail(error)


def num_output_tokens(choices: list[Choice]) -> int:
    """``completion_tokens``: output tokens of every child (``Choice.num_output_tokens``)."""
    return sum(c.num_output_tokens for c in choices)


def usage_of(choices: list[Choice], num_prompt_tokens: int) -> dict[str, Any]:
    """The ``usage`` of a response (a body's, or a stream's last chunk): ``num_prompt_tokens``
    (each prompt once), every child's output tokens, and ``cached_tokens``, the prefix-cache
    hit of each prompt's first choice (``Generation.num_cached_tokens``), summed over prompts."""
    num_cached = sum(c.gen.num_cached_tokens for c in choices if c.first_of_prompt)
    return usage(num_prompt_tokens, num_output_tokens(choices), num_cached)


async def full_response(choices: list[Choice], num_prompt_tokens: int, headers: dict[str, str]) -> Response:
    """Wait for every child's whole output and answer one JSON body, choices in index
    order (or the first error: 499 when the client left)."""
    try:
        texts = await _results(choices)
    except OpenAIError as exc:
        fail_siblings(choices, exc)
        return exc.response()
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        close_all(choices)
    body = choices[0].shape.body([c.body_choice(t) for c, t in zip(choices, texts, strict=True)],
                                 usage_of(choices, num_prompt_tokens))
    return JSONResponse(body, headers=headers)


async def _results(choices: list[Choice]) -> list[str]:
    """Every child's text, in order; raises the first error as soon as it happens."""
    if len(choices) == 1:
        return [await choices[0].gen.result()]
    tasks = [asyncio.ensure_future(c.gen.result()) for c in choices]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()


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
