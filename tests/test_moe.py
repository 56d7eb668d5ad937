"""Qwen3-MoE on CPU (float32) against transformers' own classes: the MoE block against
``Qwen3MoeSparseMoeBlock`` with the same weights, and a tiny random ``Qwen3MoeForCausalLM``
saved with ``save_pretrained`` and run by our engine, whose logits must be transformers'
within 1e-4 at the prefill and every step of a 64-token greedy run, with the same tokens
(harness: ``tests/model_oracle.py``). Also the loader's two checkpoint layouts, the
expert alignment of the Triton kernel (``kernels/fused_moe.moe_align_ref``, plain PyTorch
ops), the parameter counts and the Qwen3-30B-A3B dummy config. The Triton kernel itself:
``tests/test_moe_cuda.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from kernels.fused_moe import fused_moe, fused_moe_ref, moe_align_ref
from shared.model_source import DUMMY_CONFIGS
from tests.model_oracle import Greedy, assert_same_greedy, engine_greedy, hf_greedy, save_random_model
from worker.models.config import ModelConfig
from worker.models.llama import MLP, LlamaForCausalLM
from worker.models.loader import WeightLoadError, build_model
from worker.models.moe import SparseMoeBlock

NEW_TOKENS = 64
PROMPT = [7, 300, 41, 99, 12, 5, 250, 77, 3, 18, 400, 61, 2, 90, 33, 128, 256, 11, 500, 9]


def tiny_config(**overrides) -> Qwen3MoeConfig:
    """2 MoE layers around one dense one, 8 experts top-2, GQA 4/2, head_dim 64."""
    kw = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 192, "moe_intermediate_size": 64,
          "num_hidden_layers": 3, "mlp_only_layers": [1], "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
          "max_position_embeddings": 256, "initializer_range": 0.05, "tie_word_embeddings": False}
    return Qwen3MoeConfig(**{**kw, **overrides})


def spread_routers(model: torch.nn.Module, seed: int = 1) -> None:
    """Router weights large enough that top-k picks are not near-ties (trained routers
    are decisive; at init scale a rounding difference could swap two experts)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def our_block(hf_cfg: Qwen3MoeConfig, hf_block: Qwen3MoeSparseMoeBlock) -> SparseMoeBlock:
    block = SparseMoeBlock(ModelConfig.from_hf(hf_cfg.to_dict()))
    with torch.no_grad():
        block.gate.weight.copy_(hf_block.gate.weight)
        block.w13.copy_(hf_block.experts.gate_up_proj)
        block.w2.copy_(hf_block.experts.down_proj)
    return block


@pytest.mark.parametrize("num_experts,top_k,norm", [(8, 2, True), (8, 2, False), (16, 4, True)])
def test_block_matches_hf(num_experts: int, top_k: int, norm: bool) -> None:
    torch.manual_seed(0)
    cfg = tiny_config(num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=norm)
    hf = Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1)
    block = our_block(cfg, hf)
    x = torch.randn(37, cfg.hidden_size)
    with torch.no_grad():
        want = hf(x[None])[0]
        got, got_fused = block(x), block(x, fused=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_fused, want, atol=1e-5, rtol=1e-5)


def test_reference_checks_shapes() -> None:
    x, w13, w2 = torch.randn(3, 16), torch.randn(4, 8, 16), torch.randn(4, 16, 4)
    ids = torch.tensor([[0, 1], [2, 3], [3, 0]])
    weights = torch.rand(3, 2)
    assert fused_moe(x, w13, w2, weights, ids).shape == (3, 16)
    with pytest.raises(ValueError, match="w2 must be"):
        fused_moe_ref(x, w13, w2[:, :, :3], weights, ids)
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        fused_moe_ref(x, w13, w2, weights[:2], ids)
    with pytest.raises(ValueError, match="share a dtype"):
        fused_moe_ref(x.double(), w13, w2, weights, ids)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(1, 8, 2, 16), (1, 128, 8, 16), (37, 8, 2, 16),
                                                                   (256, 128, 8, 64), (5, 4, 4, 16)])
