"""vLLM's engine as a worker backend (``inferq worker --backend vllm``).

The worker's Redis loop stays the same; only the engine under it changes. vLLM's v1
``LLMEngine`` runs in this process with its engine core in-process (``InprocClient``),
so one ``step()`` here is one ``EngineCore.step()`` there: schedule, execute, update.
The forward pass runs in vLLM's executor (on CPU always its multiprocessing executor:
one model process whose OpenMP threads vLLM binds, see ``VLLM_CPU_OMP_THREADS_BIND``).
Not vLLM's ``AsyncLLM``: the worker already owns an event loop and runs ``step`` off it,
so the synchronous engine fits without a second loop, an output-handler task and an
engine-core process behind ZMQ, and its aborts and counts take effect at once.

How our calls map onto vLLM's:

- ``add_request``: the prompt's token ids become a ``TokensPrompt`` rendered by vLLM's
  renderer, ``shared.sampling.SamplingParams`` becomes ``vllm.SamplingParams`` (deltas
  only, no detokenization: the gateway owns the text). A request resumed after failover
  (``output_token_ids`` given) runs as prompt + delivered outputs, with ``max_tokens``
  and ``min_tokens`` reduced by what was delivered; its first new token has index
  ``len(output_token_ids)``. Greedy resumes are exact; presence/frequency penalties and
  seeded sampling see the delivered outputs as prompt, so sampled resumes may differ.
  A structured output becomes vLLM's ``StructuredOutputsParams`` (``vllm_structured``),
  enforced by vLLM's llguidance backend (``guidance``, compact JSON), the grammar engine
  ours uses. vLLM cannot start a grammar part-way (the delivered outputs would be prompt
  there and the grammar would start again after them), so a structured request resumed
  after delivered outputs is rejected rather than continued off its grammar. vLLM
  ends a structured output with the EOS token its grammar then forces (included in the
  ids, hidden from the text); ours finishes at the grammar's end without it.
  ``logprobs`` and ``prompt_logprobs`` pass through as vLLM's fields of the same names
  (a resumed request gets no prompt logprobs: its vLLM prompt holds delivered outputs).
  ``priority`` (the class rank, ``GenerateRequest.priority``) passes through as vLLM's
  ``priority``, which its ``priority`` scheduling policy (set by ``engine_args``) honours:
  waiting requests in (priority, arrival) order, and the running request of the lowest
  class preempted when a running one needs KV blocks. vLLM 0.32 (installed) preempts no
  running request to admit a waiting one of a higher class, which our engine does
  (docs/architecture.md, "Requests and scheduling"): there a high-class request waits
  for the first running request to finish.
- ``step``: ``LLMEngine.step()``; each ``RequestOutput`` gives the request's new token
  ids (stop and EOS tokens included, as in our engine) and finish reason, and, when
  asked for, their logprobs (vLLM's delta slice: one entry per new token) and, on the
  first output, the prompt's, converted to ``TokenLogprobs`` by ``token_logprobs``.
  vLLM's default ``logprobs_mode`` (``raw_logprobs``) is ours: a log-softmax of the
  model's logits before bias, penalties, temperature and top-k/p (docs/operations.md,
  "Logprobs"). Not so with a structured output: vLLM masks the logits with the grammar
  before its sampler, so the forced tokens score 0 and forbidden alternatives -inf.
  Output logprobs with a structured output are therefore rejected, not returned from
  another distribution; prompt logprobs are not masked and pass.
- ``abort``: ``LLMEngine.abort_request``, which frees the request's KV blocks at once.
- ``num_admittable``: free sequence slots, but 0 while vLLM leaves requests waiting after
  a step or the free KV blocks do not cover the queued prompts plus one block of growth
  per running request, so unstarted work stays in Redis for other workers.
- ``stats``: running/waiting counts, KV usage and the prefill tokens its requests still
  have to compute read from vLLM's scheduler now (so an abort shows at once),
  prefix-cache and preemption counters summed from the ``SchedulerStats``/``IterationStats``
  that vLLM hands its stat loggers every step.
- ``take_kv_events``: none. vLLM's own KV events (``BlockStored``/``BlockRemoved``) name
  blocks by vLLM's hash, not by ours (``shared/block_hashes.py``), so a vLLM worker's KV
  index stays empty and placement sees it by load only.

Settings map one to one where vLLM has the same knob (``max_num_seqs``,
``max_num_batched_tokens``, ``block_size``, ``enable_prefix_caching``, ``enforce_eager``,
``gpu_memory_utilization``, ``num_kv_blocks`` as ``num_gpu_blocks_override``); on CPU
``kv_cache_bytes`` sizes vLLM's KV cache (``kv_cache_memory_bytes``). ``dtype`` ``auto``
means what it means for our engine: float32 on CPU, bfloat16 on CUDA. ``device`` is
vLLM's platform (the installed build decides). vLLM's CPU attention needs ``block_size``
a multiple of 32: any other size (our default 16 included) gives vLLM's CPU default, 128.
``quantization`` and ``kv_cache_dtype`` map onto vLLM's knobs of the same names
(``vllm_quantization``, ``vllm_kv_cache_dtype``), and the speculative-decoding flags onto
vLLM's ``speculative_config`` (``vllm_speculative_config``); vLLM refuses at start-up what
its platform cannot run (its CPU build has no FP8 weights, for one).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.grammars import close_objects
from shared.model_source import ModelSource, max_model_len, resolve_model
from shared.protocol import FinishReason, TokenLogprobs
from shared.sampling import MAX_LOGPROBS, SamplingParams, StructuredOutput
from shared.settings import EngineSettings, ModelSettings
from worker.backends.base import EngineStats, RequestOutput, RequestRejected, check_request
from worker.backends.kv_events import NO_KV_EVENTS, KVEvents

if TYPE_CHECKING:
    import vllm
    from vllm.logprobs import Logprob
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

#: vLLM's finish reasons as ours: ``repetition`` (its hallucination guard) ends the
#: request like a stop; ``error`` (a request-level failure inside vLLM), and any reason a
#: later vLLM adds, ends it as an abort.
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort",
                                     "repetition": "stop", "error": "abort"}


@dataclass(slots=True)
class _Tracked:
    """What we remember of a request vLLM holds for us."""

    num_prompt_tokens: int  # of the original prompt, without resumed outputs
    next_index: int  # index of the next output token in the whole output
    num_logprobs: int | None  # top alternatives per output token, None: no logprobs
    num_prompt_logprobs: int | None  # the same per prompt token, until they are sent


@dataclass(slots=True)
class _Counters:
    """Totals since start, summed from vLLM's per-step stats."""

    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens found
    num_preemptions: int = 0


