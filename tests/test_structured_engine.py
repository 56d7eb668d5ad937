"""Structured outputs in the engine (worker/structured/): the mask op against a reference,
the grammar cache and masks on SmolLM2's real vocabulary, and end to end on the real
SmolLM2 (float32, CPU): JSON schemas, regex, choice, Lark and GBNF grammars, batches that
mix constrained and unconstrained requests, the grammar's end as ``stop``, failover
continuations, preemption, and the vLLM backend's mapping.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from shared.sampling import SamplingParams, StructuredOutput
from worker.backends.base import RequestRejected
from worker.structured.bitmask import GrammarMasks
from worker.structured.cache import GrammarCache, InvalidGrammar
from worker.structured.mask import TokenMask, apply_token_bitmask_, num_words
from worker.structured.tokenizer import build_tokenizer

CPU = torch.device("cpu")

# -- schemas and a validator for the features they use -------------------------------
PERSON = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "address", "tags", "score"],
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "tags": {"type": "array", "minItems": 1, "maxItems": 3,
                 "items": {"type": "string", "enum": ["red", "green", "blue"]}},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
}
ORDER = {
    "type": "object", "additionalProperties": False, "required": ["id", "items", "status"],
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 10}}}},
        "status": {"enum": ["open", "shipped", "closed"]},
        "note": {"type": "string", "maxLength": 12},
    },
}
VERDICT = {
    "type": "object", "additionalProperties": False, "required": ["answer", "confidence"],
    "properties": {"answer": {"type": "boolean"}, "confidence": {"type": "number", "minimum": -1, "maximum": 1}},
}
_TYPES: dict[str, Any] = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int,
                          "number": (int, float)}


def validate(value: Any, schema: dict[str, Any], path: str = "$") -> None:
    """Assert that ``value`` matches ``schema`` (type, enum, bounds, lengths, pattern,
    properties, required, additionalProperties false, items)."""
    t = schema.get("type")
    if t is not None:
        assert isinstance(value, _TYPES[t]) and (t == "boolean" or not isinstance(value, bool)), (path, value)
    if "enum" in schema:
        assert value in schema["enum"], (path, value)
    if isinstance(value, (int, float)):
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), (path, value)
    if isinstance(value, str):
        assert len(value) <= schema.get("maxLength", len(value)), (path, value)
        assert re.search(schema.get("pattern", ""), value), (path, value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        assert set(schema.get("required", ())) <= set(value), (path, value)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), (path, value)
        for key, item in value.items():
            if key in props:
                validate(item, props[key], f"{path}.{key}")
    if isinstance(value, list):
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), (path, value)
        for i, item in enumerate(value):
            validate(item, schema.get("items", {}), f"{path}[{i}]")


def json_schema(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput(kind="json_schema", spec=json.dumps(schema, sort_keys=True))


# -- the mask op ------------------------------------------------------------------------
def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """numpy's unpackbits as the oracle: bit t of row k, least significant first."""
    out = logits.clone()
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.cpu().numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    for k, row in enumerate(rows):
        out[row, torch.from_numpy(bits[k] == 0)] = float("-inf")
    return out


def check_apply(device: torch.device, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=gen)
    rows = [0, 3, 4, 6]
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), num_words(vocab)), dtype=torch.int32, generator=gen)
    bitmask[1] = -1  # all allowed
    bitmask[2] = 0  # none allowed
    bitmask[3, 0] = -2**31  # the sign bit alone: token 31 only, in the first word
    expected = reference_apply(logits, bitmask, rows)
    got = logits.to(device)
    apply_token_bitmask_(got, TokenMask(bitmask.to(device), torch.tensor(rows, device=device)))
    assert torch.equal(got.cpu(), expected)  # exact: allowed logits keep their values
    untouched = [1, 2, 5]
    assert torch.equal(got.cpu()[untouched], logits[untouched])


@pytest.mark.parametrize("vocab", [1000, 49152, 32 * 7 + 5])
def test_apply_token_bitmask_matches_numpy_reference(vocab: int) -> None:
    check_apply(CPU, vocab)


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [1000, 151936])
def test_apply_token_bitmask_matches_numpy_reference_cuda(vocab: int) -> None:
    check_apply(torch.device("cuda"), vocab)


