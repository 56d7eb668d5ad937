"""FP8 weights on CUDA (``worker/models/fp8.py``, ``kernels/fp8_quant.py``,
``kernels/fp8_gemv.py``): the Triton row quantizer, the weight-streaming GEMV and
``torch._scaled_mm`` (per channel and 128x128 blocks) against their PyTorch references,
capture into a CUDA graph, and the engine with ``quantization="fp8"``: graphs (with async scheduling
and prefix caching) against eager, and its logits against the unquantized model and
against the dequantized reference."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kernels.fp8_gemv as fp8_gemv_module
from kernels.fp8_gemv import PLANS, LaunchConfig, block_rows, fp8_gemv, fp8_gemv_ref, plan
from kernels.fp8_quant import quantize_groups, quantize_groups_ref, quantize_rows, quantize_rows_ref
from kernels.fused_add_rms_norm import fused_add_rms_norm, fused_add_rms_norm_fp8
from kernels.silu_and_mul import silu_and_mul, silu_and_mul_fp8
from shared.model_source import DUMMY_CONFIGS
from shared.sampling import SamplingParams
from worker.llm import LLM
from worker.models.fp8 import (
    BLOCK_SCALED_MM_K,
    GEMV_MAX_ROWS,
    W8A8_MAX_ROWS,
    W8A8_MIN_ROWS,
    fp8_linear,
    fp8_linear_ref,
    quantize_weight,
    takes_group_quantized_input,
)
from worker.models.loader import fp8_linears

pytestmark = pytest.mark.cuda
MODEL = "SmolLM2-135M"  # dummy weights: 30 layers, every projection's dims multiples of 16


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("cols", [576, 18944])
def test_quantize_rows_kernel_matches_reference(rows: int, cols: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * torch.logspace(-2, 2, rows, device="cuda")[:, None]
    q, scale = quantize_rows(x)
    q_ref, scale_ref = quantize_rows_ref(x)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    assert torch.equal(q.float(), q_ref.float())


@pytest.mark.parametrize(("rows", "cols", "pad_rows_to", "column_major"),
                         [(33, 1024, 1, False), (33, 1024, 16, True), (64, 18944, 16, True), (1, 3584, 16, True),
                          (300, 2304, 16, False)])
def test_quantize_groups_kernel_matches_reference(rows: int, cols: int, pad_rows_to: int, column_major: bool) -> None:
    """The group kernel, bit for bit the reference: padded rows (zeros) and column-major
    scales included, and a row of zeros; more groups than one program takes."""
    torch.manual_seed(0)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * torch.logspace(-2, 2, cols, device="cuda")
    x[rows // 2] = 0
    q, scale = quantize_groups(x, pad_rows_to=pad_rows_to, scales_column_major=column_major)
    q_ref, scale_ref = quantize_groups_ref(x, pad_rows_to=pad_rows_to, scales_column_major=column_major)
    assert scale.shape == (rows + -rows % pad_rows_to, cols // 128) and q.shape == (scale.shape[0], cols)
    assert scale.stride() == scale_ref.stride() == ((1, scale.shape[0]) if column_major else (cols // 128, 1))
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    assert torch.equal(q.float(), q_ref.float())


@pytest.mark.parametrize("rows", [1, 33, 300])
def test_silu_and_mul_fp8_is_the_two_kernels_in_turn(rows: int) -> None:
    """The fused SwiGLU + group quantization, bit for bit ``silu_and_mul`` then
    ``quantize_groups`` (padded rows and column-major scales as ``_scaled_mm`` takes them)."""
    torch.manual_seed(0)
    x = torch.randn(rows, 2 * 2304, device="cuda", dtype=torch.bfloat16) * 3
    q, scale = silu_and_mul_fp8(x, pad_rows_to=16)
    q2, scale2 = quantize_groups(silu_and_mul(x), pad_rows_to=16, scales_column_major=True)
    assert q.shape == q2.shape == (rows + -rows % 16, 2304) and scale.stride() == scale2.stride()
    torch.testing.assert_close(scale, scale2, rtol=0, atol=0)
    assert torch.equal(q.float(), q2.float())


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize(("rows", "hidden", "pad_rows_to"), [(1, 3584, 1), (33, 3584, 1), (300, 3584, 16),
                                                           (5, 640, 16)])
def test_fused_add_rms_norm_fp8_is_the_two_kernels_in_turn(rows: int, hidden: int, pad_rows_to: int,
                                                           residual: bool) -> None:
    """The residual add + RMSNorm with its output group-quantized in one launch, bit for
    bit ``fused_add_rms_norm`` then ``quantize_groups`` (padded rows, column-major
    scales), the residual stream too."""
    torch.manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16) * 3
    res = torch.randn_like(x) if residual else None
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    q, scale, res_out = fused_add_rms_norm_fp8(x, res, weight, 1e-6, pad_rows_to=pad_rows_to)
    out2, res_out2 = fused_add_rms_norm(x, res, weight, 1e-6)
    q2, scale2 = quantize_groups(out2, pad_rows_to=pad_rows_to, scales_column_major=True)
    assert q.shape == q2.shape == (rows + -rows % pad_rows_to, hidden) and scale.stride() == scale2.stride()
    torch.testing.assert_close(scale, scale2, rtol=0, atol=0)
    assert torch.equal(q.float(), q2.float())
    assert torch.equal(res_out, res_out2)


@pytest.mark.parametrize("rows", [17, 32, 33, 64])
@pytest.mark.parametrize("swap_ab", [False, True])
def test_w8a8_gemv_matches_the_dequantized_product(rows: int, swap_ab: bool) -> None:
    """The kernel on E4M3 input (``x_scale``): the product of the dequantized input and
    weight, split-K (K 8,192) and with a bias, in both orientations."""
    torch.manual_seed(0)
    n, k = 512, 8192
    w, w_scale = quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, "block")
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * torch.logspace(-1, 1, k, device="cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    q, scale = quantize_groups(x)
    p = plan(rows, n, k, torch.cuda.get_device_properties(0).multi_processor_count,
             LaunchConfig(block_n=128, swap_ab=swap_ab))
    assert p.split > 1
    out = fp8_gemv(q, w, w_scale, bias, gemv_plan=p, x_scale=scale)
    x_deq = q.float() * scale.repeat_interleave(128, 1)
    ref = fp8_gemv_ref(x_deq, w, w_scale, bias.float()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    with pytest.raises(ValueError, match="x_scale"):
        fp8_gemv(x, w, w_scale, x_scale=scale)  # a bfloat16 x with a scale


def test_down_projection_quantizes_as_it_computes_its_input() -> None:
    """An FP8 ``block`` down projection of ``W8A8_MIN_ROWS`` rows or more takes its input
    from ``silu_and_mul_fp8``: exactly what the unfused path gives; below, the bf16 GEMV."""
    from worker.models.linear import Linear

    torch.manual_seed(0)
    down = Linear(BLOCK_SCALED_MM_K, 128, bias=True).to("cuda", torch.bfloat16)  # _scaled_mm's K above 64 rows
    down.to_fp8("block")
    for rows in (W8A8_MIN_ROWS - 1, W8A8_MIN_ROWS, GEMV_MAX_ROWS + 1, 100):
        gate_up = torch.randn(rows, 2 * BLOCK_SCALED_MM_K, device="cuda", dtype=torch.bfloat16)
        assert takes_group_quantized_input(rows, down.weight, down.weight_scale) == (rows >= W8A8_MIN_ROWS)
        torch.testing.assert_close(down.forward_silu_and_mul(gate_up), down(silu_and_mul(gate_up)), rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["block", "channel"])
@pytest.mark.parametrize("rows", [24, 33, 64, 65, 333])
def test_scaled_mm_matches_reference(rows: int, scheme: str) -> None:
    """Above ``GEMV_MAX_ROWS`` rows ``_scaled_mm`` (row-wise, or 1x128 x 128x128 blocks
    with the rows padded to 16), and for ``block`` weights from ``W8A8_MIN_ROWS`` to
    ``W8A8_MAX_ROWS`` rows the W8A8 kernel, accumulate the same FP8 products in float32 as
    the reference: only the bf16 rounding of the output (2^-9 relative) and the summation
    order differ."""
    if scheme == "channel" and rows <= GEMV_MAX_ROWS:
        pytest.skip("channel weights take the bf16-input kernel here (test_fp8_gemv_matches_reference)")
    torch.manual_seed(0)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    w, w_scale = quantize_weight(torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16) * 0.02, scheme)
    bias = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    out, ref = fp8_linear(x, w, w_scale, bias), fp8_linear_ref(x, w, w_scale, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 1024)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))


@pytest.mark.parametrize("rows", [40, 100, 300])
@pytest.mark.parametrize("k", [256, 768, 1792, 9472, 3584])
def test_block_products_match_reference_at_every_k(k: int, rows: int) -> None:
    """128x128-block weights whose K is not a multiple of ``BLOCK_SCALED_MM_K`` (cuBLASLt's
    block-scaled GEMM sums them wrongly: at K 256 the product was off by 20x, at 1792 by
    10%; a row-parallel shard at TP=2 has such K) and one whose K is (3584), at rows that
    take each path: the W8A8 kernel (40), and above ``W8A8_MAX_ROWS`` ``_scaled_mm`` or the
    dequantized weight, each on the input rounded per 1x128 group as the reference rounds
    it: within 1% of it (unrounded input was 2.6% off, a wrong sum 7% or more)."""
    torch.manual_seed(k + rows)
    w, w_scale = quantize_weight(torch.randn(1024, k, device="cuda", dtype=torch.bfloat16) * 0.02, "block")
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out, ref = fp8_linear(x, w, w_scale).float(), fp8_linear_ref(x.float(), w, w_scale).float()
    assert float((out - ref).norm() / ref.norm()) < 0.01
    assert takes_group_quantized_input(rows, w, w_scale) == (rows <= W8A8_MAX_ROWS or k % BLOCK_SCALED_MM_K == 0)


@pytest.mark.parametrize("scheme", ["block", "channel"])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64])
@pytest.mark.parametrize("shape", [(3584, 18944), (4608, 3584), (200, 272)])
def test_fp8_gemv_matches_reference(shape: tuple[int, int], rows: int, scheme: str) -> None:
    """The weight-streaming kernel (split-K for down_proj's shape, one split for qkv's,
    partial blocks and tiles for 200 x 272) against its reference: bf16 activations are
    not rounded, e4m3 weights are exact in bf16, so only the float32 summation order and
    the output's bf16 rounding differ."""
    n, k = shape
    torch.manual_seed(0)
    w, w_scale = quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, scheme)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if n == 200 else None
    out, ref = fp8_gemv(x, w, w_scale, bias), fp8_gemv_ref(x, w, w_scale, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=2e-3 * float(ref.abs().max()))
    if rows <= GEMV_MAX_ROWS and not takes_group_quantized_input(rows, w, w_scale):
        assert torch.equal(fp8_linear(x, w, w_scale, bias), out)  # the product fp8_linear runs


