"""Weight-streaming product of a few rows by a 16-bit weight (decode at 1-16 sequences):
``x [M, K]`` times ``weight [N, K]`` (bfloat16 or float16), through the kernel of
``kernels/fp8_gemv.py`` without weight scales (``W_SCALED=False``; its tile conversion is
then a no-op): each program streams ``BLOCK_N`` output channels of one K slice, rows
padded to 16 on the tensor cores, split-K summed in the kernel by the last slice to
arrive, the weight tile read by TMA on Hopper and later.

Why: a decode step's time is the time to read the weights, and at one row cuBLAS (torch
2.11, CUDA 13, H200) reads Qwen2.5-7B's projections at 56-87% of the copy rate, adding a
split-K reduce launch to o_proj and down_proj; this kernel reads gate_up at 98%, down at
88% and o at 60%, and loses on qkv (65% against 69%; ``python bench/gemv_bench.py``,
bench/results/s19/gemv16_m1.json). One plan (``PLAN``) is the best single configuration
over the four projections there.

Source: the split-K GEMV of FasterTransformer / TensorRT-LLM's weight-only kernels, as
``fp8_gemv``.
"""

from __future__ import annotations

import torch

from kernels.fp8_gemv import LaunchConfig, _tile_counters, plan, triton
from kernels.gpu_facts import has_tma, num_sms

#: Most rows ``gemv`` takes (one 16-row tile; the weight bytes, not the rows, set its time).
MAX_ROWS = 16
#: Weight dtypes ``gemv`` takes on a GPU (float32 too under the Triton interpreter).
WEIGHT_DTYPES = (torch.bfloat16, torch.float16)
#: The launch configuration (H200 sweep above): 64 channels a program, 3 stages, about
#: two programs per SM (split-K where the channel tiles are fewer), TMA where there is.
PLAN = LaunchConfig(block_n=64, num_warps=4, num_stages=3, programs_per_sm=2, tma=True)

if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from kernels.fp8_gemv import _fp8_gemv_kernel


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``worker.models.linear.linear`` runs ``x @ weight.T`` here: a CUDA product
    of 1 to ``MAX_ROWS`` rows by a contiguous 16-bit ``[N, K]`` weight, Triton installed."""
    return (triton is not None and x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and weight.dtype in WEIGHT_DTYPES and x.dtype == weight.dtype and weight.dim() == 2
            and weight.is_contiguous())


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: LaunchConfig = PLAN) -> torch.Tensor:
    """``x @ weight.T + bias``, the weight streamed once.

    Args:
        x: ``[M, K]``, ``M`` in ``1..MAX_ROWS``, bfloat16 or float16 (float32 under the
            Triton interpreter), the weight's dtype, last dim contiguous.
        weight: ``[N, K]`` of ``x``'s dtype, row-major.
        bias: ``[N]`` or None.
        config: launch parameters (``PLAN``); TMA is used only on Hopper or later and
            when the weight's rows are 16-byte aligned.
    Returns:
        ``[M, N]`` in ``x``'s dtype. No host sync: CUDA-graph capturable.
    Raises:
        ValueError: shapes or dtypes it does not take.
        RuntimeError: Triton is not installed.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x [M <= {MAX_ROWS}, K] and weight [N, K] expected, got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or (x.is_cuda and x.dtype not in WEIGHT_DTYPES):
        raise ValueError(f"x and weight must share a 16-bit dtype, got {x.dtype} and {weight.dtype}")
    n, k = weight.shape
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if triton is None:
        raise RuntimeError("gemv needs Triton")
    m = x.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    tma = config.tma and has_tma(x.device) and (k * weight.element_size()) % 16 == 0 and weight.data_ptr() % 16 == 0
    p = plan(m, n, k, num_sms(x.device), config)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(p.split, m, n, dtype=torch.float32, device=x.device) if p.split > 1 else out
    tiles_n = triton.cdiv(n, p.block_n)
    counts = _tile_counters(x.device) if p.split > 1 else out
    w_desc = TensorDescriptor.from_tensor(weight, [p.block_n, p.block_k]) if tma else None
    bias_arg = bias if bias is not None else out
    _fp8_gemv_kernel[(tiles_n, p.split)](
        x, weight, w_desc, out, out, bias_arg, out, part, counts, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0), 0, 0, 0, p.k_per_split, p.split, BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
        SCALE_BLOCK=0, SPLIT_K=p.split > 1, SWAP_AB=False, HAS_BIAS=bias is not None, X_SCALED=False,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", USE_TMA=tma, SERIAL=True, W_SCALED=False,
        num_warps=p.num_warps, num_stages=p.num_stages)
    return out
