"""Structured outputs at the gateway: the request fields that ask for one, and their
conversion to the ``StructuredOutput`` that travels in ``SamplingParams.structured``
(docs/operations.md, "Structured outputs").

Ways of asking, in both endpoints, streaming or not:

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type":
  "json_object"}``, ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}``;
- vLLM's ``guided_json`` (a schema, or its JSON text), ``guided_regex``, ``guided_choice``
  and ``guided_grammar`` (GBNF or Lark), and the newer ``structured_outputs: {"json" |
  "regex" | "choice" | "grammar" | "json_object": ...}``.

At most one constraint per request (400 otherwise). ``strict`` comes from
``json_schema.strict`` (OpenAI's default: false) or ``structured_outputs
.disable_additional_properties``; the schema is enforced either way (shared/grammars.py
says what ``strict`` adds). Request models forbid unknown fields, unlike the bodies: a
misspelt ``"shema"`` must not drop the constraint silently.

Converting is ``Constraint.build``: the schema as canonical JSON (sorted keys, compact, so
equal schemas share one compiled grammar on the worker), then ``shared.grammars.check``
with the model's vocabulary (``GrammarChecker``): the matcher the worker will build, under
the same limits, probed by a short walk from its start (shared/grammar_check.py). That is
about 10 ms of CPU for a typical schema and 0.9 s for a 300 KB one, so the handler runs it
on the encode pool (``TokenizerWorker.run_blocking``, within its time budget), never on
the event loop; an unsupported keyword, a bad regex or grammar, one that hits llguidance's
limits, or one that matches nothing is a 400 naming the field that carried it. Verdicts,
good and bad, are remembered by the spec's hash (``MAX_NUM_CHECKED_SPECS``), so a
repeated constraint costs a dictionary lookup; a check that overran the time budget
still finishes in the background and leaves its verdict for the next request.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import llguidance
import pydantic_core
from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import OpenAIError
from shared import grammars
from shared.sampling import InvalidParameter, StructuredKind, StructuredOutput

#: Sub-objects of a request: strict types, unknown fields refused.
_CLOSED = ConfigDict(extra="forbid", strict=True)
#: Checked specs remembered per tokenizer (their SHA-256 and llguidance's verdict, about
#: 150 bytes each): a service's schemas and tools, and a burst of distinct bad ones.
MAX_NUM_CHECKED_SPECS = 4096


class ModelTokenizer(Protocol):
    """What the checker needs of the gateway's tokenizer (``gateway.tokenize.TokenizerWorker``)."""

    tokenizer: Any
    vocab_size: int
    eos_token_ids: AbstractSet[int]


class GrammarChecker:
    """``shared.grammars.check`` over one model's vocabulary, with its verdicts cached.

    The llguidance tokenizer is built on the first check (about 0.5 s for SmolLM2's 49k
    tokens), once. Thread-safe: checks run on the encode pool's threads.
    """

    def __init__(self, model: ModelTokenizer, max_num_specs: int = MAX_NUM_CHECKED_SPECS) -> None:
        # What the tokenizer is built from; not ``model`` itself, which keys ``_CHECKERS``.
        self._hf_tokenizer = model.tokenizer
        self._vocab_size = model.vocab_size
        self._eos_token_ids = sorted(model.eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._verdicts: OrderedDict[bytes, str] = OrderedDict()  # spec hash -> "" (good) or the error
        self._lock = threading.Lock()
        self.max_num_specs = max_num_specs
        self.num_checked = 0  # specs compiled and probed (cache misses)

    def check(self, structured: StructuredOutput, param: str) -> None:
        """Refuse what the worker could not enforce (``shared.grammars.check``). Blocking.

        Raises:
            InvalidParameter: naming ``param``, as ``shared.grammars.check``.
        """
        key = hashlib.sha256(_spec_key(structured)).digest()
        with self._lock:
            verdict = self._verdicts.get(key)
            if verdict is not None:
                self._verdicts.move_to_end(key)
        if verdict is None:
            try:
                grammars.check(structured, param, self.tokenizer())
                verdict = ""
            except InvalidParameter as exc:
                verdict = str(exc)
            with self._lock:
                self.num_checked += 1
                self._verdicts[key] = verdict
                if len(self._verdicts) > self.max_num_specs:
                    self._verdicts.popitem(last=False)
        if verdict:
            raise InvalidParameter(param, verdict)

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the model's tokenizer (as the worker's:
        worker/structured/tokenizer.py), built on first use."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self._vocab_size,
                                                               eos_token=self._eos_token_ids or None)
            return self._tokenizer


#: One checker per tokenizer (``checker_for``), dropped with it.
_CHECKERS: weakref.WeakKeyDictionary[Any, GrammarChecker] = weakref.WeakKeyDictionary()
_CHECKERS_LOCK = threading.Lock()


def checker_for(model: ModelTokenizer) -> GrammarChecker:
    """The ``GrammarChecker`` of ``model``'s vocabulary, made on first use."""
    with _CHECKERS_LOCK:
        checker = _CHECKERS.get(model)
        if checker is None:
            checker = _CHECKERS[model] = GrammarChecker(model)
        return checker


