"""The engine core: one ``step()`` = schedule, execute, update (vLLM v1's loop)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial

import torch

from shared.model_source import ModelSource, eos_token_ids, max_model_len
from shared.protocol import TokenLogprobs
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from worker.backends.base import EngineStats, RequestOutput, RequestRejected, check_request
from worker.backends.kv_events import KVEvents
from worker.engine.arrivals import Arrivals, StepStop
from worker.engine.block_manager import BlockManager
from worker.engine.cuda_graphs import PiecewiseReplay
from worker.engine.draft_proposer import DraftProposer, draft_num_blocks, load_draft_model
from worker.engine.kv_calibration import kv_calibration_ids
from worker.engine.model_runner import ModelRunner, StepLaunch, decode_inputs, kv_cache_dtype
from worker.engine.request import GRAMMAR_FAILED, Request
from worker.engine.scheduler import Scheduler
from worker.engine.spec_decode import NgramProposer, Proposer, SpecStats
from worker.engine.step_cost import StepCostModel, StepFeatures, step_features
from worker.engine.step_types import SchedulerOutput
from worker.models.config import ModelConfig
from worker.models.fp8 import resolve_quantization
from worker.models.llama import ForwardStopped
from worker.models.loader import build_model
from worker.structured.cache import GrammarCache, InvalidGrammar
from worker.structured.tokenizer import build_tokenizer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Longest pause between one ``step`` returning and the next being called that still
#: counts the interval as a step's time for the step cost model, seconds: the worker's
#: pull and publish between steps take about a millisecond; a longer pause is idleness.
MAX_STEP_GAP_S = 0.05


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def num_kv_blocks(cfg: ModelConfig, settings: EngineSettings, dtype: torch.dtype, device: torch.device,
                  draft_cfg: ModelConfig | None = None) -> int:
    """KV blocks that fit: the explicit count, ``kv_cache_bytes`` on CPU, or on CUDA the
    part of ``gpu_memory_utilization`` left after weights and a worst-case step's
    activations (estimated as 24 bytes per hidden unit per batched token plus logits).
    With a draft model (``draft_cfg``, speculative decoding) a block's bytes include the
    draft's block, as its cache has as many (``draft_proposer.draft_num_blocks``)."""
    if settings.num_kv_blocks:
        return settings.num_kv_blocks
    elem = torch.empty((), dtype=kv_cache_dtype(settings.kv_cache_dtype, dtype)).element_size()
    block_bytes = (cfg.kv_bytes_per_token(elem) + (draft_cfg.kv_bytes_per_token(elem) if draft_cfg else 0)) \
        * settings.block_size
    if device.type != "cuda":
        return max(1, settings.kv_cache_bytes // block_bytes)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    activations = settings.max_num_batched_tokens * (cfg.hidden_size * 24 + cfg.intermediate_size * 8) \
        + settings.max_num_seqs * cfg.vocab_size * 8
    budget = int(total * settings.gpu_memory_utilization) - used - activations
    if budget < block_bytes:
        raise RuntimeError(f"no GPU memory left for the KV cache (budget {budget} bytes)")
    return budget // block_bytes


def cpu_threads(settings: EngineSettings, environ: Mapping[str, str] | None = None) -> int:
    """Intra-op threads for a CPU engine: ``settings.cpu_threads``, else ``OMP_NUM_THREADS``,
    else every core. Measured on the 2-core CI machine (`bench.vllm_paired`, served,
    256 in / 64 out): 2 threads gave 13.9 output tok/s at concurrency 1 against 10.1 with
    one, although the gateway shares the cores; run several workers on one host with
    ``cpu_threads`` (or ``OMP_NUM_THREADS``) = cores / workers instead.
    """
    if settings.cpu_threads:
        return settings.cpu_threads
    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"])
    return os.cpu_count() or 1


def _needs_no_host(request: Request) -> bool:
    """Whether a step may carry ``request`` before the previous step's tokens reach the
    host (async scheduling): it reads no token history there (penalties), and fetches no
    logprobs or prompt logprobs with the ids (``RawLogprobs`` is fetched with them, which
    an enqueued step does not wait for)."""
    sampling = request.sampling
    return not sampling.needs_penalties and sampling.logprobs is None and request.prompt_logprobs is None


class LLMEngine:
    """Continuous-batching engine over one model on one device. Not thread-safe: call
    ``add_request``/``abort``/``step`` from one thread at a time."""

    def __init__(self, source: ModelSource, model_settings: ModelSettings,
                 engine_settings: EngineSettings | None = None) -> None:
        self.engine_settings = engine_settings or EngineSettings()
        self.model_settings = model_settings
        self.device = resolve_device(model_settings.device)
        self.dtype = resolve_dtype(model_settings.dtype, self.device)
        self.model_config = ModelConfig.from_hf(source.config)
        self.max_model_len = max_model_len(source.config, model_settings.max_model_len)
        t0 = time.perf_counter()
        quantization, prequantized = resolve_quantization(model_settings.quantization, source.config)
        model = build_model(self.model_config, source.path, source.dummy, self.dtype, self.device,
                            self.max_model_len, model_settings.seed, quantization, prequantized)
        es = self.engine_settings
        draft = load_draft_model(es, model_settings, source, self.dtype, self.device, self.max_model_len) \
            if es.speculative_method == "draft" else None
        # A tensor-parallel rank holds its shard's KV heads only (worker/parallel/layers.py).
        num_blocks = num_kv_blocks(model.shard_config, es, self.dtype, self.device,
                                   draft.config if draft is not None else None)
        self.runner = ModelRunner(model, self.engine_settings, num_blocks, self.max_model_len, self.dtype,
                                  self.device, model_settings.seed,
                                  kv_calibration_ids(source, es, self.model_config.vocab_size, self.max_model_len))
        num_blocks = self.runner.num_blocks  # the group's, under tensor parallelism
        # Without --max-model-len, what the cache holds caps the config's length (the runner's
        # tables keep the config's: every rank sizes them alike before the group's count is known).
        self.max_model_len = max_model_len(source.config, model_settings.max_model_len,
                                           num_blocks * self.engine_settings.block_size)
        if self.max_model_len > num_blocks * self.engine_settings.block_size:
            log.warning("--max-model-len %d is more than the KV cache holds (%d tokens): longer requests "
                        "get a 400", self.max_model_len, num_blocks * self.engine_settings.block_size)
        #: The step-time model behind ``itl_target_ms`` (``worker/engine/step_cost.py``):
        #: fed each step's time while the engine stays busy (``step``), only when a
        #: target is set (the features cost a pass over the batch).
        self.step_cost = StepCostModel()
        self._step_features: StepFeatures | None = None  # of the step ``_apply`` applied last
        self._last_step_end_s: float | None = None
        self.scheduler = Scheduler(BlockManager(num_blocks, self.engine_settings.block_size,
                                                self.engine_settings.enable_prefix_caching,
                                                self.model_config.uniform_sliding_window),
                                   self.engine_settings.max_num_seqs, self.engine_settings.max_num_batched_tokens,
                                   # On CPU a step's time is mostly per token, so a cap would only
                                   # slow prefills down: it bounds mixed steps against graph replays.
                                   self.engine_settings.prefill_tokens_per_decode if self.runner.graphs else 0,
                                   # A target is asked for: it applies on any device.
                                   self.engine_settings.itl_target_ms / 1e3, self.step_cost)
        self.eos_token_ids = eos_token_ids(source.config)
        # Speculative decoding (worker/engine/spec_decode.py, draft_proposer.py); None: off.
        self.proposer: Proposer | None = None
        if es.speculative_method == "ngram":
            self.proposer = NgramProposer(es.num_speculative_tokens, es.speculative_ngram_max,
                                          es.speculative_ngram_min, es.speculative_token_cost)
        elif draft is not None:
            self.proposer = DraftProposer(draft, es, draft_num_blocks(num_blocks, es), self.max_model_len,
                                          self.dtype, self.device)
        # Structured outputs: the llguidance tokenizer is built on the first such request.
        self.grammars = GrammarCache(
            partial(build_tokenizer, source.path, self.model_config.vocab_size, self.eos_token_ids)
            if source.path is not None and source.has_tokenizer else None)
        # The step enqueued on the GPU and not yet applied (async scheduling): whole, or a
        # decode step's first piece only (``graph_pieces``; ``_finish_inflight`` looks, then
        # replays the rest).
        self._inflight: tuple[SchedulerOutput, StepLaunch | PiecewiseReplay] | None = None
        self.num_async_steps = 0  # steps enqueued behind one still in flight
        # Scheduled ahead of the step in flight but not enqueued (``_look_ahead``): runs
        # synchronously in the next call.
        self._next: SchedulerOutput | None = None
        #: Whether any step may be scheduled while the one before it runs
        #: (``_look_ahead``): with the CUDA graphs, async scheduling and ``schedule_ahead``,
        #: not with speculative decoding. Under tensor parallelism too: a step goes to the
        #: other ranks when it is enqueued (``ModelRunner.launch_step``), and an enqueued
        #: step is never dropped there (no ``step_stop``). Off on CPU, where a step
        #: runs in the caller's thread and a step scheduled ahead would only hold its
        #: predecessor's tokens back; tests turn it on there to check the bookkeeping.
        self.look_ahead = (es.async_scheduling and es.schedule_ahead and self.runner.graphs is not None
                           and self.runner.mixed is not None and self.proposer is None)
        self.num_steps_ahead = 0  # steps scheduled while the one before them ran
        # What was announced since the worker last pulled (``note_arrival``).
        self.arrivals = Arrivals()
        self.num_chains_withheld = 0  # decode steps not chained for an arrival (``_finish_inflight``)
        # Decode steps chained without the late look (nothing that could preempt was
        # announced lately: ``Arrivals.worth_looking``), single-GPU only.
        self.num_chains_unlooked = 0
        # The look at the step in progress, between layers (eager) or pieces (replays).
        self.step_stop = StepStop(self.arrivals, self.scheduler)
        self.num_steps_stopped = 0  # steps stopped between layers or pieces for an arrival
        if self.runner.step_sync is None and self.proposer is None:
            self.runner.step_stop = self.step_stop
        log.info("engine ready in %.1f s: %s, max_model_len %d", time.perf_counter() - t0,
                 source.name, self.max_model_len)

    # -- requests ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    output_token_ids: list[int] | None = None, priority: int = 0, tenant: str = "",
                    num_cached_hint: int = 0) -> None:
        """Queue a request; ``output_token_ids`` resumes one whose first outputs were
        already delivered (failover): they count against ``max_tokens`` and the next
        token's index is ``len(output_token_ids)``. ``priority`` is its class rank
        (``GenerateRequest.priority``, lower served first; the scheduler admits in
        class order and preempts running requests of a lower class to fit it).
        ``tenant``: who sent it (the scheduler shares a class's slots between tenants).
        ``num_cached_hint``: its expected prefix-cache hit, tokens (``Request.num_cached_hint``).

        A structured output (``sampling.structured``) gets its grammar matcher here, from
        the compiled-grammar cache, advanced past ``output_token_ids``. Prompt logprobs
        (``sampling.prompt_logprobs``) are computed for a new request only: a
        continuation's client has them already.

        Raises:
            RequestRejected: empty or too long prompt, bad parameters, duplicate id, a
                resumed request with nothing left to generate, or a structured output
                that does not compile (or whose resumed tokens it rejects).
        """
        outputs = list(output_token_ids or ())
        check_request(prompt_token_ids, sampling, len(outputs), self.max_model_len)
        all_ids = [*prompt_token_ids, *outputs]
        if any(t >= self.model_config.vocab_size for t, _ in sampling.logit_bias):  # negative: validate()
            raise RequestRejected("logit_bias token id out of the vocabulary")
        if max(all_ids) >= self.model_config.vocab_size or min(all_ids) < 0:
            raise RequestRejected("token id out of the vocabulary")
        try:
            grammar = None if sampling.structured is None else self.grammars.matcher(sampling.structured, outputs)
        except InvalidGrammar as exc:  # worded as a grammar that fails mid-generation
            raise RequestRejected(f"{GRAMMAR_FAILED}: {exc}") from exc
        try:
            wants_prompt_logprobs = sampling.prompt_logprobs is not None and not outputs
            self.scheduler.add(Request(request_id, list(prompt_token_ids), sampling, self.eos_token_ids,
                                       priority=priority, tenant=tenant, token_ids=all_ids, grammar=grammar,
                                       prompt_logprobs=[] if wants_prompt_logprobs else None,
                                       num_cached_hint=num_cached_hint))
        except ValueError as exc:  # the scheduler's checks
            raise RequestRejected(str(exc)) from exc

    def abort(self, request_id: str) -> bool:
        """Finish a request now and free its blocks; returns False if it is unknown."""
        request = self.scheduler.abort(request_id)
        if request is not None:
            self._free(request)
        return request is not None

    def _free(self, request: Request) -> None:
        """Drop what a finished request holds outside the scheduler: its seeded generator
        and its grammar matcher."""
        self.runner.sampler.free(request.request_id)
        request.grammar = None
        if self.proposer is not None:
            self.proposer.free(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._inflight is not None or self._next is not None

    def num_admittable(self, priority: int | None = None) -> int:
        """How many new requests (of class ``priority`` or higher, when given) the worker
        may pull now (``Scheduler.num_admittable``)."""
        return self.scheduler.num_admittable(priority)

    def fair_share_blocked(self, priority: int) -> set[str] | None:
        """Tenants whose next request of class ``priority`` would find no slot to claim
        in a full engine (``Scheduler.fair_share_blocked``); ``None``: every tenant's."""
        return self.scheduler.fair_share_blocked(priority)

    def note_arrival(self, priority: int | None, tenant: str = "") -> None:
        """A request of class rank ``priority`` from ``tenant`` was queued, or (``None``)
        the worker is about to pull: forget earlier notes. Called from the worker's event
        loop while a step may run (``worker/engine/arrivals.py``); read by the engine
        thread (``step_stop``, ``_finish_inflight``)."""
        self.arrivals.note(priority, tenant)

    # -- the loop ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward pass; return the new tokens of every request that got one
        (``_step``). With ``itl_target_ms``, the time from the previous step's return to
        this one's is the step's time as a decoding stream sees it, and goes into
        ``step_cost`` when the caller came back within ``MAX_STEP_GAP_S`` (the engine
        stayed busy; an idle engine's gap is no step's cost)."""
        if self.engine_settings.itl_target_ms <= 0:
            return self._step()
        called_s = time.perf_counter()
        outputs = self._step()
        end_s = time.perf_counter()
        features, self._step_features = self._step_features, None
        last, self._last_step_end_s = self._last_step_end_s, end_s if features is not None else None
        if features is not None and last is not None and called_s - last <= MAX_STEP_GAP_S:
            self.step_cost.observe(features, end_s - last)
        return outputs

    def _step(self) -> list[RequestOutput]:
        """Run one forward pass; return the new tokens of every request that got one.

        With async scheduling (CUDA graphs, ``async_scheduling``), step N + 1 is
        scheduled and enqueued before step N's tokens reach the host: its decode tokens'
        input ids are step N's sampled ids on the device, so the host's bookkeeping of
        step N (fetching ids, stop checks, publishing, the worker's pull) overlaps the
        GPU's step N + 1, as in vLLM's async scheduling. A decode step that follows one
        of the same requests takes the decode chain (``_finish_inflight``); any other
        step, one that admits requests or carries prefill chunks, is scheduled on the
        view of step N applied (``_look_ahead``, ``schedule_ahead``). A request that stops
        at step N has computed one wasted token in step N + 1, which is dropped.

        Returns ``[]`` with requests still running when a step stopped between layers
        (eager) or pieces (replays) for an announced request (``step_stop``): nothing of
        it applied.
        """
        if self._inflight is not None:
            return self._finish_inflight()
        out = self._take_next()
        if out is None or out.is_empty:
            if self.proposer is not None:
                self.proposer.propose(self.scheduler.running)
            out = self.scheduler.schedule()
            if self.proposer is not None:
                for request in out.preempted:  # a draft model's KV of it is recomputed when it resumes
                    self.proposer.preempted(request.request_id)
        if out.is_empty:
            return []
        if self._async_decode_ok(out):
            requests = [item.request for item in out.scheduled]
            self._inflight = out, self._launch_decode(requests, *decode_inputs(requests))
            return self._finish_inflight()
        if self.look_ahead and self._async_step_ok(out):
            self._inflight = out, self.runner.launch_step(out.scheduled)
            return self._finish_inflight()
        self.step_stop.lowest_class = max(item.request.priority for item in out.scheduled)
        try:
            sampled, logprobs, prompt_logprobs = self.runner.execute(
                out.scheduled, while_gpu_runs=lambda: self.scheduler.hash_ahead(out))
        except ForwardStopped:
            # Nothing of the step is applied: its requests compute the same tokens in a
            # later step (their blocks stay; none was registered as cached, which happens
            # in ``update`` only). The worker pulls the newcomer, which the priority floor
            # prefills in a step without the lower classes next.
            return self._stopped()
        self.arrivals.step_ended(stopped=False)
        if self.proposer is not None:
            for item, tokens in zip(out.scheduled, sampled):
                if item.num_spec_tokens and isinstance(tokens, list):
                    self.proposer.record(item.request.request_id, item.num_spec_tokens, len(tokens) - 1)
        return self._apply(out, sampled, logprobs, prompt_logprobs)

    def _stopped(self) -> list[RequestOutput]:
        """Count a step stopped for an arrival; it returns no output."""
        self.num_steps_stopped += 1
        self.arrivals.step_ended(stopped=True)
        return []

    def _apply(self, out: SchedulerOutput, sampled: Sequence[int | list[int] | None],
               logprobs: list[TokenLogprobs | None] | None = None,
               prompt_logprobs: list[list[TokenLogprobs] | None] | None = None) -> list[RequestOutput]:
        """Apply a step's sampled tokens (and, per scheduled item, its token's logprobs
        or None, and the prompt logprobs its chunk scored or None) and return the
        outputs; a request's prompt logprobs go out, all of them, with its first token."""
        if self.engine_settings.itl_target_ms > 0:
            self._step_features = step_features(out.scheduled)
        asked = {item.request.request_id: lp for item, lp in zip(out.scheduled, logprobs or ()) if lp is not None}
        for item, entries in zip(out.scheduled, prompt_logprobs or ()):
            if entries is not None and item.request.prompt_logprobs is not None:
                item.request.prompt_logprobs.extend(entries)
        results, finished = self.scheduler.update(out, sampled)
        for request in finished:
            self._free(request)
        outputs = []
        for r in results:
            request = r.request
            prompt = request.prompt_logprobs
            if prompt is not None:
                assert len(prompt) == request.num_prompt_tokens - 1, (len(prompt), request.num_prompt_tokens)
                request.prompt_logprobs = None  # delivered: a recompute after preemption skips them
            outputs.append(RequestOutput(request.request_id, r.new_token_ids, r.first_index, request.finish_reason,
                                         request.num_prompt_tokens, request.num_cached_tokens,
                                         [asked[request.request_id]] if request.request_id in asked else None,
                                         prompt, error=request.error))
        return outputs

    def _async_decode_ok(self, out: SchedulerOutput) -> bool:
        """A step the async path may run: every item one sampled decode token, through
        the graphs, with no request that needs its token history on the host (penalties)
        or logprobs (``RawLogprobs`` is fetched with the ids, which the async path does not
        wait for), or prompt logprobs not delivered yet. Grammars may: ``_finish_inflight``
        samples their step after the previous tokens reach them. Not with speculative
        decoding on: the proposer reads each step's tokens on the host before the next."""
        return (self.engine_settings.async_scheduling and self.proposer is None
                and self.runner.takes_decode_graphs(out.scheduled) and not out.preempted
                and all(_needs_no_host(item.request) for item in out.scheduled))

    def _in_pieces(self, requests: Sequence[Request]) -> bool:
        """Whether a decode step of ``requests`` is enqueued piece by piece, to be looked
        at between its pieces (``_finish_inflight``): its graphs come in pieces, the engine
        looks at arrivals, and no request has a grammar (such a step samples under masks
        filled once the previous tokens are applied: ``launch_forward``)."""
        return (self.runner.step_stop is not None and self.runner.decode_pieces > 1
                and all(r.grammar is None for r in requests))

    def _launch_decode(self, requests: Sequence[Request], positions: Sequence[int],
                       input_ids: Sequence[int] | torch.Tensor) -> StepLaunch | PiecewiseReplay:
        """Enqueue a decode step of ``requests`` (arguments as
        ``ModelRunner.launch_decode``): its first piece only when ``_in_pieces``, else whole."""
        if not self._in_pieces(requests):
            return self.runner.launch_decode(requests, positions, input_ids)
        return self.runner.begin_decode(requests, self.runner.prepare_decode(requests, positions, input_ids))

    def _finish_inflight(self) -> list[RequestOutput]:
        """Finish enqueuing the step in flight, enqueue the next decode step when it can
        follow it, then wait for the in-flight step's tokens and apply them.

        The look between pieces: a step in flight whose first piece only was enqueued
        (``_launch_decode``) goes on piece by piece while nothing preempting is announced
        (``ModelRunner.finish_pieces``); else it is dropped there, as a stopped step.

        The late look (not under tensor parallelism), while a request that could take
        the place of the next step's work was announced lately (``Arrivals.worth_looking``):
        the next step is prepared, and replayed once the one in flight has run only if no
        such request was announced meanwhile (``note_arrival``, ``Arrivals.preempts``).
        Otherwise the next step is enqueued before the wait, so its graph launch overlaps
        the step in flight (``num_chains_unlooked``)."""
        out, launch = self._inflight  # type: ignore[misc]
        if isinstance(launch, PiecewiseReplay):
            requests = [item.request for item in out.scheduled]
            self.step_stop.lowest_class = max(r.priority for r in requests)
            try:
                logits = self.runner.finish_pieces(launch)
            except ForwardStopped:
                # Nothing of it applies: the in-flight tokens before it are applied, its
                # blocks stay with their requests, which compute the step again.
                self._inflight = None
                return self._stopped()
            launch = self.runner.launch_sample(logits, requests)
            self._inflight = out, launch
        self.arrivals.step_ended(stopped=False)
        # The decode chain below follows a decode step only (``launch_step`` enqueues others),
        # through the decode graphs (not on CPU, where tests look ahead eagerly).
        if not (self.runner.takes_decode_graphs(out.scheduled) and self.scheduler.can_schedule_next_decode(out)):
            return self._look_ahead(out, launch)  # type: ignore[arg-type]
        nxt = self.scheduler.schedule_next_decode(out)
        requests = [item.request for item in nxt.scheduled]
        # One position past the token in flight, which the host has not applied yet.
        positions = [r.num_computed_tokens + 1 for r in requests]
        # ``running`` is in class order: its last request is of the lowest class.
        lowest_class = self.scheduler.running[-1].priority
        engine_full = len(self.scheduler.running) >= self.scheduler.max_num_seqs
        if (all(r.grammar is None for r in requests) and self.runner.step_sync is None
                and self.arrivals.worth_looking(lowest_class, engine_full)):
            # The late look: a request of a higher class (or one that claims a slot of a
            # full engine) queued while the step in flight ran would otherwise wait for
            # the chained step too, then for its own (it is pulled between steps).
            # Prepare the chained step, wait for the one in flight, and replay only if
            # no such request was announced meanwhile. The GPU idles for the replay's
            # launch (~0.2 ms for a 7B model's first piece of four, ~0.6 ms whole, on an
            # H200); the host's apply still overlaps the replay. So the engine looks only
            # while such traffic was seen lately (``Arrivals.worth_looking``), as between
            # pieces; else the chained step is replayed before the wait, below. (Not under
            # tensor parallelism: rank 0 announces each step to the others as it prepares it.)
            max_seq_len = self.runner.prepare_decode(requests, positions, launch.sampled)
            token_ids = launch.token_ids()
            if self.arrivals.preempts(self.scheduler, lowest_class):
                # Not chained: its blocks stay with their requests, for their next step.
                self.num_chains_withheld += 1
                self._inflight = None
                return self._apply(out, token_ids)  # type: ignore[arg-type]
            self.num_async_steps += 1
            if self._in_pieces(requests):  # its later pieces follow in the next call
                self._inflight = nxt, self.runner.begin_decode(requests, max_seq_len)
            else:
                self._inflight = nxt, self.runner.replay_decode(requests, max_seq_len)
            return self._apply(out, token_ids)  # type: ignore[arg-type]
        self.num_async_steps += 1
        if all(r.grammar is None for r in requests):
            self.num_chains_unlooked += self.runner.step_sync is None
            self._inflight = nxt, self._launch_decode(requests, positions, launch.sampled)
            return self._apply(out, launch.token_ids())  # type: ignore[arg-type]
        # A grammar's next mask needs the token in flight: enqueue the forward pass, apply
        # the tokens (advancing the grammars) while it runs, then sample under the masks.
        # A request that stopped meanwhile has dropped its grammar: its row is sampled
        # unmasked and discarded, as in the path above, and the seeded generator that
        # sampling makes again for it is dropped once more.
        logits = self.runner.launch_forward(requests, positions, launch.sampled)
        outputs = self._apply(out, launch.token_ids())  # type: ignore[arg-type]
        self._inflight = nxt, self.runner.launch_sample(logits, requests)
        for r in requests:
            if r.status.finished:
                self._free(r)
        return outputs

    def _async_step_ok(self, out: SchedulerOutput) -> bool:
        """A step ``ModelRunner.launch_step`` may enqueue without waiting: no item needs
        its token history on the host (penalties), a grammar's mask (filled from the
        tokens applied), logprobs or prompt logprobs (fetched with the ids), and the
        graphs hold it; nor while the engine may stop a step for an announced request
        (``StepStop.armed``), which only the synchronous path does."""
        if self.runner.step_stop is not None:
            self.step_stop.lowest_class = max(item.request.priority for item in out.scheduled)
            if self.step_stop.armed:
                return False
        return self.runner.can_launch_step(out.scheduled) and all(
            item.request.grammar is None and _needs_no_host(item.request) for item in out.scheduled)

    def _take_next(self) -> SchedulerOutput | None:
        """The step that ``_look_ahead`` scheduled and left to run now, without the items
        of requests that finished (or were aborted) since; None when there is none."""
        out, self._next = self._next, None
        if out is not None:
            out.scheduled = [item for item in out.scheduled if not item.request.status.finished]
        return out

    def _look_ahead(self, out: SchedulerOutput, launch: StepLaunch) -> list[RequestOutput]:
        """Apply ``out``, the step in flight (``launch``), and before waiting for its
        tokens schedule the next step (``Scheduler.ahead_of``) and, when it can go without
        waiting (``_async_step_ok``), enqueue it behind ``out``: its decode tokens are
        ``out``'s sampled ids, copied on the device (``ModelRunner.launch_step``). The
        host's apply, the worker's publish and its pull of new requests then overlap the
        GPU, for steps that carry prefill chunks as for decodes. A step scheduled ahead
        that cannot be enqueued now (a newcomer that needs a grammar, logprobs or
        penalties) runs synchronously in the next call (``_next``). Not when a request was
        announced that would take the place of work the next step carries
        (``Arrivals.preempts``): the worker pulls it first, as without async scheduling."""
        flags = [item.samples for item in out.scheduled]  # before any update
        self._inflight = None
        running = self.scheduler.running
        if self.look_ahead and running and not self.arrivals.preempts(self.scheduler, running[-1].priority):
            rows = {item.request: row for row, item in enumerate(i for i, f in zip(out.scheduled, flags) if f)}
            with self.scheduler.ahead_of(out) as nxt:
                if not nxt.is_empty and self._async_step_ok(nxt):
                    from_device, start = [], 0
                    for item in nxt.scheduled:
                        r = item.request
                        if r.num_pending_tokens and r.num_computed_tokens == len(r.token_ids):
                            from_device.append((start, rows[r]))  # its input is the token in flight
                        start += item.num_tokens
                    self._inflight = nxt, self.runner.launch_step(nxt.scheduled, from_device, launch.sampled)
                    self.num_async_steps += 1
                    self.num_steps_ahead += 1
                elif not nxt.is_empty:
                    self._next = nxt
                    self.num_steps_ahead += 1
        ids = iter(launch.token_ids())
        return self._apply(out, [next(ids) if f else None for f in flags])

    def stats(self) -> EngineStats:
        """The scheduler's counts, with the prefill tokens its requests still have to
        compute (``Request.num_prefill_tokens_left``, summed over waiting and running)
        and the KV fragmentation of the running ones (``BlockManager.fragmentation``).
        The heartbeat calls it while a step may run on the engine thread: the queues are
        copied first (one C call each, so no step mutates them midway)."""
        s = self.scheduler
        running = list(s.running)
        held = [*s.waiting, *running]
        frag = s.block_manager.fragmentation(running, self.max_model_len)
        return replace(s.make_stats(), num_waiting_prefill_tokens=sum(r.num_prefill_tokens_left for r in held),
                       kv_internal_fragmentation=frag.internal_fragmentation,
                       kv_contiguous_waste_ratio=frag.contiguous_waste_ratio)

    def take_kv_events(self, snapshot: bool = False) -> KVEvents:
        """The prefix cache's changes since the last call, or with ``snapshot`` all of it
        (``BlockManager.take_kv_events``; the first call starts the recording)."""
        return self.scheduler.block_manager.take_kv_events(snapshot)

    @property
    def spec_stats(self) -> SpecStats:
        """Speculative decoding's counters (all zero when it is off)."""
        return self.proposer.stats if self.proposer is not None else SpecStats()
