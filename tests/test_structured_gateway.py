"""The gateway side of issue 14's structured outputs and small items: every way of asking
for a structured output reaches the worker as the right ``StructuredOutput``; bad ones
are 400s naming the field, with nothing written to the request stream; ``logit_bias``
(wire form, validation, and the sampler on the CPU); ``GET /v1/models/{id}``; vLLM's
``/tokenize`` and ``/detokenize`` with the real tokenizer (fixtures:
gateway_harness.py, a fake worker on a real Redis that records each request).
"""

from __future__ import annotations

import functools
import json
import threading

import openai
import pytest
import redis.asyncio as aioredis
import torch

from gateway import structured as gateway_structured
from shared.sampling import SamplingParams, StructuredOutput
from tests.gateway_harness import MODEL, answer_tokens
from worker.engine.sampler import Sampler

pytestmark = pytest.mark.timeout(60)

SCHEMA = {"type": "object", "required": ["name", "age"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}
#: ``SCHEMA`` as it travels: sorted keys, no whitespace.
CANONICAL = json.dumps(SCHEMA, sort_keys=True, separators=(",", ":"))
CHAT = [{"role": "user", "content": "Describe a person."}]


def _client(harness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=harness.base_url + "/v1", api_key="none", max_retries=0)


async def _nothing_enqueued(harness) -> bool:
    """True when no entry was ever added to the request stream (its last id is still 0-0)."""
    client = aioredis.from_url(harness.redis.url)
    try:
        info = await client.xinfo_stream(harness.keys.requests_stream(MODEL))
    finally:
        await client.aclose()
    return info["last-generated-id"] in (b"0-0", "0-0")


# -- the wire form of each way of asking ----------------------------------------------------

async def test_openai_client_response_format_json_schema_and_json_object(harness):
    client = _client(harness)
    await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "description": "d", "schema": SCHEMA}})
    await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8,
                                         response_format={"type": "json_object"})
    await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, response_format={"type": "text"})
    await client.close()
    got = [r.sampling.structured for r in harness.worker.requests]
    assert got == [StructuredOutput(kind="json_schema", spec=CANONICAL, strict=True),
                   StructuredOutput(kind="json_schema", spec=CANONICAL, strict=False),  # OpenAI's default
                   StructuredOutput(kind="json_object", spec="", strict=False),
                   None]


async def test_openai_client_parse_with_a_pydantic_model(harness):
    """``client.chat.completions.parse(response_format=Model)``, as instructor-style code
    calls it: the strict schema the client builds reaches the worker, the answer parses."""
    import pydantic

    class City(pydantic.BaseModel):
        name: str
        population: int

    harness.worker.behavior = functools.partial(answer_tokens, text='{"name":"Paris","population":2100000}')
    client = _client(harness)
    resp = await client.chat.completions.parse(model=MODEL, messages=CHAT, max_tokens=30, response_format=City)
    await client.close()
    assert resp.choices[0].message.parsed == City(name="Paris", population=2100000)
    sent = harness.worker.requests[-1].sampling.structured
    assert sent.kind == "json_schema" and sent.strict
    assert json.loads(sent.spec)["required"] == ["name", "population"]


