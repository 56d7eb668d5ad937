"""OpenAI request bodies (pydantic, validated from raw bytes so every failure becomes a
400 OpenAI error naming the field) and their conversion to ``SamplingParams``.

Types are strict, as OpenAI's are: ``"stream": "yes"``, ``"max_tokens": "16"`` and
``"prompt": [true, 2]`` are refused rather than coerced (JSON integers are accepted for
float fields). Unknown fields are ignored, as OpenAI-compatible servers do (the
structured-output objects of gateway/structured.py refuse them). Fields that inferq does
not implement (``suffix``) are refused with a 400 rather than silently ignored. List fields are bounded (``MAX_NUM_*`` below; the character bound of
prompts is in gateway/tokenize.py); docs/operations.md lists every limit.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import OpenAIError, validation_error
from gateway.structured import Constraint, StructuredFields
from gateway.tools import ToolCall, ToolFields
from shared.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, InvalidParameter, SamplingParams, StructuredOutput

#: Default ``max_tokens`` of /v1/completions: OpenAI's, which ``SamplingParams`` also uses.
DEFAULT_COMPLETION_MAX_TOKENS = SamplingParams().max_tokens
#: Most stop strings per request (OpenAI's limit).
MAX_NUM_STOP_STRINGS = 4
#: Longest stop string, characters: while streaming, the last ``len(longest stop) - 1``
#: characters are held back (gateway/stop.py), so a long one delays the whole stream.
MAX_STOP_STRING_CHARS = 1000
#: Most ``stop_token_ids`` per request (every worker step checks them).
MAX_NUM_STOP_TOKEN_IDS = 256
#: Most chat messages per request (each is converted and templated on the CPU).
MAX_NUM_MESSAGES = 2048
#: Most ``logit_bias`` entries per request (every worker step adds them to the logits).
MAX_NUM_LOGIT_BIAS = 1024
#: Most choices per prompt (``n``): each is a child request with its own KV blocks past
#: the shared prompt (gateway/choices.py).
MAX_N = 16
#: Most prompts in one /v1/completions request (a list of strings or of token-id lists).
MAX_NUM_PROMPTS = 32
#: Most choices in one response, prompts * ``n``: the child requests one request enqueues.
MAX_NUM_CHOICES = 64
#: Most ``logprobs`` alternatives of ``/v1/completions`` (OpenAI's limit; chat allows ``MAX_LOGPROBS``).
MAX_COMPLETION_LOGPROBS = 5
#: ``max_tokens`` sent to the worker for ``echo`` with ``max_tokens: 0`` (scoring a prompt
#: only, as vLLM allows): the engine needs one step to score the prompt and sends the prompt
#: logprobs with its first output token, which the gateway then discards (gateway/choices.py).
PROMPT_ONLY_MAX_TOKENS = 1
#: ``X-Request-Id``: matched whole (``re.fullmatch``; a pattern ending in ``$`` would also
#: match before a trailing newline). The OpenAPI schema anchors it with ``^...$``.
REQUEST_ID_PATTERN = r"[A-Za-z0-9._:\-]{1,128}"
#: An integer that reaches the worker as is: msgspec (the wire) and torch (seeds) take 64 bits
#: at most, so a larger one must be a 400 here rather than an OverflowError (500) at the XADD.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
#: Every body model: strict types, unknown fields ignored.
_STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = False


#: The bodies' parsing: strict types, unknown fields ignored. JSON has no NaN or Infinity;
#: pydantic would parse them, and the range checks of ``SamplingParams.validate`` let an
#: infinite penalty through to the sampler.
BODY_CONFIG = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class SamplingKnobs(BaseModel):
    """The sampling fields that ``/v1/completions``, chat and ``/v1/generate``
    (gateway/generate_api.py) take alike, with the tenant (``user``) and the priority
    class; each maps onto ``SamplingParams`` (``_SamplingFields.sampling_params``)."""

    model_config = BODY_CONFIG

    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # names the tenant with --tenant-source user (gateway/tenants.py)
    priority: int | None = None  # vLLM's field: <0 interactive, 0 default, >0 batch (gateway/priority.py)


class _SamplingFields(StructuredFields, SamplingKnobs):
    """Fields shared by both OpenAI endpoints: ``SamplingKnobs``, OpenAI's and vLLM's
    other sampling fields, and the structured-output fields of gateway/structured.py."""

    model_config = BODY_CONFIG

    model: str
    max_tokens: int | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list of non-empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        """True when a streamed response must end with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_common(self) -> None:
        """Refuse what inferq does not support, lists over their limits and more than one
        structured-output constraint (cheap checks; the grammar is checked later, off the
        event loop: gateway/structured.py).

        Raises:
            OpenAIError: 400 naming the field.
        """
        self.constraint()
        if self.logit_bias is not None and len(self.logit_bias) > MAX_NUM_LOGIT_BIAS:
            raise OpenAIError(400, f"logit_bias takes at most {MAX_NUM_LOGIT_BIAS} tokens, got "
                              f"{len(self.logit_bias)}", param="logit_bias")
        if not 1 <= self.num_choices <= MAX_N:
            raise OpenAIError(400, f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        if self.seed is not None and self.seed + self.num_choices - 1 > 2**63 - 1:
            raise OpenAIError(400, "seed + n - 1 must fit 64 bits (choice k is sampled with seed + k)",
                              param="seed")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_NUM_STOP_STRINGS:
            raise OpenAIError(400, f"stop takes at most {MAX_NUM_STOP_STRINGS} strings, got {len(stops)}",
                              param="stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise OpenAIError(400, f"a stop string is {longest} characters; at most {MAX_STOP_STRING_CHARS} "
                              "are allowed", param="stop")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_NUM_STOP_TOKEN_IDS:
            raise OpenAIError(400, f"stop_token_ids takes at most {MAX_NUM_STOP_TOKEN_IDS} ids, got "
                              f"{len(self.stop_token_ids)}", param="stop_token_ids")

    @property
    def num_choices(self) -> int:
        """``n``: choices per prompt (null: 1)."""
        return 1 if self.n is None else self.n

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per output token to return (``SamplingParams.logprobs``);
        None: no logprobs."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top alternatives per prompt token to return (``SamplingParams.prompt_logprobs``);
        None: none."""
        return None

    def sampling_params(self, max_tokens: int, *, vocab_size: int | None = None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """Build and validate the sampling parameters with the resolved ``max_tokens`` and
        the already checked ``structured`` output (``Constraint.build``); fields the
        request leaves out (or sets to null) keep ``SamplingParams``' defaults.
        ``logit_bias`` token ids must be below ``vocab_size`` (None: not checked).

        Raises:
            OpenAIError: 400 naming the first out-of-range field.
        """
        given = {name: getattr(self, name) for name in _OPTIONAL_SAMPLING_FIELDS}
        params = SamplingParams(
            max_tokens=max_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            structured=structured,
            logit_bias=self._logit_bias(vocab_size),
            logprobs=self.num_logprobs,
            prompt_logprobs=self.num_prompt_logprobs,
            **{name: value for name, value in given.items() if value is not None},
        )
        try:
            params.validate()
        except InvalidParameter as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from exc
        return params

    def _logit_bias(self, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as sorted ``(token_id, bias)`` pairs (JSON keys are strings).

        Raises:
            OpenAIError: 400 ``logit_bias``: a key that is not a token id (decimal, below
                ``vocab_size``) or names one twice.
        """
        pairs: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            token_id = int(key) if key.isascii() and key.isdigit() and len(key) < 20 else -1
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size) or token_id in pairs:
                where = "" if vocab_size is None else f" in [0, {vocab_size})"
                raise OpenAIError(400, f"logit_bias: {key[:40]!r} is not a token id{where}, or a repeated one",
                                  param="logit_bias")
            pairs[token_id] = float(bias)
        return tuple(sorted(pairs.items()))


