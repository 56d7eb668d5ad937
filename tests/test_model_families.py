"""Model families against transformers (issue 16): for each family a tiny random model
built by transformers' own class (2-3 layers, GQA, head_dim 64/128, tied and untied
embeddings), saved as a Hugging Face folder and loaded by our engine in float32 on CPU,
must give transformers' logits (within 1e-4) at the prefill and at every step of a
64-token greedy run, and the same tokens (harness: ``tests/model_oracle.py``). Run on the
PyTorch reference backend and on the C++ CPU backend.

Sliding windows shorter than the run (Mistral, Gemma 3's local layers) must match
transformers too; a backend that takes no window is refused at load for them. Unsupported
configs fail at load, naming what is supported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.model_oracle import (
    Greedy,
    assert_same_greedy,
    engine_greedy,
    hf_greedy,
    save_random_model,
)
from worker.models.config import FULL_ATTENTION, SLIDING_ATTENTION, SUPPORTED_ARCHITECTURES, ModelConfig

NUM_NEW = 64
MAX_MODEL_LEN = 128
BF16_ATOL = 0.25  # CUDA, bfloat16 against transformers' float32 logits (std about 1.5)
WINDOW = 16  # shorter than the 76-token runs: the window cuts in after 16 tokens
#: Shared by every config: small, GQA, weights large enough (std 0.1) that attention is
#: far from uniform, so rope and window mistakes change the logits.
COMMON = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
          "max_position_embeddings": 256, "initializer_range": 0.1, "rms_norm_eps": 1e-6}
GEMMA_ROPE = {FULL_ATTENTION: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
              SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10_000.0}}


def _family(name: str, window: int | None = None) -> tuple[object, object]:
    """``(model class, config)`` of the tiny model of family ``name``."""
    import transformers as tf

    if name == "llama3":  # untied, head_dim 64, Llama 3 rope scaling that changes most frequencies
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32, "rope_theta": 500_000.0}
        return tf.LlamaForCausalLM, tf.LlamaConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=2,
                                                   rope_parameters=scaling, tie_word_embeddings=False)
    if name == "qwen3":  # tied, head_dim 128 (q width 512 > hidden 256), q/k norm
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(**COMMON, num_hidden_layers=2, num_key_value_heads=1,
                                                   head_dim=128, tie_word_embeddings=True)
    if name == "mistral":  # untied, every layer slides
        return tf.MistralForCausalLM, tf.MistralConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=2,
                                                       head_dim=64, sliding_window=window or 4096,
                                                       tie_word_embeddings=False)
    # Untied: tied, its sqrt(hidden)-scaled random embeddings make the run repeat one token.
    assert name == "gemma3"  # local + global layers, sandwich norms, GeGLU, soft-capped logits
    return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
        **COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=64,
        query_pre_attn_scalar=100,
        layer_types=[SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION], sliding_window=window or 4096,
        rope_parameters=GEMMA_ROPE, final_logit_softcapping=3.0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(3, COMMON["vocab_size"], (12,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, prompt: list[int]):
    """``reference(family, window) -> (folder, transformers' greedy run)``, built once."""
    cache: dict[tuple[str, int | None], tuple[Path, Greedy]] = {}

    def get(name: str, window: int | None = None) -> tuple[Path, Greedy]:
        if (name, window) not in cache:
            folder = tmp_path_factory.mktemp(f"{name}-{window}")
            model = save_random_model(*_family(name, window), folder)
            cache[name, window] = folder, hf_greedy(model, prompt, NUM_NEW)
        return cache[name, window]

    return get


# The C++ CPU kernels must build where a compiler is (as in tests/test_cpu_attention.py),
# so a build failure fails these tests instead of skipping them.
BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["llama3", "qwen3", "mistral", "gemma3"])
def test_family_matches_transformers(family: str, backend: str, reference, prompt: list[int]) -> None:
    folder, expected = reference(family)
    ours = engine_greedy(folder, prompt, NUM_NEW, backend, MAX_MODEL_LEN)
    assert_same_greedy(ours, expected)
    assert len(set(expected.token_ids)) > 4, "a degenerate run (one token repeated) checks little"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sliding_window_matches_transformers(family: str, backend: str, reference, prompt: list[int]) -> None:
    """A window shorter than the run: the engine attends within it, as transformers."""
    folder, expected = reference(family, WINDOW)
    assert_same_greedy(engine_greedy(folder, prompt, NUM_NEW, backend, MAX_MODEL_LEN), expected)


def test_unsupported_model_type_lists_supported(tmp_path: Path) -> None:
    from worker.llm import LLM

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral_xl", **COMMON,
                                                      "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="'mixtral_xl' is not supported") as err:
        LLM(model=str(tmp_path), dtype="float32", device="cpu")
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)
    assert "gemma3_text" in SUPPORTED_ARCHITECTURES and "qwen3" in SUPPORTED_ARCHITECTURES


@pytest.mark.parametrize(("extra", "match"), [
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "llama", "hidden_act": "relu"}, "activation 'relu'"),
])
def test_unimplemented_options_are_refused(extra: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**COMMON, "num_hidden_layers": 2, **extra})


