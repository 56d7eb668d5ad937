"""The Responses API end to end (docs/operations.md, "The Responses API"): the official
``openai`` client -> two gateway processes with API keys k1, k2 and an admin key, on one
real Redis -> one worker process (our engine, SmolLM2 float32 on CPU). Greedy.

A response answers what its chat equivalent answers (same text, same prompt tokens:
the Responses API is the chat path underneath), for a text input, messages with
instructions, a function tool round trip and a ``previous_response_id`` continuation
(whose prompt hits the prefix cache: ``cached_tokens``); a stream's events come in
OpenAI's order and build the stored response; ``max_output_tokens`` cuts to
``incomplete``; a JSON schema output parses and validates. Stored responses are found
through the other gateway, are 404 to another key (the same 404 as a missing id) and
after ``DELETE``, and are not stored with ``store: false``. The gateway side with a
scripted worker: tests/test_responses_gateway.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import openai
import pytest
from openai.types.responses import Response

from tests import processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MODEL = "SmolLM2-135M-Instruct"
ADMIN = "adm"
ASK = "What is the capital of France?"
WEATHER_PARAMETERS = {"type": "object", "required": ["city"], "additionalProperties": False,
                      "properties": {"city": {"type": "string", "maxLength": 30}}}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
           "strict": True, "parameters": WEATHER_PARAMETERS}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


class Stack:
    """Redis, one SmolLM2 worker, two gateways with keys k1, k2 and the admin key."""

    def __init__(self, tmp: Path) -> None:
        from shared.embedded_redis import EmbeddedRedis

        self.redis = EmbeddedRedis().start()
        self.worker = processes.start("worker", self.redis.url, "--max-num-seqs", "8", log_path=tmp / "worker.log")
        self.urls: list[str] = []
        self.gateways = []
        for i in range(2):
            port = processes.free_port()
            self.urls.append(f"http://127.0.0.1:{port}")
            self.gateways.append(processes.start("gateway", self.redis.url, "--port", str(port), "--api-key", "k1",
                                                 "--api-key", "k2", "--admin-api-key", ADMIN,
                                                 log_path=tmp / f"gateway{i}.log"))
        self._clients: dict[tuple[str, int], openai.OpenAI] = {}

    def client(self, key: str = "k1", gateway: int = 0) -> openai.OpenAI:
        if (key, gateway) not in self._clients:
            self._clients[key, gateway] = openai.OpenAI(base_url=self.urls[gateway] + "/v1", api_key=key,
                                                        max_retries=0, timeout=300)
        return self._clients[key, gateway]

    def http(self, method: str, path: str, key: str | None, gateway: int = 0, **kwargs: Any) -> httpx.Response:
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        return httpx.request(method, self.urls[gateway] + path, headers=headers, timeout=300, trust_env=False,
                             **kwargs)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        for proc in (*self.gateways, self.worker):
            processes.stop(proc)
        self.redis.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("responses"))
    try:
        for url, proc in zip(s.urls, s.gateways, strict=True):
            processes.wait_for_gateway(url, proc)
        processes.wait_for_workers(s.redis.url, 1, [s.worker])
        yield s
    finally:
        s.close()


def _create(stack: Stack, key: str = "k1", gateway: int = 0, **body: Any) -> Response:
    """``responses.create``, the raw body checked against the SDK's ``Response`` model
    (validated, not merely constructed) and returned as it."""
    raw = stack.client(key, gateway).responses.with_raw_response.create(model=MODEL, **body)
    return Response.model_validate(raw.http_response.json())


def _chat(stack: Stack, messages: list[dict[str, Any]], max_tokens: int, **body: Any) -> Any:
    return stack.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, **body)


@pytest.mark.parametrize("body,messages", [
    ({"input": ASK}, [{"role": "user", "content": ASK}]),
    ({"instructions": "Answer with one word.",
      "input": [{"role": "user", "content": [{"type": "input_text", "text": "Name one planet."}]}]},
     [{"role": "system", "content": "Answer with one word."}, {"role": "user", "content": "Name one planet."}]),
])
def test_a_response_answers_what_its_chat_equivalent_answers(stack, body, messages):
    response = _create(stack, max_output_tokens=16, temperature=0, **body)
    chat = _chat(stack, messages, 16)
    status = "completed" if chat.choices[0].finish_reason == "stop" else "incomplete"
    assert response.status == status and response.object == "response" and response.id.startswith("resp_")
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == status
    assert response.output_text == chat.choices[0].message.content and response.output_text
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert 0 <= usage.input_tokens_details.cached_tokens <= usage.input_tokens
    assert (response.instructions, response.max_output_tokens, response.temperature) == (
        body.get("instructions"), 16, 0.0)


def test_a_stream_numbers_its_events_in_order_and_stores_what_it_built(stack):
    whole = _create(stack, input=ASK, max_output_tokens=24, temperature=0)
    events = list(stack.client("k1", gateway=1).responses.create(model=MODEL, input=ASK, max_output_tokens=24,
                                                                 temperature=0, stream=True))
    kinds = [e.type for e in events]
    num_deltas = kinds.count("response.output_text.delta")
    assert num_deltas >= 2
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * num_deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    created, completed = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.usage is None
    assert completed.id == created.id and completed.status == "completed" and completed.output_text == text
    assert completed.usage.output_tokens == whole.usage.output_tokens
    assert events[-2].item == completed.output[0]
    # Stored before response.completed was sent, and found through the other gateway.
    assert stack.client("k1", gateway=0).responses.retrieve(completed.id) == completed


def test_max_output_tokens_cuts_the_response_to_incomplete(stack):
    response = _create(stack, input=ASK, max_output_tokens=3, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"
    assert response.completed_at is None
    events = list(stack.client().responses.create(model=MODEL, input=ASK, max_output_tokens=3, temperature=0,
                                                  stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == response.output_text


def test_a_json_schema_output_parses_and_validates(stack):
    schema = {"type": "object", "required": ["city", "country"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string",
                                                                                   "maxLength": 20}}}
    response = _create(stack, input="Name a large city and its country, as JSON.", max_output_tokens=60,
                       temperature=0, text={"format": {"type": "json_schema", "name": "city", "strict": True,
                                                       "schema": schema}})
    assert response.status == "completed", response.output_text
    assert jsonschema_rs.validator_for(schema).is_valid(json.loads(response.output_text)), response.output_text
    assert response.text.format.type == "json_schema" and response.text.format.name == "city"


def test_a_function_call_round_trip_answers_as_chat_does(stack):
    ask = {"role": "user", "content": "What is the weather like in Paris today?"}
    first = _create(stack, input=[ask], tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                    max_output_tokens=60, temperature=0)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert jsonschema_rs.validator_for(WEATHER_PARAMETERS).is_valid(json.loads(call.arguments)), call
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'}
    # The client sends the call back as the SDK returned it (OpenAI's documented loop).
    second = _create(stack, input=[ask, call, result], tools=[WEATHER], max_output_tokens=12, temperature=0)
    chat = _chat(stack, [ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]}], 12, tools=[CHAT_WEATHER])
    message = chat.choices[0].message
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == (message.content or "")
    assert [(o.name, o.arguments) for o in second.output if o.type == "function_call"] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_previous_response_id_continues_the_conversation_through_another_gateway(stack):
    first = _create(stack, input="My name is Ada. Say hello to me.", max_output_tokens=12, temperature=0)
    second = _create(stack, gateway=1, previous_response_id=first.id, input="What is my name?",
                     max_output_tokens=8, temperature=0)
    chat = _chat(stack, [{"role": "user", "content": "My name is Ada. Say hello to me."},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "What is my name?"}], 8)
    assert second.previous_response_id == first.id
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # The first turn's prompt is in the worker's prefix cache: at least one 16-token block.
    assert 16 <= second.usage.input_tokens_details.cached_tokens <= second.usage.input_tokens
    # A third turn chains on through the second (which holds the whole conversation).
    third = _create(stack, previous_response_id=second.id, input="Thanks.", max_output_tokens=2, temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_store_false_stores_nothing(stack):
    response = _create(stack, input="Hi", max_output_tokens=2, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        stack.client().responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as info:
        stack.client().responses.create(model=MODEL, input="Hi", previous_response_id=response.id)
    assert info.value.param == "previous_response_id"


def _missing(stack: Stack, method: str, response_id: str, key: str, gateway: int) -> None:
    """``response_id`` answers ``key`` the 404 of an id that does not exist, word for word."""
    unknown = "resp_" + "0" * 48
    r = stack.http(method, f"/v1/responses/{response_id}", key, gateway)
    missing = stack.http(method, f"/v1/responses/{unknown}", key, gateway)
    assert r.status_code == missing.status_code == 404, (r.text, missing.text)
    assert r.json() == json.loads(missing.text.replace(unknown, response_id))


def test_another_key_gets_the_404_of_a_missing_response_and_delete_works_anywhere(stack):
    response = _create(stack, input="Hi", max_output_tokens=2)
    for gateway in (0, 1):
        for method in ("GET", "DELETE"):
            _missing(stack, method, response.id, "k2", gateway)
        with pytest.raises(openai.NotFoundError) as info:
            stack.client("k2", gateway).responses.create(model=MODEL, input="Hi", previous_response_id=response.id)
        assert info.value.param == "previous_response_id"
        assert stack.client(ADMIN, gateway).responses.retrieve(response.id).id == response.id
    assert stack.client("k1", 1).responses.retrieve(response.id) == response  # not deleted by k2
    stack.client("k1", 1).responses.delete(response.id)
    for gateway in (0, 1):
        for method in ("GET", "DELETE"):
            _missing(stack, method, response.id, "k1", gateway)


@pytest.mark.parametrize("key", [None, "wrong"])
def test_a_missing_or_wrong_key_is_401(stack, key):
    for method, path, body in [("POST", "/v1/responses", {"model": MODEL, "input": "Hi"}),
                               ("GET", "/v1/responses/resp_" + "0" * 48, None),
                               ("DELETE", "/v1/responses/resp_" + "0" * 48, None)]:
        r = stack.http(method, path, key, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    if key is not None:
        with pytest.raises(openai.AuthenticationError):
            stack.client(key).responses.create(model=MODEL, input="Hi")


@pytest.mark.parametrize("body,param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "Hi", "background": True}, "background"),
])
def test_unsupported_input_is_a_400_naming_the_param(stack, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        stack.client().responses.create(model=MODEL, **body)
    assert info.value.param == param, info.value.body
