"""The body of ``POST /v1/responses`` (OpenAI's Responses API) and its translation into the
chat request that the chat path runs (``gateway.handlers.admit``: template, tools,
structured outputs, admission, placement, failover are the chat path's own;
docs/operations.md, "The Responses API").

Translation, item by item (OpenAI's input items; ``input`` as a string is one user message):

- ``instructions`` -> a first ``system`` message (never carried over by
  ``previous_response_id``, as OpenAI has it);
- a ``message`` item (roles ``user``, ``system``, ``developer``, ``assistant``; content a
  string or ``input_text`` / ``output_text`` parts, joined) -> a chat message of its role;
- a ``function_call`` item -> a ``tool_calls`` entry of an assistant message (the one
  just before it when that is the assistant's, as a response's text and calls are one
  chat turn), ``call_id`` as its id;
- a ``function_call_output`` item -> a ``tool`` message answering ``call_id``, which an
  earlier ``function_call`` of the conversation must have made;
- ``tools`` (function tools) and ``tool_choice`` -> the chat fields of gateway/tools.py;
  ``text.format`` -> the structured-output constraint (named ``text.format`` in errors);
  ``max_output_tokens`` -> ``max_completion_tokens``.

Every item is checked here, so that a 400 names the Responses field (``input``,
``tools``, ...), and kept in one canonical form (``input_items``), which is what a stored
response holds to continue its conversation. What the Responses API has and inferq does
not (built-in tools, background mode, reasoning, conversations, prompt templates,
``include``, logprobs, ``truncation: "auto"``) is refused with a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from gateway.errors import OpenAIError, validation_error
from gateway.schemas import BODY_CONFIG, ChatCompletionRequest
from gateway.structured import Constraint
from gateway.tools import FunctionDef

#: Most ``metadata`` pairs, and the longest key and value, characters (OpenAI's limits).
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
#: What a response id looks like (``resp_`` and hex: gateway/responses_output.py); any
#: other ``previous_response_id`` is a 404 without a Redis read.
RESPONSE_ID_RE = re.compile(r"resp_[0-9a-f]{1,64}")
#: A ``text.format`` name (OpenAI's rule, as for function names).
_FORMAT_NAME_RE = re.compile(r"[A-Za-z0-9_\-]{1,64}")
#: Content part types that carry text, by who wrote them.
_TEXT_PARTS = ("input_text", "output_text")
#: Input item types inferq refuses, with why (every other unknown type gets a generic 400).
_REFUSED_ITEMS = {
    "reasoning": "reasoning items are not supported (the model writes none)",
    "item_reference": "item references are not supported; send the item itself or use previous_response_id",
}
#: Request fields inferq refuses unless left out (or null, false, empty), with why.
_REFUSED_FIELDS = {
    "background": "background mode is not supported: a response runs within its request",
    "conversation": "conversation objects are not supported; chain responses with previous_response_id",
    "prompt": "prompt templates are not supported",
    "reasoning": "reasoning options are not supported",
    "include": "include is not supported: there are no extra output fields to include",
    "top_logprobs": "logprobs are not supported on /v1/responses (use /v1/chat/completions)",
    "context_management": "context management is not supported",
}
#: Sub-objects: strict types, unknown fields refused (a misspelt field must not be dropped).
_CLOSED = ConfigDict(extra="forbid", strict=True)
#: Items may carry fields of OpenAI's output items (``id``, ``status``, ``annotations``...).
_ITEM = ConfigDict(extra="ignore", strict=True)


class TextFormat(BaseModel):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "name", "schema", "strict", "description"}``."""

    model_config = _CLOSED
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    # ``schema`` would shadow a BaseModel attribute; the JSON key is still "schema".
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def constraint(self) -> Constraint | None:
        """The structured-output constraint (None for ``text``), named ``text.format``.

        Raises:
            OpenAIError: 400 ``text.format``: a json_schema without a valid name or a
                schema, or json_schema fields on another type.
        """
        if self.type != "json_schema":
            if self.name is not None or self.schema_ is not None or self.strict is not None:
                raise OpenAIError(400, "text.format: name, schema and strict are only for type json_schema",
                                  param="text.format")
            return None if self.type == "text" else Constraint("text.format", "json_object", None)
        if self.name is None or _FORMAT_NAME_RE.fullmatch(self.name) is None:
            raise OpenAIError(400, "text.format: a json_schema needs a name of 1-64 letters, digits, _ or -",
                              param="text.format")
        if self.schema_ is None:
            raise OpenAIError(400, "text.format: a json_schema needs a schema", param="text.format")
        return Constraint("text.format", "json_schema", self.schema_, bool(self.strict))


