"""Varlen attention over the paged KV cache, for prefill chunks and decode in one call.

Each sequence ``b`` contributes ``query_len_b = query_start_loc[b+1] - query_start_loc[b]``
query tokens, which are the *last* ``query_len_b`` of its ``seq_lens[b]`` context tokens;
all ``seq_lens[b]`` keys and values (earlier context and the new tokens) are already in
the cache. Attention is causal: the query at absolute position ``p`` sees keys ``0..p``.
A decode token is the case ``query_len_b == 1``; a prefill chunk with cached context
(prefix caching, chunked prefill) is ``1 < query_len_b <= seq_lens[b]``.

Sliding-window attention (Mistral, Gemma 3's local layers): with ``sliding_window = w``
the query at position ``p`` sees only keys ``k`` with ``p - w < k <= p``, i.e. its last
``w`` positions itself included, as transformers' ``sliding_window_overlay`` defines it
(``kv_idx > q_idx - sliding_window``). Blocks wholly before a query's window are never
read, so their block-table entries may point anywhere valid (a freed sequence head).

FP8 cache (``float8_e4m3fn``): entries are ``x / scale`` (``kernels/kv_cache_write.py``);
both implementations dequantize on load (``entry * k_scale``, ``entry * v_scale``, one
per-tensor scale each), and with an fp8 cache the reference always reads K/V from the
cache, never this step's unquantized ``key``/``value``, so that it sees what Triton sees.

Source: the varlen-over-paged-cache formulation of vLLM's ``unified_attention`` and of
FlashAttention-2's ``flash_attn_varlen_func`` with a block table (Dao, 2023).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

from kernels.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_AMAX, group_outputs, quantize_groups_ref
from kernels.gpu_facts import has_tma, max_shared_memory, num_sms
from kernels.kv_cache_write import FP8_KV_DTYPE


def check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor) -> None:
    """Validate shapes and dtypes of a paged-attention call.

    Raises:
        ValueError: on any mismatch.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) != cache ({k_cache.shape[3]})")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    if k_cache.dtype != v_cache.dtype or (q.dtype != k_cache.dtype and k_cache.dtype != FP8_KV_DTYPE):
        raise ValueError(f"dtype mismatch: q {q.dtype}, cache {k_cache.dtype} (or an fp8 cache)")
    num_seqs = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [num_seqs + 1], got {tuple(query_start_loc.shape)}")
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


