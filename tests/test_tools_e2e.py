"""Tool calling on the whole path with the real model: the official openai client ->
gateway process -> real Redis -> worker process (our engine, SmolLM2 float32 on CPU, the
grammar mask in its sampler) -> SSE. ``tool_choice`` ``required`` and a named function
make SmolLM2 call a tool whose arguments parse and validate against the tool's schema
(checked with jsonschema_rs, not with the grammar engine that produced them), in one body
and in a stream. The gateway side alone is tests/test_tools.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import jsonschema_rs
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.", "strict": True,
    "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
STOCK = {"type": "function", "function": {
    "name": "get_stock_price", "description": "Get the price of a stock.",
    "parameters": {"type": "object", "required": ["ticker"], "additionalProperties": False, "properties": {
        "ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"}, "days": {"type": "integer", "minimum": 1,
                                                                         "maximum": 30}}}}}
TOOLS = [WEATHER, STOCK]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(smollm_stack: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{smollm_stack}/v1", api_key="none", max_retries=0) as c:
        yield c


def _check(calls, allowed: list[dict]) -> None:
    """Every call names an offered tool and its arguments validate against its schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in allowed}
    assert calls, "no tool call"
    for call in calls:
        assert call.function.name in schemas, call
        arguments = json.loads(call.function.arguments)
        assert jsonschema_rs.validator_for(schemas[call.function.name]).is_valid(arguments), call


def _streamed(client: openai.OpenAI, **kwargs):
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        state.handle_chunk(chunk)
    return state.get_final_completion()


def test_required_and_named_tool_choice_give_valid_calls(client) -> None:
    named = {"type": "function", "function": {"name": "get_stock_price"}}
    asks = [{"tool_choice": "required", "temperature": 0.0},
            {"tool_choice": "required", "temperature": 1.0, "seed": 7},
            {"tool_choice": named, "temperature": 0.0},
            {"tool_choice": named, "temperature": 1.0, "seed": 3, "parallel_tool_calls": False}]
    common = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 120}
    with ThreadPoolExecutor(len(asks) + 1) as pool:  # one engine batch, not one request after another
        futures = [pool.submit(client.chat.completions.create, **common, **a) for a in asks]
        stream = pool.submit(_streamed, client, **common, **asks[0])
        results = [f.result() for f in futures]
        streamed = stream.result()
    for ask, result in zip(asks, results, strict=True):
        choice = result.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        _check(choice.message.tool_calls, [STOCK] if ask["tool_choice"] is named else TOOLS)
        if ask.get("parallel_tool_calls") is False:
            assert len(choice.message.tool_calls) == 1
    # Greedy: the stream assembles to the same calls as the body.
    whole = results[0].choices[0].message
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    assert (streamed.choices[0].message.content or None) == whole.content