def test_apply_token_bitmask_checks_its_inputs() -> None:
    logits = torch.zeros(2, 100)
    good, rows = torch.zeros(1, 4, dtype=torch.int32), torch.tensor([1])
    apply_token_bitmask_(logits, TokenMask(good[:0], rows[:0]))  # no rows: nothing to do
    assert torch.equal(logits, torch.zeros(2, 100))
    for bitmask, r in [(torch.zeros(1, 3, dtype=torch.int32), rows), (good.long(), rows),
                       (good, torch.tensor([1, 0])), (good, rows.int())]:
        with pytest.raises(ValueError):
            apply_token_bitmask_(logits, TokenMask(bitmask, r))


def test_sampler_draws_only_allowed_tokens_in_masked_rows() -> None:
    from worker.engine.sampler import Sampler

    vocab = 64
    torch.manual_seed(0)
    logits = torch.randn(4, vocab)
    allowed = [5, 40, 63]  # none of them the argmax of row 0
    assert logits[0].argmax().item() not in allowed
    bits = np.zeros((2, vocab), dtype=np.uint8)
    bits[:, allowed] = 1
    bitmask = torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())
    mask = TokenMask(bitmask, torch.tensor([0, 2]))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.5, repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(temperature=1.5)]
    sampler = Sampler(CPU, seed=3)
    masked_rows_draws: set[int] = set()
    for step in range(50):
        ids = [f"r{i}" for i in range(4)]
        got = sampler(logits.clone(), ids, params, [[5, 5, 40]] * 4, [1] * 4, mask)
        masked_rows_draws |= {got[0], got[2]}
        assert got[1] == logits[1].argmax().item()  # unmasked greedy row: its own argmax
    assert got[0] == allowed[int(logits[0, allowed].argmax())]
    assert masked_rows_draws <= set(allowed) and len(masked_rows_draws) >= 2


# -- grammars on SmolLM2's vocabulary ---------------------------------------------------------
@pytest.fixture(scope="module")
def ll_tokenizer(smollm_source):
    from shared.model_source import eos_token_ids

    return build_tokenizer(smollm_source.path, smollm_source.config["vocab_size"],
                           eos_token_ids(smollm_source.config))


