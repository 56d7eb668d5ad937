"""Text Generation Inference (TGI) request bodies and their translation into a
completions request, so that ``/generate``, ``/generate_stream`` and ``/`` run on the
completions pipeline (gateway/handlers.py, ``admit``): docs/operations.md, "Endpoints".

The bodies follow TGI's router (``GenerateRequest``, ``CompatGenerateRequest`` and
``GenerateParameters`` in its ``router/src/lib.rs``; the checks of
``router/src/validation.rs``): ``{"inputs": str, "parameters": {...}}``, unknown fields
ignored, as TGI's serde does. Types are strict (``"max_new_tokens": "8"`` is refused).

What maps onto ``SamplingParams`` maps one to one: ``max_new_tokens``, ``temperature``,
``top_p``, ``top_k``, ``repetition_penalty``, ``frequency_penalty``, ``seed``, ``stop``
(stop strings), ``grammar`` (a structured output). Greedy or sampled is TGI's rule: a
request samples when ``do_sample`` is true or it gives ``temperature``, ``top_k``,
``top_p`` or ``typical_p``; else it is greedy (temperature 0). A body without
``parameters`` samples (TGI's default parameters set ``do_sample``). What inferq lacks
is refused with a 422 naming the parameter, unless its value changes nothing:
``typical_p`` other than 1.0, ``watermark: true``, ``truncate``, ``best_of`` above 1,
``adapter_id``; ``decoder_input_details`` in a stream is refused as TGI refuses it.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from gateway.errors import OpenAIError, validation_error
from gateway.schemas import BODY_CONFIG, MAX_COMPLETION_LOGPROBS, CompletionRequest, parse_body
from gateway.structured import Constraint

#: The field that names a TGI request's structured output in errors.
GRAMMAR_PARAM = "grammar"
#: Most ``top_n_tokens`` (TGI's default ``--max-top-n-tokens``; also the completions
#: API's most ``logprobs``, which it becomes).
MAX_TOP_N_TOKENS = MAX_COMPLETION_LOGPROBS
#: A seed TGI accepts (u64) that also fits the wire and torch's generator (signed 64 bits).
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]

class TgiGrammar(BaseModel):
    """``parameters.grammar``: ``{"type": "json" | "json_object", "value": schema (an
    object or its JSON text)}``, ``{"type": "json_schema", "value": {"schema": ...,
    "name": ...}}`` or ``{"type": "regex", "value": pattern}``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["json", "json_object", "json_schema", "regex"]
    value: Any

    def constraint(self) -> Constraint:
        """The structured-output constraint (checked later, off the event loop).

        Raises:
            OpenAIError: 400 ``grammar`` for a value of the wrong shape.
        """
        if self.type == "regex":
            if not isinstance(self.value, str):
                raise OpenAIError(400, "grammar: a regex value must be a string", param=GRAMMAR_PARAM)
            return Constraint(GRAMMAR_PARAM, "regex", self.value)
        schema = self.value
        if self.type == "json_schema":
            if not isinstance(schema, dict) or "schema" not in schema:
                raise OpenAIError(400, 'grammar: a json_schema value is {"schema": {...}, "name": ...}',
                                  param=GRAMMAR_PARAM)
            schema = schema["schema"]
        if not isinstance(schema, dict | str):
            raise OpenAIError(400, "grammar: a json value is a JSON schema (an object, or its JSON text)",
                              param=GRAMMAR_PARAM)
        return Constraint(GRAMMAR_PARAM, "json_schema", schema)


class TgiParameters(BaseModel):
    """``parameters`` of a TGI body (TGI's ``GenerateParameters``; its defaults)."""

    model_config = BODY_CONFIG
    best_of: int | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: int | None = None
    return_full_text: bool | None = None
    stop: list[str] | None = None
    truncate: int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: Seed | None = None
    top_n_tokens: int | None = None
    grammar: TgiGrammar | None = None
    adapter_id: str | None = None

    @property
    def samples(self) -> bool:
        """TGI's rule: sampling when asked, or when any sampling parameter is given."""
        return self.do_sample or any(v is not None for v in (self.temperature, self.top_k, self.top_p,
                                                              self.typical_p))

    @property
    def wants_details(self) -> bool:
        """The response carries ``details`` (``decoder_input_details`` implies it, as in TGI)."""
        return self.details or self.decoder_input_details

    def check(self, stream: bool) -> None:
        """TGI's checks on the parameters, and a refusal of what inferq does not do.

        Raises:
            OpenAIError: 400 naming the parameter (answered as TGI's 422).
        """
        refusals: list[tuple[bool, str, str]] = [
            (self.best_of is not None and self.best_of < 1, "best_of", "`best_of` must be > 0"),
            ((self.best_of or 1) > 1, "best_of", "`best_of` > 1 is not supported: inferq returns one sequence"),
            (self.temperature is not None and self.temperature <= 0, "temperature",
             "`temperature` must be strictly positive (leave `do_sample` false and `temperature` out for greedy)"),
            (self.top_k is not None and self.top_k <= 0, "top_k", "`top_k` must be strictly positive"),
            (self.max_new_tokens is not None and self.max_new_tokens <= 0, "max_new_tokens",
             "`max_new_tokens` must be strictly positive"),
            (self.typical_p is not None and self.typical_p != 1.0, "typical_p",
             "`typical_p` is not supported (only 1.0, which keeps every token)"),
            (self.watermark, "watermark", "`watermark` is not supported"),
            (self.truncate is not None, "truncate", "`truncate` is not supported: send the inputs to keep"),
            (self.adapter_id is not None, "adapter_id", "`adapter_id` is not supported: inferq serves no adapters"),
            (self.top_n_tokens is not None and not 0 <= self.top_n_tokens <= MAX_TOP_N_TOKENS, "top_n_tokens",
             f"`top_n_tokens` must be >= 0 and <= {MAX_TOP_N_TOKENS}"),
            (stream and self.decoder_input_details, "decoder_input_details",
             "`decoder_input_details` == true is not supported when streaming tokens"),
        ]
        for refused, param, message in refusals:
            if refused:
                raise OpenAIError(400, message, param=param)


