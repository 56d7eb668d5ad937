"""A step's token masks: llguidance fills one bitmask row per request with a grammar,
in its own Rust threads without the GIL (``fill_next_token_bitmask_par``), and the rows
go to the device in one non-blocking copy from pinned memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.torch
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
        pin = self.device.type == "cuda"
        bitmask = torch.empty((len(rows), num_words(self.vocab_size)), dtype=torch.int32, pin_memory=pin)
        matchers = [(grammars[row].matcher, k) for k, row in enumerate(rows)]  # type: ignore[union-attr]
        llguidance.torch.fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        return TokenMask(bitmask.to(self.device, non_blocking=True), host_list_to_device(rows, torch.int64, self.device))
