"""Weight-streaming FP8 product for few rows (decode, 1-64 rows): ``x [M, K]``
(bfloat16/float16, unquantized) times an E4M3 weight ``[N, K]`` dequantized in registers
(W8A16); or, given ``x`` in E4M3 with one scale per row and 128 columns (``x_scale``,
``fp8_quant.quantize_groups``), FP8 times FP8 on the tensor cores, each step's partial
product scaled by the input's scales too (W8A8, its own plans: ``W8A8_PLANS``).

A decode step multiplies a handful of rows by every weight of the model, so its time is
the time to read the weight bytes. cuBLASLt's FP8 GEMM reads them at about half the copy
rate at 1-64 rows on an H100 (docs/benchmarks.md, "FP8 weights"), and needs the
activations quantized first (one more launch per product). This kernel instead streams
the weight:

- grid ``(ceil(N / BLOCK_N), split)``: each program owns ``BLOCK_N`` output channels and
  a ``k_per_split`` slice of K, walks it in ``BLOCK_K`` steps (a ``BLOCK_N x BLOCK_K``
  FP8 tile, contiguous along K, pipelined ``num_stages`` deep), converts the tile to the
  activations' dtype and multiplies it with the ``BLOCK_M x BLOCK_K`` activation tile
  (rows padded to ``BLOCK_M`` = 16, 32 or 64 by masks) on the tensor cores, accumulating
  in float32;
- the product's orientation (``swap_ab``): ``x @ w^T`` (the weight tile is the second
  operand) or, swapped, ``(w @ x^T)^T``: the weight tile is the first operand, which
  Hopper's wgmma can read from registers, where the conversion leaves it, and the padded
  rows become wgmma's narrow N (8-256) instead of its M (64 a warp group): the "swap AB"
  of vLLM's CUTLASS FP8 GEMM for small M, and its Machete mixed-input kernel, which feeds
  the converted weight to wgmma from registers;
- split-K: where ``N / BLOCK_N`` programs would leave SMs idle (o_proj and down_proj of a
  7B model have only 28-56 tiles for 132 SMs), K is cut so that about ``programs_per_sm``
  programs run per SM; the float32 partial sums go to a workspace ``[split, M, N]``.
  Serially (``serial_split_k``, CUTLASS's "serial split-K" and stream-K fix-up): each
  slice then adds one to its tile's arrival counter (int32, ``_tile_counters``), and the
  last to arrive adds the partials and the bias, casts, writes the output and zeroes the
  counter; otherwise a second small kernel does that sum;
- the weight tile is read by masked loads or, with ``tma``, by the Tensor Memory
  Accelerator from a host tensor descriptor (Hopper; out-of-range rows and columns read as
  zeros);
- scales: per output channel (``scale [N]``, applied once at the end) or per
  ``FP8_BLOCK x FP8_BLOCK`` block (``scale [ceil(N / 128), ceil(K / 128)]``; ``BLOCK_K``
  divides 128 and ``k_per_split`` is a multiple of 128, so each step's partial product
  is multiplied by one scale per output channel).

The launch parameters per row bucket are one table, ``PLANS`` (tuned with
``bench/fp8_gemm_bench.py --sweep``). No host sync and no data-dependent launch:
CUDA-graph capturable. Shapes are static per graph, so the launch plan (``plan``) is
fixed per captured batch size.

Source: the split-K GEMV scheme of FasterTransformer / TensorRT-LLM's weight-only
kernels and vLLM's Triton ``w8a8_block_fp8_matmul`` (block-scale indexing).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.fp8_quant import FP8_BLOCK, FP8_DTYPE
from kernels.gpu_facts import num_sms

#: Smallest K slice one program streams (fewer steps would not fill the pipeline).
MIN_K_PER_SPLIT = 512
#: Largest row count the kernel takes (``BLOCK_M`` up to this; decode batches).
MAX_ROWS = 64


@dataclass(frozen=True)
class LaunchConfig:
    """The tunable launch parameters of one row bucket (``PLANS``): output channels per
    program, warps, pipeline depth, split-K target (programs per SM), orientation, how
    the weight tile is read (TMA or loads) and how split-K partials are summed."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 4
    swap_ab: bool = False
    tma: bool = False
    serial_split_k: bool = True