def _absent_parameters() -> TgiParameters:
    """TGI's parameters of a body without ``parameters``: as the defaults, but sampling."""
    return TgiParameters(do_sample=True)


class TgiGenerateRequest(BaseModel):
    """Body of ``POST /generate`` and ``POST /generate_stream``."""

    model_config = BODY_CONFIG
    inputs: str
    parameters: TgiParameters = Field(default_factory=_absent_parameters)


class TgiCompatRequest(TgiGenerateRequest):
    """Body of ``POST /`` (TGI's ``compat_generate``): ``stream`` picks the answer."""

    stream: bool = False


class TgiCompletionRequest(CompletionRequest):
    """The completions request a TGI body becomes: what ``admit`` runs. Adds the prompt
    logprobs of ``decoder_input_details`` (without ``echo``) and the ``grammar``
    constraint, named as TGI names it."""

    prompt_logprobs: int | None = None
    _grammar: TgiGrammar | None = PrivateAttr(None)

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def constraint(self) -> Constraint | None:
        return None if self._grammar is None else self._grammar.constraint()


def parse_tgi(body: bytes, *, compat: bool) -> TgiGenerateRequest:
    """Validate a TGI body (``compat``: ``POST /``'s, with ``stream``).

    Raises:
        OpenAIError: 400 for malformed JSON or the first invalid field (answered as 422).
    """
    return parse_body(TgiCompatRequest if compat else TgiGenerateRequest, body)  # type: ignore[no-any-return]


def to_completion(tgi: TgiGenerateRequest, model: str, *, stream: bool) -> TgiCompletionRequest:
    """The completions request of ``tgi`` for the served ``model``: one prompt, one
    choice; ``max_tokens`` None when ``max_new_tokens`` is not given (the caller fills
    the context, as TGI does); logprobs (``top_n_tokens`` alternatives) when the answer
    carries ``details``; a random seed when a request with ``details`` samples without one
    (TGI reports the seed it sampled with).

    Raises:
        OpenAIError: 400 naming the parameter (answered as TGI's 422).
    """
    p = tgi.parameters
    p.check(stream)
    if not tgi.inputs:
        raise OpenAIError(400, "`inputs` cannot be empty", param="inputs")
    samples = p.samples
    seed = p.seed
    if samples and seed is None and p.wants_details:
        seed = secrets.randbits(63)
    fields: dict[str, Any] = {
        "model": model, "prompt": tgi.inputs, "max_tokens": p.max_new_tokens, "stream": stream,
        "temperature": (1.0 if p.temperature is None else p.temperature) if samples else 0.0,
        "top_p": p.top_p, "top_k": p.top_k, "repetition_penalty": p.repetition_penalty,
        "frequency_penalty": p.frequency_penalty, "seed": seed if samples else None, "stop": p.stop,
        "logprobs": (p.top_n_tokens or 0) if p.wants_details else None,
        "prompt_logprobs": 0 if p.decoder_input_details else None,
    }
    try:
        req = TgiCompletionRequest.model_validate(fields)
    except pydantic.ValidationError as exc:  # not expected: every field was validated as TGI's
        raise validation_error(list(exc.errors(include_url=False))) from exc
    req._grammar = p.grammar
    return req


# -- answers, documented in the OpenAPI schema (gateway/tgi.py builds them) --------------

#: TGI's ``finish_reason``: ``length`` (``max_new_tokens`` or the context), ``eos_token``
#: (the model's end of sequence), ``stop_sequence`` (a ``stop`` string).
TgiFinishReason = Literal["length", "eos_token", "stop_sequence"]


class TgiToken(BaseModel):
    """A generated token: ``logprob`` null unless the request asked for ``details``;
    ``text`` empty for special tokens (gateway/tgi.py, ``TgiOutput``)."""

    id: int
    text: str
    logprob: float | None
    special: bool


class TgiPrefillToken(BaseModel):
    """A prompt token (``decoder_input_details``); the first has a null ``logprob``."""

    id: int
    text: str
    logprob: float | None


class TgiDetails(BaseModel):
    finish_reason: TgiFinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[TgiPrefillToken]
    tokens: list[TgiToken]
    top_tokens: list[list[TgiToken]] | None = None


class TgiGenerateResponse(BaseModel):
    """``POST /generate``'s body (``POST /`` answers a list of one)."""

    generated_text: str
    details: TgiDetails | None = None


class TgiStreamDetails(BaseModel):
    finish_reason: TgiFinishReason
    generated_tokens: int
    seed: int | None
    input_length: int


class TgiStreamResponse(BaseModel):
    """One event of ``POST /generate_stream``: a token; the last also has the whole
    ``generated_text`` and, when asked, ``details``."""

    index: int
    token: TgiToken
    top_tokens: list[TgiToken] | None = None
    generated_text: str | None
    details: TgiStreamDetails | None


class TgiErrorResponse(BaseModel):
    """Every non-2xx answer of the TGI routes, and a stream's error event."""

    error: str
    error_type: str


class TgiInfo(BaseModel):
    """``GET /info``: TGI's ``Info`` (what ``huggingface_hub``'s ``get_endpoint_info`` returns)."""

    model_id: str
    model_sha: str | None
    model_pipeline_tag: str | None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_input_length: int
    max_total_tokens: int
    validation_workers: int
    max_client_batch_size: int
    router: str
    version: str
    sha: str | None
    docker_label: str | None