@pytest.mark.parametrize("extra,expected", [
    ({"guided_json": SCHEMA}, StructuredOutput(kind="json_schema", spec=CANONICAL, strict=False)),
    ({"guided_json": json.dumps(SCHEMA, indent=2)}, StructuredOutput(kind="json_schema", spec=CANONICAL,
                                                                      strict=False)),
    ({"guided_regex": r"\d{3}-[a-z]+"}, StructuredOutput(kind="regex", spec=r"\d{3}-[a-z]+", strict=False)),
    ({"guided_choice": ["yes", "no", "a|b"]}, StructuredOutput(kind="choice", spec='["yes","no","a|b"]',
                                                               strict=False)),
    ({"guided_grammar": 'root ::= "x" | "y"'}, StructuredOutput(kind="grammar", spec='root ::= "x" | "y"',
                                                                strict=False)),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
     StructuredOutput(kind="json_schema", spec=CANONICAL, strict=True)),
    ({"structured_outputs": {"regex": "a+"}}, StructuredOutput(kind="regex", spec="a+", strict=False)),
    ({"structured_outputs": {"choice": ["x"]}}, StructuredOutput(kind="choice", spec='["x"]', strict=False)),
    ({"structured_outputs": {"grammar": 'start: "z"'}}, StructuredOutput(kind="grammar", spec='start: "z"',
                                                                         strict=False)),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     StructuredOutput(kind="json_object", spec="", strict=False)),
])
async def test_openai_client_vllm_extra_body(harness, extra, expected):
    client = _client(harness)
    await client.completions.create(model=MODEL, prompt="Answer:", max_tokens=8, extra_body=extra)
    stream = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, extra_body=extra,
                                                  stream=True)
    async for _ in stream:  # read to the end: the request has reached the worker (no race with its pull)
        pass
    await client.close()
    assert [r.sampling.structured for r in harness.worker.requests] == [expected, expected]


async def test_equal_schemas_travel_as_equal_text(harness):
    reordered = {"properties": dict(reversed(SCHEMA["properties"].items())), "required": ["name", "age"],
                 "type": "object"}
    for schema in (SCHEMA, reordered):
        r = await harness.http.post("/v1/completions", json={
            "model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})
        assert r.status_code == 200, r.text
    first, second = (r.sampling.structured.spec for r in harness.worker.requests)
    assert first == second == CANONICAL


async def test_the_grammar_is_checked_on_the_encode_pool(harness, monkeypatch):
    threads = []
    real_check = gateway_structured.grammars.check

    def recording_check(structured, param="response_format", tokenizer=None):
        threads.append(threading.current_thread().name)
        assert tokenizer is not None  # over the model's vocabulary, as the worker compiles it
        real_check(structured, param, tokenizer)

    monkeypatch.setattr(gateway_structured.grammars, "check", recording_check)
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "guided_regex": "a+"})
    assert r.status_code == 200, r.text
    assert len(threads) == 1 and threads[0].startswith("inferq-encode"), threads


# -- refused: 400 naming the field, nothing enqueued ------------------------------------------

