"""Tool calling at the gateway (issue 14, item 2): the tools and the history reach the
prompt; ``required`` and a named function travel as a grammar that accepts exactly the
calls of the offered tools with valid arguments; the model's Hermes ``<tool_call>`` blocks
(or, under a Llama 3 template, its JSON calls) become ``tool_calls`` in one body and in a
stream of argument fragments that the official openai client assembles; bad requests are 400s with nothing enqueued (fixtures: gateway_harness.py, a fake
worker on a real Redis that records each request and answers chosen text). The real
model is in test_tools_e2e.py."""

from __future__ import annotations

import functools
import json

import llguidance
import llguidance.hf
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from shared.grammars import grammar_for
from tests.gateway_harness import MODEL, answer_tokens, sse_events
from tests.test_structured_gateway import _nothing_enqueued
from tests.test_tool_parser import LLAMA31_TOOLS_TEMPLATE

pytestmark = pytest.mark.timeout(60)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.", "strict": True,
    "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL_UTC = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
#: A fake answer: content, two calls, and a block that is not a call (stays content).
ANSWER = f"Let me check.\n{CALL_PARIS}\n{CALL_UTC}"
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "UTC"})]


@pytest.fixture(autouse=True)
def _longer_context(harness):
    """The harness serves 256 tokens; the tools' system prompt alone is about 300."""
    harness.app.state.inferq.max_model_len = 2048


def _client(harness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=harness.base_url + "/v1", api_key="none", max_retries=0)


def _answer(harness, text: str) -> None:
    harness.worker.behavior = functools.partial(answer_tokens, text=text)


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or []]


# -- the prompt ---------------------------------------------------------------------------------

async def test_tools_and_tool_history_reach_the_prompt(harness, tokenizer):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    client = _client(harness)
    for choice in ("auto", "none"):
        await client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice=choice,
                                             max_tokens=4)
    await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
    await client.close()
    with_tools, with_none, without = [tokenizer.decode(r.prompt_token_ids) for r in harness.worker.requests]
    assert with_tools == with_none  # "none" still offers the tools (vLLM's default); it only parses nothing
    # SmolLM2's template does not render ``tools``: gateway/tools.py writes Qwen 2.5's system prompt.
    offered = with_tools.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in offered.split("\n")] == TOOLS
    assert with_tools.startswith("<|im_start|>system\n# Tools\n")
    assert f"<|im_start|>assistant\n{CALL_PARIS}<|im_end|>" in with_tools
    assert "<|im_start|>user\n<tool_response>\n18 degrees, sunny\n</tool_response><|im_end|>" in with_tools
    assert "<tools>" not in without and "SmolLM" in without  # no tools: the template's own system prompt


#: A chat template that renders ``tools`` itself (as Qwen 2.5's does), reduced to what it shows.
TOOLS_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
                  "{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                  "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}|{% endfor %}")


async def test_a_template_that_renders_tools_gets_them_as_they_are(harness, tokenizer):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"UTC"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    saved = tokenizer.chat_template
    tokenizer.chat_template = TOOLS_TEMPLATE
    try:
        r = await harness.http.post("/v1/chat/completions", json={"model": MODEL, "messages": history,
                                                                  "tools": TOOLS, "max_tokens": 4})
    finally:
        tokenizer.chat_template = saved
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(harness.worker.requests[0].prompt_token_ids)
    # The arguments reach the template as a JSON value (vLLM's convention), not as JSON text.
    assert prompt == ('TOOLS:get_weather;get_time;|user:What is the weather in Paris?|'
                      'assistant:CALL get_time {"zone": "UTC"}|tool:noon|')


# -- enforcement: the grammar on the wire -------------------------------------------------------

def _accepts(grammar: str, tokenizer, text: str) -> bool:
    """True when ``text`` is a whole sentence of the llguidance ``grammar``."""
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), grammar)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


#: The calls as a forcing grammar writes them: arguments in compact JSON.
GRAMMAR_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","unit":"celsius"}}\n</tool_call>'
GRAMMAR_UTC = '<tool_call>\n{"name": "get_time", "arguments": {"zone":"UTC"}}\n</tool_call>'


