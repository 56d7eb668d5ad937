"""Mixture-of-experts feed-forward over top-k routed tokens: for each token ``t`` and each
of its ``K`` experts ``e`` with router weight ``w``, ``out[t] += w * down_e(silu(gate_e(x[t]))
* up_e(x[t]))``.

Weights are stacked over experts: ``w13 [E, 2I, H]`` (rows ``[:I]`` gate, ``[I:]`` up, as
HF's ``Qwen3MoeExperts.gate_up_proj``) and ``w2 [E, H, I]``.

The Triton path (CUDA) is a grouped GEMM: the ``T * K`` token-expert pairs are sorted by
expert and each expert's run is padded to a multiple of ``BLOCK_M`` (``moe_align``: one
Triton program up to ``ALIGN_MAX_PAIRS`` pairs, PyTorch ops beyond), so that every
``BLOCK_M`` rows of the sorted list belong to one expert and a program multiplies them by
that expert's weight tile. Two GEMM launches: ``x @ w13[e].T`` with SiLU-and-
mul fused into the epilogue (gate and up tiles are accumulated side by side, so the
``[P, 2I]`` product is never written), then ``@ w2[e].T`` times the router weight, written
per pair; the ``K`` pairs of a token are summed at the end. Nothing reads a count back to
the host and the grid depends only on ``T``, ``K`` and ``E`` (an upper bound on the padded
length; programs past the end exit at once), so a step with the kernel can be captured
in a CUDA graph.

Source: the alignment and grouped GEMM follow the idea of vLLM's ``moe_align_block_size``
and ``fused_moe_kernel`` (themselves after MegaBlocks, Gale et al. 2022); written anew.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def check_fused_moe_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor) -> None:
    """Validate shapes and dtypes of ``fused_moe``'s arguments.

    Raises:
        ValueError: on any mismatch.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, hidden], got {tuple(x.shape)}")
    t, h = x.shape
    if w13.dim() != 3 or w13.shape[2] != h or w13.shape[1] % 2 != 0:
        raise ValueError(f"w13 must be [num_experts, 2 * intermediate, {h}], got {tuple(w13.shape)}")
    e, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (e, h, inter):
        raise ValueError(f"w2 must be [{e}, {h}, {inter}], got {tuple(w2.shape)}")
    if x.dtype != w13.dtype or x.dtype != w2.dtype:
        raise ValueError(f"x, w13 and w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [{t}, top_k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_ids must be int32/int64 and topk_weights floating, got "
                         f"{topk_ids.dtype}, {topk_weights.dtype}")


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """PyTorch reference, the math of HF's ``Qwen3MoeExperts.forward``: a loop over the
    experts that some token chose, each a gather, two matmuls and an ``index_add_``.

    Args:
        x: ``[T, H]``; w13: ``[E, 2I, H]``; w2: ``[E, H, I]``, all one dtype.
        topk_weights: ``[T, K]`` router weights (cast to ``x``'s dtype, as HF does).
        topk_ids: ``[T, K]`` int expert ids in ``[0, E)``.
    Returns:
        ``[T, H]`` in ``x``'s dtype.
    Raises:
        ValueError: see ``check_fused_moe_args``.
    """
    check_fused_moe_args(x, w13, w2, topk_weights, topk_ids)
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    for e in topk_ids.unique().tolist():  # host sync: the reference is not for CUDA graphs
        token_idx, k_idx = torch.where(topk_ids == e)
        gate, up = F.linear(x[token_idx], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weights[token_idx, k_idx, None]
        out.index_add_(0, token_idx, y)
    return out


#: ``(BLOCK_M, BLOCK_N, BLOCK_K)`` when experts get few rows each (decode) and otherwise.
#: ``bench/moe_bench.py`` times the choices on the real shape.
SMALL_BLOCKS = (16, 64, 64)
LARGE_BLOCKS = (64, 64, 64)


def block_sizes(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` for ``num_pairs`` token-expert pairs over
    ``num_experts`` experts: ``SMALL_BLOCKS`` up to 16 pairs per expert, else ``LARGE_BLOCKS``."""
    return SMALL_BLOCKS if num_pairs <= 16 * num_experts else LARGE_BLOCKS


#: Most token-expert pairs ``moe_align`` hands to its one-program Triton kernel; more go
#: through ``moe_align_ref``'s PyTorch ops, whose fixed cost (about 20 small launches)
#: matters only for small steps.
ALIGN_MAX_PAIRS = 4096


def _max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows the padded runs can take: every pair plus ``block_m - 1`` of padding
    per expert hit, rounded up to ``block_m``."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return (rows + block_m - 1) // block_m * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_align_ref``'s result, from one Triton program on CUDA for up to
    ``ALIGN_MAX_PAIRS`` pairs (decode and small prefill steps), else from the reference."""
    if triton is not None and topk_ids.is_cuda and topk_ids.numel() <= ALIGN_MAX_PAIRS:
        return moe_align_triton(topk_ids, num_experts, block_m)
    return moe_align_ref(topk_ids, num_experts, block_m)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the token-expert pairs by expert and pad each expert's run to ``block_m`` rows,
    on the device and without reading anything back to the host (PyTorch ops).

    Args:
        topk_ids: ``[T, K]`` int expert ids; pair ``p = t * K + k`` is ``topk_ids[t, k]``.
    Returns:
        ``(sorted_pairs, block_experts)``: ``sorted_pairs`` int32 ``[max_padded]``, pair ids
        grouped by expert (ascending pair id within an expert), padding slots hold
        ``T * K``; ``block_experts`` int32 ``[max_padded // block_m]``, the expert of each
        ``block_m`` rows, ``num_experts`` for the blocks past the padded end.
        ``max_padded = T*K + min(E, T*K) * (block_m - 1)`` rounded up to ``block_m``, the
        most the padded runs can take (``_max_padded``).
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    start = counts.cumsum(0) - counts
    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(num_pairs, device=device) - start[sorted_experts]
    dest = padded_end[sorted_experts] - padded[sorted_experts] + rank
    max_padded = _max_padded(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_experts


if triton is not None:

    @triton.jit
    def _moe_align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, num_blocks,
                          BLOCK_M: tl.constexpr, E_P2: tl.constexpr, BLOCK_P: tl.constexpr,
                          BLOCK_B: tl.constexpr):
        """One program: count the pairs per expert, then scatter each pair id to its
        expert's padded start plus its rank among the expert's earlier pairs (a cumsum of
        a one-hot ``[BLOCK_P, E]`` tile), then label each block with its expert.
        ``sorted_ptr`` must hold the sentinel ``num_pairs`` already."""
        experts = tl.arange(0, E_P2)
        counts = tl.zeros((E_P2,), dtype=tl.int32)
        for p0 in range(0, num_pairs, BLOCK_P):
            offs = p0 + tl.arange(0, BLOCK_P)
            ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
            counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        padded_end = tl.cumsum(padded, axis=0)
        base = padded_end - padded  # next free row of each expert's run
        for p0 in range(0, num_pairs, BLOCK_P):
            offs = p0 + tl.arange(0, BLOCK_P)
            valid = offs < num_pairs
            ids = tl.load(ids_ptr + offs, mask=valid, other=-1)
            onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
            rank = tl.cumsum(onehot, axis=0) - 1
            dest = tl.sum(onehot * (base[None, :] + rank), axis=1)
            tl.store(sorted_ptr + dest, offs, mask=valid)
            base += tl.sum(onehot, axis=0)
        for b0 in range(0, num_blocks, BLOCK_B):
            blocks = b0 + tl.arange(0, BLOCK_B)
            # A block's expert: how many runs end at or before its first row.
            ended = tl.sum((padded_end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + blocks, tl.minimum(ended, num_experts), mask=blocks < num_blocks)

    @triton.jit
    def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, topk_w_ptr, sorted_ptr, block_expert_ptr,
                         num_pairs, num_experts, top_k, n_out,
                         stride_am, stride_we, stride_wn, stride_wk, stride_om,
                         K_DIM: tl.constexpr, GATED: tl.constexpr, A_PER_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        """``out[p, n] = (a[row(p)] @ w[e, n].T)`` for the ``BLOCK_M`` sorted pairs ``p`` of
        this program's block (expert ``e``) and ``BLOCK_N`` output columns ``n``.
        GATED: ``silu(a @ w[e, n].T) * (a @ w[e, n_out + n].T)``; A_PER_TOKEN: ``row(p) =
        p // top_k`` (else ``p``); MUL_WEIGHT: times ``topk_w[p]``."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert >= num_experts:  # a block past the padded end
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_ptr + offs_m)
        row_mask = pairs < num_pairs
        if A_PER_TOKEN:
            a_rows = pairs // top_k
        else:
            a_rows = pairs
        a_rows = tl.where(row_mask, a_rows, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_out
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K_DIM, BLOCK_K):
            k_mask = offs_k < K_DIM - k0
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if GATED:
                w_up = tl.load(w_ptrs + n_out * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        dtype = out_ptr.dtype.element_ty
        if GATED:
            # Round gate and up to the model dtype first, as the unfused path does.
            gate = acc.to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
            res = act * acc_up.to(dtype)
        else:
            res = acc.to(dtype)
        if MUL_WEIGHT:
            wt = tl.load(topk_w_ptr + pairs, mask=row_mask, other=0.0).to(dtype)
            res = res * wt[:, None]
        out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, res, mask=row_mask[:, None] & n_mask[None, :])


def _gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, topk_weights: torch.Tensor,
          sorted_pairs: torch.Tensor, block_experts: torch.Tensor, top_k: int, gated: bool,
          blocks: tuple[int, int, int]) -> None:
    num_pairs, n_out = out.shape
    k_dim = a.shape[1]
    block_m, block_n, block_k = blocks
    grid = (block_experts.numel(), triton.cdiv(n_out, block_n))
    _moe_gemm_kernel[grid](
        a, w, out, topk_weights, sorted_pairs, block_experts,
        num_pairs, w.shape[0], top_k, n_out,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        K_DIM=k_dim, GATED=gated, A_PER_TOKEN=gated, MUL_WEIGHT=not gated,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_align_ref`` as one Triton program (plus the sentinel fill); the same result,
    bit for bit. Also runs on CPU tensors under ``TRITON_INTERPRET=1``."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    max_padded = _max_padded(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=flat.device)
    block_experts = torch.empty(max_padded // block_m, dtype=torch.int32, device=flat.device)
    e_p2 = triton.next_power_of_2(num_experts)
    block_p = max(16, min(256, 4096 // e_p2))  # the one-hot tile stays at 4096 entries
    _moe_align_kernel[(1,)](flat, sorted_pairs, block_experts, num_pairs, num_experts, block_experts.numel(),
                            BLOCK_M=block_m, E_P2=e_p2, BLOCK_P=block_p, BLOCK_B=64, num_warps=4)
    return sorted_pairs, block_experts


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """The Triton path of ``fused_moe`` (also runs on CPU tensors under
    ``TRITON_INTERPRET=1``, which tests use). Same arguments and result.

    Raises:
        ValueError: bad shapes or dtypes, or a tensor not contiguous.
    """
    check_fused_moe_args(x, w13, w2, topk_weights, topk_ids)
    if triton is None:
        raise ValueError("the fused MoE kernel needs Triton")
    if not (x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("x, w13 and w2 must be contiguous")
    t, h = x.shape
    num_experts, inter, top_k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    num_pairs = t * top_k
    out = torch.zeros_like(x)
    if num_pairs == 0:
        return out
    blocks = block_sizes(num_pairs, num_experts)
    sorted_pairs, block_experts = moe_align(topk_ids, num_experts, blocks[0])
    weights = topk_weights.reshape(-1).contiguous()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gemm(x, w13, act, weights, sorted_pairs, block_experts, top_k, True, blocks)
    per_pair = torch.empty(num_pairs, h, dtype=x.dtype, device=x.device)
    _gemm(act, w2, per_pair, weights, sorted_pairs, block_experts, top_k, False, blocks)
    return per_pair.view(t, top_k, h).sum(dim=1)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """MoE feed-forward of ``x [T, H]`` over its routed experts: the Triton grouped GEMM
    on CUDA, the reference (``fused_moe_ref``) elsewhere.

    Args:
        x: ``[T, H]``; w13: ``[E, 2I, H]`` (gate rows, then up rows); w2: ``[E, H, I]``.
        topk_weights: ``[T, K]`` router weights; topk_ids: ``[T, K]`` int expert ids.
    Returns:
        ``[T, H]`` in ``x``'s dtype.
    Raises:
        ValueError: see ``check_fused_moe_args``; on CUDA also non-contiguous tensors.
    """
    if triton is not None and x.is_cuda:
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
