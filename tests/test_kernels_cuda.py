"""Triton kernels against the PyTorch references on random paged batches (CUDA only).

Every output buffer is NaN-poisoned first, so an element the kernel forgets to write
fails the comparison; rows that must stay unwritten (padding) are checked to stay NaN.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.kv_cache_write import kv_cache_write, kv_cache_write_ref
from kernels.paged_attention import paged_attention, paged_attention_ref

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
BF16_TOL = 1e-2
FP16_TOL = 5e-3
FP32_TOL = 1e-5


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _make_batch(seqs: list[tuple[int, int]], num_kv_heads: int, qpk: int, head_dim: int,
                block_size: int, dtype: torch.dtype, *, num_pad_seqs: int = 0, num_pad_tokens: int = 0,
                spare_blocks: int = 7, seed: int = 0) -> dict:
    """Random paged batch: seqs are (query_len, seq_len); block tables are a random
    permutation of the pool (non-contiguous), trailing entries random garbage ids."""
    gen = torch.Generator().manual_seed(seed)
    q_lens = [a for a, _ in seqs] + [0] * num_pad_seqs
    s_lens = [b for _, b in seqs] + [0] * num_pad_seqs
    assert all(0 <= a <= b for a, b in zip(q_lens, s_lens))
    num_blocks_per = [-(-s // block_size) for s in s_lens]
    max_blocks = max(max(num_blocks_per), 1) + 2
    pool = sum(num_blocks_per) + spare_blocks
    perm = torch.randperm(pool, generator=gen)
    tables = torch.randint(0, pool, (len(s_lens), max_blocks), generator=gen, dtype=torch.int32)
    owned = torch.zeros(pool, block_size, dtype=torch.bool)
    o = 0
    for i, n in enumerate(num_blocks_per):
        tables[i, :n] = perm[o:o + n].int()
        for j in range(n):
            owned[perm[o + j], :min(block_size, s_lens[i] - j * block_size)] = True
        o += n
    num_tokens = sum(q_lens) + num_pad_tokens
    k_cache = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(num_tokens, num_kv_heads * qpk, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return {"q": q.to(DEV), "k_cache": k_cache.to(DEV), "v_cache": v_cache.to(DEV),
            "block_tables": tables.to(DEV), "query_start_loc": qsl.to(DEV),
            "seq_lens": torch.tensor(s_lens, dtype=torch.int32, device=DEV), "owned": owned.to(DEV),
            "num_real_tokens": sum(q_lens), "max_query_len": max(q_lens), "max_seq_len": max(s_lens)}


def _run_both(b: dict, *, max_query_len: int | None = None, max_seq_len: int | None = None,
              cache_override: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    scale = b["q"].shape[-1] ** -0.5
    meta = (b["block_tables"], b["query_start_loc"], b["seq_lens"])
    out = torch.full_like(b["q"], float("nan"))
    k_cache, v_cache = cache_override or (b["k_cache"], b["v_cache"])
    paged_attention(b["q"], k_cache, v_cache, *meta, scale, out,
                    max_query_len=max_query_len or b["max_query_len"],
                    max_seq_len=max_seq_len or b["max_seq_len"])
    # Oracle in fp32 from the same (rounded) inputs.
    ref = paged_attention_ref(b["q"].float(), b["k_cache"].float(), b["v_cache"].float(), *meta, scale)
    return out, ref


def _tol(dtype: torch.dtype) -> float:
    return {torch.bfloat16: BF16_TOL, torch.float16: FP16_TOL, torch.float32: FP32_TOL}[dtype]


def _ragged(rng: random.Random, n: int, max_ctx: int, mode: str) -> list[tuple[int, int]]:
    seqs = []
    for _ in range(n):
        s = rng.randint(1, max_ctx)
        if mode == "decode":
            seqs.append((1, s))
        elif mode == "prefill":  # empty context
            seqs.append((s, s))
        elif mode == "chunk":  # prefill chunk after cached context
            seqs.append((rng.randint(1, s), s))
        else:  # mixed
            seqs.append(rng.choice([(1, s), (s, s), (rng.randint(1, s), s)]))
    return seqs


CASES = [
    # (mode, num_seqs, max_ctx, num_kv_heads, qpk, head_dim, block_size, dtype)
    ("decode", 5, 300, 4, 7, 128, 16, torch.bfloat16),
    ("decode", 3, 8192, 2, 8, 128, 32, torch.bfloat16),
    ("decode", 1, 8192, 4, 7, 128, 16, torch.bfloat16),
    ("decode", 9, 2000, 2, 1, 64, 16, torch.float16),
    ("decode", 64, 700, 4, 7, 128, 16, torch.bfloat16),
    # Three or more programs an SM (a 132-SM H100/H200): 64-key tiles, two stages.
    ("decode", 160, 700, 4, 7, 128, 16, torch.bfloat16),
    ("decode", 256, 300, 4, 7, 128, 16, torch.float16),
    ("prefill", 3, 700, 4, 7, 128, 16, torch.bfloat16),
    ("prefill", 2, 4096, 2, 4, 128, 32, torch.bfloat16),
    ("prefill", 4, 257, 3, 3, 64, 16, torch.float16),
    ("chunk", 4, 3000, 2, 8, 64, 32, torch.bfloat16),
    ("chunk", 3, 8192, 1, 4, 128, 16, torch.bfloat16),
    ("mixed", 12, 1500, 4, 7, 128, 16, torch.bfloat16),
    ("mixed", 160, 600, 4, 7, 128, 16, torch.bfloat16),
    ("mixed", 8, 600, 2, 3, 64, 32, torch.bfloat16),
    ("mixed", 6, 900, 8, 1, 128, 32, torch.float16),
    ("mixed", 6, 400, 2, 7, 64, 16, torch.float32),
    ("decode", 4, 1000, 2, 4, 128, 32, torch.float32),
    ("prefill", 2, 300, 1, 8, 128, 16, torch.float32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_attention_matches_reference(case: tuple) -> None:
    mode, n, max_ctx, num_kv_heads, qpk, head_dim, block_size, dtype = case
    rng = random.Random(CASES.index(case))
    seqs = _ragged(rng, n, max_ctx, mode)
    b = _make_batch(seqs, num_kv_heads, qpk, head_dim, block_size, dtype, seed=rng.randint(0, 10**6))
    out, ref = _run_both(b)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < _tol(dtype)
    # Per-sequence check too: one bad short sequence must not hide in the global norm.
    qsl = b["query_start_loc"].tolist()
    for i in range(len(seqs)):
        assert _rel_err(out[qsl[i]:qsl[i + 1]], ref[qsl[i]:qsl[i + 1]]) < 2 * _tol(dtype), f"seq {i} {seqs[i]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_edge_lengths(dtype: torch.dtype) -> None:
    """Single-key sequences, exact block multiples, partial last blocks, q_len == seq_len."""
    seqs = [(1, 1), (1, 16), (1, 17), (16, 16), (17, 17), (1, 32), (31, 33), (2, 2), (5, 64), (1, 65)]
    b = _make_batch(seqs, 2, 4, 64, 16, dtype)
    for mql in (b["max_query_len"], 1, 1000):  # hints never change the answer
        out, ref = _run_both(b, max_query_len=mql)
        assert not out.isnan().any()
        assert _rel_err(out, ref) < _tol(dtype)


@pytest.mark.parametrize("mode", ["decode", "mixed"])
def test_padding_rows_are_harmless(mode: str) -> None:
    """Padded sequences (seq_len 0, query_len 0) and spare q rows are left unwritten."""
    rng = random.Random(7)
    seqs = _ragged(rng, 5, 2500, mode)
    b = _make_batch(seqs, 4, 7, 128, 16, torch.bfloat16, num_pad_seqs=11, num_pad_tokens=11)
    out, ref = _run_both(b, max_seq_len=8192)
    n = b["num_real_tokens"]
    assert not out[:n].isnan().any()
    assert out[n:].isnan().all()
    assert _rel_err(out[:n], ref[:n]) < BF16_TOL


def test_unowned_cache_slots_are_never_read() -> None:
    """NaN everywhere outside the sequences' own slots: the result must not change."""
    rng = random.Random(3)
    seqs = _ragged(rng, 6, 1000, "mixed") + [(1, 33), (1, 1)]
    b = _make_batch(seqs, 2, 4, 128, 16, torch.bfloat16)
    mask = b["owned"][:, :, None, None]
    nan = torch.tensor(float("nan"), dtype=torch.bfloat16, device=DEV)
    poisoned = (torch.where(mask, b["k_cache"], nan), torch.where(mask, b["v_cache"], nan))
    for mql in (b["max_query_len"], 1):
        out, ref = _run_both(b, max_query_len=mql, cache_override=poisoned)
        assert not out.isnan().any()
        assert _rel_err(out, ref) < BF16_TOL