@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("scheme", ["block", "channel"])
@pytest.mark.parametrize("rows", [17, 64])
def test_fp8_gemv_orientations_and_tiles(rows: int, scheme: str, swap_ab: bool) -> None:
    """Both operand orientations and every channel tile of ``bench/fp8_gemm_bench.py``'s
    sweep, with 8 warps and a deeper pipeline, split-K (down_proj's shape) and a bias,
    against the reference: a configuration the sweep may pick for ``PLANS`` computes
    the same product."""
    n, k = 3584, 18944
    torch.manual_seed(rows)
    w, w_scale = quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, scheme)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ref = fp8_gemv_ref(x, w, w_scale, bias)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (block_n, num_warps, num_stages), tma in itertools.product(((64, 4, 3), (128, 8, 4), (256, 8, 3)),
                                                                   (False, True)):
        p = plan(rows, n, k, sms, LaunchConfig(block_n, num_warps, num_stages, 2, swap_ab, tma))
        assert p.split > 1 and p.swap_ab == swap_ab and p.tma == tma
        torch.testing.assert_close(fp8_gemv(x, w, w_scale, bias, gemv_plan=p), ref, rtol=1e-2,
                                   atol=2e-3 * float(ref.abs().max()), msg=lambda m, p=p: f"{p}: {m}")


