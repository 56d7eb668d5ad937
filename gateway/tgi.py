"""Text Generation Inference's routes on the gateway: ``POST /generate``,
``POST /generate_stream``, ``POST /`` (TGI's ``compat_generate``: the body's ``stream``
picks one of the other two) and ``GET /info`` (docs/operations.md, "Endpoints").

A TGI body becomes a completions request (gateway/tgi_schemas.py) that runs through
``admit`` (gateway/handlers.py): the same auth, tenants, rate limits, priority class
(``X-Priority``), admission, placement, failover, stop strings, detokenization and
metrics as ``/v1/completions``. Only the answers are TGI's:

- Errors: ``{"error": str, "error_type": str}`` with TGI's statuses (``tgi_error``).
  Refusals come before a stream starts, as a status (TGI answers a stream's validation
  error as an event of a 200; clients raise the same error for both); a failure once a
  stream runs is an error event that ends it. TGI sends no ``[DONE]``, nor does inferq.
- Tokens: ``TgiOutput``. ``POST /`` answers a list of one body, as TGI does, and returns
  the prompt with the text unless ``return_full_text`` is false (TGI's default for a
  text-generation model there); ``/generate`` returns it only when asked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Send

from gateway.choices import Choice
from gateway.errors import OpenAIError
from gateway.generation import ClientDisconnected, Generation
from gateway.handlers import admit, check_auth
from gateway.logprobs import TokenTexts, token_texts
from gateway.openapi import add_body_schemas, generation_extra
from gateway.output import Step
from gateway.responses import ResponseShape, sse_event
from gateway.schemas import MAX_NUM_PROMPTS, MAX_NUM_STOP_STRINGS
from gateway.sse import ChoicesStream
from gateway.state import GatewayState
from gateway.tenants import Caller
from gateway.tgi_schemas import (
    TgiCompatRequest,
    TgiCompletionRequest,
    TgiErrorResponse,
    TgiGenerateRequest,
    TgiGenerateResponse,
    TgiInfo,
    TgiParameters,
    parse_tgi,
    to_completion,
)
from gateway.tokenize import default_num_encode_threads
from shared.protocol import TokenLogprobs

log = logging.getLogger(__name__)

#: inferq's status of an error -> TGI's status and ``error_type`` (TGI's ``InferError``:
#: validation 422, overloaded 429, generation 424). Others keep their status, as "error".
_TGI_ERRORS: dict[int, tuple[int, str]] = {
    400: (422, "validation"), 404: (422, "validation"), 409: (409, "validation"), 413: (413, "validation"),
    401: (401, "authentication"), 429: (429, "overloaded"), 500: (424, "generation"),
    503: (503, "unavailable"), 504: (504, "timeout"),
}
#: Completions field names that the pipeline's errors use -> the TGI names they came from.
_TGI_PARAMS = {"prompt": "inputs", "max_tokens": "max_new_tokens", "logprobs": "top_n_tokens"}


def tgi_error_body(exc: OpenAIError) -> tuple[int, dict[str, str]]:
    """TGI's status and body for ``exc``: its message, led by the TGI name of the
    parameter when the message does not name it."""
    status, error_type = _TGI_ERRORS.get(exc.status, (exc.status, "error"))
    message = exc.message
    if exc.param is not None:
        param = _TGI_PARAMS.get(exc.param, exc.param)
        if param not in message:
            message = f"{param}: {message}"
    return status, {"error": message, "error_type": error_type}


def tgi_error(exc: OpenAIError) -> JSONResponse:
    """``exc`` as TGI's error response (its headers, e.g. ``Retry-After``, kept)."""
    status, body = tgi_error_body(exc)
    return JSONResponse(body, status_code=status, headers=exc.headers)


def tgi_finish_reason(gen: Generation) -> str:
    """TGI's ``finish_reason`` of a finished output."""
    if gen.stop_string is not None:
        return "stop_sequence"
    return "length" if gen.finish_reason == "length" else "eos_token"


_SPECIAL_IDS: dict[int, tuple[Any, frozenset[int]]] = {}


def special_ids(tokenizer: Any, eos_token_ids: frozenset[int] | set[int]) -> frozenset[int]:
    """The token ids TGI marks ``special``: the tokenizer's special tokens and EOS ids
    (memoised per tokenizer: a gateway process has one)."""
    found = _SPECIAL_IDS.get(id(tokenizer))
    if found is None or found[0] is not tokenizer:
        found = _SPECIAL_IDS[id(tokenizer)] = (tokenizer, frozenset(tokenizer.all_special_ids) | eos_token_ids)
    return found[1]


