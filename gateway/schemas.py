"""OpenAI request bodies (pydantic, validated from raw bytes so every failure becomes a
400 OpenAI error naming the field) and their conversion to ``SamplingParams``.

Unknown fields are ignored, as OpenAI-compatible servers do. Fields that inferq does
not implement yet (``logprobs``, ``echo``, ``n > 1``) are refused with a 400 rather than
silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import OpenAIError, validation_error
from shared.sampling import InvalidParameter, SamplingParams

#: Default ``max_tokens`` of /v1/completions (OpenAI's).
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: An integer that reaches the worker as is: msgspec (the wire) and torch (seeds) take 64 bits
#: at most, so a larger one must be a 400 here rather than an OverflowError (500) at the XADD.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints (OpenAI's plus vLLM's sampling extras)."""

    # JSON has no NaN or Infinity; pydantic would parse them, and the range checks of
    # ``SamplingParams.validate`` let an infinite penalty through to the sampler.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None

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
        """Refuse what inferq does not support.

        Raises:
            OpenAIError: 400 naming the field.
        """
        if self.n not in (None, 1):
            raise OpenAIError(400, "only n=1 is supported", param="n")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Build and validate the sampling parameters with the resolved ``max_tokens``.

        Raises:
            OpenAIError: 400 naming the first out-of-range field.
        """
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, -1),
            min_p=pick(self.min_p, 0.0),
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
        )
        try:
            params.validate()
        except InvalidParameter as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from exc
        return params


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None

    def check(self) -> None:
        """Refuse unsupported fields (400)."""
        self.check_common()
        if self.logprobs:
            raise OpenAIError(400, "logprobs is not supported yet", param="logprobs")
        if self.echo:
            raise OpenAIError(400, "echo is not supported yet", param="echo")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        batched = isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list))
        if batched and len(self.prompt) != 1:
            raise OpenAIError(400, "only one prompt per request is supported", param="prompt")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template expects it (text content only).

        Raises:
            OpenAIError: 400 for non-text content parts.
        """
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
        return message


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None

    def check(self) -> None:
        """Refuse unsupported fields and empty conversations (400)."""
        self.check_common()
        if self.logprobs:
            raise OpenAIError(400, "logprobs is not supported yet", param="logprobs")
        if not self.messages:
            raise OpenAIError(400, "messages must not be empty", param="messages")

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