def check_sliding_window(sliding_window: int | None) -> None:
    """Raises ``ValueError`` unless ``sliding_window`` is ``None`` or a positive int."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")


def first_key_in_window(pos: int, sliding_window: int | None) -> int:
    """First key position the query at ``pos`` sees: ``max(0, pos - sliding_window + 1)``."""
    return 0 if sliding_window is None else max(0, pos - sliding_window + 1)


def _select_blocks(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``cache.index_select(0, blocks)``, an fp8 cache's converted to ``dtype`` and
    multiplied by ``scale`` (its bytes are selected: CPU has no fp8 ``index_select``)."""
    if cache.dtype != FP8_KV_DTYPE:
        return cache.index_select(0, blocks)
    x = cache.view(torch.uint8).index_select(0, blocks).view(FP8_KV_DTYPE).to(dtype)
    return x if scale == 1.0 else x.mul_(scale)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, first_block: int = 0,
               dtype: torch.dtype | None = None, scale: float = 1.0) -> torch.Tensor:
    """Contiguous ``[length - first_block * block_size, num_kv_heads, head_dim]`` copy of
    one sequence's cache from block ``first_block`` on (positions ``first_block *
    block_size .. length - 1``), an fp8 cache's dequantized to ``dtype``."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = _select_blocks(cache, block_table[first_block:num_blocks].long(), dtype or cache.dtype, scale)
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length - first_block * block_size]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float,
                        out: torch.Tensor | None = None,
                        query_lens_cpu: list[int] | None = None,
                        seq_lens_cpu: list[int] | None = None,
                        key: torch.Tensor | None = None,
                        value: torch.Tensor | None = None,
                        skip_decode: bool = False,
                        sliding_window: int | None = None,
                        k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """PyTorch reference of causal varlen attention over the paged cache (CPU and CUDA).

    Also the CPU engine's attention, so it avoids copies: decode tokens are one padded
    SDPA call over the blocks gathered with ``index_select``, and a prefill without
    earlier context attends to this step's ``key``/``value`` without reading the cache.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, float32/bfloat16/float16.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype
            or ``float8_e4m3fn`` (dequantized with ``k_scale``/``v_scale`` on load).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32, physical block ids.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query lengths (tokens).
        seq_lens: ``[num_seqs]`` int32, context length of each sequence including its
            new tokens.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: optional ``[num_tokens, num_heads, head_dim]`` output buffer.
        query_lens_cpu, seq_lens_cpu: the same lengths as Python lists, when the caller
            has them, to avoid device-to-host copies.
        key, value: optional ``[num_tokens, num_kv_heads, head_dim]``, this step's K/V,
            already written to the cache (the model passes them); used for sequences
            whose whole context is in this step.
        skip_decode: leave the rows of single-token queries untouched (the CPU backend
            computes them with its kernel).
        sliding_window: ``None`` (full causal attention) or ``w >= 1``: the query at
            position ``p`` sees keys ``p - w < k <= p`` only (see the module docstring).
        k_scale, v_scale: an fp8 cache's per-tensor scales (ignored for other dtypes).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in q's dtype.

    Raises:
        ValueError: shapes or dtypes do not match (see ``check_attention_args``), or
            ``sliding_window`` is not ``None`` or a positive int.
    """
    check_attention_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    check_sliding_window(sliding_window)
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    q_lens = query_lens_cpu if query_lens_cpu is not None else [b - a for a, b in itertools.pairwise(starts)]
    s_lens = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.tolist()
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    gqa = num_heads != num_kv_heads
    scales = (k_scale, v_scale)
    if k_cache.dtype == FP8_KV_DTYPE:
        key = value = None  # attend to the quantized entries, as the Triton kernel does

    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode and not skip_decode:
        _decode_batch(q, k_cache, v_cache, block_tables, starts, s_lens, decode, scale, out, sliding_window,
                      scales)
    block_size = k_cache.shape[1]
    for i, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        start, ctx = starts[i], s_lens[i]
        # Keys before the first query's window are never seen: start at its block.
        first_block = first_key_in_window(ctx - q_len, sliding_window) // block_size
        key_lo = first_block * block_size  # absolute position of the first key used
        if ctx == q_len and key is not None and value is not None:
            k = key[start + key_lo:start + q_len].transpose(0, 1)  # [kvh, keys, d]
            v = value[start + key_lo:start + q_len].transpose(0, 1)
        else:
            k = _gather_kv(k_cache, block_tables[i], ctx, first_block, q.dtype, k_scale).transpose(0, 1)
            v = _gather_kv(v_cache, block_tables[i], ctx, first_block, q.dtype, v_scale).transpose(0, 1)
        # 4-D ([1, heads, len, d]) so that SDPA takes its fused (flash) CPU kernel.
        qi = q[start:start + q_len].transpose(0, 1).unsqueeze(0)
        k, v = k.unsqueeze(0), v.unsqueeze(0)
        windowed = sliding_window is not None and sliding_window < ctx
        if ctx == q_len and not windowed:  # no earlier context: plain causal
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # Query j sits at absolute position ctx - q_len + j and sees keys 0..that
            # position (within the window: more than position - sliding_window).
            pos_q = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
            pos_k = torch.arange(key_lo, ctx, device=q.device)[None, :]
            mask = pos_q >= pos_k
            if windowed:
                mask &= pos_q - pos_k < sliding_window
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start:start + q_len] = o[0].transpose(0, 1)
    return out


def _decode_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, starts: list[int], s_lens: list[int],
                  rows: list[int], scale: float, out: torch.Tensor,
                  sliding_window: int | None = None, kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Single-token queries of the sequences ``rows`` in one padded SDPA call.

    Each sequence's blocks are gathered with one ``index_select`` (whole blocks are
    contiguous rows, about twice as fast as advanced indexing on CPU) into
    ``[B, L, kvh, d]``; SDPA reads the ``[B, kvh, L, d]`` view of it without a copy and
    shares K/V among the query heads of a group (``enable_gqa``); keys past a sequence's
    length are masked. With a sliding window shorter than the longest context, each
    sequence's gather starts at the block of its first key in the window (row ``b``'s
    keys then start at absolute position ``first_block_b * block_size``), and keys before
    the window are masked.
    """
    device = q.device
    lens = [s_lens[i] for i in rows]
    max_len = max(lens)
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    bsz = len(rows)
    every = bsz == len(starts) - 1  # every sequence decodes: no row selection
    if every:
        tables, qb = block_tables, q
    else:
        tables = block_tables.index_select(0, torch.tensor(rows, device=device))
        token_idx = torch.tensor([starts[i] for i in rows], device=device)
        qb = q.index_select(0, token_idx)
    if sliding_window is None or sliding_window >= max_len:
        first_blocks = None
        num_blocks = (max_len + block_size - 1) // block_size
        tables = tables[:, :num_blocks]
    else:
        first_blocks = [first_key_in_window(n - 1, sliding_window) // block_size for n in lens]
        num_blocks = max(-(-n // block_size) - b for n, b in zip(lens, first_blocks))
        cols = torch.tensor(first_blocks, device=device)[:, None] + torch.arange(num_blocks, device=device)
        # Columns past a row's last block hold padding keys (masked); clamp them in range.
        tables = tables.gather(1, cols.clamp_(max=tables.shape[1] - 1))
    num_keys = num_blocks * block_size if first_blocks is not None else max_len
    flat = tables.reshape(-1).long()
    shape = (bsz, num_blocks * block_size, num_kv_heads, head_dim)
    k = _select_blocks(k_cache, flat, q.dtype, kv_scales[0])
    v = _select_blocks(v_cache, flat, q.dtype, kv_scales[1])
    k = k.view(shape)[:, :num_keys].transpose(1, 2)  # [B, kvh, L, d]
    v = v.view(shape)[:, :num_keys].transpose(1, 2)
    mask = None
    if first_blocks is not None:
        # Absolute position of each gathered key; the query sits at len - 1.
        pos = torch.tensor(first_blocks, device=device)[:, None] * block_size + torch.arange(num_keys, device=device)
        len_t = torch.tensor(lens, device=device)[:, None]
        mask = ((pos < len_t) & (pos > len_t - 1 - sliding_window))[:, None, None, :]  # [B, 1, 1, L]
    elif min(lens) < max_len:
        keep = torch.arange(max_len, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        mask = keep[:, None, None, :]  # [B, 1, 1, L]
    o = F.scaled_dot_product_attention(qb.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[1] != num_kv_heads).squeeze(2)  # [B, h, d]
    if every:
        out.copy_(o)
    else:
        out.index_copy_(0, token_idx, o)


# --------------------------------------------------------------------------------------
# Triton implementation (CUDA). One launch serves a mixed batch of prefill chunks and
# decode tokens; a second, tiny launch reduces split-KV partials when the batch is
# pure decode and too small to fill the GPU (flash-decoding).
# --------------------------------------------------------------------------------------

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the wrapper falls back to the reference.
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # no Triton, or one without host-side tensor descriptors
    TensorDescriptor = None

_LOG2E = 1.4426950408889634
_MIN_KEYS_PER_SPLIT = 128  # below this a split's fixed cost outweighs the parallelism.
_MAX_SPLITS = 64
#: Decode launches of at least this many programs per SM (sequences x KV heads) take
#: short tiles and two stages instead of one long-tiled program an SM.
_MIN_WAVES_SHORT_TILES = 3
#: Prefill launches of at most this many sequences take one query head per program.
_MAX_SEQS_ONE_HEAD = 16
#: ... when their chunks read their own keys from key/value (``NEW_KV``), only from this
#: query length on; shorter chunks do better with packed heads.
_MIN_QUERY_ONE_HEAD_NEW_KV = 8192

if triton is not None:
    _FP8_MAX = tl.constexpr(FP8_MAX)
    _MIN_AMAX = tl.constexpr(MIN_AMAX)

    @triton.jit
    def _find_seq_idx(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q: tl.constexpr):
        """Largest ``b`` with ``query_start_loc[b] // BLOCK_Q + b <= q_block_id``.

        Sequence ``b`` owns q-blocks ``[qsl[b] // BLOCK_Q + b, qsl[b+1] // BLOCK_Q + b + 1)``,
        at least ``cdiv(query_len_b, BLOCK_Q)`` of them, so the grid needs no host data.
        """
        lo = tl.full([], 0, tl.int32)
        hi = tl.full([], 0, tl.int32) + num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            start = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
            if start <= q_block_id:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _tile_weights(q, k, m_i, l_i, seen, qk_scale, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
        """The online softmax's step for one key tile (FlashAttention-2's update): scores of
        ``q [rows, d]`` against ``k [TILE, d]``, masked (``MASKED``) where ``seen [rows,
        TILE]`` is false; returns ``(p, alpha, m_new, l_new)``, ``m`` in log2 units. The
        caller adds ``p @ v`` to its accumulator scaled by ``alpha`` (``_accumulate``)."""
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked row
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)

    @triton.jit
    def _accumulate(acc, p, alpha, v, DOT_PRECISION: tl.constexpr):
        """``acc * alpha + p @ v`` (``v [TILE, d]``): the tile's values into the output."""
        return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)

    @triton.jit
    def _new_kv_tile(q, acc, m_i, l_i, t, offs_n, offs_d, d_valid, q_abs, context_len, num_keys, row0, key_ptr,
                     value_ptr, k_desc, v_desc, kv_head, bt_row, k_cache_ptr, v_cache_ptr, kh_off_k, kh_off_v,
                     qk_scale, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_bt_b, stride_kb, stride_ks,
                     stride_vb, stride_vs, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr,
                     STRADDLE: tl.constexpr):
        """Key tile ``t`` (absolute keys ``t * TILE ..``, the tiles of the cache path, so
        that the sums run in the same order) read from this step's ``key``/``value`` rows
        (``NEW_KV``): key ``p >= context_len`` is row ``row0 + p - context_len`` of ``[T,
        num_kv_heads, head_dim]`` (``USE_TMA``: through tensor descriptors of the ``[T,
        num_kv_heads * head_dim]`` views, Hopper's TMA). ``STRADDLE``: the tile also holds
        context keys, read from the cache through the block table. ``MASKED``: the causal
        mask and the key range."""
        key = t * TILE + offs_n
        if USE_TMA and not STRADDLE:
            k = k_desc.load([row0 + t * TILE - context_len, kv_head * HEAD_DIM]).to(q.dtype)
            v = v_desc.load([row0 + t * TILE - context_len, kv_head * HEAD_DIM]).to(q.dtype)
        else:
            rows = (row0 + key - context_len).to(tl.int64)
            if MASKED or STRADDLE:
                new_mask = ((key >= context_len) & (key < num_keys))[:, None] & d_valid[None, :]
            else:
                new_mask = d_valid[None, :]
            k = tl.load(key_ptr + rows[:, None] * stride_nkt + kv_head * stride_nkh + offs_d[None, :],
                        mask=new_mask, other=0.0).to(q.dtype)
            v = tl.load(value_ptr + rows[:, None] * stride_nvt + kv_head * stride_nvh + offs_d[None, :],
                        mask=new_mask, other=0.0).to(q.dtype)
            if STRADDLE:
                cached = key < context_len
                phys = tl.load(bt_row + (key // BLOCK_SIZE) * stride_bt_b, mask=cached, other=0).to(tl.int64)
                in_block = (key % BLOCK_SIZE).to(tl.int64)
                old_mask = cached[:, None] & d_valid[None, :]
                k_old = tl.load(k_cache_ptr + (phys * stride_kb + in_block * stride_ks + kh_off_k)[:, None]
                                + offs_d[None, :], mask=old_mask, other=0.0).to(q.dtype)
                v_old = tl.load(v_cache_ptr + (phys * stride_vb + in_block * stride_vs + kh_off_v)[:, None]
                                + offs_d[None, :], mask=old_mask, other=0.0).to(q.dtype)
                k = tl.where(cached[:, None], k_old, k)
                v = tl.where(cached[:, None], v_old, v)
        seen = (key[None, :] <= q_abs[:, None]) & (key < num_keys)[None, :]
        p, alpha, m_i, l_i = _tile_weights(q, k, m_i, l_i, seen, qk_scale, DOT_PRECISION, MASKED)
        return _accumulate(acc, p, alpha, v, DOT_PRECISION), m_i, l_i

    @triton.jit
    def _attn_tile(q, acc, m_i, l_i, t, offs_n, offs_d, d_valid, q_abs, num_keys, first_key, bt_row, k_cache_ptr,
                   v_cache_ptr, kh_off_k, kh_off_v, qk_scale, stride_bt_b, stride_kb, stride_ks, stride_vb, stride_vs,
                   BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   SLIDING_WINDOW: tl.constexpr, MASKED: tl.constexpr):
        """One key tile ``t`` of ``_paged_attn_kernel``'s online softmax: returns the new
        ``(acc, m_i, l_i)``. ``MASKED``: apply the causal (and window) mask and the key
        range; off, every key of the tile is valid and seen by every row."""
        key = t * TILE + offs_n
        if MASKED:
            key_valid = (key < num_keys) & (key >= first_key)
        else:
            key_valid = key >= 0
        # Gather: each key's physical block (int64: a cache can exceed 2**31 elements).
        phys = tl.load(bt_row + (key // BLOCK_SIZE) * stride_bt_b, mask=key_valid, other=0).to(tl.int64)
        in_block = (key % BLOCK_SIZE).to(tl.int64)
        kv_mask = key_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + (phys * stride_kb + in_block * stride_ks + kh_off_k)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        seen = (key[None, :] <= q_abs[:, None]) & key_valid[None, :]
        if SLIDING_WINDOW > 0:
            seen = seen & (key[None, :] > q_abs[:, None] - SLIDING_WINDOW)
        p, alpha, m_i, l_i = _tile_weights(q, k, m_i, l_i, seen, qk_scale, DOT_PRECISION, MASKED)
        # V is loaded after the scores, as before the K/V-rows path shared this code.
        v = tl.load(v_cache_ptr + (phys * stride_vb + in_block * stride_vs + kh_off_v)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        return _accumulate(acc, p, alpha, v, DOT_PRECISION), m_i, l_i

    @triton.jit
    def _store_out(o, tok, head, offs_d, row_valid, d_valid, out_ptr, out_scale_ptr, stride_ot, stride_oh,
                   stride_st, stride_sh, OUT_DTYPE: tl.constexpr, QUANT_OUT: tl.constexpr):
        """Store the float32 output tile ``o [rows, HEAD_DIM_P]`` (row r: token ``tok[r]``,
        head ``head[r]``): in ``OUT_DTYPE``, or with ``QUANT_OUT`` rounded to ``OUT_DTYPE``
        first and then quantized as one 1 x HEAD_DIM group per row, exactly as
        ``kernels.fp8_quant.quantize_groups`` quantizes that rounded output (``amax / 448``,
        at least ``MIN_AMAX / 448``; round to nearest), its scale at ``out_scale_ptr +
        tok * stride_st + head * stride_sh``."""
        ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        mask = row_valid[:, None] & d_valid[None, :]
        if QUANT_OUT:
            y = o.to(OUT_DTYPE).to(tl.float32)
            s = tl.maximum(tl.max(tl.abs(y), axis=1), _MIN_AMAX) / _FP8_MAX
            tl.store(out_scale_ptr + tok * stride_st + head * stride_sh, s, mask=row_valid)
            y = tl.clamp(tl.math.div_rn(y, s[:, None]), -_FP8_MAX, _FP8_MAX)
            tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _paged_attn_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, out_scale_ptr,
        part_out_ptr, part_m_ptr, part_l_ptr,
        block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        qk_scale, v_scale, num_seqs, num_heads,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_st, stride_sh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_bt_s, stride_bt_b,
        key_ptr, value_ptr, k_desc, v_desc, stride_nkt, stride_nkh, stride_nvt, stride_nvh,
        QPK: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SEQ_FILTER: tl.constexpr, SLIDING_WINDOW: tl.constexpr, QUANT_OUT: tl.constexpr,
        PACK_HEADS: tl.constexpr = True, NEW_KV: tl.constexpr = False, NEW_KV_TMA: tl.constexpr = False,
        WARP_SPEC: tl.constexpr = False,
    ):
        # PACK_HEADS: program = (q-block of BLOCK_Q tokens x all QPK query heads of one KV
        # head, split). Row m of the tile is token m // QPK, query head kv_head * QPK + m %
        # QPK (GQA packing), so every KV tile is read once for all heads that share it.
        # Off: program = (q-block of BLOCK_Q = BLOCK_M tokens, one query head): no row is
        # padding when QPK is not a power of two (Qwen2.5-7B's 7 heads fill 7 of 8 rows),
        # and the QPK programs of a KV head read its tiles from L2 (long prefills).
        # SEQ_FILTER: 0 = every sequence; 1 = only query_len > 1; 2 = only query_len == 1,
        # one program per sequence (grid dim 0 = num_seqs, BLOCK_Q = 1).
        # SLIDING_WINDOW: 0 = full causal; w > 0: query q_abs sees keys q_abs - w < key
        # <= q_abs, and tiles wholly before the q-block's first window are skipped (their
        # block-table entries are never read).
        # An fp8 cache is converted to q's dtype on load; its K scale is folded into
        # qk_scale by the wrapper and v_scale multiplies the accumulator once at the end.
        # QUANT_OUT: each output row (one token's head) is written as one E4M3 group with
        # its float32 scale (``_store_out``), for a block-scaled FP8 o_proj.
        # NEW_KV (full causal, no splits, a cache of q's dtype): a chunk's own keys come from
        # this step's ``key``/``value`` rows, contiguous (NEW_KV_TMA: tensor descriptors;
        # WARP_SPEC: the compiler's warp specialization of the loop over them), and only
        # the context before the chunk from the cache through the block table.
        if PACK_HEADS:
            kv_head = tl.program_id(1)
        else:
            head_id = tl.program_id(1)
            kv_head = head_id // QPK
        split = tl.program_id(2)
        if SEQ_FILTER == 2:
            seq_idx = tl.program_id(0)
            q_block_local = 0
        else:
            # Last q-blocks first: they see the most keys, so a launch ends on light
            # programs instead of a tail of the heaviest (FlashAttention-2's causal order).
            q_block_id = tl.num_programs(0) - 1 - tl.program_id(0)
            seq_idx = _find_seq_idx(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq_idx).to(tl.int32)
        q_len = tl.load(query_start_loc_ptr + seq_idx + 1).to(tl.int32) - q_start
        if SEQ_FILTER != 2:
            q_block_local = q_block_id - (q_start // BLOCK_Q + seq_idx)
        if q_block_local * BLOCK_Q >= q_len:  # spare grid slot, or a padded sequence
            return
        if SEQ_FILTER == 1 and q_len == 1:  # left to the decode launch
            return
        if SEQ_FILTER == 2 and q_len != 1:  # left to the prefill launch
            return
        seq_len = tl.load(seq_lens_ptr + seq_idx).to(tl.int32)
        context_len = seq_len - q_len

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM_P)
        offs_n = tl.arange(0, TILE)
        if PACK_HEADS:
            q_pos = q_block_local * BLOCK_Q + offs_m // QPK  # position within this chunk
            head = kv_head * QPK + offs_m % QPK
            row_valid = (offs_m < BLOCK_Q * QPK) & (q_pos < q_len)
        else:
            q_pos = q_block_local * BLOCK_Q + offs_m
            head = head_id + tl.zeros([BLOCK_M], tl.int32)
            row_valid = q_pos < q_len
        d_valid = offs_d < HEAD_DIM
        tok = (q_start + q_pos).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_valid[:, None] & d_valid[None, :], other=0.0)

        q_abs = context_len + q_pos  # absolute position: sees keys 0..q_abs (causal)
        num_keys = context_len + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len)
        num_tiles = tl.cdiv(num_keys, TILE)
        if SLIDING_WINDOW > 0:  # the q-block's first query sees keys from first_key on
            first_key = tl.maximum(context_len + q_block_local * BLOCK_Q - SLIDING_WINDOW + 1, 0)
        else:
            first_key = tl.full([], 0, tl.int32)
        first_tile = first_key // TILE
        tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
        tile_lo = first_tile + split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
        bt_row = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt_s
        kh_off_k = kv_head.to(tl.int64) * stride_kh
        kh_off_v = kv_head.to(tl.int64) * stride_vh
        if NEW_KV:
            # The cache path's tiles in its order: tiles wholly before context_len from the
            # cache (every row sees all of them: no mask), a tile across it from both, the
            # rest from key/value, masked from the first tile that a row of the q-block
            # does not wholly see.
            full_hi = tl.maximum(tl.minimum((context_len + q_block_local * BLOCK_Q + 1) // TILE, tile_hi), tile_lo)
            ctx_full = context_len // TILE
            for t in range(tile_lo, ctx_full):
                acc, m_i, l_i = _attn_tile(
                    q, acc, m_i, l_i, t, offs_n, offs_d, d_valid, q_abs, num_keys, first_key, bt_row, k_cache_ptr,
                    v_cache_ptr, kh_off_k, kh_off_v, qk_scale, stride_bt_b, stride_kb, stride_ks, stride_vb,
                    stride_vs, BLOCK_SIZE, TILE, DOT_PRECISION, 0, False)
            first_new = ctx_full
            if ctx_full * TILE < context_len:  # the tile across context_len (always masked)
                acc, m_i, l_i = _new_kv_tile(
                    q, acc, m_i, l_i, ctx_full, offs_n, offs_d, d_valid, q_abs, context_len, num_keys, q_start,
                    key_ptr, value_ptr, k_desc, v_desc, kv_head, bt_row, k_cache_ptr, v_cache_ptr, kh_off_k,
                    kh_off_v, qk_scale, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_bt_b, stride_kb,
                    stride_ks, stride_vb, stride_vs, BLOCK_SIZE, HEAD_DIM, TILE, DOT_PRECISION, True, NEW_KV_TMA,
                    True)
                first_new = ctx_full + 1
            for t in tl.range(first_new, tl.maximum(full_hi, first_new), warp_specialize=WARP_SPEC):
                acc, m_i, l_i = _new_kv_tile(
                    q, acc, m_i, l_i, t, offs_n, offs_d, d_valid, q_abs, context_len, num_keys, q_start,
                    key_ptr, value_ptr, k_desc, v_desc, kv_head, bt_row, k_cache_ptr, v_cache_ptr, kh_off_k,
                    kh_off_v, qk_scale, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_bt_b, stride_kb,
                    stride_ks, stride_vb, stride_vs, BLOCK_SIZE, HEAD_DIM, TILE, DOT_PRECISION, False, NEW_KV_TMA,
                    False)
            for t in range(tl.maximum(full_hi, first_new), tile_hi):
                acc, m_i, l_i = _new_kv_tile(
                    q, acc, m_i, l_i, t, offs_n, offs_d, d_valid, q_abs, context_len, num_keys, q_start,
                    key_ptr, value_ptr, k_desc, v_desc, kv_head, bt_row, k_cache_ptr, v_cache_ptr, kh_off_k,
                    kh_off_v, qk_scale, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_bt_b, stride_kb,
                    stride_ks, stride_vb, stride_vs, BLOCK_SIZE, HEAD_DIM, TILE, DOT_PRECISION, True, NEW_KV_TMA,
                    False)
        else:
            # Tiles whose every key every row of the q-block sees (full causal, keys before the
            # block's first query) need no mask: only the last tile or two of a row's keys do.
            if SLIDING_WINDOW == 0:
                full_hi = tl.maximum(tl.minimum((context_len + q_block_local * BLOCK_Q + 1) // TILE, tile_hi),
                                     tile_lo)
            else:
                full_hi = tile_lo
            for t in range(tile_lo, full_hi):
                acc, m_i, l_i = _attn_tile(
                    q, acc, m_i, l_i, t, offs_n, offs_d, d_valid, q_abs, num_keys, first_key, bt_row, k_cache_ptr,
                    v_cache_ptr, kh_off_k, kh_off_v, qk_scale, stride_bt_b, stride_kb, stride_ks, stride_vb,
                    stride_vs, BLOCK_SIZE, TILE, DOT_PRECISION, SLIDING_WINDOW, False)
            for t in range(full_hi, tile_hi):
                acc, m_i, l_i = _attn_tile(
                    q, acc, m_i, l_i, t, offs_n, offs_d, d_valid, q_abs, num_keys, first_key, bt_row, k_cache_ptr,
                    v_cache_ptr, kh_off_k, kh_off_v, qk_scale, stride_bt_b, stride_kb, stride_ks, stride_vb,
                    stride_vs, BLOCK_SIZE, TILE, DOT_PRECISION, SLIDING_WINDOW, True)

        acc = acc * v_scale  # 1.0 unless the cache is fp8
        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            _store_out(o, tok, head, offs_d, row_valid, d_valid, out_ptr, out_scale_ptr, stride_ot, stride_oh,
                       stride_st, stride_sh, q.dtype, QUANT_OUT)
        else:
            # Partials [num_tokens, num_heads, NUM_SPLITS(, HEAD_DIM_P)], m in log2 units.
            part = (tok * num_heads + head) * NUM_SPLITS + split
            tl.store(part_m_ptr + part, m_i, mask=row_valid)
            tl.store(part_l_ptr + part, l_i, mask=row_valid)
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :], acc, mask=row_valid[:, None])

    @triton.jit
    def _reduce_splits_kernel(
        q_ptr, out_ptr, out_scale_ptr, part_out_ptr, part_m_ptr, part_l_ptr, query_start_loc_ptr,
        num_seqs, num_heads, stride_ot, stride_oh, stride_st, stride_sh,
        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, QUANT_OUT: tl.constexpr,
    ):
        # q_ptr: read for its dtype only (the output's before QUANT_OUT quantizes it).
        tok = tl.program_id(0)
        head = tl.program_id(1)
        # Rows past the last sequence's queries are padding: no partials, write nothing.
        if tok >= tl.load(query_start_loc_ptr + num_seqs).to(tl.int32):
            return
        offs_s = tl.arange(0, SPLITS_P)
        offs_d = tl.arange(0, HEAD_DIM_P)
        s_valid = offs_s < NUM_SPLITS
        base = (tok.to(tl.int64) * num_heads + head) * NUM_SPLITS + offs_s
        m = tl.load(part_m_ptr + base, mask=s_valid, other=float("-inf"))
        l = tl.load(part_l_ptr + base, mask=s_valid, other=0.0)
        m_max = tl.max(m, 0)
        w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty split -> 0
        l_tot = tl.sum(w * l, 0)
        acc = tl.load(part_out_ptr + base[:, None] * HEAD_DIM_P + offs_d[None, :], mask=s_valid[:, None], other=0.0)
        o = tl.sum(acc * w[:, None], 0) / tl.where(l_tot == 0.0, 1.0, l_tot)
        # As a one-row tile, so that the store is the main kernel's.
        _store_out(o[None, :], tok.to(tl.int64) + tl.zeros([1], tl.int64), head + tl.zeros([1], tl.int32), offs_d,
                   tl.full([1], True, tl.int1), offs_d < HEAD_DIM, out_ptr, out_scale_ptr, stride_ot, stride_oh,
                   stride_st, stride_sh, q_ptr.dtype.element_ty, QUANT_OUT)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _attention_config(dtype: torch.dtype, qpk: int, num_seqs: int, num_kv_heads: int,
                      max_query_len: int, max_seq_len: int, num_sms: int, new_kv: bool = False,
                      head_dim: int = 128, smem_limit: int | None = None) -> dict[str, int]:
    """Tile sizes and split count from shapes and the caller's Python ints only.

    Correctness never depends on ``max_query_len``/``max_seq_len``: they pick tiles and
    splits, and the kernel masks by the real lengths it reads on the device. ``new_kv``:
    the prefill launch can read each chunk's keys from the step's ``key``/``value``
    (``NEW_KV``), which moves the best tiles (H200 sweep, bench/results/s18/attn_prefill_sweep_new_kv.json).
    ``head_dim`` (padded to a power of two) and ``smem_limit`` (bytes a program may take,
    None: no limit): the tiles are shrunk until they fit (``fit_shared_memory``), which
    only larger heads (Gemma 3's 256) and GPUs with less shared memory than Hopper need.
    """
    cfg = _pick_config(dtype, qpk, num_seqs, num_kv_heads, max_query_len, max_seq_len, num_sms, new_kv)
    return cfg if smem_limit is None else fit_shared_memory(cfg, head_dim, dtype.itemsize, smem_limit)


def shared_memory_bytes(cfg: dict[str, int], head_dim: int, elem_bytes: int) -> int:
    """Shared memory (bytes) that a launch config's pipelined tiles take: the q-tile and
    ``num_stages`` K and V tiles of ``head_dim`` (padded) elements of ``elem_bytes``, plus
    1 KiB of barriers with TMA. Checked against what Triton 3.6 reported for configs that
    did not fit an H200 (bench/results/s18/attn_prefill_sweep_new_kv.json: 128 x 128 tiles,
    4 stages, bf16 heads of 128: 294,912 bytes; with TMA 295,936)."""
    tiles = cfg["BLOCK_M"] * head_dim + cfg["num_stages"] * 2 * cfg["TILE"] * head_dim
    return tiles * elem_bytes + (1024 if cfg.get("NEW_KV_TMA") else 0)


def fit_shared_memory(cfg: dict[str, int], head_dim: int, elem_bytes: int, limit: int) -> dict[str, int]:
    """``cfg`` with fewer stages (down to 2), then shorter key tiles (down to 16), then one
    stage, until ``shared_memory_bytes`` is within ``limit``; unchanged when it fits."""
    if shared_memory_bytes(cfg, head_dim, elem_bytes) <= limit:
        return cfg
    cfg = dict(cfg)
    while shared_memory_bytes(cfg, head_dim, elem_bytes) > limit:
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif cfg["TILE"] > 16:
            cfg["TILE"] //= 2
        elif cfg["num_stages"] > 1:
            cfg["num_stages"] = 1
        else:
            break
    return cfg


def _pick_config(dtype: torch.dtype, qpk: int, num_seqs: int, num_kv_heads: int, max_query_len: int,
                 max_seq_len: int, num_sms: int, new_kv: bool) -> dict[str, int]:
    """``_attention_config``'s choice before the shared-memory fit."""
    tile = 32 if dtype == torch.float32 else 64
    num_stages = 2
    packed_new_kv = packed_tma = False  # decode launches read the cache
    if max_query_len <= 1:
        block_m, num_warps = max(16, _next_pow2(qpk)), 4
        block_q = 1
        work = max(num_seqs * num_kv_heads, 1)
        if dtype == torch.float32:
            splits = min(-(-2 * num_sms // work), -(-max_seq_len // _MIN_KEYS_PER_SPLIT), _MAX_SPLITS)
        elif work >= _MIN_WAVES_SHORT_TILES * num_sms:
            # Several waves of programs: 64-key tiles, two stages (64 KiB of shared
            # memory, three programs an SM) overlap one program's gather with the next
            # one's (H200 sweep, bench/results/s21/attn_decode256.json: 256 x 288 keys
            # 63.8 -> 50.6 us, 256 x 2,000 keys 266 -> 256 us, 128 x 330 keys 35.5 -> 31.8 us).
            tile, num_stages, splits = 64, 2, 1
        elif work >= num_sms:
            # The batch fills the GPU about once: no split; long tiles and a deeper
            # pipeline hide the gather latency (H100 sweep, bench/results/attn_sweep_h100.json:
            # batch 64 x 330 keys 28.0 -> 20.2 us, batch 64 x 2048 keys 116.5 -> 97.4 us).
            tile, num_stages, splits = 128, 3, 1
        else:
            # Flash-decoding: split each sequence's keys so that small batches fill the
            # GPU; short contexts take short tiles so that each split has work (batch 1
            # x 330 keys: 6.2 us with 32-key tiles and 8 splits).
            tile, min_keys = (32, 32) if max_seq_len <= 1024 else (128, 256)
            num_warps = 4 if tile == 32 else 8
            splits = min(-(-2 * num_sms // work), -(-max_seq_len // min_keys), _MAX_SPLITS)
        splits = max(splits, 1)
    else:
        big = dtype != torch.float32 and max_query_len * qpk >= 512
        # TMA pays on long chunks (2 x 2,048 tokens: 178 -> 158 us), not on short ones
        # (64 x 100-token questions: 786 -> 800 us).
        tma = new_kv and big and max_query_len >= 1024
        if new_kv and big and max_query_len >= _MIN_QUERY_ONE_HEAD_NEW_KV and num_seqs <= _MAX_SEQS_ONE_HEAD:
            # One head per program, 128 x 128 tiles, three stages, keys through TMA: a
            # 30,000-token prompt 17.8 ms a layer (block-table gather) -> 11.7 ms (~550
            # TFLOP/s); a 13,616-token chunk over 16,384 cached 12.2 -> 10.0 ms.
            return {"BLOCK_M": 128, "BLOCK_Q": 128, "TILE": 128, "NUM_SPLITS": 1, "num_warps": 8,
                    "num_stages": 3, "PACK_HEADS": False, "NEW_KV": True, "NEW_KV_TMA": True, "WARP_SPEC": False}
        if not new_kv and big and max_query_len >= 512 and num_seqs <= _MAX_SEQS_ONE_HEAD:
            # Long prompts of a few sequences: one query head per program, no padded
            # rows (H200 sweep, bench/results/s17/attn_prefill_sweep.json: a 30,000-token
            # prompt 22.7 -> 17.6 ms a layer, 2 x 2,048 tokens 275 -> 247 us). Not for
            # many sequences (a mixed-step graph's 256 slots): its grid has a program per
            # head and sequence slot, most of them returning at once.
            block_m, tile, num_warps, num_stages = (128, 128, 8, 2) if max_query_len >= 1024 else (64, 64, 4, 2)
            return {"BLOCK_M": block_m, "BLOCK_Q": block_m, "TILE": tile, "NUM_SPLITS": 1,
                    "num_warps": num_warps, "num_stages": num_stages, "PACK_HEADS": False,
                    "NEW_KV": False, "NEW_KV_TMA": False, "WARP_SPEC": False}
        block_m, num_warps = (128, 8) if big else (64, 4)
        if big:  # a third stage: 64 x 100-token questions over 2,000 cached 920 -> 823 us
            num_stages = 3
        block_m = max(block_m, _next_pow2(qpk))
        block_q = block_m // qpk
        splits = 1
        # Packed heads with the chunk's keys from key/value beat one head per program
        # below ~8k-token chunks (2 x 2,048 tokens: 158 us packed with TMA, 169 one head).
        packed_new_kv, packed_tma = new_kv, tma
    return {"BLOCK_M": block_m, "BLOCK_Q": block_q, "TILE": tile, "NUM_SPLITS": splits,
            "num_warps": num_warps, "num_stages": num_stages, "PACK_HEADS": True,
            "NEW_KV": packed_new_kv, "NEW_KV_TMA": packed_tma, "WARP_SPEC": False}


def _kv_descriptors(key: torch.Tensor, value: torch.Tensor, tile: int, head_dim: int) -> tuple[Any, Any] | None:
    """TMA tensor descriptors of ``key``/``value`` as ``[T, num_kv_heads * head_dim]``
    matrices, blocks of ``tile`` rows x one head, or ``None`` where TMA cannot read them:
    no ``TensorDescriptor`` in this Triton, a head size that is not a power of two of at
    least 16, heads not packed in a row, or a base or row stride not 16-byte aligned."""
    if TensorDescriptor is None or head_dim < 16 or head_dim & (head_dim - 1):
        return None
    descs = []
    for t in (key, value):
        num_tokens, num_kv_heads, _ = t.shape
        if t.stride(1) != head_dim or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return None
        descs.append(TensorDescriptor(t, [num_tokens, num_kv_heads * head_dim], [t.stride(0), 1], [tile, head_dim]))
    return descs[0], descs[1]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                    *, max_query_len: int, max_seq_len: int,
                    sliding_window: int | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> torch.Tensor:
    """Causal varlen attention over the paged cache: Triton on CUDA, the reference elsewhere.

    Same semantics, shapes and dtypes as ``paged_attention_ref``; prefill chunks (with or
    without cached context) and decode tokens mix freely in one call. CUDA-graph safe: no
    host syncs, and the grid and workspace depend only on tensor shapes and the two ints.

    Args:
        max_query_len: an upper bound on every ``query_len_b`` (1 for a pure decode batch,
            which enables split-KV); picks tile sizes only.
        max_seq_len: an upper bound on every ``seq_lens[b]`` (for a captured graph, the
            largest it will see); picks the split count only.
        sliding_window: ``None`` or ``w >= 1`` (see ``paged_attention_ref``); a
            compile-time constant of the kernel (one compile per distinct window).
        k_scale, v_scale: an fp8 cache's per-tensor scales (ignored for other dtypes);
            runtime arguments, so a captured graph keeps the values it was captured with.
        key, value: optional, ``[num_tokens, num_kv_heads, head_dim]`` in q's dtype, this
            step's keys and values, row for row with ``q`` (what was just written to the
            cache). Given, with a cache of q's dtype and no sliding window, the prefill
            launch reads each chunk's own keys from these rows, contiguous (through TMA
            tensor descriptors on Hopper where the layout allows), and only the earlier
            context through the block table; the result is the same.

    Padding sequences (``query_len 0``, ``seq_len 0``) and rows of ``q`` past
    ``query_start_loc[-1]`` are left unwritten. ``block_tables`` entries past a sequence's
    last block are never read.

    Raises:
        ValueError: shapes, dtypes or strides do not match (``key``/``value`` included), or
            a bad ``sliding_window``.
    """
    check_attention_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    check_sliding_window(sliding_window)
    new_kv = _new_kv(q, k_cache, key, value)
    if out is None:
        out = torch.empty_like(q)
    if triton is None or not q.is_cuda:
        return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out,
                                   sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale)
    return _paged_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out,
                                   max_query_len, max_seq_len, sliding_window or 0, k_scale, v_scale, new_kv=new_kv)


def quantized_output_fits(q: torch.Tensor) -> bool:
    """Whether ``paged_attention_fp8_out`` runs its Triton path for ``q [T, num_heads,
    head_dim]``: CUDA, Triton, and ``head_dim`` a power of two of at least 16 (each head
    row is then one whole quantization group)."""
    head_dim = q.shape[-1]
    return triton is not None and q.is_cuda and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def paged_attention_fp8_out(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, *, max_query_len: int, max_seq_len: int,
                            pad_rows_to: int = 1, sliding_window: int | None = None,
                            k_scale: float = 1.0, v_scale: float = 1.0,
                            key: torch.Tensor | None = None,
                            value: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_attention`` whose output comes quantized for a block-scaled FP8 product
    (``o_proj``): each token's head row, ``head_dim`` values, is one E4M3 group with its
    own float32 scale, written by the attention launches themselves (no bfloat16 output,
    no quantizer launch). Bit for bit what ``kernels.fp8_quant.quantize_groups`` gives for
    the ``[T, num_heads * head_dim]`` output in ``q``'s dtype with group ``head_dim``,
    ``pad_rows_to`` and column-major scales; where ``quantized_output_fits`` is false, that
    is how it is computed (the reference, then ``quantize_groups_ref``).

    Arguments as ``paged_attention`` (keyword-only past ``scale``, ``key``/``value``
    included); ``pad_rows_to``: the
    row multiple of the outputs (``torch._scaled_mm`` takes multiples of 16).

    Returns:
        ``(out [T', num_heads * head_dim] float8_e4m3fn, scale [T', num_heads] float32)``,
        the scale a column-major view (strides ``(1, T')``), ``T'`` = T padded up to a
        multiple of ``pad_rows_to``. On CUDA, rows past ``query_start_loc[-1]`` (padding
        tokens, padding rows) are left unwritten, as ``paged_attention`` leaves them.
    Raises:
        ValueError: as ``paged_attention``.
    """
    num_tokens, num_heads, head_dim = q.shape
    if not quantized_output_fits(q):
        o = paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                            max_query_len=max_query_len, max_seq_len=max_seq_len, sliding_window=sliding_window,
                            k_scale=k_scale, v_scale=v_scale, key=key, value=value)
        return quantize_groups_ref(o.reshape(num_tokens, num_heads * head_dim), head_dim, pad_rows_to, True)
    check_attention_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    check_sliding_window(sliding_window)
    out, out_scale = group_outputs(num_tokens, num_heads * head_dim, head_dim, pad_rows_to, True, q.device)
    _paged_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                            out[:num_tokens].view(num_tokens, num_heads, head_dim), max_query_len, max_seq_len,
                            sliding_window or 0, k_scale, v_scale, out_scale=out_scale[:num_tokens],
                            new_kv=_new_kv(q, k_cache, key, value))
    return out, out_scale


def _new_kv(q: torch.Tensor, k_cache: torch.Tensor, key: torch.Tensor | None,
            value: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(key, value)`` when the prefill launch may read a chunk's keys from them (the
    cache of q's dtype: an fp8 cache's keys must be read back quantized, as the reference
    reads them), else ``None``.

    Raises:
        ValueError: only one of them given, or not ``[num_tokens, num_kv_heads,
            head_dim]`` of q's dtype, contiguous in ``head_dim``.
    """
    if key is None and value is None:
        return None
    if key is None or value is None:
        raise ValueError("key and value come together: one of them is None")
    want = (q.shape[0], k_cache.shape[2], q.shape[2])
    for t in (key, value):
        if tuple(t.shape) != want or t.dtype != q.dtype or t.stride(-1) != 1:
            raise ValueError(f"key and value must be {want} {q.dtype}, contiguous in head_dim; "
                             f"got {tuple(t.shape)} {t.dtype} strides {t.stride()}")
    return (key, value) if k_cache.dtype == q.dtype else None


def _paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                            max_query_len: int, max_seq_len: int, sliding_window: int = 0,
                            k_scale: float = 1.0, v_scale: float = 1.0,
                            out_scale: torch.Tensor | None = None,
                            new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The Triton launches of ``paged_attention``; with ``out_scale`` (``[T, num_heads]``
    float32) ``out`` is E4M3 and each of its head rows is quantized (``_store_out``). The
    K/V scales apply to an fp8 cache only. ``new_kv``: ``_new_kv``'s pair, read by the
    prefill launch (not under a sliding window)."""
    if k_cache.dtype != FP8_KV_DTYPE:
        k_scale = v_scale = 1.0
    out_dtype = q.dtype if out_scale is None else FP8_DTYPE
    if out.shape != q.shape or out.dtype != out_dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {out_dtype}, got {tuple(out.shape)} {out.dtype}")
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, strides {t.stride()}")
    if not (query_start_loc.is_contiguous() and seq_lens.is_contiguous()):
        raise ValueError("query_start_loc and seq_lens must be contiguous")
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return out
    qpk = num_heads // num_kv_heads
    if sliding_window:  # a decode token reads at most its window: split that many keys
        max_seq_len = min(max_seq_len, sliding_window)
    new_ok = new_kv is not None and not sliding_window and max_query_len > 1
    head_dim_p = max(16, _next_pow2(head_dim))
    smem = max_shared_memory(q.device)
    cfg = _attention_config(q.dtype, qpk, num_seqs, num_kv_heads, max_query_len, max_seq_len, num_sms(q.device),
                            new_kv=new_ok, head_dim=head_dim_p, smem_limit=smem)
    splits = cfg["NUM_SPLITS"]
    if splits > 1:  # shape-only allocations: fine under CUDA-graph capture (graph pool)
        part_out = torch.empty(num_tokens, num_heads, splits, head_dim_p, dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_out = part_m = part_l = out  # unused
    # A mixed batch (max_query_len > 1, several sequences) runs as two launches so that
    # decode tokens get small q-tiles instead of wasting a prefill-sized one each: launch
    # A takes sequences with query_len > 1, launch B those with query_len == 1. Every
    # sequence lands in exactly one of them whatever the hints say.
    mixed = max_query_len > 1 and num_seqs > 1
    quant = out_scale is not None
    scales = out_scale if quant else out  # unused without QUANT_OUT
    scale_strides = (out_scale.stride(0), out_scale.stride(1)) if quant else (0, 0)
    use_new = new_ok and cfg["NEW_KV"] and splits == 1
    key, value = new_kv if use_new else (q, q)  # unused when not use_new
    tma = use_new and cfg["NEW_KV_TMA"] and has_tma(q.device)
    descs = _kv_descriptors(key, value, cfg["TILE"], head_dim) if tma else None
    args = (q, k_cache, v_cache, out, scales, part_out, part_m, part_l,
            block_tables, query_start_loc, seq_lens,
            scale * k_scale * _LOG2E, float(v_scale), num_seqs, num_heads,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *scale_strides,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0), block_tables.stride(1))
    new_args = (key, value, *(descs or (key, value)), key.stride(0), key.stride(1), value.stride(0), value.stride(1))
    no_new = (q, q, q, q, 0, 0, 0, 0)
    common = {"QPK": qpk, "HEAD_DIM": head_dim, "HEAD_DIM_P": head_dim_p, "BLOCK_SIZE": block_size,
              "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32", "SLIDING_WINDOW": sliding_window,
              "QUANT_OUT": quant}
    pack = cfg["PACK_HEADS"]
    grid = (num_tokens // cfg["BLOCK_Q"] + num_seqs, num_kv_heads if pack else num_heads, splits)
    _paged_attn_kernel[grid](
        *args, *(new_args if use_new else no_new), **common, BLOCK_M=cfg["BLOCK_M"], BLOCK_Q=cfg["BLOCK_Q"],
        TILE=cfg["TILE"], NUM_SPLITS=splits, SEQ_FILTER=1 if mixed else 0, PACK_HEADS=pack, NEW_KV=use_new,
        NEW_KV_TMA=descs is not None, WARP_SPEC=use_new and cfg["WARP_SPEC"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if mixed:
        dec = _attention_config(q.dtype, qpk, num_seqs, num_kv_heads, 1, max_seq_len, num_sms(q.device),
                                head_dim=head_dim_p, smem_limit=smem)
        _paged_attn_kernel[(num_seqs, num_kv_heads, 1)](
            *args, *no_new, **common, BLOCK_M=dec["BLOCK_M"], BLOCK_Q=1, TILE=dec["TILE"], NUM_SPLITS=1,
            SEQ_FILTER=2, num_warps=dec["num_warps"], num_stages=dec["num_stages"],
        )
    if splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            q, out, scales, part_out, part_m, part_l, query_start_loc, num_seqs, num_heads,
            out.stride(0), out.stride(1), *scale_strides,
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, NUM_SPLITS=splits, SPLITS_P=_next_pow2(splits),
            QUANT_OUT=quant, num_warps=4,
        )
    return out
