"""Continuous batching under a token budget (vLLM v1 style, no prefill/decode phases).

Each step the scheduler hands out ``{request: num_scheduled_tokens}``: running
requests first (one decode token each, or the next chunk of an unfinished prefill),
then waiting requests (their uncached prompt, chunked to fit), while the total stays
within ``max_num_batched_tokens`` and the running set within ``max_num_seqs``. A
waiting request whose next uncached block a running request is computing right now
waits until it is cached (``_defer``: in-batch prefix caching), so ``n`` requests with
one prompt prefill it once. When the KV cache cannot hold a running request's next
tokens, the most recently admitted running request is preempted: its blocks are freed
and it goes back to the head of the waiting queue, to be recomputed later (preemption
by recompute, vLLM's default).

The scheduler owns the block manager: the engine asks it, not the block manager, how
many requests to admit (``num_admittable``) and whether a decode step may follow one
still in flight (``can_schedule_next_decode`` / ``schedule_next_decode``).

The scheduler imports no torch and no redis: tests drive it with hand-made outputs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from worker.backends.base import EngineStats
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    """One request in a step and how many of its tokens the step computes."""

    request: Request
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's tokens, so the step
        samples its next token (partial prefill chunks do not)."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


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


class Scheduler:
    """Decides each step's batch; owns the block manager and the request queues."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management ---------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a new request.

        Raises:
            ValueError: duplicate request id, or a request whose prompt and
                ``max_tokens`` need more KV blocks than the whole cache holds (it
                could never finish; the worker answers 400 instead of failing the batch).
        """
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        bm = self.block_manager
        # The last sampled token's KV is never computed.
        num_kv_tokens = request.num_prompt_tokens + request.sampling.max_tokens - 1
        num_blocks = -(-num_kv_tokens // bm.block_size)
        if num_blocks > bm.num_blocks:
            raise ValueError(f"prompt ({request.num_prompt_tokens} tokens) plus max_tokens "
                             f"({request.sampling.max_tokens}) needs {num_blocks} KV blocks of "
                             f"{bm.block_size} tokens; this worker's cache has {bm.num_blocks}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request as aborted and free its blocks; unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self._finish(request)
        return request

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def num_admittable(self) -> int:
        """How many new requests the worker may pull now: free sequence slots
        (``max_num_seqs`` minus running and waiting requests), as long as the free KV
        blocks exceed what the waiting requests still need plus one block of growth per
        running request (0 otherwise). Pulling no more than this keeps unstarted work in
        Redis, where another worker can take it."""
        bm = self.block_manager
        slots = self.max_num_seqs - len(self.running) - len(self.waiting)
        reserved = sum(bm.blocks_needed(r, r.num_tokens - r.num_computed_tokens) for r in self.waiting)
        return max(0, slots) if bm.num_free_blocks > reserved + len(self.running) else 0

    # -- one step -----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their blocks."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not bm.can_allocate(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                bm.allocate(request, num_new)
                out.scheduled.append(ScheduledRequest(request, num_new))
                scheduled_ids.add(request.request_id)
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted; everything after it too

        # Admit waiting requests, in order, only when nothing was preempted this step: a
        # cache that just ran out would thrash otherwise. One whose next block a running
        # request is computing waits a step (``_defer``) and lets later ones pass.
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[i]
            if not request.block_table:
                # A request that asks for prompt logprobs computes every prompt position:
                # a cached block has no logits (vLLM v1 skips the lookup too).
                cached = [] if request.prompt_logprobs is not None else bm.find_cached_prefix(request)
                if self._defer(request, len(cached)):
                    i += 1
                    continue
                bm.allocate_prefix(request, cached)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not bm.can_allocate(request, num_new):
                # A waiting request holds no blocks: the cached prefix it was just given
                # goes back (it stays cached), or two waiting requests could hold every
                # block with nothing running, and every later step would be empty.
                self._release(request)
                if not self.running and bm.num_free_blocks == bm.num_blocks:
                    raise RuntimeError(f"request {request.request_id} needs more KV blocks than exist")
                break
            bm.allocate(request, num_new)
            if request.prompt_logprobs is None:  # the others looked nothing up
                bm.record_admission(request)
            del self.waiting[i]
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out

    def update(self, out: SchedulerOutput, sampled: list[int | None]) -> tuple[list[StepResult], list[Request]]:
        """Apply a step's results.

        Args:
            out: the step's ``SchedulerOutput``.
            sampled: one entry per ``out.scheduled``: the sampled token id, or ``None``
                for a partial prefill chunk.

        Returns:
            ``(results, finished)``: new tokens per request that got one, and the
            requests that finished this step (their blocks already freed).
        """
        results: list[StepResult] = []
        finished: list[Request] = []
        for item, token in zip(out.scheduled, sampled, strict=True):
            request = item.request
            if request.status.finished:  # aborted, or stopped, while this step was in flight
                continue
            request.num_computed_tokens += item.num_tokens
            self.block_manager.cache_full_blocks(request)
            if token is None:
                continue
            first_index = request.num_output_tokens
            request.append_token(token)
            results.append(StepResult(request, [token], first_index))
            if request.status.finished:
                self.running.remove(request)
                self._finish(request)
                finished.append(request)
        return results, finished

    # -- async scheduling: a decode step behind one still in flight -----------------
    def can_schedule_next_decode(self, out: SchedulerOutput) -> bool:
        """True when the step after ``out``, whose sampled tokens are not applied yet,
        is one more decode token for the same requests: nothing waits to be admitted (or
        no sequence slot is free to admit it: ``max_num_seqs`` are running), none of
        them finished, was aborted or will reach ``max_tokens`` with the token
        in flight, and the KV cache has blocks for two more positions each (the
        in-flight token's and the next one's). ``max_tokens`` also keeps them within
        ``max_model_len``: ``check_request`` admits no prompt + ``max_tokens`` above it."""
        requests = [item.request for item in out.scheduled]
        if (self.waiting and len(self.running) < self.max_num_seqs) or len(requests) != len(self.running):
            return False
        if any(r.status != RequestStatus.RUNNING or r.num_output_tokens + 1 >= r.sampling.max_tokens
               for r in requests):
            return False
        bm = self.block_manager
        return sum(bm.blocks_needed(r, 2) for r in requests) <= bm.num_free_blocks

    def schedule_next_decode(self, out: SchedulerOutput) -> SchedulerOutput:
        """The step after ``out`` (check ``can_schedule_next_decode`` first): one token
        for each of ``out``'s requests, with the blocks for the in-flight token's position
        and the next one allocated. Its tokens sit at ``num_computed_tokens + 1``, as
        ``out``'s are not applied yet; ``update`` applies both steps in order.

        Raises:
            RuntimeError: not enough free blocks.
        """
        requests = [item.request for item in out.scheduled]
        for r in requests:
            self.block_manager.allocate(r, 2)
        return SchedulerOutput(scheduled=[ScheduledRequest(r, 1) for r in requests])

    def make_stats(self) -> EngineStats:
        """Queue lengths and block-manager counters, for heartbeats and metrics."""
        bm = self.block_manager
        return EngineStats(num_running=len(self.running), num_waiting=len(self.waiting), kv_usage=bm.usage,
                           num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks,
                           num_preemptions=self.num_preemptions, prefix_cache_queries=bm.num_prefix_queries,
                           prefix_cache_hits=bm.num_prefix_hits)

    # -- internals ----------------------------------------------------------------
    def _defer(self, request: Request, num_cached_blocks: int) -> bool:
        """True when a running request (admitted this step or earlier, its prefill not
        past the block yet) computes the full block that follows the waiting
        ``request``'s cached prefix, with the same tokens before it: admitted later,
        ``request`` finds that block in the prefix cache instead of computing it again
        (in-batch prefix caching: n siblings of one prompt arrive together, and only the
        first prefills the prompt). SGLang's scheduler deprioritises waiting requests that
        share a prefix with another waiting one the same way
        (``python/sglang/srt/managers/schedule_policy.py``,
        ``SchedulePolicy._compute_prefix_matches``). Not starved: the deferral ends when
        that request has computed the block, or is preempted or aborted (no longer
        running). Costs no hashing beyond the lookup's: the block's hash was its miss,
        and the running request's are hashed once (``Request.block_hashes``).
        """
        bm = self.block_manager
        k = num_cached_blocks
        if not bm.enable_prefix_caching or request.prompt_logprobs is not None or k >= bm.num_lookup_blocks(request):
            return False
        end = (k + 1) * bm.block_size  # block k holds tokens [end - block_size, end)
        want = bm.block_hash_at(request, k)
        return any(other.num_computed_tokens < end <= other.num_tokens and bm.block_hash_at(other, k) == want
                   for other in self.running)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        """Free a waiting request's blocks; it recomputes (or re-finds cached) from 0."""
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0

    def _finish(self, request: Request) -> None:
        self.block_manager.free(request)
        del self.requests[request.request_id]
