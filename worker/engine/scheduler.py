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

Priority classes (``Request.priority``, lower served first, as vLLM's ``priority``):
both queues are kept in class order, arrival (waiting) or admission (running) order
within a class, so every rule above applies per class: waiting requests are admitted
in (priority, arrival) order, a preempted request goes back to the head of its class,
and the running request preempted for KV space is the lowest class's most recently
admitted. A waiting request that finds no sequence slot or KV blocks preempts running
requests of a strictly lower class (``_preempt_for``), lowest first, until it fits;
never one of its own class, so with one class this is plain FCFS. While a request of a
higher class than some running one waits or is mid-prefill, the step carries only its
class and the higher ones (``_priority_floor``): the lower classes' decodes pause for
that step (they keep their blocks), so its prefill runs in a short step, at most
``MAX_PRIORITY_PAUSES`` steps in a row. Within a class, sequence slots are shared between
tenants (``Request.tenant``; ``worker/engine/fair_share.py``): a waiting request whose
tenant runs two fewer than another tenant preempts that tenant's youngest, one per step.

The scheduler owns the block manager: the engine asks it, not the block manager, how
many requests to admit (``num_admittable``), whether a decode step may follow one
still in flight (``can_schedule_next_decode`` / ``schedule_next_decode``), and what any
step after one in flight carries (``ahead_of``: scheduling on the view of that step
applied).

The scheduler imports no torch and no redis: tests drive it with hand-made outputs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from worker.backends.base import EngineStats
from worker.engine.block_manager import BlockManager
from worker.engine.fair_share import blocked_tenants, claim_victim
from worker.engine.request import Request, RequestStatus
from worker.engine.step_cost import StepCostModel, StepFeatures
from worker.engine.step_types import ScheduledRequest, SchedulerOutput, StepResult

#: The prefill cap's floor (``Scheduler._prefill_budget``), tokens: a step of this many
#: prompt tokens already runs near the GPU's matmul rate (docs/benchmarks.md: 83-84% on the
#: H100 at 512-token prompts), so a smaller cap would only add steps while few sequences
#: decode (a start-up ramp), each reading every weight once more.
MIN_PREFILL_TOKENS = 512
#: The prefill cap's floor under an inter-token-latency target, tokens: when the decodes
#: alone take the target (more streams than it allows), prompts still advance by this
#: much a step, one matmul tile of 128 rows, so new requests are never starved.
MIN_TARGET_PREFILL_TOKENS = 128
#: Most consecutive steps in which running requests of a lower class pause for a higher
#: class's prefill (``Scheduler._priority_floor``); the step after them carries every
#: running request, so a lower class is slowed, never starved. A new request's prompt
#: (up to ``max_num_batched_tokens``) takes one step, so a few cover the chunks of a
#: long prompt or several arrivals in a row.
MAX_PRIORITY_PAUSES = 4


class Scheduler:
    """Decides each step's batch; owns the block manager and the request queues."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_tokens_per_decode: int = 0, itl_target_s: float = 0.0,
                 step_cost: StepCostModel | None = None) -> None:
        """``prefill_tokens_per_decode``: in a step that carries decodes, the prefill chunks
        (new admissions and unfinished prefills) get at most this many tokens per decoding
        sequence, and at least ``MIN_PREFILL_TOKENS`` (0: no cap; ``EngineSettings``).
        ``itl_target_s`` (> 0): instead, as many as ``step_cost`` (the engine's
        ``StepCostModel``, fed by its steps) says fit in that step time beside the decodes,
        once it is ``ready`` (``_prefill_budget``).

        Raises:
            ValueError: ``itl_target_s`` > 0 without ``step_cost``.
        """
        if itl_target_s > 0 and step_cost is None:
            raise ValueError("an inter-token-latency target needs a step cost model")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_tokens_per_decode = prefill_tokens_per_decode
        self.itl_target_s = itl_target_s
        self.step_cost = step_cost
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        #: Consecutive steps that paused a lower class (``_priority_floor``).
        self.num_paused_steps = 0

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
        _insert_in_class(self.waiting, request, ahead=False)

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

    def num_admittable(self, priority: int | None = None) -> int:
        """How many new requests the worker may pull now: free sequence slots
        (``max_num_seqs`` minus running and waiting requests), as long as the free KV
        blocks exceed what the waiting requests still need plus one block of growth per
        running request (0 otherwise). Pulling no more than this keeps unstarted work in
        Redis, where another worker can take it.

        With ``priority``, the same for new requests of that class (or a higher one):
        running and waiting requests of a strictly lower class count as room, their slots
        free and their blocks (about: shared prefix blocks stay held) too, since such a
        request would preempt or pass them. ``None``: every request counts, as before.
        """
        bm = self.block_manager
        ahead = [r for r in self.running if priority is None or r.priority <= priority]
        waiting = [r for r in self.waiting if priority is None or r.priority <= priority]
        slots = self.max_num_seqs - len(ahead) - len(waiting)
        preemptible = sum(len(r.block_table) for r in self.running if priority is not None and r.priority > priority)
        reserved = sum(bm.blocks_needed(r, r.num_uncomputed_tokens) for r in waiting)
        return max(0, slots) if bm.num_free_blocks + preemptible > reserved + len(ahead) else 0

    # -- one step -----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their blocks."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        floor = self._priority_floor()
        prefill_budget = self._prefill_budget(floor)
        scheduled_ids: set[str] = set()
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.priority > floor:
                break  # paused this step: the rest are of lower classes still (class order)
            if request.ends_in_flight:
                i += 1  # looking ahead: its token in flight is its last (``max_tokens``)
                continue
            num_new = min(request.num_uncomputed_tokens, budget)
            # A decode with drafts verifies them in the same step, as far as the budget
            # and the free blocks go: a block stays free for each running request after
            # this one, so drafts never cause a preemption.
            num_spec = min(len(request.spec_token_ids), budget - 1) if num_new == 1 else 0
            if num_spec > 0 and (bm.blocks_needed(request, 1 + num_spec) + len(self.running) - i - 1
                                 > bm.num_free_blocks):
                num_spec = 0
            if num_spec > 0:
                num_new += num_spec
            elif num_new > 1:  # an unfinished prefill: its chunk counts against the prefill cap
                num_new = min(num_new, prefill_budget)
                if num_new == 0:
                    i += 1
                    continue
                prefill_budget -= num_new
            while not bm.can_allocate(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                bm.allocate(request, num_new)
                out.scheduled.append(ScheduledRequest(request, num_new, num_spec))
                scheduled_ids.add(request.request_id)
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted; everything after it too

        # Admit waiting requests, in class order, only when the running requests
        # preempted nothing this step: a cache that just ran out would thrash otherwise.
        # One whose next block a running request is computing waits a step (``_defer``)
        # and lets later ones pass. One that finds no slot or blocks preempts running
        # requests of a lower class (``_preempt_for``), or for a slot one of its class from
        # a tenant that runs two more (``_preempt_for_tenant``); after that only classes
        # above every request preempted so far are admitted, so no victim comes straight back.
        if out.preempted:
            return out
        no_claim: set[str] = set()  # tenants whose waiting request found no slot to take
        claimants: set[str] | None = None  # tenants that may take a slot (``_claimants``)
        i = 0
        while i < len(self.waiting) and min(budget, prefill_budget) > 0:
            request = self.waiting[i]
            if out.preempted and request.priority >= min(r.priority for r in out.preempted):
                break
            if request.priority > floor:
                break  # its class's decodes pause this step: it would only lengthen it
            if request.tenant in no_claim:
                i += 1
                continue
            # A request that asks for prompt logprobs computes every prompt position: a
            # cached block has no logits (vLLM v1 skips the lookup too).
            cached = [] if request.prompt_logprobs is not None else bm.find_cached_prefix(request)
            if self._defer(request, len(cached)):
                i += 1
                continue
            if len(self.running) >= self.max_num_seqs:
                refund = self._preempt_for(request, out)
                if refund is None and request.tenant not in no_claim:
                    refund = self._preempt_for_tenant(request, out)
                if refund is None:
                    # Only a preemption admits anything now; a later request of another
                    # tenant may still claim a slot (each tenant is looked at once).
                    no_claim.add(request.tenant)
                    if claimants is None:
                        claimants = self._claimants()
                    if claimants <= no_claim:
                        break  # no later request can take a slot either (a long queue offline)
                    i += 1
                    continue
                budget += refund
                i = self.waiting.index(request)  # a victim of its class went back ahead of it
            bm.allocate_prefix(request, cached)
            num_new = min(request.num_uncomputed_tokens, budget, prefill_budget)
            fits = bm.can_allocate(request, num_new)
            while not fits and (refund := self._preempt_for(request, out)) is not None:
                budget += refund
                fits = bm.can_allocate(request, num_new)
            if not fits:
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
            _insert_in_class(self.running, request, ahead=False)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            prefill_budget -= num_new
        return out

    def _priority_floor(self) -> float:
        """The lowest class (largest ``priority``) this step carries: every class
        (``inf``), unless a request of a class above the lowest running one waits (the
        first waiting request: the highest class) or is running mid-prefill. Then its
        class, so the lower classes' decodes pause for this step and it prefills in a
        step of its class's size, as on an idle engine, not beside all of theirs (on CPU
        a step's time grows with its tokens). Paused requests are neither preempted nor
        freed: they decode again in the next step that carries their class, at the latest
        after ``MAX_PRIORITY_PAUSES`` paused steps in a row. (vLLM's priority policy
        touches a lower class only when it runs out of room, by preemption; a pause costs
        it one step and no recompute.) Same-class arrivals pause nobody: under a flood
        every step admits one, and decodes would stall in every step."""
        if self.running and self.num_paused_steps < MAX_PRIORITY_PAUSES:
            lowest = self.running[-1].priority  # class order: the last is of the lowest class
            urgent = [r.priority for r in self.running if r.num_uncomputed_tokens > 1]
            if self.waiting:
                urgent.append(self.waiting[0].priority)
            if urgent and min(urgent) < lowest:
                self.num_paused_steps += 1
                return min(urgent)
        self.num_paused_steps = 0
        return float("inf")

    def _prefill_budget(self, floor: float = float("inf")) -> int:
        """Most prefill tokens this step may carry beside the decodes of the running
        requests of class ``floor`` or above; ``max_num_batched_tokens`` with no decode.
        A mixed step then takes a bounded time, so decoding sequences see no inter-token
        spike when a long prompt arrives (Sarathi-Serve's stall-free batching, Agrawal et
        al., OSDI 2024). Looking ahead, a request whose token in flight is its last
        (``Request.ends_in_flight``) decodes no more. Counted as decodes, 8 prompts
        finishing in flight capped the next step's prefill at ``MIN_PREFILL_TOKENS``, and
        an offline prefill of 16 prompts of 512 tokens took 9 steps instead of 2 on the H100.

        With an inter-token-latency target (``itl_target_s``) and a ``ready`` step cost
        model: the tokens that fit in that step time beside these decodes and the context
        the next prefill chunk attends to (``StepCostModel.prefill_budget``), at least
        ``MIN_TARGET_PREFILL_TOKENS``: few decodes leave room for long chunks, many
        leave short ones. Otherwise ``prefill_tokens_per_decode`` per decode (0: no
        cap), at least ``MIN_PREFILL_TOKENS``."""
        decoding = [r for r in self.running
                    if r.num_uncomputed_tokens == 1 and r.priority <= floor and not r.ends_in_flight]
        if not decoding:
            return self.max_num_batched_tokens
        if self.itl_target_s > 0 and self.step_cost is not None and self.step_cost.ready:
            decodes = StepFeatures(len(decoding), len(decoding), sum(r.num_computed_tokens for r in decoding))
            context = next((r.num_computed_tokens for r in self.running
                            if r.num_uncomputed_tokens > 1 and r.priority <= floor), 0)
            budget = self.step_cost.prefill_budget(self.itl_target_s, decodes, context)
            return min(self.max_num_batched_tokens, max(MIN_TARGET_PREFILL_TOKENS, budget))
        if self.prefill_tokens_per_decode <= 0:
            return self.max_num_batched_tokens
        return max(MIN_PREFILL_TOKENS, self.prefill_tokens_per_decode * len(decoding))

    def update(self, out: SchedulerOutput, sampled: Sequence[int | list[int] | None]
               ) -> tuple[list[StepResult], list[Request]]:
        """Apply a step's results.

        A speculative item (``num_spec_tokens > 0``) gets a list: its accepted drafts,
        then the target model's token. Only the accepted drafts' KV counts as computed;
        the rejected ones' positions are rolled back and the blocks that hold none of
        the kept positions are freed (``BlockManager.free_tail``).

        Args:
            out: the step's ``SchedulerOutput``.
            sampled: one entry per ``out.scheduled``: the sampled token id, the list of
                a speculative item, or ``None`` for a partial prefill chunk.

        Returns:
            ``(results, finished)``: new tokens per request that got one, and the
            requests that finished this step (their blocks already freed).
        """
        results: list[StepResult] = []
        finished: list[Request] = []
        for item, token in zip(out.scheduled, sampled, strict=True):
            request = item.request
            if request.status.finished or request.status == RequestStatus.PREEMPTED:
                continue  # aborted, stopped, or preempted by a look ahead, while this step was in flight
            tokens = [token] if isinstance(token, int) else token
            request.spec_token_ids = []
            first_index = request.num_output_tokens
            if item.num_spec_tokens:
                assert tokens is not None and 1 <= len(tokens) <= item.num_spec_tokens + 1, tokens
                # The input token's and the accepted drafts' KV stay; the rest is rolled back.
                request.num_computed_tokens += item.num_tokens - item.num_spec_tokens + len(tokens) - 1
                self.block_manager.free_tail(request)
                appended = []
                for t in tokens:  # a stop among the accepted drafts ends the request there
                    request.append_token(t)
                    appended.append(t)
                    if request.status.finished:
                        break
                if not request.status.finished:  # the accepted drafts are in token_ids now
                    self.block_manager.cache_full_blocks(request)
                    self.block_manager.free_outside_window(request)
                results.append(StepResult(request, appended, first_index))
            else:
                request.num_computed_tokens += item.num_tokens
                self.block_manager.cache_full_blocks(request)
                self.block_manager.free_outside_window(request)  # sliding-window models only
                if tokens is None:
                    continue
                request.append_token(tokens[0])
                results.append(StepResult(request, tokens, first_index))
            if request.status.finished:
                self.running.remove(request)
                self._finish(request)
                finished.append(request)
        return results, finished

    def hash_ahead(self, out: SchedulerOutput) -> None:
        """Hash the full blocks that ``out``'s input tokens fill (their tokens are all
        known), so that ``update``'s ``cache_full_blocks`` finds the hashes made: the
        engine calls this while the GPU runs the step (``ModelRunner.execute``'s
        ``while_gpu_runs``), where a 2,048-token prompt's 128 hashes would otherwise
        keep the GPU waiting between two steps. No effect without prefix caching."""
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return
        for item in out.scheduled:
            r = item.request
            num_full = min(r.num_computed_tokens + item.num_tokens, r.num_tokens) // bm.block_size
            if num_full > len(r.block_hashes):
                bm.block_hash_at(r, num_full - 1)  # hashes every block up to it, each once

    # -- async scheduling: a step behind one still in flight ------------------------
    @contextmanager
    def ahead_of(self, inflight: SchedulerOutput) -> Iterator[SchedulerOutput]:
        """Schedule the step after ``inflight``, a step enqueued on the device whose
        results are not applied yet, as if they were: while the context is open, each of
        its requests counts its chunk as computed (``num_computed_tokens``) and, when
        the chunk samples, one token in flight (``num_pending_tokens``: the next step's
        input at that position comes from the device). The context yields ``schedule()``
        made on that view; on exit the view is taken back, and ``update(inflight, ...)``
        then ``update(next, ...)`` apply both steps in order. Whatever the look ahead
        allocated, admitted or preempted stays: the step it yields must run (enqueued
        ahead, or synchronously once ``inflight`` is applied). A request whose token in
        flight reaches ``max_tokens`` is not scheduled (its slot is taken in the step
        after: admitting into it at once was measured slower on the H100,
        docs/benchmarks.md); one that stops on it (EOS, stop token) computes one token
        more, which ``update`` drops. A request that the look ahead preempts keeps
        nothing of ``inflight``: its entry is skipped by ``update``.
        (vLLM v1's async scheduling advances ``num_computed_tokens`` at schedule time
        and counts output placeholders the same way.)

        Raises:
            AssertionError: ``inflight`` verifies drafts (speculative steps are never
                enqueued ahead).
        """
        advanced: list[tuple[ScheduledRequest, int, bool]] = []
        for item in inflight.scheduled:
            assert not item.num_spec_tokens, "a speculative step is applied before the next is scheduled"
            r = item.request
            if r.status != RequestStatus.RUNNING:  # aborted or finished while in flight
                continue
            samples = item.samples
            r.num_computed_tokens += item.num_tokens
            r.num_pending_tokens += samples
            advanced.append((item, r.num_preemptions, samples))
        try:
            yield self.schedule()
        finally:
            for item, num_preemptions, samples in advanced:
                r = item.request
                if r.num_preemptions == num_preemptions:  # else preempted: ``_release`` reset both
                    r.num_computed_tokens -= item.num_tokens
                    r.num_pending_tokens -= samples

    # -- async scheduling: a decode step behind one still in flight -----------------
    def can_schedule_next_decode(self, out: SchedulerOutput) -> bool:
        """True when the step after ``out``, whose sampled tokens are not applied yet,
        is one more decode token for the same requests: nothing waits to be admitted (or
        no sequence slot is free to admit it: ``max_num_seqs`` are running, and no
        waiting request is of a higher class than a running one, which it could
        preempt), none of
        them finished, was aborted or will reach ``max_tokens`` with the token
        in flight, and the KV cache has blocks for two more positions each (the
        in-flight token's and the next one's). ``max_tokens`` also keeps them within
        ``max_model_len``: ``check_request`` admits no prompt + ``max_tokens`` above it."""
        requests = [item.request for item in out.scheduled]
        if (self.waiting and len(self.running) < self.max_num_seqs) or len(requests) != len(self.running):
            return False
        if self.waiting and self.running and self.waiting[0].priority < self.running[-1].priority:
            return False  # it may preempt a running request of a lower class
        if self.waiting and self._claimants():
            return False  # it may preempt one of another tenant's (fair share of slots)
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
        past the block yet, or past it only in a step still in flight) computes the full
        block that follows the waiting ``request``'s cached prefix, with the same tokens
        before it: admitted later, ``request`` finds that block in the prefix cache
        instead of computing it again (in-batch prefix caching: n siblings of one prompt
        arrive together, and only the first prefills the prompt). The test is on the
        blocks registered in the cache, not on ``num_computed_tokens``: a step scheduled
        ahead (``ahead_of``) sees the one in flight as computed before its blocks are
        registered, and judged on the count, 15 of 32 groups' 2,000-token prefixes were
        computed twice (offline shared-prefix run, H200, 2026-11-28). SGLang's scheduler deprioritises waiting requests that
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
        return any(bm.num_registered_blocks(other) <= k and end <= other.num_tokens
                   and bm.block_hash_at(other, k) == want for other in self.running)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.spec_token_ids = []
        self._release(request)
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        _insert_in_class(self.waiting, request, ahead=True)
        self.num_preemptions += 1

    def _preempt_for(self, request: Request, out: SchedulerOutput) -> int | None:
        """Preempt the last running request (the lowest class's most recently admitted)
        if its class is strictly below the waiting ``request``'s (a larger ``priority``),
        to make room for it; a victim already scheduled in ``out`` is taken out of it.

        Returns:
            The victim's tokens scheduled in ``out`` (0 if none), for the caller to give
            back to the step's budget; ``None`` when no running request is of a lower
            class (nothing was preempted).
        """
        if not self.running or self.running[-1].priority <= request.priority:
            return None
        return self._preempt_in(self.running[-1], out)

    def _preempt_in(self, victim: Request, out: SchedulerOutput) -> int:
        """Preempt ``victim`` during the step ``out``, taking it out of ``out`` if it is
        scheduled there; returns its tokens scheduled there (0 if none)."""
        self._preempt(victim)
        out.preempted.append(victim)
        for k, item in enumerate(out.scheduled):
            if item.request is victim:
                del out.scheduled[k]
                return item.num_tokens
        return 0

    def _preempt_for_tenant(self, request: Request, out: SchedulerOutput) -> int | None:
        """Preempt the running request that the waiting ``request`` may take the slot of
        (``fair_share.claim_victim``: same class, another tenant that runs at least two
        more); a victim already scheduled in ``out`` is taken out of it. Returns as
        ``_preempt_for``: the victim's tokens scheduled in ``out``, or ``None`` (nothing
        was preempted)."""
        victim = claim_victim(self.running, request)
        return None if victim is None else self._preempt_in(victim, out)

    def _claimants(self) -> set[str]:
        """The tenants with a waiting request that may preempt another tenant's running
        request of its class for a slot (``fair_share.claim_victim``; each tenant's first
        waiting request of each class is asked)."""
        firsts: dict[tuple[str, int], Request] = {}
        for r in self.waiting:
            firsts.setdefault((r.tenant, r.priority), r)
        return {tenant for (tenant, _), r in firsts.items() if claim_victim(self.running, r) is not None}

    def fair_share_blocked(self, priority: int) -> set[str] | None:
        """For the worker's pull when the engine is full (``num_admittable(priority) ==
        0``): the tenants whose next request of class ``priority`` would find no slot to
        claim (``fair_share.blocked_tenants``); ``None``: every tenant's would find none."""
        return blocked_tenants(self.running, self.waiting, priority)

    def _release(self, request: Request) -> None:
        """Free a waiting request's blocks; it recomputes (or re-finds cached) from 0."""
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0
        request.num_pending_tokens = 0

    def _finish(self, request: Request) -> None:
        self.block_manager.free(request)
        del self.requests[request.request_id]


def _insert_in_class(queue: deque[Request] | list[Request], request: Request, *, ahead: bool) -> None:
    """Insert ``request`` into ``queue``, which is kept in class order (lower
    ``priority`` first): behind every request of its class (a new arrival or admission:
    FCFS within the class), or with ``ahead`` in front of them (a preempted request
    resumes before its class's later arrivals, as it did before classes existed). Scans
    from the end where the place is (the front with ``ahead``), so with one class it
    costs O(1)."""
    p = request.priority
    if ahead:
        i = next((k for k, r in enumerate(queue) if r.priority >= p), len(queue))
    else:
        i = len(queue)
        while i > 0 and queue[i - 1].priority > p:
            i -= 1
    queue.insert(i, request)
