"""FP8 (E4M3) weights: per-output-channel quantization, the scaled matmul and its reference.

``--quantization fp8`` stores the decoder layers' linear weights (``qkv_proj``,
``o_proj``, ``gate_up_proj``, ``down_proj``) as ``float8_e4m3fn [N, K]`` with one float32
scale per output channel (``weight_scale [N]``, ``w ~= w_fp8 * scale[:, None]``, the
scale ``amax(|w[n]|) / 448``); the activations are quantized per token on the fly
(``x [M, K]`` with ``scale [M, 1]``). On CUDA the product is one
``torch._scaled_mm(x_fp8, w_fp8.T, scale_a [M, 1], scale_b [1, N], out_dtype=bf16)``
(cuBLASLt's row-wise scaled FP8 GEMM, SM89+; K and N multiples of 16), which halves the
bytes a decode step reads. Every step is device-side (no host sync), so the product is
captured into CUDA graphs like any other. Why per-channel and not DeepSeek-V3's 128x128
blocks: measured on the H100 (``docs/benchmarks.md``, "FP8 weights").

Per-channel scales also fit our fused projections: q/k/v (gate/up) rows keep their own
scales when stacked into ``qkv_proj`` (``gate_up_proj``), so a checkpoint's shards load
without requantizing.

Embeddings, the LM head, norms, the MoE router and the MoE experts stay in the model
dtype (the experts' fused kernel, ``kernels/fused_moe.py``, has no FP8 path).

On CPU (the reference, used by the quality test and bench/fp8_quality.py) the weights
are rounded through E4M3 with their scales at load and stored back in the model dtype
(``Linear.dequantize_fp8``), and the activations are rounded through E4M3 per token in
each product: the same numbers as the CUDA path up to the accumulation order.

Checkpoints already saved in FP8 (``config.json`` ``quantization_config`` with
``quant_method: "fp8"``, as vLLM's and llm-compressor's per-tensor or per-channel FP8
write them: ``weight`` in ``float8_e4m3fn`` and ``weight_scale`` ``[]``, ``[1]``,
``[N]`` or ``[N, 1]``) load as they are; block-wise checkpoints (``weight_block_size``,
``weight_scale_inv``) are refused (``checkpoint_fp8_error``). Static activation scales
(``input_scale``) are ignored: activations are always scaled per token.

Source: Micikevicius et al., "FP8 Formats for Deep Learning" (2022); the row-wise
``_scaled_mm`` use as vLLM's ``Fp8LinearOp`` (per-token activations, per-channel weights).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.fp8_quant import FP8_DTYPE, FP8_MAX, quantize_rows, quantize_rows_ref

__all__ = ["FP8_DTYPE", "FP8_MAX", "quantize_rows", "quantize_rows_ref"]

#: ``torch._scaled_mm`` needs K and N multiples of this.
SCALED_MM_ALIGN = 16


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [R, C]`` (E4M3) times ``scale`` (``[R]`` or ``[R, 1]`` float32) in ``dtype``."""
    return (q.float() * scale.reshape(-1, 1).float()).to(dtype)


def fake_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [R, C]`` rounded through E4M3 per row (``quantize_rows_ref`` then back), in ``x``'s dtype."""
    return dequantize_rows(*quantize_rows_ref(x), dtype=x.dtype)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch reference of ``fp8_linear``: ``x [M, K]`` rounded per token, times the
    dequantized ``weight [N, K]`` (E4M3, ``weight_scale [N]`` float32), in float32, plus
    ``bias [N]``; returns ``[M, N]`` in ``x``'s dtype."""
    out = dequantize_rows(*quantize_rows_ref(x)) @ dequantize_rows(weight, weight_scale).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(weight).T + bias`` with ``x [M, K]`` (bfloat16 or float16) quantized
    per token: ``torch._scaled_mm`` on CUDA, ``fp8_linear_ref`` elsewhere.

    Args:
        weight: ``[N, K]`` float8_e4m3fn, row-major (``_scaled_mm`` takes its transpose,
            column-major, as it requires); K and N multiples of ``SCALED_MM_ALIGN``.
        weight_scale: ``[N]`` float32.
        bias: ``[N]`` in ``x``'s dtype, or None.
    Returns:
        ``[M, N]`` in ``x``'s dtype.
    """
    if not x.is_cuda:
        return fp8_linear_ref(x, weight, weight_scale, bias)
    q, scale = quantize_rows(x.contiguous())
    out = torch._scaled_mm(q, weight.T, scale_a=scale, scale_b=weight_scale.view(1, -1),
                           out_dtype=torch.bfloat16)
    out = out if x.dtype == torch.bfloat16 else out.to(x.dtype)
    return out if bias is None else out + bias


def scaled_mm_fits(out_features: int, in_features: int) -> bool:
    """Whether a ``[out, in]`` weight meets ``torch._scaled_mm``'s shape constraints."""
    return out_features % SCALED_MM_ALIGN == 0 and in_features % SCALED_MM_ALIGN == 0


def checkpoint_fp8_error(config: dict[str, Any]) -> str | None:
    """Why the FP8 checkpoint of HF ``config`` (its ``quantization_config``) cannot be
    loaded, or None where it can (per-tensor or per-channel ``weight_scale``)."""
    qc = config.get("quantization_config") or {}
    if qc.get("weight_block_size"):
        return (f"block-wise FP8 checkpoints (weight_block_size {qc['weight_block_size']}, weight_scale_inv) "
                "are not supported: inferq serves per-tensor or per-channel FP8 checkpoints; load the "
                "bfloat16 checkpoint with --quantization fp8 instead")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        return f"FP8 format {fmt!r} is not supported (e4m3 only)"
    return None


def resolve_quantization(setting: str, config: dict[str, Any]) -> tuple[str, bool]:
    """``(quantization, prequantized)`` to load HF ``config``'s weights with under the
    ``ModelSettings.quantization`` ``setting``: a checkpoint saved in FP8
    (``quantization_config.quant_method`` ``"fp8"``) is served in FP8 whatever the
    setting (``prequantized`` True); otherwise the setting decides.

    Raises:
        ValueError: a ``quant_method`` other than fp8, or an FP8 layout that cannot be
            loaded (``checkpoint_fp8_error``).
    """
    qc = config.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method is None:
        return setting, False
    if method != "fp8":
        raise ValueError(f"checkpoint quantization {method!r} is not supported (supported: fp8)")
    error = checkpoint_fp8_error(config)
    if error is not None:
        raise ValueError(error)
    return "fp8", True
