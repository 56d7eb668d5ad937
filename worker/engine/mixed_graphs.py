"""Step inputs packed for the device, and CUDA graphs of whole mixed steps (prefill
chunks beside decode tokens), one per token-count bucket, captured at start-up.

Why whole-step graphs are possible: the Triton attention kernel
(``kernels/paged_attention.py``) finds each program's sequence on the device from
``query_start_loc``, so its grid depends only on ``num_tokens``, ``num_seqs`` and two host
hints (``max_query_len`` picks tiles, ``max_seq_len`` the split count). With
``num_tokens`` padded to a bucket, ``num_seqs`` padded to ``max_num_seqs`` and the hints
fixed, every step of up to a bucket's tokens has one launch sequence: attention stays
inside the graph (vLLM v1 needs piecewise graphs with attention outside them because its
attention kernels plan on the host). Padding tokens lie past ``query_start_loc[-1]`` with
slot -1 (no KV write); padding sequences have query length 0 and ``seq_len`` 0; the
kernels skip both. The hints: ``max_query_len`` = the bucket (no step of the bucket can
exceed it); ``max_seq_len`` = ``max_model_len``: with ``max_query_len > 1`` the kernel
never splits KV, and the hint only picks the tile of the decode-token launch when
``max_num_seqs * num_kv_heads`` is below the SM count (speed, not correctness), so one
context tier suffices.

A graph ends with the hidden rows of the sampled tokens gathered into one buffer
``[max_num_seqs, hidden]`` shared by every bucket; the LM head runs outside the graph on
the real rows only (two launches), which spares a ``[max_num_seqs, vocab]`` float32
output per bucket (156 MB each for Qwen2.5-7B at 256 sequences).

``StepInputs`` is also the eager path's packing (``ModelRunner.prepare``): one layout,
sized exactly for the step there and to the largest bucket here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from worker.engine.cuda_graphs import LayerPieces, PiecewiseReplay
from worker.engine.packed_step import PackedStepBuffers
from worker.engine.step_types import ScheduledRequest
from worker.models.attention import AttentionBackend, AttentionMetadata
from worker.models.llama import KVCache, LlamaForCausalLM

log = logging.getLogger(__name__)

#: Up to this many tokens a 7B step is bound by reading the weights (H100: ~800 bf16
#: TFLOP/s over ~3 TB/s is ~260 rows), so padding costs little and buckets are coarse.
_COARSE_BUCKETS = (16, 32, 64, 128, 192, 256)
#: Above it, buckets per doubling of the token count: padding wastes at most 1/8.
_BUCKETS_PER_OCTAVE = 8


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Padded token counts of the mixed graphs: 16, 32, 64, 128, 192, 256, then eight
    per doubling (288, 320, ..., 512, 576, ..., 1024, 1152, ...), up to and including
    ``max_num_batched_tokens``."""
    sizes = [s for s in _COARSE_BUCKETS if s < max_num_batched_tokens]
    size = _COARSE_BUCKETS[-1]
    while size < max_num_batched_tokens:
        octave = 1 << (size.bit_length() - 1)
        size += octave // _BUCKETS_PER_OCTAVE
        if size < max_num_batched_tokens:
            sizes.append(size)
    return sizes + [max_num_batched_tokens]


@dataclass(frozen=True, slots=True)
class StepShape:
    """The real extent of a packed step and the host-side facts its metadata needs."""

    num_tokens: int
    num_seqs: int
    num_sampled: int
    max_query_len: int
    max_seq_len: int
    query_lens: list[int]
    seq_lens: list[int]