def allowed_ids(masks: GrammarMasks, matcher) -> set[int]:
    mask = masks.mask([matcher])
    assert mask is not None
    bits = np.unpackbits(mask.bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[0]
    return set(np.flatnonzero(bits).tolist())


def test_cache_compiles_each_spec_once_and_drops_the_least_recent(ll_tokenizer) -> None:
    cache = GrammarCache(lambda: ll_tokenizer, max_num_grammars=2)
    a, b, c = json_schema(VERDICT), StructuredOutput(kind="regex", spec="[0-9]+"), StructuredOutput(kind="json_object")
    first, second = cache.matcher(a), cache.matcher(json_schema(VERDICT))  # an equal spec, another object
    assert cache.num_compiled == 1 and first.matcher is not second.matcher
    assert first.accept(ll_tokenizer.tokenize_str('{"')[0]) and not second.matcher.is_error()
    cache.matcher(b)
    cache.matcher(a)  # a is now the most recent: c evicts b
    cache.matcher(c)
    assert (cache.num_compiled, len(cache)) == (3, 2)
    cache.matcher(a)
    assert cache.num_compiled == 3
    cache.matcher(b)
    assert cache.num_compiled == 4


def test_invalid_specs_and_replays_raise_invalid_grammar(ll_tokenizer) -> None:
    cache = GrammarCache(lambda: ll_tokenizer)
    cases = [(StructuredOutput(kind="regex", spec="("), "regex"),
             (StructuredOutput(kind="json_schema", spec="{not json"), "JSON"),
             (StructuredOutput(kind="grammar", spec="root ::= undefined_rule"), "grammar"),
             (StructuredOutput(kind="choice", spec="[]"), "choice")]
    for structured, message in cases:
        with pytest.raises(InvalidGrammar, match=message):
            cache.matcher(structured)
    digits = StructuredOutput(kind="regex", spec="[0-9]+")
    with pytest.raises(InvalidGrammar, match="do not match"):
        cache.matcher(digits, ll_tokenizer.tokenize_str("abc"))
    assert cache.matcher(digits, ll_tokenizer.tokenize_str("12")).matcher.is_accepting()
    with pytest.raises(InvalidGrammar, match="need the model.s tokenizer"):
        GrammarCache(None).matcher(digits)


def test_eos_is_allowed_only_where_the_grammar_accepts(ll_tokenizer) -> None:
    masks = GrammarMasks(ll_tokenizer.vocab_size, CPU)
    cache = GrammarCache(lambda: ll_tokenizer)
    eos = ll_tokenizer.eos_token
    digits = cache.matcher(StructuredOutput(kind="regex", spec="[0-9]+"))
    start = allowed_ids(masks, digits)
    assert eos not in start and start and all(ll_tokenizer.decode_str([t]).isdigit() for t in start)
    assert digits.accept(ll_tokenizer.tokenize_str("7")[0]) and not digits.is_finished
    assert eos in allowed_ids(masks, digits)
    assert digits.accept(eos) and digits.is_finished  # EOS consumed where it accepts: the grammar ended
    choice = cache.matcher(StructuredOutput(kind="choice", spec='["yes", "no"]'))
    for t in ll_tokenizer.tokenize_str("yes"):
        assert choice.accept(t)
    assert choice.is_finished and allowed_ids(masks, choice) == {eos}  # at its end: EOS only
    any_object = allowed_ids(masks, cache.matcher(StructuredOutput(kind="json_object")))
    assert any_object and all(ll_tokenizer.decode_str([t]).startswith("{") for t in any_object)
    assert masks.mask([None, None]) is None  # no grammar in the step: no mask, no work


def test_padded_vocabulary_ids_are_never_allowed(smollm_source) -> None:
    vocab = smollm_source.config["vocab_size"]
    padded = build_tokenizer(smollm_source.path, vocab + 100, frozenset({2}))
    masks = GrammarMasks(vocab + 100, CPU)
    anything = GrammarCache(lambda: padded).matcher(StructuredOutput(kind="regex", spec="(.|\\n)*"))
    ids = allowed_ids(masks, anything)
    assert len(ids) > vocab // 2 and max(ids) < vocab
    with pytest.raises(ValueError, match="more than"):
        build_tokenizer(smollm_source.path, 1000, frozenset({2}))


def test_json_numbers_are_capped_unless_the_grammar_needs_more_digits(ll_tokenizer) -> None:
    """A JSON output's numbers stop at 20 digits before the point, 20 after it, 3 in the
    exponent (shared/grammars.py); strings, regexes and a schema that needs a longer
    number keep their digits."""
    masks = GrammarMasks(ll_tokenizer.vocab_size, CPU)
    cache = GrammarCache(lambda: ll_tokenizer)
    digit_ids = {t for t in range(ll_tokenizer.vocab_size) if ll_tokenizer.decode_str([t]).isdigit()}

    def after(structured: StructuredOutput, text: str):
        matcher = cache.matcher(structured)
        for t in ll_tokenizer.tokenize_str(text):
            assert matcher.accept(t), text
        return matcher, allowed_ids(masks, matcher)

    bounded = json_schema({"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}},
                           "required": ["x"], "additionalProperties": False})
    assert digit_ids & after(bounded, '{"x":0.5' + "0" * 18)[1]  # 19 digits after the point
    close = after(bounded, '{"x":0.5' + "0" * 19)[1]
    assert not digit_ids & close and ll_tokenizer.tokenize_str("}")[0] in close
    eos = ll_tokenizer.eos_token
    for structured, text in [(json_schema({"type": "integer"}), "1" + "0" * 19), (json_schema({"type": "number"}), "-2e123"),
                             (StructuredOutput(kind="json_object"), '{"a":[' + "7" * 20)]:
        allowed = after(structured, text)[1]
        assert not digit_ids & allowed and allowed, text
        assert (eos in allowed) == (structured.kind == "json_schema"), text
    kept = [(json_schema({"type": "object", "properties": {"s": {"type": "string"}}}), '{"s":"' + "1" * 30),
            (StructuredOutput(kind="regex", spec="[0-9]+"), "1" * 30),
            (json_schema({"enum": [10**24, 7]}), "1" + "0" * 19)]  # the schema needs 25 digits
    for structured, text in kept:
        assert digit_ids & after(structured, text)[1], text
    matcher, _ = after(json_schema({"enum": [10**24, 7]}), "1" + "0" * 24)
    assert matcher.number_cap is None and matcher.matcher.is_accepting()  # the cap gave way


# -- end to end on the real model -----------------------------------------------------------
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def chat(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True)["input_ids"])


