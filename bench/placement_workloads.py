"""Workloads of ``bench/placement_bench.py``: token-id prompts, the streaming client that
sends them, and what a phase of requests saw.

Every prompt is a list of random token ids in ``[TOKEN_ID_LOW, TOKEN_ID_HIGH)`` (no
special tokens, valid in every vocabulary we serve); every request is a streamed
``/v1/completions`` with ``ignore_eos``, greedy, a fixed ``max_tokens`` and usage in the
last chunk. The four workloads (sizes in ``Sizes``):

- ``burst``: ``burst_requests`` prompts of ``burst_prompt_len`` tokens, all at once.
- ``multi_turn``: ``users`` conversations over ``rounds`` rounds; round 0 sends each
  user's first prompt (``first_prompt_len``), each later round that user's history plus
  the previous answer's token ids plus ``turn_len`` new tokens (``next_turn``), every user
  of a round at once.
- ``shared_prefix``: SGLang's generated-shared-prefix (``bench_serving.py --dataset-name
  generated-shared-prefix``): ``groups`` system prompts of ``system_prompt_len`` tokens,
  each followed by ``prompts_per_group`` questions of ``question_len`` tokens, shuffled
  as SGLang does; at ``shared_concurrency`` at once (0: all at once).
- ``throughput``: no reuse; prompt and output lengths lognormal around their medians
  (``lognormal_lengths``), ``throughput_concurrency`` at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from bench.loadgen.client import RequestOutput, send_request
from bench.loadgen.metrics import compute_metrics

#: Prompt token ids are drawn from this range (as ``bench.loadgen``'s random dataset).
TOKEN_ID_LOW, TOKEN_ID_HIGH = 1000, 32000
#: Lognormal lengths are clipped to this many times their median (no 40k-token outlier).
MAX_LENGTH_OVER_MEDIAN = 4
WORKLOADS = ("burst", "multi_turn", "shared_prefix", "throughput")


@dataclass(frozen=True, slots=True)
class Sizes:
    """Workload sizes; lengths in tokens. Defaults: the GPU workloads (docs/benchmarks.md, scale-out)."""

    burst_requests: int = 96
    burst_prompt_len: int = 3000
    burst_output_len: int = 64
    users: int = 96
    rounds: int = 5  # round 0 + 4 follow-ups
    first_prompt_len: int = 3000
    turn_len: int = 50
    turn_output_len: int = 64
    groups: int = 64
    prompts_per_group: int = 16
    system_prompt_len: int = 2048
    question_len: int = 128
    shared_output_len: int = 256
    shared_concurrency: int = 0  # 0: all at once
    throughput_requests: int = 1600
    throughput_concurrency: int = 512
    throughput_input_len: int = 500  # median
    throughput_output_len: int = 150  # median
    throughput_sigma: float = 0.5  # of the lengths' natural logarithm

    def __post_init__(self) -> None:
        counts = (self.burst_requests, self.burst_prompt_len, self.burst_output_len, self.users, self.first_prompt_len,
                  self.turn_output_len, self.groups, self.prompts_per_group, self.system_prompt_len,
                  self.question_len, self.shared_output_len, self.throughput_requests,
                  self.throughput_concurrency, self.throughput_input_len, self.throughput_output_len)
        assert min(counts) >= 1, "counts and lengths must be at least 1"
        assert self.rounds >= 2, "multi_turn needs round 0 and at least one follow-up"
        assert self.turn_len >= 0 and self.shared_concurrency >= 0 and self.throughput_sigma >= 0

    def max_total_len(self, workloads: Sequence[str]) -> int:
        """Longest prompt + output any request of ``workloads`` may have, tokens."""
        lengths = {
            "burst": self.burst_prompt_len + self.burst_output_len,
            "multi_turn": self.first_prompt_len + (self.rounds - 1) * (self.turn_output_len + self.turn_len)
            + self.turn_output_len,
            "shared_prefix": self.system_prompt_len + self.question_len + self.shared_output_len,
            "throughput": MAX_LENGTH_OVER_MEDIAN * (self.throughput_input_len + self.throughput_output_len),
        }
        return max(lengths[w] for w in workloads)


# -- prompts ------------------------------------------------------------------------------------
def random_ids(rng: np.random.Generator, length: int) -> list[int]:
    """``length`` random token ids in ``[TOKEN_ID_LOW, TOKEN_ID_HIGH)``."""
    return rng.integers(TOKEN_ID_LOW, TOKEN_ID_HIGH, size=length).tolist()


def burst_prompts(sizes: Sizes, rng: np.random.Generator) -> list[list[int]]:
    """``burst_requests`` independent prompts of ``burst_prompt_len`` tokens."""
    return [random_ids(rng, sizes.burst_prompt_len) for _ in range(sizes.burst_requests)]


def first_turns(sizes: Sizes, rng: np.random.Generator) -> list[list[int]]:
    """Each user's first prompt (``first_prompt_len`` tokens)."""
    return [random_ids(rng, sizes.first_prompt_len) for _ in range(sizes.users)]


