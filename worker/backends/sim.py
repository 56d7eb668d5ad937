"""A model-free backend for load tests of the queue, the worker loop, placement and the
gateway.

``SimBackend`` behaves like a continuous-batching engine with chunked prefill and a
prefix cache, whose forward pass takes ``step_time_ms`` plus ``prefill_ms_per_token`` per
prefill token it computes: each step, every running request that has prefilled gets one
token, and running requests with prompt left to compute share ``max_num_batched_tokens``
(less one per decode) in admission order; a request's first token comes with the step
that computes its prompt's last token. At most ``max_num_seqs`` requests run at once and
the rest wait (FIFO within a priority class, lower ``priority`` first), and
``num_admittable`` reports free sequence slots, so pull-based balancing across workers
holds as it does with the real engine. As there, a waiting request that finds every slot
taken preempts the running request of the lowest class strictly below its own, most
recently admitted first (``num_preemptions``); the victim goes back to the head of its
class, frees its blocks (they stay cached) and recomputes its tokens when it resumes; its
outputs continue where they were.

The prefix cache is the real engine's: a ``BlockManager`` (``worker/engine/block_manager.py``)
of ``num_blocks`` blocks, the same chained block hashes (``shared/block_hashes.py``), LRU
eviction, hit counters (``stats``) and KV events (``take_kv_events``). An admitted request
takes its cached prefix (``num_cached_tokens`` in its outputs, which then costs no prefill
time) and reserves blocks for its whole prompt plus ``max_tokens`` up front (TGI's
admission), so it never runs out of blocks mid-run; a request waits while the free blocks
do not cover that. ``num_blocks``: ``EngineSettings.num_kv_blocks``, or by default
``ceil(max_model_len / block_size)`` per sequence slot, with which a free slot always finds
its blocks.

Outputs are deterministic so tests can detect lost or duplicated tokens: output token
``i`` of a request is ``prompt_token_ids[i % len(prompt_token_ids)]`` (an echo of the
prompt, repeated; ``i`` counts from the start of the output, also for a request
resumed after failover, so a resumed stream continues the same echo). Stopping is
``worker.engine.request.Request.append_token``'s: after ``min_tokens`` outputs, a token in
``stop_token_ids`` (or in ``eos_token_ids`` unless ``ignore_eos``) stops the request with
``stop``; reaching ``max_tokens`` stops it with ``length``. EOS ids and ``max_model_len``
come from the model's ``config`` as for the real engine (``shared.model_source``); with no
config no token counts as EOS and ``max_model_len`` is the setting.

Arrivals (``note_arrival``) stop a step as they stop the inferq engine's eager steps
(``worker/engine/arrivals.py``): a request announced during the step's sleep, of a class
above the lowest class running, ends the step early (within ``STOP_CHECK_MS``) with no
token and nothing computed, as often as ``Arrivals.may_stop`` allows. The sim shares no
slots between tenants, so only the class counts.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from shared.model_source import eos_token_ids, max_model_len
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from worker.backends.base import EngineStats, RequestOutput, RequestRejected, check_request
from worker.backends.kv_events import KVEvents
from worker.engine.arrivals import Arrivals
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request

#: How often a step's sleep looks at the arrivals, ms (the engine: after each layer).
STOP_CHECK_MS = 2.0


class SimBackend:
    """An ``EngineBackend`` (worker/backends/base.py) without a model. Not
    thread-safe: like the real engine, call it from one thread at a time (``stats`` only
    reads)."""

    name = "sim"

    def __init__(self, model_settings: ModelSettings, engine_settings: EngineSettings, *,
                 step_time_ms: float | None = None, prefill_ms_per_token: float | None = None,
                 config: Mapping[str, Any] | None = None) -> None:
        """``config``: the model's parsed ``config.json`` (EOS ids, position limit).
        ``step_time_ms`` (default ``EngineSettings.sim_step_time_ms``) and
        ``prefill_ms_per_token`` (default ``EngineSettings.sim_prefill_ms_per_token``): a
        step's time (module docstring)."""
        if step_time_ms is None:
            step_time_ms = engine_settings.sim_step_time_ms
        if prefill_ms_per_token is None:
            prefill_ms_per_token = engine_settings.sim_prefill_ms_per_token
        assert step_time_ms >= 0.0 and prefill_ms_per_token >= 0.0, (step_time_ms, prefill_ms_per_token)
        self.block_size = engine_settings.block_size
        self.max_num_seqs = engine_settings.max_num_seqs
        self.max_num_batched_tokens = engine_settings.max_num_batched_tokens
        config = config or {}
        # Without --max-model-len, --num-kv-blocks caps the config's length (by default the
        # cache is sized from the length, so it always holds it).
        self.max_model_len = max_model_len(config, model_settings.max_model_len,
                                           engine_settings.num_kv_blocks * self.block_size or None)
        self.step_time_ms = step_time_ms
        self.prefill_ms_per_token = prefill_ms_per_token
        self.eos_token_ids = eos_token_ids(config)
        num_blocks = engine_settings.num_kv_blocks or \
            self.max_num_seqs * -(-self.max_model_len // self.block_size)
        self.block_manager = BlockManager(num_blocks, self.block_size, engine_settings.enable_prefix_caching)
        self._waiting: deque[Request] = deque()
        self._running: dict[str, Request] = {}  # in admission order
        self._known: set[str] = set()  # ids waiting or running
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_steps_stopped = 0  # steps stopped by an arrival (module docstring)
        self.num_prefill_tokens = 0  # prefill tokens computed (cache hits left out)
        #: What was announced since the worker last pulled (``note_arrival``).
        self.arrivals = Arrivals()

    # -- requests ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    output_token_ids: list[int] | None = None, priority: int = 0, tenant: str = "",
                    num_cached_hint: int = 0) -> None:
        """Queue a request; ``output_token_ids`` resumes one whose first outputs were
        already delivered (failover): they count against ``max_tokens``, the next
        token's index (and echo position) is ``len(output_token_ids)``, and they are
        prefilled with the prompt. ``priority``: the class rank, lower served first
        (``GenerateRequest.priority``); ``tenant`` is kept but shares nothing (the sim
        shares no slots between tenants: ``fair_share_blocked``); ``num_cached_hint``:
        as the engine's.

        Raises:
            RequestRejected: empty or too long prompt, bad parameters, duplicate id,
                a resumed request with nothing left to generate, one whose prompt and
                ``max_tokens`` need more blocks than the cache has, or logprobs or
                prompt logprobs (a simulated model has no distribution).
        """
        if sampling.logprobs is not None:
            raise RequestRejected("logprobs are not supported by the sim backend")
        if sampling.prompt_logprobs is not None:
            raise RequestRejected("prompt_logprobs (echo with logprobs) are not supported by the sim backend")
        outputs = list(output_token_ids or ())
        check_request(prompt_token_ids, sampling, len(outputs), self.max_model_len)
        if request_id in self._known:
            raise RequestRejected(f"request {request_id} is already running")
        request = Request(request_id, list(prompt_token_ids), sampling, self.eos_token_ids, priority=priority,
                          tenant=tenant, token_ids=[*prompt_token_ids, *outputs], num_cached_hint=num_cached_hint)
        if self._num_reserved_blocks(request) > self.block_manager.num_blocks:
            raise RequestRejected(f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({sampling.max_tokens}) "
                                  f"needs more than the {self.block_manager.num_blocks} KV blocks of this worker")
        self._enqueue(request, ahead=False)
        self._known.add(request_id)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request and free its blocks; False when unknown. It
        emits nothing more."""
        if request_id not in self._known:
            return False
        self._known.discard(request_id)
        request = self._running.pop(request_id, None)
        if request is None:
            request = next(r for r in self._waiting if r.request_id == request_id)
            self._waiting.remove(request)
        self.block_manager.free(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._known)

    def num_admittable(self, priority: int | None = None) -> int:
        """Free sequence slots: ``max_num_seqs`` minus running and waiting requests; with
        ``priority``, minus only those of that class or a higher one (a new request of the
        class preempts or passes the others)."""
        held = [*self._running.values(), *self._waiting]
        return max(0, self.max_num_seqs - sum(priority is None or r.priority <= priority for r in held))

    def fair_share_blocked(self, priority: int) -> set[str] | None:
        """``None``: no tenant's request preempts another's here (``EngineBackend``)."""
        return None

    def note_arrival(self, priority: int | None, tenant: str = "") -> None:
        """Record an announcement, or forget them (``None``): a step in progress may stop
        for it (module docstring; ``EngineBackend``)."""
        self.arrivals.note(priority, tenant)

    # -- the loop ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests into free slots, compute decodes and prefill chunks under
        the token budget, take ``step_time_ms`` plus ``prefill_ms_per_token`` per prefill
        token (blocking sleep: call it off the loop), and emit one token per request
        whose tokens are then all computed; or, stopped by an arrival (module docstring),
        nothing."""
        start_s = time.perf_counter()
        self._admit()
        chunks = self._schedule()
        num_prefill = sum(n for _, n in chunks if n > 1)
        end_s = start_s + (self.step_time_ms + self.prefill_ms_per_token * num_prefill) / 1000
        if self._sleep_unless_stopped(end_s):
            self.num_steps_stopped += 1
            self.arrivals.step_ended(stopped=True)
            return []
        self.arrivals.step_ended(stopped=False)
        self.num_prefill_tokens += num_prefill
        outputs = []
        for request, n in chunks:
            request.num_computed_tokens += n
            self.block_manager.cache_full_blocks(request)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that does not reach the end samples nothing
            out = self._advance(request)
            outputs.append(out)
            if out.finish_reason is not None:
                del self._running[request.request_id]
                self._known.discard(request.request_id)
                self.block_manager.free(request)
        self.num_steps += 1
        return outputs

    def _admit(self) -> None:
        """Move waiting requests into free slots (preempting a lower class for a higher
        one), in order, while the free blocks cover each one's reservation."""
        bm = self.block_manager
        while self._waiting:
            request = self._waiting[0]
            if len(self._running) >= self.max_num_seqs and not self._preempt_for(request):
                return
            cached = bm.find_cached_prefix(request)
            num_free_hits = sum(bm.blocks[b].ref_count == 0 for b in cached)
            if self._num_reserved_blocks(request) - len(cached) > bm.num_free_blocks - num_free_hits:
                return  # waits for blocks (a running request frees them when it ends)
            self._waiting.popleft()
            bm.allocate_prefix(request, cached)
            bm.allocate(request, self._num_reserved_tokens(request) - request.num_computed_tokens)
            bm.record_admission(request)
            self._running[request.request_id] = request

    def _schedule(self) -> list[tuple[Request, int]]:
        """This step's ``(request, tokens to compute)``: a decode's one token each, then
        prefill chunks in admission order under what is left of ``max_num_batched_tokens``."""
        decodes = [(r, 1) for r in self._running.values() if r.num_uncomputed_tokens == 1]
        budget = self.max_num_batched_tokens - len(decodes)
        chunks = []
        for r in self._running.values():
            left = r.num_uncomputed_tokens
            if left > 1 and budget > 0:
                chunks.append((r, min(left, budget)))
                budget -= chunks[-1][1]
        return decodes + chunks

    def _num_reserved_tokens(self, request: Request) -> int:
        """Tokens whose KV the request may hold: its prompt and every output but the last."""
        return request.num_prompt_tokens + request.sampling.max_tokens - 1

    def _num_reserved_blocks(self, request: Request) -> int:
        return -(-self._num_reserved_tokens(request) // self.block_size)

    def _sleep_unless_stopped(self, end_s: float) -> bool:
        """Sleep until ``end_s`` (``time.perf_counter``); True, early, when an arrival of
        a class above the lowest running one stops the step."""
        lowest = max((r.priority for r in self._running.values()), default=0)
        stoppable = self.arrivals.may_stop
        while (remaining_s := end_s - time.perf_counter()) > 0:
            if stoppable and self.arrivals.above(lowest):
                return True
            time.sleep(min(remaining_s, STOP_CHECK_MS / 1000))
        return False

    def _enqueue(self, request: Request, *, ahead: bool) -> None:
        """Insert into the waiting queue in class order: behind its class, or ``ahead``
        of it (a preempted request)."""
        p = request.priority
        if ahead:
            i = next((k for k, r in enumerate(self._waiting) if r.priority >= p), len(self._waiting))
        else:
            i = len(self._waiting)
            while i > 0 and self._waiting[i - 1].priority > p:
                i -= 1
        self._waiting.insert(i, request)

    def _preempt_for(self, request: Request) -> bool:
        """Preempt the lowest-class running request, the most recently admitted of its
        class, if that class is strictly below ``request``'s; False when none is. The
        victim's blocks are freed (they stay cached) and its tokens recomputed later."""
        victim = max(reversed(self._running.values()), key=lambda r: r.priority, default=None)
        if victim is None or victim.priority <= request.priority:
            return False
        del self._running[victim.request_id]
        self.block_manager.free(victim)
        victim.num_computed_tokens = victim.num_cached_tokens = 0
        self._enqueue(victim, ahead=True)
        self.num_preemptions += 1
        return True

    def _advance(self, request: Request) -> RequestOutput:
        """Append the echo's next token (``Request.append_token`` sets the finish)."""
        first_index = request.num_output_tokens
        prompt = request.prompt_token_ids
        request.append_token(prompt[first_index % len(prompt)])
        return RequestOutput(request.request_id, request.token_ids[-1:], first_index, request.finish_reason,
                             request.num_prompt_tokens, request.num_cached_tokens)

    def stats(self) -> EngineStats:
        """Load snapshot: counts, the block manager's usage and prefix-cache counters, the
        prefill tokens still to compute (``Request.num_prefill_tokens_left``) and the KV
        fragmentation of the running requests (``BlockManager.fragmentation``: their
        blocks reserved up front for ``max_tokens`` count as empty until filled)."""
        running = list(self._running.values())
        held = [*self._waiting, *running]
        bm = self.block_manager
        frag = bm.fragmentation(running, self.max_model_len)
        return EngineStats(num_running=len(running), num_waiting=len(self._waiting), kv_usage=bm.usage,
                           num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks,
                           num_preemptions=self.num_preemptions, prefix_cache_queries=bm.num_prefix_queries,
                           prefix_cache_hits=bm.num_prefix_hits,
                           num_waiting_prefill_tokens=sum(r.num_prefill_tokens_left for r in held),
                           kv_internal_fragmentation=frag.internal_fragmentation,
                           kv_contiguous_waste_ratio=frag.contiguous_waste_ratio)

    def take_kv_events(self, snapshot: bool = False) -> KVEvents:
        """The prefix cache's changes since the last call, or with ``snapshot`` all of it
        (``BlockManager.take_kv_events``; the first call starts the recording)."""
        return self.block_manager.take_kv_events(snapshot)
