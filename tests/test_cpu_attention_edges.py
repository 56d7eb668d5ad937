"""CPU counterparts of the CUDA kernel checks (tests/test_kernels_cuda.py): the CPU decode
kernel (``kernels/cpu_attention.py``) and the CPU attention backend around it
(``worker/models/attention.py``) never read cache slots outside a sequence's length
(NaN-poisoned there), leave zero-length sequences and spare rows alone, and give the same
answer whatever the ``max_query_len`` hint and whether host-side lengths are passed.

Oracle: ``_naive_attention`` of tests/test_kernels_ref.py (one token and head at a time,
explicit slot lookup), on the clean cache. Every case runs with 1 and 4 intra-op
threads: with few decode tokens the kernel splits each sequence's blocks into
partitions (one per thread pair), some of them empty."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from kernels import cpu_attention
from tests.test_kernels_ref import _naive_attention
from worker.models.attention import AttentionMetadata, CpuAttentionBackend

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler on this machine")

NUM_KV_HEADS, QPK, HEAD_DIM, BLOCK_SIZE = 2, 3, 16, 16
SCALE = HEAD_DIM ** -0.5
NAN = float("nan")


@pytest.fixture(params=[1, 4], ids=["1-thread", "4-threads"], autouse=True)
def num_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


@dataclass
class Batch:
    """A paged batch of ``(query_len, seq_len)`` sequences (padding ones: ``(0, 0)``) and
    ``num_pad_tokens`` spare query rows after the real ones. Block tables are a random
    permutation of the pool, their unused entries random block ids; ``owned`` marks the
    slots inside some sequence's length."""

    q: torch.Tensor  # [num_tokens, heads, dim]
    k_cache: torch.Tensor  # [pool, block_size, kv_heads, dim]
    v_cache: torch.Tensor
    tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    owned: torch.Tensor  # [pool, block_size] bool
    q_lens: list[int]
    s_lens: list[int]

    @property
    def num_real_tokens(self) -> int:
        return sum(self.q_lens)

    def slot(self, seq: int, position: int) -> int:
        return int(self.tables[seq, position // BLOCK_SIZE]) * BLOCK_SIZE + position % BLOCK_SIZE

    def poisoned(self, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the caches with NaN in every slot outside ``keep``."""
        mask = keep[:, :, None, None]
        return torch.where(mask, self.k_cache, NAN), torch.where(mask, self.v_cache, NAN)

    def expected(self) -> torch.Tensor:
        """The oracle on the clean caches, ``[num_real_tokens, heads, dim]`` float64."""
        q = self.q[:self.num_real_tokens]
        return _naive_attention(q, self.k_cache, self.v_cache, self.tables, self.q_lens, self.s_lens, SCALE)


def make_batch(seqs: list[tuple[int, int]], *, num_pad_tokens: int = 0, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    q_lens, s_lens = [a for a, _ in seqs], [b for _, b in seqs]
    assert all(0 <= a <= b for a, b in seqs)
    num_blocks = [-(-s // BLOCK_SIZE) for s in s_lens]
    pool = sum(num_blocks) + 5  # spare blocks nobody owns
    perm = torch.randperm(pool, generator=gen)
    tables = torch.randint(0, pool, (len(seqs), max(num_blocks) + 2), generator=gen, dtype=torch.int32)
    owned = torch.zeros(pool, BLOCK_SIZE, dtype=torch.bool)
    start = 0
    for i, n in enumerate(num_blocks):
        tables[i, :n] = perm[start:start + n].int()
        for j in range(n):
            owned[perm[start + j], :min(BLOCK_SIZE, s_lens[i] - j * BLOCK_SIZE)] = True
        start += n
    shape = (pool, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return Batch(q=torch.randn(sum(q_lens) + num_pad_tokens, NUM_KV_HEADS * QPK, HEAD_DIM, generator=gen),
                 k_cache=torch.randn(shape, generator=gen), v_cache=torch.randn(shape, generator=gen),
                 tables=tables, query_start_loc=qsl, seq_lens=torch.tensor(s_lens, dtype=torch.int32),
                 owned=owned, q_lens=q_lens, s_lens=s_lens)


def decode_rows(b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_idx, seq_idx)`` of the batch's single-token queries."""
    seqs = [i for i, n in enumerate(b.q_lens) if n == 1]
    starts = b.query_start_loc.tolist()
    return (torch.tensor([starts[i] for i in seqs], dtype=torch.int32), torch.tensor(seqs, dtype=torch.int32))


def run_backend(b: Batch, k_cache: torch.Tensor, v_cache: torch.Tensor, *, max_query_len: int | None = None,
                host_lengths: bool = True) -> torch.Tensor:
    """One ``CpuAttentionBackend`` call: this step's K/V (the clean cache's values at the
    new tokens' slots) written into ``k_cache``/``v_cache``, then attention."""
    slots = [b.slot(i, p) for i, (q_len, s_len) in enumerate(zip(b.q_lens, b.s_lens))
             for p in range(s_len - q_len, s_len)]
    num_pad = b.q.shape[0] - len(slots)
    k_flat, v_flat = b.k_cache.flatten(0, 1), b.v_cache.flatten(0, 1)
    k = torch.cat([k_flat[slots], torch.full((num_pad, NUM_KV_HEADS, HEAD_DIM), NAN)])
    v = torch.cat([v_flat[slots], torch.full((num_pad, NUM_KV_HEADS, HEAD_DIM), NAN)])
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots + [-1] * num_pad), block_tables=b.tables,
                             query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
                             max_query_len=max(b.q_lens) if max_query_len is None else max_query_len,
                             max_seq_len=max(b.s_lens), query_lens_cpu=b.q_lens if host_lengths else None,
                             seq_lens_cpu=b.s_lens if host_lengths else None, has_padding=num_pad > 0)
    return CpuAttentionBackend()(b.q, k, v, k_cache, v_cache, meta, SCALE)


# Lengths at, before and after block edges; one-token contexts; a long sequence beside
# short ones (its partitions are uneven).
DECODE = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 33), (1, 64), (1, 150)]
MIXED = [(1, 1), (17, 17), (5, 40), (1, 16), (16, 16), (3, 35), (1, 100)]  # prefills, chunks, decodes


