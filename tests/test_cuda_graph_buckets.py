"""The padded batch sizes CUDA graphs are captured for (pure Python: runs without a GPU)."""

from __future__ import annotations

from itertools import pairwise

from worker.engine.cuda_graphs import bucket_sizes


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert bucket_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]


def test_every_batch_size_has_a_bucket() -> None:
    for max_num_seqs in range(1, 300):
        sizes = bucket_sizes(max_num_seqs)
        assert sizes[0] == 1 and sizes[-1] == max_num_seqs
        assert all(a < b for a, b in pairwise(sizes)), sizes  # increasing, no repeats
        # Padding above 32 sequences wastes at most 16 rows.
        assert all(b - a <= 16 for a, b in pairwise(sizes) if a >= 32), sizes