def constrained(structured: StructuredOutput, temperature: float = 0.0, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=120, temperature=temperature, seed=seed, structured=structured)


#: (name, prompt, params) of one mixed batch; the unconstrained requests come last.
CASES = [
    ("person", "Describe a person as JSON.", constrained(json_schema(PERSON))),
    ("person_hot", "Describe a person as JSON.", constrained(json_schema(PERSON), 1.0, seed=1)),
    ("order", "Write an order as JSON.", constrained(json_schema(ORDER))),
    ("order_hot", "Write an order as JSON.", constrained(json_schema(ORDER), 0.9, seed=2)),
    ("verdict", "Is water wet? Answer as JSON.", constrained(json_schema(VERDICT))),
    ("regex", "Give me a phone number.", constrained(StructuredOutput(kind="regex", spec=r"[0-9]{3}-[0-9]{4}"))),
    ("choice", "Is the sky blue? yes or no", constrained(StructuredOutput(kind="choice", spec='["yes", "no"]'))),
    ("lark", "Name a color.", constrained(StructuredOutput(kind="grammar", spec='start: "color: " C "."\nC: "red" | "blue"'))),
    ("gbnf", "Pick A, B or C.", constrained(StructuredOutput(
        kind="grammar", spec='root ::= "The answer is " [ABC] "."'))),
    ("free1", "What is the capital of France?", GREEDY),
    ("free2", "Write a haiku about the sea.", GREEDY),
]


_MIXED: dict[str, Any] = {}


@pytest.fixture()
def mixed(offline) -> dict[str, Any]:
    """One batch of every case, run once for the module: each request's output by name."""
    if not _MIXED:
        tok = offline.tokenizer
        outs = offline.generate([chat(tok, prompt) for _, prompt, _ in CASES], [p for _, _, p in CASES])
        assert not offline.engine.has_unfinished_requests()
        _MIXED.update({name: out for (name, _, _), out in zip(CASES, outs, strict=True)})
    return _MIXED


@pytest.mark.slow
def test_json_schema_outputs_parse_and_match_their_schemas(mixed) -> None:
    for name, schema in [("person", PERSON), ("person_hot", PERSON), ("order", ORDER), ("order_hot", ORDER),
                         ("verdict", VERDICT)]:
        out = mixed[name]
        assert out.finish_reason == "stop", (name, out.text)
        validate(json.loads(out.text), schema)


@pytest.mark.slow
def test_regex_choice_lark_and_gbnf_outputs_match(mixed) -> None:
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", mixed["regex"].text)
    assert mixed["choice"].text in ("yes", "no")
    assert re.fullmatch(r"color: (red|blue)\.", mixed["lark"].text)
    assert re.fullmatch(r"The answer is [ABC]\.", mixed["gbnf"].text)


@pytest.mark.slow
def test_grammar_end_finishes_with_stop(mixed, offline, smollm_source) -> None:
    from shared.model_source import eos_token_ids

    eos = eos_token_ids(smollm_source.config)
    for name in ("choice", "lark", "gbnf", "regex", "person", "order", "verdict"):
        out = mixed[name]
        assert out.finish_reason == "stop", name
        assert not eos & set(out.token_ids[:-1]), name  # EOS, if any, only at the end
    # A choice ends with its last character: no EOS sampled after it.
    assert offline.tokenizer.decode(mixed["choice"].token_ids) == mixed["choice"].text
    assert mixed["choice"].token_ids[-1] not in eos


@pytest.mark.slow
def test_finished_and_aborted_requests_drop_their_matcher(offline) -> None:
    engine, params = offline.engine, CASES[7][2]  # choice: one token
    prompt = chat(offline.tokenizer, CASES[7][1])
    engine.add_request("done", prompt, params)
    engine.add_request("aborted", prompt, params)
    done, aborted = engine.scheduler.requests["done"], engine.scheduler.requests["aborted"]
    assert done.grammar is not None and aborted.grammar is not None
    assert engine.abort("aborted") and aborted.grammar is None
    assert run(engine, "done")[1] == "stop" and done.grammar is None


