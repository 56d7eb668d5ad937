"""Tool calling at the gateway, request side: the ``tools``, ``tool_choice`` and
``parallel_tool_calls`` fields of a chat request, the prompt that offers the tools, and
the grammar that enforces ``tool_choice: "required"`` or a named function
(docs/operations.md, "Tool calling"). The output side, text to ``tool_calls``, is
gateway/tool_parser.py.

Formats (gateway/tool_formats.py): Hermes ``<tool_call>`` blocks, or Llama 3's bare
JSON ``{"name": ..., "parameters": {...}}``, as the chat template teaches
(``tool_format_for_template``; the handler stores it in ``ToolFields.tool_format``). A chat
template that renders ``tools`` itself (its text names ``tools``, as Qwen 2.5's and
Llama 3.1's do) gets them through ``apply_chat_template(tools=...)``. One that does not
(SmolLM2's) gets them in a system message written here, the same words as Qwen 2.5's
template (so Hermes), and the history's tool calls and tool results as Qwen's template
writes them (``<tool_call>`` blocks in the assistant's text, ``<tool_response>`` blocks
in a user message).

Enforcement: ``required`` and a named function become a Lark grammar (llguidance's, with
each tool's ``parameters`` embedded as ``%json``), carried as a ``grammar``
``StructuredOutput``: the output is one call (or, with ``parallel_tool_calls``, one or
more), in the template's format, of an offered tool, whose arguments match its schema
(closed with ``additionalProperties: false`` when the tool is ``strict``), in compact
JSON. ``auto`` is not constrained; ``none`` offers the tools in the prompt and parses
nothing (vLLM's default).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from gateway.errors import OpenAIError
from gateway.structured import Constraint
from gateway.tool_formats import HERMES, ToolFormat
from shared.grammars import close_objects

#: Sub-objects of a request: strict types, unknown fields refused.
_CLOSED = ConfigDict(extra="forbid", strict=True)
#: Most tools per request (each schema is compiled into the forcing grammar).
MAX_NUM_TOOLS = 128
#: A tool's arguments when it declares no ``parameters`` (OpenAI: a function without
#: parameters), and what any tool's schema must be at its root.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
#: llguidance's JSON options for the embedded argument schemas: compact JSON, no keyword
#: silently ignored (as shared/grammars.py's, for the same reasons).
_JSON_OPTIONS = {"whitespace_flexible": False, "lenient": False, "coerce_one_of": False}
#: Qwen 2.5's tools system prompt, for templates that do not render ``tools``.
_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


class FunctionDef(BaseModel):
    """``tools[i].function``."""

    model_config = _CLOSED
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def arguments_schema(self) -> dict[str, Any]:
        """The schema the arguments must match (closed when ``strict``)."""
        schema = self.parameters if self.parameters is not None else _NO_PARAMETERS
        return close_objects(schema) if self.strict else schema


class Tool(BaseModel):
    """One entry of ``tools``."""

    model_config = _CLOSED
    type: Literal["function"]
    function: FunctionDef


class _ChosenFunction(BaseModel):
    model_config = _CLOSED
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    model_config = _CLOSED
    type: Literal["function"]
    function: _ChosenFunction


class CalledFunction(BaseModel):
    """``tool_calls[i].function`` of an assistant message in the history."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """``tool_calls[i]`` of an assistant message in the history."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def arguments_value(self) -> Any:
        """The arguments as a JSON value (vLLM passes them to templates so).

        Raises:
            OpenAIError: 400 when they are not valid JSON.
        """
        try:
            return json.loads(self.function.arguments)
        except json.JSONDecodeError as exc:
            raise OpenAIError(400, f"messages: tool call {self.id!r} has arguments that are not JSON: {exc}",
                              param="messages") from exc


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(BaseModel):
    """The chat request fields of tool calling (mixed into ``ChatCompletionRequest``)."""

    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    #: The model's tool-call format (not a request field: the handler sets it from the
    #: chat template, ``tool_format_for_template``).
    _tool_format: ToolFormat = PrivateAttr(default=HERMES)

    @property
    def tool_format(self) -> ToolFormat:
        """The format the forcing grammar writes and the parser reads (default Hermes)."""
        return self._tool_format

    @tool_format.setter
    def tool_format(self, value: ToolFormat) -> None:
        self._tool_format = value

    def check_tools(self) -> None:
        """Cheap checks of the tool fields.

        Raises:
            OpenAIError: 400: ``tool_choice`` without ``tools``, a named function that is
                not in ``tools``, two tools of one name, more than ``MAX_NUM_TOOLS``.
        """
        tools = self.tools or []
        if len(tools) > MAX_NUM_TOOLS:
            raise OpenAIError(400, f"tools takes at most {MAX_NUM_TOOLS} tools, got {len(tools)}", param="tools")
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise OpenAIError(400, "tools: two tools have the same name", param="tools")
        if self.tool_choice is not None and self.tool_choice != "none" and not tools:
            raise OpenAIError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise OpenAIError(400, f"tool_choice names the function {self.tool_choice.function.name!r}, which is "
                              "not in tools", param="tool_choice")

    @property
    def effective_tool_choice(self) -> str:
        """``none``, ``auto``, ``required`` or ``named`` (OpenAI's default: ``auto`` with
        tools, ``none`` without)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def parses_tool_calls(self) -> bool:
        """True when the output is parsed into ``tool_calls``."""
        return bool(self.tools) and self.effective_tool_choice != "none"

    @property
    def max_num_tool_calls(self) -> int | None:
        """At most one call without ``parallel_tool_calls`` (None: no limit)."""
        return None if self.parallel_tool_calls is not False else 1

    def tool_constraint(self) -> Constraint | None:
        """The grammar constraint that forces a call (``required``, a named function), or
        None. Cheap: the grammar is checked later, off the event loop (``Constraint.build``)."""
        choice = self.effective_tool_choice
        if choice not in ("required", "named") or not self.tools:
            return None
        tools = [t.function for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            tools = [f for f in tools if f.name == self.tool_choice.function.name]
        return Constraint("tools", "grammar", forcing_grammar(tools, parallel=self.max_num_tool_calls is None,
                                                              tool_format=self.tool_format))

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as ``apply_chat_template(tools=...)`` takes them (None: no tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


def forcing_grammar(functions: list[FunctionDef], *, parallel: bool, tool_format: ToolFormat = HERMES) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are one call of one of
    ``functions`` in ``tool_format`` (``parallel``: one or more, with the format's
    separator between), the arguments matching that function's schema in compact JSON:
    Hermes ``<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>``, Llama 3
    ``{"name": "f", "parameters": {...}}``."""
    fmt = tool_format
    rules = []
    for i, function in enumerate(functions):
        schema = {**function.arguments_schema(), "x-guidance": _JSON_OPTIONS}
        head = json.dumps(f'{fmt.grammar_open}{{"name": {json.dumps(function.name)}, "{fmt.arguments_key}": ')
        rules.append(f"call_{i}: {head} args_{i} {json.dumps('}' + fmt.grammar_close)}\n"
                     f"args_{i}: %json {json.dumps(schema)}\n")
    calls = " | ".join(f"call_{i}" for i in range(len(functions)))
    start = f"start: call ({json.dumps(fmt.grammar_separator)} call)*\n" if parallel else "start: call\n"
    return start + f"call: {calls}\n" + "".join(rules)


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      renders_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation and the ``tools`` argument for ``apply_chat_template``.

    ``messages`` are ``ChatMessage.to_template`` dicts (assistant ``tool_calls`` with
    their arguments as JSON values). A template that ``renders_tools`` gets them as they
    are. Otherwise the tools go into the system message (a new one when the conversation
    has none), tool calls into the assistant's text and tool results into user messages,
    as Qwen 2.5's template writes them; ``tools`` is then None.
    """
    if renders_tools:
        return messages, tools
    out: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            blocks = [f"{HERMES.call_open}\n{json.dumps(c['function'], ensure_ascii=False)}\n{HERMES.call_close}"
                      for c in message["tool_calls"]]
            text = "\n".join(([message["content"]] if message["content"] else []) + blocks)
            out.append({"role": "assistant", "content": text})
        elif message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results share one user message
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")})
    for message in out:
        message.pop("tool_results", None)
    if tools:
        prompt = _TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def template_renders_tools(chat_template: str | dict[str, str] | None) -> bool:
    """True when the chat template (or one of a tokenizer's named templates) uses ``tools``."""
    if isinstance(chat_template, dict):
        return any("tools" in t for t in chat_template.values())
    return chat_template is not None and "tools" in chat_template
