"""One ``StructuredOutput`` as an llguidance grammar: the gateway checks it (400 for
what llguidance cannot enforce: ``check``), the worker compiles it against the model's
vocabulary (``compile_matcher``), both under the same limits and probes
(shared/grammar_check.py).

llguidance (https://github.com/guidance-ai/llguidance) is the grammar engine: it has no
dependencies (xgrammar's metadata pulls triton), supports JSON Schema, regular
expressions and Lark grammars, and computes a token mask in tens of microseconds
(measured: docs/benchmarks.md, "Structured outputs").

Nothing is enforced loosely: llguidance's ``lenient`` option (ignore keywords it does not
implement) stays off, so ``uniqueItems``, ``not``, ``if``/``then``, ``contains`` and the
like are errors that name the keyword, never a grammar weaker than the schema.

JSON outputs (``json_schema``, ``json_object``) also get a digit cap on their numbers
(``NUMBER_CAP_REGEX``, docs/operations.md, "Structured outputs"). A JSON schema bounds a
number's value, never its text: ``{"minimum": 0, "maximum": 1}`` still allows
``0.000...`` forever, and a small model can keep emitting digits until ``max_tokens``
cuts the JSON open. llguidance has no option for this, and a ``multipleOf`` rewrite
would lose the negative numbers (llguidance < 1.8 matches ``multipleOf`` without a sign;
vLLM pins < 1.8). So the worker intersects the schema's grammar with this second, regular
grammar; where the schema itself needs a longer number the intersection is empty and the
schema's mask is used alone (worker/structured/bitmask.py), so no schema becomes
unsatisfiable.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from shared.grammar_check import (
    MAX_NUM_PROBE_CHOICES,
    embedded_schemas,
    parser_limits,
    short_error,
    start_error,
    unsatisfiable_refs,
)
from shared.sampling import InvalidParameter, StructuredOutput

#: llguidance's JSON options, which replace any the schema sets (``x-guidance``): compact
#: output (no free whitespace between tokens, which a small model otherwise fills with
#: newlines until max_tokens), and no keyword silently ignored.
_JSON_OPTIONS = {"whitespace_flexible": False, "lenient": False, "coerce_one_of": False}
#: Any JSON object, for ``response_format: {"type": "json_object"}``.
_ANY_OBJECT = {"type": "object"}
#: JSON Schema keywords whose value is a map of subschemas, a list of them, or one.
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties")

#: The digit caps of a number in a JSON output: every 64-bit integer fits (20 digits), and
#: so do the 17 significant digits that round-trip any float64 (``0.30000000000000004``).
MAX_NUMBER_INTEGER_DIGITS = 20
MAX_NUMBER_FRACTION_DIGITS = 20
MAX_NUMBER_EXPONENT_DIGITS = 3
_NUMBER = (rf"-?(0|[1-9][0-9]{{0,{MAX_NUMBER_INTEGER_DIGITS - 1}}})(\.[0-9]{{1,{MAX_NUMBER_FRACTION_DIGITS}}})?"
           rf"([eE][+-]?[0-9]{{1,{MAX_NUMBER_EXPONENT_DIGITS}}})?")
#: JSON text whose numbers keep the caps above; loose everywhere else (the schema's grammar
#: is the judge of the rest): strings with any escapes, any character that cannot start a
#: number, and numbers, each followed by a character that ends a number in JSON (so two
#: capped numbers cannot join into one long one) or by the end of the text.
NUMBER_CAP_REGEX = (rf'("([^"\\]|\\(?s:.))*"|[^"0-9\-]|{_NUMBER}[,:}}\]\x20\t\n\r])*({_NUMBER})?')


def grammar_for(structured: StructuredOutput, param: str = "response_format") -> str:
    """The llguidance grammar (its JSON form) enforcing ``structured``; not yet checked
    (``check`` does that).

    Args:
        param: the request field that carried the constraint, for errors.

    Raises:
        InvalidParameter: naming ``param``: a spec that is not valid JSON where JSON is
            expected, a schema that is not an object, or a ``choice`` list that is empty
            or not strings.
    """
    kind, spec = structured.kind, structured.spec
    if kind in ("json_schema", "json_object"):
        schema = _ANY_OBJECT if kind == "json_object" else _load(spec, param)
        if not isinstance(schema, dict):
            raise InvalidParameter(param, "a JSON schema must be an object")
        schema = {k: v for k, v in schema.items() if k != "x-guidance"}
        if structured.strict:
            schema = close_objects(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = _load(spec, param)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise InvalidParameter(param, "choice must be a non-empty list of strings")
        pattern = "|".join(_regex_literal(c) for c in choices)
        return llguidance.LLMatcher.grammar_from_regex(f"({pattern})")
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec))
    raise InvalidParameter(param, f"unknown structured output kind {kind!r}")


def caps_numbers(structured: StructuredOutput) -> bool:
    """Whether the output is JSON, whose numbers ``number_cap_grammar`` caps; regexes and
    grammars are the user's own text, and keep exactly their language."""
    return structured.kind in ("json_schema", "json_object")


@cache
def number_cap_grammar() -> str:
    """The llguidance grammar (its JSON form) of ``NUMBER_CAP_REGEX``."""
    return llguidance.LLMatcher.grammar_from_regex(NUMBER_CAP_REGEX)


