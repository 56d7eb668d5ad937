"""OpenAI response bodies and stream chunks for both endpoints, and SSE framing.

Completions use ``text_completion`` objects; chat uses ``chat.completion`` and
``chat.completion.chunk`` (the first chunk carries ``{"role": "assistant", "content": ""}``).

Stream chunks are the hot path (one per output token and stream): ``ResponseShape``
encodes each request's constant JSON once, so a text chunk costs one ``msgspec`` string
encode and a concatenation. The bytes equal ``sse_event`` of the dict form
(tests/test_relay_batches.py checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

DONE_EVENT = b"data: [DONE]\n\n"

_json_encode = msgspec.json.Encoder().encode


def sse_event(payload: dict[str, Any]) -> bytes:
    """One Server-Sent Event ``data: <json>\\n\\n`` (compact JSON, UTF-8 as is)."""
    return b"data: " + _json_encode(payload) + b"\n\n"


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI ``usage`` object, in tokens: ``prompt_tokens_details.cached_tokens`` is the
    part of ``prompt_tokens`` found in the worker's prefix cache (as OpenAI and vLLM report
    it; always present, 0 for a miss). What a response counts: ``choices.usage_of``."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """What differs between the two endpoints' bodies, for the choice ``index`` of a
    response (gateway/choices.py: prompt index * n + choice index)."""

    request_id: str
    model: str
    created_unix_s: int
    chat: bool
    index: int = 0
    #: ``sse_event(self.chunk(text))`` = ``_text_head + <text as JSON> + _text_tail``.
    _text_head: bytes = field(init=False, repr=False)
    _text_tail: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        marker = "\x00"  # the text is the last string of the chunk: split at its last
        head, _, tail = sse_event(self.chunk(marker)).rpartition(_json_encode(marker))
        object.__setattr__(self, "_text_head", head)
        object.__setattr__(self, "_text_tail", tail)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created_unix_s, "model": self.model}

    def choice(self, text: str | None, finish_reason: str | None, tool_calls: list[dict[str, Any]] | None = None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """This choice of a non-streaming body (chat ``tool_calls``: gateway/tool_parser.py;
        ``logprobs``: gateway/logprobs.py)."""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def body(self, choices: list[dict[str, Any]], usage_: dict[str, Any]) -> dict[str, Any]:
        """The non-streaming response body with ``choices`` (``choice``'s, in index order)."""
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": usage_}

    def first_chunk(self) -> dict[str, Any] | None:
        """The role chunk that opens a chat stream (None for completions)."""
        if not self.chat:
            return None
        choice = {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def chunk(self, text: str, finish_reason: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A stream chunk with a text delta (and the finish_reason on the last one), and
        the logprobs of the tokens in it when asked for."""
        if self.chat:
            delta = {"content": text} if text or finish_reason is None else {}
            choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def chunk_event(self, text: str, finish_reason: str | None = None,
                    logprobs: dict[str, Any] | None = None) -> bytes:
        """``sse_event(self.chunk(text, finish_reason, logprobs))``; the text-only chunk
        without building the dict."""
        if finish_reason is None and logprobs is None:
            return self._text_head + _json_encode(text) + self._text_tail
        return sse_event(self.chunk(text, finish_reason, logprobs))

    def delta_event(self, delta: dict[str, Any]) -> bytes:
        """A chat stream chunk with ``delta`` as given (a tool-call delta), as an SSE event."""
        choice = {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}
        return sse_event({**self._head("chat.completion.chunk"), "choices": [choice]})

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        """The final ``choices: []`` chunk of ``stream_options.include_usage``."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_}
