"""Incremental detokenization: turn output token ids into text deltas, one token at a
time, so that multi-byte characters split across tokens come out whole.

Method (vLLM's ``detokenize_incrementally``, TGI's ``decode_token``): keep two offsets
into the token list. ``decode(ids[prefix_offset:read_offset])`` is text already sent;
``decode(ids[prefix_offset:])`` is that text plus the new tokens. The delta is the
difference, released only when it grew and does not end in U+FFFD (an incomplete UTF-8
sequence whose remaining bytes are in tokens still to come). Decoding a short window
rather than a single token keeps tokenizers whose decoders depend on context (leading
spaces of SentencePiece) right, and keeps each step O(window) instead of O(length).

Two implementations of that method, with one interface (``add``, ``flush``):

- ``StreamDetokenizer``: the ``tokenizers`` library's ``DecodeStream`` (Rust; the
  method above with its state kept in Rust), several times cheaper than the Python
  window: cheap enough to run on the event loop, for every request of a relayed batch in
  one pass (docs/architecture.md, "The relay"; ``python -m bench.relay_bench inline``).
- ``WindowDetokenizer``: the same method in Python over Hugging Face ``decode``: for
  slow (Python) tokenizers and tokenizers whose ``decode`` cleans up spaces (which
  ``DecodeStream`` does not), and the reference the stream one is tested against.

``make_detokenizer`` picks one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
#: Prompt tokens that seed the window so the first output token decodes in context.
NUM_CONTEXT_TOKENS = 5
#: How ``DecodeStream.step`` says its text stopped extending the text already sent (a
#: decoder whose output is not prefix-stable); vLLM recovers the same way
#: (vllm-project/vllm#17448).
_INVALID_PREFIX = "Invalid prefix encountered"


class Detokenizer(Protocol):
    """One request's incremental detokenizer. Not thread-safe."""

    def add(self, token_id: int) -> str:
        """Append one output token; return the new text that is now final ('' if none)."""
        ...

    def flush(self) -> str:
        """At the end of the output: return whatever was held back (possibly ending in
        U+FFFD when the output really is an incomplete character)."""
        ...


class WindowDetokenizer:
    """Detokenizes one request's output, token by token, in Python.

    ``tokenizer`` is a Hugging Face tokenizer (``decode(ids, skip_special_tokens=...)``).
    ``prompt_tail`` are the last prompt token ids (context only; never emitted).
    Special tokens (EOS, chat markers) are skipped, so they never reach the text.
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
        """At the end of the output: return whatever was held back."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""


class StreamDetokenizer:
    """Detokenizes one request's output with ``tokenizers.decoders.DecodeStream``.

    ``backend`` is a ``tokenizers.Tokenizer`` (a fast tokenizer's ``backend_tokenizer``);
    ``prompt_tail`` as for ``WindowDetokenizer``. Special tokens are skipped.
    """

    def __init__(self, backend: Any, prompt_tail: Sequence[int] = ()) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._new_stream = DecodeStream
        context = list(prompt_tail[-NUM_CONTEXT_TOKENS:]) if NUM_CONTEXT_TOKENS else []
        # A context that ends inside a character would come out with the first output
        # token that completes it, as if it were output: leave such tokens out.
        while context and backend.decode(context, skip_special_tokens=True).endswith(REPLACEMENT_CHAR):
            context.pop()
        self._stream = DecodeStream(skip_special_tokens=True)
        for token_id in context:  # what ``DecodeStream(ids=...)`` does, on tokenizers < 0.22 too
            self._stream.step(backend, token_id)
        #: Tokens added since the last text released (an incomplete character, or
        #: tokens that decode to nothing), and up to ``NUM_CONTEXT_TOKENS`` tokens before
        #: them (the context ``flush`` decodes them in).
        self._held: list[int] = []
        self._recent = context

    def add(self, token_id: int) -> str:
        """Append one output token; return the new text that is now final ('' if none)."""
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            # The decoder rewrote text already sent (sent text cannot be taken back):
            # start a new stream at this token.
            log.warning("detokenizer: %s; restarting the decode stream", exc)
            self._stream = self._new_stream(skip_special_tokens=True)
            self._held, self._recent = [], []
            text = self._stream.step(self._backend, token_id)
        if text is None:
            self._held.append(token_id)
            return ""
        self._recent = [*self._recent, *self._held, token_id][-NUM_CONTEXT_TOKENS:]
        if self._held:
            self._held = []
        return text

    def flush(self) -> str:
        """At the end of the output: return whatever was held back (an incomplete
        character decodes to U+FFFD)."""
        if not self._held:
            return ""
        context, held, self._held = self._recent, self._held, []
        prefix_text = self._backend.decode(context, skip_special_tokens=True)
        text: str = self._backend.decode(context + held, skip_special_tokens=True)
        return text[len(prefix_text):] if len(text) > len(prefix_text) else ""


def make_detokenizer(tokenizer: Any, prompt_ids: Sequence[int] = ()) -> Detokenizer:
    """A ``StreamDetokenizer`` for a fast tokenizer (its backend a ``tokenizers.Tokenizer``,
    tokenizers >= 0.21) whose ``decode`` keeps spaces as they are, else a
    ``WindowDetokenizer``; ``prompt_ids`` seed the context (never emitted)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if _streams(backend) and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return StreamDetokenizer(backend, prompt_ids)
    return WindowDetokenizer(tokenizer, prompt_ids)


def _streams(backend: Any) -> bool:
    """``DecodeStream`` exists and can step ``backend`` (a Rust ``Tokenizer``, no wrapper)."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401 - tokenizers >= 0.21
    except ImportError:
        return False
    return isinstance(backend, Tokenizer)