def check(structured: StructuredOutput, param: str = "response_format",
          tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """Refuse what cannot be enforced: the grammar is built and validated, its JSON
    schemas (its own, or those a Lark grammar embeds with ``%json``) checked for ``$ref``
    recursion that no finite value ends (``shared.grammar_check.unsatisfiable_refs``),
    and, with the model's ``tokenizer``, a matcher built and probed as the worker would
    (``compile_matcher``). Blocking, on a 2-core CPU: without a tokenizer about 1 ms for a
    typical schema, 0.2-0.3 s for a 300 KB one (llguidance refuses larger ones as "schema
    too large"); with one about 10 ms, 0.9 s for 300 KB; llguidance releases the GIL
    meanwhile.

    Args:
        param: the request field that carried the constraint, named in the error.

    Raises:
        InvalidParameter: naming ``param``: the grammar cannot be built, llguidance
            cannot enforce part of it (its message names the keyword or the
            regex/grammar error, or the limit it hit), or its language is empty.
    """
    if tokenizer is not None:
        compile_matcher(structured, tokenizer, param)
        return
    grammar = _checked_grammar(structured, param)
    error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
    if error:
        raise InvalidParameter(param, f"unsupported {structured.kind}: {short_error(error)}")


def compile_matcher(structured: StructuredOutput, tokenizer: llguidance.LLTokenizer,
                    param: str = "response_format",
                    max_num_choices: int = MAX_NUM_PROBE_CHOICES) -> llguidance.LLMatcher:
    """The matcher of ``structured`` over ``tokenizer``'s vocabulary in its start state,
    built under ``parser_limits`` and probed (``start_error`` with ``max_num_choices``,
    on a deep copy) before it is returned. Blocking: see ``check``; the probe takes about
    10 ms of it with 16 choices, 0.1-3 ms with none.

    Raises:
        InvalidParameter: naming ``param``, as ``check``.
    """
    grammar = _checked_grammar(structured, param)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    eos = frozenset(tokenizer.eos_tokens)
    error = start_error(matcher.deep_copy(), eos, max_num_choices)
    if structured.kind == "grammar":  # each embedded schema on its own: one good alternative hides a bad one
        for schema in embedded_schemas(structured.spec):
            if error or not isinstance(schema, dict):
                break
            error = start_error(llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema)), log_level=0, limits=parser_limits()), eos, max_num_choices)
            error = error and f"its %json schema {_truncated(schema)}: {error}"
    if error == "matches no text":
        raise InvalidParameter(param, f"the {structured.kind} {_EMPTY[structured.kind]}")
    if error:
        raise InvalidParameter(param, f"unsupported {structured.kind}: {error}")
    return matcher


#: How an empty language reads, per kind of constraint.
_EMPTY = {"json_schema": "has no instance: no JSON value satisfies it", "json_object": "matches no text",
          "regex": "matches no text", "choice": "matches no text", "grammar": "matches no text"}


def _checked_grammar(structured: StructuredOutput, param: str) -> str:
    """``grammar_for(structured)`` after the schema-level checks; what llguidance's GBNF
    converter raises becomes ``InvalidParameter``."""
    try:
        grammar = grammar_for(structured, param)
    except InvalidParameter:
        raise
    except Exception as exc:  # llguidance's GBNF converter raises a bare Exception
        raise InvalidParameter(param, f"unsupported {structured.kind}: {str(exc) or type(exc).__name__}") from exc
    if structured.kind == "json_schema":
        schemas = [_load(structured.spec, param)]
    elif structured.kind == "grammar":
        schemas = embedded_schemas(structured.spec)
    else:
        schemas = []
    for schema in schemas:
        refs = unsatisfiable_refs(schema)
        if refs:
            what = "the schema" if structured.kind == "json_schema" else f"its %json schema {_truncated(schema)}"
            verb = "refers back to itself" if len(refs) == 1 else "refer back to themselves"
            raise InvalidParameter(param, f"no finite JSON value satisfies {what}: {', '.join(map(repr, refs[:5]))} "
                                   f"{verb} (through $ref, allOf, required properties or minItems) with no way out")
    return grammar


def close_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` in every object schema that lists
    ``properties`` or ``patternProperties`` and says nothing of ``additionalProperties``,
    at any depth: what ``strict`` adds (the same rule as vLLM's
    ``disable_additional_properties``). Returns a new schema; ``schema`` is unchanged."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(sub) for sub in out[key]]
    for key in _SUBSCHEMAS:
        if key in out:
            sub = out[key]
            out[key] = [close_objects(s) for s in sub] if isinstance(sub, list) else close_objects(sub)
    listed = isinstance(out.get("properties"), dict) or isinstance(out.get("patternProperties"), dict)
    if listed and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _truncated(value: Any, max_num_chars: int = 80) -> str:
    text = json.dumps(value)
    return text if len(text) <= max_num_chars else text[:max_num_chars - 3] + "..."


def _load(spec: str, param: str) -> object:
    try:
        return json.loads(spec)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidParameter(param, f"not valid JSON: {exc}") from exc


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching exactly itself."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in text)
