"""Residual add fused with RMSNorm: ``s = x + residual; out = rms_norm(s) * weight``,
returning ``(out, s)`` in one pass over the row (vLLM's ``fused_add_rms_norm``).

Unfused, a decoder layer spends two launches and an extra round trip through memory
on each of its two norms; fused, one. Rounding follows the unfused PyTorch path: the
sum is rounded to the input dtype first (it is the residual stream), and the norm is
computed from the rounded sum in float32.

Source: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_extension


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

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o,
                             stride_ro, hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < hidden
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = x + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
            tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


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
        hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
    )
    return out, res_out