def vllm_dtype(dtype: str, on_cpu: bool) -> Any:
    """Our ``dtype`` setting as vLLM's: ``auto`` is float32 on CPU, bfloat16 on CUDA
    (our engine's meaning; vLLM's own ``auto`` would follow the checkpoint)."""
    if dtype == "auto":
        return "float32" if on_cpu else "bfloat16"
    return dtype


def vllm_block_size(block_size: int, on_cpu: bool) -> int | None:
    """Our ``block_size`` for vLLM, or ``None`` (vLLM's default: 128 on CPU) where its
    attention cannot use it: its CPU kernels need a multiple of 32 (our default is 16)."""
    if on_cpu and block_size % 32:
        log.info("block size %d is not a multiple of 32, which vLLM's CPU attention needs: "
                 "using vLLM's default", block_size)
        return None
    return block_size


def vllm_quantization(quantization: str) -> str | None:
    """Our ``--quantization`` as vLLM's: ``fp8`` is vLLM's online FP8 of the linear
    weights (its own scale layout: per tensor, where ours loads 128x128 blocks,
    worker/models/fp8.py), ``none`` is ``None``. A checkpoint saved in FP8 is detected by
    both from its ``quantization_config`` whatever the setting."""
    return None if quantization == "none" else quantization


def vllm_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """Our ``--kv-cache-dtype`` as vLLM's: ``fp8`` is float8 e4m3 with scale 1.0 in both
    (vLLM's ``fp8_e4m3``, named so that it cannot mean e5m2), ``auto`` the model's dtype."""
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


