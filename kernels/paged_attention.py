"""Varlen attention over the paged KV cache, for prefill chunks and decode in one call.

Each sequence ``b`` contributes ``query_len_b = query_start_loc[b+1] - query_start_loc[b]``
query tokens, which are the *last* ``query_len_b`` of its ``seq_lens[b]`` context tokens;
all ``seq_lens[b]`` keys and values (earlier context and the new tokens) are already in
the cache. Attention is causal: the query at absolute position ``p`` sees keys ``0..p``.
A decode token is the case ``query_len_b == 1``; a prefill chunk with cached context
(prefix caching, chunked prefill) is ``1 < query_len_b <= seq_lens[b]``.

Source: the varlen-over-paged-cache formulation of vLLM's ``unified_attention`` and of
FlashAttention-2's ``flash_attn_varlen_func`` with a block table (Dao, 2023).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    if q.dtype != k_cache.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, cache {k_cache.dtype}")
    num_seqs = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [num_seqs + 1], got {tuple(query_start_loc.shape)}")
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Contiguous ``[length, num_kv_heads, head_dim]`` view of one sequence's cache."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float,
                        out: torch.Tensor | None = None,
                        query_lens_cpu: list[int] | None = None,
                        seq_lens_cpu: list[int] | None = None) -> torch.Tensor:
    """PyTorch reference of causal varlen attention over the paged cache (CPU and CUDA).

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, float32/bfloat16/float16.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32, physical block ids.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query lengths (tokens).
        seq_lens: ``[num_seqs]`` int32, context length of each sequence including its
            new tokens.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: optional ``[num_tokens, num_heads, head_dim]`` output buffer.
        query_lens_cpu, seq_lens_cpu: the same lengths as Python lists, when the caller
            has them, to avoid device-to-host copies.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in q's dtype.

    Raises:
        ValueError: shapes or dtypes do not match (see ``check_attention_args``).
    """
    check_attention_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    q_lens = query_lens_cpu if query_lens_cpu is not None else [b - a for a, b in zip(starts, starts[1:])]
    s_lens = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.tolist()
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    gqa = num_heads != num_kv_heads

    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if len(decode) > 1:
        _decode_batch(q, k_cache, v_cache, block_tables, starts, s_lens, decode, scale, out, gqa)
        done = set(decode)
    else:
        done = set()
    for i, q_len in enumerate(q_lens):
        if i in done or q_len == 0:
            continue
        start, ctx = starts[i], s_lens[i]
        k = _gather_kv(k_cache, block_tables[i], ctx).transpose(0, 1)  # [kvh, ctx, d]
        v = _gather_kv(v_cache, block_tables[i], ctx).transpose(0, 1)
        qi = q[start:start + q_len].transpose(0, 1)  # [h, q_len, d]
        # Query j sits at absolute position ctx - q_len + j and sees keys 0..that position.
        pos_q = torch.arange(ctx - q_len, ctx, device=q.device)
        mask = pos_q[:, None] >= torch.arange(ctx, device=q.device)[None, :]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start:start + q_len] = o.transpose(0, 1)
    return out


def _decode_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, starts: list[int], s_lens: list[int],
                  rows: list[int], scale: float, out: torch.Tensor, gqa: bool) -> None:
    """Single-token queries of several sequences as one padded SDPA call."""
    device = q.device
    max_len = max(s_lens[i] for i in rows)
    block_size = k_cache.shape[1]
    num_blocks = (max_len + block_size - 1) // block_size
    idx = torch.tensor(rows, device=device)
    tables = block_tables.index_select(0, idx)[:, :num_blocks].long()  # [B, nb]
    bsz = len(rows)
    k = k_cache[tables].reshape(bsz, num_blocks * block_size, *k_cache.shape[2:])[:, :max_len]
    v = v_cache[tables].reshape(bsz, num_blocks * block_size, *v_cache.shape[2:])[:, :max_len]
    lens = torch.tensor([s_lens[i] for i in rows], device=device)
    mask = torch.arange(max_len, device=device)[None, :] < lens[:, None]  # [B, L]
    tok = torch.tensor([starts[i] for i in rows], device=device)
    qb = q.index_select(0, tok).unsqueeze(2)  # [B, h, 1, d]
    o = F.scaled_dot_product_attention(qb, k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=gqa)
    out.index_copy_(0, tok, o.squeeze(2))