def _json_schema(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


@pytest.mark.parametrize("extra,param,words", [
    (_json_schema({"type": "array", "uniqueItems": True}), "response_format", "uniqueItems"),
    (_json_schema({"type": "string", "not": {"const": "a"}, "x-guidance": {"lenient": True}}), "response_format",
     "not"),
    (_json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}), "response_format", "strin"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "shema": {}}}}, "response_format",
     "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "type"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "s", "schema": {}}}}, "response_format",
     "json_schema"),
    ({"guided_json": {"type": "object", "if": {}, "then": {}}}, "guided_json", "if"),
    ({"guided_json": "{not json"}, "guided_json", "JSON"),
    ({"guided_json": "[1, 2]"}, "guided_json", "object"),
    ({"guided_json": 7}, "guided_json", None),
    ({"guided_regex": "(ab"}, "guided_regex", "unclosed"),
    ({"guided_regex": r"(a)\1"}, "guided_regex", "backreferences"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_choice": ["a", 1]}, "guided_choice", None),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "unclosed"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ({"structured_outputs": {"json": {}, "disable_fallback": True}}, "structured_outputs", "disable_fallback"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "at most one"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "structured_outputs", "at most one"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token id"),
    ({"logit_bias": {"-3": 1}}, "logit_bias", "token id"),
    ({"logit_bias": {"49152": 1}}, "logit_bias", "49152"),
    ({"logit_bias": {"7": 1, "007": 2}}, "logit_bias", "repeated"),
    ({"logit_bias": {"7": 100.5}}, "logit_bias", None),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "1024"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_bad_constraint_is_400_naming_the_field_and_nothing_is_enqueued(harness, path, extra, param, words):
    body = {"model": MODEL, **({"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}), **extra}
    for stream in (False, True):
        r = await harness.http.post(path, json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
        assert words is None or words in err["message"], err
    assert harness.worker.requests == [] and await _nothing_enqueued(harness)
    assert 'reason="invalid_request"' in harness.metrics()


async def test_openai_client_sees_the_400(harness):
    client = _client(harness)
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"guided_regex": "(?=a)a"})
    await client.close()
    assert info.value.body["param"] == "guided_regex" and "look-around" in info.value.body["message"]
    assert await _nothing_enqueued(harness)


# -- logit_bias and user -----------------------------------------------------------------------

async def test_logit_bias_and_user_on_the_wire(harness):
    client = _client(harness)
    await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, user="someone",
                                         logit_bias={"500": 5, "3": -100, "49151": 0.25})
    await client.completions.create(model=MODEL, prompt="x", max_tokens=4, logit_bias={"12": 100})
    await client.completions.create(model=MODEL, prompt="x", max_tokens=4)
    await client.close()
    assert [r.sampling.logit_bias for r in harness.worker.requests] == [
        ((3, -100.0), (500, 5.0), (49151, 0.25)), ((12, 100.0),), ()]


def test_logit_bias_outside_its_range_is_invalid():
    for bias in (((1, 100.5),), ((-1, 1.0),), ((1, float("nan")),)):
        with pytest.raises(ValueError) as info:
            SamplingParams(logit_bias=bias).validate()
        assert info.value.param == "logit_bias"
    SamplingParams(logit_bias=((0, -100.0), (5, 100.0))).validate()


def _sample(params: list[SamplingParams], logits: torch.Tensor) -> list[int]:
    n = len(params)
    return Sampler(torch.device("cpu"), seed=1)(logits.clone(), [f"r{i}" for i in range(n)], params, [[1]] * n,
                                                 [1] * n)


def test_logit_bias_forces_and_bans_in_the_sampler():
    torch.manual_seed(0)
    logits = torch.randn(4, 64) * 3
    best = logits.argmax(-1).tolist()
    low = logits.argmin(-1).tolist()
    greedy = [SamplingParams(temperature=0.0, logit_bias=((low[0], 100.0),)),
              SamplingParams(temperature=0.0, logit_bias=((best[1], -100.0),)),
              SamplingParams(temperature=0.0),  # a row without bias is untouched
              SamplingParams(temperature=0.0, logit_bias=((best[3], -100.0), (low[3], 100.0)))]
    got = _sample(greedy, logits)
    assert got[0] == low[0] and got[1] != best[1] and got[2] == best[2] and got[3] == low[3]
    assert got[1] == logits[1].topk(2).indices[1].item()  # the runner-up once the best is banned
    # Sampled, not greedy: a banned token is never drawn, a forced one always is.
    hot = logits[:1].repeat(300, 1)
    banned = _sample([SamplingParams(temperature=1.0, logit_bias=((best[0], -100.0),))] * 300, hot)
    forced = _sample([SamplingParams(temperature=1.0, logit_bias=((low[0], 100.0),))] * 300, hot)
    assert best[0] not in banned and len(set(banned)) > 1 and set(forced) == {low[0]}


# -- GET /v1/models/{id} ------------------------------------------------------------------------

async def test_retrieve_model(harness):
    listed = (await harness.http.get("/v1/models")).json()["data"][0]
    r = await harness.http.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json() == listed
    r = await harness.http.get("/v1/models/org/not-served")
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == "model_not_found" and "org/not-served" in err["message"]
    client = _client(harness)
    model = await client.models.retrieve(MODEL)
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-9")
    await client.close()
    assert model.id == MODEL and model.owned_by == "inferq"


# -- /tokenize and /detokenize --------------------------------------------------------------------

async def test_tokenize_detokenize_round_trip(harness, tokenizer):
    text = "Hello world, ça va? 東京"
    r = await harness.http.post("/tokenize", json={"model": MODEL, "prompt": text})
    body = r.json()
    expected = tokenizer(text)["input_ids"]
    assert r.status_code == 200 and body == {"count": len(expected), "max_model_len": 256, "tokens": expected}
    r = await harness.http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    r = await harness.http.post("/tokenize", json={"prompt": "Hi there", "add_special_tokens": False,
                                                    "return_token_strs": True})
    assert r.json()["token_strs"] == tokenizer.convert_ids_to_tokens(tokenizer.encode("Hi there",
                                                                                      add_special_tokens=False))


async def test_tokenize_messages_uses_the_chat_template(harness, tokenizer):
    for add_generation_prompt in (True, False):
        r = await harness.http.post("/tokenize", json={"model": MODEL, "messages": CHAT,
                                                        "add_generation_prompt": add_generation_prompt})
        expected = list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt,
                                                      tokenize=True)["input_ids"])
        assert r.status_code == 200 and r.json()["tokens"] == expected
        text = (await harness.http.post("/detokenize", json={"tokens": expected})).json()["prompt"]
        assert text == tokenizer.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt,
                                                     tokenize=False)


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "x", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/detokenize", {"model": MODEL, "tokens": [1, 49152]}, 400, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"model": "gpt-9", "tokens": [1]}, 404, "model"),
    ("/detokenize", {"model": MODEL, "tokens": "1 2"}, 400, "tokens"),
])
async def test_tokenizer_endpoints_refuse_bad_bodies(harness, path, body, status, param):
    r = await harness.http.post(path, json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


async def test_tokenizer_endpoints_are_documented(harness):
    doc = (await harness.http.get("/openapi.json")).json()
    for path, model in (("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
    assert "/v1/models/{model_id}" in doc["paths"]
    assert "response_format" in doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]


# -- shared/grammars.py: what a grammar lets through (llguidance on the real vocabulary) -------

@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer)


def _accepts(ll_tokenizer, tokenizer, structured: StructuredOutput, text: str) -> bool:
    import llguidance

    from shared.grammars import grammar_for

    matcher = llguidance.LLMatcher(ll_tokenizer, grammar_for(structured), log_level=0)
    ok = all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return ok and not matcher.is_error() and matcher.is_accepting()


def test_strict_closes_objects_and_the_schema_is_enforced_either_way(ll_tokenizer, tokenizer):
    schema = json.dumps({"type": "object", "required": ["a"], "properties": {
        "a": {"type": "integer", "maximum": 9}, "n": {"type": "object", "properties": {"b": {"type": "string"}}}},
        "x-guidance": {"item_separator": ";", "whitespace_flexible": True}})  # ignored: ours win
    cases = {'{"a":1}': (True, True), '{"a":1,"n":{"b":"x"}}': (True, True), '{"a":1,"z":2}': (False, True),
             '{"a":1,"n":{"b":"x","c":1}}': (False, True), '{"a":10}': (False, False), '{"n":{}}': (False, False),
             '{"a": 1}': (False, False), '{"a":1;"n":{}}': (False, False)}
    for text, (strict_ok, loose_ok) in cases.items():
        for strict, ok in ((True, strict_ok), (False, loose_ok)):
            got = _accepts(ll_tokenizer, tokenizer, StructuredOutput(kind="json_schema", spec=schema, strict=strict),
                           text)
            assert got == ok, (text, strict)


def test_choice_matches_exactly_its_strings(ll_tokenizer, tokenizer):
    choices = ["a.b", "x|y", "(z)", "[q]*", "é ü", "new\nline"]
    structured = StructuredOutput(kind="choice", spec=json.dumps(choices))
    for text in choices:
        assert _accepts(ll_tokenizer, tokenizer, structured, text), text
    for text in ("a", "axb", "x", "z", "[q]", "é"):
        assert not _accepts(ll_tokenizer, tokenizer, structured, text), text
