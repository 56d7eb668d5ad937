"""Speculative decoding: the proposers' common part (an adaptive draft length per
request), n-gram prompt-lookup proposals, and the acceptance rule that keeps the target
model's output distribution. The draft-model proposer is ``draft_proposer.py``.

A step verifies a request's ``k`` proposed tokens in one forward pass: the scheduler
gives it ``1 + k`` query tokens (its last sampled token, then the drafts), the model
runner keeps the logits of all ``1 + k`` positions, and ``verify`` turns them into the
accepted drafts plus one token of the target's own (the correction at the first
rejection, or a bonus token when all ``k`` pass). The scheduler then rolls the rejected
drafts' KV back by counting only the accepted positions in ``num_computed_tokens`` and
freeing blocks past them (``Scheduler.update``); their slots are overwritten later.

Acceptance (Leviathan et al., "Fast Inference from Transformers via Speculative
Decoding", ICML 2023; Chen et al., "Accelerating Large Language Model Decoding with
Speculative Sampling", 2023): with target distribution ``p`` and draft distribution
``q``, draft token ``x ~ q`` is accepted with probability ``min(1, p(x) / q(x))``; on
rejection the token is drawn from ``norm(max(0, p - q))``, and the result is distributed
exactly as ``p``. An n-gram proposal, and a greedy draft model's (``draft_proposer.py``), is a
point mass, ``q = delta_d``, so ``q(d) = 1``:
accept ``d`` with probability ``p(d)``; on rejection ``max(0, p - delta_d)`` is ``p``
with ``p(d)`` set to 0 (``p(d) - 1 <= 0``), so draw from ``p`` without ``d``,
renormalised. ``verify`` realises this by drawing ``x ~ p`` as the plain sampler does and
accepting ``d`` iff ``x == d`` (``P = p(d)``; a rejected ``x`` is ``p`` conditioned on
``x != d``, the residual above). Greedy requests have ``p`` a point mass at the argmax:
accept the longest prefix of drafts equal to the target's argmax, then the argmax at
the first mismatch, token-identical to decoding without speculation. ``p`` is the
distribution the plain sampler draws from (``Sampler.target_probs``: ``logit_bias``,
temperature, top-k, top-p, min-p), so sampling parameters keep their meaning. Requests
with penalties, a grammar or logprobs are not speculated (their per-position state
would have to follow each draft).

Seeds: a seeded request draws one noise row per position from its own generator, as
the plain sampler does, and its generator ends just after the last emitted token's row,
so a seed gives the same output with speculation on or off.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from worker.engine.request import Request
from worker.engine.sampler import exponential_noise


@dataclass(slots=True)
class SpecStats:
    """Counters of speculation since start-up (the worker's ``/metrics``)."""

    num_verify_steps: int = 0  # request-steps that verified at least one draft
    num_draft_tokens: int = 0  # drafts proposed and verified
    num_accepted_tokens: int = 0  # drafts accepted
    proposer_time_s: float = 0.0  # wall time spent proposing (a draft model's up to its drafts on the host), s

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / verified drafts (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verifying request-step: accepted drafts + the target's one."""
        return 1 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0


def ngram_propose(token_ids: Sequence[int], max_n: int, min_n: int, num_tokens: int) -> list[int]:
    """Prompt lookup: for ``n`` from ``max_n`` down to ``min_n``, find the most recent
    earlier occurrence of the last ``n`` tokens in ``token_ids`` (prompt + output) and
    propose up to ``num_tokens`` tokens that followed it; ``[]`` when none matches.

    Args:
        token_ids: the request's tokens so far (ints).
        max_n, min_n: the longest and shortest suffix tried (``1 <= min_n <= max_n``).
        num_tokens: the most tokens to propose (``k``).
    """
    length = len(token_ids)
    if num_tokens <= 0 or length < min_n + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n:]
        # Start positions i < length - n, so the match ends before the suffix starts
        # its own occurrence and at least one token follows it.
        starts = np.flatnonzero(arr[:length - n] == suffix[0])
        for i in starts[::-1]:  # most recent first
            if np.array_equal(arr[i:i + n], suffix):
                return arr[i + n:i + n + num_tokens].tolist()
    return []


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens one verify step emits with ``k`` drafts, each accepted with
    probability ``alpha`` independently (Leviathan et al. 2023, eq. 1):
    ``(1 - alpha^(k+1)) / (1 - alpha)``."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def choose_num_drafts(alpha: float, max_k: int, token_cost: float, batch_size: int) -> int:
    """The draft length ``k`` in ``0..max_k`` that maximises tokens per unit of step
    time, ``expected_tokens(alpha, k) / (1 + c * k)``, where ``c`` is the cost of one
    more query token per sequence relative to a decode step. With a step time of
    ``a + b * tokens`` (a weight pass plus per-token work), a batch of ``B`` decodes
    costs ``a + b*B`` and ``k`` drafts each add ``b*B*k``, so ``c = rB / (1 + rB)`` with
    ``r = b / a = token_cost``: at batch 1 speculation is nearly free, as the batch grows
    each draft costs nearly a whole token and only a high ``alpha`` pays (0: off)."""
    c = token_cost * batch_size / (1 + token_cost * batch_size)
    best_k, best = 0, 1.0
    for k in range(1, max_k + 1):
        value = expected_tokens(alpha, k) / (1 + c * k)
        if value > best * 1.0001:
            best_k, best = k, value
    return best_k


class Proposer:
    """Proposes drafts for decoding requests and learns each one's acceptance rate; the
    n-gram and draft-model proposers fill in ``_propose``.

    ``alpha`` per request is ``(accepted + 1) / (accepted + rejections + 2)`` over its
    recent verify steps (a Beta(1, 1) prior, counts halved when they pass 32 so the
    estimate follows the text: a copied passage ends, a new one starts)."""

    def __init__(self, max_k: int, token_cost: float) -> None:
        self.max_k, self.token_cost = max_k, token_cost
        self._counts: dict[str, tuple[float, float]] = {}  # request id -> (accepted, rejections)
        self.stats = SpecStats()

    def eligible(self, request: Request) -> bool:
        """Decoding (one token without KV), and no per-position state that a draft would
        have to advance: penalties, a grammar, logprobs."""
        p = request.sampling
        return (request.num_tokens - request.num_computed_tokens == 1 and request.grammar is None
                and not p.needs_penalties and p.logprobs is None and request.prompt_logprobs is None)

    def alpha(self, request_id: str) -> float:
        accepted, rejected = self._counts.get(request_id, (0.0, 0.0))
        return (accepted + 1) / (accepted + rejected + 2)

    def propose(self, running: Sequence[Request]) -> None:
        """Set ``spec_token_ids`` of each running request: its drafts for the next step
        (``[]``: none). At most ``max_tokens - 1`` drafts beyond the output so far, as
        a step emits up to ``k + 1`` tokens."""
        t0 = time.perf_counter()
        batch = len(running)
        wanted: list[tuple[Request, int]] = []
        for r in running:
            r.spec_token_ids = []
            if not self.eligible(r):
                continue
            k = min(choose_num_drafts(self.alpha(r.request_id), self.max_k, self.token_cost, batch),
                    r.sampling.max_tokens - r.num_output_tokens - 1)
            if k > 0:
                wanted.append((r, k))
        if wanted:
            self._propose(wanted)
        self.stats.proposer_time_s += time.perf_counter() - t0

    def _propose(self, wanted: list[tuple[Request, int]]) -> None:
        """Set ``spec_token_ids`` of each ``(request, k)`` to at most ``k`` drafts."""
        raise NotImplementedError

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Count one verify step of ``num_drafts`` drafts of which ``num_accepted`` passed."""
        s = self.stats
        s.num_verify_steps += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        accepted, rejected = self._counts.get(request_id, (0.0, 0.0))
        accepted, rejected = accepted + num_accepted, rejected + (num_accepted < num_drafts)
        if accepted + rejected > 32:
            accepted, rejected = accepted / 2, rejected / 2
        self._counts[request_id] = (accepted, rejected)

    def preempted(self, request_id: str) -> None:
        """The request was preempted: drop what it holds that a recompute rebuilds."""

    def free(self, request_id: str) -> None:
        """The request finished: drop everything kept for it."""
        self._counts.pop(request_id, None)


class NgramProposer(Proposer):
    """Prompt lookup (``ngram_propose``) over each request's own tokens."""

    def __init__(self, max_k: int, max_n: int, min_n: int, token_cost: float) -> None:
        super().__init__(max_k, token_cost)
        self.max_n, self.min_n = max_n, min_n

    def _propose(self, wanted: list[tuple[Request, int]]) -> None:
        for r, k in wanted:
            r.spec_token_ids = ngram_propose(r.token_ids, self.max_n, self.min_n, k)


def verify(probs: torch.Tensor | None, argmax: torch.Tensor, drafts: Sequence[int],
           generator: torch.Generator | None, seeded: bool = False) -> list[int]:
    """Accept a prefix of ``drafts`` and append the target's token (module docstring).

    Row ``j``'s target token is ``x_j = argmax(p_j / E_j)`` with ``E_j ~ Exp(1)`` per
    vocabulary entry (the plain sampler's exponential race, so ``x_j ~ p_j``), or
    ``argmax(p_j)`` when greedy; drafts are accepted while ``x_j == d_j``. For a
    point-mass draft this is the rejection rule: ``d_j`` is accepted with probability
    ``P(x_j = d_j) = p_j(d_j)``, and on rejection ``x_j`` is distributed as ``p_j`` given
    ``x_j != d_j``, i.e. ``p_j`` without ``d_j``, renormalised.

    Args:
        probs: ``[k + 1, vocab]`` float32 target probabilities at the ``k + 1`` positions
            (row ``j`` predicts the token after draft ``j - 1``), or ``None`` for a
            greedy request.
        argmax: ``[k + 1]`` int64, the target's argmax per row (used when greedy).
        drafts: the ``k`` proposed token ids.
        generator: the request's generator (``Sampler.generator``; unused when greedy).
        seeded: the generator is the request's own: its noise rows are drawn one per
            position, as the plain sampler draws them, and the generator is left just
            after the row of the last emitted token, so a seeded request's output is the
            same with speculation on or off (up to float differences between a verify
            step's logits and a decode step's).

    Returns:
        The emitted tokens: ``a`` accepted drafts then one target token (``a + 1`` ids).
    """
    k = len(drafts)
    if probs is None:
        targets = argmax.tolist()
    else:
        vocab, dev = probs.shape[1], probs.device
        if seeded:
            assert generator is not None
            rows, states = [], []
            for _ in range(k + 1):
                rows.append(exponential_noise(torch.Size([vocab]), generator, dev))
                states.append(generator.get_state())
            noise = torch.stack(rows)
        else:
            noise = exponential_noise(probs.shape, generator, dev)  # type: ignore[arg-type]
        targets = (probs / noise).argmax(dim=-1).tolist()
    a = 0
    while a < k and drafts[a] == targets[a]:
        a += 1
    if probs is not None and seeded:
        generator.set_state(states[a])  # type: ignore[union-attr]
    return [*drafts[:a], targets[a]]
