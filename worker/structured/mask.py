"""Applying a grammar's token bitmask to the logits, on the logits' device.

The bitmask layout is llguidance's (and xgrammar's): row ``i`` is ``ceil(V / 32)`` int32
words, and token ``t`` is allowed iff bit ``t % 32`` of word ``t // 32`` is set (least
significant bit first). Read as little-endian bytes, that is byte ``t // 8``, bit ``t % 8``.

``apply_token_bitmask_`` turns each byte into 8 additive biases (0 where allowed, -inf
where not) with one gather from a ``[256, 8]`` table, and adds them to the masked rows
with ``index_add_``: no host sync, no per-bit shifts, and rows without a grammar are not
touched. Measured on the 2-core CPU (1 thread), 16 rows of SmolLM2's 49,152 tokens: 0.43 ms,
against 3.4 to 4.6 ms for unpacking to bool and ``masked_fill``/``where``. The bias costs
``[m, V]`` float32 of transient memory, like one of the sampler's own ``[n, V]`` temporaries.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache

import torch

#: Bits per bitmask word.
BITS_PER_WORD = 32


@dataclass(frozen=True, slots=True)
class TokenMask:
    """The allowed tokens of the rows of one step that have a grammar.

    ``bitmask``: ``[m, ceil(V / 32)]`` int32 on the logits' device (layout in the module
    docstring); ``rows``: ``[m]`` int64 on the same device, the logits row each bitmask
    row belongs to (distinct, ascending).
    """

    bitmask: torch.Tensor
    rows: torch.Tensor


def num_words(vocab_size: int) -> int:
    """Int32 words in one bitmask row for ``vocab_size`` tokens."""
    return -(-vocab_size // BITS_PER_WORD)


def apply_token_bitmask_(logits: torch.Tensor, mask: TokenMask) -> None:
    """Set the logits of disallowed tokens to ``-inf``, in place, in the masked rows only.

    Enqueued on the logits' device without a host synchronisation. Bits past ``V`` are
    ignored. Allowed logits keep their exact value (``x + 0``); the logits must not hold
    ``+inf`` (``+inf - inf`` is NaN), which a model's logits never do.

    Args:
        logits: ``[n, V]`` float (float32 in the engine), contiguous.
        mask: ``bitmask [m, ceil(V / 32)]`` int32 and ``rows [m]`` int64, on the logits'
            device, ``m <= n``.

    Raises:
        ValueError: wrong shapes, dtypes or devices.
    """
    bitmask, rows = mask.bitmask, mask.rows
    n, vocab = logits.shape
    m = bitmask.shape[0]
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[1] != num_words(vocab):
        raise ValueError(f"bitmask must be int32 [m, {num_words(vocab)}], got {bitmask.dtype} {tuple(bitmask.shape)}")
    if rows.dtype != torch.int64 or rows.shape != (m,) or m > n:
        raise ValueError(f"rows must be int64 [{m}] with m <= {n}, got {rows.dtype} {tuple(rows.shape)}")
    if not (logits.device == bitmask.device == rows.device) or not logits.is_contiguous():
        raise ValueError("logits, bitmask and rows must be on one device, logits contiguous")
    if m == 0:
        return
    logits.index_add_(0, rows, bitmask_bias(bitmask, vocab, logits.dtype))


def bitmask_bias(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``[m, ceil(V / 32)]`` int32 bitmask -> ``[m, V]`` additive bias of ``dtype``: 0 where
    the token is allowed, -inf where not (rows are distinct, so ``index_add_`` is exact)."""
    assert sys.byteorder == "little"  # the uint8 view reads each word's bytes in token order
    m = bitmask.shape[0]
    as_bytes = bitmask.contiguous().view(torch.uint8).view(-1)  # byte b holds tokens 8b .. 8b + 7
    bias = _byte_bias(bitmask.device, dtype).index_select(0, as_bytes.int())  # [m * 4 * words, 8]
    return bias.view(m, -1)[:, :vocab_size]


@cache
def _byte_bias(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[256, 8]``: row ``b`` is the bias of the 8 tokens of a mask byte ``b``, bit 0 first."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf")).to(device)
