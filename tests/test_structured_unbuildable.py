"""Constraints that cannot be enforced: a 400 naming the parameter before anything is
enqueued, never a 500 or an empty answer (shared/grammar_check.py), through the openai
client against a real gateway and worker (``smollm_stack``: the real SmolLM2 tokenizer at
the gateway, our engine at the worker); a grammar that only fails on a path the gateway's
probe does not force fails its own request in the worker and leaves the next ones alone;
and the pieces on their own (the ``$ref`` analysis, the probe, the gateway's cache)."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from typing import Any

import llguidance
import openai
import pytest

from gateway import structured as gateway_structured
from gateway.structured import GrammarChecker, checker_for
from shared.grammar_check import embedded_schemas, parser_limits, start_error, unsatisfiable_refs
from shared.grammars import check, compile_matcher, grammar_for
from shared.sampling import InvalidParameter, StructuredOutput
from worker.structured.cache import GrammarCache
from worker.structured.matcher import GrammarMatcher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Answer in JSON."}]

#: A required property that is the schema itself: only an infinitely nested value fits.
SELF_REF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
#: Two definitions that are each other and nothing else.
REF_CYCLE = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}
#: A definition whose only content is itself.
ALL_OF_CYCLE = {"$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}]}}, "$ref": "#/$defs/A"}
#: Recursion with a way out: these have finite instances and must pass.
TREE = {"$defs": {"node": {"type": "object", "required": ["v", "kids"], "properties": {
    "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
LIST = {"type": "object", "required": ["v", "next"], "properties": {
    "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
OK_ARGS = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
#: Fails at the lexer's limit on its second token whichever first token is sampled: no
#: token is forced, so only a probe that chooses tokens finds it (the gateway's does; the
#: worker's follows forced tokens only).
UNFORCED_LIMIT = "(a{1000}){1000}|(b{1000}){1000}"


@pytest.fixture(scope="module")
def client(smollm_stack: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{smollm_stack}/v1", api_key="none", max_retries=0) as c:
        yield c


def _tools(*schemas: dict[str, Any]) -> dict[str, Any]:
    return {"tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": s}}
                      for i, s in enumerate(schemas)], "tool_choice": "required"}


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


# (request fields, the param the 400 names, words of its message)
CASES = [
    ({"extra_body": {"guided_regex": "(a{1000}){1000}"}}, "guided_regex", "too many expressions"),
    ({"extra_body": {"guided_grammar": "start: /(a{1000}){1000}/"}}, "guided_grammar", "too many expressions"),
    ({"extra_body": {"guided_regex": r"[^\s\S]"}}, "guided_regex", "matches no text"),
    ({"extra_body": {"structured_outputs": {"regex": r"[^\s\S]"}}}, "structured_outputs", "matches no text"),
    ({"extra_body": {"guided_json": SELF_REF}}, "guided_json", "'#' refers back to itself"),
    ({"extra_body": {"guided_json": REF_CYCLE}}, "guided_json", "'#/$defs/A', '#/$defs/B'"),
    ({"extra_body": {"guided_json": ALL_OF_CYCLE}}, "guided_json", "'#/$defs/A' refers back"),
    (_format(SELF_REF), "response_format", "no finite JSON value"),
    (_format(REF_CYCLE), "response_format", "no finite JSON value"),
    (_format(ALL_OF_CYCLE), "response_format", "no finite JSON value"),
    ({"extra_body": {"guided_regex": UNFORCED_LIMIT}}, "guided_regex", "too many expressions"),
    (_format({"type": "object", "properties": {"p": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
              "required": ["p"]}), "response_format", "too many expressions"),
    (_tools(SELF_REF), "tools", "no finite JSON value"),
    (_tools(OK_ARGS, REF_CYCLE), "tools", "no finite JSON value"),  # the good tool does not hide the bad one
    (_tools(OK_ARGS, ALL_OF_CYCLE), "tools", "no finite JSON value"),
]


@pytest.mark.parametrize("fields,param,words", CASES)
def test_constraint_that_cannot_be_built_is_a_400_naming_it(client, fields, param, words) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, stream=stream, **fields)
        body = info.value.body
        assert body["param"] == param and body["type"] == "invalid_request_error", body
        assert words in body["message"], body["message"]


def test_refused_specs_leave_the_service_working(client) -> None:
    """After the refusals (and again for the same spec: the gateway's cached verdict), a
    constrained request with a recursive schema that has a way out is answered."""
    for _ in range(2):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                           extra_body={"guided_regex": "(a{1000}){1000}"})
    resp = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                          extra_body={"guided_json": LIST})
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.choices[0].message.content.startswith('{"')


def test_a_failure_inside_the_worker_fails_that_request_only(client, smollm_tokenizer) -> None:
    """A grammar that passes the gateway and fails on its second token: each such request
    ends with a 400 naming the constraint's field and llguidance's reason, never a 200
    with an empty or cut answer (a matcher in llguidance's error state allows EOS) nor a
    500 ``aborted``, the second one too (the failed grammar is not kept), and a request
    after them is served.

    The gateway's probe takes the allowed token with the highest id, so the regex offers
    a word whose token has a higher id than any run of ``a``, and ``logit_bias`` makes
    the model take the ``a`` branch instead."""
    vocab = smollm_tokenizer.get_vocab()
    word_id = max(i for t, i in vocab.items() if t.isascii() and t.isalpha() and len(t) > 3)
    word = smollm_tokenizer.decode([word_id])
    [a_id] = smollm_tokenizer.encode("a", add_special_tokens=False)
    assert word_id > max(i for t, i in vocab.items() if set(t) == {"a"})
    for _ in range(2):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="Say a:", max_tokens=8, temperature=0,
                                      logit_bias={str(a_id): 100},
                                      extra_body={"guided_regex": f"{word}|(a{{1000}}){{1000}}"})
        body = info.value.body
        assert body["param"] == "guided_regex" and body["type"] == "invalid_request_error", body
        assert body["message"].startswith("the structured output constraint failed: lexer error"), body
    resp = client.completions.create(model=MODEL, prompt="The answer (yes or no):", max_tokens=5,
                                     extra_body={"guided_choice": ["yes", "no"]})
    assert resp.choices[0].text in ("yes", "no")


# -- the worker's grammar cache ------------------------------------------------------------

@pytest.fixture(scope="module")
def ll_tokenizer(smollm_source) -> llguidance.LLTokenizer:
    from shared.model_source import eos_token_ids
    from worker.structured.tokenizer import build_tokenizer

    return build_tokenizer(smollm_source.path, smollm_source.config["vocab_size"], eos_token_ids(smollm_source.config))


def _walk_until_error(matcher, ll_tokenizer) -> int:
    """Feed the matcher the first token its mask allows, then EOS once nothing else is
    allowed (what the sampler does under a mask); returns the tokens fed."""
    import numpy as np

    for num_fed in range(1, 10):
        bits = np.unpackbits(np.frombuffer(matcher.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = [t for t in np.flatnonzero(bits).tolist() if t != ll_tokenizer.eos_token]
        if not matcher.accept(allowed[0] if allowed else ll_tokenizer.eos_token):
            return num_fed
    raise AssertionError("the matcher never failed")


def test_a_failed_matcher_fails_and_its_grammar_is_compiled_again(ll_tokenizer) -> None:
    cache = GrammarCache(lambda: ll_tokenizer)
    structured = StructuredOutput(kind="regex", spec=UNFORCED_LIMIT)
    first = cache.matcher(structured)
    assert _walk_until_error(first, ll_tokenizer) == 2  # EOS in the error state is refused, not a stop
    assert (cache.num_compiled, cache.num_forgotten, len(cache)) == (1, 1, 0)
    second = cache.matcher(structured)  # a fresh lexer: it fails where the first did, not at its start
    assert cache.num_compiled == 2 and not second.matcher.is_error()
    assert _walk_until_error(second, ll_tokenizer) == 2
    good = cache.matcher(StructuredOutput(kind="regex", spec="[0-9]+"))
    assert good.accept(ll_tokenizer.tokenize_str("42")[0]) and cache.num_forgotten == 2


def test_eos_in_the_error_state_fails_the_request(ll_tokenizer) -> None:
    """A mask that hits an error allows EOS only, and llguidance then accepts EOS: the
    matcher must report a failure, not the grammar's end (an empty answer that stopped)."""
    failures = []
    grammar = grammar_for(StructuredOutput(kind="regex", spec=r"[^\s\S]"))  # built without the checks
    matcher = GrammarMatcher(llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0), on_error=lambda: failures.append(1))
    matcher.matcher.compute_bitmask()
    assert matcher.matcher.is_error() and matcher.matcher.consume_token(ll_tokenizer.eos_token)  # llguidance's view
    matcher = GrammarMatcher(llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0), on_error=lambda: failures.append(1))
    matcher.matcher.compute_bitmask()
    assert not matcher.accept(ll_tokenizer.eos_token) and failures == [1]
    assert not matcher.accept(ll_tokenizer.eos_token) and failures == [1]  # on_error runs once


