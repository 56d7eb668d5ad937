"""SwiGLU activation on a fused gate/up projection: ``silu(x[:, :I]) * x[:, I:]`` in one
pass (vLLM's ``silu_and_mul``), instead of a chunk, a SiLU and a multiply.

Source: Shazeer, "GLU Variants Improve Transformer" (2020).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_extension
from kernels.fp8_quant import FP8_BLOCK, FP8_MAX, MIN_AMAX, group_grid, group_outputs, quantize_groups_ref


def check_silu_and_mul_args(x: torch.Tensor) -> None:
    """Raises ``ValueError`` unless ``x`` is ``[num_tokens, 2 * I]``."""
    if x.dim() != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"x must be [num_tokens, 2 * intermediate], got {tuple(x.shape)}")


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """PyTorch reference: ``[T, 2I] -> [T, I]``."""
    check_silu_and_mul_args(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    from kernels.fp8_quant import group_tile, store_quantized_groups

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
        # Round SiLU to the input dtype before the product, as the unfused path does.
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        tl.store(out_ptr + row * stride_o + offs, act * up, mask=mask)


    @triton.jit
    def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, rows, inter, num_groups, stride_x, stride_q, stride_sr,
                                 stride_sg, GROUP: tl.constexpr, GROUPS: tl.constexpr, QMAX: tl.constexpr,
                                 AMIN: tl.constexpr):
        # ``_silu_and_mul_kernel``'s product, rounded to the input dtype as it stores it, then
        # the group quantizer's math (``fp8_quant``) on a [GROUPS, GROUP] tile of one row.
        row, offs_g, in_row, cols = group_tile(num_groups, GROUP, GROUPS)
        mask = in_row[:, None] & (row < rows)
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
        y = ((gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up).to(tl.float32)
        store_quantized_groups(y, row, offs_g, in_row, cols, q_ptr, s_ptr, stride_q, stride_sr, stride_sg, QMAX, AMIN)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]`` (``[T, 2I] -> [T, I]``): one Triton
    launch on CUDA, the C++ kernel on CPU where it builds (``kernels/cpu_extension.py``),
    the reference elsewhere.

    Raises:
        ValueError: ``x`` is not ``[T, 2I]`` or not contiguous in its last dimension.
    """
    check_silu_and_mul_args(x)
    ext = cpu_extension.load() if x.device.type == "cpu" else None
    if ext is not None and x.stride(1) == 1:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
        ext.silu_and_mul(out, x)
        return out
    if triton is None or not x.is_cuda:
        return silu_and_mul_ref(x)
    if x.stride(1) != 1:
        raise ValueError(f"x must be contiguous in its last dimension, strides {x.stride()}")
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = 1024
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)
    return out


def silu_and_mul_fp8(x: torch.Tensor, pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_and_mul(x)`` quantized per 1 x ``FP8_BLOCK`` group (``fp8_quant.quantize_groups``
    with ``scales_column_major``), in one pass: the input of a block-scaled FP8 down
    projection (``worker/models/fp8.py``), without writing and reading back the bfloat16
    product. Bit for bit the two kernels in turn; the reference off CUDA or where the
    intermediate size is not a multiple of ``FP8_BLOCK``.

    Args:
        x: ``[T, 2I]`` ``[gate | up]``, contiguous in its last dimension.
        pad_rows_to: zero rows appended up to a multiple of this many (as ``quantize_groups``).
    Returns:
        ``(q [T', I] float8_e4m3fn, scale [T', I / 128] float32, column-major)``.
    Raises:
        ValueError: ``x`` is not ``[T, 2I]``.
    """
    check_silu_and_mul_args(x)
    rows, inter = x.shape[0], x.shape[1] // 2
    if triton is None or not x.is_cuda or inter % FP8_BLOCK or x.stride(1) != 1:
        return quantize_groups_ref(silu_and_mul_ref(x), FP8_BLOCK, pad_rows_to, scales_column_major=True)
    q, scale = group_outputs(rows, inter, FP8_BLOCK, pad_rows_to, True, x.device)
    num_groups = scale.shape[1]
    if q.shape[0] == 0 or num_groups == 0:
        return q, scale
    grid, groups, warps = group_grid(q.shape[0], num_groups)
    _silu_and_mul_fp8_kernel[grid](
        x, q, scale, rows, inter, num_groups, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
        GROUP=FP8_BLOCK, GROUPS=groups, QMAX=FP8_MAX, AMIN=MIN_AMAX, num_warps=warps)
    return q, scale