@pytest.mark.parametrize("tool_choice,parallel,accepted,refused", [
    ("required", True, [GRAMMAR_PARIS, GRAMMAR_UTC, f"{GRAMMAR_PARIS}\n{GRAMMAR_UTC}"],
     ["Sure.", f"Sure. {GRAMMAR_PARIS}", GRAMMAR_PARIS.replace("celsius", "kelvin"),
      GRAMMAR_PARIS.replace(',"unit":"celsius"', ""), GRAMMAR_UTC.replace("get_time", "get_date"),
      CALL_PARIS]),  # arguments with spaces: not the compact form
    ("required", False, [GRAMMAR_PARIS, GRAMMAR_UTC], [f"{GRAMMAR_PARIS}\n{GRAMMAR_UTC}"]),
    ({"type": "function", "function": {"name": "get_time"}}, True, [GRAMMAR_UTC, f"{GRAMMAR_UTC}\n{GRAMMAR_UTC}"],
     [GRAMMAR_PARIS, "UTC"]),
])
async def test_forcing_tool_choice_travels_as_a_grammar_of_the_offered_calls(harness, tokenizer, tool_choice,
                                                                             parallel, accepted, refused):
    client = _client(harness)
    await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                         parallel_tool_calls=parallel, max_tokens=4)
    await client.close()
    structured = harness.worker.requests[0].sampling.structured
    assert structured is not None and structured.kind == "grammar"
    grammar = grammar_for(structured)  # what the worker compiles (worker/structured/cache.py)
    for text in accepted:
        assert _accepts(grammar, tokenizer, text), text
    for text in refused:
        assert not _accepts(grammar, tokenizer, text), text
    # A strict tool's arguments are closed: no property its schema does not name.
    assert not _accepts(grammar, tokenizer, GRAMMAR_PARIS.replace('"celsius"}', '"celsius","x":1}'))


async def test_auto_and_none_are_not_constrained(harness):
    client = _client(harness)
    for choice in ("auto", "none"):
        await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                             max_tokens=4)
    await client.close()
    assert [r.sampling.structured for r in harness.worker.requests] == [None, None]


# -- parsing: one body and a stream --------------------------------------------------------------

async def test_tool_calls_in_one_body(harness):
    _answer(harness, ANSWER)
    client = _client(harness)
    r = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check." and _calls(message.tool_calls) == EXPECTED_CALLS
    ids = [c.id for c in message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert all(c.type == "function" for c in message.tool_calls)
    # Only calls: content is null. One call at most without parallel_tool_calls.
    _answer(harness, CALL_PARIS)
    r = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    assert r.choices[0].message.content is None and _calls(r.choices[0].message.tool_calls) == EXPECTED_CALLS[:1]
    _answer(harness, ANSWER)
    r = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False)
    assert _calls(r.choices[0].message.tool_calls) == EXPECTED_CALLS[:1]
    await client.close()


async def test_no_parsing_without_tools_or_with_none(harness):
    _answer(harness, ANSWER)
    client = _client(harness)
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        r = await client.chat.completions.create(model=MODEL, messages=ASK, **extra)
        assert r.choices[0].message.content == ANSWER and r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "stop"
    await client.close()


async def test_a_block_that_is_not_a_call_stays_content(harness):
    text = "<tool_call>\nnot json\n</tool_call> and <tool_call>{\"name\": 3}</tool_call>"
    _answer(harness, text)
    client = _client(harness)
    r = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    await client.close()
    assert r.choices[0].message.content == text and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("answer,content,calls,parallel", [
    (ANSWER, "Let me check.", EXPECTED_CALLS, True),
    (ANSWER, "Let me check.", EXPECTED_CALLS[:1], False),
    (CALL_PARIS, None, EXPECTED_CALLS[:1], True),
    ("No tool needed <tool", "No tool needed <tool", [], True),  # a held-back tag prefix is released
])
async def test_streamed_tool_calls_assemble_as_the_one_body(harness, answer, content, calls, parallel):
    _answer(harness, answer)
    client = _client(harness)
    state = ChatCompletionStreamState(input_tools=TOOLS)
    stream = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True,
                                                  parallel_tool_calls=parallel)
    async for chunk in stream:
        state.handle_chunk(chunk)
    one = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=parallel)
    await client.close()
    streamed = state.get_final_completion().choices[0]
    # The stream's fragments join to exactly the body's arguments text.
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == \
        [(c.function.name, c.function.arguments) for c in one.choices[0].message.tool_calls or []]
    for choice in (streamed, one.choices[0]):
        assert (choice.message.content or None) == content and _calls(choice.message.tool_calls) == calls
        assert choice.finish_reason == ("tool_calls" if calls else "stop")
    if calls and calls[0][0] == "get_weather":  # a strict tool: the client parsed its arguments too
        assert streamed.message.tool_calls[0].function.parsed_arguments == calls[0][1]


