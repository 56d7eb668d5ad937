"""Sampling parameters of one request, shared by the gateway (validation), the wire
protocol (transport) and the engine (sampling)."""

from __future__ import annotations

from typing import Literal

import msgspec

#: What a structured output is constrained by (docs/operations.md, "Structured outputs").
StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
#: Largest ``logit_bias`` magnitude (OpenAI's range is [-100, 100]).
MAX_LOGIT_BIAS = 100.0
#: Most top alternatives ``logprobs`` may ask for per token (OpenAI's ``top_logprobs``).
MAX_LOGPROBS = 20


class InvalidParameter(ValueError):
    """A sampling parameter is out of range; ``param`` names it (OpenAI ``param`` field)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on the output text, enforced token by token with a grammar mask.

    ``spec`` by ``kind``: ``json_schema``, the schema as canonical JSON text (sorted
    keys, so equal schemas share one compiled grammar); ``json_object``, empty (any JSON
    object); ``regex``, the pattern; ``choice``, a JSON list of the allowed strings;
    ``grammar``, a GBNF (llama.cpp, vLLM) or llguidance Lark grammar. ``strict``
    forbids object properties the schema does not name, in every object that lists
    ``properties`` (or ``patternProperties``) and says nothing of ``additionalProperties``
    (OpenAI's ``strict: true`` requires ``additionalProperties: false`` there); either way
    the output matches the schema (``shared.grammars.close_objects``).
    """

    kind: StructuredKind
    spec: str = ""
    strict: bool = True


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick each next token and when to stop.

    Semantics follow the OpenAI API and vLLM's ``SamplingParams``: ``temperature == 0``
    means greedy; ``top_k <= 0`` (or ``-1``) disables top-k; ``top_p == 1`` and
    ``min_p == 0`` disable nucleus and min-p filtering. ``seed`` makes a sampled request
    reproducible on its own. ``stop_token_ids`` end the request like EOS does (the
    stop token is included in the output ids and, like EOS, hidden from the text).
    Stop *strings* are applied by the gateway, which owns detokenization.
    ``logit_bias`` is ``(token_id, bias)`` pairs, sorted by id, each added to that token's
    logit before penalties and sampling (OpenAI's ``logit_bias``: -100 bans, +100 forces).
    ``logprobs``: ``None``, none; ``k``, each output token's log-probability and those of
    the ``k`` most likely tokens (0: the sampled token's only), of the raw model
    distribution (docs/operations.md, "Logprobs"). ``prompt_logprobs`` (vLLM's field):
    ``None``, none; ``k``, the same for every prompt token after the first (the
    completions API's ``echo`` with ``logprobs``); such a request bypasses the prefix
    cache, since a cached block has no logits.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    structured: StructuredOutput | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def validate(self) -> None:
        """Check every field.

        Raises:
            InvalidParameter: naming the first field that is out of range.
        """
        checks: list[tuple[bool, str, str]] = [
            (self.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1"),
            (0.0 <= self.temperature <= 2.0, "temperature", "temperature must be in [0, 2]"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 0, "top_k", "top_k must be -1 (off) or >= 0"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be >= 0"),
            (self.min_tokens <= self.max_tokens, "min_tokens", "min_tokens must be <= max_tokens"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "repetition_penalty must be > 0"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "stop_token_ids must be >= 0"),
            (all(t >= 0 and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in self.logit_bias), "logit_bias",
             f"logit_bias maps token ids >= 0 to biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidParameter(param, message)

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        """True when any repetition, presence or frequency penalty is active."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
