"""The tool-call parser alone (gateway/tool_parser.py, gateway/tool_formats.py), both
formats: the stream's argument fragments join to exactly the non-streaming arguments
(the model's own text, which parses); any split of the text gives the same result;
the name goes out as soon as the head is complete, not before; blocks that are not
calls stay content; limits; an output ending mid-call; which format a chat template
teaches. Through the gateway and the openai client: tests/test_tools.py."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gateway.tool_formats import HERMES, LLAMA3_JSON, ToolFormat, tool_format_for_template
from gateway.tool_parser import MAX_HEAD_CHARS, ToolCallStream, parse_tool_calls

pytestmark = pytest.mark.timeout(60)

#: Arguments as a model may write them: spaces, a newline, escapes, brackets and a
#: closing-tag look-alike inside strings, non-ASCII.
ODD_ARGS = '{ "city" : "Par\\"is {}[]", "note": "</tool_cal", "list": [1, {"x": null}],\n "é": "ü\\\\" }'
HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + ODD_ARGS + '}\n</tool_call>\n'
               '<tool_call>\n{"type": "function", "name": "get_time", "parameters": {"zone": "UTC"}}\n</tool_call>\n'
               '<tool_call>not a call</tool_call> Done.')
HERMES_CALLS = [("get_weather", ODD_ARGS), ("get_time", '{"zone": "UTC"}')]
HERMES_CONTENT = "Let me check.\n<tool_call>not a call</tool_call> Done."
LLAMA_TEXT = ('<|python_tag|>{"name": "get_weather", "parameters": ' + ODD_ARGS + '} ; \n'
              '{"name": "get_time", "arguments": {"zone": "UTC"}}')
LLAMA_CALLS = HERMES_CALLS
SAMPLES = [(HERMES, HERMES_TEXT, HERMES_CONTENT, HERMES_CALLS), (LLAMA3_JSON, LLAMA_TEXT, None, LLAMA_CALLS)]


def _run(text_pieces: list[str], fmt: ToolFormat, max_num_calls: int | None = None) -> list[str | dict[str, Any]]:
    stream = ToolCallStream(max_num_calls, fmt)
    return [e for piece in text_pieces for e in stream.feed(piece)] + stream.finish()


def _assemble(events: list[str | dict[str, Any]]) -> tuple[str | None, list[tuple[str, str]]]:
    """What a client assembles from the deltas: content and ``(name, arguments)`` per index."""
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, dict):
            if "id" in e:  # the first delta of a call
                assert e["index"] == len(calls) and e["type"] == "function" and e["id"].startswith("call_"), e
                calls[e["index"]] = [e["function"]["name"], e["function"]["arguments"]]
            else:
                assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}, e
                calls[e["index"]][1] += e["function"]["arguments"]
    content = "".join(e for e in events if isinstance(e, str))
    return (content or None) if calls else content, [(n, a) for n, a in calls.values()]


def _whole(text: str, fmt: ToolFormat, max_num_calls: int | None = None) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text, max_num_calls, fmt)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("fmt,text,content,calls", SAMPLES, ids=["hermes", "llama3_json"])
def test_streamed_fragments_join_to_the_body_arguments(fmt, text, content, calls):
    """Fed token-sized pieces, each call goes out as a name delta then several argument
    fragments; joined, they are the body's arguments: the model's text, which parses."""
    assert _whole(text, fmt) == (content, calls)
    events = _run(list(text), fmt)
    assert _assemble(events) == (content, calls)
    for name, arguments in calls:
        json.loads(arguments)
    deltas = [e for e in events if isinstance(e, dict) and e["index"] == 0]
    # The name, with the character that completed the head: the arguments' "{".
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": "{"}
    assert len(deltas) > 10  # streamed, not one delta once the call is over


@pytest.mark.parametrize("fmt,text,content,calls", SAMPLES, ids=["hermes", "llama3_json"])
def test_every_split_gives_the_same_result(fmt, text, content, calls):
    """Two pieces split at every position, one character at a time, and random pieces:
    always the whole text's content and calls."""
    expected = _whole(text, fmt)
    for k in range(len(text) + 1):
        assert _assemble(_run([text[:k], text[k:]], fmt)) == expected, k
    rng = random.Random(14)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _assemble(_run(pieces, fmt)) == expected, cuts


@pytest.mark.parametrize("fmt,text", [
    (HERMES, "a <tool_ca"), (HERMES, "a \n<tool_call>no call</tool_call>"), (HERMES, "No tool  \n"),
    (HERMES, ('<tool_call>{"name": "x", "arguments": {}}</tool_call>\n\n<tool_call>{"name": "y", "arguments": '
              '{"a": "<"}}</tool_call>\nDone.\n')),
    (HERMES, 'x<<tool_call>{"name": "x", "arguments": {}}</tool_call>'), (HERMES, '<tool_call>{"name": "x"'),
    (LLAMA3_JSON, "  <|python_ta"), (LLAMA3_JSON, '\n {"name": "x", "parameters": {}} ;'),
    (LLAMA3_JSON, '{"name": "x", "parameters": {}} \n Done. \n'), (LLAMA3_JSON, "Hello  \n"),
])
def test_every_split_of_edge_texts(fmt, text):
    """Tags and separators split across pieces, whitespace held back then released."""
    expected = _whole(text, fmt)
    for k in range(len(text) + 1):
        assert _assemble(_run([text[:k], text[k:]], fmt)) == expected, k
    assert _assemble(_run(list(text), fmt)) == expected


@pytest.mark.parametrize("fmt,head", [(HERMES, '<tool_call>\n{"name": "get_weather", "arguments": '),
                                      (LLAMA3_JSON, '{"name": "get_weather", "parameters": ')])