#: Request fields that map one to one onto ``SamplingParams`` fields, None meaning "default".
_OPTIONAL_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                             "presence_penalty", "frequency_penalty")


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None

    def check(self) -> None:
        """Refuse unsupported fields and lists over their limits (400)."""
        self.check_common()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise OpenAIError(400, f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}]", param="logprobs")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        if self.scores_prompt_only and self.min_tokens > 0:
            raise OpenAIError(400, "min_tokens must be 0 with max_tokens 0", param="min_tokens")
        num_prompts = len(self.prompts)
        if num_prompts > MAX_NUM_PROMPTS:
            raise OpenAIError(400, f"prompt takes at most {MAX_NUM_PROMPTS} prompts, got {num_prompts}",
                              param="prompt")
        if num_prompts * self.num_choices > MAX_NUM_CHOICES:
            raise OpenAIError(400, f"{num_prompts} prompts x n={self.num_choices} is {num_prompts * self.num_choices}"
                              f" choices; at most {MAX_NUM_CHOICES} are allowed", param="n")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts: ``prompt`` as a list of strings or token-id lists (a string or a
        token-id list alone is one prompt; an empty list stays one, empty, prompt)."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    @property
    def scores_prompt_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the choices are the prompts (and their logprobs)
        alone, no output (``max_tokens: 0`` without ``echo`` stays a 400)."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def worker_max_tokens(self) -> int | None:
        """The ``max_tokens`` to resolve and send: ``PROMPT_ONLY_MAX_TOKENS`` when
        scoring the prompt only, else ``max_tokens`` as given (None: the default)."""
        return PROMPT_ONLY_MAX_TOKENS if self.scores_prompt_only else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """``logprobs`` with ``echo`` (the prompt's logprobs are echoed too, as vLLM does)."""
        return self.logprobs if self.echo else None


class ContentPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages only (required there)

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template expects it (text content only; an assistant's
        ``tool_calls`` with their arguments as JSON values, as vLLM passes them).

        Raises:
            OpenAIError: 400 for non-text content parts, ``tool_calls`` outside an
                assistant message, a tool message without ``tool_call_id``, arguments
                that are not JSON.
        """
        if self.tool_calls is not None and self.role != "assistant":
            raise OpenAIError(400, f"messages: tool_calls is only for assistant messages, not {self.role}",
                              param="messages")
        if self.role == "tool" and not self.tool_call_id:
            raise OpenAIError(400, "messages: a tool message needs its tool_call_id", param="messages")
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise OpenAIError(400, f"content part of type {part.type!r} is not supported", param="messages")
                texts.append(part.text)
            content = "".join(texts)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.arguments_value()}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(ToolFields, _SamplingFields):
    """Body of ``POST /v1/chat/completions`` (tool fields: gateway/tools.py)."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None

    def check(self) -> None:
        """Refuse unsupported fields, lists over their limits and empty or too long
        conversations (400)."""
        self.check_tools()
        self.check_common()
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise OpenAIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if not self.messages:
            raise OpenAIError(400, "messages must not be empty", param="messages")
        if len(self.messages) > MAX_NUM_MESSAGES:
            raise OpenAIError(400, f"messages takes at most {MAX_NUM_MESSAGES} messages, got {len(self.messages)}",
                              param="messages")

    def constraint(self) -> Constraint | None:
        """The structured-output constraint, or the grammar that forces a tool call
        (``tool_choice`` ``required`` or a named function; gateway/tools.py).

        Raises:
            OpenAIError: 400 when both are asked for, or as ``StructuredFields.constraint``.
        """
        constraint, forcing = super().constraint(), self.tool_constraint()
        if constraint is not None and forcing is not None:
            raise OpenAIError(400, f"{constraint.param} cannot be combined with tool_choice "
                              f"{self.effective_tool_choice!r}, which constrains the output to a tool call",
                              param="tool_choice")
        return forcing or constraint

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (preferred) or the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_body(model: type[pydantic.BaseModel], body: bytes) -> Any:
    """Validate a JSON body as ``model``.

    Raises:
        OpenAIError: 400 for malformed JSON or the first invalid field.
    """
    if not body.strip():
        raise OpenAIError(400, "request body is empty")
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        errors = exc.errors(include_url=False)
        if errors and errors[0].get("type") == "json_invalid":
            raise OpenAIError(400, f"invalid JSON: {errors[0].get('msg')}") from exc
        raise validation_error(list(errors)) from exc
