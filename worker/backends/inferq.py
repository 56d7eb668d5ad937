"""The in-house engine as a worker backend."""

from __future__ import annotations

import logging

import torch

from shared.model_source import ModelSource
from shared.settings import EngineSettings, ModelSettings
from worker.engine.engine import LLMEngine, cpu_threads, resolve_device

log = logging.getLogger(__name__)


class InferqBackend(LLMEngine):
    """``LLMEngine`` built from settings, with the attributes ``EngineBackend`` names."""

    name = "inferq"

    def __init__(self, source: ModelSource, model_settings: ModelSettings, engine_settings: EngineSettings) -> None:
        if resolve_device(model_settings.device).type == "cpu":  # the worker process owns its threads
            torch.set_num_threads(cpu_threads(engine_settings))
            log.info("CPU engine with %d intra-op threads", torch.get_num_threads())
        super().__init__(source, model_settings, engine_settings)
        self.block_size = engine_settings.block_size
        self.max_num_seqs = engine_settings.max_num_seqs
        self.max_num_batched_tokens = engine_settings.max_num_batched_tokens
