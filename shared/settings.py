"""Settings of every component: one frozen dataclass each, built once at the entry
point from CLI flags and ``INFERQ_*`` environment variables. Nothing deeper reads
``os.environ``.

Precedence: CLI flag > ``INFERQ_<FIELD>`` variable > the default written here. Field
names are unique across the dataclasses, so ``INFERQ_<FIELD>`` names one setting.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "INFERQ_"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def _doc(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """Which weights to load and how."""

    model: str = field(default=DEFAULT_MODEL, metadata=_doc(
        "Model: the default name, a local Hugging Face folder, or a named config with --load-format dummy"))
    served_model_name: str = field(default="", metadata=_doc(
        "Name clients use in the `model` field (default: the model's name)"))
    load_format: str = field(default="auto", metadata=_doc("auto | dummy (random weights of the config)"))
    dtype: str = field(default="auto", metadata=_doc(
        "auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16"))
    device: str = field(default="auto", metadata=_doc("auto | cpu | cuda"))
    max_model_len: int = field(default=2048, metadata=_doc("Longest prompt + output, tokens"))
    model_cache_dir: str = field(default="", metadata=_doc(
        "Where converted models are cached (default ~/.cache/inferq/models)"))
    seed: int = field(default=0, metadata=_doc("Seed for dummy weights and unseeded sampling"))

    def __post_init__(self) -> None:
        assert self.load_format in ("auto", "dummy"), self.load_format
        assert self.dtype in ("auto", "float32", "bfloat16", "float16"), self.dtype
        assert self.device in ("auto", "cpu", "cuda"), self.device
        assert self.max_model_len >= 1


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
    attention_backend: str = field(default="auto", metadata=_doc("auto | torch | cpu | triton"))
    async_scheduling: bool = field(default=True, metadata=_doc(
        "With CUDA graphs, enqueue the next decode step before the current one's tokens reach the host"))
    cpu_threads: int = field(default=0, metadata=_doc(
        "Intra-op threads on CPU (0: OMP_NUM_THREADS if set, else every core)"))
    sim_step_time_ms: float = field(default=20.0, metadata=_doc(
        "Step time of the model-free `sim` backend, ms (one token per running request per step)"))

    def __post_init__(self) -> None:
        assert self.block_size >= 1 and self.max_num_seqs >= 1
        assert self.max_num_batched_tokens >= 1 and self.num_kv_blocks >= 0
        assert 0.0 < self.gpu_memory_utilization <= 1.0
        assert self.attention_backend in ("auto", "torch", "cpu", "triton"), self.attention_backend
        assert self.sim_step_time_ms >= 0.0, self.sim_step_time_ms
        assert self.cpu_threads >= 0, self.cpu_threads


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """Where Redis is and which namespace the keys live under."""

    redis_url: str = field(default="", metadata=_doc(
        "Redis URL (redis://host:port/0 or unix:///path); empty with `serve` starts an embedded Redis"))
    namespace: str = field(default="inferq", metadata=_doc("Prefix of every Redis key"))


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """The HTTP gateway."""

    host: str = field(default="127.0.0.1", metadata=_doc("Address the gateway listens on"))
    port: int = field(default=8000, metadata=_doc("Port the gateway listens on"))
    api_keys: tuple[str, ...] = field(default=(), metadata={
        "help": "Accepted bearer tokens: repeat --api-key; comma-separated in the variable (none: no auth)",
        "flag": "--api-key"})
    max_queue_len: int = field(default=1000, metadata=_doc("Queued requests per model above which new ones get 429"))
    request_timeout_s: float = field(default=600.0, metadata=_doc("Deadline of a request from arrival, seconds"))
    max_body_bytes: int = field(default=4 * 1024**2, metadata=_doc("Largest request body, bytes (413 above)"))


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """One worker process."""

    worker_id: str = field(default="", metadata=_doc("Consumer name in the group (default: host-pid)"))
    backend: str = field(default="inferq", metadata=_doc(
        "inferq (our engine) | sim (no model: fixed step time, echoes the prompt) | vllm (vLLM in-process)"))
    metrics_port: int = field(default=0, metadata=_doc("Port of the worker's /metrics (0: off)"))
    drain_timeout_s: float = field(default=60.0, metadata=_doc(
        "On SIGTERM, how long to finish held requests before handing the rest back, seconds"))


def _convert(raw: str, annotation: Any) -> Any:
    """Parse an environment-variable string into the field's type."""
    hint = annotation
    origin = typing.get_origin(hint)
    if hint is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
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
          environ: Mapping[str, str] | None = None) -> T:
    """Build settings ``cls`` from overrides (CLI flags; ``None`` means unset),
    ``INFERQ_<FIELD>`` variables of ``environ`` (default ``os.environ``), and defaults.

    Raises:
        ValueError: an environment variable does not parse as the field's type.
    """
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        given = (overrides or {}).get(f.name)
        if given is not None:
            values[f.name] = tuple(given) if isinstance(given, list) else given
            continue
        raw = env.get(ENV_PREFIX + f.name.upper())
        if raw is not None:
            try:
                values[f.name] = _convert(raw, hints[f.name])
            except ValueError as exc:
                raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: {exc}") from exc
    return cls(**values)


ALL_SETTINGS = (ModelSettings, EngineSettings, RedisSettings, GatewaySettings, WorkerSettings)


def settings_table() -> str:
    """Markdown table of every setting (variable, default, meaning) for the README."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for cls in ALL_SETTINGS:
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else ""
            rows.append(f"| `{ENV_PREFIX}{f.name.upper()}` | `{default!r}` | {f.metadata.get('help', '')} |")
    return "\n".join(rows)