def test_the_name_goes_out_once_the_head_is_complete(fmt, head):
    stream = ToolCallStream(None, fmt)
    assert stream.feed(head) == [] and stream.num_calls == 0  # the arguments may still not be an object
    [event] = stream.feed("{")
    assert event["function"] == {"name": "get_weather", "arguments": "{"} and stream.num_calls == 1
    assert stream.feed('"city": "Pa') == [{"index": 0, "function": {"arguments": '"city": "Pa'}}]


@pytest.mark.parametrize("fmt,text", [
    (HERMES, "<tool_call>\nnot json\n</tool_call>"),
    (HERMES, 'a <tool_call>{"name": 3, "arguments": {}}</tool_call> b'),
    (HERMES, '<tool_call>{"arguments": {}, "name": "f"}</tool_call>'),  # the name must come first
    (HERMES, '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>'),  # arguments must be an object
    (HERMES, '<tool_call>{"name": "' + "f" * MAX_HEAD_CHARS + '", "arguments": {}}</tool_call>'),
    (HERMES, '<tool_call>{"name": "f"</tool_call>'),
    (LLAMA3_JSON, 'Sure: {"name": "f", "parameters": {}}'),  # Llama 3 calls only at the start
    (LLAMA3_JSON, '{"answer": 42}; {"name": "f", "parameters": {}}'),
    (LLAMA3_JSON, ' {"name": "f", "parameters": [1]}'),
    (LLAMA3_JSON, '<|python_tag|>brave_search.call(query="x")'),
    (LLAMA3_JSON, "  \n"),
])
def test_text_that_is_not_a_call_stays_content(fmt, text):
    for pieces in ([text], list(text)):
        assert _assemble(_run(pieces, fmt)) == (text, []), pieces
    assert _whole(text, fmt) == (text, [])


def test_llama3_text_after_a_call_is_content():
    text = '{"name": "f", "parameters": {}}; {"name": 1}\nDone.'
    assert _whole(text, LLAMA3_JSON) == ('; {"name": 1}\nDone.', [("f", "{}")])
    assert _whole('{"name": "f", "parameters": {"a": 1}}\nDone.', LLAMA3_JSON) == ("\nDone.", [("f", '{"a": 1}')])


@pytest.mark.parametrize("fmt,text,content", [(HERMES, HERMES_TEXT, HERMES_CONTENT), (LLAMA3_JSON, LLAMA_TEXT, None)])
def test_a_limit_drops_later_calls(fmt, text, content):
    """``parallel_tool_calls: false``: one call; no delta of the later ones goes out."""
    for pieces in ([text], list(text)):
        events = _run(pieces, fmt, max_num_calls=1)
        assert {e["index"] for e in events if isinstance(e, dict)} == {0}
        assert _assemble(events) == (content, HERMES_CALLS[:1])
    assert _whole(text, fmt, 1) == (content, HERMES_CALLS[:1])


@pytest.mark.parametrize("fmt,text,expected", [
    # The head not complete: content.
    (HERMES, '<tool_call>\n{"name": "get_weather", "argu', ('<tool_call>\n{"name": "get_weather", "argu', [])),
    (LLAMA3_JSON, '{"name": "get_weather"', ('{"name": "get_weather"', [])),
    # Mid-arguments: a call with the arguments written so far (the stream sent them already).
    (HERMES, '<tool_call>{"name": "f", "arguments": {"a": "x<', (None, [("f", '{"a": "x<')])),
    (LLAMA3_JSON, '{"name": "f", "parameters": {"a": [1, 2', (None, [("f", '{"a": [1, 2')])),
    # A closing tag inside the arguments ends them; the arguments complete, the tag missing.
    (HERMES, '<tool_call>{"name": "f", "arguments": {"a": "x</tool_call> b', (" b", [("f", '{"a": "x')])),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1}}', (None, [("f", '{"a": 1}')])),
])
def test_an_output_that_ends_mid_call(fmt, text, expected):
    assert _whole(text, fmt) == expected
    for k in range(len(text) + 1):
        assert _assemble(_run([text[:k], text[k:]], fmt)) == expected, k


#: A faithful excerpt of Llama 3.1 Instruct's chat template (tokenizer_config.json of
#: meta-llama/Llama-3.1-8B-Instruct): the parts about tools, custom tools in the first
#: user message (its default), and how it writes a call and a tool result.
LLAMA31_TOOLS_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- set first_user_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {{- message.content }}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
#: Qwen 2.5 Instruct's tools part (a Hermes template).
QWEN25_TOOLS_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": "
        "<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- endif %}"""
#: A template that does not render tools (SmolLM2's does not either: gateway/tools.py then
#: writes the Hermes tools prompt).
NO_TOOLS_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def test_the_chat_template_decides_the_format():
    assert tool_format_for_template(LLAMA31_TOOLS_TEMPLATE) is LLAMA3_JSON
    # Llama 3.2's lightweight models' template has no built-in tools: its answer format decides.
    no_builtin = LLAMA31_TOOLS_TEMPLATE.replace('"<|python_tag|>" + ', "")
    assert "<|python_tag|>" not in no_builtin and tool_format_for_template(no_builtin) is LLAMA3_JSON
    assert tool_format_for_template(QWEN25_TOOLS_TEMPLATE) is HERMES
    assert tool_format_for_template(NO_TOOLS_TEMPLATE) is HERMES
    assert tool_format_for_template(None) is HERMES
    assert tool_format_for_template({"default": NO_TOOLS_TEMPLATE, "tool_use": LLAMA31_TOOLS_TEMPLATE}) is LLAMA3_JSON
    assert tool_format_for_template({"default": LLAMA31_TOOLS_TEMPLATE, "tool_use": QWEN25_TOOLS_TEMPLATE}) is HERMES
