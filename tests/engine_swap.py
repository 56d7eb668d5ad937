"""A test helper: the session's offline engine with another proposer and, optionally, a
small scheduler, for the speculative-decoding tests (test_spec_decode.py, test_spec_draft.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler

#: Tokens a step of the small scheduler: prompts go in chunks.
SMALL_STEP_TOKENS = 32


@contextmanager
def swapped_engine(engine: Any, proposer: Any, num_blocks: int | None) -> Iterator[None]:
    """``engine`` (an ``LLMEngine``) with ``proposer`` (None: speculation off) and, when
    ``num_blocks`` is given, a scheduler of that many KV blocks and ``SMALL_STEP_TOKENS``
    tokens a step (preemption and chunked prefill); restored afterwards, with its prefix
    cache forgotten (a small scheduler's blocks overwrote cached KV)."""
    saved = engine.scheduler
    if num_blocks is not None:
        engine.scheduler = Scheduler(BlockManager(num_blocks, saved.block_manager.block_size),
                                     saved.max_num_seqs, SMALL_STEP_TOKENS)
    engine.proposer = proposer
    try:
        yield
    finally:
        engine.proposer = None
        engine.scheduler = saved
        saved.block_manager.reset_prefix_cache()