def test_unaligned_block_layer_above_gemv_rows() -> None:
    """A block-scaled layer whose dims are not multiples of 128 (no cuBLASLt block GEMM)
    runs larger products through its dequantized weight: the GEMV's math at any row count."""
    torch.manual_seed(0)
    w, w_scale = quantize_weight(torch.randn(200, 272, device="cuda", dtype=torch.bfloat16) * 0.02, "block")
    x = torch.randn(100, 272, device="cuda", dtype=torch.bfloat16)
    ref = fp8_gemv_ref(x, w, w_scale)  # the dequantized weight is rounded to bf16 there: 2^-9 a weight
    torch.testing.assert_close(fp8_linear(x, w, w_scale), ref, rtol=2e-2, atol=1e-2 * float(ref.abs().max()))


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("scheme", ["block", "channel"])
@pytest.mark.parametrize("rows", [4, 17, 64])
def test_fp8_gemv_split_k_captures_into_a_cuda_graph(rows: int, scheme: str, swap_ab: bool, tma: bool) -> None:
    """The split-K launch (partials summed by the last slice of each tile), in either
    operand orientation, the weight read by loads or TMA, with the rest of the row bucket's ``PLANS`` entry, replays on new
    inputs, every replay right (the tile counters are back at zero after each)."""
    torch.manual_seed(0)
    w, w_scale = quantize_weight(torch.randn(512, 8192, device="cuda", dtype=torch.bfloat16) * 0.02, scheme)
    config = dataclasses.replace(PLANS[block_rows(rows)], swap_ab=swap_ab, tma=tma)
    p = plan(rows, 512, 8192, torch.cuda.get_device_properties(0).multi_processor_count, config)
    assert p.split > 1
    x = torch.randn(rows, 8192, device="cuda", dtype=torch.bfloat16)
    fp8_gemv(x, w, w_scale, gemv_plan=p)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemv(x, w, w_scale, gemv_plan=p)
    for _ in range(20):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, fp8_gemv_ref(x, w, w_scale), rtol=1e-2, atol=2e-3 * float(out.abs().max()))
    assert not fp8_gemv_module._tile_counters(x.device).any()


