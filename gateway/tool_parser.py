"""Tool calling at the gateway, output side: the model's text to OpenAI ``tool_calls``, in
either format of gateway/tool_formats.py (Hermes ``<tool_call>`` blocks, Llama 3's bare
JSON objects); gateway/tools.py has the request side. Runs on the event loop, in the
handler, over the text the relay released (docs/architecture.md, "Tool calls").

A call is a JSON object that starts ``{"name": "<string>", "arguments": {`` (or
``"parameters"``; a ``"type": "function",`` pair may come first, as Llama 3.3 writes
it), whitespace allowed between the tokens. The call begins once that head is complete,
up to the ``{`` of its arguments: from then on it is a call, whatever follows. Its
``arguments`` are the model's own text of that object, character for character (vLLM's
hermes parser streams the same), so a stream's fragments join to exactly the
non-streaming ``arguments``. The text after the arguments object up to the end of the
call (``}`` and the closing tag) is not content.

Not a call, and so content as it was written: a Hermes block whose head does not match
(other key order, arguments that are not an object, not JSON), or a head longer than
``MAX_HEAD_CHARS``; in Llama 3 format, an output that does not start with a call (after
whitespace and ``<|python_tag|>``), and all text from the first object that is not a
call, or the first text after a call that is not ``;``. Text outside the calls is
``content``; whitespace right before a Hermes block, and text between or after calls
that is only whitespace, is not; ``content`` is null when nothing else is left.

Limits: with ``max_num_calls`` (``parallel_tool_calls: false`` gives 1) later calls are
dropped, arguments and all. The output ending mid-call: a call whose head is complete
stays a call with the arguments written so far (a Hermes closing tag inside the
arguments ends them too), which then need not parse (``finish_reason`` is ``length``);
one whose head is not complete is content.

Streaming, OpenAI's delta shape: ``{"index", "id", "type": "function", "function":
{"name", "arguments": ""}}`` once the head is complete, then ``{"index", "function":
{"arguments": <fragment>}}`` as the arguments arrive (what one ``feed`` finds is merged
into one delta). Held back: a tail that may start a tag, trailing whitespace of content,
a head not yet complete, and in the arguments a tail that may start ``</tool_call>``.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from gateway.tool_formats import HERMES, ToolFormat

#: Longest call head, ``{"name": ..., "arguments": {`` (names are at most 64 characters:
#: OpenAI's rule); a longer one is not taken as a call, which bounds what is held back.
MAX_HEAD_CHARS = 256
_WS = " \t\n\r"
_NAME = object()  # the head's name string, in a head pattern
_KEYS = ('"arguments"', '"parameters"')
_HEADS = (("{", '"name"', ":", _NAME, ",", _KEYS, ":", "{"),
          ("{", '"type"', ":", '"function"', ",", '"name"', ":", _NAME, ",", _KEYS, ":", "{"))
_JSON_SPECIAL = re.compile(r'["{}\[\]]')
_STRING_SPECIAL = re.compile(r'["\\]')


def new_call_id() -> str:
    """A fresh ``call_<24 hex>`` id."""
    return "call_" + secrets.token_hex(12)


def scan_call_head(text: str) -> tuple[bool | None, str, int]:
    """Match the start of ``text`` against a call's head (module docstring).

    Returns ``(True, name, end)`` when it matches (``end``: the index just past the
    arguments' ``{``), ``(None, "", 0)`` when ``text`` may still become one (too short to
    tell), ``(False, "", 0)`` when it cannot.
    """
    partial = False
    for pattern in _HEADS:
        result = _match_head(text, pattern)
        if result is None:
            partial = True
        elif result[0]:
            return result
    return (None, "", 0) if partial else (False, "", 0)


def _match_head(text: str, pattern: tuple[Any, ...]) -> tuple[bool, str, int] | None:
    """One head pattern against ``text``: ``(True, name, end)``, ``(False, "", 0)``, or
    None when ``text`` ends before the pattern is decided."""
    i, name = 0, ""
    for token in pattern:
        while i < len(text) and text[i] in _WS:
            i += 1
        if i == len(text):
            return None
        if token is _NAME:
            end = _string_end(text, i)
            if end is None:
                return None if text[i] == '"' else (False, "", 0)
            try:
                name = json.loads(text[i:end])
            except json.JSONDecodeError:
                return (False, "", 0)
            i = end
            continue
        for literal in (token if isinstance(token, tuple) else (token,)):
            piece = text[i:i + len(literal)]
            if piece == literal:
                i += len(literal)
                break
            if len(piece) < len(literal) and literal.startswith(piece):
                return None
        else:
            return (False, "", 0)
    return (True, name, i)


def _string_end(text: str, start: int) -> int | None:
    """The index past the JSON string that starts at ``text[start]`` (a ``"``), or None
    when it is not closed within ``text`` (or ``text[start]`` is no ``"``)."""
    if text[start] != '"':
        return None
    i = start + 1
    while (match := _STRING_SPECIAL.search(text, i)) is not None:
        if match.group() == '"':
            return match.end()
        i = match.end() + 1  # a backslash and the character it escapes
    return None


@dataclass(slots=True)
class _Brackets:
    """How deep into a JSON text fed in pieces: ``{``/``[`` open, outside strings."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def advance(self, text: str, stop_depth: int) -> int:
        """Consume ``text`` up to the bracket that closes back to ``stop_depth``; returns
        how many characters were consumed (``len(text)`` when it was not reached)."""
        i = 0
        while i < len(text):
            if self.escaped:
                self.escaped, i = False, i + 1
                continue
            match = (_STRING_SPECIAL if self.in_string else _JSON_SPECIAL).search(text, i)
            if match is None:
                return len(text)
            char, i = match.group(), match.end()
            if self.in_string:
                self.escaped, self.in_string = char == "\\", char != '"'
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == stop_depth:
                    return i
        return len(text)


class _State(enum.Enum):
    TEXT = enum.auto()  # content, looking for the next call
    HEAD = enum.auto()  # a call's head, not complete yet
    NOT_A_CALL = enum.auto()  # a Hermes block whose head failed, until its closing tag
    ARGUMENTS = enum.auto()  # a call's arguments object
    REST = enum.auto()  # after the arguments, until the call's end
    CONTENT = enum.auto()  # Llama 3 format: all the rest is content


@dataclass(slots=True)
class ToolCallStream:
    """Splits streamed text into content and tool-call deltas (module docstring).

    ``max_num_calls`` None: no limit. ``num_calls`` counts the calls begun so far (those
    within the limit); ``tool_format`` is what to parse (gateway/tool_formats.py).
    """

    max_num_calls: int | None = None
    tool_format: ToolFormat = HERMES
    num_calls: int = 0
    _state: _State = _State.TEXT
    _pending: str = ""  # text not consumed yet
    _raw: str = ""  # text consumed into a call that may not be one: content if it is not
    _block: str = ""  # the potential call's text after its opening tag (Hermes) or from its "{"
    _brackets: _Brackets = field(default_factory=_Brackets)
    _kept: bool = False  # the current call is within the limit (its deltas are sent)
    _after_call: bool = False  # Llama 3 format: a call ended, a separator may follow
    _events: list[str | dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> list[str | dict[str, Any]]:
        """Consume more text; returns content strings and tool-call deltas, in order."""
        self._pending += text
        while self._step():
            pass
        return self._take_events()

    def finish(self) -> list[str | dict[str, Any]]:
        """The output is over: release what was held back (module docstring, "Limits")."""
        pending, self._pending = self._pending, ""
        state = self._state
        if state is _State.TEXT:
            self._content(pending if not self._after_call else "")
        elif state is _State.CONTENT:
            self._content(self._raw + pending)
        elif state in (_State.HEAD, _State.NOT_A_CALL):
            self._content(self._raw + self._block + pending)
        elif state is _State.ARGUMENTS:
            self._arguments(pending[:self._brackets.advance(pending, 1)])
        self._state, self._raw, self._block = _State.TEXT, "", ""
        return self._take_events()

    def _take_events(self) -> list[str | dict[str, Any]]:
        events, self._events = self._events, []
        return events

    def _step(self) -> bool:
        """Consume what the current state can; True when it changed state (go on)."""
        state = self._state
        if state is _State.TEXT:
            return self._text() if self.tool_format.tagged else self._untagged_text()
        if state is _State.HEAD:
            return self._head()
        if state is _State.NOT_A_CALL:
            return self._not_a_call()
        if state is _State.ARGUMENTS:
            return self._arguments_step()
        if state is _State.REST:
            return self._rest()
        self._release_content(self._raw + self._pending, "")
        self._raw = ""
        return False

    # -- outside calls --------------------------------------------------------------------------

    def _text(self) -> bool:
        """Hermes: content up to the next opening tag."""
        opening = self.tool_format.call_open
        start = self._pending.find(opening)
        if start < 0:
            self._release_content(self._pending, opening)
            return False
        before = self._pending[:start]
        self._content(before.rstrip())
        self._raw = before[len(before.rstrip()):] + opening  # the whitespace before is content only if no call
        self._pending = self._pending[start + len(opening):]
        self._state, self._block = _State.HEAD, ""
        return True

    def _untagged_text(self) -> bool:
        """Llama 3: a call (or a separator and a call) here, or content from here on."""
        fmt, text = self.tool_format, self._pending
        i = len(text) - len(text.lstrip(_WS))
        if self._after_call:
            if i == len(text):
                return False
            if not text.startswith(fmt.separator, i):
                self._state = _State.CONTENT
                return True
            self._after_call = False
            self._raw += text[:i + len(fmt.separator)]
            self._pending = text[i + len(fmt.separator):]
            return True
        if text.startswith(fmt.call_open, i):
            i += len(fmt.call_open)
            i += len(text[i:]) - len(text[i:].lstrip(_WS))
        elif fmt.call_open.startswith(text[i:]):
            return False  # nothing yet, or what may become the opening token
        if i == len(text):
            return False
        if text[i] != "{":
            self._state = _State.CONTENT
            return True
        self._raw += text[:i]
        self._pending = text[i:]
        self._state, self._block = _State.HEAD, ""
        return True

    def _release_content(self, text: str, tag: str) -> None:
        """Content, holding back trailing whitespace and a tail that may start ``tag``."""
        keep = _partial_tag_len(text, tag) if tag else 0
        released = len(text[:len(text) - keep].rstrip())
        self._content(text[:released])
        self._pending = text[released:]

    def _content(self, text: str) -> None:
        if not text:
            return
        if self.num_calls and not text.strip():
            return  # the whitespace between and after calls is not content
        self._events.append(text)

    # -- a call's head ---------------------------------------------------------------------------

    def _take_block(self) -> bool:
        """Move pending text into the block, up to a Hermes closing tag; True when that
        tag was found (it then starts the pending text)."""
        closing = self.tool_format.call_close
        if not closing:
            self._block, self._pending = self._block + self._pending, ""
            return False
        text = self._block + self._pending
        end = text.find(closing, max(0, len(self._block) - len(closing) + 1))
        cut = len(text) if end < 0 else end
        self._block, self._pending = text[:cut], text[cut:]
        return end >= 0

    def _head(self) -> bool:
        closed = self._take_block()
        matched, name, end = scan_call_head(self._block)
        if (end if matched else len(self._block)) > MAX_HEAD_CHARS:
            matched = False  # whatever the pieces: the head, or what is known of it, is too long
        if matched:
            self._begin_call(name)
            self._pending = self._block[end - 1:] + self._pending  # the arguments, from their "{"
            self._raw = self._block = ""
            return True
        if matched is None and not closed:
            return False
        if not self.tool_format.tagged:
            self._state = _State.CONTENT
            self._raw += self._block
            self._block = ""
            return True
        self._state = _State.NOT_A_CALL
        return True

    def _not_a_call(self) -> bool:
        """Hermes: a block that is no call is content, closing tag and all."""
        if not self._take_block():
            return False
        closing = self.tool_format.call_close
        self._content(self._raw + self._block + closing)
        self._pending = self._pending[len(closing):]
        self._raw = self._block = ""
        self._state = _State.TEXT
        return True

    def _begin_call(self, name: str) -> None:
        self._kept = self.max_num_calls is None or self.num_calls < self.max_num_calls
        if self._kept:
            self._events.append({"index": self.num_calls, "id": new_call_id(), "type": "function",
                                 "function": {"name": name, "arguments": ""}})
            self.num_calls += 1
        self._brackets = _Brackets(depth=1)  # inside the call's object
        self._state = _State.ARGUMENTS

    # -- a call's arguments and the rest ---------------------------------------------------------

    def _arguments_step(self) -> bool:
        text, closing = self._pending, self.tool_format.call_close
        end = text.find(closing) if closing else -1
        limit = end if end >= 0 else len(text) - (_partial_tag_len(text, closing) if closing else 0)
        n = self._brackets.advance(text[:limit], 1)
        self._arguments(text[:n])
        self._pending = text[n:]
        if self._brackets.depth == 1:
            self._state = _State.REST
            return True
        if end >= 0:  # the block closed inside the arguments
            self._pending = self._pending[len(closing):]
            self._end_call()
            return True
        return False

    def _arguments(self, fragment: str) -> None:
        if not fragment or not self._kept:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, dict) and last["index"] == self.num_calls - 1:
            last["function"]["arguments"] += fragment
        else:
            self._events.append({"index": self.num_calls - 1, "function": {"arguments": fragment}})

    def _rest(self) -> bool:
        """Up to the call's end: Hermes, its closing tag; Llama 3, its object's ``}``."""
        closing = self.tool_format.call_close
        if not closing:
            n = self._brackets.advance(self._pending, 0)
            self._pending = self._pending[n:]
            if self._brackets.depth > 0:
                return False
            self._after_call = True
            self._end_call()
            return True
        end = self._pending.find(closing)
        if end < 0:
            self._pending = self._pending[len(self._pending) - _partial_tag_len(self._pending, closing):]
            return False
        self._pending = self._pending[end + len(closing):]
        self._end_call()
        return True

    def _end_call(self) -> None:
        self._state, self._raw, self._block = _State.TEXT, "", ""


def parse_tool_calls(text: str, max_num_calls: int | None = None,
                     tool_format: ToolFormat = HERMES) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output as ``(content, tool_calls)``: content None when only calls (and
    whitespace) were written; the calls as OpenAI ``tool_calls`` entries (no ``index``),
    each ``arguments`` the join of what ``ToolCallStream`` streams for it."""
    stream = ToolCallStream(max_num_calls, tool_format)
    events = stream.feed(text) + stream.finish()
    calls: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, dict):
            if "id" in event:
                calls.append({"id": event["id"], "type": "function", "function": dict(event["function"])})
            else:
                calls[event["index"]]["function"]["arguments"] += event["function"]["arguments"]
    content = "".join(e for e in events if isinstance(e, str))
    return (content or None) if calls else content, calls


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
