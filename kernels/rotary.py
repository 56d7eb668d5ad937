"""Rotary position embedding (rotate-half form, as in HF transformers' Llama), applied
in place to the query and key heads of a fused QKV output in one launch.

Unfused, a layer's rotary costs about ten small launches (gathers, casts, negate,
concatenate, multiplies); here it is one, reading each head once.

Source: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021).
"""

from __future__ import annotations

import torch

from kernels import cpu_extension


def check_rotary_args(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Validate shapes and dtypes.

    Raises:
        ValueError: on any mismatch.
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q/k must be [T, heads, head_dim], got {tuple(q.shape)} / {tuple(k.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q {q.dtype} and k {k.dtype} differ")
    if positions.shape != (q.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [{q.shape[0]}] int32/int64, got {tuple(positions.shape)} {positions.dtype}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != q.shape[2] or q.shape[2] % 2:
        raise ValueError(f"cos/sin must be [max_positions, {q.shape[2]}] (even), got {tuple(cos.shape)}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_rows(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``cos``/``sin`` ``[max_positions, D]`` at ``positions [T]``, each as
    ``[T, 1, D]`` in ``dtype`` (broadcast over heads)."""
    return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_rows: torch.Tensor,
                 sin_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, H, D]`` and ``k [T, KVH, D]`` out of place by their rows of the
    tables (``rotary_rows``: ``[T, 1, D]`` in their dtype); the oracle's arithmetic."""
    return q * cos_rows + _rotate_half(q) * sin_rows, k * cos_rows + _rotate_half(k) * sin_rows


def rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference (out of place). ``positions [T]``; ``q [T, H, D]``,
    ``k [T, KVH, D]``; ``cos``/``sin`` ``[max_positions, D]`` float32 with both halves
    equal. Returns the rotated ``(q, k)`` in their dtype."""
    check_rotary_args(positions, q, k, cos, sin)
    return apply_rotary(q, k, *rotary_rows(positions, cos, sin, q.dtype))


try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                       stride_c, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_H: tl.constexpr, HALF_P: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        offs_d = tl.arange(0, HALF_P)
        dmask = offs_d < HALF
        c = tl.load(cos_ptr + pos * stride_c + offs_d, mask=dmask, other=0.0)[None, :]
        s = tl.load(sin_ptr + pos * stride_c + offs_d, mask=dmask, other=0.0)[None, :]
        offs_h = tl.arange(0, BLOCK_H)
        # Query heads, then key heads; each as [BLOCK_H, HALF] halves.
        qmask = (offs_h[:, None] < NUM_HEADS) & dmask[None, :]
        qp = q_ptr + tok * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
        x1 = tl.load(qp, mask=qmask, other=0.0)
        x2 = tl.load(qp + HALF, mask=qmask, other=0.0)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(qp, (f1 * c - f2 * s).to(x1.dtype), mask=qmask)
        tl.store(qp + HALF, (f2 * c + f1 * s).to(x1.dtype), mask=qmask)
        kmask = (offs_h[:, None] < NUM_KV_HEADS) & dmask[None, :]
        kp = k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
        y1 = tl.load(kp, mask=kmask, other=0.0)
        y2 = tl.load(kp + HALF, mask=kmask, other=0.0)
        g1, g2 = y1.to(tl.float32), y2.to(tl.float32)
        tl.store(kp, (g1 * c - g2 * s).to(y1.dtype), mask=kmask)
        tl.store(kp + HALF, (g2 * c + g1 * s).to(y1.dtype), mask=kmask)


def _contiguous_in_head_dim(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The layout the in-place kernels (Triton, C++) read: unit stride along head_dim,
    and cos/sin tables with one layout."""
    return q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` by their positions: in place with one Triton launch on
    CUDA or the C++ kernel on CPU where it builds (``kernels/cpu_extension.py``; both
    compute in float32 and round once), the out-of-place reference elsewhere. Returns
    ``(q, k)``. ``q``/``k`` may be strided views (slices of a fused QKV output) as long
    as ``head_dim`` is contiguous.

    Raises:
        ValueError: shapes, dtypes or strides do not match.
    """
    check_rotary_args(positions, q, k, cos, sin)
    in_place_ok = _contiguous_in_head_dim(q, k, cos, sin) and cos.dtype == sin.dtype == torch.float32
    ext = cpu_extension.load() if q.device.type == "cpu" else None
    if ext is not None and in_place_ok:
        ext.rotary(positions.long().contiguous(), q, k, cos, sin)
        return q, k
    if triton is None or not q.is_cuda:
        return rotary_ref(positions, q, k, cos, sin)
    if not _contiguous_in_head_dim(q, k, cos, sin):
        raise ValueError("q, k, cos and sin must be contiguous in head_dim")
    if not in_place_ok:
        raise ValueError("cos/sin tables must be float32")
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[1], HALF=half,
        BLOCK_H=triton.next_power_of_2(max(num_heads, k.shape[1])), HALF_P=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q, k
