"""What a Responses API answer is made of: the output items built from one generation's
text (with the stream events that build them), the ``response`` object around them, and
the usage mapping from the chat path's usage (docs/operations.md, "The Responses API").
Pure and synchronous; gateway/responses_api.py drives it from the generation's steps.

Output items, in the order the model wrote them: text becomes a ``message`` item (one
``output_text`` part), each tool call a ``function_call`` item (``call_id``: the chat
path's ``call_<hex>`` id). With tools, the text goes through the chat path's tool-call
parser (``ToolCallStream``), so text before, between and after calls makes message items
at its place. An output with no item (no text, no call) is one empty message. The item
being written when the output is cut by ``max_output_tokens`` is ``incomplete``.

Stream events, OpenAI's (``openai.types.responses``), for each item:
``response.output_item.added``, then for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``; for a call ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``; then ``response.output_item.done``. The
non-streaming answer runs the same builder over the whole text, so both carry the same
items.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import OpenAIError
from gateway.tool_parser import ToolCallStream

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    """A fresh object id, ``<prefix>_<48 hex>`` (``resp``, ``msg``, ``fc``)."""
    return f"{prefix}_{secrets.token_hex(24)}"


def responses_usage(chat_usage: Mapping[str, Any]) -> dict[str, Any]:
    """The chat path's ``usage`` (gateway/responses.py ``usage``: prompt, completion and
    total tokens, ``prompt_tokens_details.cached_tokens``) as a Responses ``usage``:
    prompt tokens are ``input_tokens``, the prefix-cache hit ``cached_tokens``, completion
    tokens ``output_tokens``. ``reasoning_tokens`` is 0 (the models write no reasoning
    items) and ``cache_write_tokens`` 0 (inferq's prefix cache is automatic and counts no
    writes)."""
    details = chat_usage.get("prompt_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0), "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def response_error(error: OpenAIError) -> dict[str, Any]:
    """A failed response's ``error``: OpenAI's ``code`` for the status (429
    ``rate_limit_exceeded``, 400 ``invalid_prompt``, else ``server_error``) and the
    gateway's message, with its own code when it has one."""
    code = "rate_limit_exceeded" if error.status == 429 else "invalid_prompt" if error.status == 400 \
        else "server_error"
    detail = f" ({error.code})" if error.code and not error.code.isdigit() else ""
    return {"code": code, "message": error.message + detail}


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """What a ``response`` object says of its request (``fields``: instructions, tools,
    sampling values, ...), its id, creation time (unix s) and model; ``build`` adds the
    status, output and usage."""

    response_id: str
    created_at: int
    model: str
    fields: dict[str, Any]

    def build(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None, *,
              error: dict[str, Any] | None = None, completed_at: int | None = None) -> dict[str, Any]:
        """The ``response`` object with ``status`` (``in_progress``, ``completed``,
        ``incomplete``: cut by ``max_output_tokens``, or ``failed`` with ``error``)."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "completed_at": completed_at, "error": error, "incomplete_details": incomplete,
                "model": self.model, "output": output, "usage": usage, **self.fields}


class OutputItems:
    """One response's output items, built as text arrives (module docstring).

    ``tool_calls``: the chat path's parser when the request parses tool calls (tools
    given, ``tool_choice`` not ``none``), else None (all text is one message).
    ``items`` holds every item begun, the open one as last added.
    """

    def __init__(self, tool_calls: ToolCallStream | None) -> None:
        self._tool_calls = tool_calls
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written (as added)
        self._parts: list[str] = []  # its text (message) or arguments (call) so far

    def feed(self, text: str, finished: bool = False) -> list[Event]:
        """Consume released text (``finished``: the output is over, release what the
        tool-call parser held back); returns the events it makes, without
        ``sequence_number``."""
        events: list[Event] = []
        calls = self._tool_calls
        pieces: list[str | dict[str, Any]] = [text] if calls is None else calls.feed(text)
        if finished and calls is not None:
            pieces += calls.finish()
        for piece in pieces:
            if isinstance(piece, str):
                self._text(piece, events)
            elif "id" in piece:
                self._begin_call(piece, events)
            else:
                self._parts.append(piece["function"]["arguments"])
                events.append({"type": "response.function_call_arguments.delta", **self._where(),
                               "delta": piece["function"]["arguments"]})
        return events

    def finish(self, complete: bool) -> list[Event]:
        """Close the open item (``incomplete`` unless ``complete``); an output without
        items gets an empty message first. Returns the events."""
        events: list[Event] = []
        if not self.items:
            self._begin_message(events)
        self._close(events, "completed" if complete else "incomplete")
        return events

    def snapshot(self) -> list[dict[str, Any]]:
        """The items so far, the open one with what it holds so far as ``incomplete`` (a
        failed response's output)."""
        item = self._open
        if item is None:
            return list(self.items)
        whole = "".join(self._parts)
        partial = {**item, "status": "incomplete"}
        partial.update({"content": [_text_part(whole)]} if item["type"] == "message" else {"arguments": whole})
        return [*self.items[:-1], partial]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _text(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        if self._open is None or self._open["type"] != "message":
            self._close(events, "completed")
            self._begin_message(events)
        self._parts.append(text)
        events.append({"type": "response.output_text.delta", **self._where(), "content_index": 0, "delta": text,
                       "logprobs": []})

    def _begin_message(self, events: list[Event]) -> None:
        item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        self._add(item, events)
        events.append({"type": "response.content_part.added", **self._where(), "content_index": 0,
                       "part": _text_part("")})

    def _begin_call(self, delta: dict[str, Any], events: list[Event]) -> None:
        self._close(events, "completed")
        function = delta["function"]
        self._add({"id": new_id("fc"), "type": "function_call", "call_id": delta["id"], "name": function["name"],
                   "arguments": "", "status": "in_progress"}, events)
        if function["arguments"]:
            self._parts.append(function["arguments"])
            events.append({"type": "response.function_call_arguments.delta", **self._where(),
                           "delta": function["arguments"]})

    def _add(self, item: dict[str, Any], events: list[Event]) -> None:
        self._open, self._parts = item, []
        self.items.append(item)
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": item})

    def _close(self, events: list[Event], status: str) -> None:
        """Finish the open item, if any, with ``status``."""
        item = self._open
        if item is None:
            return
        where, whole = self._where(), "".join(self._parts)
        if item["type"] == "message":
            part = _text_part(whole)
            done = {**item, "status": status, "content": [part]}
            events.append({"type": "response.output_text.done", **where, "content_index": 0, "text": whole,
                           "logprobs": []})
            events.append({"type": "response.content_part.done", **where, "content_index": 0, "part": part})
        else:
            done = {**item, "status": status, "arguments": whole}
            events.append({"type": "response.function_call_arguments.done", **where, "arguments": whole})
        events.append({"type": "response.output_item.done", "output_index": where["output_index"], "item": done})
        self.items[-1] = done
        self._open, self._parts = None, []


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