def test_worker_refuses_what_the_gateway_refuses(ll_tokenizer) -> None:
    from worker.structured.cache import InvalidGrammar

    cache = GrammarCache(lambda: ll_tokenizer)
    for structured, words in [(StructuredOutput(kind="regex", spec="(a{1000}){1000}"), "too many expressions"),
                              (StructuredOutput(kind="regex", spec=r"[^\s\S]"), "matches no text"),
                              (StructuredOutput(kind="json_schema", spec=json.dumps(SELF_REF)), "refers back")]:
        with pytest.raises(InvalidGrammar, match=words):
            cache.matcher(structured)
    assert len(cache) == 0


# -- the pieces ------------------------------------------------------------------------------

def test_ref_analysis_refuses_only_schemas_without_a_finite_instance() -> None:
    assert unsatisfiable_refs(SELF_REF) == ["#"]
    assert unsatisfiable_refs(REF_CYCLE) == ["#/$defs/A", "#/$defs/B"]
    assert unsatisfiable_refs(ALL_OF_CYCLE) == ["#/$defs/A"]
    assert unsatisfiable_refs({"type": "array", "minItems": 2, "items": {"$ref": "#"}}) == ["#"]
    satisfiable = [
        TREE, LIST, OK_ARGS, {"type": "object", "properties": {"a": {"$ref": "#"}}},  # optional: {} ends it
        {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no type: a string is an instance
        {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        {"anyOf": [{"$ref": "#"}, {"type": "integer"}]},
        {"$ref": "#/$defs/missing"}, {"$ref": "https://example.com/schema"},  # unsure: llguidance decides
        {"type": "object", "required": ["a"], "patternProperties": {"^a": {"$ref": "#"}},
         "properties": {"b": {"$ref": "#"}}},
        {"enum": [1, 2], "allOf": [{"type": "integer"}]},
    ]
    for schema in satisfiable:
        assert unsatisfiable_refs(schema) == [], schema
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(5000):  # deeper than Python's recursion: unsure, not an error
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    assert unsatisfiable_refs(deep) == []


def test_embedded_schemas_are_found_in_a_lark_grammar() -> None:
    lark = 'start: a | b\na: %json {"type": "integer"}\nb: %json  {"$ref": "#"} "x"\nc: %json nonsense'
    assert embedded_schemas(lark) == [{"type": "integer"}, {"$ref": "#"}]
    # Each embedded schema is checked on its own, also without a tokenizer.
    good_and_bad = f'start: a | b\na: %json {json.dumps(OK_ARGS)}\nb: %json {json.dumps(SELF_REF)}\n'
    with pytest.raises(InvalidParameter, match="no finite JSON value satisfies its %json schema"):
        check(StructuredOutput(kind="grammar", spec=good_and_bad), "guided_grammar")
    check(StructuredOutput(kind="grammar", spec=f'start: a\na: %json {json.dumps(TREE)}\n'), "guided_grammar")


def test_probe_follows_forced_tokens_and_spots_empty_languages(ll_tokenizer) -> None:
    def probe(kind: str, spec: str, **kwargs: Any) -> str:
        grammar = grammar_for(StructuredOutput(kind=kind, spec=spec))
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0, limits=parser_limits())
        return start_error(matcher, frozenset(ll_tokenizer.eos_tokens), **kwargs)

    assert probe("regex", r"[^\s\S]") == "matches no text"
    assert probe("json_schema", json.dumps(REF_CYCLE)) == "matches no text"
    assert probe("grammar", "start: /(a{1000}){1000}/").startswith("lexer error")
    # Past the ``$ref`` analysis: the probe alone finds it, llguidance's parser limit on forced tokens.
    assert probe("json_schema", json.dumps(SELF_REF)).startswith("parser error: Too many items")
    assert probe("regex", UNFORCED_LIMIT).startswith("lexer error")  # on the token it chose
    assert probe("regex", UNFORCED_LIMIT, max_num_choices=0) == ""  # forced tokens only: none here
    # The lexer's fuel (a tenth of llguidance's default): these pass under the default.
    assert probe("regex", "a{100000}").startswith("lexer error")
    assert probe("regex", "(a{300}){300}").startswith("lexer error")
    for kind, spec in [("regex", ""), ("regex", "a+"), ("regex", "x{10000}"), ("regex", "[a-z]{1,100}@[a-z]+"),
                       ("json_schema", json.dumps(TREE)), ("json_schema", json.dumps(LIST)), ("json_object", ""),
                       ("choice", '["yes", "no"]')]:
        assert probe(kind, spec) == "", (kind, spec)


def test_gateway_checker_caches_verdicts(smollm_tokenizer) -> None:
    class Model:
        tokenizer, vocab_size, eos_token_ids = smollm_tokenizer, 49152, frozenset({2})

    checker = GrammarChecker(Model(), max_num_specs=2)
    bad, good = StructuredOutput(kind="regex", spec=r"[^\s\S]"), StructuredOutput(kind="regex", spec="a+")
    for _ in range(3):
        with pytest.raises(InvalidParameter, match="matches no text") as info:
            checker.check(bad, "guided_regex")
        assert info.value.param == "guided_regex"
        checker.check(good, "guided_regex")
    assert checker.num_checked == 2
    checker.check(StructuredOutput(kind="regex", spec="b+"), "guided_regex")  # evicts ``bad``
    with pytest.raises(InvalidParameter):
        checker.check(bad, "guided_regex")
    assert checker.num_checked == 4
    num_checkers, model = len(gateway_structured._CHECKERS), Model()
    assert checker_for(model) is checker_for(model)  # one per tokenizer ...
    assert len(gateway_structured._CHECKERS) == num_checkers + 1
    del model
    gc.collect()
    assert len(gateway_structured._CHECKERS) == num_checkers  # ... dropped with it


def test_compile_matcher_names_the_param(ll_tokenizer) -> None:
    with pytest.raises(InvalidParameter) as info:
        compile_matcher(StructuredOutput(kind="regex", spec="(a{1000}){1000}"), ll_tokenizer, "guided_regex")
    assert info.value.param == "guided_regex"

