"""Random prompts of chosen token lengths, like ``vllm bench serve --dataset-name random``.

Lengths are drawn uniformly from ``[floor(L*(1-r)), ceil(L*(1+r))]`` for a length ``L`` and range
ratio ``r`` (vLLM's ``RandomDataset``). With a tokenizer, random non-special token ids are decoded
to text and re-encoded; since decode/encode does not round-trip, the sequence is trimmed or
extended with fresh random ids and retried (vLLM's ``gen_prompt_decode_to_target_len``), so most
prompts land on the exact length and ``prompt_len`` records the length actually sent. Without a
tokenizer the ids themselves are the prompt (``/v1/completions`` accepts a list of ints).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

MAX_DECODE_RETRIES = 10  # as in vLLM; a few ids may remain off by one or two after this


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer this module uses."""

    all_special_ids: list[int]

    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One prompt to send: text, or token ids when no tokenizer was given."""

    prompt: str | list[int]
    prompt_len: int  # tokens
    expected_output_len: int  # tokens, sent as max_tokens


def sample_lengths(rng: np.random.Generator, length: int, range_ratio: float, count: int) -> np.ndarray:
    """``count`` lengths uniform in ``[floor(length*(1-r)), ceil(length*(1+r))]``, each at least 1."""
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return rng.integers(low, high + 1, size=count)


def fit_to_length(
    tokenizer: Tokenizer, token_ids: list[int], target_len: int, allowed_ids: np.ndarray, rng: np.random.Generator
) -> tuple[str, int]:
    """Decode ``token_ids`` to text whose re-encoding is ``target_len`` tokens; returns (text, length).

    Each round decodes, re-encodes, then truncates a too-long sequence or appends random
    ``allowed_ids`` to a too-short one. Stops after ``MAX_DECODE_RETRIES`` rounds.
    """
    ids = list(token_ids)
    text = tokenizer.decode(ids)
    for _ in range(MAX_DECODE_RETRIES):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target_len:
            break
        if len(ids) > target_len:
            ids = ids[:target_len]
        else:
            ids += rng.choice(allowed_ids, size=target_len - len(ids)).tolist()
        text = tokenizer.decode(ids)
    final_len = len(tokenizer.encode(text, add_special_tokens=False))
    return text, final_len


def sample_random_requests(
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    tokenizer: Tokenizer | Any | None = None,
    token_id_low: int = 1000,
    token_id_high: int = 32000,
) -> list[SampleRequest]:
    """Build ``num_prompts`` random requests; deterministic for a given ``seed`` and tokenizer."""
    rng = np.random.default_rng(seed)
    input_lens = sample_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)
    if tokenizer is None:
        allowed_ids = np.arange(token_id_low, token_id_high)
    else:
        special = set(tokenizer.all_special_ids)
        allowed_ids = np.array([i for i in range(len(tokenizer)) if i not in special])
    requests = []
    for in_len, out_len in zip(input_lens.tolist(), output_lens.tolist(), strict=True):
        ids = rng.choice(allowed_ids, size=in_len).tolist()
        if tokenizer is None:
            requests.append(SampleRequest(prompt=ids, prompt_len=in_len, expected_output_len=out_len))
        else:
            text, real_len = fit_to_length(tokenizer, ids, in_len, allowed_ids, rng)
            requests.append(SampleRequest(prompt=text, prompt_len=real_len, expected_output_len=out_len))
    return requests