class StepInputs(PackedStepBuffers):
    """A step's inputs packed into two buffers (``packed_step.py``'s layout, with
    ``logits_indices`` of ``max_sampled`` rows): a pinned host copy filled by numpy and
    the device copy the model reads; ``upload()`` is the step's two host-to-device copies
    (on CPU the host buffers are the device buffers). ``fill`` writes a step of at most
    ``T`` tokens and ``S`` sequences; ``views(t, s)`` gives its first ``t`` tokens and
    ``s`` sequences. Rows past the step are padding: slot -1, query length 0,
    ``seq_len`` 0, logits index 0. Block-table entries past a sequence's blocks are stale
    (never read).
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int,
                 device: torch.device, max_sampled: int = 0) -> None:
        """``max_sampled``: capacity of ``logits_indices`` (0: ``max_seqs``, one row per
        sequence; a speculative step scores more rows, up to its token count)."""
        super().__init__(max_tokens, max_seqs, max_blocks, device, max_sampled or max_seqs)
        self.block_size = block_size

    def fill(self, batch: Sequence[ScheduledRequest], pad_tokens_to: int = 0) -> StepShape:
        """Pack a step: each request's tokens ``[num_computed_tokens, + num_tokens)``, their
        positions and KV slots (``block_table[p // block_size] * block_size + p %
        block_size``), the sequences' block tables, cumulative query lengths, context
        lengths after the step, and the flat index of each sampled token's hidden row
        (every row of a speculative item: ``ScheduledRequest.num_spec_tokens``).
        Token rows ``[num_tokens, pad_tokens_to)`` get slot -1; sequence rows past the
        batch are padding (see the class docstring).

        Raises:
            ValueError: more tokens, sequences or blocks than the buffers hold.
        """
        self.wait_for_upload()
        q_lens = [item.num_tokens for item in batch]
        starts = [item.request.num_computed_tokens for item in batch]
        n, num_tokens = len(batch), sum(q_lens)
        if n > self.max_seqs or max(num_tokens, pad_tokens_to) > self.max_tokens:
            raise ValueError(f"a step of {num_tokens} tokens and {n} sequences does not fit buffers of "
                             f"{self.max_tokens} tokens and {self.max_seqs} sequences")
        self._ids[:num_tokens] = list(chain.from_iterable(item.input_token_ids() for item in batch))
        tables = self._tables
        for i, item in enumerate(batch):
            row = item.request.block_table
            if len(row) > self.max_blocks:
                raise ValueError(f"a block table of {len(row)} blocks does not fit {self.max_blocks}")
            tables[i, :len(row)] = row
        qsl = self._qsl
        qsl[0] = 0
        np.cumsum(q_lens, out=qsl[1:n + 1])
        qsl[n + 1:] = num_tokens
        s_lens = [s + q for s, q in zip(starts, q_lens)]
        self._seq_lens[:n] = s_lens
        self._seq_lens[n:] = 0
        # Per token: its sequence and position, then its slot.
        tok_seq = np.repeat(np.arange(n), q_lens)
        offset = np.asarray(starts, dtype=np.int64) - qsl[:n]  # position - flat index, per sequence
        pos = self._pos[:num_tokens]
        np.add(np.arange(num_tokens), offset[tok_seq], out=pos)
        bs = self.block_size
        self._slots[:num_tokens] = tables[tok_seq, pos // bs].astype(np.int64) * bs + pos % bs
        self._slots[num_tokens:max(num_tokens, pad_tokens_to)] = -1
        # A speculative item's every row is scored: its drafts and the token after them.
        sampled = [row for item, end in zip(batch, qsl[1:n + 1].tolist()) if item.samples
                   for row in range(end - 1 - item.num_spec_tokens, end)]
        if len(sampled) > len(self._logits_idx):
            raise ValueError(f"{len(sampled)} scored rows do not fit {len(self._logits_idx)}")
        self._logits_idx[:len(sampled)] = sampled
        self._logits_idx[len(sampled):] = 0
        return StepShape(num_tokens, n, len(sampled), max(q_lens, default=0), max(s_lens, default=0), q_lens, s_lens)

    def views(self, num_tokens: int, num_seqs: int, num_sampled: int, max_query_len: int, max_seq_len: int,
              shape: StepShape | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """``(input_ids [t], positions [t], metadata of s sequences, logits_indices [k])``
        for ``t = num_tokens``, ``s = num_seqs``, ``k = num_sampled``, on the device, with
        the hints ``max_query_len`` and ``max_seq_len``. ``shape``: the step is exactly
        what ``fill`` returned (no padding), so the host lengths go into the metadata."""
        ids, pos, meta = self.attention_metadata(
            num_tokens, num_seqs, max_query_len, max_seq_len,
            query_lens_cpu=shape.query_lens if shape is not None else None,
            seq_lens_cpu=shape.seq_lens if shape is not None else None,
            has_padding=shape is None)
        T = self.max_tokens
        return ids, pos, meta, self.dev64[3 * T:3 * T + num_sampled]


class MixedGraphs:
    """Captured graphs of whole steps, one per token-count bucket (``token_buckets``),
    every one padded to ``max_num_seqs`` sequences; ``run(batch)`` packs a step, replays
    the smallest bucket that holds its tokens, and returns the hidden rows of its sampled
    tokens, ``begin(batch)`` its first piece only (``pieces`` > 1: one graph per range of
    layers, ``cuda_graphs.LayerPieces``). Attributes ``num_captures`` and ``num_replays``
    count graph captures and replays (the start-up warm-up test reads them)."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], backend: AttentionBackend,
                 max_num_seqs: int, max_num_batched_tokens: int, max_blocks_per_seq: int, max_seq_len: int,
                 block_size: int, device: torch.device, pieces: int = 1) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.max_num_seqs, self.max_seq_len = max_num_seqs, max_seq_len
        self.buckets = token_buckets(max_num_batched_tokens)
        self.inputs = StepInputs(self.buckets[-1], max_num_seqs, max_blocks_per_seq, block_size, device)
        # The graphs' output: hidden rows of the sampled tokens. Outside the graph pool, so
        # that every bucket writes the same buffer and nothing else reuses it.
        self.rows = torch.empty(max_num_seqs, model.config.hidden_size,
                                dtype=model.embed_tokens.weight.dtype, device=device)
        self.pieces = LayerPieces(model, pieces, self.buckets[-1], device)
        # Keyed by token bucket: the step's graphs, one per piece.
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.capture_time_s = 0.0
        self.num_captures = 0
        self.num_replays = 0

    @property
    def max_num_tokens(self) -> int:
        return self.buckets[-1]

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        """True when a step of this size can replay a bucket."""
        return num_tokens <= self.max_num_tokens and num_seqs <= self.max_num_seqs

    def forward(self, bucket: int, piece: int | None = None) -> None:
        """One padded step of ``bucket`` tokens over the current inputs (eager; what a
        graph captures), whole (``piece`` None) or one piece: after the last, ``rows`` <-
        hidden rows at ``logits_indices``."""
        ids, pos, meta, idx = self.inputs.views(bucket, self.max_num_seqs, self.max_num_seqs,
                                                max_query_len=bucket, max_seq_len=self.max_seq_len)
        hidden = self.pieces.forward(self.model, piece, ids, pos, self.kv_caches, meta, self.backend)
        if hidden is not None:
            torch.index_select(hidden, 0, idx, out=self.rows)

    @torch.inference_mode()
    def capture(self, pool: tuple[int, int] | None = None) -> None:
        """(Re)capture every bucket, largest first, in ``pool`` (default: a new one). The
        inputs are all padding, so the KV cache is not touched."""
        t0 = time.perf_counter()
        self.graphs.clear()
        self.inputs.fill([], pad_tokens_to=self.max_num_tokens)
        self.inputs.upload()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks kernels
            for b in self.buckets:
                for piece in self.pieces.indices():
                    self.forward(b, piece)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for b in reversed(self.buckets):
            self.graphs[b], _ = self.pieces.capture(lambda piece: self.forward(b, piece), pool)  # noqa: B023
            self.num_captures += len(self.graphs[b])
        torch.cuda.synchronize()
        self.capture_time_s = time.perf_counter() - t0
        log.info("captured %d mixed-step CUDA graphs (tokens %s, %d sequences, %d piece(s) each) in %.1f s",
                 self.num_captures, self.buckets, self.max_num_seqs, len(self.pieces), self.capture_time_s)

    def run(self, batch: Sequence[ScheduledRequest]) -> torch.Tensor:
        """Pack and upload ``batch`` (check ``fits`` first), replay the smallest bucket
        that holds its tokens, every piece, without waiting for the GPU.

        Returns:
            ``[num_sampled, hidden_size]`` hidden rows of the sampled tokens, in batch
            order (a view of the shared output buffer, valid until the next replay).
        """
        return self.begin(batch).finish()

    def begin(self, batch: Sequence[ScheduledRequest],
              device_ids: tuple[torch.Tensor, torch.Tensor] | None = None) -> PiecewiseReplay:
        """As ``run``, but replay the first piece only: the caller replays the others
        (``PiecewiseReplay``; its ``output`` is ``run``'s rows), or drops the step.
        ``device_ids``: ``(token indices [k], ids [k])``, both int64 on the device, input
        ids written over the packed ones after the upload (tokens sampled by a step still
        in flight: ``ModelRunner.launch_step``)."""
        return self.replay(*self.pack(batch, device_ids))

    def pack(self, batch: Sequence[ScheduledRequest],
             device_ids: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[int, int]:
        """The first half of ``begin``: pack ``batch``, enqueue the upload (and the
        ``device_ids`` copy); returns ``(bucket, num_sampled)`` for ``replay``. Between
        the two, ``inputs.dev64``/``dev32`` hold the step on the device, complete: what
        rank 0 of a tensor-parallel group sends the others (``StepSync.send_mixed``)."""
        num_tokens = sum(item.num_tokens for item in batch)
        bucket = next(b for b in self.buckets if b >= num_tokens)
        shape = self.inputs.fill(batch, pad_tokens_to=bucket)
        self.inputs.upload()
        if device_ids is not None:  # input_ids lead the int64 buffer
            self.inputs.dev64.index_copy_(0, *device_ids)
        return bucket, shape.num_sampled

    def replay(self, bucket: int, num_sampled: int) -> PiecewiseReplay:
        """The second half of ``begin``: replay the first piece of ``bucket``'s graphs on
        the inputs on the device (``pack``'s, or on the other ranks of a group, rank 0's
        received in place); its ``output`` is the first ``num_sampled`` hidden rows."""
        self.num_replays += 1
        return self.pieces.begin(self.graphs[bucket], self.rows[:num_sampled])
