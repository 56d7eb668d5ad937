"""Prompt tokenization (encode, chat template) on a thread pool, so that one request's
CPU work never queues behind another's.

- Prompts are encoded on a pool of ``num_encode_threads`` threads that call the Rust
  ``tokenizers.Tokenizer`` of a fast tokenizer directly: its ``encode_batch`` releases the
  GIL (a long encode does not stall the event loop) and, like ``decode``, only borrows
  the tokenizer immutably, so the threads share it. Hugging Face's ``tokenizer(...)``
  would re-set truncation, padding and ``encode_special_tokens`` on the shared object
  when a call asks for other values, which raises "Already borrowed" in a thread that is
  encoding at that moment. A slow (Python) tokenizer is called as is. Each encode has a
  time budget (``encode_timeout_s``, waiting for a free thread included): past it the
  request gets a 503 and nobody waits for it. Python cannot stop a running thread, so an
  encode that overran still finishes in the background; the character bound below keeps
  every encode that starts short.
- Output detokenization is not here: it runs on the event loop, in the relay's pass
  over each token batch (``gateway/detokenizer.py``: a few µs per token).
- Cheap checks first: a prompt of C characters has at least ``ceil(C / max_token_chars)``
  tokens, so a prompt that cannot fit ``max_model_len`` is refused without tokenizing it
  (``max_token_chars``; docs/operations.md, "Limits").
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.errors import OpenAIError
from shared.model_source import eos_token_ids

T = TypeVar("T")
log = logging.getLogger(__name__)

#: Encode threads when ``num_encode_threads`` is 0: one per usable core, at most this many.
MAX_DEFAULT_ENCODE_THREADS = 8
#: How much a normalizer can shorten text, as a divisor of its length (None: unbounded,
#: the character check is off). Composition (NFC, NFKC) joins at most 4 code points into
#: one, since no canonical decomposition is longer (Unicode UAX #15, "Stream-Safe Text
#: Format"); the others never shorten text (a Replace only when its content is at least as
#: long as its pattern).
_NORMALIZER_SHRINK = {"Prepend": 1, "NFD": 1, "NFKD": 1, "Lowercase": 1, "NFC": 4, "NFKC": 4}
#: Pre-tokenizers that keep every character (a Split or Punctuation whose behavior is
#: "Removed" drops them; Whitespace and BertPreTokenizer drop whitespace).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def _normalizer_shrink(spec: Mapping[str, Any] | None) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factors = [_normalizer_shrink(n) for n in spec.get("normalizers", [])]
        return None if None in factors else math.prod(f for f in factors if f is not None)
    if kind == "Replace":
        pattern = spec.get("pattern", {})
        keeps = "String" in pattern and len(spec.get("content", "")) >= len(pattern["String"])
        return 1 if keeps else None
    return _NORMALIZER_SHRINK.get(str(kind))


def _keeps_characters(spec: Mapping[str, Any] | None) -> bool:
    if spec is None:
        return True
    if spec.get("type") == "Sequence":
        return all(_keeps_characters(p) for p in spec.get("pretokenizers", []))
    return spec.get("type") in _KEEPING_PRE_TOKENIZERS and spec.get("behavior") != "Removed"


def _has_byte_level(spec: Mapping[str, Any] | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in spec.get("pretokenizers", []))
    return spec.get("type") == "ByteLevel"


def max_token_chars(tokenizer: Any) -> tuple[int | None, str]:
    """Characters of input text that one token can stand for, at most, and why.

    Returns ``(L, reason)``: every text of C characters encodes to at least
    ``ceil(C / L)`` tokens (chat templates and special tokens only add more). L is the
    longest vocabulary string, times what the normalizer can shrink text by; a
    byte-level vocabulary string has one character per byte, and a byte has at most one
    character of the text. ``L`` is None (no bound) for tokenizers that can map a span of
    any length to one token or drop characters: slow (Python) tokenizers, models other
    than BPE, BPE that fuses unknown characters without byte fallback, and normalizers or
    pre-tokenizers that delete text (Strip, StripAccents, BertNormalizer, Precompiled,
    Whitespace, ...).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None, "not a fast (Rust) tokenizer"
    model = backend.model
    kind = type(model).__name__
    if kind != "BPE":
        return None, f"{kind} model (may map a whole span to one unknown token)"
    pre_tokenizer = _state(backend.pre_tokenizer)
    if model.fuse_unk and not model.byte_fallback and not _has_byte_level(pre_tokenizer):
        return None, "BPE fuses unknown characters into one token"
    if not _keeps_characters(pre_tokenizer):
        return None, "the pre-tokenizer drops characters"
    shrink = _normalizer_shrink(_state(backend.normalizer))
    if shrink is None:
        return None, "the normalizer can delete characters"
    longest = max(len(s) for s in backend.get_vocab(with_added_tokens=True))
    return longest * shrink, f"longest vocabulary string {longest} characters, normalizer shrink {shrink}"


