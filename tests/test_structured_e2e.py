"""Structured outputs on the whole path with the real model: the official openai client ->
gateway process -> real Redis -> worker process (our engine, SmolLM2 float32 on CPU, the
grammar mask in its sampler) -> SSE. Every constrained answer must parse and validate:
JSON against its schema (checked with jsonschema_rs, not with the grammar engine that
produced it), choices and regular expressions exactly. Also ``logit_bias`` through the
real sampler."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema_rs
import openai
import pytest

from worker.backends.base import RequestRejected

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 15}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "skills"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a software engineer called Ana as JSON."}]


@pytest.fixture()
def client(smollm_stack: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{smollm_stack}/v1", api_key="none", max_retries=0) as c:
        yield c


def _json_schema_format(strict: bool) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}


def together(*calls: Callable[[], Any]) -> list[Any]:
    """Run the calls at once (one engine batch instead of one request after another: the
    model's CPU steps are what this file's time goes to) and return their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def test_json_schema_answers_validate_greedy_and_sampled(client) -> None:
    def ask(temperature: float, seed: int | None) -> Any:
        return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=temperature,
                                              seed=seed, response_format=_json_schema_format(strict=True))

    for resp in together(lambda: ask(0.0, None), lambda: ask(1.0, 1), lambda: ask(1.0, 2)):
        text = resp.choices[0].message.content
        assert resp.choices[0].finish_reason == "stop", text
        assert jsonschema_rs.validator_for(PERSON).is_valid(json.loads(text)), text


def test_json_schema_stream_equals_non_stream(client) -> None:
    fmt = _json_schema_format(strict=False)
    whole, chunks = together(
        lambda: client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=0,
                                               response_format=fmt),
        lambda: list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=0,
                                                    response_format=fmt, stream=True)))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert jsonschema_rs.validator_for(PERSON).is_valid(json.loads(text)), text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_json_schema_on_completions_with_guided_json(client) -> None:
    resp = client.completions.create(model=MODEL, prompt="A person record in JSON:", max_tokens=200, temperature=0,
                                     extra_body={"guided_json": PERSON})
    assert jsonschema_rs.validator_for(PERSON).is_valid(json.loads(resp.choices[0].text)), resp.choices[0].text


def test_json_object_is_an_object(client) -> None:
    # Any object may run on until max_tokens ("a cat as a JSON object" counts 1, 2, 3, ...
    # in an array): this prompt gets a short one from SmolLM2.
    ask = [{"role": "user", "content": "Return a JSON object with two keys: name (a cat's name) and age (a number)."}]
    whole, chunks = together(
        lambda: client.chat.completions.create(model=MODEL, messages=ask, max_tokens=200, temperature=0,
                                               response_format={"type": "json_object"}),
        lambda: list(client.chat.completions.create(model=MODEL, messages=ask, max_tokens=200, temperature=0,
                                                    response_format={"type": "json_object"}, stream=True)))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].finish_reason == "stop" and text == whole.choices[0].message.content
    assert isinstance(json.loads(text), dict), text


def test_guided_choice(client) -> None:
    choices = ["positive", "negative", "neutral"]
    ask = [{"role": "user", "content": "Sentiment of 'I love this phone'?"}]
    for temperature in (0.0, 1.5):
        resp = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=10, temperature=temperature,
                                              seed=3, extra_body={"guided_choice": choices})
        assert resp.choices[0].message.content in choices and resp.choices[0].finish_reason == "stop"
    resp = client.completions.create(model=MODEL, prompt="The answer (yes or no):", max_tokens=5,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert resp.choices[0].text in ("yes", "no")


def test_guided_regex(client) -> None:
    pattern = r"[A-Z][a-z]{2,8}, [0-9]{4}-[0-9]{2}-[0-9]{2}"
    ask = [{"role": "user", "content": "Name a city and a date."}]
    for temperature, stream in ((0.0, False), (1.0, True)):
        out = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=30, temperature=temperature,
                                             seed=5, stream=stream, extra_body={"guided_regex": pattern})
        text = ("".join(c.choices[0].delta.content or "" for c in out if c.choices) if stream
                else out.choices[0].message.content)
        assert re.fullmatch(pattern, text), text


def test_logit_bias_forces_a_token(client, smollm_tokenizer) -> None:
    [forced] = smollm_tokenizer.encode(" banana", add_special_tokens=False)
    resp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                                     logit_bias={str(forced): 100})
    assert resp.choices[0].text == " banana" * 3


def test_engine_refuses_a_logit_bias_outside_the_vocabulary(offline) -> None:
    from shared.sampling import SamplingParams

    with pytest.raises(RequestRejected):
        offline.engine.add_request("bias-oov", [1, 2, 3], SamplingParams(logit_bias=((10**7, 1.0),)))
