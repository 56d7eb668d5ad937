"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at start-up.
Steps that carry prefill chunks replay the graphs of ``mixed_graphs.py`` instead.

A decode step of a 7B model is ~350 kernel launches; at ~30 µs of host time each
(see docs, H100 notes) an eager step costs ~10 ms whatever the GPU does. Replaying a
captured graph costs one launch. vLLM does the same: capture at start-up, for padded
batch sizes 1, 2, 4, 8, then every 8 (here 16 above 32) up to ``max_num_seqs``.

Static buffers (the graphs read them at fixed addresses; the model runner fills them
with two host-to-device copies per step, see ``StaticInputs``): ``packed_step.py``'s
layout with ``max_bs`` tokens and sequences. A bucket ``b`` graph reads the first ``b`` rows. Rows past the real batch are padding:
slot -1 (no KV write), query length 0 and seq_len 0 (attention skips them); their
logits are computed and ignored. Output: logits ``[b, vocab]`` float32 of every row.

The attention kernel sizes its split-KV grid from a ``max_seq_len`` hint fixed at
capture. A hint far above the real context wastes programs and the split reduction
(Qwen2.5-7B, batch 64, context 320 on the H100: 6.97 ms per replay with the hint at
4096, 6.27 ms at 512), so each bucket is captured once per context tier
(512, 2048, 8192, ... up to ``max_seq_len``) and a step replays the smallest tier that
holds its longest sequence.

