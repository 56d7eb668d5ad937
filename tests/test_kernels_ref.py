"""The PyTorch reference kernels (CPU) against naive per-token implementations."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.kv_cache_write import kv_cache_write, kv_cache_write_ref
from kernels.paged_attention import paged_attention, paged_attention_ref


def _naive_attention(q, k_cache, v_cache, block_tables, q_lens, s_lens, scale):
    """One query token and one head at a time: explicit slot lookup and softmax."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    qpk = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    tok = 0
    for b, (q_len, s_len) in enumerate(zip(q_lens, s_lens)):
        for j in range(q_len):
            pos = s_len - q_len + j
            for h in range(q.shape[1]):
                kvh = h // qpk
                scores, values = [], []
                for key in range(pos + 1):
                    blk = int(block_tables[b, key // block_size])
                    k = k_cache[blk, key % block_size, kvh].double()
                    scores.append(float(q[tok, h].double() @ k) * scale)
                    values.append(v_cache[blk, key % block_size, kvh].double())
                m = max(scores)
                w = [math.exp(s - m) for s in scores]
                out[tok, h] = sum(wi * vi for wi, vi in zip(w, values)) / sum(w)
            tok += 1
    return out


def _batch(seqs, num_kv_heads, qpk, head_dim, block_size, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q_lens = [a for a, _ in seqs]
    s_lens = [b for _, b in seqs]
    nbs = [-(-s // block_size) for s in s_lens]
    pool = sum(nbs) + 3
    perm = torch.randperm(pool, generator=gen)
    tables = torch.randint(0, pool, (len(seqs), max(max(nbs), 1) + 1), generator=gen, dtype=torch.int32)
    o = 0
    for i, n in enumerate(nbs):
        tables[i, :n] = perm[o:o + n].int()
        o += n
    kc = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    vc = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), num_kv_heads * qpk, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, kc, vc, tables, qsl, torch.tensor(s_lens, dtype=torch.int32), q_lens, s_lens


@pytest.mark.parametrize("seqs,num_kv_heads,qpk,head_dim,block_size", [
    ([(1, 5), (1, 17), (1, 1)], 2, 3, 16, 4),               # pure decode, partial blocks
    ([(6, 6), (3, 3)], 1, 4, 8, 4),                         # pure prefill, empty context
    ([(4, 9), (1, 12), (7, 7), (1, 3), (2, 16)], 2, 2, 8, 4),  # mixed, chunks after context
    ([(1, 40)], 3, 1, 32, 16),                              # single decode (no batch path)
    ([(5, 33), (1, 32)], 1, 7, 16, 16),
])
def test_reference_attention_matches_naive(seqs, num_kv_heads, qpk, head_dim, block_size) -> None:
    q, kc, vc, tables, qsl, sl, q_lens, s_lens = _batch(seqs, num_kv_heads, qpk, head_dim, block_size)
    scale = head_dim ** -0.5
    ref = paged_attention_ref(q, kc, vc, tables, qsl, sl, scale)
    naive = _naive_attention(q, kc, vc, tables, q_lens, s_lens, scale)
    torch.testing.assert_close(ref.double(), naive, rtol=1e-5, atol=1e-5)
    # The public wrapper on CPU is the reference.
    out = paged_attention(q, kc, vc, tables, qsl, sl, scale, max_query_len=max(q_lens), max_seq_len=max(s_lens))
    torch.testing.assert_close(out, ref)


def test_reference_attention_lists_match_tensors() -> None:
    q, kc, vc, tables, qsl, sl, q_lens, s_lens = _batch([(3, 10), (1, 7), (1, 9)], 2, 2, 16, 4, seed=1)
    a = paged_attention_ref(q, kc, vc, tables, qsl, sl, 0.25)
    b = paged_attention_ref(q, kc, vc, tables, qsl, sl, 0.25, query_lens_cpu=q_lens, seq_lens_cpu=s_lens)
    torch.testing.assert_close(a, b)


def test_reference_attention_with_this_steps_kv_matches_the_cache() -> None:
    """Sequences whose whole context is in the step attend to the passed ``key``/``value``
    (the engine's CPU path); the result equals reading the same K/V from the cache."""
    seqs = [(6, 6), (1, 9), (4, 11), (5, 5)]
    q, kc, vc, tables, qsl, sl, q_lens, _ = _batch(seqs, 2, 3, 16, 4, seed=2)
    block_size = kc.shape[1]
    rows = [(b, s - n + j) for b, (n, s) in enumerate(seqs) for j in range(n)]  # (seq, position)
    key = torch.stack([kc[tables[b, p // block_size], p % block_size] for b, p in rows])
    value = torch.stack([vc[tables[b, p // block_size], p % block_size] for b, p in rows])
    a = paged_attention_ref(q, kc, vc, tables, qsl, sl, 0.25)
    b = paged_attention_ref(q, kc, vc, tables, qsl, sl, 0.25, key=key, value=value)
    torch.testing.assert_close(a, b)
    # And the passed K/V are what is read: poison them and the fresh-context rows change.
    c = paged_attention_ref(q, kc, vc, tables, qsl, sl, 0.25, key=key + 1.0, value=value + 1.0)
    fresh = torch.tensor([n == s for n, s in seqs]).repeat_interleave(torch.tensor(q_lens))
    assert not torch.allclose(a[fresh], c[fresh]) and torch.equal(a[~fresh], c[~fresh])


def test_reference_attention_rejects_bad_shapes() -> None:
    q, kc, vc, tables, qsl, sl, _, _ = _batch([(1, 5)], 2, 2, 16, 4)
    with pytest.raises(ValueError):
        paged_attention_ref(q[:, :3], kc, vc, tables, qsl, sl, 0.25)
    with pytest.raises(ValueError):
        paged_attention_ref(q, kc, vc, tables, qsl[:1], sl, 0.25)
    with pytest.raises(ValueError):
        paged_attention_ref(q.double(), kc, vc, tables, qsl, sl, 0.25)


def test_reference_kv_write_places_tokens_and_skips_padding() -> None:
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 2, 8
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(4, num_kv_heads, head_dim)
    value = torch.randn(4, num_kv_heads, head_dim)
    slots = torch.tensor([6, -1, 19, 0], dtype=torch.int32)
    kv_cache_write_ref(key, value, k_cache, v_cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        assert torch.equal(k_cache[s // block_size, s % block_size], key[t])
        assert torch.equal(v_cache[s // block_size, s % block_size], value[t])
    written = k_cache.abs().sum(dim=(2, 3)) != 0
    assert int(written.sum()) == 3  # the padding token wrote nothing
    # The public wrapper on CPU is the reference.
    k2, v2 = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    kv_cache_write(key, value, k2, v2, slots)
    assert torch.equal(k2, k_cache) and torch.equal(v2, v_cache)


def test_reference_kv_write_rejects_bad_args() -> None:
    k_cache = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError):
        kv_cache_write_ref(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), k_cache, k_cache.clone(),
                           torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError):
        kv_cache_write_ref(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), k_cache, k_cache.clone(),
                           torch.zeros(3, dtype=torch.float32))
