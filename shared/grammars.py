"""One ``StructuredOutput`` as an llguidance grammar: the gateway validates it (400 for
what llguidance cannot enforce), the worker compiles it against the model's vocabulary.

llguidance (https://github.com/guidance-ai/llguidance) is the grammar engine: it has no
dependencies (xgrammar's metadata pulls triton), supports JSON Schema, regular
expressions and Lark grammars, and computes a token mask in tens of microseconds
(measured: docs/benchmarks.md, "Structured outputs").
"""

from __future__ import annotations

import json

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from shared.sampling import InvalidParameter, StructuredOutput

#: llguidance's JSON options: compact output (no free whitespace between tokens, which a
#: small model otherwise fills with newlines until max_tokens).
_JSON_DEFAULTS = {"whitespace_flexible": False}
#: Any JSON object, for ``response_format: {"type": "json_object"}``.
_ANY_OBJECT = {"type": "object"}


def grammar_for(structured: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) enforcing ``structured``.

    Raises:
        InvalidParameter: ``param`` ``response_format``: a spec that is not valid JSON
            where JSON is expected, or a ``choice`` list that is empty or not strings.
    """
    kind, spec = structured.kind, structured.spec
    if kind in ("json_schema", "json_object"):
        schema = _ANY_OBJECT if kind == "json_object" else _load(spec)
        if not isinstance(schema, (dict, bool)):
            raise InvalidParameter("response_format", "a JSON schema must be an object")
        if isinstance(schema, dict) and structured.strict:
            schema = {**schema, "x-guidance": {**_JSON_DEFAULTS, **schema.get("x-guidance", {})}}
        elif isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**_JSON_DEFAULTS, "lenient": True, **schema.get("x-guidance", {})}}
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = _load(spec)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise InvalidParameter("response_format", "choice must be a non-empty list of strings")
        pattern = "|".join(_regex_literal(c) for c in choices)
        return llguidance.LLMatcher.grammar_from_regex(f"({pattern})")
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec))
    raise InvalidParameter("response_format", f"unknown structured output kind {kind!r}")


def check(structured: StructuredOutput) -> None:
    """Build and validate the grammar without a tokenizer.

    Raises:
        InvalidParameter: the grammar cannot be built, or llguidance cannot enforce part
            of it (the message is llguidance's, naming the unsupported feature).
    """
    try:
        grammar = grammar_for(structured)
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
    except InvalidParameter:
        raise
    except Exception as exc:  # noqa: BLE001 - llguidance's GBNF converter raises a bare Exception
        error = str(exc)
    if error:
        raise InvalidParameter("response_format", f"unsupported {structured.kind}: {error}")


def _load(spec: str) -> object:
    try:
        return json.loads(spec)
    except json.JSONDecodeError as exc:
        raise InvalidParameter("response_format", f"not valid JSON: {exc}") from exc


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching exactly itself."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in text)
