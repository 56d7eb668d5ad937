"""Whether a grammar can be enforced at all, before any token is sampled under it: the
resource limits every llguidance matcher of a request's grammar is built with, a probe of
a freshly built matcher, and a check of a JSON schema's ``$ref`` recursion.

llguidance builds a matcher's lexer and parser lazily, token by token: a grammar that
validates may still fail at its first mask or at a later token ("lexer error: too many
expressions constructed" for ``(a{1000}){1000}``, "Too many items" in the parser for a
schema whose required property refers back to itself), and a matcher in its error state
allows EOS only, which reads as an empty answer that ``stop``ped. The gateway refuses such
grammars with a 400 before enqueue (gateway/structured.py) and the worker runs the same
checks when it compiles one (worker/structured/cache.py):

- ``parser_limits``: the lexer's budget for building its regular expressions is a tenth
  of llguidance's default (100,000 instead of 1,000,000 units of fuel), which makes a
  regex of about 100,000 repeated characters an error at its first token in milliseconds
  instead of masks of 40 ms a token (the step of every request in the batch waits for
  them), or of a second for ``(a{1000}){1000}``. Measured on SmolLM2's vocabulary: a 106 KB
  schema of 1,500 patterned properties, a 5,000-word enum, a 2,000-alternative regex,
  ``email``/``date-time``/``uuid`` formats and arithmetic in Lark build and run exactly as
  under the defaults. Errors leave out the parser's state (``verbose_errors``): a message
  names the problem, not the grammar's internals.
- ``start_error``: a short walk from the start. The first mask (an error there, or a
  start state that allows nothing but is not accepting, is an empty language:
  ``[^\\s\\S]``, a ``$ref`` cycle, an ``allOf`` that includes itself); then, position
  by position, the tokens the grammar forces (llguidance's fast-forward tokens, up to
  ``MAX_NUM_PROBE_TOKENS``: every answer contains them) or, where it forces none, one
  allowed token (up to ``MAX_NUM_PROBE_CHOICES``). An error on the way is one a request
  can meet; a grammar that fails only on paths the walk does not take still reaches the
  worker, which fails that request alone (worker/structured/matcher.py). Under a
  millisecond for a typical grammar; 0.2 s for the worst measured.
- ``unsatisfiable_refs``: the ``$ref`` targets of a JSON schema that no finite JSON value
  satisfies (a required property, or one of ``minItems`` items, that refers back to
  itself with no way out), found as the least fixed point of "has a finite instance"
  over the targets, each judged generously (unsure counts as satisfiable), so only a
  schema that certainly has no instance is refused.
- ``embedded_schemas``: the JSON schemas a Lark grammar includes with ``%json`` (tool
  arguments: gateway/tools.py), each checked on its own, since a grammar with one good
  alternative is not empty as a whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Set as AbstractSet
from functools import cache
from typing import Any

import llguidance
import numpy as np

#: llguidance's limits for every matcher of a request's grammar (the module docstring
#: says why the lexer's fuel is a tenth of the default); the rest are llguidance's
#: defaults: 2,000 items a row, 200,000 lexer fuel and 50,000 Earley items a step,
#: 250,000 lexer states, 500,000 grammar symbols.
INITIAL_LEXER_FUEL = 100_000
#: Forced tokens the probe follows at most (``start_error``): far past any forced prefix
#: of a real grammar (a tool call's opening is tens of tokens) and cheap (llguidance
#: forces 37,500 tokens of a self-referencing schema in 0.06 s).
MAX_NUM_PROBE_TOKENS = 65_536
#: Tokens the probe picks itself where the grammar forces none (``start_error``): enough
#: to enter the first few lexemes (a JSON key, its value's opening, a regex's first
#: alternative), 16 masks at most (about 0.2 s for the largest schemas measured).
MAX_NUM_PROBE_CHOICES = 16
#: Work the ``$ref`` analysis may do, in schema nodes visited; past it the schema is
#: taken as satisfiable (llguidance's own limits still apply).
MAX_NUM_SCHEMA_VISITS = 1_000_000

_EMPTY_LANGUAGE_ERRORS = ("NoExtension",)  # llguidance's stop reasons for "no text can follow"
_JSON_DIRECTIVE = re.compile(r"%json\s*")
_ALL_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")


@cache
def parser_limits() -> llguidance.LLParserLimits:
    """The ``LLParserLimits`` of every request grammar's matcher (``INITIAL_LEXER_FUEL``)."""
    return llguidance.LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL, verbose_errors=False)


