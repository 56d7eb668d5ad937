"""Paged decode attention on CPU, the C++ kernel of ``kernels/csrc/decode_attention_cpu.cpp``
(built by ``kernels/cpu_extension.py``).

The PyTorch reference gathers each sequence's blocks into a padded tensor
(``index_select``) before one SDPA call: every K/V byte is read twice and written once.
The kernel reads K/V in place through the block table, one task per decode token (or per
partition of its blocks when there are fewer tokens than twice the threads: flash-decoding,
merged by the partitions' maxima and denominators), each block front to back, so a decode
step's attention costs one streaming pass over the context. Prefill chunks stay
on SDPA's flash kernel (``paged_attention_ref``), which is compute-bound and fast there.
"""

from __future__ import annotations

import torch

from kernels import cpu_extension
from kernels.paged_attention import check_sliding_window


def decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, token_idx: torch.Tensor,
                     seq_idx: torch.Tensor, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Attention of single query tokens over their sequences' paged K/V, written into
    ``out`` in place (other rows of ``out`` untouched); returns ``out``.

    Args:
        out, q: ``[num_tokens, num_heads, head_dim]`` float32 or bfloat16, each token's
            heads contiguous (row stride may differ).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous,
            q's dtype; ``num_heads`` a multiple of ``num_kv_heads`` (GQA).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32.
        seq_lens: ``[num_seqs]`` int32, context length of each sequence (tokens),
            this step's token included (already written to the cache).
        token_idx, seq_idx: ``[n]`` int32: row of each decode token in ``q``/``out`` and
            the sequence it belongs to.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: ``None`` or ``w >= 1``: the token at position ``len - 1`` sees
            keys ``len - w .. len - 1`` only; blocks wholly before them are not read.

    Raises:
        RuntimeError: the kernels are not built here (``cpu_extension.available``), or shapes,
            strides or dtypes do not match.
        ValueError: ``sliding_window`` is not ``None`` or a positive int.
    """
    check_sliding_window(sliding_window)
    ext = cpu_extension.load()
    if ext is None:
        raise RuntimeError("the CPU kernels are not built on this machine")
    ext.decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, token_idx, seq_idx, scale,
                         sliding_window or 0)
    return out