Pieces: a step may be captured as ``pieces`` graphs over consecutive ranges of layers
(``piece_bounds``), replayed one after the other. Between two pieces the host can wait
for the first and decide whether the step goes on: the engine drops it there when a
request announced meanwhile would take its place (docs/operations.md, "Stopping the step
in progress"), so a newcomer waits for part of a step, not the rest of a whole one. The
hidden state crosses from piece to piece in two buffers outside the graph pool
(``carry_x``, ``carry_residual``); each boundary costs the GPU the host's wake-up and
one graph launch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from worker.engine.packed_step import PackedStepBuffers
from worker.models.attention import AttentionBackend, AttentionMetadata
from worker.models.llama import KVCache, LlamaForCausalLM

log = logging.getLogger(__name__)

T = TypeVar("T")


def context_tiers(max_seq_len: int) -> list[int]:
    """Context-length hints the graphs are captured for: 512, 2048, 8192, ... (x4) below
    ``max_seq_len``, then ``max_seq_len`` itself (tokens)."""
    tiers, t = [], 512
    while t < max_seq_len:
        tiers.append(t)
        t *= 4
    return tiers + [max_seq_len]


def piece_bounds(num_layers: int, pieces: int) -> list[tuple[int, int]]:
    """``pieces`` consecutive layer ranges ``[start, end)`` covering ``num_layers`` layers,
    as equal as they can be (the first ones one layer longer); fewer when the model has
    fewer layers.

    Raises:
        ValueError: ``pieces`` < 1.
    """
    if pieces < 1:
        raise ValueError(f"pieces must be >= 1, got {pieces}")
    pieces = min(pieces, num_layers)
    size, extra = divmod(num_layers, pieces)
    bounds, start = [], 0
    for k in range(pieces):
        end = start + size + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class LayerPieces:
    """A step's layers cut into pieces (``piece_bounds``) and the buffers that carry the
    hidden state from one piece to the next: ``[max_tokens, hidden_size]`` each, in the
    model's dtype, outside any graph pool (one step runs at a time, so every bucket's
    graphs share them). With one piece there is nothing to carry. It also captures a
    step's pieces (``capture``) and starts their replay (``begin``), for the decode and
    the mixed-step graphs alike."""

    def __init__(self, model: LlamaForCausalLM, pieces: int, max_tokens: int, device: torch.device) -> None:
        self.bounds = piece_bounds(len(model.layers), pieces)
        self.carry_x: torch.Tensor | None = None
        self.carry_residual: torch.Tensor | None = None
        # Recorded after each piece but the last of a replay (one replay runs at a time).
        self._piece_done: torch.cuda.Event | None = None
        if len(self.bounds) > 1:
            shape, dtype = (max_tokens, model.config.hidden_size), model.embed_tokens.weight.dtype
            self.carry_x = torch.zeros(shape, dtype=dtype, device=device)
            self.carry_residual = torch.zeros(shape, dtype=dtype, device=device)
            if device.type == "cuda":  # replays only run there
                self._piece_done = torch.cuda.Event()

    def __len__(self) -> int:
        return len(self.bounds)

    def indices(self) -> list[int | None]:
        """What ``forward`` takes to run a step whole: ``[None]`` (one piece), else each
        piece's index."""
        return [None] if len(self.bounds) == 1 else list(range(len(self.bounds)))

    def forward(self, model: LlamaForCausalLM, piece: int | None, ids: torch.Tensor, pos: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata, backend: AttentionBackend
                ) -> torch.Tensor | None:
        """Run the whole pass (``piece`` None) or one piece over ``num_tokens`` tokens
        (``ids``, ``pos``: ``[num_tokens]`` int64): the hidden states ``[num_tokens,
        hidden_size]`` after the final norm, or None for a piece before the last (its
        output waits in the carry buffers)."""
        if piece is None:
            return model(ids, pos, kv_caches, meta, backend)
        assert self.carry_x is not None and self.carry_residual is not None
        n = ids.shape[0]
        start, end = self.bounds[piece]
        if piece == 0:
            x, residual = model.embed(ids), None
        else:
            x, residual = self.carry_x[:n], self.carry_residual[:n]
        x, residual = model.run_layers(x, residual, pos, kv_caches, meta, backend, start, end)
        if piece + 1 == len(self.bounds):
            return model.final_norm(x, residual, backend)
        assert residual is not None
        self.carry_x[:n].copy_(x)
        self.carry_residual[:n].copy_(residual)
        return None

    def capture(self, run: Callable[[int | None], T], pool: tuple[int, int]
                ) -> tuple[list[torch.cuda.CUDAGraph], T]:
        """Capture one step as a graph per piece in memory pool ``pool``: ``run(piece)``
        (``indices``' values) records the piece's work. Returns the graphs and what the
        last piece's ``run`` returned (its output, which the graphs write on replay)."""
        graphs, out = [], None
        for piece in self.indices():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = run(piece)
            graphs.append(graph)
        return graphs, out  # type: ignore[return-value]

    def begin(self, graphs: list[torch.cuda.CUDAGraph], output: torch.Tensor) -> PiecewiseReplay:
        """Replay the first of a step's ``graphs`` (``capture``'s), whose last piece writes
        ``output``; the returned replay goes on with the others."""
        replay = PiecewiseReplay(graphs, output, self._piece_done)
        replay.replay_next()
        return replay


class PiecewiseReplay:
    """One step being replayed piece by piece (``DecodeGraphs.begin``,
    ``MixedGraphs.begin``).

    ``remaining`` pieces are still to be replayed; ``wait()`` blocks until the pieces
    replayed so far have run on the GPU, ``replay_next()`` enqueues the next one. Once
    none remains, ``output`` (the step's logits or hidden rows, a view of the graphs'
    output buffer) is enqueued. A step dropped halfway leaves KV written for its first
    layers only, at slots that its requests write again when they compute those
    positions; nothing else of it is kept."""

    def __init__(self, graphs: list[torch.cuda.CUDAGraph], output: torch.Tensor,
                 done: torch.cuda.Event | None) -> None:
        self._graphs = graphs
        self._next = 0
        self.output = output
        self._done = done  # recorded after each piece but the last (None: a single piece)

    @property
    def remaining(self) -> int:
        return len(self._graphs) - self._next

    def replay_next(self) -> None:
        self._graphs[self._next].replay()
        self._next += 1
        if self.remaining:
            assert self._done is not None
            self._done.record()

    def wait(self) -> None:
        """Block until the pieces replayed so far have run."""
        if self._done is not None:
            self._done.synchronize()

    def finish(self) -> torch.Tensor:
        """Replay every piece left, without looking; returns ``output``."""
        while self.remaining:
            self.replay_next()
        return self.output


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, 16, 24, 32, 48, 64, 80, ... up to and including
    ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4, 8, 16, 24, 32) if s < max_num_seqs]
    s = 48
    while s < max_num_seqs:
        sizes.append(s)
        s += 16
    return sizes + [max_num_seqs]


