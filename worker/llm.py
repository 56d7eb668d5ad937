"""Offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))`` drives the
engine directly, without Redis. Tests and engine benchmarks use it."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from shared.model_source import resolve_model
from shared.protocol import FinishReason, TokenLogprobs
from shared.sampling import SamplingParams
from shared.settings import DEFAULT_MODEL_NAME, OFFLINE_GPU_ENGINE_DEFAULTS, EngineSettings, ModelSettings
from shared.tokenizer_loader import load_tokenizer
from worker.engine.engine import LLMEngine, resolve_device
from worker.parallel import group as tp_group


@dataclass(slots=True)
class CompletionOutput:
    """One finished request: its prompt ids, output ids, text (when a tokenizer is
    available), why it stopped, per output token its logprobs when asked for
    (``SamplingParams.logprobs``), and per prompt token after the first its logprobs
    when asked for (``SamplingParams.prompt_logprobs``; else None)."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None


def offline_defaults(device: str) -> Mapping[str, Any]:
    """The offline engine's defaults over ``EngineSettings``' own on ``device`` (a
    ``ModelSettings.device``): ``OFFLINE_GPU_ENGINE_DEFAULTS`` on a GPU ("cuda", or
    "auto" with one present), none on a CPU."""
    return OFFLINE_GPU_ENGINE_DEFAULTS if resolve_device(device).type == "cuda" else {}


def offline_engine_settings(given: Mapping[str, Any], device: str) -> EngineSettings:
    """The offline engine's settings: ``given`` (fields of ``EngineSettings``), then
    ``offline_defaults(device)``, then ``EngineSettings``' defaults.

    Raises:
        SettingsError: a value that is not allowed.
    """
    return EngineSettings(**{**offline_defaults(device), **given})


class LLM:
    """Load a model and generate for a list of prompts in continuous batches.

    Keyword arguments are fields of ``ModelSettings`` or ``EngineSettings``, e.g.
    ``LLM(model="SmolLM2-135M-Instruct", num_kv_blocks=64, max_num_seqs=8)``. On a GPU the
    fields it is not given take ``OFFLINE_GPU_ENGINE_DEFAULTS`` (larger prefill steps than
    a served worker's) before ``EngineSettings``' own defaults. With
    ``tensor_parallel_size`` N > 1 and no tensor-parallel group in this process yet, it
    starts one (``worker.parallel.follower.start_for_engine``: N - 1 processes, this one
    rank 0) and owns it: ``close()`` (or leaving a ``with LLM(...) as llm:`` block) stops
    it. Without ``close`` the followers end with this process.

    Raises:
        TypeError: an unknown keyword.
        ValueError: settings the engine or the group refuses (``start_for_engine``).
    """

    def __init__(self, model: str = DEFAULT_MODEL_NAME, **kwargs: Any) -> None:
        model_fields = set(ModelSettings.__dataclass_fields__)
        engine_fields = set(EngineSettings.__dataclass_fields__)
        unknown = set(kwargs) - model_fields - engine_fields
        if unknown:
            raise TypeError(f"unknown settings: {sorted(unknown)}")
        self.model_settings = ModelSettings(model=model, **{k: v for k, v in kwargs.items() if k in model_fields})
        self.engine_settings = offline_engine_settings({k: v for k, v in kwargs.items() if k in engine_fields},
                                                       self.model_settings.device)
        self.source = resolve_model(model, self.model_settings.load_format, self.model_settings.model_cache_dir)
        self._group = None  # the tensor-parallel group this LLM started, if any
        if self.engine_settings.tensor_parallel_size > 1 and tp_group.current() is None:
            from worker.parallel.follower import start_for_engine

            self._group = start_for_engine(self.source, self.model_settings, self.engine_settings)
        try:
            self.engine = LLMEngine(self.source, self.model_settings, self.engine_settings)
        except BaseException:
            if self._group is not None:
                self._group.close()
            raise
        self.tokenizer = None
        if self.source.has_tokenizer:
            self.tokenizer = load_tokenizer(self.source.path)
        self._ids = itertools.count()

    def close(self, abort: bool = True) -> None:
        """Stop the tensor-parallel group this LLM started (its followers exit; bounded
        by ``group.TEARDOWN_BUDGET_S``); nothing otherwise. The engine is unusable after.
        ``abort``: as ``TPGroup.close``; False where the process ends next by
        ``group.exit_process``, so that it does not wait for NCCL's abort first."""
        group, self._group = self._group, None
        if group is not None:
            sync = self.engine.runner.step_sync
            group.close(sync.send_stop if sync is not None else None, abort=abort)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt (ids pass through).

        Raises:
            ValueError: a text prompt and no tokenizer.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        outputs: dict[str, CompletionOutput] = {}
        order: list[str] = []
        for prompt, p in zip(prompts, params, strict=True):
            rid = f"offline-{next(self._ids)}"
            ids = self.encode(prompt)
            self.engine.add_request(rid, ids, p)
            outputs[rid] = CompletionOutput(ids)
            order.append(rid)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                result = outputs[out.request_id]
                assert out.first_index == len(result.token_ids), "token gap or duplicate"
                result.token_ids.extend(out.new_token_ids)
                result.logprobs.extend(out.logprobs or ())
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = out.prompt_logprobs
                result.num_cached_tokens = out.num_cached_tokens
                if out.finish_reason is not None:
                    result.finish_reason = out.finish_reason
        if self.tokenizer is not None:
            for result in outputs.values():
                result.text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return [outputs[rid] for rid in order]
