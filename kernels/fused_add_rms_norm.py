"""Residual add fused with RMSNorm: ``s = x + residual; out = rms_norm(s) * weight``,
returning ``(out, s)`` in one pass over the row (vLLM's ``fused_add_rms_norm``).

Unfused, a decoder layer spends two launches and an extra round trip through memory
on each of its two norms; fused, one. Rounding follows the unfused PyTorch path: the
sum is rounded to the input dtype first (it is the residual stream), and the norm is
computed from the rounded sum in float32.

``fused_add_rms_norm_fp8`` goes one step further for a block-scaled FP8 linear that reads
the norm's output (``worker/models/linear.py``, ``Linear.forward_add_rms_norm``): the
normalized row, rounded to the input dtype as it would be stored, is quantized per
1x128 group in the same program (``fp8_quant``'s group math), so the bfloat16 output is
neither written nor read back by a separate quantizer launch.

Source: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); the norm fused
with the FP8 quantization of its output as vLLM's ``rms_norm_dynamic_per_token_quant``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_extension
from kernels.fp8_quant import FP8_BLOCK, FP8_MAX, MIN_AMAX, group_outputs, quantize_groups

#: Widest row ``fused_add_rms_norm_fp8``'s one program holds (as ``fp8_quant.MAX_TRITON_COLS``).
MAX_FUSED_COLS = 32768


def check_rms_norm_args(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    """Validate shapes and dtypes.

    Raises:
        ValueError: on any mismatch.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, hidden], got {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [{x.shape[1]}], got {tuple(weight.shape)}")


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference. ``x``, ``residual``: ``[T, H]``; ``weight``: ``[H]``.
    Returns ``(rms_norm(x + residual) * weight, x + residual)``, both ``[T, H]``."""
    check_rms_norm_args(x, residual, weight)
    if residual is not None:
        x = x + residual
    return F.rms_norm(x, (x.shape[-1],), weight, eps), x


try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    from kernels.fp8_quant import store_quantized_groups

    @triton.jit
    def _add_and_rstd(x_ptr, res_ptr, res_out_ptr, row, offs, mask, stride_x, stride_r, stride_ro, hidden, eps,
                      HAS_RESIDUAL: tl.constexpr):
        """One row's ``x (+ residual)``, stored to ``res_out`` when there is a residual, in
        the input dtype and in float32, and its ``1 / rms``: the math both norm kernels share
        (one reduction, so the fused FP8 kernel's rstd is the plain kernel's, bit for bit)."""
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = x + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
            tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
        return x, xf, rstd

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o,
                             stride_ro, hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < hidden
        _, xf, rstd = _add_and_rstd(x_ptr, res_ptr, res_out_ptr, row, offs, mask, stride_x, stride_r, stride_ro,
                                   hidden, eps, HAS_RESIDUAL)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _add_rms_norm_fp8_kernel(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, rows, num_groups, stride_x,
                                 stride_r, stride_ro, stride_q, stride_sr, stride_sg, hidden, eps,
                                 HAS_RESIDUAL: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                                 QMAX: tl.constexpr, AMIN: tl.constexpr):
        # ``_add_rms_norm_kernel``'s math on the same 1-D row (``_add_and_rstd``), its
        # output rounded to the input dtype, then viewed as [GROUPS, GROUP] and quantized per
        # group as ``fp8_quant.quantize_groups`` does. A row at or past ``rows`` is padding:
        # zeros in, a zero row and the minimum scale out.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, GROUPS * GROUP)
        mask = (offs < hidden) & (row < rows)
        x, xf, rstd = _add_and_rstd(x_ptr, res_ptr, res_out_ptr, row, offs, mask, stride_x, stride_r, stride_ro,
                                    hidden, eps, HAS_RESIDUAL)
        w = tl.load(w_ptr + offs, mask=offs < hidden, other=0.0).to(tl.float32)
        y = tl.reshape((xf * rstd * w).to(x.dtype).to(tl.float32), (GROUPS, GROUP))
        offs_g = tl.arange(0, GROUPS)
        cols = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        store_quantized_groups(y, row, offs_g, offs_g < num_groups, cols, q_ptr, s_ptr, stride_q, stride_sr,
                               stride_sg, QMAX, AMIN)


def _num_warps(block: int) -> int:
    """Warps of a one-row norm program over ``block`` columns (both norm kernels use it,
    so that they reduce a row in the same order)."""
    return min(max(block // 256, 1), 16)


def _contiguous_in_hidden(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """The layout the fused kernels (Triton, C++) read: rows with unit stride."""
    return x.stride(1) == 1 and (residual is None or residual.stride(1) == 1) and weight.is_contiguous()


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)``: one Triton launch on CUDA,
    the C++ kernel on CPU where it builds (``kernels/cpu_extension.py``), the reference
    elsewhere. With ``residual=None`` the second output is ``x``.

    Args:
        x, residual: ``[num_tokens, hidden]``, same dtype; contiguous in ``hidden``.
        weight: ``[hidden]``.
        eps: added to the mean square.

    Raises:
        ValueError: shapes, dtypes or strides do not match.
    """
    check_rms_norm_args(x, residual, weight)
    ext = cpu_extension.load() if x.device.type == "cpu" else None
    if ext is not None and _contiguous_in_hidden(x, residual, weight):
        out = torch.empty_like(x)
        res_out = torch.empty_like(x) if residual is not None else x
        ext.fused_add_rms_norm(out, res_out, x, residual, weight, eps)
        return out, res_out
    if triton is None or not x.is_cuda:
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    if not _contiguous_in_hidden(x, residual, weight):
        raise ValueError("x, residual and weight must be contiguous in the hidden dimension")
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if num_tokens == 0:
        return out, res_out
    block = triton.next_power_of_2(hidden)
    res = residual if residual is not None else x
    _add_rms_norm_kernel[(num_tokens,)](
        x, res, weight, out, res_out, x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block),
    )
    return out, res_out


