"""A model-free backend for load tests of the queue, the worker loop and the gateway.

``SimBackend`` behaves like a continuous-batching engine whose forward pass takes a
fixed ``step_time_ms``: every step emits one token for each running request, at most
``max_num_seqs`` requests run at once and the rest wait (FIFO within a priority class,
lower ``priority`` first), and ``num_admittable`` reports free sequence slots, so
pull-based balancing across workers holds as it does with the real engine. As there, a
waiting request that finds every slot taken preempts the running request of the lowest
class strictly below its own, most recently admitted first (``num_preemptions``); the
victim goes back to the head of its class and resumes where it was (the sim has no KV
to recompute).

Outputs are deterministic so tests can detect lost or duplicated tokens: output token
``i`` of a request is ``prompt_token_ids[i % len(prompt_token_ids)]`` (an echo of the
prompt, repeated; ``i`` counts from the start of the output, also for a request
resumed after failover, so a resumed stream continues the same echo). Stopping follows ``worker.engine.request.Request.append_token``:
after ``min_tokens`` outputs, a token in ``stop_token_ids`` (or in ``eos_token_ids``
unless ``ignore_eos``) stops the request with ``stop``; reaching ``max_tokens`` stops
it with ``length``. EOS ids and ``max_model_len`` come from the model's ``config`` as for
the real engine (``shared.model_source``); with no config no token counts as EOS and
``max_model_len`` is the setting.

KV usage is faked: each sequence slot stands for ``ceil(max_model_len / block_size)``
blocks, so ``kv_usage = num_running / max_num_seqs``.

Arrivals (``note_arrival``) stop a step as they stop the inferq engine's eager steps
(``worker/engine/arrivals.py``): a request announced during the step's sleep, of a class
above the lowest class running, ends the step early (within ``STOP_CHECK_MS``) with no
token, as often as ``Arrivals.may_stop`` allows. The sim shares no slots
between tenants, so only the class counts.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.model_source import eos_token_ids, max_model_len
from shared.protocol import FinishReason
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from worker.backends.base import EngineStats, RequestOutput, RequestRejected, check_request
from worker.engine.arrivals import Arrivals

#: How often a step's sleep looks at the arrivals, ms (the engine: after each layer).
STOP_CHECK_MS = 2.0


@dataclass(slots=True)
class _SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    num_output_tokens: int = 0
    priority: int = 0

    def next_token(self) -> int:
        return self.prompt_token_ids[self.num_output_tokens % len(self.prompt_token_ids)]


class SimBackend:
    """An ``EngineBackend`` (worker/backends/base.py) without a model. Not
    thread-safe: like the real engine, call it from one thread at a time."""

    name = "sim"

    def __init__(self, model_settings: ModelSettings, engine_settings: EngineSettings, *,
                 step_time_ms: float | None = None, config: Mapping[str, Any] | None = None) -> None:
        """``config``: the model's parsed ``config.json`` (EOS ids, position limit)."""
        if step_time_ms is None:
            step_time_ms = engine_settings.sim_step_time_ms
        assert step_time_ms >= 0.0, step_time_ms
        self.block_size = engine_settings.block_size
        self.max_num_seqs = engine_settings.max_num_seqs
        config = config or {}
        self.max_model_len = max_model_len(config, model_settings.max_model_len)
        self.step_time_ms = step_time_ms
        self.eos_token_ids = eos_token_ids(config)
        self._blocks_per_seq = -(-self.max_model_len // self.block_size)
        self._waiting: deque[_SimRequest] = deque()
        self._running: dict[str, _SimRequest] = {}
        self._known: set[str] = set()  # ids waiting or running
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_steps_stopped = 0  # steps stopped by an arrival (module docstring)
        #: What was announced since the worker last pulled (``note_arrival``).
        self.arrivals = Arrivals()

    # -- requests ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    output_token_ids: list[int] | None = None, priority: int = 0, tenant: str = "") -> None:
        """Queue a request; ``output_token_ids`` resumes one whose first outputs were
        already delivered (failover): they count against ``max_tokens`` and the next
        token's index (and echo position) is ``len(output_token_ids)``. ``priority``:
        the class rank, lower served first (``GenerateRequest.priority``); ``tenant``
        is ignored (the sim shares no slots between tenants: ``fair_share_blocked``).

        Raises:
            RequestRejected: empty or too long prompt, bad parameters, duplicate id,
                a resumed request with nothing left to generate, or logprobs or
                prompt logprobs (a simulated model has no distribution).
        """
        if sampling.logprobs is not None:
            raise RequestRejected("logprobs are not supported by the sim backend")
        if sampling.prompt_logprobs is not None:
            raise RequestRejected("prompt_logprobs (echo with logprobs) are not supported by the sim backend")
        num_resumed = len(output_token_ids or ())
        check_request(prompt_token_ids, sampling, num_resumed, self.max_model_len)
        if request_id in self._known:
            raise RequestRejected(f"request {request_id} is already running")
        self._enqueue(_SimRequest(request_id, list(prompt_token_ids), sampling, num_resumed, priority), ahead=False)
        self._known.add(request_id)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request; False when unknown. It emits nothing more."""
        if request_id not in self._known:
            return False
        self._known.discard(request_id)
        if self._running.pop(request_id, None) is None:
            self._waiting = deque(r for r in self._waiting if r.request_id != request_id)
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
        """Admit waiting requests into free slots, take ``step_time_ms`` (blocking sleep:
        call it off the loop), and emit one token per running request; or, stopped by an
        arrival (module docstring), nothing."""
        start_s = time.perf_counter()
        while self._waiting and (len(self._running) < self.max_num_seqs or self._preempt_for(self._waiting[0])):
            request = self._waiting.popleft()
            self._running[request.request_id] = request
        if self._sleep_unless_stopped(start_s + self.step_time_ms / 1000):
            self.num_steps_stopped += 1
            self.arrivals.step_ended(stopped=True)
            return []
        self.arrivals.step_ended(stopped=False)
        outputs = [self._advance(r) for r in self._running.values()]
        for out in outputs:
            if out.finish_reason is not None:
                del self._running[out.request_id]
                self._known.discard(out.request_id)
        self.num_steps += 1
        return outputs

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

    def _enqueue(self, request: _SimRequest, *, ahead: bool) -> None:
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

    def _preempt_for(self, request: _SimRequest) -> bool:
        """Preempt the lowest-class running request, the most recently admitted of its
        class, if that class is strictly below ``request``'s; False when none is."""
        victim = max(reversed(self._running.values()), key=lambda r: r.priority, default=None)
        if victim is None or victim.priority <= request.priority:
            return False
        del self._running[victim.request_id]
        self._enqueue(victim, ahead=True)
        self.num_preemptions += 1
        return True

    def _advance(self, request: _SimRequest) -> RequestOutput:
        token = request.next_token()
        first_index = request.num_output_tokens
        request.num_output_tokens += 1
        params = request.sampling
        finish: FinishReason | None = None
        if request.num_output_tokens >= params.min_tokens and (
                token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)):
            finish = "stop"
        elif request.num_output_tokens >= params.max_tokens:
            finish = "length"
        return RequestOutput(request.request_id, [token], first_index, finish,
                             len(request.prompt_token_ids), 0)

    def stats(self) -> EngineStats:
        """Load snapshot; KV usage is the fraction of sequence slots in use."""
        num_running = len(self._running)
        num_blocks = self.max_num_seqs * self._blocks_per_seq
        return EngineStats(num_running=num_running, num_waiting=len(self._waiting),
                           kv_usage=num_running / self.max_num_seqs,
                           num_free_blocks=(self.max_num_seqs - num_running) * self._blocks_per_seq,
                           num_blocks=num_blocks, num_preemptions=self.num_preemptions, prefix_cache_queries=0,
                           prefix_cache_hits=0)
