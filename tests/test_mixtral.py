"""Mixtral on CPU (float32) against transformers' own classes: the MoE block against
``MixtralSparseMoeBlock`` with the same weights, and a tiny random ``MixtralForCausalLM``
saved with ``save_pretrained`` (its checkpoint names: ``block_sparse_moe.experts.{e}.w1/w2/w3``,
``block_sparse_moe.gate``) and run by our engine, whose logits must be transformers'
within 1e-4 at the prefill and every step of a 64-token greedy run, with the same tokens
(harness: ``tests/model_oracle.py``), with full attention and with a sliding window
shorter than the run. Also the config's fields and parameter counts against transformers',
the loader's other layout (transformers' stacked experts) and a missing expert, the
Mixtral-8x7B dummy config, and a config that asks for more experts per token than it has."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from shared.model_source import DUMMY_CONFIGS
from tests.model_oracle import Greedy, assert_same_greedy, engine_greedy, hf_greedy, save_random_model
from tests.test_moe import spread_routers
from worker.models.config import SLIDING_ATTENTION, ModelConfig
from worker.models.llama import LlamaForCausalLM
from worker.models.loader import WeightLoadError, build_model
from worker.models.moe import SparseMoeBlock

pytestmark = pytest.mark.timeout(300)

NEW_TOKENS = 64
MAX_MODEL_LEN = 256
WINDOW = 16  # shorter than the 84-token run: the window cuts in after 16 tokens
PROMPT = [7, 300, 41, 99, 12, 5, 250, 77, 3, 18, 400, 61, 2, 90, 33, 128, 256, 11, 500, 9]


def tiny_config(**overrides) -> MixtralConfig:
    """2 layers, 8 experts top-2 (Mixtral's routing), GQA 4/2, head_dim 64, untied."""
    kw = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": 8,
          "num_experts_per_tok": 2, "max_position_embeddings": MAX_MODEL_LEN, "initializer_range": 0.05,
          "tie_word_embeddings": False}
    return MixtralConfig(**{**kw, **overrides})


def config_of(hf_cfg: MixtralConfig) -> ModelConfig:
    return ModelConfig.from_hf(json.loads(hf_cfg.to_json_string()))


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (4, 3)])
def test_block_matches_hf(num_experts: int, top_k: int) -> None:
    torch.manual_seed(0)
    cfg = tiny_config(num_local_experts=num_experts, num_experts_per_tok=top_k)
    hf = MixtralSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1)
    block = SparseMoeBlock(config_of(cfg))
    with torch.no_grad():
        block.gate.weight.copy_(hf.gate.weight)
        block.w13.copy_(hf.experts.gate_up_proj)
        block.w2.copy_(hf.experts.down_proj)
    x = torch.randn(37, cfg.hidden_size)
    with torch.no_grad():
        want = hf(x[None])[0]
        got, got_fused = block(x), block(x, fused=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_fused, want, atol=1e-5, rtol=1e-5)


def test_config_fields_and_param_counts_match_hf() -> None:
    hf_cfg = tiny_config(sliding_window=WINDOW)
    ours = config_of(hf_cfg)
    assert ours.model_type == "mixtral" and (ours.num_experts, ours.num_experts_per_tok) == (8, 2)
    assert ours.norm_topk_prob and ours.moe_intermediate_size == hf_cfg.intermediate_size
    assert all(ours.is_moe_layer(n) for n in range(ours.num_layers))
    assert ours.layer_types == (SLIDING_ATTENTION,) * 2 and ours.uniform_sliding_window == WINDOW
    assert ours.rope_theta == 1_000_000.0  # Mixtral's default base, from transformers 5.x's rope_parameters
    assert config_of(tiny_config()).uniform_sliding_window is None  # sliding_window null: full attention
    hf = MixtralForCausalLM(hf_cfg)
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in LlamaForCausalLM(ours, 64).layers)
    assert ours.num_params == sum(p.numel() for p in hf.parameters())
    unused = (8 - 2) * 3 * hf_cfg.hidden_size * hf_cfg.intermediate_size * hf_cfg.num_hidden_layers
    assert ours.num_active_params == ours.num_params - unused