def fused_add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                           pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm``'s output quantized per 1 x ``FP8_BLOCK`` group
    (``fp8_quant.quantize_groups`` with ``scales_column_major``), in one launch: the input
    of a block-scaled FP8 linear (``worker/models/fp8.py``, ``block_product``). Bit for
    bit the two kernels in turn; the two of them (or their references) off CUDA or where
    ``hidden`` is not a multiple of ``FP8_BLOCK``.

    Args:
        x, residual: ``[T, hidden]``, same dtype, contiguous in ``hidden``; ``residual``
            may be None (then the third output is ``x``).
        weight: ``[hidden]``.
        eps: added to the mean square.
        pad_rows_to: zero rows appended to the quantized output up to a multiple of this
            many (as ``quantize_groups``).
    Returns:
        ``(q [T', hidden] float8_e4m3fn, scale [T', hidden / 128] float32, column-major,
        x + residual [T, hidden])``, ``T'`` the padded row count.
    Raises:
        ValueError: shapes, dtypes or strides do not match.
    """
    check_rms_norm_args(x, residual, weight)
    rows, hidden = x.shape
    if (triton is None or not x.is_cuda or hidden % FP8_BLOCK or not _contiguous_in_hidden(x, residual, weight)
            or hidden > MAX_FUSED_COLS):
        out, res_out = fused_add_rms_norm(x, residual, weight, eps)
        return *quantize_groups(out, FP8_BLOCK, pad_rows_to, scales_column_major=True), res_out
    q, scale = group_outputs(rows, hidden, FP8_BLOCK, pad_rows_to, True, x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    if q.shape[0] == 0:
        return q, scale, res_out
    num_groups = scale.shape[1]
    groups = triton.next_power_of_2(num_groups)
    res = residual if residual is not None else x
    _add_rms_norm_fp8_kernel[(q.shape[0],)](
        x, res, weight, q, scale, res_out, rows, num_groups, x.stride(0), res.stride(0), res_out.stride(0),
        q.stride(0), scale.stride(0), scale.stride(1), hidden, eps, HAS_RESIDUAL=residual is not None,
        GROUP=FP8_BLOCK, GROUPS=groups, QMAX=FP8_MAX, AMIN=MIN_AMAX, num_warps=_num_warps(groups * FP8_BLOCK))
    return q, scale, res_out
