"""SwiGLU activation on a fused gate/up projection: ``silu(x[:, :I]) * x[:, I:]`` in one
pass (vLLM's ``silu_and_mul``), instead of a chunk, a SiLU and a multiply.

Source: Shazeer, "GLU Variants Improve Transformer" (2020).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_extension


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
