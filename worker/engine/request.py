"""The state of one request inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.protocol import FinishReason, TokenLogprobs
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from worker.structured.matcher import GrammarMatcher


class RequestStatus(enum.IntEnum):
    """Where a request is. Finished states are the ones ``>= FINISHED_STOPPED``."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


#: The one map from a finished status to the OpenAI ``finish_reason``.
FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False, slots=True)
class Request:
    """A prompt and what has been generated for it.

    ``token_ids`` is prompt + output. ``num_computed_tokens`` counts the tokens whose
    KV is in the cache; it catches up with ``len(token_ids)`` one chunk at a time, so
    prefill, chunked prefill, prefix-cache hits, decode and recompute after preemption
    are one path (vLLM v1). ``block_table`` lists the physical KV blocks in order.
    ``grammar`` is the matcher of a structured output (``sampling.structured``): it has
    consumed every output token, and each appended token advances it once (recompute after
    preemption appends nothing, so it consumes nothing).
    ``block_hashes``: the chained hashes of its first full blocks (``block_manager``),
    each computed once, on demand; ``token_ids`` only grows, so they stay valid for the
    request's life, preemptions included.
    ``prompt_logprobs``: while the request asks for them (``sampling.prompt_logprobs``)
    and has not delivered them, the entries gathered so far (entry ``i`` scores
    ``prompt_token_ids[i + 1]``; chunked prefill adds to it); ``None`` otherwise (not
    asked, a failover continuation, or already delivered with its first token).
    ``priority``: the class rank (``GenerateRequest.priority``), lower served first; the
    scheduler keeps its queues in class order and preempts for a lower number only.
    ``tenant``: who sent it (``shared/fair_queue.py``'s stream tenant; "" unknown): within
    a class, the scheduler shares sequence slots between tenants (``Scheduler``).
    ``spec_token_ids``: draft tokens proposed for the next step (speculative decoding,
    ``worker/engine/spec_decode.py``), not part of ``token_ids``; ``[]``: none.
    ``num_pending_tokens``: tokens sampled on the device by a step in flight and not in
    ``token_ids`` yet; nonzero only while the scheduler looks ahead past that step
    (``Scheduler.ahead_of``), 0 everywhere else.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_s: float = field(default_factory=time.monotonic)
    priority: int = 0
    tenant: str = ""
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    grammar: GrammarMatcher | None = None
    block_hashes: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    num_pending_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not computed yet: the prompt's rest, or 1 for a decode
        (a token sampled in flight, ``num_pending_tokens``, included)."""
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def ends_in_flight(self) -> bool:
        """Whether a token sampled in flight (``num_pending_tokens``) is its last by
        ``max_tokens``: a step scheduled ahead gives it nothing to compute."""
        return bool(self.num_pending_tokens) and (
            self.num_output_tokens + self.num_pending_tokens >= self.sampling.max_tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int) -> None:
        """Add one sampled token and set a finished status if it ends the request.

        With a grammar, the token advances it first: a grammar that allows nothing more
        but EOS (its end, or EOS consumed where it accepts) stops the request, before
        ``min_tokens`` and with ``ignore_eos`` too; a token it rejects (which its mask
        rules out) aborts the request.
        """
        self.token_ids.append(token_id)
        params = self.sampling
        num_out = self.num_output_tokens
        grammar_ended = False
        if self.grammar is not None:
            if not self.grammar.accept(token_id):
                self.status = RequestStatus.FINISHED_ABORTED
                return
            grammar_ended = self.grammar.is_finished
        if grammar_ended or (num_out >= params.min_tokens and (
                (not params.ignore_eos and token_id in self.eos_token_ids) or token_id in params.stop_token_ids)):
            self.status = RequestStatus.FINISHED_STOPPED
            return
        if num_out >= params.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