def _spec_key(structured: StructuredOutput) -> bytes:
    """The bytes that identify a spec: kind, strictness and spec text."""
    return f"{structured.kind}\0{int(structured.strict)}\0".encode() + structured.spec.encode("utf-8", "surrogatepass")


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema`` (OpenAI)."""

    model_config = _CLOSED
    name: str
    description: str | None = None
    # ``schema`` would shadow a BaseModel attribute; the JSON key is still "schema".
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = _CLOSED
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs`` (``vllm.sampling_params.StructuredOutputsParams``);
    ``whitespace_pattern`` and ``structural_tag`` are refused, ``disable_any_whitespace``
    is what inferq always does (compact JSON)."""

    model_config = _CLOSED
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


@dataclass(frozen=True, slots=True)
class Constraint:
    """One requested constraint, not yet converted: ``param`` is the request field that
    carried it (named in errors); ``value`` is the schema (dict or JSON text), the
    pattern, the choices or the grammar."""

    param: str
    kind: StructuredKind
    value: Any
    strict: bool = False

    def build(self, model: ModelTokenizer | None = None) -> StructuredOutput:
        """The ``StructuredOutput``, checked by llguidance over ``model``'s vocabulary
        (``checker_for``; None: the grammar alone, without the probe). Blocking (see the
        module docstring): call it off the event loop.

        Raises:
            OpenAIError: 400 naming ``param``: not valid JSON, or a schema, regex or
                grammar llguidance cannot enforce (its message names the feature or the
                limit), or one that matches no text.
        """
        try:
            structured = StructuredOutput(kind=self.kind, spec=self._spec(), strict=self.strict)
            if model is None:
                grammars.check(structured, self.param)
            else:
                checker_for(model).check(structured, self.param)
        except InvalidParameter as exc:
            raise OpenAIError(400, f"{exc.param}: {exc}", param=exc.param) from exc
        return structured

    def _spec(self) -> str:
        if self.kind == "json_schema":
            schema = self.value
            if isinstance(schema, str):
                try:  # pydantic's parser: the same nesting limit as the body's
                    schema = pydantic_core.from_json(schema)
                except ValueError as exc:
                    raise InvalidParameter(self.param, f"not valid JSON: {exc}") from exc
            if not isinstance(schema, dict):
                raise InvalidParameter(self.param, "a JSON schema must be an object")
            return canonical_json(schema)
        if self.kind == "choice":
            return canonical_json(self.value)
        return "" if self.kind == "json_object" else str(self.value)


def canonical_json(value: Any) -> str:
    """``value`` as JSON text with sorted keys and no whitespace: equal values, equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class StructuredFields(BaseModel):
    """The request fields that ask for a structured output (mixed into both bodies)."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def constraint(self) -> Constraint | None:
        """The one constraint the request asks for (None: free text). Cheap: no grammar work.

        Raises:
            OpenAIError: 400 when more than one is given, or one is malformed.
        """
        found = [c for c in (_from_response_format(self.response_format), *self._guided(),
                             _from_structured_outputs(self.structured_outputs)) if c is not None]
        if len(found) > 1:
            raise OpenAIError(400, "at most one structured output constraint per request; got "
                              + ", ".join(c.param for c in found), param=found[1].param)
        return found[0] if found else None

    def _guided(self) -> list[Constraint | None]:
        return [None if self.guided_json is None else Constraint("guided_json", "json_schema", self.guided_json),
                None if self.guided_regex is None else Constraint("guided_regex", "regex", self.guided_regex),
                None if self.guided_choice is None else Constraint("guided_choice", "choice", self.guided_choice),
                None if self.guided_grammar is None else Constraint("guided_grammar", "grammar", self.guided_grammar)]


def _from_response_format(fmt: ResponseFormat | None) -> Constraint | None:
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise OpenAIError(400, "response_format: json_schema is only for type json_schema",
                              param="response_format")
        return None
    if fmt.type == "json_object":
        if fmt.json_schema is not None:
            raise OpenAIError(400, "response_format: json_schema is only for type json_schema",
                              param="response_format")
        return Constraint("response_format", "json_object", None)
    if fmt.json_schema is None:
        raise OpenAIError(400, "response_format: type json_schema needs a json_schema object",
                          param="response_format")
    return Constraint("response_format", "json_schema", fmt.json_schema.schema_, bool(fmt.json_schema.strict))


def _from_structured_outputs(so: StructuredOutputsParams | None) -> Constraint | None:
    if so is None:
        return None
    param = "structured_outputs"
    for name in ("whitespace_pattern", "structural_tag"):
        if getattr(so, name) is not None:
            raise OpenAIError(400, f"structured_outputs.{name} is not supported", param=param)
    found = [c for c in (
        None if so.json_ is None else Constraint(param, "json_schema", so.json_, so.disable_additional_properties),
        None if so.regex is None else Constraint(param, "regex", so.regex),
        None if so.choice is None else Constraint(param, "choice", so.choice),
        None if so.grammar is None else Constraint(param, "grammar", so.grammar),
        Constraint(param, "json_object", None) if so.json_object else None,
    ) if c is not None]
    if len(found) != 1:
        raise OpenAIError(400, f"structured_outputs must name exactly one of json, regex, choice, grammar, "
                          f"json_object; got {len(found)}", param=param)
    return found[0]
