"""What the scheduler hands the engine for one step and what the engine hands back: value
types, apart from the ``Scheduler`` that makes them, so the runner, the graphs, the
draft proposer and the prompt-logprobs path import no scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request in a step and how many of its tokens the step computes.
    ``num_spec_tokens``: how many of them are draft tokens to verify (the last ones,
    ``request.spec_token_ids``; speculative decoding), 0 otherwise."""

    request: Request
    num_tokens: int
    num_spec_tokens: int = 0

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's tokens, so the step
        samples its next token (partial prefill chunks do not)."""
        r = self.request
        return r.num_computed_tokens + self.num_tokens - self.num_spec_tokens == r.num_tokens + r.num_pending_tokens

    def input_token_ids(self) -> list[int]:
        """The step's input tokens of this request: its tokens from
        ``num_computed_tokens`` on, then its drafts. A token still in flight
        (``Request.num_pending_tokens``) is a 0 here: the step's launch puts the sampled id
        in its place on the device (``ModelRunner.launch_step``)."""
        r, start = self.request, self.request.num_computed_tokens
        n = self.num_tokens - self.num_spec_tokens
        ids = r.token_ids[start:start + n]
        if len(ids) < n:
            ids = ids + [0] * (n - len(ids))
        return ids + r.spec_token_ids[:self.num_spec_tokens] if self.num_spec_tokens else ids


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes. ``scheduled`` keeps running requests before new ones."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class StepResult:
    """New tokens of one request after a step, for the engine's caller."""

    request: Request
    new_token_ids: list[int]
    first_index: int  # index of new_token_ids[0] among the request's output tokens