def split_texts(steps: Sequence[Step], ids: Sequence[int], special: frozenset[int]) -> list[str]:
    """Each consumed token's text (``ids``: at least one) from ``steps``: a step's text
    goes with its last token when the steps count their tokens (``Step.token_ids``, sent
    with logprobs) and the counts add up; else all of it goes with the last token that
    is not ``special`` (the last token when all are)."""
    texts = [""] * len(ids)
    counts = [len(s.token_ids) for s in steps]
    if sum(counts) != len(ids):
        last = next((k for k in range(len(ids) - 1, -1, -1) if ids[k] not in special), len(ids) - 1)
        texts[last] = "".join(s.text for s in steps)
        return texts
    last = -1
    for step, count in zip(steps, counts, strict=True):
        last += count
        texts[max(last, 0)] += step.text  # a step without tokens (the end) joins the one before
    return texts


@dataclass(slots=True)
class TgiOutput:
    """One TGI request's tokens and text, taken from its ``Generation`` batch by batch.

    Each output token the pipeline consumed (``Generation.output_ids`` up to
    ``num_output_tokens``) becomes ``{id, text, logprob, special}``. ``text`` is the text
    that became final with the token (``split_texts``), so the tokens' texts add up to
    the generated text. A special token (EOS) adds no text of its own (TGI's token shows
    its name, which ``generated_text`` leaves out). The stop sequence that ended the
    output ends both the last token's text and ``generated_text``, as in TGI.
    ``logprob`` and ``top_tokens`` (``top_n_tokens`` each) come when the request asked
    for details (the worker then sends logprobs); else ``logprob`` is null.
    """

    gen: Generation
    params: TgiParameters
    prefix: str  # the inputs, when the text is returned with them (return_full_text)
    num_prompt_tokens: int
    seed: int | None
    special: frozenset[int]
    texts: TokenTexts
    _num_taken: int = 0
    _index: int = 0
    _parts: list[str] = field(default_factory=list)
    _last: dict[str, Any] | None = None

    def take(self, steps: Sequence[Step]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """The TGI tokens (each with its top tokens) consumed since the last call, with
        ``steps`` the steps delivered since then."""
        gen = self.gen
        end = gen.num_output_tokens
        ids = gen.output_ids[self._num_taken:end]
        self._num_taken = end
        stop = gen.stop_string if any(s.stop_string is not None for s in steps) else None
        if not ids:
            text = "".join(s.text for s in steps) + (stop or "")
            self._parts.append(text)
            return []
        texts = split_texts(steps, ids, self.special)
        if stop is not None:
            texts[-1] += stop
        self._parts.extend(texts)
        logprobs: list[TokenLogprobs | None] = [lp for s in steps for lp in s.logprobs]
        if len(logprobs) != len(ids):  # none asked for (or sent)
            logprobs = [None] * len(ids)
        num_top = self.params.top_n_tokens or 0
        out = []
        for k, (token_id, lp) in enumerate(zip(ids, logprobs, strict=True)):
            token = {"id": token_id, "text": texts[k], "logprob": None if lp is None else lp.logprob,
                     "special": token_id in self.special}
            top = [] if lp is None or not num_top else [self._top(i, v) for i, v in lp.top[:num_top]]
            out.append((token, top))
        self._last = out[-1][0]
        return out

    def _top(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"id": token_id, "text": self.texts.get(token_id)[0], "logprob": logprob,
                "special": token_id in self.special}

    @property
    def generated_text(self) -> str:
        """The text taken so far (the whole text once the output is over)."""
        return self.prefix + "".join(self._parts)

    def stream_events(self, steps: Sequence[Step]) -> bytes:
        """The SSE events of the tokens in ``steps``: one per token; the last token's
        event also carries ``generated_text`` and ``details`` (when asked) once the output
        is over. An end without a new token repeats the last token with the text left."""
        tokens = self.take(steps)
        over = any(s.finish_reason is not None for s in steps)
        if over and not tokens:
            left = self._parts[-1] if self._parts else ""
            # No token at all cannot happen (max_tokens >= 1); an empty special token
            # would keep the event well-formed.
            last = self._last or {"id": min(self.special, default=0), "logprob": None, "special": True}
            tokens = [({**last, "text": left}, [])]
        events = []
        for k, (token, top) in enumerate(tokens):
            self._index += 1
            event: dict[str, Any] = {"index": self._index, "token": token}
            if top:
                event["top_tokens"] = top
            closing = over and k == len(tokens) - 1
            event["generated_text"] = self.generated_text if closing else None
            event["details"] = self._stream_details() if closing and self.params.details else None
            events.append(sse_event(event))
        return b"".join(events)

    def _stream_details(self) -> dict[str, Any]:
        return {"finish_reason": tgi_finish_reason(self.gen), "generated_tokens": self.gen.num_output_tokens,
                "seed": self.seed, "input_length": self.num_prompt_tokens}

    def body(self, steps: Sequence[Step], prefill: list[dict[str, Any]]) -> dict[str, Any]:
        """The answer to a request that does not stream, from all of its steps."""
        tokens = self.take(steps)
        body: dict[str, Any] = {"generated_text": self.generated_text}
        if self.params.wants_details:
            details = {"finish_reason": tgi_finish_reason(self.gen), "generated_tokens": self.gen.num_output_tokens,
                       "seed": self.seed, "prefill": prefill, "tokens": [t for t, _ in tokens]}
            if self.params.top_n_tokens:
                details["top_tokens"] = [top for _, top in tokens]
            body["details"] = details
        return body


def prefill_tokens(texts: TokenTexts, prompt_ids: Sequence[int],
                   prompt_logprobs: Sequence[TokenLogprobs] | None) -> list[dict[str, Any]]:
    """``details.prefill``: every prompt token, each shown alone (gateway/logprobs.py),
    with its logprob (``TokenOutput.prompt_logprobs``; the first token's is null: nothing
    predicts it). Logprobs are null when the worker sent none."""
    lps: list[float | None] = [None] * len(prompt_ids)
    if prompt_logprobs is not None and len(prompt_logprobs) == len(prompt_ids) - 1:
        lps[1:] = [lp.logprob for lp in prompt_logprobs]
    return [{"id": t, "text": texts.get(t)[0], "logprob": lp} for t, lp in zip(prompt_ids, lps, strict=True)]


@dataclass(slots=True)
class TgiChoice(Choice):
    """The one choice of a TGI stream: its events are ``TgiOutput``'s."""

    output: TgiOutput | None = None

    def step_events(self, steps: list[Step]) -> bytes:
        assert self.output is not None
        return self.output.stream_events(steps)


class TgiStream(ChoicesStream):
    """TGI's SSE stream of one choice: its token events, no ``[DONE]``, and a failure as
    TGI's error event (the disconnect watcher and the write loop are ``ChoicesStream``'s)."""

    def __init__(self, choice: TgiChoice, headers: dict[str, str]) -> None:
        super().__init__([choice], 0, False, headers)

    async def _write_events(self, send: Send) -> None:
        choice = self._choices[0]
        try:
            await self._write_one(choice, send)
            return
        except OpenAIError as exc:
            error = exc
        except Exception as exc:
            log.exception("stream of %s failed", choice.gen.request_id)
            error = OpenAIError(500, f"internal error: {type(exc).__name__}")
        choice.gen.fail(error)
        status_body = tgi_error_body(error)[1]
        await send({"type": "http.response.body", "body": sse_event(status_body), "more_body": True})


async def handle_tgi(state: GatewayState, request: Request, *, stream: bool | None) -> Response:
    """Serve ``POST /generate`` (``stream`` False), ``/generate_stream`` (True) or ``/``
    (None: the body's ``stream`` decides)."""
    parsed: list[TgiGenerateRequest] = []

    async def parse(_: Caller, body: bytes) -> TgiCompletionRequest:
        tgi = parse_tgi(body, compat=stream is None)
        parsed.append(tgi)
        streams = tgi.stream if isinstance(tgi, TgiCompatRequest) else bool(stream)
        return to_completion(tgi, state.served_model_name, stream=streams)

    try:
        admitted = await admit(state, request, parse, id_prefix="tgi-", batch_allowed=False, default_max_tokens=None)
    except OpenAIError as exc:
        return tgi_error(exc)
    tgi, req, gen = parsed[0], admitted.req, admitted.gens[0]
    full_text = tgi.parameters.return_full_text
    if full_text is None:
        full_text = stream is None  # TGI's compat route returns the prompt too for a text-generation model
    output = TgiOutput(gen, tgi.parameters, tgi.inputs if full_text else "", len(admitted.prompts[0]),
                       admitted.params[0].seed,  # None when greedy (to_completion)
                       special_ids(state.tokenizer.tokenizer, state.tokenizer.eos_token_ids),
                       token_texts(state.tokenizer.tokenizer))
    headers = {"X-Request-Id": admitted.request_id, **admitted.rate_headers}
    if req.stream:
        shape = ResponseShape(admitted.request_id, state.served_model_name, int(time.time()), chat=False)
        return TgiStream(TgiChoice(gen, shape, output=output),
                         {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        await gen.result()
        prefill = [] if not tgi.parameters.decoder_input_details else await state.tokenizer.run_blocking(
            prefill_tokens, output.texts, admitted.prompts[0], gen.prompt_logprobs, param="inputs",
            action="decoding")
    except OpenAIError as exc:
        gen.fail(exc)
        return tgi_error(exc)
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        gen.close()
    body = output.body(gen.take_steps(), prefill)
    headers.update({"x-prompt-tokens": str(output.num_prompt_tokens),
                    "x-generated-tokens": str(gen.num_output_tokens)})
    return JSONResponse([body] if stream is None else body, headers=headers)


def info(state: GatewayState) -> dict[str, Any]:
    """``GET /info``: TGI's ``Info`` of the served model and this gateway's limits."""
    max_model_len = state.max_model_len
    try:
        inferq_version = version("inferq")
    except PackageNotFoundError:  # run from a checkout that was never installed
        inferq_version = "unknown"
    return {"model_id": state.served_model_name, "model_sha": None, "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": state.settings.max_queue_len, "max_best_of": 1,
            "max_stop_sequences": MAX_NUM_STOP_STRINGS, "max_input_tokens": max_model_len - 1,
            "max_input_length": max_model_len - 1, "max_total_tokens": max_model_len,
            "validation_workers": state.settings.num_tokenizer_threads or default_num_encode_threads(),
            "max_client_batch_size": MAX_NUM_PROMPTS, "router": "inferq", "version": inferq_version,
            "sha": None, "docker_label": None}


def _tgi_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": TgiErrorResponse, "description": "TGI error (gateway/tgi.py, tgi_error)"} for s in statuses}


#: Every status a TGI generation route answers besides 200.
_GENERATION_ERRORS = _tgi_errors(401, 409, 413, 422, 424, 429, 503, 504)
#: One SSE event, as an OpenAPI schema (before OpenAPI 3.2, a stream's schema is one event's).
_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "A TgiStreamResponse, or a TgiErrorResponse (the last event)"}}}