def next_turn(history: list[int], answer_ids: list[int], sizes: Sizes, rng: np.random.Generator) -> list[int]:
    """The next prompt of a conversation: its last prompt, that prompt's answer, then
    ``turn_len`` new tokens (the user's next message)."""
    return [*history, *answer_ids, *random_ids(rng, sizes.turn_len)]


def shared_prefix_prompts(sizes: Sizes, rng: np.random.Generator) -> list[tuple[int, list[int]]]:
    """SGLang's generated-shared-prefix prompts as ``(group, prompt)``: per group one
    system prompt of ``system_prompt_len`` tokens, then per prompt a question of
    ``question_len`` tokens; the list shuffled (SGLang's
    ``sample_generated_shared_prefix_requests`` shuffles its requests too)."""
    prompts = []
    for group in range(sizes.groups):
        system = random_ids(rng, sizes.system_prompt_len)
        prompts += [(group, system + random_ids(rng, sizes.question_len)) for _ in range(sizes.prompts_per_group)]
    order = rng.permutation(len(prompts))
    return [prompts[i] for i in order]


def lognormal_lengths(rng: np.random.Generator, median: int, sigma: float, count: int,
                      max_len: int | None = None) -> list[int]:
    """``count`` lengths whose logarithm is normal around ``log(median)`` with ``sigma``,
    rounded, clipped to ``[1, max_len]`` (default ``MAX_LENGTH_OVER_MEDIAN * median``)."""
    raw = rng.lognormal(math.log(median), sigma, size=count)
    cap = MAX_LENGTH_OVER_MEDIAN * median if max_len is None else max_len
    return np.clip(np.rint(raw), 1, cap).astype(int).tolist()


def throughput_requests(sizes: Sizes, rng: np.random.Generator) -> list[tuple[list[int], int]]:
    """``throughput_requests`` of ``(prompt, max_tokens)``, lengths by ``lognormal_lengths``."""
    n = sizes.throughput_requests
    inputs = lognormal_lengths(rng, sizes.throughput_input_len, sizes.throughput_sigma, n)
    outputs = lognormal_lengths(rng, sizes.throughput_output_len, sizes.throughput_sigma, n)
    return [(random_ids(rng, i), o) for i, o in zip(inputs, outputs, strict=True)]


# -- the client -------------------------------------------------------------------------------
@dataclass(slots=True)
class Sent:
    """One request to send: its prompt, ``max_tokens`` and extra headers."""

    prompt: list[int]
    max_tokens: int
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Completion:
    """One request as the client saw it: loadgen's record (times, output tokens, text),
    the prompt tokens the server's usage reports (0 without usage) and the generated
    token ids when the server streams them (vLLM's ``return_token_ids``; else None)."""

    output: RequestOutput
    num_prompt_tokens: int = 0
    token_ids: list[int] | None = None