def test_gemma3_config_of_transformers_4() -> None:
    """The 4.x layout (``sliding_window_pattern``, ``rope_local_base_freq``, top-level
    ``rope_scaling``) as Gemma 3 checkpoints ship it gives the same layers and rotaries."""
    cfg = ModelConfig.from_hf({**COMMON, "model_type": "gemma3_text", "num_hidden_layers": 12, "head_dim": 64,
                               "sliding_window": 1024, "sliding_window_pattern": 6, "rope_theta": 1e6,
                               "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 256,
                               "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert [cfg.layer_window(i) for i in range(12)] == ([1024] * 5 + [None]) * 2
    assert cfg.uniform_sliding_window is None and cfg.rope_local_theta == 1e4 and cfg.rope_theta == 1e6
    assert dict(cfg.rope_scaling) == {"rope_type": "linear", "factor": 8.0}
    assert cfg.attn_scale == 256 ** -0.5 and cfg.embed_scale == 256 ** 0.5 and cfg.tie_word_embeddings
    mistral = ModelConfig.from_hf({**COMMON, "model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 64})
    assert mistral.uniform_sliding_window == 64


def test_backend_without_window_is_refused() -> None:
    """A backend whose call takes no ``sliding_window`` (as before issue 16) is refused for
    a model whose window can cut, and accepted where it cannot."""
    from worker.models.attention import TorchAttentionBackend
    from worker.models.loader import build_model

    class NoWindowBackend(TorchAttentionBackend):
        def __call__(self, q, k, v, k_cache, v_cache, meta, scale):  # type: ignore[override]
            return super().__call__(q, k, v, k_cache, v_cache, meta, scale)

    cfg = ModelConfig.from_hf({**COMMON, "model_type": "mistral", "num_hidden_layers": 2, "sliding_window": WINDOW})
    model = build_model(cfg, None, True, torch.float32, torch.device("cpu"), MAX_MODEL_LEN)
    with pytest.raises(ValueError, match=rf"mistral: sliding_window {WINDOW} is shorter than max_model_len "
                                         rf"{MAX_MODEL_LEN}, and the torch attention backend"):
        model.check_backend(NoWindowBackend())
    model.check_backend(TorchAttentionBackend())
    build_model(cfg, None, True, torch.float32, torch.device("cpu"), WINDOW).check_backend(NoWindowBackend())


@pytest.mark.parametrize(("name", "num_params"), [("Qwen3-8B", 8.19e9), ("Gemma-3-12B", 11.77e9)])
def test_dummy_configs_of_new_families(name: str, num_params: float) -> None:
    """The real shapes for ``--load-format dummy`` parse, with the parameter counts of the
    published models (Gemma 3 12B: its text model), and dummy weights give Gemma's
    ``1 + weight`` norms a scale of 1."""
    from shared.model_source import DUMMY_CONFIGS
    from worker.models.llama import RMSNorm
    from worker.models.loader import build_model

    cfg = ModelConfig.from_hf(DUMMY_CONFIGS[name])
    assert cfg.num_params == pytest.approx(num_params, rel=0.01)
    tiny = ModelConfig.from_hf({**DUMMY_CONFIGS[name], **COMMON, "num_hidden_layers": 2, "num_key_value_heads": 2,
                                "head_dim": 64})
    model = build_model(tiny, None, True, torch.float32, torch.device("cpu"), MAX_MODEL_LEN)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(bool(((m.offset + m.weight) == 1.0).all()) for m in norms)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama3", "qwen3", "mistral", "gemma3"])
def test_family_on_cuda_triton(family: str, reference, prompt: list[int]) -> None:
    """The Triton path (fused ops, window in the kernel): float32 eager within 1e-3 of
    transformers' float32 logits (Triton's float32 dots may round through TF32) with the
    same tokens, and the same tokens through the CUDA graphs; bfloat16 logits within
    ``BF16_ATOL`` at the steps whose prefix equals transformers' (up to the first token
    that differs)."""
    folder, expected = reference(family, WINDOW if family in ("mistral", "gemma3") else None)
    eager = engine_greedy(folder, prompt, NUM_NEW, "triton", MAX_MODEL_LEN, "cuda", enforce_eager=True)
    assert_same_greedy(eager, expected, atol=1e-3)
    graphs = engine_greedy(folder, prompt, NUM_NEW, "triton", MAX_MODEL_LEN, "cuda")
    assert graphs.token_ids == expected.token_ids
    bf16 = engine_greedy(folder, prompt, NUM_NEW, "triton", MAX_MODEL_LEN, "cuda", "bfloat16", enforce_eager=True)
    # Steps up to the first token that differs share their prefix with transformers' run.
    same = next((i for i, (a, b) in enumerate(zip(bf16.token_ids, expected.token_ids)) if a != b), NUM_NEW - 1)
    diff = (bf16.logits[:same + 1] - expected.logits[:same + 1]).abs().amax()
    print(f"{family}: bfloat16 tokens equal up to step {same}, max |logit diff| {float(diff):.3g}")
    assert float(diff) <= BF16_ATOL