def vllm_speculative_config(engine: EngineSettings, model: ModelSettings, load_format: str) -> dict[str, Any] | None:
    """Our speculative-decoding flags as vLLM's ``speculative_config`` (``None``: off).

    ``ngram``: method ``ngram`` with ``prompt_lookup_max``/``min`` from
    ``--speculative-ngram-max``/``min``. ``draft``: method ``draft_model`` with the
    ``--speculative-model`` folder (resolved as ours resolves it), and a
    ``draft_load_config`` when its load format differs from the target's
    ``load_format`` (vLLM's draft otherwise loads as the target does).
    ``--num-speculative-tokens`` is vLLM's ``num_speculative_tokens``, which vLLM
    proposes every step: our adaptive draft length (``--speculative-token-cost``) has no
    vLLM counterpart.

    Raises:
        ValueError: a draft model without a Hugging Face folder.
        ModelSourceError: as ``resolve_model``.
    """
    method, k = engine.speculative_method, engine.num_speculative_tokens
    if method == "off":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": engine.speculative_ngram_max,
                "prompt_lookup_min": engine.speculative_ngram_min}
    draft = resolve_model(engine.speculative_model, engine.speculative_model_load_format, model.model_cache_dir)
    if draft.path is None:
        raise ValueError(f"the vllm backend needs a Hugging Face folder; the draft {draft.name!r} has none")
    config: dict[str, Any] = {"method": "draft_model", "model": str(draft.path), "num_speculative_tokens": k}
    draft_format = "dummy" if draft.dummy else "auto"
    if draft_format != load_format:
        from vllm.config import LoadConfig

        config["draft_load_config"] = LoadConfig(load_format=draft_format)
    return config


def engine_args(source: ModelSource, model: ModelSettings, engine: EngineSettings, on_cpu: bool) -> Any:
    """``vllm.EngineArgs`` for ``source`` with our settings (see the module docstring).

    Raises:
        ValueError: ``source`` has no Hugging Face folder (vLLM reads config and
            tokenizer from one; a named dummy config without a folder cannot run here),
            or ``itl_target_ms`` is set (vLLM's scheduler has no such target).
    """
    from vllm import EngineArgs

    if source.path is None:
        raise ValueError(f"the vllm backend needs a Hugging Face folder; {source.name!r} has none")
    if engine.itl_target_ms > 0:
        raise ValueError("the vllm backend has no inter-token-latency target (--itl-target-ms): vLLM takes a fixed "
                         "--max-num-batched-tokens per step")
    load_format = "dummy" if source.dummy else "auto"
    return EngineArgs(
        model=str(source.path), served_model_name=source.name, load_format=load_format,
        dtype=vllm_dtype(model.dtype, on_cpu), seed=model.seed, quantization=vllm_quantization(model.quantization),
        kv_cache_dtype=vllm_kv_cache_dtype(engine.kv_cache_dtype),
        speculative_config=vllm_speculative_config(engine, model, load_format),
        # Without --max-model-len, vLLM's auto-fit (-1): the config's length, capped by its
        # KV cache (as shared.model_source.max_model_len does for our engine).
        max_model_len=max_model_len(source.config, model.max_model_len) if model.max_model_len else -1,
        max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
        block_size=vllm_block_size(engine.block_size, on_cpu), enable_prefix_caching=engine.enable_prefix_caching,
        enforce_eager=engine.enforce_eager, gpu_memory_utilization=engine.gpu_memory_utilization,
        kv_cache_memory_bytes=engine.kv_cache_bytes if on_cpu else None,
        num_gpu_blocks_override=engine.num_kv_blocks or None, disable_log_stats=False, max_logprobs=MAX_LOGPROBS,
        structured_outputs_config=structured_outputs_config(), scheduling_policy="priority")


def structured_outputs_config() -> Any:
    """vLLM's structured-output settings that match our engine's grammars
    (``shared.grammars.grammar_for``): llguidance (vLLM's ``guidance`` backend) and JSON
    without free whitespace (``whitespace_flexible: false``)."""
    from vllm.config import StructuredOutputsConfig

    return StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True)


