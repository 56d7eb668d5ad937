"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at start-up.
Steps that carry prefill chunks replay the graphs of ``mixed_graphs.py`` instead.

A decode step of a 7B model is ~350 kernel launches; at ~30 µs of host time each
(see docs, H100 notes) an eager step costs ~10 ms whatever the GPU does. Replaying a
captured graph costs one launch. vLLM does the same: capture at start-up, for padded
batch sizes 1, 2, 4, 8, then every 8 (here 16 above 32) up to ``max_num_seqs``.

Static buffers (the graphs read them at fixed addresses; the model runner fills them
with two host-to-device copies per step, see ``StaticInputs``):
    int64: input_ids | positions | slot_mapping            each [max_bs]
    int32: block_tables [max_bs, max_blocks] | query_start_loc [max_bs + 1] | seq_lens [max_bs]
A bucket ``b`` graph reads the first ``b`` rows. Rows past the real batch are padding:
slot -1 (no KV write), query length 0 and seq_len 0 (attention skips them); their
logits are computed and ignored. Output: logits ``[b, vocab]`` float32 of every row.

The attention kernel sizes its split-KV grid from a ``max_seq_len`` hint fixed at
capture. A hint far above the real context wastes programs and the split reduction
(Qwen2.5-7B, batch 64, context 320 on the H100: 6.97 ms per replay with the hint at
4096, 6.27 ms at 512), so each bucket is captured once per context tier
(512, 2048, 8192, ... up to ``max_seq_len``) and a step replays the smallest tier that
holds its longest sequence.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from worker.models.attention import AttentionBackend, AttentionMetadata
from worker.models.llama import KVCache, LlamaForCausalLM

log = logging.getLogger(__name__)


def context_tiers(max_seq_len: int) -> list[int]:
    """Context-length hints the graphs are captured for: 512, 2048, 8192, ... (x4) below
    ``max_seq_len``, then ``max_seq_len`` itself (tokens)."""
    tiers, t = [], 512
    while t < max_seq_len:
        tiers.append(t)
        t *= 4
    return tiers + [max_seq_len]


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, 16, 24, 32, 48, 64, 80, ... up to and including
    ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4, 8, 16, 24, 32) if s < max_num_seqs]
    s = 48
    while s < max_num_seqs:
        sizes.append(s)
        s += 16
    return sizes + [max_num_seqs]


class StaticInputs:
    """The packed step inputs: a pinned host copy filled by numpy, and the device
    buffers the graphs read. ``upload()`` is the step's two host-to-device copies."""

    def __init__(self, max_bs: int, max_blocks: int, device: torch.device) -> None:
        self.max_bs, self.max_blocks = max_bs, max_blocks
        n32 = max_bs * max_blocks + 2 * max_bs + 1
        self.host64 = torch.zeros(3 * max_bs, dtype=torch.int64, pin_memory=True)
        self.host32 = torch.zeros(n32, dtype=torch.int32, pin_memory=True)
        self.dev64 = torch.zeros(3 * max_bs, dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(n32, dtype=torch.int32, device=device)
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        # A copy may still be reading the pinned buffer when the next step refills it
        # (a step that samples nothing does not synchronise); wait for it first.
        self._uploaded = torch.cuda.Event()

    def fill(self, input_ids: list[int], positions: list[int], slots: list[int],
             block_tables: list[list[int]], seq_lens: list[int]) -> None:
        """Write one decode step (``n`` sequences, one token each) and its padding."""
        self._uploaded.synchronize()
        n, bs, mb = len(input_ids), self.max_bs, self.max_blocks
        a, b = self.np64, self.np32
        a[:n], a[n:bs] = input_ids, 0
        a[bs:bs + n], a[bs + n:2 * bs] = positions, 0
        a[2 * bs:2 * bs + n], a[2 * bs + n:] = slots, -1
        tables = b[:bs * mb].reshape(bs, mb)
        if block_tables:
            width = max(len(row) for row in block_tables)
            tables[:n, :width] = [row + [0] * (width - len(row)) for row in block_tables]
        qsl = b[bs * mb:bs * mb + bs + 1]
        qsl[:n + 1] = np.arange(n + 1)
        qsl[n + 1:] = n
        lens = b[bs * mb + bs + 1:]
        lens[:n], lens[n:] = seq_lens, 0

    def upload(self) -> None:
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        self._uploaded.record()

    def views(self, b: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``(input_ids, positions, metadata)`` of the first ``b`` rows."""
        bs, mb = self.max_bs, self.max_blocks
        d64, d32 = self.dev64, self.dev32
        meta = AttentionMetadata(
            slot_mapping=d64[2 * bs:2 * bs + b],
            block_tables=d32[:bs * mb].view(bs, mb)[:b],
            query_start_loc=d32[bs * mb:bs * mb + b + 1],
            seq_lens=d32[bs * mb + bs + 1:bs * mb + bs + 1 + b],
            max_query_len=1,
            max_seq_len=max_seq_len,
        )
        return d64[:b], d64[bs:bs + b], meta


class DecodeGraphs:
    """Captured decode graphs of one model, KV cache and backend; ``run(n)`` replays
    the smallest bucket that holds ``n`` sequences and returns their logits."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], backend: AttentionBackend,
                 max_num_seqs: int, max_blocks_per_seq: int, max_seq_len: int, device: torch.device) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.max_seq_len = max_seq_len
        self.tiers = context_tiers(max_seq_len)
        self.buckets = bucket_sizes(max_num_seqs)
        self.inputs = StaticInputs(max_num_seqs, max_blocks_per_seq, device)
        # Keyed by (context tier, batch bucket).
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.capture_time_s = 0.0
        self.num_captures = 0  # graphs captured since start-up (the warm-up test reads it)
        self.num_replays = 0

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def _forward(self, b: int, tier: int) -> torch.Tensor:
        ids, pos, meta = self.inputs.views(b, tier)
        hidden = self.model(ids, pos, self.kv_caches, meta, self.backend)
        return self.model.compute_logits(hidden)

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
                    self._forward(b, tier)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for tier in reversed(self.tiers):
            for b in reversed(self.buckets):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[tier, b] = self._forward(b, tier)
                self.graphs[tier, b] = graph
                self.num_captures += 1
        torch.cuda.synchronize()
        self.capture_time_s = time.perf_counter() - t0
        log.info("captured %d decode CUDA graphs (batch %s x context %s) in %.1f s", len(self.graphs),
                 self.buckets, self.tiers, self.capture_time_s)

    def run(self, n: int, max_seq_len: int | None = None, upload: bool = True) -> torch.Tensor:
        """Upload the filled inputs, replay the bucket for ``n`` sequences whose longest
        context is ``max_seq_len`` tokens (default: the largest tier), and return their
        logits ``[n, vocab]`` float32 (a view of the graph's output buffer, valid until
        the next replay). ``upload=False``: the caller has uploaded them already."""
        b = next(s for s in self.buckets if s >= n)
        need = self.max_seq_len if max_seq_len is None else max_seq_len
        tier = next(t for t in self.tiers if t >= need)
        if upload:
            self.inputs.upload()
        self.graphs[tier, b].replay()
        self.num_replays += 1
        return self.logits[tier, b][:n]
