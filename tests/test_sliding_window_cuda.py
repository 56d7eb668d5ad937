"""Sliding-window attention in the Triton kernel (decode, split-KV decode, varlen prefill,
mixed batches) against the dense float64 oracle of ``test_sliding_window`` (transformers'
mask function). CUDA only; with ``TRITON_INTERPRET=1`` and Triton installed the same tests
run on CPU tensors through Triton's interpreter (slowly), which is how they were first
checked on a machine without a GPU.

Table entries of blocks wholly before every query's window point at a NaN block and the
output is NaN-poisoned first: a kernel that reads skipped blocks, or forgets a row, fails.
"""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import (
    _paged_attention_triton,
    check_attention_args,
    paged_attention,
    paged_attention_ref,
)
from tests.test_sliding_window import _oracle, _paged_batch, drive_windowed_requests
from tests.triton_target import DEV, INTERPRET, KERNEL_TEST_MARKS
from worker.models.attention import TritonAttentionBackend

pytestmark = KERNEL_TEST_MARKS

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _triton(b: dict, dtype: torch.dtype, scale: float, window: int | None, max_query_len: int,
            max_seq_len: int) -> torch.Tensor:
    q = b["q"].to(DEV, dtype)
    kc, vc = b["k_cache"].to(DEV, dtype), b["v_cache"].to(DEV, dtype)
    args = (q, kc, vc, b["block_tables"].to(DEV), b["query_start_loc"].to(DEV), b["seq_lens"].to(DEV))
    out = torch.full_like(q, float("nan"))
    if INTERPRET:  # the public wrapper sends CPU tensors to the reference
        check_attention_args(*args)
        return _paged_attention_triton(*args, scale, out, max_query_len, max_seq_len, window or 0)
    return paged_attention(*args, scale, out, max_query_len=max_query_len, max_seq_len=max_seq_len,
                           sliding_window=window)


def _check(seqs, num_kv_heads, qpk, head_dim, block_size, window, dtype, max_seq_len=None) -> None:
    if INTERPRET and dtype != torch.float32:
        pytest.skip("Triton's interpreter computes bfloat16 wrongly, with or without a window")
    b = _paged_batch(seqs, num_kv_heads, qpk, head_dim, block_size, window)
    scale = head_dim ** -0.5
    got = _triton(b, dtype, scale, window, max(n for n, _ in seqs), max_seq_len or max(s for _, s in seqs))
    # The oracle sees the same rounded inputs as the kernel.
    b["q"] = b["q"].to(dtype)
    b["dense_k"] = [k.to(dtype) for k in b["dense_k"]]
    b["dense_v"] = [v.to(dtype) for v in b["dense_v"]]
    want = _oracle(b, scale, window)
    assert not got.isnan().any()
    err = ((got.double().cpu() - want).norm() / want.norm()).item()
    assert err < TOL[dtype], err


DECODE = [  # (seq_lens, window)
    ([300, 7, 129, 64, 2049], 1),
    ([300, 7, 129, 64, 2049], 37),     # window not a multiple of the tile or block
    ([2000], 256),                     # one long sequence: split-KV over the window
    ([1500, 33], 4096),                # window >= seq_len: plain causal
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("s_lens,window", DECODE)
@pytest.mark.parametrize("num_kv_heads,qpk,head_dim,block_size", [(2, 4, 64, 16), (1, 7, 128, 32)])
def test_decode_matches_oracle(s_lens, window, num_kv_heads, qpk, head_dim, block_size, dtype) -> None:
    _check([(1, s) for s in s_lens], num_kv_heads, qpk, head_dim, block_size, window, dtype)


def test_large_decode_batch_without_splits() -> None:
    """Enough sequences to fill the GPU: one program per (sequence, KV head), long tiles."""
    lens = [40 + 37 * i for i in range(140)]
    _check([(1, s) for s in lens], 2, 4, 64, 16, 100, torch.bfloat16)


PREFILL = [  # (seqs as (query_len, seq_len), window)
    ([(70, 70), (9, 9)], 16),                          # from scratch, window < query length
    ([(50, 300), (120, 200)], 64),                     # chunks after context, spanning the window
    ([(33, 90), (1, 500), (64, 64), (1, 3), (5, 260)], 37),  # mixed: prefill + decode launches
    ([(40, 100), (1, 100)], 1),
    ([(100, 130), (1, 77)], 1000),                     # window >= seq_len
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seqs,window", PREFILL)
@pytest.mark.parametrize("num_kv_heads,qpk,head_dim,block_size", [(2, 4, 64, 16), (1, 3, 128, 32)])
def test_prefill_and_mixed_match_oracle(seqs, window, num_kv_heads, qpk, head_dim, block_size, dtype) -> None:
    _check(seqs, num_kv_heads, qpk, head_dim, block_size, window, dtype)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need CUDA")
def test_cuda_graph_replay_with_window() -> None:
    """Captured once with a window, replayed with other lengths and tables."""
    num_kv_heads, qpk, head_dim, block_size, bucket, max_len, window = 2, 4, 64, 16, 4, 1024, 100
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
                        max_query_len=1, max_seq_len=max_len, sliding_window=window)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        seq_lens.copy_(torch.randint(1, max_len + 1, (bucket,), generator=gen).int())
        tables.copy_(torch.randperm(pool, generator=gen).view(bucket, max_blocks).int())
        q.copy_(torch.randn(q.shape, generator=gen).to(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, qsl, seq_lens, scale,
                                  sliding_window=window)
        assert not out.isnan().any()
        assert ((out.float() - ref).norm() / ref.norm()).item() < TOL[torch.bfloat16]


@pytest.mark.skipif(INTERPRET, reason="the backend runs Triton on CUDA tensors only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scheduler_frees_blocks_the_kernels_never_read(dtype) -> None:
    """Freed blocks (``FREED_BLOCK`` entries, then reused by another request) through the
    Triton KV write and attention: see ``drive_windowed_requests``."""
    drive_windowed_requests(TritonAttentionBackend(), DEV, dtype)