def vllm_structured(structured: StructuredOutput) -> Any:
    """Our structured output as vLLM's ``StructuredOutputsParams``: ``json_schema`` as
    ``json`` (closed by ``close_objects`` when ``strict`` and without the schema's own
    llguidance options, as ``shared.grammars.grammar_for`` builds it), ``json_object``,
    ``regex``, ``choice`` (the list) and ``grammar`` (GBNF or Lark, converted by vLLM as
    by us).

    Raises:
        ValueError: a spec that is not valid JSON where JSON is expected, or a schema
            that is not an object.
    """
    from vllm.sampling_params import StructuredOutputsParams

    kind, spec = structured.kind, structured.spec
    if kind == "json_schema":
        schema = json.loads(spec)
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        schema = {k: v for k, v in schema.items() if k != "x-guidance"}
        return StructuredOutputsParams(json=close_objects(schema) if structured.strict else schema)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "regex":
        return StructuredOutputsParams(regex=spec)
    if kind == "choice":
        return StructuredOutputsParams(choice=json.loads(spec))
    return StructuredOutputsParams(grammar=spec)


def vllm_sampling(sampling: SamplingParams, num_resumed: int = 0) -> vllm.SamplingParams:
    """Our sampling parameters as vLLM's, for a request with ``num_resumed`` outputs
    already delivered (they count against ``max_tokens`` and ``min_tokens``, and there
    are no prompt logprobs: vLLM's prompt would include them).

    Deltas only (``RequestOutputKind.DELTA``) and no detokenization.

    Raises:
        ValueError: a structured output spec that is not valid JSON where JSON is expected.
    """
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(
        max_tokens=sampling.max_tokens - num_resumed, min_tokens=max(0, sampling.min_tokens - num_resumed),
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(0, sampling.top_k),
        min_p=sampling.min_p, seed=sampling.seed, stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos, repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
        logit_bias=dict(sampling.logit_bias) or None, logprobs=sampling.logprobs,
        prompt_logprobs=None if num_resumed else sampling.prompt_logprobs,
        detokenize=False, skip_special_tokens=False, output_kind=RequestOutputKind.DELTA,
        structured_outputs=None if sampling.structured is None else vllm_structured(sampling.structured))


def token_logprobs(position: dict[int, Logprob], token_id: int, num_top: int) -> TokenLogprobs:
    """One position of vLLM's logprobs as ours: ``token_id``'s logprob and the
    ``num_top`` most likely ``(token_id, logprob)`` pairs, most likely first.

    vLLM's dict maps the scored token first, then its top ``num_top`` (ranks 1 to
    ``num_top``; ``vllm.logprobs.append_logprobs_for_next_position``), so it holds
    ``num_top`` entries when the token is among them and ``num_top + 1`` when not.

    Raises:
        ValueError: ``token_id`` missing or a size other than those two.
    """
    if token_id not in position or len(position) not in (num_top, num_top + 1):
        raise ValueError(f"vLLM logprobs {sorted(position)} do not score token {token_id} with top {num_top}")
    top = [(t, lp) for t, lp in position.items() if t != token_id or len(position) == num_top]
    top.sort(key=lambda item: item[1].rank or 0)
    return TokenLogprobs(position[token_id].logprob, [(t, lp.logprob) for t, lp in top])


