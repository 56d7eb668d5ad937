"""FP8 (E4M3) weights: 128x128 block or per-output-channel scales, the products and their reference.

``--quantization fp8`` stores the decoder layers' linear weights (``qkv_proj``,
``o_proj``, ``gate_up_proj``, ``down_proj``) as ``float8_e4m3fn [N, K]`` with float32
scales, ``w ~= w_fp8 * scale`` and each scale ``amax / 448`` of what it covers. Two layouts
(``FP8_SCHEMES``), told apart by the scale's rank:

- ``block`` (the default for weights quantized at load): one scale per 128x128 block,
  ``weight_scale [ceil(N / 128), ceil(K / 128)]``, as DeepSeek-V3 and vLLM's block FP8;
- ``channel``: one scale per output channel, ``weight_scale [N]``; what per-tensor and
  per-channel FP8 checkpoints hold.

Why blocks: on the default model they keep perplexity within 0.2% of float32 where
per-channel scales lose 3.5% (a row's amax is set by a few outlier columns, pushing the
rest of the row into e4m3's subnormals); docs/benchmarks.md, "FP8 weights", has the
measured table (``bench/fp8_quality.py``).

On CUDA a product of up to ``GEMV_MAX_ROWS`` rows (decode) is ``kernels/fp8_gemv.py``: the
activations stay in bfloat16 and the weight is streamed once, dequantized in registers
(W8A16). With ``block`` weights, products of ``W8A8_MIN_ROWS`` to ``W8A8_MAX_ROWS`` rows
(decode steps of 17-64 sequences) run the same kernel on activations quantized per 1x128
group instead (W8A8: FP8 by FP8 on the tensor cores). Larger products (prefill) quantize the activations and run cuBLASLt's FP8 GEMM,
``torch._scaled_mm``: per token with ``channel`` weights (row-wise scaling, SM89+), per
1x128 group with ``block`` weights (DeepSeek-V3's recipe, SM90 and CUDA 12.9+; K and N
multiples of 128, rows padded to a multiple of 16 for it); a ``block`` layer whose dims
are not multiples of 128 dequantizes its weight for a ``F.linear`` instead. Every step is
device-side (no host sync), so the products are captured into CUDA graphs like any other.

On CPU (the reference, used by the quality test and bench/fp8_quality.py) the weights
are rounded through E4M3 with their scales at load and stored back in the model dtype
(``Linear.dequantize_fp8``), and each product's input is rounded through E4M3 as the
prefill path does (``round_inputs``: per token for ``channel``, per 1x128 group for
``block``): the error of what CUDA serves, or slightly more for the products that run the
bf16-input kernel (decode steps of up to 16 sequences with ``block`` weights, 32 with
``channel``), whose inputs CUDA does not round.

Embeddings, the LM head, norms, the MoE router and the MoE experts stay in the model
dtype (the experts' fused kernel, ``kernels/fused_moe.py``, has no FP8 path).

Under tensor parallelism each rank holds its slice of these weights and of their scales,
TP=1's bit for bit (``worker/parallel/fp8_shards.py``, which also says which splits of
the ``block`` layout are refused).

Checkpoints already saved in FP8 (``config.json`` ``quantization_config`` with
``quant_method: "fp8"``, as vLLM's and llm-compressor's per-tensor or per-channel FP8
write them: ``weight`` in ``float8_e4m3fn`` and ``weight_scale`` ``[]``, ``[1]``,
``[N]`` or ``[N, 1]``) load as they are, in the ``channel`` layout; block-wise
checkpoints (``weight_block_size``, ``weight_scale_inv``) are refused
(``checkpoint_fp8_error``). Static activation scales (``input_scale``) are ignored.

Source: Micikevicius et al., "FP8 Formats for Deep Learning" (2022); DeepSeek-V3
(arXiv:2412.19437, section 3.3) for the block layout; the row-wise ``_scaled_mm`` use as
vLLM's ``Fp8LinearOp`` (per-token activations, per-channel weights).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels.fp8_gemv import MAX_ROWS, dequantize_weight, fp8_gemv
from kernels.fp8_quant import (
    FP8_BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    quantize_blocks_ref,
    quantize_groups,
    quantize_groups_ref,
    quantize_rows,
    quantize_rows_ref,
)

__all__ = ["FP8_BLOCK", "FP8_DTYPE", "FP8_MAX", "dequantize_weight", "quantize_rows", "quantize_rows_ref"]

#: ``torch._scaled_mm`` needs K and N multiples of this.
SCALED_MM_ALIGN = 16
#: Weight layouts (see the module docstring); the first is the default of ``--quantization fp8``.
FP8_SCHEMES = ("block", "channel")
#: Products of up to this many rows run ``kernels/fp8_gemv.py`` on CUDA (W8A16, the
#: decode steps of up to 32 sequences; the kernel takes up to ``kernels.fp8_gemv.MAX_ROWS``);
#: larger ones ``torch._scaled_mm``. Crossover on the H100: the kernel 0.138 ms a layer at
#: 32 rows against cuBLASLt's 0.140, 0.186 against 0.159 at 64 (bench/fp8_gemm_bench.py
#: ``--sweep``; docs/benchmarks.md, "FP8 weights").
GEMV_MAX_ROWS = 32
#: Products of ``W8A8_MIN_ROWS`` to ``W8A8_MAX_ROWS`` rows on ``block`` weights (dims
#: multiples of 128) run the same kernel on group-quantized input instead (W8A8,
#: ``fp8_gemv``'s ``x_scale``), the quantization included: per layer 0.123 ms at 32 rows
#: and 0.121 at 24 against 0.138 for the bf16-input kernel, 0.139 at 64 against cuBLASLt's
#: 0.157 (H100 sweeps, docs/benchmarks.md, "FP8 weights"). Up to 16 rows the bf16-input
#: kernel stays (no quantization launch, inputs unrounded).
W8A8_MIN_ROWS = 17
W8A8_MAX_ROWS = MAX_ROWS
#: cuBLASLt's 1x128 x 128x128 block-scaled FP8 GEMM (``torch._scaled_mm`` with ``[M, K / 128]``
#: and ``[K / 128, N / 128]`` scales) returns wrong sums, with no error, unless K is a
#: multiple of this: on an H200 with torch 2.11 (CUDA 13), 2026-11-28, K of 512, 1024,
#: 1536, 2048, 2560, 3584 and 4608 matched the reference within bf16 rounding, and K of
#: 128-896, 1152, 1280, 1792 and 9472 were off by 7% to 1e8 (NaN once), whatever N and M.
#: Such K (Gemma-3-12B's hidden size 3840; Qwen2.5-7B's row-parallel products at TP=2,
#: 1792 and 9472 columns) keep the W8A8 kernel up to ``W8A8_MAX_ROWS`` rows and take the
#: dequantized weight above (``fp8_linear``).
BLOCK_SCALED_MM_K = 4 * FP8_BLOCK


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [R, C]`` (E4M3) times ``scale`` (``[R]`` or ``[R, 1]`` float32) in ``dtype``."""
    return (q.float() * scale.reshape(-1, 1).float()).to(dtype)