def short_error(error: str) -> str:
    """llguidance's error message without the parser state it may append (``<state>``,
    or ``<non-verbose/>`` where ``verbose_errors`` is off)."""
    for marker in ("\n<state>", "\n<non-verbose/>"):
        error = error.split(marker, 1)[0]
    return error.strip()


def start_error(matcher: llguidance.LLMatcher, eos_token_ids: AbstractSet[int] = frozenset(),
                max_num_choices: int = MAX_NUM_PROBE_CHOICES) -> str:
    """Why ``matcher`` (freshly built, in its start state) cannot be enforced; "" when no
    problem showed. Advances ``matcher``: probe a deep copy of one that is kept.

    The walk: at each position, the mask (an error there ends the walk); the tokens the
    grammar forces from there, if any (every answer contains them); otherwise one token of
    the mask's choosing, the allowed one with the highest id other than ``eos_token_ids``
    (in a BPE vocabulary, one of the longest), at most ``max_num_choices`` times (0:
    forced tokens only). Any error on the way is one that sampling can reach.

    Returns:
        llguidance's error (``short_error``) at build, at a mask or on a token, or
        "matches no text" for an empty language (nothing but forced tokens, then a
        start that allows nothing, or a dead end).
    """
    if matcher.is_error():
        return short_error(matcher.get_error())
    num_probed = num_choices = 0
    while True:
        mask = matcher.compute_bitmask()  # builds the lexer states of this position
        if matcher.is_error():
            error = short_error(matcher.get_error())
            return "matches no text" if not num_choices and error.startswith(_EMPTY_LANGUAGE_ERRORS) else error
        if matcher.is_stopped():
            return "" if matcher.is_accepting() or num_choices else "matches no text"
        if num_probed >= MAX_NUM_PROBE_TOKENS:
            return ""
        tokens = matcher.compute_ff_tokens()[:MAX_NUM_PROBE_TOKENS - num_probed]
        if matcher.is_error():
            return short_error(matcher.get_error())
        if not tokens:
            if num_choices >= max_num_choices:
                return ""
            choice = _highest_allowed(mask, eos_token_ids)
            if choice is None:  # EOS alone: the walk has reached an end of the language
                return ""
            tokens, num_choices = [choice], num_choices + 1
        num_probed += len(tokens)
        if not matcher.consume_tokens(tokens) or matcher.is_error():
            return short_error(matcher.get_error())


