"""Row-wise dynamic FP8 (E4M3) quantization: each row of ``x [R, C]`` scaled by its own
``amax / 448`` and rounded to ``float8_e4m3fn``, in one Triton launch (one program per
row, the row read once). Used per token on the activations of the FP8 linears
(``worker/models/fp8.py``); unfused, the same math is about six kernel launches per
linear, which a batch-1 decode step of a 28-layer model would pay 112 times.

1x``FP8_BLOCK`` groups of activations (the block layout's activation side) have a kernel
of their own (``quantize_groups``): one program per row and ``GROUPS_PER_PROGRAM`` groups,
which can pad the rows to a multiple (zero rows, as ``torch._scaled_mm`` needs its rows in
multiples of 16) and write the scales column-major (cuBLASLt's layout for block scales),
so that neither takes a kernel of its own; ``quantize_blocks_ref`` quantizes a weight in
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
#: Groups one program of a group kernel quantizes (a power of two), and its warps: 1,024
#: columns of a row at the default group size, 8 elements (16 bytes of bfloat16) a thread.
#: H100, ``silu_and_mul_fp8`` at 4,096 x 18,944: 135.8 us (95% of the copy rate) against
#: 145.3 with 16 groups; 4 groups and 2 warps 133.3 (bench/fp8_elementwise_bench.py
#: ``--sweep``, docs/benchmarks.md, "FP8 weights").
GROUPS_PER_PROGRAM = 8
GROUP_KERNEL_WARPS = 4


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


def quantize_groups_ref(x: torch.Tensor, group: int = FP8_BLOCK, pad_rows_to: int = 1,
                        scales_column_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of ``quantize_groups`` (arguments and returns as there); the last
    group of a row may be partial."""
    check_quantize_rows_args(x)
    x = _pad_rows(x, pad_rows_to)
    rows, cols = x.shape
    num_groups = -(-cols // group)
    padded = torch.nn.functional.pad(x, (0, num_groups * group - cols))
    q, scale = quantize_rows_ref(padded.reshape(rows * num_groups, group))
    scale = scale.view(rows, num_groups)
    return (q.view(rows, num_groups * group)[:, :cols].contiguous(),
            scale.t().contiguous().t() if scales_column_major else scale)


def group_outputs(rows: int, cols: int, group: int, pad_rows_to: int, scales_column_major: bool,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The empty outputs of a group kernel (``quantize_groups``,
    ``silu_and_mul.silu_and_mul_fp8``) over ``rows`` rows of ``cols`` columns, a multiple of
    ``group``: ``(q [R', cols] float8_e4m3fn, scale [R', cols / group] float32)``, ``R'``
    being ``rows`` padded up to a multiple of ``pad_rows_to``, the scales a column-major
    view (strides ``(1, R')``) when ``scales_column_major``."""
    out_rows, num_groups = rows + -rows % pad_rows_to, cols // group
    q = torch.empty(out_rows, cols, dtype=FP8_DTYPE, device=device)
    if scales_column_major:
        return q, torch.empty(num_groups, out_rows, dtype=torch.float32, device=device).t()
    return q, torch.empty(out_rows, num_groups, dtype=torch.float32, device=device)


def group_grid(out_rows: int, num_groups: int) -> tuple[tuple[int, int], int, int]:
    """``(grid, GROUPS, num_warps)`` of a group kernel writing ``out_rows`` rows of
    ``num_groups`` groups (both > 0; Triton only): one program per row and ``GROUPS``
    groups (``group_tile``), at most ``GROUPS_PER_PROGRAM``, with ``GROUP_KERNEL_WARPS``
    warps (both read at each call, so that bench/fp8_elementwise_bench.py can sweep them)."""
    groups = min(GROUPS_PER_PROGRAM, triton.next_power_of_2(num_groups))
    return (out_rows, triton.cdiv(num_groups, groups)), groups, GROUP_KERNEL_WARPS


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x`` with zero rows appended up to a multiple of ``multiple`` rows."""
    pad = -x.shape[0] % multiple
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


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


    @triton.jit
    def group_tile(num_groups, GROUP: tl.constexpr, GROUPS: tl.constexpr):
        """This program's share of a group kernel's grid ``(rows, ceil(num_groups /
        GROUPS))``: ``(row, offs_g [GROUPS], in_row [GROUPS], cols [GROUPS, GROUP])``, the
        row (int64), its groups, which of them exist, and their columns."""
        row = tl.program_id(0).to(tl.int64)
        offs_g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        cols = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        return row, offs_g, offs_g < num_groups, cols

    @triton.jit
    def store_quantized_groups(y, row, offs_g, in_row, cols, q_ptr, s_ptr, stride_q, stride_sr, stride_sg,
                               QMAX: tl.constexpr, AMIN: tl.constexpr):
        """Quantize the float32 tile ``y [GROUPS, GROUP]`` (``group_tile``'s groups of
        ``row``) per group, ``amax / QMAX`` each, and store the E4M3 values and the scales."""
        scale = tl.maximum(tl.max(tl.abs(y), axis=1), AMIN) / QMAX
        tl.store(s_ptr + row * stride_sr + offs_g * stride_sg, scale, mask=in_row)
        q = tl.clamp(tl.math.div_rn(y, scale[:, None]), -QMAX, QMAX)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=in_row[:, None])

    @triton.jit
    def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, rows, num_groups, stride_x, stride_q, stride_sr, stride_sg,
                                GROUP: tl.constexpr, GROUPS: tl.constexpr, QMAX: tl.constexpr,
                                AMIN: tl.constexpr):
        # Program (row, j): groups j * GROUPS .. of one row, as a [GROUPS, GROUP] tile; a row
        # at or past ``rows`` is padding (read as zeros).
        row, offs_g, in_row, cols = group_tile(num_groups, GROUP, GROUPS)
        x = tl.load(x_ptr + row * stride_x + cols, mask=in_row[:, None] & (row < rows), other=0.0).to(tl.float32)
        store_quantized_groups(x, row, offs_g, in_row, cols, q_ptr, s_ptr, stride_q, stride_sr, stride_sg, QMAX, AMIN)


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


def quantize_groups(x: torch.Tensor, group: int = FP8_BLOCK, pad_rows_to: int = 1,
                    scales_column_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each 1 x ``group`` slice of ``x [R, C]`` with its own scale (the activation
    side of the block layout). One Triton launch on CUDA where ``C`` is a multiple of
    ``group`` (a power of two) and the last dim is contiguous; the reference elsewhere.
    No host sync: safe inside a CUDA-graph capture.

    Args:
        pad_rows_to: append zero rows (each group's scale then ``MIN_AMAX / 448``) up to
            a multiple of this many rows (``torch._scaled_mm`` takes multiples of 16).
        scales_column_major: return the scales as a column-major ``[R', G]`` view (strides
            ``(1, R')``), the layout cuBLASLt's block scaling reads, written so directly.
    Returns:
        ``(x_fp8 [R', C] float8_e4m3fn, scale [R', ceil(C / group)] float32)``, ``R'`` the
        padded row count.
    Raises:
        ValueError: ``x`` is not a 2-D floating-point tensor.
    """
    check_quantize_rows_args(x)
    rows, cols = x.shape
    if (triton is None or not x.is_cuda or cols % group or group & (group - 1) or x.stride(1) != 1
            or (rows and x.stride(0) < cols)):
        return quantize_groups_ref(x, group, pad_rows_to, scales_column_major)
    q, scale = group_outputs(rows, cols, group, pad_rows_to, scales_column_major, x.device)
    num_groups = scale.shape[1]
    if q.shape[0] == 0 or num_groups == 0:
        return q, scale
    grid, groups, warps = group_grid(q.shape[0], num_groups)
    _quantize_groups_kernel[grid](
        x, q, scale, rows, num_groups, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1), GROUP=group,
        GROUPS=groups, QMAX=FP8_MAX, AMIN=MIN_AMAX, num_warps=warps)
    return q, scale
