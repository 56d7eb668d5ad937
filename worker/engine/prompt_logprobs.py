"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's raw
log-probability given the tokens before it, and the ``k`` most likely tokens there.

The same distribution as output logprobs (``sampler.RawLogprobs``, vLLM's default
``raw_logprobs``): a float32 log-softmax of the LM head's logits. A prefill chunk of a
request that asks runs the LM head over every position of the chunk that predicts a
prompt token (position ``p`` predicts ``prompt_token_ids[p + 1]``), not only its last
one, so a ``P``-token prompt gets ``P - 1`` entries, gathered chunk by chunk
(``Request.prompt_logprobs``). Positions already gathered (a request preempted
mid-prefill computes them again) are skipped. The logits are taken ``MAX_ROWS`` at a
time, so a long chunk holds at most ``[MAX_ROWS, vocab]`` float32 logits.

Such steps run eagerly (``ModelRunner.execute``): the CUDA graphs keep the hidden rows
of the sampled tokens only. Requests that do not ask pay nothing. On CUDA the first
request that asks compiles nothing (it took 1.7 s of Triton compiles on the H100): the
runner packs such steps as a mixed-step graph replay would be packed
(``ModelRunner._eager_inputs``), and runs ``warm_up_steps`` at start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shared.protocol import TokenLogprobs
from shared.sampling import SamplingParams
from worker.engine.request import Request
from worker.engine.step_types import ScheduledRequest

#: Positions whose logits are materialised at once: 512 x 152k float32 (Qwen2.5) is 0.3 GB.
MAX_ROWS = 512


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """The prompt positions one step scores for one scheduled request: entries
    ``[first, first + num)`` of its prompt logprobs, from the step's flat hidden rows
    ``[row, row + num)``, each with ``num_top`` alternatives."""

    item: int  # index in the step's batch
    row: int
    first: int
    num: int
    num_top: int


def prompt_spans(batch: Sequence[ScheduledRequest]) -> list[PromptSpan]:
    """The spans of a step whose requests ask for prompt logprobs and whose chunks hold
    positions not gathered yet; empty when none (the step may then take any path).
    The batch's hidden rows are its items' tokens in order (``StepInputs.fill``)."""
    spans: list[PromptSpan] = []
    row = 0
    for i, item in enumerate(batch):
        request = item.request
        if request.prompt_logprobs is not None:
            start = request.num_computed_tokens
            first = max(start, len(request.prompt_logprobs))
            end = min(start + item.num_tokens, request.num_prompt_tokens - 1)
            if end > first:
                spans.append(PromptSpan(i, row + first - start, first, end - first,
                                        request.sampling.prompt_logprobs or 0))
        row += item.num_tokens
    return spans


def compute_prompt_logprobs(hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            batch: Sequence[ScheduledRequest], spans: Sequence[PromptSpan]
                            ) -> list[list[TokenLogprobs] | None]:
    """Score the spans' positions.

    Args:
        hidden: ``[num_tokens, hidden_size]``, the step's final hidden states, every row.
        compute_logits: the model's LM head, ``[n, hidden_size]`` -> ``[n, vocab]``.
        batch: the step; spans: ``prompt_spans(batch)``, not empty.

    Returns:
        Per batch item, its new entries in position order, or None (no span). Waits for
        the device (the eager path's steps synchronise anyway).
    """
    device = hidden.device
    rows = torch.cat([torch.arange(s.row, s.row + s.num, device=device) for s in spans])
    targets = torch.tensor([t for s in spans for t in
                            batch[s.item].request.prompt_token_ids[s.first + 1:s.first + 1 + s.num]],
                           dtype=torch.int64, device=device)
    num_top = max(s.num_top for s in spans)
    chosen, top_values, top_ids = [], [], []
    for lo in range(0, rows.numel(), MAX_ROWS):
        logprobs = torch.log_softmax(compute_logits(hidden.index_select(0, rows[lo:lo + MAX_ROWS])).float(), dim=-1)
        chosen.append(logprobs.gather(1, targets[lo:lo + MAX_ROWS].unsqueeze(1)).squeeze(1))
        values, ids = logprobs.topk(num_top, dim=-1)  # most likely first
        top_values.append(values)
        top_ids.append(ids)
    chosen_host = torch.cat(chosen).tolist()
    values_host, ids_host = torch.cat(top_values).tolist(), torch.cat(top_ids).tolist()
    out: list[list[TokenLogprobs] | None] = [None] * len(batch)
    at = 0
    for s in spans:
        out[s.item] = [TokenLogprobs(chosen_host[j], list(zip(ids_host[j][:s.num_top], values_host[j][:s.num_top])))
                       for j in range(at, at + s.num)]
        at += s.num
    return out


def warm_up_steps(max_num_seqs: int, max_num_batched_tokens: int, block_size: int,
                  num_blocks: int) -> list[list[ScheduledRequest]]:
    """Two small steps that score prompt logprobs (a chunk alone, and one beside a decode
    token), for the runner to execute at start-up: they load the torch kernels of
    ``compute_prompt_logprobs`` (log-softmax, gather, top-k) and the LM head's plans for a
    row count the graphs do not use. The Triton kernels need none: on CUDA such steps
    take the mixed-step graphs' padded inputs (``ModelRunner._eager_inputs``), the ones
    they were compiled for. Fresh greedy requests over blocks ``0 ..``, ``prompt_logprobs
    = 1``: run them before any real request owns a block (their KV is overwritten by the
    requests that follow)."""
    steps: list[list[ScheduledRequest]] = []
    for shape in ([7], [5, 1]):
        if sum(shape) > max_num_batched_tokens or len(shape) > max_num_seqs or len(shape) > num_blocks:
            continue
        step = []
        for i, num in enumerate(shape):
            decode = i > 0  # a running request's decode token beside the chunk
            prompt_len = 2 if decode else num
            sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=None if decode else 1)
            request = Request(f"warm-up-{i}", [1] * prompt_len, sampling, num_computed_tokens=prompt_len - 1 if decode
                              else 0, block_table=[i], prompt_logprobs=None if decode else [])
            step.append(ScheduledRequest(request, num))
        steps.append(step)
    return steps
