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
(llguidance, no tokenizer). That is up to 0.3 s of CPU for a large schema, so the handler
runs it on the encode pool (``TokenizerWorker.run_blocking``), never on the event loop;
an unsupported keyword, a bad regex or grammar is a 400 naming the field that carried it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import OpenAIError
from shared import grammars
from shared.sampling import InvalidParameter, StructuredKind, StructuredOutput

#: Sub-objects of a request: strict types, unknown fields refused.
_CLOSED = ConfigDict(extra="forbid", strict=True)


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

    def build(self) -> StructuredOutput:
        """The ``StructuredOutput``, checked by llguidance. Blocking (see the module
        docstring): call it off the event loop.

        Raises:
            OpenAIError: 400 naming ``param``: not valid JSON, or a schema, regex or
                grammar llguidance cannot enforce (its message names the feature).
        """
        try:
            structured = StructuredOutput(kind=self.kind, spec=self._spec(), strict=self.strict)
            grammars.check(structured, self.param)
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