#: The launch configuration per row bucket (``BLOCK_M``: rows padded to 16, 32 or 64), the
#: one place to change after ``bench/fp8_gemm_bench.py --sweep``: each the best single plan
#: of the H100 sweeps over Qwen2.5-7B's four projections (
#: bench/results/fp8_gemm_sweep_h100.json, then fp8_gemm_sweep_s7_h100.json for 32 and 64
#: rows). Per layer: 0.115 ms at 1 and 16 rows (cuBLASLt 0.133), 0.138 ms at 32 (0.140),
#: 0.186 ms at 64 rows, where cuBLASLt's 0.159 ms wins (``fp8.GEMV_MAX_ROWS`` is 32). The
#: swapped operands (the weight as the wgmma register operand) were never better. Split-K
#: summed in the kernel (``serial_split_k``): 0.110 ms at 1 row and 0.113 at 16, against
#: 0.1135 and 0.115 with a second launch (bench/results/s12/fp8_gemm_tma_h100.json).
PLANS: dict[int, LaunchConfig] = {
    16: LaunchConfig(block_n=64, num_warps=4, num_stages=3, programs_per_sm=4, swap_ab=False),
    32: LaunchConfig(block_n=64, num_warps=4, num_stages=3, programs_per_sm=4, swap_ab=False),
    64: LaunchConfig(block_n=128, num_warps=4, num_stages=3, programs_per_sm=4, swap_ab=False),
}
#: The launch configuration of the W8A8 kernel (E4M3 input with ``x_scale``) per row
#: bucket, where it differs from ``PLANS``. 17-32 rows: the best single plan of
#: bench/results/fp8_gemm_w8a8_sweep32_h100.json, its split-K summed by a second launch
#: (``fp8_linear`` at 32 rows: 0.125 ms a layer of Qwen2.5-7B's four projections, 0.130
#: with the tile counters; bench/results/s12/fp8_gemm_tma_h100.json). 33-64 rows: the best
#: single plan with the weight tile fetched by TMA (``bench/fp8_gemm_bench.py --rows
#: 1,16,32,64 --sweep --grid ...``, bench/results/s12/fp8_gemm_tma_sweep_h100.json):
#: ``fp8_linear`` at 64 rows 0.138 ms a layer, against 0.148 under the plan before and
#: 0.156 for cuBLASLt's block ``_scaled_mm``. One program per SM (a short split) and a
#: deeper pipeline suit TMA.
W8A8_PLANS: dict[int, LaunchConfig] = {
    32: LaunchConfig(block_n=64, num_warps=4, num_stages=3, programs_per_sm=4, swap_ab=True, serial_split_k=False),
    64: LaunchConfig(block_n=64, num_warps=4, num_stages=4, programs_per_sm=1, swap_ab=False, tma=True),
}


@dataclass(frozen=True)
class GemvPlan:
    """Launch parameters of one ``fp8_gemv`` shape (see the module docstring)."""

    block_m: int
    block_n: int
    block_k: int
    split: int
    k_per_split: int
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    tma: bool = False
    serial_split_k: bool = True


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_rows(m: int) -> int:
    """``BLOCK_M`` for ``m`` rows: the power of two at least ``m`` and 16 (a ``PLANS`` key)."""
    return max(16, 1 << (m - 1).bit_length())


