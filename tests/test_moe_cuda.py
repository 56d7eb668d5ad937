"""The Triton fused MoE kernel (``kernels/fused_moe.py``) on CUDA against its PyTorch
reference: bfloat16 and float32, decode and prefill sizes, Qwen3-MoE's real expert shape
(128 experts, top-8) and a small one (8, top-2); inside a CUDA graph; and a tiny
transformers Qwen3-MoE model served end to end by the engine on the Triton backend (CUDA
graphs on) against the PyTorch reference backend."""

from __future__ import annotations

import gc

import pytest
import torch

from kernels.fused_moe import ALIGN_MAX_PAIRS, fused_moe_ref, fused_moe_triton, moe_align_ref, moe_align_triton
from worker.models.moe import select_experts

pytestmark = pytest.mark.cuda

BLOCK_SIZE = 16
# (hidden, moe_intermediate, num_experts, top_k)
SHAPES = {"e8_top2": (512, 256, 8, 2), "qwen3_30b_a3b": (2048, 768, 128, 8)}


def _inputs(num_tokens: int, shape: tuple[int, int, int, int], dtype: torch.dtype, seed: int = 0):
    h, i, e, k = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, h, device="cuda", generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * i ** -0.5).to(dtype)
    logits = torch.randn(num_tokens, e, device="cuda", generator=gen).to(dtype)
    weights, ids = select_experts(logits, k, renormalize=True)
    return x, w13, w2, weights, ids


def step_logits(model, caches, backend, tokens: list[int], start: int) -> torch.Tensor:
    """Run ``tokens`` at positions ``start..`` of one sequence whose blocks are ``0, 1, ...``
    straight through the model (no engine); returns the logits ``[vocab]`` of the last."""
    from worker.engine.model_runner import slot
    from worker.models.attention import AttentionMetadata

    n, total = len(tokens), start + len(tokens)
    table = list(range(-(-total // BLOCK_SIZE)))
    dev = model.embed_tokens.weight.device
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slot(table, p, BLOCK_SIZE) for p in range(start, total)], device=dev),
        block_tables=torch.tensor([table], dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([total], dtype=torch.int32, device=dev),
        max_query_len=n, max_seq_len=total, query_lens_cpu=[n], seq_lens_cpu=[total], has_padding=False)
    hidden = model(torch.tensor(tokens, device=dev), torch.arange(start, total, device=dev), caches, meta, backend)
    return model.compute_logits(hidden[-1:])[0]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [
    (1, 8, 2, 16), (1, 128, 8, 16), (37, 8, 2, 16), (64, 128, 8, 16), (256, 128, 8, 64), (300, 16, 4, 64),
    (3, 1, 1, 16), (ALIGN_MAX_PAIRS // 8, 128, 8, 64)])
def test_align_kernel_equals_reference(num_tokens: int, num_experts: int, top_k: int, block_m: int) -> None:
    """The one-program Triton alignment gives the PyTorch ops' result bit for bit."""
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).cuda()
    for got, want in zip(moe_align_triton(ids, num_experts, block_m), moe_align_ref(ids, num_experts, block_m),
                         strict=True):
        assert torch.equal(got, want)


# 1024 tokens of the top-8 shape are past ALIGN_MAX_PAIRS: the PyTorch alignment's path.
@pytest.mark.parametrize("num_tokens", [1, 3, 64, 256, 1024])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernel_matches_reference(num_tokens: int, shape: str, dtype: torch.dtype) -> None:
    x, w13, w2, weights, ids = _inputs(num_tokens, SHAPES[shape], dtype)
    got = fused_moe_triton(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    # The oracle: the reference in float32 on the same (rounded) inputs.
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights.float(), ids)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    err = (got.float() - want).abs().amax().item()
    assert err <= tol * want.abs().amax().item(), err


def test_kernel_in_a_cuda_graph() -> None:
    """Captured once, replayed on other inputs and routings (a new expert set each time)."""
    shape = SHAPES["qwen3_30b_a3b"]
    x, w13, w2, weights, ids = _inputs(8, shape, torch.bfloat16)
    fused_moe_triton(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, w13, w2, weights, ids)
    for seed in (1, 2, 3):
        x2, _, _, weights2, ids2 = _inputs(8, shape, torch.bfloat16, seed=seed)
        x.copy_(x2)
        weights.copy_(weights2)
        ids.copy_(ids2)
        graph.replay()
        torch.testing.assert_close(out, fused_moe_triton(x, w13, w2, weights, ids), atol=0, rtol=0)


@pytest.fixture(scope="module")
def tiny_moe_folder(tmp_path_factory):
    from transformers import Qwen3MoeForCausalLM

    from tests.test_moe import spread_routers, tiny_config

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(tiny_config(max_position_embeddings=1024))
    spread_routers(hf)
    folder = tmp_path_factory.mktemp("qwen3moe_cuda")
    hf.save_pretrained(folder)
    return folder


def _greedy(folder, backend: str, dtype: str) -> list[list[int]]:
    from shared.sampling import SamplingParams
    from worker.llm import LLM

    llm = LLM(model=str(folder), dtype=dtype, device="cuda", attention_backend=backend, num_kv_blocks=256,
              max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024)
    prompts = [[(7 * n + 3 * j) % 500 for j in range(n)] for n in (3, 17, 40, 90)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.token_ids for o in outs]


def test_engine_triton_matches_reference_float32(tiny_moe_folder) -> None:
    """The whole model on the Triton backend (fused MoE, CUDA graphs, chunked prefill)
    against the PyTorch reference backend (the reference MoE), float32: token for token."""
    assert _greedy(tiny_moe_folder, "triton", "float32") == _greedy(tiny_moe_folder, "torch", "float32")


def test_model_bf16_logits_triton_vs_reference(tiny_moe_folder) -> None:
    """bfloat16, teacher-forced (the same tokens fed to both, so one flipped near-tie does
    not change what the later steps compare): the model's logits on the Triton backend
    (fused MoE kernel) against the reference backend, prefill and 32 decode steps. Greedy
    runs are not compared in bf16: a rounding difference can flip a router's top-k or a
    near-tie token and every later token with it."""
    import json

    from tests.test_moe import PROMPT
    from worker.engine.model_runner import allocate_kv_cache
    from worker.models.attention import TorchAttentionBackend, TritonAttentionBackend
    from worker.models.config import ModelConfig
    from worker.models.loader import build_model

    cfg = ModelConfig.from_hf(json.loads((tiny_moe_folder / "config.json").read_text()))
    dev = torch.device("cuda")
    model = build_model(cfg, tiny_moe_folder, dummy=False, dtype=torch.bfloat16, device=dev, max_positions=256)
    runs = {}
    with torch.inference_mode():
        for name, backend in (("ref", TorchAttentionBackend()), ("triton", TritonAttentionBackend())):
            caches = allocate_kv_cache(cfg, 8, BLOCK_SIZE, torch.bfloat16, dev)
            logits = [step_logits(model, caches, backend, PROMPT, 0)]
            for k in range(32):
                tok = int(runs["ref"][k].argmax()) if "ref" in runs else int(logits[-1].argmax())
                logits.append(step_logits(model, caches, backend, [tok], len(PROMPT) + k))
            runs[name] = torch.stack(logits)
    ref, tri = runs["ref"], runs["triton"]
    err = (tri - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1)
    assert err.max().item() < 0.05, err.tolist()
    assert (tri.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
