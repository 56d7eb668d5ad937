"""Our engine settings as vLLM's ``EngineArgs`` (worker/backends/vllm.py): quantization,
the KV cache's dtype and speculative decoding (n-gram and draft model). Builds the
arguments only: no vLLM engine starts (vLLM validates them at start-up, which the names
checked here against its config classes anticipate)."""

from __future__ import annotations

import dataclasses
from typing import get_args

import pytest

from shared.settings import EngineSettings, ModelSettings

pytestmark = [pytest.mark.vllm]


def test_quantization_kv_dtype_and_speculation_map_to_vllms(smollm_source) -> None:
    from vllm.config import SpeculativeConfig
    from vllm.config.cache import CacheDType
    from vllm.config.speculative import SpeculativeMethod
    from vllm.model_executor.layers.quantization import QuantizationMethods

    from worker.backends.vllm import engine_args

    plain = engine_args(smollm_source, ModelSettings(), EngineSettings(), on_cpu=True)
    assert (plain.quantization, plain.kv_cache_dtype, plain.speculative_config) == (None, "auto", None)

    ngram = engine_args(smollm_source, ModelSettings(quantization="fp8"),
                        EngineSettings(kv_cache_dtype="fp8", speculative_method="ngram", num_speculative_tokens=3,
                                       speculative_ngram_max=5, speculative_ngram_min=1), on_cpu=False)
    assert ngram.quantization == "fp8" and ngram.quantization in get_args(QuantizationMethods)
    assert ngram.kv_cache_dtype == "fp8_e4m3" and ngram.kv_cache_dtype in get_args(CacheDType)
    assert ngram.speculative_config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
                                        "prompt_lookup_min": 1}

    # The default model by name as its own draft, the draft alone with dummy weights.
    es = EngineSettings(speculative_method="draft", speculative_model="SmolLM2-135M-Instruct",
                        speculative_model_load_format="dummy", num_speculative_tokens=4)
    spec = engine_args(smollm_source, ModelSettings(), es, on_cpu=True).speculative_config
    assert (spec["method"], spec["model"], spec["num_speculative_tokens"]) == \
        ("draft_model", str(smollm_source.path), 4)
    assert spec["draft_load_config"].load_format == "dummy"
    # Loaded as the target is: no load config of its own.
    same = dataclasses.replace(es, speculative_model_load_format="auto")
    assert "draft_load_config" not in engine_args(smollm_source, ModelSettings(), same, on_cpu=True).speculative_config

    # Names vLLM's SpeculativeConfig takes, methods it knows.
    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    for config in (ngram.speculative_config, spec):
        assert set(config) <= fields and config["method"] in get_args(SpeculativeMethod)


def test_an_itl_target_is_refused_with_the_vllm_backend(smollm_source) -> None:
    """vLLM's scheduler takes a fixed token budget: a target would be silently ignored."""
    from worker.backends.vllm import engine_args

    with pytest.raises(ValueError, match="itl-target-ms"):
        engine_args(smollm_source, ModelSettings(), EngineSettings(itl_target_ms=30.0), on_cpu=True)
