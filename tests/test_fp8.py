"""FP8 weights on CPU (``worker/models/fp8.py``): the quantizer, the reference product,
checkpoints saved in FP8, refusals, and perplexity on the real default model."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.fp8_gemv import (
    PLANS,
    LaunchConfig,
    check_gemv_args,
    dequantize_weight,
    fp8_gemv,
    fp8_gemv_ref,
    plan,
)
from kernels.fp8_quant import MIN_AMAX, quantize_blocks_ref, quantize_groups
from shared.settings import ModelSettings, SettingsError
from worker.models.config import ModelConfig
from worker.models.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_rows,
    fp8_linear,
    quantize_rows,
    quantize_weight,
    resolve_quantization,
    round_inputs,
)
from worker.models.linear import Linear
from worker.models.loader import build_model, fp8_linears

CPU = torch.device("cpu")
# A tiny Llama: GQA, head_dim 16, untied LM head; every projection's dims multiples of 16.
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "max_position_embeddings": 128}


def test_quantize_rows_scales_and_rounding() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 256) * torch.logspace(-3, 2, 8)[:, None]  # rows of very different size
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (8, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, x.abs().amax(dim=1, keepdim=True) / FP8_MAX)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((8,), FP8_MAX))  # each row uses the full range
    # E4M3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 relative, or half the
    # subnormal step (2^-10 of the scale) for the smallest values.
    err = (dequantize_rows(q, scale) - x).abs()
    assert bool((err <= x.abs() * 2**-4 + scale * 2**-10).all())
    zero_q, zero_scale = quantize_rows(torch.zeros(2, 16))  # an all-zero row stays finite
    assert bool(torch.isfinite(zero_scale).all()) and not zero_q.float().any()


def test_block_and_group_quantization() -> None:
    """128x128 weight blocks and 1x128 activation groups, partial edge blocks included:
    each block's scale is its own amax / 448, and the round trip stays within e4m3's
    rounding of each value."""
    torch.manual_seed(0)
    w = torch.randn(200, 272) * torch.logspace(-4, 1, 272)[None, :]  # columns of very different size
    q, scale = quantize_blocks_ref(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and scale.shape == (2, 3)
    torch.testing.assert_close(scale[1, 2], w[128:, 256:].abs().amax() / FP8_MAX)
    back = dequantize_weight(q, scale)
    assert bool(((back - w).abs() <= w.abs() * 2**-4 + scale.amax() * 2**-10).all())
    # Blocks follow the column sizes that one per-channel scale cannot: with the row's
    # amax set by its large columns, its small ones fall into e4m3's subnormals.
    q_c, s_c = quantize_weight(w, "channel")
    small = slice(0, 128)
    rel_block = ((back - w).abs() / w.abs())[:, small].mean()
    rel_channel = ((dequantize_weight(q_c, s_c) - w).abs() / w.abs())[:, small].mean()
    assert s_c.shape == (200,) and rel_block < 0.04 and rel_channel > 0.08, (rel_block, rel_channel)
    x = torch.randn(3, 256) * torch.tensor([1.0] * 128 + [100.0] * 128)
    xq, xs = quantize_groups(x)
    assert xs.shape == (3, 2)
    # Padded to 16 rows of zeros (the smallest scale), scales column-major: as _scaled_mm takes them.
    pq, ps = quantize_groups(x, pad_rows_to=16, scales_column_major=True)
    assert pq.shape == (16, 256) and ps.shape == (16, 2) and ps.stride() == (1, 16)
    assert torch.equal(pq[:3].float(), xq.float()) and torch.equal(ps[:3], xs) and not pq[3:].float().any()
    assert bool((ps[3:] == MIN_AMAX / FP8_MAX).all())
    torch.testing.assert_close(xs[:, 0], x[:, :128].abs().amax(dim=1) / FP8_MAX)
    torch.testing.assert_close(round_inputs(x, True), xq.float() * xs.repeat_interleave(128, 1))
    with pytest.raises(ValueError, match="unknown FP8 scheme"):
        quantize_weight(w, "tensor")


def test_gemv_plan_and_reference() -> None:
    """The split-K plan covers K in slices of whole 128-blocks and fills the GPU; the
    GEMV reference is the unrounded-input product; bad arguments are refused."""
    for n, k in ((3584, 18944), (3584, 3584), (4608, 3584), (37888, 3584), (96, 272)):
        p = plan(1, n, k, num_sms=132)
        assert p.k_per_split % 128 == 0 and (p.split - 1) * p.k_per_split < k <= p.split * p.k_per_split
        if n > 96:  # Qwen2.5-7B's projections: at least 2 programs per SM (K slices >= 512 allowing)
            assert -(-n // p.block_n) * p.split >= min(PLANS[16].programs_per_sm, 2) * 132, (n, k, p)
    assert plan(1, 3584, 18944, 132).split == 10 and plan(1, 37888, 3584, 132).split == 1
    assert plan(5, 64, 512, 132).block_m == 16 and plan(33, 64, 512, 132).block_m == 64
    assert plan(17, 64, 512, 132).block_m == 32 and set(PLANS) == {16, 32, 64}
    # Each row bucket takes its PLANS entry unless a configuration is given.
    for m in (1, 17, 64):
        p, c = plan(m, 3584, 18944, 132), PLANS[plan(m, 8, 512, 132).block_m]
        assert (p.block_n, p.num_warps, p.num_stages, p.swap_ab) == (c.block_n, c.num_warps, c.num_stages, c.swap_ab)
    assert plan(64, 3584, 18944, 132, LaunchConfig(block_n=256, swap_ab=False)).block_n == 256
    with pytest.raises(ValueError, match="1..64 rows"):
        plan(65, 64, 512, 132)
    torch.manual_seed(0)
    q, scale = quantize_blocks_ref(torch.randn(96, 272))
    x = torch.randn(4, 272)
    torch.testing.assert_close(fp8_gemv_ref(x, q, scale), x @ dequantize_weight(q, scale).T)
    with pytest.raises(ValueError, match="weight_scale must be"):
        check_gemv_args(x, q, scale.view(-1), None)
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        check_gemv_args(x, q.float(), scale, None)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
                    reason="the Triton kernel on CPU: run with TRITON_INTERPRET=1 and triton installed")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [17, 33, 64])
@pytest.mark.parametrize("scheme", ["block", "channel"])
def test_fp8_gemv_kernel_interpreted(scheme: str, rows: int, bias: bool) -> None:
    """``kernels/fp8_gemv.py`` run by Triton's interpreter (float32 inputs: it computes
    bfloat16 wrongly) against its reference, in both operand orientations, on a weight
    with a partial 128-block and a partial channel tile, split-K (2 slices, the last one
    partial) at 17 and 64 rows and one slice at 33."""
    n, k = 200, 1152
    torch.manual_seed(rows)
    w, w_scale = quantize_weight(torch.randn(n, k) * torch.logspace(-1, 1, k)[None, :] * 0.02, scheme)
    x = torch.randn(rows, k)
    b = torch.randn(n) if bias else None
    ref = fp8_gemv_ref(x, w, w_scale, b)
    for swap_ab, tma in itertools.product((False, True), (False, True)):
        p = plan(rows, n, k, 1 if rows == 33 else 2,
                 LaunchConfig(block_n=128, programs_per_sm=2, swap_ab=swap_ab, tma=tma))
        assert p.split == (1 if rows == 33 else 2) and p.swap_ab == swap_ab
        for _ in range(2):  # the second launch finds the split-K tile counters back at zero
            torch.testing.assert_close(fp8_gemv(x, w, w_scale, b, gemv_plan=p), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["block", "channel"])
def test_fp8_linear_matches_the_dequantized_reference_layer(scheme: str) -> None:
    """The two CPU forms of an FP8 layer agree: FP8 storage (``fp8_linear``) and the
    reference that dequantizes on load and rounds its inputs as the prefill path does."""
    torch.manual_seed(0)
    layer = Linear(256, 32, bias=True)
    x = torch.randn(5, 256)
    layer.to_fp8(scheme)
    assert layer.is_fp8 and layer.weight.dtype == FP8_DTYPE
    assert layer.weight_scale.shape == ((1, 2) if scheme == "block" else (32,))
    stored = layer(x)
    layer.dequantize_fp8(torch.float32)
    assert not layer.is_fp8 and layer.fp8_reference
    torch.testing.assert_close(layer(x), stored, rtol=1e-5, atol=1e-5)
    # The inputs are rounded too: with the float32 inputs the product differs.
    assert not torch.allclose(torch.nn.functional.linear(x, layer.weight, layer.bias), stored, rtol=1e-4, atol=1e-4)
    w_q, w_s = quantize_weight(torch.randn(32, 256), scheme)
    exact_inputs = x @ dequantize_weight(w_q, w_s).T  # input rounding adds about 2^-5 relative
    assert (fp8_linear(x, w_q, w_s) - exact_inputs).norm() < 0.05 * exact_inputs.norm()


def _save_folder(folder: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None = None) -> Path:
    folder.mkdir()
    config = dict(TINY, **({"quantization_config": quantization_config} if quantization_config else {}))
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 checkpoint of ``TINY``, our own random weights saved under HF names."""
    model = build_model(ModelConfig.from_hf(TINY), None, True, torch.float32, CPU, 128, seed=3)
    h, q, kv = 64, 64, 32
    tensors = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight,
               "lm_head.weight": model.lm_head.weight}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        wq, wk, wv = layer.self_attn.qkv_proj.weight.split([q, kv, kv])
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        tensors |= {p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                    p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
                    p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": layer.mlp.down_proj.weight,
                    p + "input_layernorm.weight": layer.input_layernorm.weight + 0.1 * i,
                    p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight}
    assert all(t.shape[-1] % 16 == 0 for t in tensors.values()) and h == 64
    return _save_folder(tmp_path_factory.mktemp("fp8") / "bf16", {k: v.detach() for k, v in tensors.items()})


