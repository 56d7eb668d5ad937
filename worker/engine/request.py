"""The state of one request inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.block_hashes import BlockHasher
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

#: What the client reads before llguidance's reason when a request's grammar fails
#: (``Request.error``, and the engine's refusal of a grammar it cannot build).
GRAMMAR_FAILED = "the structured output constraint failed"


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
    ``block_hasher``: the hashes of its first full blocks (``shared.block_hashes``;
    ``block_hashes`` lists them), each computed once, on demand, by the block manager
    (``BlockManager.block_hash_at``; None until it first hashes one); ``token_ids`` only
    grows, so they stay valid for the request's life, preemptions included.
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
    ``error``: why it was aborted when its grammar failed (``append_token``), for the
    client; None otherwise.
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
    block_hasher: BlockHasher | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    num_pending_tokens: int = 0
    #: Tokens of its prompt expected in the prefix cache when it is admitted (placement's
    #: estimate: ``GenerateRequest`` entries carry the uncached part), 0 unknown.
    num_cached_hint: int = 0
    error: str | None = None

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
    def block_hashes(self) -> list[bytes]:
        """The hashes of its first full blocks made so far (``block_hasher``), 16 bytes each."""
        return self.block_hasher.hashes if self.block_hasher is not None else []

    @property
    def num_prefill_tokens_left(self) -> int:
        """Prompt tokens (and, after a preemption, output tokens) whose KV is still to be
        computed before it decodes: ``num_uncomputed_tokens`` when more than a decode's
        one, else 0. Its prefix-cache hit is known only when it is admitted: until then
        (nothing computed) ``num_cached_hint`` is taken off, so a worker that pulled a
        conversation's follow-ups does not count their cached history as work to do."""
        left = self.num_uncomputed_tokens
        if self.num_computed_tokens == 0:
            left -= min(self.num_cached_hint, left - 1)
        return left if left > 1 else 0

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
        rules out, or any token once a limit put it in llguidance's error state) aborts
        the request with ``error`` set.
        """
        self.token_ids.append(token_id)
        params = self.sampling
        num_out = self.num_output_tokens
        grammar_ended = False
        if self.grammar is not None:
            if not self.grammar.accept(token_id):
                self.status = RequestStatus.FINISHED_ABORTED
                self.error = f"{GRAMMAR_FAILED}: {self.grammar.error or 'token rejected'}"
                return
            grammar_ended = self.grammar.is_finished
        if grammar_ended or (num_out >= params.min_tokens and (
                (not params.ignore_eos and token_id in self.eos_token_ids) or token_id in params.stop_token_ids)):
            self.status = RequestStatus.FINISHED_STOPPED
            return
        if num_out >= params.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