def test_mixtral_8x7b_dummy_config() -> None:
    cfg = ModelConfig.from_hf(DUMMY_CONFIGS["Mixtral-8x7B"])
    assert cfg.model_type == "mixtral" and (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    assert cfg.uniform_sliding_window is None and all(cfg.is_moe_layer(n) for n in range(cfg.num_layers))
    assert cfg.num_params == pytest.approx(46.7e9, rel=0.005)  # the published 46.7B
    assert cfg.num_active_params == pytest.approx(12.9e9, rel=0.005)  # and 12.9B per token


def test_more_experts_per_token_than_experts_is_refused() -> None:
    with pytest.raises(ValueError, match=r"mixtral: num_experts_per_tok 9 must be between 1 and "
                                         r"num_local_experts \(8\)"):
        config_of(tiny_config(num_experts_per_tok=9))


# ---- the tiny model, saved by transformers and loaded by us --------------------------------

@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """``reference(window) -> (folder, transformers' greedy run)`` of a tiny random
    MixtralForCausalLM, built once per window."""
    cache: dict[int | None, tuple[Path, Greedy]] = {}

    def get(window: int | None) -> tuple[Path, Greedy]:
        if window not in cache:
            folder = tmp_path_factory.mktemp(f"mixtral-{window}")
            hf = save_random_model(MixtralForCausalLM, tiny_config(sliding_window=window), folder)
            spread_routers(hf)
            hf.save_pretrained(folder)
            cache[window] = folder, hf_greedy(hf, PROMPT, NEW_TOKENS)
        return cache[window]

    return get


# The C++ CPU kernels must build where a compiler is (as in tests/test_model_families.py).
BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler"))]


def test_checkpoint_uses_mixtral_names(reference) -> None:
    folder, _ = reference(None)
    names = set(load_file(next(folder.glob("*.safetensors"))))
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any(".mlp." in n for n in names)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "sliding"])
def test_logits_match_hf_each_step(reference, window: int | None, backend: str) -> None:
    """The whole engine (scheduler, paged cache, the attention backend) on the saved
    folder: transformers' logits within 1e-4 at the prefill and every decode step, same
    tokens; with the window, attention within it as transformers' sliding mask."""
    folder, expected = reference(window)
    assert_same_greedy(engine_greedy(folder, PROMPT, NEW_TOKENS, backend, MAX_MODEL_LEN), expected)
    assert len(set(expected.token_ids)) > 4, "a degenerate run (one token repeated) checks little"


def test_loader_takes_stacked_experts_and_refuses_missing_ones(reference, tmp_path) -> None:
    folder, _ = reference(None)
    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    tensors = load_file(next(folder.glob("*.safetensors")))
    cpu = torch.device("cpu")
    ref = build_model(cfg, folder, dummy=False, dtype=torch.float32, device=cpu, max_positions=64)
    # transformers 5.x's in-memory layout: the block named mlp, one [E, 2I, H] and one [E, H, I] tensor.
    stacked = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(cfg.num_layers):
        pre = f"model.layers.{layer}.block_sparse_moe.experts"
        stacked[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([tensors[f"{pre}.{e}.w1.weight"], tensors[f"{pre}.{e}.w3.weight"]])
            for e in range(cfg.num_experts)])
        stacked[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [tensors[f"{pre}.{e}.w2.weight"] for e in range(cfg.num_experts)])
    (tmp_path / "stacked").mkdir()
    save_file(stacked, str(tmp_path / "stacked" / "model.safetensors"))
    model = build_model(cfg, tmp_path / "stacked", dummy=False, dtype=torch.float32, device=cpu, max_positions=64)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    # One expert's up projection (w3) left out: refused at load, not run with garbage.
    (tmp_path / "missing").mkdir()
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.block_sparse_moe.experts.5.w3.weight"},
              str(tmp_path / "missing" / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="layers.1.mlp.w13"):
        build_model(cfg, tmp_path / "missing", dummy=False, dtype=torch.float32, device=cpu, max_positions=64)
