"""The Responses API at the gateway (gateway/responses_api.py), against the test harness:
a real gateway under uvicorn, a real Redis, and a scripted worker whose output is known
(tests/gateway_harness.py), through the official ``openai`` client.

What needs a known output: text and tool calls become items in the order written, the
same in one body and in a stream; a stream's events come in OpenAI's order, numbered,
each valid against the SDK's event models; a worker that fails mid-stream ends it with
``response.failed`` and nothing is stored. What needs no model: each Responses input
reaches the worker as the prompt and sampling parameters of its chat equivalent (the
chat path runs it), and bad bodies are 400s naming the Responses field. The real model,
several gateways and tenants: tests/test_responses_e2e.py."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from shared import protocol
from shared.protocol import ErrorMessage
from tests.gateway_harness import ANSWER, MODEL, answer_tokens

pytestmark = pytest.mark.timeout(60)

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.", "strict": True,
           "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}
CALL_TEXT = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EVENTS = TypeAdapter(ResponseStreamEvent)


def _client(harness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=harness.base_url + "/v1", api_key="none", max_retries=0)


def _events(raw: str) -> list[dict]:
    """The SSE events of a Responses stream: ``event: <type>`` then ``data: <json>``."""
    events = []
    for block in raw.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}", block
        EVENTS.validate_python(event)
        events.append(event)
    return events


def _without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


async def test_text_and_tool_calls_are_items_in_order_in_a_body_and_a_stream(harness):
    async def calls(req, w):
        await answer_tokens(req, w, CALL_TEXT)
    harness.worker.behavior = calls
    body = {"model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER], "temperature": 0}
    r = await harness.http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    whole = r.json()
    Response.model_validate(whole)
    assert whole["status"] == "completed" and whole["object"] == "response" and whole["id"].startswith("resp_")
    message, call = whole["output"]
    assert message["type"] == "message" and message["status"] == "completed"
    assert message["content"] == [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"].startswith("call_")
    assert whole["usage"]["output_tokens"] == len(harness.worker.tok.encode(CALL_TEXT, add_special_tokens=False)) + 1

    r = await harness.http.post("/v1/responses", json={**body, "stream": True})
    events = _events(r.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    arguments = kinds.count("response.function_call_arguments.delta")
    assert deltas >= 1 and arguments >= 1
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", *["response.function_call_arguments.delta"] * arguments,
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Let me look."
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == \
        call["arguments"]
    final = events[-1]["response"]
    assert _without_ids(final["output"]) == _without_ids(whole["output"]) and final["usage"] == whole["usage"]
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == final["output"]
    # The SDK's own stream accumulator agrees (it checks item identities and indexes).
    async with _client(harness) as client, client.responses.stream(**body) as stream:
        async for _ in stream:
            pass
        assembled = await stream.get_final_response()
    assert assembled.output_text == "Let me look." and [o.type for o in assembled.output] == ["message", "function_call"]
    assert (assembled.output[1].name, assembled.output[1].arguments) == (call["name"], call["arguments"])


async def test_a_cut_output_is_incomplete(harness):
    async def cut(req, w):  # as a worker does at max_tokens
        ids = w.tok.encode(ANSWER, add_special_tokens=False)[:req.sampling.max_tokens]
        await w.send(req, 0, ids, "length")
    harness.worker.behavior = cut
    r = await harness.http.post("/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 2,
                                                       "stream": True})
    events = _events(r.text)
    final = events[-1]
    assert final["type"] == "response.incomplete" and final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete" and final["response"]["completed_at"] is None
    assert final["response"]["output"][0]["content"][0]["text"] == harness.worker.tok.decode(
        harness.worker.tok.encode(ANSWER, add_special_tokens=False)[:2])
    assert harness.worker.requests[-1].sampling.max_tokens == 2


async def test_a_worker_failing_mid_stream_is_response_failed_and_not_stored(harness):
    async def failing(req, w):
        await w.send(req, 0, w.tok.encode(" Paris", add_special_tokens=False))
        msg = ErrorMessage(request_id=req.request_id, attempt=0, worker_id="w1", status=500, message="engine died")
        await w.client.publish(req.reply_channel, protocol.encode(msg))
    harness.worker.behavior = failing
    r = await harness.http.post("/v1/responses", json={"model": MODEL, "input": "x", "stream": True})
    events = _events(r.text)
    assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "engine died"}
    [partial] = failed["response"]["output"]
    assert partial["status"] == "incomplete" and partial["content"][0]["text"] == " Paris"
    response_id = failed["response"]["id"]
    assert (await harness.http.get(f"/v1/responses/{response_id}")).status_code == 404
    # One body: the chat path's HTTP error.
    r = await harness.http.post("/v1/responses", json={"model": MODEL, "input": "x"})
    assert r.status_code == 500 and r.json()["error"]["message"] == "engine died"


async def test_a_client_leaving_mid_stream_aborts_and_stores_nothing(harness):
    async def endless(req, w):
        ids = w.tok.encode(ANSWER, add_special_tokens=False)
        for i in range(200):
            await w.send(req, i, ids[:1])
            await asyncio.sleep(0.05)
    harness.worker.behavior = endless
    harness.worker.ack = False
    async with harness.http.stream("POST", "/v1/responses", json={"model": MODEL, "input": "x", "stream": True},
                                   headers={"X-Request-Id": "leaver"}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "response.output_text.delta":
                break
    request_id = harness.worker.requests[-1].request_id
    assert request_id.startswith("resp-leaver")
    assert (await harness.worker.wait_for_abort(request_id, timeout_s=10)).reason == "client disconnected"
    assert harness.app.state.inferq.relay.num_in_flight == 0
    assert await harness.app.state.inferq.redis.keys(f"{harness.keys.namespace}:response:*") == []


CHAT_EQUIVALENTS = [
    pytest.param({"input": "What is the capital of France?"},
                 {"messages": [{"role": "user", "content": "What is the capital of France?"}]}, id="text"),
    pytest.param({"instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                  "input": [{"role": "developer", "content": "Answer in French."},
                            {"type": "message", "role": "user", "content": [
                                {"type": "input_text", "text": "Capital "}, {"type": "input_text", "text": "of Peru?"}]},
                            {"role": "assistant", "content": [{"type": "output_text", "text": "Lima."}]},
                            {"role": "user", "content": "And Chile?"}]},
                 {"max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                  "messages": [{"role": "system", "content": "Be brief."},
                               {"role": "developer", "content": "Answer in French."},
                               {"role": "user", "content": "Capital of Peru?"},
                               {"role": "assistant", "content": "Lima."}, {"role": "user", "content": "And Chile?"}]},
                 id="messages-instructions"),
    pytest.param({"tools": [WEATHER], "parallel_tool_calls": False,
                  "input": [{"role": "user", "content": "Weather in Paris?"},
                            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                             "arguments": "{\"city\": \"Paris\"}", "id": "fc_1", "status": "completed"},
                            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]},
                 {"tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
                  "parallel_tool_calls": False,
                  "messages": [{"role": "user", "content": "Weather in Paris?"},
                               {"role": "assistant", "content": None, "tool_calls": [
                                   {"id": "call_1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]},
                 id="function-call-output"),
    pytest.param({"input": "Name a color.", "text": {"format": {"type": "json_schema", "name": "color", "strict": True,
                                                                "schema": {"type": "object", "properties": {
                                                                    "color": {"type": "string"}}}}}},
                 {"messages": [{"role": "user", "content": "Name a color."}],
                  "response_format": {"type": "json_schema", "json_schema": {
                      "name": "color", "strict": True,
                      "schema": {"type": "object", "properties": {"color": {"type": "string"}}}}}},
                 id="json-schema"),
]


@pytest.mark.parametrize("responses_body,chat_body", CHAT_EQUIVALENTS)
async def test_a_responses_request_runs_as_its_chat_equivalent(harness, responses_body, chat_body):
    """The worker gets the same prompt and sampling parameters (structured output and
    all) from a Responses body as from its chat equivalent."""
    r = await harness.http.post("/v1/responses", json={"model": MODEL, **responses_body})
    assert r.status_code == 200, r.text
    r = await harness.http.post("/v1/chat/completions", json={"model": MODEL, **chat_body})
    assert r.status_code == 200, r.text
    via_responses, via_chat = harness.worker.requests[-2:]
    assert via_responses.prompt_token_ids == via_chat.prompt_token_ids
    assert via_responses.sampling == via_chat.sampling


BAD_BODIES = [
    ({"input": []}, "input"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tools": [{**WEATHER, "name": "no spaces"}]}, "tools"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nonsense"}}}},
     "text.format"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
    ({"input": "x" * 4000}, "input"),
]


@pytest.mark.parametrize("body,param", BAD_BODIES)
async def test_bad_bodies_are_400s_naming_the_responses_field(harness, body, param):
    async with _client(harness) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(model=MODEL, **body)
    assert info.value.status_code == 400 and info.value.param == param, info.value.body
    assert harness.worker.requests == []


async def test_unknown_previous_response_and_model_are_404s(harness):
    async with _client(harness) as client:
        for response_id in ("resp_" + "0" * 48, "not-an-id"):
            with pytest.raises(openai.NotFoundError) as info:
                await client.responses.create(model=MODEL, input="x", previous_response_id=response_id)
            assert info.value.param == "previous_response_id" and info.value.code == "response_not_found"
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(response_id)
            with pytest.raises(openai.NotFoundError):
                await client.responses.delete(response_id)
        with pytest.raises(openai.NotFoundError) as info:
            await client.responses.create(model="other", input="x")
        assert info.value.param == "model"
    metrics = harness.metrics()
    assert 'reason="unknown_response"} 2.0' in metrics and 'reason="unknown_model"} 1.0' in metrics
    r = await harness.http.get(f"/v1/responses/resp_{'0' * 48}", params={"stream": "true"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