def _highest_allowed(mask: bytes, excluded: AbstractSet[int]) -> int | None:
    """The highest token id whose bit is set in ``mask`` (llguidance's layout: bit ``t % 8``
    of byte ``t // 8``), other than ``excluded``; None when there is none."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    allowed = np.flatnonzero(bits)
    for token_id in allowed[::-1][:len(excluded) + 1].tolist():
        if token_id not in excluded:
            return int(token_id)
    return None


def embedded_schemas(lark: str) -> list[Any]:
    """The JSON values that follow ``%json`` in a Lark grammar (the schemas it embeds);
    text after ``%json`` that is not JSON is skipped (llguidance reports it)."""
    decoder = json.JSONDecoder()
    found = []
    for match in _JSON_DIRECTIVE.finditer(lark):
        try:
            found.append(decoder.raw_decode(lark, match.end())[0])
        except (json.JSONDecodeError, RecursionError):
            continue
    return found


def unsatisfiable_refs(schema: Any) -> list[str]:
    """The local ``$ref``s of ``schema`` (``#``, ``#/$defs/a``) whose target no finite
    JSON value satisfies, when the whole schema has none either; ``[]`` otherwise.

    A target has a finite instance if one of the types it allows can be built: an object
    whose required properties' schemas have one, an array whose first ``minItems`` item
    schemas have one, any other type; ``allOf`` needs all, ``anyOf``/``oneOf`` one; a
    ``$ref`` needs its target. Starting from "no target has one" and adding targets until
    nothing changes (the productive symbols of a grammar) leaves exactly those that only
    recursion could satisfy. Each rule errs towards "has one" (``enum``/``const``, remote
    or unresolvable refs, ``patternProperties``, an unknown shape), so a schema this
    refuses has no instance; one it passes may still be refused by llguidance.
    """
    if not isinstance(schema, dict):
        return []
    analysis = _Productivity(schema)
    try:
        return analysis.run()
    except (RecursionError, _OutOfBudget):
        return []


class _OutOfBudget(Exception):
    pass


class _Productivity:
    """``unsatisfiable_refs``' fixed point over one schema."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.num_visits = 0
        self.productive: dict[str, bool] = {}

    def run(self) -> list[str]:
        targets = {ref: target for ref in _local_refs(self.root)
                   if (target := _resolve(self.root, ref)) is not _UNRESOLVED}
        self.productive = dict.fromkeys(targets, False)
        changed = True
        while changed:
            changed = False
            for ref, target in targets.items():
                if not self.productive[ref] and self.has_instance(target):
                    self.productive[ref] = changed = True
        if self.has_instance(self.root):
            return []
        return sorted(ref for ref, ok in self.productive.items() if not ok)

    def has_instance(self, schema: Any) -> bool:
        """Whether ``schema`` may have a finite instance, given ``productive``."""
        if schema is False:
            return False
        if not isinstance(schema, dict):
            return True
        self.num_visits += 1
        if self.num_visits > MAX_NUM_SCHEMA_VISITS:
            raise _OutOfBudget
        ref = schema.get("$ref")
        if isinstance(ref, str) and not self.productive.get(ref, True):
            return False
        all_of = schema.get("allOf")
        if isinstance(all_of, list) and not all(self.has_instance(s) for s in all_of):
            return False
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            if isinstance(options, list) and options and not any(self.has_instance(s) for s in options):
                return False
        if "enum" in schema or "const" in schema:
            return True
        types = schema.get("type", _ALL_TYPES)
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list):
            return True
        return any(self._type_has_instance(t, schema) for t in types)

    def _type_has_instance(self, kind: Any, schema: dict[str, Any]) -> bool:
        if kind == "object":
            properties = schema.get("properties")
            properties = properties if isinstance(properties, dict) else {}
            required = schema.get("required")
            if isinstance(required, list) and isinstance(schema.get("patternProperties"), dict):
                required = [name for name in required if name in properties]  # unsure about the rest
            extra = schema.get("additionalProperties", True)
            return not isinstance(required, list) or all(
                self.has_instance(properties.get(name, extra))
                for name in required if isinstance(name, str))
        if kind == "array":
            min_items = schema.get("minItems", 0)
            if not isinstance(min_items, int) or min_items <= 0:
                return True
            prefix = schema.get("prefixItems")
            prefix = prefix if isinstance(prefix, list) else []
            if not all(self.has_instance(s) for s in prefix[:min_items]):
                return False
            return min_items <= len(prefix) or self.has_instance(schema.get("items", True))
        return True


_UNRESOLVED = object()


def _local_refs(schema: Any) -> set[str]:
    """Every ``$ref`` value in ``schema`` that points into this document (``#...``)."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                found.add(ref)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _resolve(root: Any, ref: str) -> Any:
    """The value at the JSON pointer of ``ref`` (``#/a/b``), or ``_UNRESOLVED`` (anchors
    like ``#name`` and pointers that lead nowhere)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return _UNRESOLVED
    node = root
    for part in ref[2:].split("/"):
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return _UNRESOLVED
    return node