def test_moe_align_groups_pairs_by_expert(num_tokens: int, num_experts: int, top_k: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    sorted_pairs, block_experts = moe_align_ref(ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    assert sorted_pairs.numel() == block_experts.numel() * block_m
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair once
    assert (sorted_pairs[sorted_pairs >= num_pairs] == num_pairs).all()  # padding is the sentinel
    flat = ids.reshape(-1)
    for b, e in enumerate(block_experts.tolist()):
        rows = sorted_pairs[b * block_m:(b + 1) * block_m]
        rows = rows[rows < num_pairs]
        if e == num_experts:  # past the padded end: no pair may be left there
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and (flat[rows.long()] == e).all()
            assert torch.equal(rows, rows.sort().values)


def test_moe_layers_and_param_counts_match_hf() -> None:
    cfg = tiny_config(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    hf = Qwen3MoeForCausalLM(cfg)
    ours = ModelConfig.from_hf(json.loads(cfg.to_json_string()))
    hf_sparse = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers]
    assert hf_sparse == [False, True, False, False]
    assert [ours.is_moe_layer(n) for n in range(4)] == hf_sparse
    model = LlamaForCausalLM(ours, 64)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == hf_sparse
    assert all(isinstance(layer.mlp, MLP) for layer, s in zip(model.layers, hf_sparse) if not s)
    assert ours.num_params == sum(p.numel() for p in hf.parameters())
    unused = (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert ours.num_active_params == ours.num_params - unused


def test_qwen3_30b_a3b_dummy_config() -> None:
    cfg = ModelConfig.from_hf({"model_type": "llama", **DUMMY_CONFIGS["Qwen3-30B-A3B"]})
    assert cfg.model_type == "qwen3_moe" and cfg.qk_norm and cfg.num_experts == 128
    assert all(cfg.is_moe_layer(n) for n in range(cfg.num_layers))
    assert 30.0e9 < cfg.num_params < 31.0e9  # "30B"
    assert 3.0e9 < cfg.num_active_params < 3.5e9  # "A3B"


# ---- the tiny model, saved by transformers and loaded by us --------------------------------

@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> tuple[Path, Greedy]:
    """``(folder, transformers' greedy run)`` of a tiny random Qwen3MoeForCausalLM."""
    folder = tmp_path_factory.mktemp("qwen3moe")
    hf = save_random_model(Qwen3MoeForCausalLM, tiny_config(), folder)
    spread_routers(hf)
    hf.save_pretrained(folder)
    return folder, hf_greedy(hf, PROMPT, NEW_TOKENS)


def test_logits_match_hf_each_step(hf_folder) -> None:
    """The whole engine (scheduler, paged cache, reference backend) on the saved folder:
    transformers' logits within 1e-4 at the prefill and every decode step, same tokens."""
    folder, expected = hf_folder
    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert cfg.model_type == "qwen3_moe" and cfg.num_experts == 8 and cfg.norm_topk_prob
    assert_same_greedy(engine_greedy(folder, PROMPT, NEW_TOKENS, "torch", 256), expected)
    assert len(set(expected.token_ids)) > 4, "a degenerate run (one token repeated) checks little"


def test_loader_takes_stacked_experts_and_refuses_missing_ones(hf_folder, tmp_path) -> None:
    folder, _ = hf_folder
    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    (weights_file,) = folder.glob("*.safetensors")
    tensors = load_file(weights_file)
    ref = build_model(cfg, folder, dummy=False, dtype=torch.float32, device=torch.device("cpu"), max_positions=64)
    # transformers' in-memory layout: one [E, 2I, H] and one [E, H, I] tensor per layer.
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in (0, 2):
        pre = f"model.layers.{layer}.mlp.experts"
        stacked[f"{pre}.gate_up_proj"] = torch.stack([
            torch.cat([tensors[f"{pre}.{e}.gate_proj.weight"], tensors[f"{pre}.{e}.up_proj.weight"]])
            for e in range(cfg.num_experts)])
        stacked[f"{pre}.down_proj"] = torch.stack([tensors[f"{pre}.{e}.down_proj.weight"]
                                                   for e in range(cfg.num_experts)])
    (tmp_path / "stacked").mkdir()
    save_file(stacked, str(tmp_path / "stacked" / "model.safetensors"))
    model = build_model(cfg, tmp_path / "stacked", dummy=False, dtype=torch.float32, device=torch.device("cpu"),
                        max_positions=64)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    # One expert's up projection left out: refused at load, not run with garbage.
    (tmp_path / "missing").mkdir()
    save_file({k: v for k, v in tensors.items() if k != "model.layers.2.mlp.experts.5.up_proj.weight"},
              str(tmp_path / "missing" / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="layers.2.mlp.w13"):
        build_model(cfg, tmp_path / "missing", dummy=False, dtype=torch.float32, device=torch.device("cpu"),
                    max_positions=64)
