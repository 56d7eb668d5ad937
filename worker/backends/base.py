"""The narrow interface between the worker's Redis adapter and an engine: the
``EngineBackend`` protocol, the types it passes (``RequestOutput``, ``EngineStats``,
``RequestRejected``; ``KVEvents`` in ``worker/backends/kv_events.py``) and the request
checks every backend shares (``check_request``).

Imports no torch and no engine: the Redis adapter and the sim backend load without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shared.protocol import FinishReason, TokenLogprobs
from shared.sampling import SamplingParams
from worker.backends.kv_events import KVEvents


class RequestRejected(ValueError):
    """A request the engine cannot run (too long, duplicate id, bad parameters)."""


def check_request(prompt_token_ids: list[int], sampling: SamplingParams, num_resumed: int,
                  max_model_len: int) -> None:
    """The checks every backend makes before queueing a request (same messages).

    Args:
        num_resumed: output tokens already delivered (failover continuation).
        max_model_len: longest prompt + output, tokens.

    Raises:
        RequestRejected: nothing left to generate, empty prompt, prompt + ``max_tokens``
            over ``max_model_len``, or invalid sampling parameters.
    """
    if num_resumed >= sampling.max_tokens:
        raise RequestRejected(f"resumed with {num_resumed} output tokens of max_tokens {sampling.max_tokens}")
    if not prompt_token_ids:
        raise RequestRejected("empty prompt")
    if len(prompt_token_ids) + sampling.max_tokens > max_model_len:
        raise RequestRejected(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({sampling.max_tokens}) "
                              f"exceeds max_model_len {max_model_len}")
    try:
        sampling.validate()
    except ValueError as exc:
        raise RequestRejected(str(exc)) from exc


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: ``new_token_ids``, the first of which
    is output token number ``first_index``; ``finish_reason`` once it ended;
    ``logprobs``, one entry per new token, when the request asked for them;
    ``prompt_logprobs`` on the request's first output only, when it asked for them and
    was not resumed: one entry per prompt token after the first (``TokenOutput``);
    ``error``: with ``finish_reason`` ``abort``, why the request failed (its structured
    output constraint did), which the worker sends as a 400 ``ErrorMessage`` instead of
    the tokens; None otherwise."""

    request_id: str
    new_token_ids: list[int]
    first_index: int
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for heartbeats and metrics (``kv_usage``: fraction of KV blocks in
    use, 0..1). ``num_waiting_prefill_tokens``: the tokens the requests it holds still
    have to prefill before they decode (waiting ones: all of their tokens; running ones:
    the rest of a chunked prefill or of a recompute), what the worker's pull budget and
    placement's load read (``WorkerStatus``). ``kv_internal_fragmentation``: share of the
    KV slots held by running requests that hold no token; ``kv_contiguous_waste_ratio``:
    share a ``max_model_len`` contiguous reservation per running request would leave empty
    (both 0..1, ``BlockManager.fragmentation``; 0 where the backend does not measure them)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_waiting_prefill_tokens: int = 0
    kv_internal_fragmentation: float = 0.0
    kv_contiguous_waste_ratio: float = 0.0


class EngineBackend(Protocol):
    """What the worker needs from an engine. Calls come from one thread at a time;
    ``step`` runs off the event loop."""

    name: str
    block_size: int
    max_num_seqs: int
    max_model_len: int
    #: Most tokens one step computes (prefill chunks + decodes): the pull budget's unit.
    max_num_batched_tokens: int

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    output_token_ids: list[int] | None = None, priority: int = 0, tenant: str = "",
                    num_cached_hint: int = 0) -> None:
        """Queue a request (``output_token_ids``: resume after these outputs;
        ``priority``: its class rank, lower served first; see ``GenerateRequest``;
        ``tenant``: who sent it, the tenant of its queue stream, "" unknown;
        ``num_cached_hint``: prompt tokens placement expects in this worker's prefix cache,
        which its load figures leave out until it is admitted).
        Raises ``RequestRejected`` when it cannot run."""

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its resources; False when unknown."""

    def step(self) -> list[RequestOutput]:
        """One engine step; the new tokens of every request that got one."""

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued or running."""

    def num_admittable(self, priority: int | None = None) -> int:
        """How many new requests to pull now; with ``priority``, how many of that class
        (or a higher one), counting what lower classes hold as room where the backend
        preempts them for it."""

    def fair_share_blocked(self, priority: int) -> set[str] | None:
        """When ``num_admittable(priority)`` is 0: the tenants whose next request of
        class ``priority`` would find no slot to take, so that the worker may pull one
        more request of another tenant, which preempts one of a tenant that runs more
        (``worker/engine/fair_share.py``). ``None``: no tenant's would (or the backend
        shares no slots between tenants)."""

    def note_arrival(self, priority: int | None, tenant: str = "") -> None:
        """A request of class rank ``priority`` from ``tenant`` was queued (the model's
        arrivals channel), or, with ``None``, forget earlier notes (the worker is about to
        pull). The one call that may come from the event loop while ``step`` runs on the
        engine thread: the inferq engine may stop that step or withhold the next chained
        one for it (``worker/engine/arrivals.py``); other backends ignore it."""

    def stats(self) -> EngineStats:
        """Load snapshot for heartbeats and metrics."""

    def take_kv_events(self, snapshot: bool = False) -> KVEvents:
        """The prefix cache's net changes (blocks stored, evicted; cleared) since the last
        call (``worker/backends/kv_events.py``); with ``snapshot``, the whole cache
        instead (cleared, then every cached block stored). The first call starts the
        recording and returns none: the worker makes it before the first step. Called
        from the worker's event loop between steps, never while ``step`` runs."""
