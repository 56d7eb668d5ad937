"""A step's token masks: llguidance fills one bitmask row per request with a grammar,
in its own Rust threads without the GIL (``fill_next_token_bitmask_par``), and the rows
go to the device in one non-blocking copy from pinned memory.

A JSON output's row is the AND of its grammar's row and its number cap's
(shared/grammars.py), filled in the same call; where the AND allows no token at all (the
schema needs a longer number than the cap allows), the grammar's row stands alone. The
cap's row is filled only after a token that ends in a digit (``GrammarMatcher
.after_digit``): elsewhere it allows every token the grammar does, and it is costly (a
walk over most of the vocabulary, where a schema's row costs little).
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from worker.engine.sampler import host_list_to_device
from worker.structured.mask import TokenMask, num_words
from worker.structured.matcher import GrammarMatcher


class GrammarMasks:
    """Builds each step's ``TokenMask`` for the logits of ``vocab_size`` tokens on ``device``."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._executor: llguidance.LLExecutor | None = None  # its threads start on first use

    def mask(self, grammars: Sequence[GrammarMatcher | None]) -> TokenMask | None:
        """The masks of the rows whose request has a grammar; ``None`` (and no work) when
        no row has one.

        Args:
            grammars: per logits row, the request's matcher or ``None``.

        Returns:
            A ``TokenMask`` on ``device``, its copies enqueued without waiting for the
            device (the host arrays are pinned on CUDA).
        """
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        used = [g for g in grammars if g is not None]
        caps = [(k, g.number_cap) for k, g in enumerate(used) if g.number_cap is not None and g.after_digit]
        capped = [k for k, _ in caps]
        m = len(rows)
        pin = self.device.type == "cuda"
        # Rows 0 .. m - 1: the grammars; m + j: the number cap of grammar ``capped[j]``.
        bitmask = torch.empty((m + len(caps), num_words(self.vocab_size)), dtype=torch.int32, pin_memory=pin)
        matchers = [(g.matcher, k) for k, g in enumerate(used)] + [(cap, m + j) for j, (_, cap) in enumerate(caps)]
        _fill_bitmask(self._executor, matchers, bitmask)
        if capped:
            _intersect_caps(bitmask, capped)
        return TokenMask(bitmask[:m].to(self.device, non_blocking=True),
                         host_list_to_device(rows, torch.int64, self.device))


def _intersect_caps(bitmask: torch.Tensor, capped: list[int]) -> None:
    """Rows ``capped[j]`` of ``bitmask`` (on the host) ANDed with rows ``m + j`` where the
    AND leaves some token allowed; ``m`` is ``bitmask.shape[0] - len(capped)``."""
    words = bitmask.numpy()  # numpy: a few small host ops, no intra-op thread pool
    rows = np.asarray(capped)
    both = words[rows] & words[words.shape[0] - len(capped):]
    some = both.any(axis=1)
    words[rows[some]] = both[some]


def _fill_bitmask(executor: llguidance.LLExecutor, matchers: Sequence[tuple[object, int]], bitmask: torch.Tensor) -> None:
    """``llguidance.torch.fill_next_token_bitmask_par``, imported on the first grammar:
    ``llguidance.torch`` loads ``torch._dynamo``, about 1.5 s that every worker start
    would pay otherwise."""
    import llguidance.torch

    llguidance.torch.fill_next_token_bitmask_par(executor, matchers, bitmask)