def _fp8_checkpoint(bf16_folder: Path, folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The checkpoint of ``bf16_folder`` saved in FP8 as vLLM writes it: per-channel
    scales ``[N, 1]``, layer 1's o_proj per-tensor (scale ``[]``), layer 1's down_proj
    left unquantized (as a ``ignored_layers`` entry), static ``input_scale``s beside.
    Returns the folder and each FP8 weight's dequantized values by HF name."""
    tensors, expected = {}, {}
    for name, w in load_file(str(bf16_folder / "model.safetensors")).items():
        projection = ".layers." in name and name.endswith("proj.weight")
        if not projection or name == "model.layers.1.mlp.down_proj.weight":
            tensors[name] = w
            continue
        if name == "model.layers.1.self_attn.o_proj.weight":
            scale = w.abs().amax() / FP8_MAX
            q = (w / scale).to(FP8_DTYPE)
        else:
            q, scale = quantize_rows(w)
        tensors[name], tensors[f"{name}_scale"] = q, scale
        tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(1.0)
        expected[name] = q.float() * scale.float()
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["model.layers.1.mlp.down_proj"]}
    return _save_folder(folder, tensors, qc), expected


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_fp8_checkpoint_loads_as_saved(bf16_folder: Path, tmp_path: Path) -> None:
    """A per-channel/per-tensor FP8 checkpoint lands unchanged in the fused FP8 layers,
    and gives the logits of its bf16 source quantized at load where the two agree."""
    folder, expected = _fp8_checkpoint(bf16_folder, tmp_path / "fp8")
    quantization, prequantized = resolve_quantization("none", _config(folder))
    assert (quantization, prequantized) == ("fp8", True)
    cfg = ModelConfig.from_hf(_config(folder))
    stored = build_model(cfg, None, True, torch.float32, CPU, 128)  # shapes only: weights replaced below
    for m in fp8_linears(stored):
        m.to_fp8("channel")
    from worker.models.loader import load_hf_weights

    load_hf_weights(stored, folder)
    attn = stored.layers[1].self_attn
    wq = dequantize_rows(attn.qkv_proj.weight, attn.qkv_proj.weight_scale)[:64]
    torch.testing.assert_close(wq, expected["model.layers.1.self_attn.q_proj.weight"], rtol=0, atol=0)
    o_proj = dequantize_rows(attn.o_proj.weight, attn.o_proj.weight_scale)
    torch.testing.assert_close(o_proj, expected["model.layers.1.self_attn.o_proj.weight"], rtol=0, atol=0)
    # Every layer holds the per-channel grid of its bf16 source, layer 1's down_proj too
    # (kept unquantized by the checkpoint, quantized at load in the checkpoint's layout).
    plain = build_model(cfg, bf16_folder, False, torch.float32, CPU, 128)
    from_fp8 = build_model(cfg, folder, False, torch.float32, CPU, 128, quantization="fp8", prequantized=True)
    for a, b in zip(fp8_linears(plain), fp8_linears(from_fp8), strict=True):
        assert b.fp8_reference and not b.fp8_block_scales
        if b is not from_fp8.layers[1].self_attn.o_proj:  # per-tensor there: a different grid
            grid = dequantize_weight(*quantize_weight(a.weight.detach(), "channel"))
            torch.testing.assert_close(b.weight.detach(), grid, rtol=0, atol=0)
    # A bf16 checkpoint quantized at load takes the default layout, 128x128 blocks.
    from_bf16 = build_model(cfg, bf16_folder, False, torch.float32, CPU, 128, quantization="fp8")
    assert all(m.fp8_reference and m.fp8_block_scales for m in fp8_linears(from_bf16))


