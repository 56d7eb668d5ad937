"""OpenAI logprobs objects from the worker's per-token logprobs (``TokenLogprobs``,
docs/protocol.md): chat ``{"content": [...]}`` and the legacy completions form.

Each token is shown alone: its raw bytes from the tokenizer's vocabulary entry
(byte-level BPE symbols mapped back to bytes, SentencePiece ``<0xNN>`` byte fallback and
``▁`` spaces), its text those bytes as UTF-8, or, for a token that is part of a
multi-byte character, ``bytes:\\xNN...`` as vLLM writes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from shared.protocol import TokenLogprobs


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, symbol -> byte (its ``bytes_to_unicode`` inverted)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[chr(b)] = b
        else:
            symbols[chr(256 + extra)] = b
            extra += 1
    return symbols


class TokenTexts:
    """Token id -> ``(text, raw bytes)`` for one tokenizer, memoised (a vocabulary entry
    never changes)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._compute(token_id)
        return found

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        raw = _piece_bytes(piece) if isinstance(piece, str) else b""
        if raw is None:
            raw = self._tokenizer.decode([token_id]).encode("utf-8")
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def _piece_bytes(piece: str) -> bytes | None:
    """The raw bytes of a vocabulary entry, or None when it is a special/added token
    (then its decoded text is used)."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
        return bytes([int(piece[3:5], 16)])
    if piece.startswith("<|") or (piece.startswith("<") and piece.endswith(">") and len(piece) > 2):
        return None
    table = _byte_decoder()
    if all(ch in table for ch in piece):  # byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen)
        return bytes(table[ch] for ch in piece)
    return piece.replace("▁", " ").encode("utf-8")  # SentencePiece


def chat_logprobs(texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs],
                  num_top: int) -> dict[str, Any]:
    """Chat ``choices[i].logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``,
    one entry per token, ``num_top`` alternatives each."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = texts.get(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top[:num_top]]}
                        for t, lp in zip(token_ids, logprobs, strict=True)]}


def completion_logprobs(texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs],
                        num_top: int, text_offset: int) -> dict[str, Any]:
    """Completions ``choices[i].logprobs``: parallel lists ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (token text -> logprob, ``num_top`` of them; the sampled token's
    included) and ``text_offset`` (characters into the output, from ``text_offset``)."""
    tokens, offsets = [], []
    for t in token_ids:
        offsets.append(text_offset)
        text = texts.get(t)[0]
        tokens.append(text)
        text_offset += len(text)
    tops = []
    for t, lp in zip(token_ids, logprobs, strict=True):
        top = {texts.get(i)[0]: v for i, v in lp.top[:num_top]}
        top.setdefault(texts.get(t)[0], lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs], "top_logprobs": tops,
            "text_offset": offsets}


def prompt_completion_logprobs(texts: TokenTexts, prompt_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprobs],
                               num_top: int, text_offset: int = 0) -> dict[str, Any]:
    """Completions ``logprobs`` of an echoed prompt (``echo`` with ``logprobs``): as
    ``completion_logprobs``, the first prompt token with ``None`` logprob and ``None``
    top_logprobs (nothing predicts it), as OpenAI and vLLM answer. ``prompt_logprobs``
    scores ``prompt_ids[1:]`` (``TokenOutput.prompt_logprobs``).

    Raises:
        ValueError: ``len(prompt_logprobs) != len(prompt_ids) - 1``.
    """
    if not prompt_ids:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    first_text = texts.get(prompt_ids[0])[0]
    rest = completion_logprobs(texts, prompt_ids[1:], prompt_logprobs, num_top, text_offset + len(first_text))
    return {"tokens": [first_text, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [text_offset, *rest["text_offset"]]}


def join_completion_logprobs(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """Two completions ``logprobs`` objects of consecutive tokens as one."""
    if then is None:
        return first
    return {key: [*first[key], *then[key]] for key in first}


_TEXTS: dict[int, tuple[Any, TokenTexts]] = {}


def token_texts(tokenizer: Any) -> TokenTexts:
    """The one ``TokenTexts`` of ``tokenizer`` (a gateway process has one tokenizer)."""
    found = _TEXTS.get(id(tokenizer))
    if found is None or found[0] is not tokenizer:
        found = _TEXTS[id(tokenizer)] = (tokenizer, TokenTexts(tokenizer))
    return found[1]


class LogprobsFormatter:
    """One request's logprobs objects, chat or completions; keeps the completions
    ``text_offset`` running across stream chunks."""

    def __init__(self, tokenizer: Any, num_top: int, chat: bool) -> None:
        self._texts = token_texts(tokenizer)
        self.num_top = num_top
        self.chat = chat
        self._offset = 0

    def format(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """The ``logprobs`` object of these tokens (the next ones of the output)."""
        if self.chat:
            return chat_logprobs(self._texts, token_ids, logprobs, self.num_top)
        out = completion_logprobs(self._texts, token_ids, logprobs, self.num_top, self._offset)
        self._offset += sum(len(t) for t in out["tokens"])
        return out

    def format_prompt(self, prompt_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """The completions ``logprobs`` object of an echoed prompt, before any output token
        (``prompt_completion_logprobs``); the output's ``text_offset`` then counts on from
        the prompt's end."""
        assert not self.chat, "echo is a completions field"
        out = prompt_completion_logprobs(self._texts, prompt_ids, prompt_logprobs, self.num_top, self._offset)
        self._offset += sum(len(t) for t in out["tokens"])
        return out
