"""OpenAI response bodies and stream chunks for both endpoints, and SSE framing.

Completions use ``text_completion`` objects; chat uses ``chat.completion`` and
``chat.completion.chunk`` (the first chunk carries ``{"role": "assistant", "content": ""}``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    """One Server-Sent Event ``data: <json>\\n\\n``."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    """OpenAI ``usage`` object."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """What differs between the two endpoints' bodies."""

    request_id: str
    model: str
    created_unix_s: int
    chat: bool

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created_unix_s, "model": self.model}

    def body(self, text: str, finish_reason: str | None, usage_: dict[str, int]) -> dict[str, Any]:
        """The non-streaming response body."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage_}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage_}

    def first_chunk(self) -> dict[str, Any] | None:
        """The role chunk that opens a chat stream (None for completions)."""
        if not self.chat:
            return None
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def chunk(self, text: str, finish_reason: str | None = None) -> dict[str, Any]:
        """A stream chunk with a text delta (and the finish_reason on the last one)."""
        if self.chat:
            delta = {"content": text} if text or finish_reason is None else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        """The final ``choices: []`` chunk of ``stream_options.include_usage``."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_}