@pytest.mark.slow
def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(mixed, offline) -> None:
    tok = offline.tokenizer
    for name, prompt, params in CASES:
        if params.structured is None:
            (alone,) = offline.generate([chat(tok, prompt)], params)
            assert mixed[name].token_ids == alone.token_ids and len(alone.token_ids) == params.max_tokens, name


def run(engine, rid: str) -> tuple[list[int], str | None, int]:
    """Step ``engine`` until idle: ``rid``'s new tokens, finish reason, first index."""
    ids: list[int] = []
    finish, first = None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                first = out.first_index if first is None else first
                ids += out.new_token_ids
                finish = out.finish_reason or finish
    return ids, finish, first if first is not None else -1


@pytest.mark.slow
def test_failover_continuation_replays_the_delivered_tokens(mixed, offline) -> None:
    prompt, params = chat(offline.tokenizer, CASES[2][1]), CASES[2][2]
    whole = mixed["order"].token_ids
    assert len(whole) >= 10
    for num_delivered in (1, len(whole) // 2):
        offline.engine.add_request("resumed", prompt, params, output_token_ids=whole[:num_delivered])
        rest, finish, first = run(offline.engine, "resumed")
        assert first == num_delivered and whole[:num_delivered] + rest == whole and finish == "stop"


@pytest.mark.slow
def test_a_runaway_number_is_closed_by_the_digit_cap(offline) -> None:
    """A model pushed to write "0.000..." (logit_bias) closes the JSON after 20 digits,
    far inside max_tokens, instead of running out of tokens mid-number."""
    tok = offline.tokenizer
    bias = tuple(sorted((tok.convert_tokens_to_ids(c), 100.0) for c in "0."))
    schema = {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}},
              "required": ["x"], "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=0.0, logit_bias=bias, structured=json_schema(schema))
    (out,) = offline.generate([chat(tok, "Give x as JSON.")], params)
    assert out.finish_reason == "stop" and out.text == '{"x":0.' + "0" * 20 + "}", out.text


@pytest.mark.slow
def test_engine_rejects_bad_grammars_and_mismatched_resumes(offline) -> None:
    engine = offline.engine
    bad = [(SamplingParams(structured=StructuredOutput(kind="regex", spec="(")), None, "invalid regex"),
           (SamplingParams(structured=StructuredOutput(kind="choice", spec="[1]")), None, "choice"),
           (constrained(json_schema(VERDICT)), offline.encode("hello"), "do not match")]
    for params, outputs, message in bad:
        with pytest.raises(RequestRejected, match=message):
            engine.add_request("bad", [1, 2, 3], params, output_token_ids=outputs)
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_preempted_structured_requests_keep_their_grammar_state(mixed, offline) -> None:
    """Recompute after preemption appends no token, so the grammar consumes none twice:
    greedy outputs under a cache so small that requests are preempted equal the roomy run."""
    from worker.llm import LLM

    names = ["person", "order", "verdict", "lark"]
    # 8 blocks of 16 tokens: "person" alone needs 6 (36 prompt + 50 output tokens).
    small = LLM(num_kv_blocks=8, max_num_seqs=4)
    cases = {name: (prompt, msgspec.structs.replace(params, max_tokens=64)) for name, prompt, params in CASES}
    outs = small.generate([chat(small.tokenizer, cases[n][0]) for n in names], [cases[n][1] for n in names])
    assert small.engine.stats().num_preemptions > 0
    for name, out in zip(names, outs, strict=True):
        assert (out.token_ids, out.finish_reason) == (mixed[name].token_ids, "stop"), name