def test_refused_checkpoints_and_settings() -> None:
    block = dict(TINY, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="block-wise FP8 checkpoints"):
        resolve_quantization("none", block)
    with pytest.raises(ValueError, match="'gptq' is not supported"):
        resolve_quantization("fp8", dict(TINY, quantization_config={"quant_method": "gptq"}))
    assert resolve_quantization("fp8", TINY) == ("fp8", False)
    with pytest.raises(SettingsError, match="quantization"):
        ModelSettings(quantization="int4")


@pytest.mark.slow
def test_fp8_perplexity_close_to_float32(smollm_source) -> None:
    """The default model's real weights: FP8 in the default 128x128 block layout (the CPU
    reference, inputs rounded per 1x128 group; converted in place on one engine to load
    the model once) against float32 on a fixed text (400 tokens here; bench/fp8_quality.py
    scores 2,000). The bound is the measured change with margin (docs/benchmarks.md, "FP8
    weights"); per-channel scales or a wrong scale or rounding move it far more."""
    from bench.fp8_kv_quality import fixed_text, perplexity
    from worker.llm import LLM

    llm = LLM(dtype="float32", device="cpu", max_num_seqs=1, enable_prefix_caching=False)
    ids = llm.encode(fixed_text())[:400]
    ppl_ref = perplexity(llm, ids)
    model = llm.engine.runner.model
    for m in fp8_linears(model):
        m.to_fp8()
        m.dequantize_fp8(torch.float32)
        assert m.fp8_block_scales
    if model.packed_max_rows is not None:
        model.prepack_for_cpu(model.packed_max_rows)
    ppl_fp8 = perplexity(llm, ids)
    print(f"perplexity float32 {ppl_ref:.4f}, fp8 {ppl_fp8:.4f} ({ppl_fp8 / ppl_ref - 1:+.2%})")
    assert ppl_ref < ppl_fp8 < ppl_ref * QUALITY_BOUND, (ppl_ref, ppl_fp8)


#: Most perplexity ratio the quality test accepts (see its docstring).
QUALITY_BOUND = 1.06