def install_tgi_routes(app: FastAPI) -> None:
    """Add the TGI routes to ``app`` (its POSTs served directly when it is a
    ``gateway.app.GatewayApp``: ``serve_directly``) and their bodies to its OpenAPI schema."""

    def state_of(request: Request) -> GatewayState:
        return request.app.state.inferq  # type: ignore[no-any-return]

    @app.post("/generate", responses={200: {"model": TgiGenerateResponse}, **_GENERATION_ERRORS},
              openapi_extra=generation_extra(TgiGenerateRequest))
    async def tgi_generate(request: Request) -> Response:
        return await handle_tgi(state_of(request), request, stream=False)

    @app.post("/generate_stream", responses={200: {"description": "Server-Sent Events, one per token", "content": {
        "text/event-stream": {"schema": _EVENT}}}, **_GENERATION_ERRORS}, openapi_extra=generation_extra(TgiGenerateRequest))
    async def tgi_generate_stream(request: Request) -> Response:
        return await handle_tgi(state_of(request), request, stream=True)

    @app.post("/", responses={200: {"model": list[TgiGenerateResponse], "description": "A list of one answer, or "
                                    "(stream: true) Server-Sent Events", "content": {
                                        "text/event-stream": {"schema": _EVENT}}}, **_GENERATION_ERRORS},
              openapi_extra=generation_extra(TgiCompatRequest))
    async def tgi_compat_generate(request: Request) -> Response:
        return await handle_tgi(state_of(request), request, stream=None)

    serve_directly = getattr(app, "serve_directly", None)
    if serve_directly is not None:
        for path, endpoint in (("/generate", tgi_generate), ("/generate_stream", tgi_generate_stream),
                               ("/", tgi_compat_generate)):
            serve_directly(path, endpoint)

    @app.get("/info", responses={200: {"model": TgiInfo}, **_tgi_errors(401)})
    async def tgi_info(request: Request) -> Response:
        state = state_of(request)
        try:
            check_auth(state, request)
        except OpenAIError as exc:
            return tgi_error(exc)
        return JSONResponse(info(state))

    add_body_schemas(app, (TgiGenerateRequest, TgiCompatRequest))