def test_cuda_graph_replay_with_new_lengths() -> None:
    """Captured once at bucket size, replayed with other lengths, tables and padding."""
    num_kv_heads, qpk, head_dim, block_size, bucket, max_len = 4, 7, 128, 16, 8, 4096
    max_blocks = max_len // block_size
    pool = bucket * max_blocks
    k_cache = torch.randn(pool, block_size, num_kv_heads, head_dim, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(bucket, num_kv_heads * qpk, head_dim, device=DEV, dtype=torch.bfloat16)
    tables = torch.zeros(bucket, max_blocks, dtype=torch.int32, device=DEV)
    qsl = torch.arange(bucket + 1, dtype=torch.int32, device=DEV)
    seq_lens = torch.ones(bucket, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5

    def step() -> None:
        paged_attention(q, k_cache, v_cache, tables, qsl, seq_lens, scale, out,
                        max_query_len=1, max_seq_len=max_len)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(11)
    for num_real in (8, 3, 1, 5):
        lens = torch.randint(1, max_len + 1, (bucket,), generator=gen)
        lens[num_real:] = 0
        seq_lens.copy_(lens.int())
        qsl.copy_(torch.tensor([0] + [min(i, num_real) for i in range(1, bucket + 1)], dtype=torch.int32))
        tables.copy_(torch.randperm(pool, generator=gen)[:bucket * max_blocks].view(bucket, max_blocks).int())
        q.copy_(torch.randn(q.shape, generator=gen).to(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_ref(q[:num_real].float(), k_cache.float(), v_cache.float(), tables[:num_real],
                                  qsl[:num_real + 1], seq_lens[:num_real], scale)
        assert not out[:num_real].isnan().any()
        assert out[num_real:].isnan().all()
        assert _rel_err(out[:num_real], ref) < BF16_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(4, 128, 16), (2, 64, 32), (3, 80, 16)])
def test_kv_cache_write_matches_reference(dtype: torch.dtype, slot_dtype: torch.dtype, num_kv_heads: int,
                                          head_dim: int, block_size: int) -> None:
    num_blocks, num_tokens = 97, 300
    gen = torch.Generator().manual_seed(num_kv_heads * head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1  # padding tokens
    slots = slots.to(slot_dtype).to(DEV)
    # key/value as strided slices of a fused QKV output: [tokens, q+k+v heads, head_dim].
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEV)
    key, value = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEV)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_cache_write(key, value, k_cache, v_cache, slots)
    kv_cache_write_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))


def test_kv_cache_write_all_padding_and_empty() -> None:
    k_cache = torch.zeros(4, 16, 2, 64, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(5, 2, 64, device=DEV, dtype=torch.bfloat16)
    kv_cache_write(key, key, k_cache, v_cache, torch.full((5,), -1, dtype=torch.int64, device=DEV))
    kv_cache_write(key[:0], key[:0], k_cache, v_cache, torch.zeros(0, dtype=torch.int64, device=DEV))
    assert not k_cache.any() and not v_cache.any()