def test_fp8_linear_captures_into_a_cuda_graph() -> None:
    """No host sync: the product captures, and a replay on new inputs equals eager."""
    torch.manual_seed(0)
    w, w_scale = quantize_rows(torch.randn(256, 128, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16)
    fp8_linear(x, w, w_scale.view(-1))  # warm-up (Triton compile, cuBLASLt plan) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w, w_scale.view(-1))
    x.copy_(torch.randn_like(x) * 3)
    graph.replay()
    assert torch.equal(out, fp8_linear(x, w, w_scale.view(-1)))


def _llm(**settings: object) -> LLM:
    base = {"model": MODEL, "load_format": "dummy", "dtype": "bfloat16", "device": "cuda", "num_kv_blocks": 256,
            "max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 512}
    return LLM(**(base | settings))  # type: ignore[arg-type]


def _free(llm: LLM) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (5, 33, 100, 200)]


def test_graphs_async_and_prefix_caching_match_eager() -> None:
    """Greedy tokens of the FP8 model with CUDA graphs (async scheduling on, the prompts
    twice so the second pass hits the prefix cache) against eager. bf16 greedy on random
    weights has near-ties, and cuBLASLt may pick another kernel for a padded graph bucket,
    so >= 95% of positions must agree, as tests/test_engine_cuda.py asks of bf16."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    eager = _llm(quantization="fp8", enforce_eager=True)
    assert all(m.is_fp8 for m in fp8_linears(eager.engine.runner.model))
    ref = [o.token_ids for o in eager.generate(_prompts(), params)]
    _free(eager)
    graphs = _llm(quantization="fp8")
    assert graphs.engine.runner.graphs is not None and graphs.engine.engine_settings.async_scheduling
    first = graphs.generate(_prompts(), params)
    again = graphs.generate(_prompts(), params)
    assert graphs.engine.runner.graphs.num_replays > 0 and graphs.engine.num_async_steps > 0
    assert sum(o.num_cached_tokens for o in again) > 0
    _free(graphs)
    for got in ([o.token_ids for o in first], [o.token_ids for o in again]):
        same = sum(a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))
        assert same >= 0.95 * sum(len(r) for r in ref), f"{same} of {sum(len(r) for r in ref)} positions agree"


def _prefill_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits ``[vocab]`` float32 of the prompt's last position (one eager prefill)."""
    model = llm.engine.runner.model
    recorded: list[torch.Tensor] = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: recorded.append(compute_logits(hidden)) or recorded[-1]
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    model.compute_logits = compute_logits
    return recorded[0][-1].float().cpu()


@pytest.fixture(scope="module")
def two_layer_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """SmolLM2-135M's shapes with 2 layers (a config folder for dummy weights): through
    30 random layers a rounding difference grows too much to compare logits."""
    folder = tmp_path_factory.mktemp("fp8_cuda")
    (folder / "config.json").write_text(json.dumps(DUMMY_CONFIGS[MODEL] | {"num_hidden_layers": 2}))
    return str(folder)


def test_fp8_logits_against_unquantized_and_the_reference(two_layer_folder: str) -> None:
    """The FP8 model's prefill logits (2 layers, float32 elsewhere, eager, 128x128 block
    scales) against (a) the same FP8 weights dequantized into float32 and run as plain
    linears and (b) the unquantized model. SmolLM2's dims are not multiples of 128, so its
    block-scaled prefill products dequantize the weight (W8A16, no input rounding): (a)
    is the same math up to the summation order. Bounds: (a) 1e-3 (a wrong scale or block
    index moves it by several %), (b) between (a) and 0.2 (10.6% measured on the H100
    with per-channel scales and rounded inputs, 2026-11-24)."""
    prompt = _prompts()[2]
    settings = {"model": two_layer_folder, "dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False}
    plain = _llm(**settings)
    plain_logits = _prefill_logits(plain, prompt)
    _free(plain)
    fp8 = _llm(quantization="fp8", **settings)
    assert all(m.is_fp8 and m.weight_scale.dim() == 2 for m in fp8_linears(fp8.engine.runner.model))
    fp8_logits = _prefill_logits(fp8, prompt)
    for m in fp8_linears(fp8.engine.runner.model):
        m.dequantize_fp8(torch.float32)
        m.fp8_reference = False  # inputs unrounded, as the W8A16 products above
    reference = _prefill_logits(fp8, prompt)
    _free(fp8)
    vs_reference = float((fp8_logits - reference).norm() / reference.norm())
    vs_plain = float((fp8_logits - plain_logits).norm() / plain_logits.norm())
    print(f"relative logit error: vs reference {vs_reference:.6f}, vs unquantized {vs_plain:.4f}")
    assert vs_reference < 1e-3
    assert vs_reference < vs_plain < 0.2


def check_fused_against_two_launches(folder: Path, head_dim: int, module: object, name: str,
                                    two_launches: Callable[..., object], calls: int,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose dims are multiples of 128 (2 layers, bf16, FP8 blocks, ``head_dim``
    as given), written to ``folder``: a prefill calls ``module.name`` (a kernel that
    quantizes for an FP8 product as it computes) ``calls`` times, and its logits equal,
    bit for bit, those of the same model with ``two_launches`` (the kernel and the group
    quantizer in turn) in its place."""
    config = DUMMY_CONFIGS[MODEL] | {"num_hidden_layers": 2, "hidden_size": 512, "intermediate_size": 1536,
                                     "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": head_dim}
    (folder / "config.json").write_text(json.dumps(config))
    llm = _llm(model=str(folder), quantization="fp8", enforce_eager=True, enable_prefix_caching=False)
    prompt = _prompts()[2]
    seen = []
    fused = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: seen.append(1) or fused(*a, **k))
    logits = _prefill_logits(llm, prompt)
    assert len(seen) == calls
    monkeypatch.setattr(module, name, two_launches)
    assert torch.equal(_prefill_logits(llm, prompt), logits)
    _free(llm)


def test_norms_quantize_for_their_block_scaled_products(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer's two pre-norms run through ``fused_add_rms_norm_fp8`` (their products
    take group-quantized input), bit for bit the norm and the quantizer as two launches
    (``check_fused_against_two_launches``)."""
    import worker.models.linear as linear_module

    def two_launches(*args: object, pad_rows_to: int = 1) -> tuple[torch.Tensor, ...]:
        out, res = fused_add_rms_norm(*args)  # type: ignore[arg-type]
        return *quantize_groups(out, pad_rows_to=pad_rows_to, scales_column_major=True), res

    check_fused_against_two_launches(tmp_path, 64, linear_module, "fused_add_rms_norm_fp8", two_launches, 2 * 2,
                                     monkeypatch)

