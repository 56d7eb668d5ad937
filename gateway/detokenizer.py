"""Incremental detokenization: turn output token ids into text deltas, one token at a
time, so that multi-byte characters split across tokens come out whole.

Method (vLLM's ``detokenize_incrementally``, TGI's ``decode_token``): keep two offsets
into the token list. ``decode(ids[prefix_offset:read_offset])`` is text already sent;
``decode(ids[prefix_offset:])`` is that text plus the new tokens. The delta is the
difference, released only when it grew and does not end in U+FFFD (an incomplete UTF-8
sequence whose remaining bytes are in tokens still to come). Decoding a short window
rather than a single token keeps tokenizers whose decoders depend on context (leading
spaces of SentencePiece) right, and keeps each step O(window) instead of O(length).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
#: Prompt tokens that seed the window so the first output token decodes in context.
NUM_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Detokenizes one request's output, token by token.

    ``tokenizer`` is a Hugging Face tokenizer (``decode(ids, skip_special_tokens=...)``).
    ``prompt_tail`` are the last prompt token ids (context only; never emitted).
    Special tokens (EOS, chat markers) are skipped, so they never reach the text.
    Not thread-safe: one request's steps must run one after another.
    """

    def __init__(self, tokenizer: Any, prompt_tail: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_tail[-NUM_CONTEXT_TOKENS:]) if NUM_CONTEXT_TOKENS else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one output token; return the new text that is now final ('' if none)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """At the end of the output: return whatever was held back (possibly ending in
        U+FFFD when the output really is an incomplete character)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
