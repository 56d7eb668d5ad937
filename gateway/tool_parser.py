"""Tool calling at the gateway, output side: the model's text to OpenAI ``tool_calls``
(Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks;
gateway/tools.py has the request side). Runs on the event loop, in the handler, over the
text the relay released (docs/architecture.md, "Tool calls").

A block whose JSON parses to ``{"name": <string>, "arguments": <object>}`` (also
``"parameters"``, which some models write) becomes a call; its ``arguments`` are sent as
compact JSON text. Text outside the blocks is the message's ``content``; a block that
does not parse stays in the content as it was written, so nothing the model wrote is
lost. A block left open when the output ends is parsed as if it were closed. With a
limit on calls (``parallel_tool_calls: false``) later blocks are dropped. Whitespace
right before a block, and text between or after calls that is only whitespace, is not
content; ``content`` is null when nothing else is left.

Streaming: ``ToolCallStream.feed`` returns what can be sent now: content outside the
blocks, holding back trailing whitespace and a tail that may be the start of
``<tool_call>``; a call as one
delta once its block is closed (index, id, type, name and the whole arguments: the
client libraries assemble it as they would several).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from gateway.tools import CALL_CLOSE, CALL_OPEN


def new_call_id() -> str:
    """A fresh ``call_<24 hex>`` id."""
    return "call_" + secrets.token_hex(12)


def parse_call(block: str) -> dict[str, Any] | None:
    """The ``{"name", "arguments"}`` of one block's inner text (None when it is not a call)."""
    try:
        value = json.loads(block)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return {"name": value["name"],
            "arguments": json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))}


def tool_call_object(call: dict[str, Any], index: int | None = None) -> dict[str, Any]:
    """OpenAI's ``tool_calls`` entry (with ``index``: a stream delta)."""
    obj = {"id": new_call_id(), "type": "function", "function": call}
    return obj if index is None else {"index": index, **obj}


@dataclass(slots=True)
class ToolCallStream:
    """Splits streamed text into content and tool calls (module docstring).

    ``max_num_calls`` None: no limit. ``num_calls`` counts the calls returned so far.
    """

    max_num_calls: int | None = None
    num_calls: int = 0
    _pending: str = ""  # content held back (may start a tag), or the open block's text
    _in_block: bool = False
    _space: str = ""  # the whitespace before the open block, content again if it is no call
    _events: list[str | dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> list[str | dict[str, Any]]:
        """Consume more text; returns content strings and tool-call deltas, in order."""
        self._pending += text
        while True:
            if self._in_block:
                end = self._pending.find(CALL_CLOSE)
                if end < 0:
                    break
                self._close_block(self._pending[:end], CALL_CLOSE)
                self._pending = self._pending[end + len(CALL_CLOSE):]
                continue
            start = self._pending.find(CALL_OPEN)
            if start < 0:
                # Held back: a tail that may start a tag, and the whitespace before it.
                keep = _partial_tag_len(self._pending)
                released = len(self._pending[:len(self._pending) - keep].rstrip())
                self._content(self._pending[:released])
                self._pending = self._pending[released:]
                break
            before = self._pending[:start]
            self._content(before.rstrip())
            self._space = before[len(before.rstrip()):]
            self._pending = self._pending[start + len(CALL_OPEN):]
            self._in_block = True
        events, self._events = self._events, []
        return events

    def finish(self) -> list[str | dict[str, Any]]:
        """The output is over: release what was held back (an open block is parsed)."""
        if self._in_block:
            self._close_block(self._pending, "")
        else:
            self._content(self._pending)
        self._pending = ""
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        if not text:
            return
        if self.num_calls and not text.strip():
            return  # the newlines between and after calls are not content
        self._events.append(text)

    def _close_block(self, inner: str, closing: str) -> None:
        self._in_block = False
        call = parse_call(inner)
        if call is None:
            self._events.append(self._space + CALL_OPEN + inner + closing)
        elif self.max_num_calls is None or self.num_calls < self.max_num_calls:
            self._events.append(tool_call_object(call, self.num_calls))
            self.num_calls += 1


def parse_tool_calls(text: str, max_num_calls: int | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output as ``(content, tool_calls)``: content None when only calls (and
    whitespace) were written; the calls as OpenAI ``tool_calls`` entries (no ``index``)."""
    stream = ToolCallStream(max_num_calls)
    events = stream.feed(text) + stream.finish()
    calls = [{k: v for k, v in e.items() if k != "index"} for e in events if isinstance(e, dict)]
    content = "".join(e for e in events if isinstance(e, str))
    return (content or None) if calls else content, calls


def _partial_tag_len(text: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