def plan(m: int, n: int, k: int, num_sms: int, config: LaunchConfig | None = None,
         block_k: int = FP8_BLOCK) -> GemvPlan:
    """The launch plan for ``[m, k] x [n, k]^T`` on a GPU with ``num_sms`` SMs, under
    ``config`` (default ``PLANS[block_rows(m)]``): ``split`` so that
    ``ceil(n / block_n) * split`` reaches ``programs_per_sm * num_sms`` (each slice at
    least ``MIN_K_PER_SPLIT`` long), slices a multiple of ``FP8_BLOCK``.

    Raises:
        ValueError: ``m`` outside ``1..MAX_ROWS``, or ``block_k`` not dividing ``FP8_BLOCK``.
    """
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"fp8_gemv takes 1..{MAX_ROWS} rows, got {m}")
    if FP8_BLOCK % block_k:
        raise ValueError(f"block_k must divide {FP8_BLOCK}, got {block_k}")
    block_m = block_rows(m)
    c = config or PLANS[block_m]
    tiles_n = _cdiv(n, c.block_n)
    target = c.programs_per_sm * num_sms
    split = 1 if tiles_n >= target else max(1, min(_cdiv(target, tiles_n), k // MIN_K_PER_SPLIT))
    k_per_split = _cdiv(_cdiv(k, split), FP8_BLOCK) * FP8_BLOCK
    split = _cdiv(k, k_per_split)
    return GemvPlan(block_m, c.block_n, block_k, split, k_per_split, c.num_warps, c.num_stages, c.swap_ab, c.tma,
                    c.serial_split_k)


def fp8_gemv_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of ``fp8_gemv``: ``x`` (unrounded) times the dequantized weight
    in float32, plus ``bias``; ``[M, N]`` in ``x``'s dtype."""
    out = x.float() @ dequantize_weight(weight, weight_scale).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight [N, K]`` (E4M3) times its scales in ``dtype``: ``weight_scale`` 1-D ``[N]``
    (per channel) or 2-D ``[ceil(N / 128), ceil(K / 128)]`` (per 128x128 block)."""
    n, k = weight.shape
    w = weight.float()
    if weight_scale.dim() == 2:
        full = weight_scale.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
        return (w * full[:n, :k]).to(dtype)
    return (w * weight_scale.reshape(-1, 1).float()).to(dtype)


def check_gemv_args(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, x_scale: torch.Tensor | None = None) -> None:
    """Raises ``ValueError`` on shapes or dtypes ``fp8_gemv`` does not take."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] expected, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight must be {FP8_DTYPE}, got {weight.dtype}")
    if x_scale is not None:
        groups = -(-x.shape[1] // FP8_BLOCK)
        if x.dtype != FP8_DTYPE or x_scale.dim() != 2 or x_scale.shape[0] < x.shape[0] or x_scale.shape[1] != groups:
            raise ValueError(f"an x_scale takes an {FP8_DTYPE} x and is [>= {x.shape[0]}, {groups}], got x "
                             f"{x.dtype} and x_scale {tuple(x_scale.shape)}")
    elif x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    n, k = weight.shape
    blocks = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    if tuple(weight_scale.shape) not in ((n,), blocks):
        raise ValueError(f"weight_scale must be [{n}] or {list(blocks)}, got {tuple(weight_scale.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")


try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    triton = None

if triton is not None:
    #: Columns per input scale of W8A8 (``x_scale``), as ``quantize_groups`` makes them.
    FP8_GROUP = tl.constexpr(FP8_BLOCK)

    @triton.jit
    def _fp8_gemv_kernel(x_ptr, w_ptr, w_desc, s_ptr, xs_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                         stride_xm, stride_wn, stride_om, stride_sn, stride_xsm, stride_xsk, k_per_split, split,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SCALE_BLOCK: tl.constexpr, SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr,
                         HAS_BIAS: tl.constexpr, X_SCALED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         USE_TMA: tl.constexpr, SERIAL: tl.constexpr, W_SCALED: tl.constexpr = True):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
        if SWAP_AB:  # acc^T [BLOCK_N, BLOCK_M]: the weight tile is the first operand
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            if USE_TMA:  # the copy engine fetches the tile; K's tail and N's edge read as zeros
                w = w_desc.load([pid_n * BLOCK_N, k0])
            else:
                w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            if SWAP_AB:
                part = tl.dot(w.to(x.dtype), tl.trans(x), input_precision=DOT_PRECISION)
            else:
                part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
            if X_SCALED:  # E4M3 input: one scale per row and 128 columns (W8A8)
                sx = tl.load(xs_ptr + offs_m * stride_xsm + (k0 // FP8_GROUP) * stride_xsk, mask=mask_m, other=0.0)
                if SWAP_AB:
                    part = part * sx[None, :]
                else:
                    part = part * sx[:, None]
            if SCALE_BLOCK > 0:  # one scale per output channel for this step's 128 columns
                s = tl.load(s_ptr + (offs_n // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK, mask=mask_n, other=0.0)
                if SWAP_AB:
                    acc += part * s[:, None]
                else:
                    acc += part * s[None, :]
            else:
                acc += part
        if SWAP_AB:
            acc = tl.trans(acc)
        if SCALE_BLOCK == 0 and W_SCALED:  # per channel; a 16-bit weight has none (kernels/gemv.py)
            acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K and not SERIAL:
            tl.store(part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)
        elif SPLIT_K:
            # Serial split-K: each slice stores its partial sums; the last of a tile's
            # slices to arrive (a counter per tile) adds them all and writes the output,
            # then zeroes the counter for the next launch. No second launch.
            tl.store(part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == split - 1:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s_k in range(split):
                    acc += tl.load(part_ptr + (s_k * M + offs_m[:, None]) * N + offs_n[None, :], mask=mask,
                                   other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                         mask=mask)
                tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=mask)

    @triton.jit
    def _splitk_sum_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om, split, BLOCK: tl.constexpr,
                           HAS_BIAS: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(split):
            acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
        n = offs % N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + (offs // N) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


#: Tiles (``ceil(N / block_n)``) the per-device split-K counters cover.
MAX_TILES = 1 << 16


@functools.cache
def _tile_counters(device: torch.device) -> torch.Tensor:
    """int32 ``[MAX_TILES]`` zeros on ``device``: the serial split-K's arrival counter per
    output tile, back at zero after every launch (the last slice of a tile resets it).
    Launches on one stream run one after another, so they can share it."""
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None = None, gemv_plan: GemvPlan | None = None,
             x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(weight).T + bias`` for few rows, the weight streamed once: W8A16, or
    W8A8 when ``x`` is E4M3 with ``x_scale`` (the tensor cores then multiply FP8 by FP8,
    and the weight tile is not converted).

    Args:
        x: ``[M, K]`` bfloat16 or float16 (float32 under the Triton interpreter), or
            float8_e4m3fn with ``x_scale``; ``M`` in ``1..MAX_ROWS``, last dim contiguous.
        x_scale: with an E4M3 ``x``: float32 ``[M', K / 128]`` (``M' >= M``, any strides),
            ``x ~= x_fp8 * scale`` per row and 128 columns (``quantize_groups``).
        weight: ``[N, K]`` float8_e4m3fn, row-major.
        weight_scale: float32, 1-D ``[N]`` (per channel) or 2-D
            ``[ceil(N / 128), ceil(K / 128)]`` (per 128x128 block).
        bias: ``[N]`` or None.
        gemv_plan: launch parameters (default ``plan`` for this shape and GPU).
    Returns:
        ``[M, N]`` in ``x``'s dtype, bfloat16 for an E4M3 ``x``.
    Raises:
        ValueError: see ``check_gemv_args`` and ``plan``.
        RuntimeError: Triton is not installed.
    """
    check_gemv_args(x, weight, weight_scale, bias, x_scale)
    if triton is None:
        raise RuntimeError("fp8_gemv needs Triton")
    m, k = x.shape
    n = weight.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    w8a8 = x_scale is not None
    p = gemv_plan or plan(m, n, k, num_sms(x.device),
                          W8A8_PLANS.get(block_rows(m)) if w8a8 else None)
    block_scales = weight_scale.dim() == 2
    scale = weight_scale.float().contiguous()
    out = torch.empty(m, n, dtype=torch.bfloat16 if w8a8 else x.dtype, device=x.device)
    part = torch.empty(p.split, m, n, dtype=torch.float32, device=x.device) if p.split > 1 else out
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    xs = x_scale if w8a8 else scale
    tiles_n = triton.cdiv(n, p.block_n)
    serial = p.serial_split_k and p.split > 1 and tiles_n <= MAX_TILES
    counts = _tile_counters(x.device) if serial else out
    w_desc = TensorDescriptor.from_tensor(weight, [p.block_n, p.block_k]) if p.tma else None
    _fp8_gemv_kernel[(tiles_n, p.split)](
        x, weight, w_desc, scale, xs, bias_arg, out, part, counts, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0), scale.stride(0) if block_scales else 0, xs.stride(0) if w8a8 else 0,
        xs.stride(1) if w8a8 else 0, p.k_per_split, p.split, BLOCK_M=p.block_m, BLOCK_N=p.block_n,
        BLOCK_K=p.block_k, SCALE_BLOCK=FP8_BLOCK if block_scales else 0, SPLIT_K=p.split > 1, SWAP_AB=p.swap_ab,
        HAS_BIAS=has_bias, X_SCALED=w8a8,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", USE_TMA=p.tma, SERIAL=serial,
        num_warps=p.num_warps, num_stages=p.num_stages)
    if p.split > 1 and not serial:
        block = 1024
        _splitk_sum_kernel[(triton.cdiv(m * n, block),)](part, bias_arg, out, m, n, out.stride(0), p.split,
                                                         BLOCK=block, HAS_BIAS=has_bias)
    return out
