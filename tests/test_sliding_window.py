"""Sliding-window attention on CPU: the PyTorch reference (prefill, chunked prefill and
decode paths) and the C++ decode kernel against a dense oracle whose mask is
transformers' own ``sliding_window_causal_mask_function`` (so the off-by-one is theirs).

Blocks wholly before every query's window are filled with NaN: a path that reads them
(instead of skipping them) poisons its output.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function

from kernels import cpu_attention
from kernels.paged_attention import paged_attention, paged_attention_ref
from shared.sampling import SamplingParams
from worker.engine.block_manager import FREED_BLOCK, NO_HASH, BlockManager
from worker.engine.model_runner import slot
from worker.engine.request import Request
from worker.engine.scheduler import Scheduler
from worker.models.attention import AttentionMetadata, CpuAttentionBackend, TorchAttentionBackend

HAS_CXX = shutil.which("g++") is not None or shutil.which("c++") is not None


def _paged_batch(seqs: list[tuple[int, int]], num_kv_heads: int, qpk: int, head_dim: int, block_size: int,
                 window: int | None, seed: int = 0) -> dict:
    """Random dense K/V per sequence scattered into a paged cache through shuffled block
    tables. ``seqs`` are ``(query_len, seq_len)``; the queries are each sequence's last
    ``query_len`` positions. Table entries of blocks that no query's window reaches point
    at a NaN block."""
    gen = torch.Generator().manual_seed(seed)
    nbs = [-(-s // block_size) for _, s in seqs]
    pool = sum(nbs) + 2
    nan_block = pool - 1
    perm = torch.randperm(pool - 1, generator=gen)
    # Entries past a sequence's last block: a finite spare block (padding keys are masked,
    # but the reference's padded decode gather reads them, as it always has).
    tables = torch.full((len(seqs), max(nbs) + 1), int(perm[-1]), dtype=torch.int32)
    k_cache = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=gen)
    k_cache[nan_block] = v_cache[nan_block] = float("nan")
    dense_k, dense_v = [], []
    o = 0
    for i, ((q_len, s_len), n) in enumerate(zip(seqs, nbs)):
        tables[i, :n] = perm[o:o + n].int()
        o += n
        k = torch.cat([k_cache[b] for b in tables[i, :n].tolist()])[:s_len]
        v = torch.cat([v_cache[b] for b in tables[i, :n].tolist()])[:s_len]
        dense_k.append(k.clone())
        dense_v.append(v.clone())
        if window is not None:  # blocks before the first query's window: never read
            first_key = max(0, s_len - q_len - window + 1)
            tables[i, :first_key // block_size] = nan_block
    q_lens = [a for a, _ in seqs]
    s_lens = [b for _, b in seqs]
    q = torch.randn(sum(q_lens), num_kv_heads * qpk, head_dim, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables, "query_start_loc": qsl,
            "seq_lens": torch.tensor(s_lens, dtype=torch.int32), "q_lens": q_lens, "s_lens": s_lens,
            "dense_k": dense_k, "dense_v": dense_v}


def _oracle(batch: dict, scale: float, window: int | None) -> torch.Tensor:
    """Dense float64 attention per sequence, masked by transformers' mask function."""
    q = batch["q"].double()
    out = torch.empty_like(q)
    start = 0
    for q_len, s_len, k, v in zip(batch["q_lens"], batch["s_lens"], batch["dense_k"], batch["dense_v"]):
        qpk = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(qpk, dim=1).transpose(0, 1)  # [h, s_len, d]
        v = v.double().repeat_interleave(qpk, dim=1).transpose(0, 1)
        pos_q = torch.arange(s_len - q_len, s_len)[:, None]
        pos_k = torch.arange(s_len)[None, :]
        mask = pos_q >= pos_k
        if window is not None:
            mask = sliding_window_causal_mask_function(window)(0, 0, pos_q, pos_k)
        scores = (q[start:start + q_len].transpose(0, 1) @ k.transpose(1, 2)) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[start:start + q_len] = (probs @ v).transpose(0, 1)
        start += q_len
    return out


# (seqs, num_kv_heads, qpk, head_dim, block_size, window)
CASES = [
    ([(1, 21), (1, 5), (1, 9)], 2, 3, 16, 4, 6),        # decode, GQA 3, partial blocks
    ([(1, 21), (1, 17)], 1, 1, 8, 4, 1),                # window 1: each token sees itself
    ([(9, 9), (6, 6)], 2, 2, 16, 4, 4),                 # prefill from scratch (key/value path)
    ([(5, 20), (7, 30)], 2, 2, 16, 4, 8),               # chunked prefill spanning the window
    ([(4, 9), (1, 33), (7, 7), (1, 3), (2, 16)], 2, 2, 8, 4, 5),  # mixed prefill + decode
    ([(3, 12), (1, 12), (12, 12)], 1, 4, 16, 16, 100),  # window >= seq_len: plain causal
    ([(6, 40), (1, 64)], 2, 1, 32, 16, 16),             # window = block size
]