def fake_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [R, C]`` rounded through E4M3 per row (``quantize_rows_ref`` then back), in ``x``'s dtype."""
    return dequantize_rows(*quantize_rows_ref(x), dtype=x.dtype)


def round_inputs(x: torch.Tensor, block_scales: bool) -> torch.Tensor:
    """``x [M, K]`` rounded through E4M3 as the prefill path quantizes it: per 1x128 group
    for ``block`` weights (``block_scales``), per token for ``channel`` ones; ``x``'s dtype."""
    if not block_scales:
        return fake_quantize_rows(x)
    return dequantize_groups(*quantize_groups_ref(x), x.dtype)


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [R, K]`` (E4M3) times its scales per 1x128 group (``scale [R, ceil(K / 128)]``
    float32, as ``quantize_groups`` and its reference give them) in ``dtype``."""
    return (q.float() * scale.repeat_interleave(FP8_BLOCK, 1)[:, :q.shape[1]]).to(dtype)


def quantize_weight(weight: torch.Tensor, scheme: str = FP8_SCHEMES[0]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` in E4M3 with its scales: ``[ceil(N / 128), ceil(K / 128)]`` for
    ``block``, ``[N]`` for ``channel`` (float32).

    Raises:
        ValueError: an unknown ``scheme``.
    """
    if scheme == "block":
        return quantize_blocks_ref(weight)
    if scheme == "channel":
        q, scale = quantize_rows(weight)
        return q, scale.view(-1)
    raise ValueError(f"unknown FP8 scheme {scheme!r} (supported: {', '.join(FP8_SCHEMES)})")


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch reference of ``fp8_linear``'s prefill path: ``x [M, K]`` rounded
    (``round_inputs``), times the dequantized ``weight [N, K]`` (E4M3, ``weight_scale``
    ``[N]`` or 128x128 blocks) in float32, plus ``bias [N]``; ``[M, N]`` in ``x``'s dtype."""
    out = round_inputs(x.float(), weight_scale.dim() == 2) @ dequantize_weight(weight, weight_scale).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def block_mm_fits(out_features: int, in_features: int) -> bool:
    """Whether a ``[out, in]`` block-scaled weight runs in ``torch._scaled_mm`` (dims
    multiples of ``FP8_BLOCK``)."""
    return out_features % FP8_BLOCK == 0 and in_features % FP8_BLOCK == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(weight).T + bias`` with ``x [M, K]`` (bfloat16 or float16): on CUDA
    ``fp8_gemv`` up to ``GEMV_MAX_ROWS`` rows (``block`` weights: up to 16), else on
    quantized activations ``fp8_gemv`` (``block`` weights, up to ``W8A8_MAX_ROWS`` rows)
    or ``torch._scaled_mm`` (module docstring; for ``block`` weights whose K it sums
    wrongly, ``BLOCK_SCALED_MM_K``, the dequantized weight on the rounded input);
    ``fp8_linear_ref`` off CUDA.

    Args:
        weight: ``[N, K]`` float8_e4m3fn, row-major (``_scaled_mm`` takes its transpose,
            column-major, as it requires); K and N multiples of ``SCALED_MM_ALIGN``.
        weight_scale: float32, ``[N]`` (``channel``) or ``[ceil(N / 128), ceil(K / 128)]``
            (``block``).
        bias: ``[N]`` in ``x``'s dtype, or None.
    Returns:
        ``[M, N]`` in ``x``'s dtype.
    """
    if not x.is_cuda:
        return fp8_linear_ref(x, weight, weight_scale, bias)
    m = x.shape[0]
    if takes_group_quantized_input(m, weight, weight_scale):
        # Both scales "outer-dim-major" (column-major) and the rows padded to the alignment,
        # as cuBLASLt's block scaling wants them: the quantizer writes them so.
        q, scale = quantize_groups(x.contiguous(), pad_rows_to=block_input_padding(m), scales_column_major=True)
        return block_product(q, scale, weight, weight_scale, m, bias, x.dtype)
    if weight_scale.dim() == 2 and m > W8A8_MAX_ROWS and block_mm_fits(*weight.shape):
        # K not a multiple of BLOCK_SCALED_MM_K: the dequantized weight, on the input rounded
        # per 1x128 group as _scaled_mm's input would be (so a row-parallel shard of such K
        # rounds as TP=1 does with its full K, which _scaled_mm takes).
        x_rounded = dequantize_groups(*quantize_groups(x.contiguous()), x.dtype)
        return F.linear(x_rounded, dequantize_weight(weight, weight_scale, x.dtype), bias)
    if m <= GEMV_MAX_ROWS:
        return fp8_gemv(x, weight, weight_scale, bias)
    if weight_scale.dim() == 1:
        q, scale = quantize_rows(x.contiguous())
        out = torch._scaled_mm(q, weight.T, scale_a=scale, scale_b=weight_scale.view(1, -1),
                               out_dtype=torch.bfloat16)
    else:  # block scales where _scaled_mm cannot take them (dims, BLOCK_SCALED_MM_K)
        return F.linear(x, dequantize_weight(weight, weight_scale, x.dtype), bias)
    out = out if x.dtype == torch.bfloat16 else out.to(x.dtype)
    return out if bias is None else out + bias


def takes_group_quantized_input(rows: int, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """Whether ``fp8_linear`` runs a product of ``rows`` rows by this FP8 weight as
    ``block_product`` of 1x128-group-quantized input (CUDA, the ``block`` layout, dims
    multiples of ``FP8_BLOCK``, at least ``W8A8_MIN_ROWS`` rows, and above ``W8A8_MAX_ROWS``
    rows K a multiple of ``BLOCK_SCALED_MM_K``): a caller that can quantize the input as it
    computes it (``kernels.silu_and_mul.silu_and_mul_fp8``) may call ``block_product``
    itself and skip writing the bfloat16 input."""
    return (weight.is_cuda and weight_scale.dim() == 2 and rows >= W8A8_MIN_ROWS
            and block_mm_fits(weight.shape[0], weight.shape[1])
            and (rows <= W8A8_MAX_ROWS or weight.shape[1] % BLOCK_SCALED_MM_K == 0))


def block_input_padding(rows: int) -> int:
    """The row multiple that group-quantized input of ``rows`` rows is padded to for
    ``block_product``: ``SCALED_MM_ALIGN`` where ``torch._scaled_mm`` takes it (more than
    ``W8A8_MAX_ROWS`` rows), else 1 (the W8A8 kernel reads only the rows it is given)."""
    return SCALED_MM_ALIGN if rows > W8A8_MAX_ROWS else 1


def block_product(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  rows: int, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Group-quantized input times a ``block`` weight (arguments as ``block_scaled_mm``):
    up to ``W8A8_MAX_ROWS`` rows the weight-streaming kernel on the E4M3 input (its first
    ``rows`` rows), above them ``block_scaled_mm``.

    Returns:
        ``[rows, N]`` in ``dtype``.
    """
    if rows <= W8A8_MAX_ROWS:
        out = fp8_gemv(q[:rows], weight, weight_scale, bias, x_scale=scale)
        return out if dtype == torch.bfloat16 else out.to(dtype)
    return block_scaled_mm(q, scale, weight, weight_scale, rows, bias, dtype)


