"""Row-wise dynamic FP8 (E4M3) quantization: each row of ``x [R, C]`` scaled by its own
``amax / 448`` and rounded to ``float8_e4m3fn``, in one Triton launch (one program per
row, the row read once). Used per token on the activations of the FP8 linears
(``worker/models/fp8.py``); unfused, the same math is about six kernel launches per
linear, which a batch-1 decode step of a 28-layer model would pay 112 times.

The same kernel quantizes 1x``FP8_BLOCK`` groups of activations (``quantize_groups``,
a view of ``x`` with one group a row); ``quantize_blocks_ref`` quantizes a weight in
``FP8_BLOCK`` x ``FP8_BLOCK`` blocks (``worker/models/fp8.py`` says why that layout).

Source: vLLM's ``dynamic_per_token_scaled_fp8_quant`` (the same scaling); the 128x128
weight blocks and 1x128 activation groups as DeepSeek-V3 (arXiv:2412.19437, section 3.3).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite E4M3 value.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
#: Smallest amax a scale is derived from (an all-zero row gets a scale of
#: ``MIN_AMAX / FP8_MAX`` instead of 0, so dividing by it stays finite).
MIN_AMAX = 1e-12
#: Longest row the one-pass kernel takes (held in registers by one program).
MAX_TRITON_COLS = 32768
#: Side of a weight block and length of an activation group sharing one scale in the
#: block layout (DeepSeek-V3's and vLLM's ``weight_block_size [128, 128]``).
FP8_BLOCK = 128


def check_quantize_rows_args(x: torch.Tensor) -> None:
    """Raises ``ValueError`` unless ``x`` is a 2-D floating-point ``[R, C]``."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point [rows, cols], got {tuple(x.shape)} {x.dtype}")


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of ``quantize_rows``."""
    check_quantize_rows_args(x)
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_AMAX)
    scale = amax / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_blocks_ref(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [N, K]`` to E4M3 in ``block`` x ``block`` blocks, each scaled by its own
    ``amax / 448`` (edge blocks may be partial; PyTorch ops, any device).

    Returns:
        ``(w_fp8 [N, K] float8_e4m3fn, scale [ceil(N / block), ceil(K / block)] float32)``
        with ``w ~= w_fp8.float() * scale`` repeated over each block.
    Raises:
        ValueError: ``w`` is not a 2-D floating-point tensor.
    """
    check_quantize_rows_args(w)
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
    blocks = padded.view(nb, block, kb, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale


def quantize_groups_ref(x: torch.Tensor, group: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of ``quantize_groups``; the last group of a row may be partial.

    Returns:
        ``(x_fp8 [R, C] float8_e4m3fn, scale [R, ceil(C / group)] float32)``.
    """
    check_quantize_rows_args(x)
    rows, cols = x.shape
    num_groups = -(-cols // group)
    padded = torch.nn.functional.pad(x, (0, num_groups * group - cols))
    q, scale = quantize_rows_ref(padded.reshape(rows * num_groups, group))
    return q.view(rows, num_groups * group)[:, :cols].contiguous(), scale.view(rows, num_groups)


try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, cols, BLOCK: tl.constexpr,
                              QMAX: tl.constexpr, AMIN: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), AMIN) / QMAX
        tl.store(s_ptr + row, scale)
        q = tl.clamp(tl.math.div_rn(x, scale), -QMAX, QMAX)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x [R, C]`` to E4M3 with its own scale: one Triton launch on
    CUDA (rows up to ``MAX_TRITON_COLS``, last dim contiguous), the reference elsewhere.
    No host sync: safe inside a CUDA-graph capture.

    Returns:
        ``(x_fp8 [R, C] float8_e4m3fn, scale [R, 1] float32)`` with
        ``x ~= x_fp8.float() * scale``; the scale is ``amax(|row|) / 448``.
    Raises:
        ValueError: ``x`` is not a 2-D floating-point tensor.
    """
    check_quantize_rows_args(x)
    rows, cols = x.shape
    if triton is None or not x.is_cuda or cols > MAX_TRITON_COLS or x.stride(1) != 1:
        return quantize_rows_ref(x)
    q = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block = triton.next_power_of_2(cols)
    _quantize_rows_kernel[(rows,)](x, q, scale, x.stride(0), q.stride(0), cols, BLOCK=block,
                                   QMAX=FP8_MAX, AMIN=MIN_AMAX, num_warps=min(16, max(4, block // 1024)))
    return q, scale


def quantize_groups(x: torch.Tensor, group: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each 1 x ``group`` slice of ``x [R, C]`` with its own scale (the activation
    side of the block layout): ``quantize_rows`` of a ``[R * C / group, group]`` view, one
    Triton launch on CUDA where ``C`` is a multiple of ``group``, the reference elsewhere.

    Returns:
        ``(x_fp8 [R, C] float8_e4m3fn, scale [R, ceil(C / group)] float32)``.
    Raises:
        ValueError: ``x`` is not a 2-D floating-point tensor.
    """
    check_quantize_rows_args(x)
    rows, cols = x.shape
    if cols % group or not x.is_contiguous():
        return quantize_groups_ref(x, group)
    q, scale = quantize_rows(x.view(rows * cols // group, group))
    return q.view(rows, cols), scale.view(rows, cols // group)
