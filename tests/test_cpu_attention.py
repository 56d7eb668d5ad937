"""The CPU decode attention kernel (C++, built on first use) against the naive oracle of
test_kernels_ref and the PyTorch reference, alone and inside the CPU backend."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels import cpu_attention, cpu_extension
from kernels.paged_attention import paged_attention_ref
from tests.test_kernels_ref import _batch, _naive_attention
from worker.models.attention import AttentionMetadata, CpuAttentionBackend, TorchAttentionBackend, select_backend

# CI machines have g++ and ninja (the `ninja` package is a dependency): there the kernel
# must build, so a build failure fails these tests instead of skipping them.
pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler on this machine")


def _decode_only(s_lens, num_kv_heads, qpk, head_dim, block_size, dtype=torch.float32):
    q, kc, vc, tables, _, seq_lens, _, _ = _batch([(1, s) for s in s_lens], num_kv_heads, qpk, head_dim,
                                                  block_size, dtype=dtype)
    idx = torch.arange(len(s_lens), dtype=torch.int32)
    return q, kc, vc, tables, seq_lens, idx


def test_kernel_builds_here() -> None:
    assert cpu_extension.available()


@pytest.mark.parametrize("s_lens,num_kv_heads,qpk,head_dim,block_size", [
    ([5, 17, 1], 2, 3, 16, 4),          # partial blocks, a one-token context, GQA 3
    ([16, 32, 33], 1, 1, 8, 16),        # MHA, lengths at and past block edges
    ([300, 7, 129, 64], 3, 3, 64, 16),  # SmolLM2's heads (9 query, 3 KV, 64 dims)
    ([40], 4, 2, 32, 32),               # one sequence, block size 32
])
def test_kernel_matches_naive(s_lens, num_kv_heads, qpk, head_dim, block_size) -> None:
    q, kc, vc, tables, seq_lens, idx = _decode_only(s_lens, num_kv_heads, qpk, head_dim, block_size)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    cpu_attention.decode_attention(out, q, kc, vc, tables, seq_lens, idx, idx, scale)
    want = _naive_attention(q, kc, vc, tables, [1] * len(s_lens), s_lens, scale)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)


def test_kernel_writes_only_the_rows_it_is_given() -> None:
    """token_idx/seq_idx pick rows of a larger q: the others keep what was there."""
    q, kc, vc, tables, seq_lens, _ = _decode_only([9, 20, 3, 11], 2, 2, 16, 4)
    scale = 0.25
    out = torch.zeros_like(q)
    token_idx = torch.tensor([3, 1], dtype=torch.int32)
    seq_idx = torch.tensor([3, 1], dtype=torch.int32)
    cpu_attention.decode_attention(out, q, kc, vc, tables, seq_lens, token_idx, seq_idx, scale)
    want = _naive_attention(q, kc, vc, tables, [1] * 4, seq_lens.tolist(), scale)
    torch.testing.assert_close(out[[1, 3]].double(), want[[1, 3]], atol=2e-5, rtol=1e-4)
    assert out[[0, 2]].abs().sum() == 0


def test_kernel_bfloat16_is_close_to_float32() -> None:
    q, kc, vc, tables, seq_lens, idx = _decode_only([50, 200], 3, 3, 64, 16)
    out32 = torch.empty_like(q)
    cpu_attention.decode_attention(out32, q, kc, vc, tables, seq_lens, idx, idx, 0.125)
    qb, kb, vb = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    out16 = torch.empty_like(qb)
    cpu_attention.decode_attention(out16, qb, kb, vb, tables, seq_lens, idx, idx, 0.125)
    torch.testing.assert_close(out16.float(), out32, atol=3e-2, rtol=3e-2)


def test_kernel_rejects_bad_arguments() -> None:
    q, kc, vc, tables, seq_lens, idx = _decode_only([5, 6], 2, 2, 16, 4)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_attention.decode_attention(out, q, kc, vc, tables.long(), seq_lens, idx, idx, 0.25)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_attention.decode_attention(out, q.double(), kc, vc, tables, seq_lens, idx, idx, 0.25)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_attention.decode_attention(out, q, kc.transpose(1, 2), vc.transpose(1, 2), tables, seq_lens,
                                       idx, idx, 0.25)


@pytest.mark.parametrize("seqs", [
    [(4, 9), (1, 12), (7, 7), (1, 3), (2, 16)],  # mixed: chunks after context, decodes
    [(1, 30), (1, 2)],                            # decode only
    [(6, 6), (3, 3)],                             # prefill only
])
def test_cpu_backend_matches_reference_backend(seqs) -> None:
    """Whole backend calls (KV write, then attend) on a mixed batch: the CPU backend
    equals the PyTorch reference backend."""
    q, kc, vc, tables, qsl, seq_lens, q_lens, s_lens = _batch(seqs, 2, 3, 16, 4)
    slots = []
    for b, (q_len, s_len) in enumerate(seqs):
        slots += [int(tables[b, p // 4]) * 4 + p % 4 for p in range(s_len - q_len, s_len)]
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(q.shape[0], 2, 16, generator=gen)
    v = torch.randn(q.shape[0], 2, 16, generator=gen)
    outs = []
    for backend in (TorchAttentionBackend(), CpuAttentionBackend()):
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=tables, query_start_loc=qsl,
                                 seq_lens=seq_lens, max_query_len=max(q_lens), max_seq_len=max(s_lens),
                                 query_lens_cpu=q_lens, seq_lens_cpu=s_lens, has_padding=False)
        outs.append(backend(q, k, v, kc.clone(), vc.clone(), meta, 0.25))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    want = paged_attention_ref(q, *_written(kc, vc, k, v, slots), tables, qsl, seq_lens, 0.25)
    torch.testing.assert_close(outs[1], want, atol=1e-5, rtol=1e-5)


def _written(kc, vc, k, v, slots):
    kc, vc = kc.clone(), vc.clone()
    for i, s in enumerate(slots):
        kc[s // 4, s % 4], vc[s // 4, s % 4] = k[i], v[i]
    return kc, vc


def test_auto_backend_on_cpu_is_the_kernel() -> None:
    assert isinstance(select_backend("auto", torch.device("cpu")), CpuAttentionBackend)
    assert isinstance(select_backend("torch", torch.device("cpu")), TorchAttentionBackend)
    with pytest.raises(ValueError, match="cpu attention backend"):
        select_backend("cpu", torch.device("meta"))