@pytest.mark.parametrize("seqs,num_kv_heads,qpk,head_dim,block_size,window", CASES)
def test_reference_matches_dense_oracle(seqs, num_kv_heads, qpk, head_dim, block_size, window) -> None:
    b = _paged_batch(seqs, num_kv_heads, qpk, head_dim, block_size, window)
    scale = head_dim ** -0.5
    want = _oracle(b, scale, window)
    args = (b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["query_start_loc"], b["seq_lens"], scale)
    got = paged_attention_ref(*args, sliding_window=window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # This step's key/value given (the model's path for prefills without context).
    flat_k = torch.cat([k[s - n:] for (n, s), k in zip(seqs, b["dense_k"])])
    flat_v = torch.cat([v[s - n:] for (n, s), v in zip(seqs, b["dense_v"])])
    got_kv = paged_attention_ref(*args, key=flat_k, value=flat_v, sliding_window=window)
    torch.testing.assert_close(got_kv.double(), want, atol=1e-5, rtol=1e-5)
    # The public wrapper on CPU is the reference.
    got_pub = paged_attention(*args, max_query_len=max(b["q_lens"]), max_seq_len=max(b["s_lens"]),
                              sliding_window=window)
    torch.testing.assert_close(got_pub, got)


def test_window_changes_the_output() -> None:
    """A window shorter than the context is not full attention (the oracle is not vacuous)."""
    b = _paged_batch([(4, 24), (1, 24)], 2, 2, 16, 4, None)
    args = (b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["query_start_loc"], b["seq_lens"], 0.25)
    full = paged_attention_ref(*args)
    windowed = paged_attention_ref(*args, sliding_window=6)
    assert (full - windowed).abs().amax() > 1e-2
    torch.testing.assert_close(windowed.double(), _oracle(b, 0.25, 6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_window_is_rejected(bad) -> None:
    b = _paged_batch([(1, 5)], 1, 1, 8, 4, None)
    args = (b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["query_start_loc"], b["seq_lens"], 0.25)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_ref(*args, sliding_window=bad)


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("s_lens,num_kv_heads,qpk,head_dim,block_size,window", [
    ([21], 2, 3, 16, 4, 6),                     # one token: split into partitions
    ([21, 5, 9, 64, 1, 33, 40, 17], 2, 3, 16, 4, 6),  # many tokens: one task each
    ([70, 13], 1, 1, 8, 16, 1),                 # window 1
    ([70, 13], 3, 3, 64, 16, 16),               # window = block size
    ([50, 31], 2, 2, 32, 8, 200),               # window >= seq_len
])
def test_cpu_kernel_matches_oracle(s_lens, num_kv_heads, qpk, head_dim, block_size, window) -> None:
    b = _paged_batch([(1, s) for s in s_lens], num_kv_heads, qpk, head_dim, block_size, window)
    scale = head_dim ** -0.5
    idx = torch.arange(len(s_lens), dtype=torch.int32)
    out = torch.full_like(b["q"], float("nan"))
    cpu_attention.decode_attention(out, b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"],
                                   idx, idx, scale, window)
    torch.testing.assert_close(out.double(), _oracle(b, scale, window), atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler on this machine")
def test_backends_pass_the_window() -> None:
    """The model-facing backends (reference and CPU kernel) honour ``sliding_window`` on
    a mixed batch: they write this step's K/V to the cache, then attend."""
    seqs, window = [(5, 20), (1, 23), (1, 9)], 7
    b = _paged_batch(seqs, 2, 2, 16, 4, window)
    want = _oracle(b, 0.25, window)
    # Slots of this step's tokens; K/V are rewritten there with the same values.
    bs = b["k_cache"].shape[1]
    slots = [int(b["block_tables"][i, p // bs]) * bs + p % bs for i, (n, s) in enumerate(seqs)
             for p in range(s - n, s)]
    k = torch.cat([k[s - n:] for (n, s), k in zip(seqs, b["dense_k"])])
    v = torch.cat([v[s - n:] for (n, s), v in zip(seqs, b["dense_v"])])
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=b["block_tables"],
                             query_start_loc=b["query_start_loc"], seq_lens=b["seq_lens"],
                             max_query_len=5, max_seq_len=23, query_lens_cpu=b["q_lens"],
                             seq_lens_cpu=b["s_lens"], has_padding=False)
    for backend in (TorchAttentionBackend(), CpuAttentionBackend()):
        got = backend(b["q"], k, v, b["k_cache"], b["v_cache"], meta, 0.25, sliding_window=window)
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4, msg=backend.name)


# -- freeing blocks outside the window (block manager, scheduler, kernels together) --


def _request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def test_block_manager_frees_blocks_outside_the_window() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True, sliding_window=6)
    a = _request("a", list(range(21)), 4)
    bm.allocate(a, 20)
    a.num_computed_tokens = 20
    bm.cache_full_blocks(a)
    # Later queries sit at positions >= 20 and see keys >= 15: blocks 0-2 (keys 0-11) go.
    assert bm.free_outside_window(a) == 3
    assert a.block_table[:3] == [FREED_BLOCK] * 3 and FREED_BLOCK not in a.block_table[3:]
    assert bm.num_free_blocks == 16 - 2
    assert bm.free_outside_window(a) == 0  # idempotent
    a.num_computed_tokens = 18  # keys >= 13 still needed by the query at 18: block 3 stays
    assert bm.free_outside_window(a) == 0
    # A re-registration (after a prefix-cache reset) skips the freed entries (-1 would
    # silently name the pool's last block).
    bm.reset_prefix_cache()
    bm.cache_full_blocks(a)
    assert bm.blocks[15].hash == NO_HASH
    bm.free(a)
    assert bm.num_free_blocks == 16


def test_freed_head_stays_in_the_prefix_cache() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True, sliding_window=6)
    a = _request("a", list(range(30)), 4)
    bm.allocate(a, 20)
    a.num_computed_tokens = 20
    bm.cache_full_blocks(a)
    head = a.block_table[:3]
    bm.free_outside_window(a)
    c = _request("c", list(range(30)), 4)
    found = bm.find_cached_prefix(c)
    assert found[:3] == head
    bm.allocate_prefix(c, found)
    bm.free(a)  # skips the freed entries: no block is released twice
    assert all(bm.blocks[i].ref_count == 1 for i in found)
    bm.free(c)
    assert bm.num_free_blocks == 16


def test_no_window_frees_nothing() -> None:
    bm = BlockManager(16, 4)
    a = _request("a", list(range(41)), 4)
    bm.allocate(a, 40)
    a.num_computed_tokens = 40
    assert bm.free_outside_window(a) == 0 and FREED_BLOCK not in a.block_table


def drive_windowed_requests(backend, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """Two requests, chunked prefill then decode, through a real scheduler and block
    manager with a sliding window, on a pool too small for both whole contexts: only the
    blocks freed outside the window let them run without preemption. Each step writes the
    new tokens' K/V (random per request and position) through ``backend`` and compares
    its attention with the dense oracle; the block tables passed to the kernels hold
    ``FREED_BLOCK`` (-1) entries, and freed blocks are reused (overwritten) by the other
    request, so a kernel that read one would fail. Also used by the CUDA test."""
    window, block_size, num_blocks, budget = 6, 4, 9, 7
    num_kv_heads, qpk, head_dim = 2, 2, 16
    scale = head_dim ** -0.5
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True, sliding_window=window)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=budget)
    requests = [_request("r0", list(range(11)), 24), _request("r1", list(range(50, 59)), 20)]
    for r in requests:
        sched.add(r)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    history = {r.request_id: ([], []) for r in requests}  # dense K, V per position
    gen = torch.Generator().manual_seed(0)
    num_freed = 0
    while sched.num_unfinished:
        out = sched.schedule()
        assert not out.preempted
        q_lens, s_lens, slots, tables = [], [], [], []
        for item in out.scheduled:
            r, n = item.request, item.num_tokens
            keys, values = history[r.request_id]
            for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                assert p == len(keys)
                keys.append(torch.randn(num_kv_heads, head_dim, generator=gen))
                values.append(torch.randn(num_kv_heads, head_dim, generator=gen))
                slots.append(slot(r.block_table, p, block_size))
            q_lens.append(n)
            s_lens.append(r.num_computed_tokens + n)
            tables.append(list(r.block_table))
            held = sum(b != FREED_BLOCK for b in r.block_table)
            assert held <= -(-(window + budget) // block_size) + 1, (r.request_id, r.block_table)
        width = max(len(t) for t in tables)
        new_k = torch.stack([k for item, q_len, s_len in zip(out.scheduled, q_lens, s_lens)
                             for k in history[item.request.request_id][0][s_len - q_len:s_len]])
        new_v = torch.stack([v for item, q_len, s_len in zip(out.scheduled, q_lens, s_lens)
                             for v in history[item.request.request_id][1][s_len - q_len:s_len]])
        q = torch.randn(sum(q_lens), num_kv_heads * qpk, head_dim, generator=gen)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                                         device=device),
            seq_lens=torch.tensor(s_lens, dtype=torch.int32, device=device), max_query_len=max(q_lens),
            max_seq_len=max(s_lens), query_lens_cpu=q_lens, seq_lens_cpu=s_lens, has_padding=False)
        got = backend(q.to(device, dtype), new_k.to(device, dtype), new_v.to(device, dtype), k_cache, v_cache,
                      meta, scale, sliding_window=window)
        want = _oracle({"q": q.to(dtype), "q_lens": q_lens, "s_lens": s_lens,
                        "dense_k": [torch.stack(history[i.request.request_id][0]).to(dtype) for i in out.scheduled],
                        "dense_v": [torch.stack(history[i.request.request_id][1]).to(dtype) for i in out.scheduled]},
                       scale, window)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)
        num_freed += sum(t.count(FREED_BLOCK) for t in tables)
        sched.update(out, [1 if item.samples else None for item in out.scheduled])
    assert num_freed > 0
    assert bm.num_free_blocks == num_blocks  # every block came back exactly once


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("backend", [TorchAttentionBackend(), CpuAttentionBackend()], ids=lambda b: b.name)
def test_scheduler_frees_blocks_the_kernels_never_read(backend) -> None:
    drive_windowed_requests(backend)