@pytest.mark.cuda
def test_structured_outputs_on_cuda_with_graphs(smollm_source) -> None:
    """Through the CUDA graphs and async scheduling, with random weights (float32, so that
    greedy is reproducible): constrained outputs match, unconstrained ones are the
    tokens they get alone, and the async path still runs for batches without a grammar."""
    from worker.llm import LLM

    llm = LLM(model=str(smollm_source.path), load_format="dummy", device="cuda", dtype="float32",
              max_num_seqs=16, num_kv_blocks=256)
    tok = llm.tokenizer
    free = [chat(tok, "What is the capital of France?"), chat(tok, "Write a haiku about the sea.")]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in free]
    assert llm.engine.num_async_steps > 0
    # Random weights would write digits for ever where a schema allows a free number:
    # these specs bound every value (bounded integers, maxLength strings, enums).
    person = {**PERSON, "required": PERSON["required"][:-1],
              "properties": {k: v for k, v in PERSON["properties"].items() if k != "score"}}
    cases = {name: params.structured for name, _, params in CASES}
    specs = [json_schema(person), json_schema(ORDER), cases["regex"], cases["choice"], cases["gbnf"],
             cases["lark"]]
    prompts = [chat(tok, f"Answer number {i}.") for i in range(len(specs))] + free
    params = [SamplingParams(max_tokens=300, temperature=0.0, structured=s) for s in specs] + [GREEDY, GREEDY]
    outs = llm.generate(prompts, params)
    for out in outs[:len(specs)]:
        assert out.finish_reason == "stop", out.text
    validate(json.loads(outs[0].text), person)
    validate(json.loads(outs[1].text), ORDER)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outs[2].text) and outs[3].text in ("yes", "no")
    assert re.fullmatch(r"The answer is [ABC]\.", outs[4].text)
    assert re.fullmatch(r"color: (red|blue)\.", outs[5].text)
    assert [o.token_ids for o in outs[-2:]] == alone


@pytest.mark.vllm
def test_structured_outputs_map_to_vllms() -> None:
    from worker.backends.vllm import structured_outputs_config, vllm_sampling

    def so(structured: StructuredOutput):
        return vllm_sampling(SamplingParams(structured=structured)).structured_outputs

    open_schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}}}
    closed = so(StructuredOutput(kind="json_schema", spec=json.dumps(open_schema))).json
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert so(StructuredOutput(kind="json_schema", spec=json.dumps(open_schema), strict=False)).json == open_schema
    assert so(StructuredOutput(kind="json_object")).json_object is True
    assert so(StructuredOutput(kind="regex", spec="[0-9]+")).regex == "[0-9]+"
    assert so(StructuredOutput(kind="choice", spec='["a", "b"]')).choice == ["a", "b"]
    assert so(StructuredOutput(kind="grammar", spec='root ::= "x"')).grammar == 'root ::= "x"'
    assert vllm_sampling(SamplingParams()).structured_outputs is None
    config = structured_outputs_config()
    assert (config.backend, config.disable_any_whitespace) == ("guidance", True)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_backend_gives_our_greedy_structured_outputs(mixed, offline, smollm_source, vllm_backend) -> None:
    """vLLM (its llguidance backend) and our engine agree token for token on greedy
    constrained requests, except that vLLM samples the EOS that is the only token left at
    a grammar's end, where ours stops without it (same text)."""
    from shared.model_source import eos_token_ids

    names = ["person", "order", "verdict", "regex", "choice", "lark", "gbnf"]
    cases = {name: (prompt, params) for name, prompt, params in CASES}
    backend = vllm_backend  # the session's (tests/conftest.py); left empty, as it came
    for name in names:
        backend.add_request(name, chat(offline.tokenizer, cases[name][0]), cases[name][1])
    got: dict[str, list[int]] = {name: [] for name in names}
    finish: dict[str, str] = {}
    while backend.has_unfinished_requests():
        for out in backend.step():
            got[out.request_id] += out.new_token_ids
            finish[out.request_id] = out.finish_reason or ""
    with pytest.raises(RequestRejected, match="cannot resume a structured output"):
        backend.add_request("resumed", [1, 2, 3], cases["order"][1], output_token_ids=[39428])
    assert not backend.has_unfinished_requests()
    eos = eos_token_ids(smollm_source.config)
    for name in names:
        ours = mixed[name].token_ids
        tail = got[name][len(ours):]
        assert got[name][:len(ours)] == ours and (tail == [] or (len(tail) == 1 and tail[0] in eos)), name
        assert finish[name] == "stop", name