class StaticInputs(PackedStepBuffers):
    """The packed decode-step inputs (``packed_step.py``'s layout with ``max_bs`` tokens
    and sequences, one token each, no logits indices): a pinned host copy filled by
    numpy, and the device buffers the graphs read."""

    def __init__(self, max_bs: int, max_blocks: int, device: torch.device) -> None:
        super().__init__(max_bs, max_bs, max_blocks, device)
        self.max_bs = max_bs

    def fill(self, input_ids: list[int], positions: list[int], slots: list[int],
             block_tables: list[list[int]], seq_lens: list[int]) -> None:
        """Write one decode step (``n`` sequences, one token each) and its padding."""
        self.wait_for_upload()
        n = len(input_ids)
        self._ids[:n], self._ids[n:] = input_ids, 0
        self._pos[:n], self._pos[n:] = positions, 0
        self._slots[:n], self._slots[n:] = slots, -1
        if block_tables:
            width = max(len(row) for row in block_tables)
            self._tables[:n, :width] = [row + [0] * (width - len(row)) for row in block_tables]
        qsl = self._qsl
        qsl[:n + 1] = np.arange(n + 1)
        qsl[n + 1:] = n
        self._seq_lens[:n], self._seq_lens[n:] = seq_lens, 0

    def views(self, b: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``(input_ids, positions, metadata)`` of the first ``b`` rows."""
        return self.attention_metadata(b, b, 1, max_seq_len)


class DecodeGraphs:
    """Captured decode graphs of one model, KV cache and backend; ``run(n)`` replays
    the smallest bucket that holds ``n`` sequences and returns their logits, ``begin(n)``
    its first piece only (``pieces`` > 1; under tensor parallelism keep 1: every rank
    must run each pass whole)."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], backend: AttentionBackend,
                 max_num_seqs: int, max_blocks_per_seq: int, max_seq_len: int, device: torch.device,
                 pieces: int = 1) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.max_seq_len = max_seq_len
        self.tiers = context_tiers(max_seq_len)
        self.buckets = bucket_sizes(max_num_seqs)
        self.inputs = StaticInputs(max_num_seqs, max_blocks_per_seq, device)
        self.pieces = LayerPieces(model, pieces, max_num_seqs, device)
        # Keyed by (context tier, batch bucket): the step's graphs, one per piece.
        self.graphs: dict[tuple[int, int], list[torch.cuda.CUDAGraph]] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.capture_time_s = 0.0
        self.num_captures = 0  # graphs captured since start-up (the warm-up test reads it)
        self.num_replays = 0

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def _forward(self, b: int, tier: int, piece: int | None = None) -> torch.Tensor | None:
        """The step of bucket ``b`` at context tier ``tier`` (what a graph captures),
        whole (``piece`` None) or one piece: the logits ``[b, vocab]`` float32 after the
        last piece, None before it."""
        ids, pos, meta = self.inputs.views(b, tier)
        hidden = self.pieces.forward(self.model, piece, ids, pos, self.kv_caches, meta, self.backend)
        return None if hidden is None else self.model.compute_logits(hidden)

    def _capture_step(self, b: int, tier: int, pool: tuple[int, int]) -> None:
        """Capture the step of bucket ``b`` at ``tier`` as one graph per piece."""
        graphs, logits = self.pieces.capture(lambda piece: self._forward(b, tier, piece), pool)
        assert logits is not None
        self.graphs[tier, b], self.logits[tier, b] = graphs, logits
        self.num_captures += len(graphs)

    @torch.inference_mode()
    def capture(self, pool: tuple[int, int] | None = None) -> None:
        """(Re)capture every bucket, largest first, all in memory pool ``pool`` (default:
        a new one; the model runner shares one with the mixed-step graphs, which never
        run at the same time). The inputs are all padding during capture, so the KV
        cache is not touched."""
        t0 = time.perf_counter()
        self.graphs.clear()
        self.logits.clear()
        self.inputs.fill([], [], [], [], [])
        self.inputs.upload()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks kernels
            for tier in self.tiers:
                for b in self.buckets:
                    for piece in self.pieces.indices():
                        self._forward(b, tier, piece)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for tier in reversed(self.tiers):
            for b in reversed(self.buckets):
                self._capture_step(b, tier, pool)
        torch.cuda.synchronize()
        self.capture_time_s = time.perf_counter() - t0
        log.info("captured %d decode CUDA graphs (batch %s x context %s, %d piece(s) each) in %.1f s",
                 self.num_captures, self.buckets, self.tiers, len(self.pieces), self.capture_time_s)

    def run(self, n: int, max_seq_len: int | None = None, upload: bool = True) -> torch.Tensor:
        """Upload the filled inputs, replay the bucket for ``n`` sequences whose longest
        context is ``max_seq_len`` tokens (default: the largest tier), every piece, and
        return their logits ``[n, vocab]`` float32 (a view of the graph's output buffer,
        valid until the next replay). ``upload=False``: the caller has uploaded them
        already."""
        return self.begin(n, max_seq_len, upload).finish()

    def begin(self, n: int, max_seq_len: int | None = None, upload: bool = True) -> PiecewiseReplay:
        """As ``run``, but replay the first piece only: the caller replays the others
        (``PiecewiseReplay``), or drops the step."""
        b = next(s for s in self.buckets if s >= n)
        need = self.max_seq_len if max_seq_len is None else max_seq_len
        tier = next(t for t in self.tiers if t >= need)
        if upload:
            self.inputs.upload()
        self.num_replays += 1
        return self.pieces.begin(self.graphs[tier, b], self.logits[tier, b][:n])