async def test_stream_chunks_are_openai_tool_call_deltas(harness):
    """OpenAI's shape: a call's first delta has index, id, type and the name; then its
    arguments come in fragments (one token at a time here) that join to the body's."""
    _answer(harness, ANSWER)
    r = await harness.http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": TOOLS,
                                                              "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"][0] for e in events[:-1]]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    tool_deltas = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    assert all(len(d["delta"].get("tool_calls", [])) <= 1 for d in deltas)
    assert content == "Let me check."  # the newline before the first block is not content
    firsts = [t for t in tool_deltas if "id" in t]
    assert [t["index"] for t in firsts] == [0, 1]
    assert all(t["id"].startswith("call_") and t["type"] == "function" for t in firsts)
    assert [t["function"]["name"] for t in firsts] == ["get_weather", "get_time"]
    rest = [t for t in tool_deltas if "id" not in t]
    assert all(set(t) == {"index", "function"} and set(t["function"]) == {"arguments"} for t in rest)
    assert len(rest) > 5  # the arguments are streamed, not sent once the call is over
    assert [t["index"] for t in tool_deltas] == sorted(t["index"] for t in tool_deltas)
    joined = ["".join(t["function"].get("arguments", "") for t in tool_deltas if t["index"] == i) for i in (0, 1)]
    assert joined == ['{"city": "Paris", "unit": "celsius"}', '{"zone": "UTC"}']  # the model's text
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["tool_calls"]
    assert "<tool_call>" not in content and "get_time" not in content


# -- Llama 3's JSON format ------------------------------------------------------------------------

@pytest.fixture
def llama3_template(tokenizer):
    """The served tokenizer with Llama 3.1's tools template (an excerpt: test_tool_parser.py)."""
    saved = tokenizer.chat_template
    tokenizer.chat_template = LLAMA31_TOOLS_TEMPLATE
    yield
    tokenizer.chat_template = saved


LLAMA_PARIS = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
LLAMA_UTC = '{"name": "get_time", "parameters": {"zone": "UTC"}}'


async def test_a_llama3_template_gets_calls_in_llama3_json(harness, tokenizer, llama3_template):
    """The template renders the tools and the history; ``required`` is a grammar of Llama 3
    calls; the model's JSON calls become ``tool_calls`` in one body and in a stream."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    client = _client(harness)
    for messages, choice in ((history, "auto"), (ASK, "required"), (ASK, {"type": "function",
                                                                          "function": {"name": "get_time"}})):
        await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice,
                                             max_tokens=4)
    prompt = tokenizer.decode(harness.worker.requests[0].prompt_token_ids)
    assert 'Respond in the format {"name": function name, "parameters"' in prompt and "<tools>" not in prompt
    assert f"{LLAMA_PARIS}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n18 degrees" in prompt
    required, named = (grammar_for(r.sampling.structured) for r in harness.worker.requests[1:])
    paris, utc = (LLAMA_PARIS.replace('", "unit', '","unit').replace('": "', '":"').replace('"name":"', '"name": "'),
                  '{"name": "get_time", "parameters": {"zone":"UTC"}}')
    assert paris == '{"name": "get_weather", "parameters": {"city":"Paris","unit":"celsius"}}'
    for text in (paris, utc, f"{paris}; {utc}"):
        assert _accepts(required, tokenizer, text), text
    for text in (GRAMMAR_PARIS, paris.replace("parameters", "arguments"), "Sure."):
        assert not _accepts(required, tokenizer, text), text
    assert _accepts(named, tokenizer, utc) and not _accepts(named, tokenizer, paris)

    _answer(harness, f"{LLAMA_PARIS}; {LLAMA_UTC}")
    state = ChatCompletionStreamState(input_tools=TOOLS)
    async for chunk in await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True):
        state.handle_chunk(chunk)
    one = (await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)).choices[0]
    streamed = state.get_final_completion().choices[0]
    for choice in (streamed, one):
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
            [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"zone": "UTC"}')]
    _answer(harness, "It is sunny in Paris.")  # no call: content
    one = (await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)).choices[0]
    assert one.message.content == "It is sunny in Paris." and one.message.tool_calls is None
    await client.close()


# -- refused: 400, nothing enqueued ---------------------------------------------------------------

@pytest.mark.parametrize("extra,param,words", [
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice", "only allowed"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", None),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "guided_regex": "a+"}, "tool_choice", "guided_regex"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "same name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", None),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
      "tool_choice": "required"}, "tools", "strin"),
    ({"messages": [{"role": "tool", "content": "18 degrees"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages", "assistant"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages", "JSON"),
])
async def test_bad_tool_request_is_400_and_nothing_is_enqueued(harness, extra, param, words):
    body = {"model": MODEL, "messages": ASK, **extra}
    for stream in (False, True):
        r = await harness.http.post("/v1/chat/completions", json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"].split(".")[0] == param and err["type"] == "invalid_request_error", err
        assert words is None or words in err["message"], err
    assert harness.worker.requests == [] and await _nothing_enqueued(harness)