def test_kernel_never_reads_slots_outside_the_sequences() -> None:
    b = make_batch(DECODE)
    k_cache, v_cache = b.poisoned(b.owned)
    token_idx, seq_idx = decode_rows(b)
    out = torch.full_like(b.q, NAN)
    cpu_attention.decode_attention(out, b.q, k_cache, v_cache, b.tables, b.seq_lens, token_idx, seq_idx, SCALE)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), b.expected(), atol=2e-5, rtol=1e-4)


def test_backend_never_reads_slots_outside_the_sequences() -> None:
    # Owned slots before this step hold the context; the step's own slots are NaN until
    # the backend writes the new K/V there.
    b = make_batch(MIXED)
    context = torch.zeros_like(b.owned)
    for i, (q_len, s_len) in enumerate(zip(b.q_lens, b.s_lens)):
        for p in range(s_len - q_len):
            s = b.slot(i, p)
            context[s // BLOCK_SIZE, s % BLOCK_SIZE] = True
    out = run_backend(b, *b.poisoned(context))
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), b.expected(), atol=2e-5, rtol=1e-4)


def test_zero_length_sequences_and_spare_rows_are_left_alone() -> None:
    """Padding sequences (query and context length 0) and spare query rows, as a padded
    step has them: the real rows are right and nothing else is written."""
    seqs = [(1, 20), (0, 0), (1, 1), (0, 0), (1, 48), (0, 0)]
    b = make_batch(seqs, num_pad_tokens=3)
    k_cache, v_cache = b.poisoned(b.owned)
    token_idx, seq_idx = decode_rows(b)
    out = torch.full_like(b.q, NAN)
    cpu_attention.decode_attention(out, b.q, k_cache, v_cache, b.tables, b.seq_lens, token_idx, seq_idx, SCALE)
    n = b.num_real_tokens
    assert not out[:n].isnan().any() and out[n:].isnan().all()
    torch.testing.assert_close(out[:n].double(), b.expected(), atol=2e-5, rtol=1e-4)
    empty = torch.zeros(0, dtype=torch.int32)  # no decode token at all: nothing is written
    out = torch.full_like(b.q, NAN)
    cpu_attention.decode_attention(out, b.q, k_cache, v_cache, b.tables, b.seq_lens, empty, empty, SCALE)
    assert out.isnan().all()
    # The backend, with padding sequences between prefills, chunks and decodes.
    b = make_batch([(3, 3), (0, 0), (1, 30), (4, 20), (0, 0)], num_pad_tokens=2, seed=1)
    clean = (b.k_cache.clone(), b.v_cache.clone())
    out = run_backend(b, *clean)
    torch.testing.assert_close(out[:b.num_real_tokens].double(), b.expected(), atol=2e-5, rtol=1e-4)
    # Spare rows (slot -1) wrote nothing: the cache still equals the clean one.
    assert torch.equal(clean[0], b.k_cache) and torch.equal(clean[1], b.v_cache)


@pytest.mark.parametrize("seqs", [DECODE, MIXED, [(9, 9), (20, 20)]], ids=["decode", "mixed", "prefill"])
def test_max_query_len_hint_and_host_lengths_do_not_change_the_answer(seqs: list[tuple[int, int]]) -> None:
    b = make_batch(seqs, seed=2)
    outs = [run_backend(b, b.k_cache.clone(), b.v_cache.clone(), max_query_len=mql, host_lengths=host)
            for mql in (max(b.q_lens), 1, 1000) for host in (True, False)]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    torch.testing.assert_close(outs[0].double(), b.expected(), atol=2e-5, rtol=1e-4)