class TextConfig(BaseModel):
    """``text``."""

    model_config = _CLOSED
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class _Part(BaseModel):
    model_config = _ITEM
    type: str
    text: str | None = None


class _Message(BaseModel):
    model_config = _ITEM
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_Part]


class _FunctionCall(BaseModel):
    model_config = _ITEM
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class _FunctionCallOutput(BaseModel):
    model_config = _ITEM
    call_id: str = Field(min_length=1)
    output: str | list[_Part]


class ResponsesRequest(BaseModel):
    """Body of ``POST /v1/responses``. Strict types; unknown fields are ignored, as in the
    chat body; the fields of ``_REFUSED_FIELDS`` are refused when given."""

    model_config = BODY_CONFIG

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # names the tenant with --tenant-source user (gateway/tenants.py)
    priority: int | None = None  # vLLM's field, as in chat (gateway/priority.py)
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    context_management: Any = None

    def check(self) -> None:
        """Refuse what inferq does not support and values out of range (cheap; the items
        are checked by ``input_items``, the tools by ``chat_tools``).

        Raises:
            OpenAIError: 400 naming the field.
        """
        for name, why in _REFUSED_FIELDS.items():
            if getattr(self, name) not in (None, False, 0, [], {}):
                raise OpenAIError(400, f"{name}: {why}", param=name)
        if self.truncation == "auto":
            raise OpenAIError(400, "truncation: only \"disabled\" is supported (an input that does not fit the "
                              "context is a 400)", param="truncation")
        if self.text is not None and self.text.verbosity is not None:
            raise OpenAIError(400, "text.verbosity is not supported", param="text.verbosity")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise OpenAIError(400, f"max_output_tokens must be at least 1, got {self.max_output_tokens}",
                              param="max_output_tokens")
        if isinstance(self.input, list) and not self.input:
            raise OpenAIError(400, "input must not be an empty list", param="input")
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_PAIRS or any(
                len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS for k, v in metadata.items()):
            raise OpenAIError(400, f"metadata takes at most {MAX_METADATA_PAIRS} pairs, keys of at most "
                              f"{MAX_METADATA_KEY_CHARS} and values of at most {MAX_METADATA_VALUE_CHARS} "
                              "characters", param="metadata")

    @property
    def text_format(self) -> TextFormat:
        """``text.format``, ``{"type": "text"}`` when not given."""
        fmt = self.text.format if self.text is not None else None
        return fmt if fmt is not None else TextFormat.model_validate({"type": "text"})

    def input_items(self) -> list[dict[str, Any]]:
        """``input`` as canonical items (module docstring), checked.

        Raises:
            OpenAIError: 400 ``input`` naming the item (``input[i]``) and what is wrong.
        """
        if isinstance(self.input, str):
            return [_message_item("user", self.input)]
        return [canonical_item(item, f"input[{i}]") for i, item in enumerate(self.input)]

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as chat tools (``{"type": "function", "function": {...}}``).

        Raises:
            OpenAIError: 400 ``tools``: a tool that is not a function tool (built-in tools
                are not supported), or a function tool that is not valid.
        """
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind != "function":
                raise OpenAIError(400, f"tools[{i}]: tools of type {str(kind)[:40]!r} are not supported; only "
                                  "function tools are (built-in tools such as web_search, file_search, "
                                  "code_interpreter or mcp need a service inferq does not run)", param="tools")
            function = {k: v for k, v in tool.items() if k != "type"}
            try:
                FunctionDef.model_validate(function)
            except pydantic.ValidationError as exc:
                raise _item_error(f"tools[{i}]", exc, "tools") from exc
            out.append({"type": "function", "function": function})
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        """``tool_choice`` as the chat field.

        Raises:
            OpenAIError: 400 ``tool_choice``: a choice other than none, auto, required or
                ``{"type": "function", "name": ...}``.
        """
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        name = choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str) or set(choice) != {"type", "name"}:
            raise OpenAIError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", "
                              "\"name\": ...}; built-in tools and allowed_tools are not supported",
                              param="tool_choice")
        return {"type": "function", "function": {"name": name}}


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat request a Responses body runs as (``to_chat``), with the body and the
    conversation's canonical items (what a stored response keeps) beside it."""

    _body: ResponsesRequest | None = PrivateAttr(default=None)
    _items: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _text_format: Constraint | None = PrivateAttr(default=None)

    @property
    def body(self) -> ResponsesRequest:
        """The Responses body this request was made from."""
        assert self._body is not None, "made by to_chat"
        return self._body

    @property
    def conversation_items(self) -> list[dict[str, Any]]:
        """The conversation's canonical items: the previous response's, then ``input``'s."""
        return self._items

    def constraint(self) -> Constraint | None:
        """``text.format``'s constraint, or the grammar that forces a tool call.

        Raises:
            OpenAIError: 400 ``tool_choice`` when both are asked for.
        """
        forcing, fmt = self.tool_constraint(), self._text_format
        if fmt is not None and forcing is not None:
            raise OpenAIError(400, f"text.format cannot be combined with tool_choice {self.effective_tool_choice!r}, "
                              "which constrains the output to a tool call", param="tool_choice")
        return forcing or fmt