def block_scaled_mm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    rows: int, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm`` of group-quantized input by a ``block`` weight, plus ``bias``
    (a bfloat16 bias added by cuBLASLt in float32 before the output is rounded, where the
    output is bfloat16: no separate pass over the output; it then differs from a separate
    add by that rounding, at most one bfloat16 ulp of the output).

    Args:
        q: ``[R', K]`` float8_e4m3fn, ``R'`` a multiple of ``SCALED_MM_ALIGN`` (padding rows
            past ``rows``).
        scale: ``[R', K / 128]`` float32, column-major (``quantize_groups(...,
            scales_column_major=True)``).
        weight, weight_scale: ``[N, K]`` E4M3 and its ``[N / 128, K / 128]`` scales.
        rows: the rows to return; bias: ``[N]`` or None; dtype: the output's.
    Returns:
        ``[rows, N]`` in ``dtype``.
    """
    fused = bias is not None and dtype == torch.bfloat16 and bias.dtype == torch.bfloat16
    out = torch._scaled_mm(q, weight.T, scale_a=scale, scale_b=weight_scale.t(), bias=bias if fused else None,
                           out_dtype=torch.bfloat16)[:rows]
    out = out if dtype == torch.bfloat16 else out.to(dtype)
    return out if bias is None or fused else out + bias


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