def _state(component: Any) -> dict[str, Any] | None:
    """A tokenizers normalizer or pre-tokenizer as its JSON spec (None stays None)."""
    return None if component is None else json.loads(component.__getstate__())


def default_num_encode_threads() -> int:
    """One encode thread per core this process may run on, at most ``MAX_DEFAULT_ENCODE_THREADS``."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_DEFAULT_ENCODE_THREADS))


class TokenizerWorker:
    """A tokenizer and its encode pool.

    ``vocab_size`` bounds token-id prompts; ``eos_token_ids`` are hidden from output text;
    ``max_token_chars`` (None: unknown) bounds the characters per token.

    Raises:
        ValueError: ``num_encode_threads`` < 0 or ``encode_timeout_s`` <= 0.
    """

    def __init__(self, tokenizer: Any, config: Mapping[str, Any] | None = None, *, num_encode_threads: int = 0,
                 encode_timeout_s: float = 10.0) -> None:
        if num_encode_threads < 0:
            raise ValueError(f"num_encode_threads must be >= 0 (0: one per core), got {num_encode_threads}")
        if not encode_timeout_s > 0:
            raise ValueError(f"encode_timeout_s must be > 0, got {encode_timeout_s}")
        self.tokenizer = tokenizer
        self.encode_timeout_s = encode_timeout_s
        config = config or {}
        self.vocab_size = max(len(tokenizer), int(config.get("vocab_size") or 0))
        tokenizer_eos = () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
        self.eos_token_ids = eos_token_ids(config) | frozenset(tokenizer_eos)
        self.max_token_chars, why = max_token_chars(tokenizer)
        log.info("prompt pre-check: %s (%s)", "off" if self.max_token_chars is None
                 else f"at most {self.max_token_chars} characters per token", why)
        self._backend = _encode_backend(tokenizer)
        self.num_encode_threads = num_encode_threads or default_num_encode_threads()
        self._encode_pool = ThreadPoolExecutor(self.num_encode_threads, thread_name_prefix="inferq-encode")

    async def run_blocking(self, fn: Callable[..., T], *args: Any, param: str, action: str = "tokenizing",
                           code: str = "tokenize_timeout") -> T:
        """Run ``fn(*args)`` on the encode pool within the time budget (``encode_timeout_s``,
        waiting for a thread included): tokenizing, and other CPU work on a request's
        fields such as checking a structured-output schema (gateway/structured.py).

        Raises:
            OpenAIError: 503 ``code`` past ``encode_timeout_s`` (a queued call is
                dropped), naming ``param``; whatever ``fn`` raises.
        """
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._encode_pool, fn, *args)
        try:
            return await asyncio.wait_for(future, self.encode_timeout_s)
        except TimeoutError:
            raise OpenAIError(503, f"{action} the {param} took longer than {self.encode_timeout_s:g} s",
                              param=param, code=code) from None

    def close(self) -> None:
        """Stop the threads: queued encodes are dropped."""
        self._encode_pool.shutdown(wait=False, cancel_futures=True)

    def check_prompt_chars(self, num_chars: int, max_model_len: int, param: str) -> None:
        """Refuse a prompt of ``num_chars`` characters that cannot fit ``max_model_len``
        tokens whatever it says (a prompt needs fewer tokens than ``max_model_len``).

        Raises:
            OpenAIError: 400 naming ``param``.
        """
        if self.max_token_chars is None:
            return
        min_tokens = math.ceil(num_chars / self.max_token_chars)
        if min_tokens >= max_model_len:
            raise OpenAIError(400, f"the {param} is {num_chars} characters, at least {min_tokens} tokens; this "
                              f"model's maximum context length is {max_model_len} tokens", param=param)

    async def completion_prompts(self, prompts: Sequence[str | Sequence[int]], max_model_len: int) -> list[list[int]]:
        """Token ids of each of a /v1/completions request's prompts (``CompletionRequest.prompts``),
        encoded side by side on the pool.

        Raises:
            OpenAIError: as ``completion_prompt``, for the first prompt that fails.
        """
        return list(await asyncio.gather(*(self.completion_prompt(p, max_model_len) for p in prompts)))

    async def completion_prompt(self, prompt: str | Sequence[int], max_model_len: int) -> list[int]:
        """Token ids of one /v1/completions prompt (a string, or token ids).

        A prompt that cannot fit ``max_model_len`` is refused before any per-token work.

        Raises:
            OpenAIError: 400 for an empty or too long prompt or token ids outside the
                vocabulary; 503 when encoding overran its time budget.
        """
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt), max_model_len, "prompt")
            ids = await self.run_blocking(self.encode, prompt, True, max_model_len, param="prompt")
        else:
            check_prompt_tokens(len(prompt), max_model_len, "prompt")
            ids = list(prompt)  # ints: the schema refuses anything else
            # min and max run in C; the Python loop only looks for the id to name in the error
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                bad = next(t for t in ids if not 0 <= t < self.vocab_size)
                raise OpenAIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                                  param="prompt")
        if not ids:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        return ids

    async def chat_prompt(self, messages: list[dict[str, Any]], max_model_len: int | None, *,
                          add_generation_prompt: bool = True, add_special_tokens: bool = False,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation with the chat template and (by default) the
        generation prompt; special tokens are the template's own unless
        ``add_special_tokens`` (vLLM's ``/tokenize`` option). ``tools`` go to the template
        as its ``tools`` variable (gateway/tools.py ``template_messages`` decides whether).

        The template is rendered to text first; text that cannot fit ``max_model_len``
        (None: no bound) is refused before it is encoded.

        Raises:
            OpenAIError: 400 when the template rejects the conversation, or it is empty or
                too long; 503 when templating and encoding overran their time budget.
        """
        try:
            ids = await self.run_blocking(self._apply_template, messages, max_model_len, add_generation_prompt,
                                          add_special_tokens, tools, param="messages")
        except OpenAIError:
            raise
        except Exception as exc:  # jinja2.TemplateError, ValueError: the template said no
            raise OpenAIError(400, f"chat template failed: {exc}", param="messages") from exc
        if not ids:
            raise OpenAIError(400, "messages produced an empty prompt", param="messages")
        return ids

    def _apply_template(self, messages: list[dict[str, Any]], max_model_len: int | None,
                        add_generation_prompt: bool, add_special_tokens: bool,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError(400, "this model has no chat template; use /v1/completions", param="messages")
        # What apply_chat_template(tokenize=True) does, with the length check in between:
        # the template writes the special tokens itself, so by default none are added.
        text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        if max_model_len is not None:
            self.check_prompt_chars(len(text), max_model_len, "messages")
        return self.encode(text, add_special_tokens, max_model_len, "messages")

    def encode(self, text: str, add_special_tokens: bool, max_model_len: int | None = None,
               param: str = "prompt") -> list[int]:
        """Token ids of ``text``, as ``tokenizer(text)["input_ids"]``; safe on any thread.

        Blocking (seconds for megabytes of text): call it off the event loop. With
        ``max_model_len``, a prompt that does not fit is refused before its ids become a
        Python list (for a million tokens that alone holds the GIL for ~0.1 s).

        Raises:
            OpenAIError: 400 naming ``param`` when the prompt does not fit ``max_model_len``.
        """
        if self._backend is None:
            ids = list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        else:
            # ``encode_batch``, not ``encode``: only the batch call releases the GIL.
            encoding = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
            if max_model_len is not None:
                check_prompt_tokens(len(encoding), max_model_len, param)
            ids = list(encoding.ids)
        if max_model_len is not None:
            check_prompt_tokens(len(ids), max_model_len, param)
        return ids


def check_prompt_tokens(num_tokens: int, max_model_len: int, param: str) -> None:
    """Refuse a prompt of ``num_tokens`` that leaves no room for output in ``max_model_len``.

    Raises:
        OpenAIError: 400 naming ``param``.
    """
    if num_tokens >= max_model_len:
        raise OpenAIError(400, f"the prompt is {num_tokens} tokens; this model's maximum context length is "
                          f"{max_model_len} tokens", param=param)


def _encode_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer that ``encode`` calls (None for a slow tokenizer): the fast
    tokenizer's own, or a private copy without truncation and padding when its
    tokenizer.json sets them (``tokenizer(...)`` turns both off on every call)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or (backend.truncation is None and backend.padding is None):
        return backend
    private = type(backend).from_str(backend.to_str())
    private.no_truncation()
    private.no_padding()
    private.encode_special_tokens = backend.encode_special_tokens
    return private