def to_chat(body: ResponsesRequest, history: list[dict[str, Any]]) -> ResponsesChatRequest:
    """The chat request of ``body`` continuing ``history`` (the canonical items of the
    previous response's conversation and output; empty without ``previous_response_id``).

    Raises:
        OpenAIError: 400 naming the Responses field (``ResponsesRequest.check`` first).
    """
    items = body.input_items()
    conversation = history + items
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions is not None else [])
    messages += chat_messages(conversation)
    fields = {"model": body.model, "messages": messages, "tools": body.chat_tools(),
              "tool_choice": body.chat_tool_choice(), "parallel_tool_calls": body.parallel_tool_calls,
              "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
              "top_p": body.top_p, "stream": body.stream, "user": body.user, "priority": body.priority}
    try:
        req = ResponsesChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except pydantic.ValidationError as exc:  # every field was checked above: a bug if it happens
        raise validation_error(list(exc.errors(include_url=False))) from exc
    req._body, req._items, req._text_format = body, conversation, body.text_format.constraint()
    return req


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical items as chat messages (module docstring).

    Raises:
        OpenAIError: 400 ``input``: a function_call_output whose call_id no earlier
            function_call made.
    """
    messages: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": "".join(p["text"] for p in item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            call_ids.add(item["call_id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            if item["call_id"] not in call_ids:
                raise OpenAIError(400, f"input: no function_call item has the call_id {item['call_id'][:64]!r} of "
                                  "a function_call_output", param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def canonical_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    """One input item (or a stored output item) in canonical form: a ``message`` with one
    text part, a ``function_call`` or a ``function_call_output`` with text output.

    Raises:
        OpenAIError: 400 ``input`` naming ``where``: an unknown or refused type, a field
            missing or of the wrong type, a content part that is not text, arguments that
            are not JSON.
    """
    kind = item.get("type", "message" if "role" in item else None)
    try:
        if kind == "message":
            message = _Message.model_validate(item)
            return _message_item(message.role, _text_of(message.content, where))
        if kind == "function_call":
            call = _FunctionCall.model_validate(item)
            try:
                json.loads(call.arguments)
            except json.JSONDecodeError as exc:
                raise OpenAIError(400, f"{where}: the arguments of function_call {call.call_id[:64]!r} are not "
                                  f"JSON: {exc}", param="input") from exc
            return {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}
        if kind == "function_call_output":
            output = _FunctionCallOutput.model_validate(item)
            return {"type": "function_call_output", "call_id": output.call_id,
                    "output": _text_of(output.output, where)}
    except pydantic.ValidationError as exc:
        raise _item_error(where, exc, "input") from exc
    why = _REFUSED_ITEMS.get(str(kind), f"items of type {str(kind)[:40]!r} are not supported")
    raise OpenAIError(400, f"{where}: {why}", param="input")


def _message_item(role: str, text: str) -> dict[str, Any]:
    part = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


def _text_of(content: str | list[_Part], where: str) -> str:
    """Content as one text: a string, or its text parts joined.

    Raises:
        OpenAIError: 400 ``input`` for a part that is not text (images, files, audio).
    """
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type not in _TEXT_PARTS or part.text is None:
            raise OpenAIError(400, f"{where}: content parts of type {part.type[:40]!r} are not supported (text "
                              "only: input_text, output_text)", param="input")
        texts.append(part.text)
    return "".join(texts)


def _item_error(where: str, exc: pydantic.ValidationError, param: str) -> OpenAIError:
    """A 400 ``param`` naming ``where`` and the first invalid field of ``exc``."""
    first = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    return OpenAIError(400, f"{where}{'.' + loc if loc else ''}: {first.get('msg', 'invalid value')}", param=param)