def request_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A streamed, greedy ``/v1/completions`` body that asks for usage and token ids."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                            headers: dict[str, str]) -> Completion:
    """POST ``body`` to ``url`` and read its SSE stream (``bench.loadgen.client.send_request``:
    TTFT to the first content chunk, one ITL per later one), keeping the prompt tokens the
    usage reports and the token ids the server streams. Never raises: failures land in
    ``output.error``."""
    ids: list[int] = []
    num_prompt_tokens = 0

    def on_chunk(chunk: dict[str, Any]) -> None:
        nonlocal num_prompt_tokens
        if usage := chunk.get("usage"):
            num_prompt_tokens = usage.get("prompt_tokens") or 0
        for choice in chunk.get("choices") or ():
            ids.extend(choice.get("token_ids") or ())

    out = await send_request(client, url, body, len(body["prompt"]), headers, on_chunk=on_chunk,
                             usage_is_content=True)
    return Completion(out, num_prompt_tokens, ids if out.success and ids else None)


async def send_timed(client: httpx.AsyncClient, urls: Sequence[str], model: str, requests: Sequence[Sent],
                     concurrency: int = 0, indices: Sequence[int] | None = None
                     ) -> tuple[list[Completion], float, float]:
    """Send ``requests``, request ``j`` to ``urls[indices[j] % len(urls)]`` (``indices``
    default: ``0, 1, ...``), at most ``concurrency`` at once (0: all at once); returns
    their completions in order and the first send's and last end's
    ``time.perf_counter()``, seconds."""
    semaphore = asyncio.Semaphore(concurrency) if concurrency else None
    where = range(len(requests)) if indices is None else indices

    async def one(j: int, request: Sent) -> Completion:
        body = request_body(model, request.prompt, request.max_tokens)
        url = urls[where[j] % len(urls)]
        if semaphore is None:
            return await stream_completion(client, url, body, request.headers)
        async with semaphore:
            return await stream_completion(client, url, body, request.headers)

    start_s = time.perf_counter()
    done = await asyncio.gather(*(one(j, r) for j, r in enumerate(requests)))
    return list(done), start_s, time.perf_counter()


async def send_all(client: httpx.AsyncClient, urls: Sequence[str], model: str, requests: Sequence[Sent],
                   concurrency: int = 0) -> tuple[list[Completion], float]:
    """Send ``requests`` round-robin over ``urls``, at most ``concurrency`` at once (0: all
    at once); returns their completions in order and the wall time from the first send
    to the last end, seconds (``send_timed``)."""
    done, start_s, end_s = await send_timed(client, urls, model, requests, concurrency)
    return done, end_s - start_s


def summarize(requests: Sequence[Sent], done: Sequence[Completion], wall_s: float) -> dict[str, Any]:
    """What the client saw of one phase: counts, tokens sent and received, output tok/s
    over the wall time, TTFT / ITL / E2E latency (ms) and the first distinct errors."""
    outputs = [c.output for c in done]
    m = compute_metrics(outputs, max(wall_s, 1e-9), (50.0, 99.0))
    ok = [(r, c) for r, c in zip(requests, done, strict=True) if c.output.success]

    def lat(name: str) -> dict[str, float]:
        s = m.latency[name]
        return {"mean": s.mean_ms, "p50": s.percentiles_ms[50.0], "p99": s.percentiles_ms[99.0]}

    return {"wall_s": wall_s, "sent": len(requests), "completed": m.completed, "failed": m.failed,
            "prompt_tokens_sent": sum(len(r.prompt) for r in requests),
            "prompt_tokens_usage": sum(c.num_prompt_tokens for _, c in ok),
            # Completions whose usage counts another prompt's length than their request's.
            "usage_mismatches": sum(c.num_prompt_tokens != len(r.prompt) for r, c in ok),
            "output_tokens": m.total_output_tokens,
            "output_tokens_expected": sum(r.max_tokens for r in requests),
            "output_tok_s": m.total_output_tokens / wall_s if wall_s > 0 else 0.0,
            "ttft_ms": lat("ttft"), "itl_ms": lat("itl"), "e2el_ms": lat("e2el"),
            "errors": sorted({o.error for o in outputs if o.error})[:5]}