def output_logprobs(positions: Any, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """vLLM's logprobs of ``token_ids`` (a sequence of per-token dicts, a list or
    ``FlatLogprobs``, one per id) as ours, one ``TokenLogprobs`` per id.

    Raises:
        ValueError: not one position per token id, or a position ``token_logprobs``
            refuses.
    """
    positions = list(positions or ())
    if len(positions) != len(token_ids):
        raise ValueError(f"vLLM gave {len(positions)} logprobs for {len(token_ids)} tokens")
    return [token_logprobs(p, t, num_top) for p, t in zip(positions, token_ids, strict=True)]


def _counting_logger(counters: _Counters) -> Any:
    """A vLLM stat-logger factory whose loggers add each step's prefix-cache lookups
    and preemptions to ``counters``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _CountingLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                counters.prefix_cache_queries += scheduler_stats.prefix_cache_stats.queries
                counters.prefix_cache_hits += scheduler_stats.prefix_cache_stats.hits
            if iteration_stats is not None:
                counters.num_preemptions += iteration_stats.num_preempted_reqs

        def log_engine_initialized(self) -> None:
            pass

    return _CountingLogger


def build_engine(args: Any, counters: _Counters) -> LLMEngine:
    """vLLM's ``LLMEngine`` with its engine core in this process (``InprocClient``),
    reporting stats to ``counters``. With ``enforce_eager`` it takes about 30 s on 2 CPU
    cores (imports, the model process's start, weights); without, vLLM first compiles
    the model with torch.compile (1.5 to 3 minutes there, cached in ``~/.cache/vllm``)."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    return LLMEngine(config, Executor.get_class(config), log_stats=True,
                     stat_loggers=[_counting_logger(counters)], multiprocess_mode=False)


class VllmBackend:
    """An ``EngineBackend`` (worker/backends/base.py) over vLLM's in-process engine.
    Not thread-safe: call it from one thread at a time (``stats`` only reads)."""

    name = "vllm"

    def __init__(self, source: ModelSource, model_settings: ModelSettings, engine_settings: EngineSettings) -> None:
        from vllm.platforms import current_platform

        args = engine_args(source, model_settings, engine_settings, current_platform.is_cpu())
        self._counters = _Counters()
        self.engine = build_engine(args, self._counters)
        config = self.engine.vllm_config
        self.block_size = int(config.cache_config.block_size)
        self.max_num_seqs = int(config.scheduler_config.max_num_seqs)
        self.max_num_batched_tokens = int(config.scheduler_config.max_num_batched_tokens)
        # The length vLLM settled on: the one engine_args asked for, or its auto-fit (it
        # refuses to start rather than lower one asked for).
        self.max_model_len = int(config.model_config.max_model_len)
        self._requests: dict[str, _Tracked] = {}
        self._num_blocks_added = 0  # prompt blocks of requests added since the last step
        self._num_added = 0  # requests added since the last step
        log.info("vLLM engine ready: %s, %s, block size %d, %d KV blocks", source.name,
                 config.model_config.dtype, self.block_size, self._block_pool().num_gpu_blocks - 1)

    # -- requests ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    output_token_ids: list[int] | None = None, priority: int = 0, tenant: str = "",
                    num_cached_hint: int = 0) -> None:
        """Queue a request in vLLM; ``output_token_ids`` resumes one whose first outputs
        were already delivered (failover); ``priority`` is vLLM's (lower served first);
        ``tenant`` and ``num_cached_hint`` are ignored (vLLM shares no slots between
        tenants; its queue figures come from its own scheduler).

        Raises:
            RequestRejected: empty or too long prompt, bad parameters, token ids out of
                the vocabulary, duplicate id, a resumed request with nothing left, a
                structured output vLLM refuses, one resumed after delivered outputs, or
                output logprobs asked of a structured output (see the module docstring).
        """
        outputs = list(output_token_ids or ())
        self._check(request_id, prompt_token_ids, sampling, len(outputs))
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        all_ids = [*prompt_token_ids, *outputs]
        try:
            (prompt,) = self.engine.renderer.render_cmpl([TokensPrompt(prompt_token_ids=all_ids)])
            self.engine.add_request(request_id, prompt, vllm_sampling(sampling, len(outputs)), priority=priority)
        except (ValueError, VLLMClientError) as exc:  # vLLM's validation of the request
            raise RequestRejected(str(exc)) from exc
        self._requests[request_id] = _Tracked(len(prompt_token_ids), len(outputs), sampling.logprobs,
                                              None if outputs else sampling.prompt_logprobs)
        self._num_added += 1
        self._num_blocks_added += -(-len(all_ids) // self.block_size)

    def _check(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
               num_resumed: int) -> None:
        """The checks our engine makes (same messages); vLLM validates the rest."""
        check_request(prompt_token_ids, sampling, num_resumed, self.max_model_len)
        if request_id in self._requests:
            raise RequestRejected(f"request {request_id} is already running")
        if sampling.structured is not None and num_resumed:
            raise RequestRejected("the vllm backend cannot resume a structured output after delivered tokens")
        if sampling.structured is not None and sampling.logprobs is not None:
            raise RequestRejected("the vllm backend cannot return logprobs with a structured output: vLLM computes "
                                  "them after the grammar mask, not from the model's raw distribution")

    def abort(self, request_id: str) -> bool:
        """Abort a request in vLLM (its KV blocks are freed now); False when unknown.
        It emits nothing more."""
        if self._requests.pop(request_id, None) is None:
            return False
        self.engine.abort_request([request_id])
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def num_admittable(self, priority: int | None = None) -> int:
        """How many new requests to pull now: free sequence slots, or 0 when vLLM left
        requests waiting after its last step (it is full), or when the free KV blocks do
        not exceed the prompt blocks of requests added since then plus one block of
        growth per running request. ``priority`` changes nothing: vLLM preempts no
        running request to admit a waiting one (module docstring)."""
        num_running, num_waiting = self._scheduler().get_request_counts()
        if num_waiting > self._num_added:
            return 0
        if self._block_pool().get_num_free_blocks() <= self._num_blocks_added + num_running:
            return 0
        return max(0, self.max_num_seqs - num_running - num_waiting)

    def fair_share_blocked(self, priority: int) -> set[str] | None:
        """``None``: no tenant's request preempts another's here (``EngineBackend``)."""
        return None

    def note_arrival(self, priority: int | None, tenant: str = "") -> None:
        """Ignored: steps here run whole and none is chained ahead (``EngineBackend``)."""

    # -- the loop ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One vLLM engine step; the new tokens of every request that got some."""
        self._num_added = self._num_blocks_added = 0
        results = []
        for out in self.engine.step():
            tracked = self._requests.get(out.request_id)
            if tracked is None:  # aborted here, vLLM's last words
                continue
            completion = out.outputs[0]  # type: ignore[index]  # a generating model: no pooling outputs
            finish = _FINISH.get(str(completion.finish_reason), "abort") if out.finished else None
            new_ids = list(completion.token_ids)
            result = RequestOutput(out.request_id, new_ids, tracked.next_index, finish,
                                   tracked.num_prompt_tokens, int(out.num_cached_tokens or 0))
            if tracked.num_logprobs is not None:
                result.logprobs = output_logprobs(completion.logprobs, new_ids, tracked.num_logprobs)
            if tracked.num_prompt_logprobs is not None and out.prompt_logprobs:
                # vLLM's entry 0 (the first prompt token, unscored) is None.
                result.prompt_logprobs = output_logprobs(out.prompt_logprobs[1:], out.prompt_token_ids[1:],
                                                         tracked.num_prompt_logprobs)
                tracked.num_prompt_logprobs = None
            results.append(result)
            tracked.next_index += len(new_ids)
            if finish is not None:
                del self._requests[out.request_id]
        return results

    def stats(self) -> EngineStats:
        """Load snapshot: vLLM's running/waiting counts, KV-cache usage and prefill
        tokens left as of now, prefix-cache and preemption totals as of its last step.
        Block counts leave out vLLM's null block (block 0, never allocated)."""
        scheduler, pool = self._scheduler(), self._block_pool()
        num_running, num_waiting = scheduler.get_request_counts()
        c = self._counters
        return EngineStats(num_running=num_running, num_waiting=num_waiting,
                           kv_usage=float(scheduler.get_kv_cache_usage()),
                           num_free_blocks=pool.get_num_free_blocks(), num_blocks=pool.num_gpu_blocks - 1,
                           num_preemptions=c.num_preemptions, prefix_cache_queries=c.prefix_cache_queries,
                           prefix_cache_hits=c.prefix_cache_hits,
                           num_waiting_prefill_tokens=self._num_waiting_prefill_tokens())

    def take_kv_events(self, snapshot: bool = False) -> KVEvents:
        """None: vLLM's events name blocks by its own hash (module docstring)."""
        return NO_KV_EVENTS

    def close(self) -> None:
        """Stop vLLM's engine core and its model process."""
        self.engine.engine_core.shutdown()

    # -- vLLM internals, in one place -------------------------------------------------
    def _scheduler(self) -> Scheduler:
        """The in-process engine core's scheduler (``InprocClient.engine_core``)."""
        return self.engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined, no-any-return]

    def _num_waiting_prefill_tokens(self) -> int:
        """Tokens vLLM's held requests still compute before they decode: per request
        ``num_tokens - num_computed_tokens`` when more than a decode's one (as
        ``Request.num_prefill_tokens_left``). The queues are copied first (the heartbeat
        reads while a step runs)."""
        scheduler = self._scheduler()
        held = [*scheduler.running, *scheduler.kv_holding_waiting, *scheduler.waiting]
        lefts = (r.num_tokens - r.num_computed_tokens for r in held)
        return sum(left for left in lefts if left > 1)

    def _block_pool(self) -> Any:
        return self._scheduler().kv_cache_manager.block_pool
