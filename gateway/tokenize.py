"""Prompt tokenization and chat templates, run on one dedicated thread.

All tokenizer work (encode, chat template, incremental decode) goes through
``TokenizerWorker.run``: it keeps the event loop free, and one thread avoids the
"Already borrowed" errors that Hugging Face fast tokenizers raise when two threads use
one tokenizer at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.errors import OpenAIError

T = TypeVar("T")


class TokenizerWorker:
    """A tokenizer plus the single thread that uses it.

    ``vocab_size`` bounds token-id prompts; ``eos_token_ids`` are hidden from output text.
    """

    def __init__(self, tokenizer: Any, config: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferq-tokenizer")
        config = config or {}
        self.vocab_size = max(len(tokenizer), int(config.get("vocab_size") or 0))
        eos = config.get("eos_token_id")
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(int(i) for i in eos_ids)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the tokenizer thread and await its result."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        """Stop the thread (pending work is finished first)."""
        self._executor.shutdown(wait=True)

    async def completion_prompt(self, prompt: str | Sequence[Any]) -> list[int]:
        """Token ids of a /v1/completions ``prompt`` (str, [str], [int] or [[int]]).

        Raises:
            OpenAIError: 400 for an empty prompt or token ids outside the vocabulary.
        """
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await self.run(self._encode, prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                  param="prompt")
        if not ids:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        return ids

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    async def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a conversation with the chat template and the generation prompt.

        Raises:
            OpenAIError: 400 when the template rejects the conversation or it is empty.
        """
        try:
            ids = await self.run(self._apply_template, messages)
        except OpenAIError:
            raise
        except Exception as exc:  # jinja2.TemplateError, ValueError: the template said no
            raise OpenAIError(400, f"chat template failed: {exc}", param="messages") from exc
        if not ids:
            raise OpenAIError(400, "messages produced an empty prompt", param="messages")
        return ids

    def _apply_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError(400, "this model has no chat template; use /v1/completions", param="messages")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding (a Mapping); older versions a list.
        if isinstance(out, Mapping) or hasattr(out, "keys"):
            out = out["input_ids"]
        return [int(t) for t in out]
