"""Rank 0 tells the other ranks of a tensor-parallel group what to run, step by step.

Rank 0 runs the engine (scheduler, block manager, sampler); the other ranks only mirror
its model calls (``follower.py``). Each call that involves the model is announced by a
fixed-size header broadcast, then its payload tensors (no pickles):
    header int64 [HEADER_LEN]: op, then the op's sizes
    FORWARD   ``TensorParallelLM.forward`` of an eager step: int64 ids | positions |
              slot_mapping [3 T], int32 block_tables | query_start_loc | seq_lens
    LOGITS    ``TensorParallelLM.compute_logits``: hidden [n, hidden_size] (model dtype)
    DECODE    a decode-graph replay: the graphs' static input buffers, broadcast in
              place (``cuda_graphs.StaticInputs.dev64``/``dev32``), then every rank
              replays the same bucket; the all-reduces are inside the graphs
    MIXED     a mixed-step graph replay (``mixed_graphs.MixedGraphs``): its input
              buffers (``StepInputs.dev64``/``dev32``) broadcast in place, then every rank
              replays the same token bucket; the LM head follows as a LOGITS call
    STOP      the follower loop ends
So a step costs 3 broadcasts (FORWARD, DECODE or MIXED) plus 2 per LM-head call of an
eager or mixed step. Every broadcast is on the device's stream order (NCCL) or synchronous (gloo).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from worker.models.attention import AttentionMetadata

HEADER_LEN = 8
OP_STOP, OP_FORWARD, OP_LOGITS, OP_DECODE, OP_MIXED = 0, 1, 2, 3, 4


class StepSync:
    """Header + payload broadcasts from rank 0 over ``group`` on ``device``."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, hidden_size: int,
                 dtype: torch.dtype) -> None:
        self.group, self.device = group, device
        self.hidden_size, self.dtype = hidden_size, dtype
        self._header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)

    def _bcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, src=0, group=self.group)

    def _send_header(self, *values: int) -> None:
        head = torch.zeros(HEADER_LEN, dtype=torch.int64)
        head[:len(values)] = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":
            # Pinned (the caching host allocator keeps it until the copy is done): a copy
            # from pageable memory would wait for the stream, and async decode would stall.
            head = head.pin_memory().to(self.device, non_blocking=True)
        self._bcast(head)

    # -- rank 0 -----------------------------------------------------------------
    def send_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Announce an eager forward pass of ``input_ids``/``positions`` ``[T]`` int64."""
        num_seqs, max_blocks = meta.block_tables.shape
        self._send_header(OP_FORWARD, input_ids.shape[0], num_seqs, max_blocks, meta.max_query_len,
                          meta.max_seq_len, int(meta.has_padding), int(meta.query_lens_cpu is not None))
        self._bcast(torch.cat([input_ids, positions, meta.slot_mapping]))
        self._bcast(torch.cat([meta.block_tables.reshape(-1), meta.query_start_loc, meta.seq_lens]))

    def send_logits(self, hidden: torch.Tensor) -> None:
        """Announce an LM-head call over ``hidden [n, hidden_size]``."""
        self._send_header(OP_LOGITS, hidden.shape[0])
        self._bcast(hidden.contiguous())

    def send_decode(self, dev64: torch.Tensor, dev32: torch.Tensor, num_seqs: int, max_seq_len: int) -> None:
        """Announce a decode-graph replay of ``num_seqs`` sequences (context hint
        ``max_seq_len`` tokens) and send the graphs' filled input buffers."""
        self._send_replay(OP_DECODE, num_seqs, max_seq_len, dev64, dev32)

    def send_mixed(self, dev64: torch.Tensor, dev32: torch.Tensor, bucket: int, num_sampled: int) -> None:
        """Announce a mixed-step graph replay of token bucket ``bucket`` whose graphs
        gather ``num_sampled`` hidden rows, and send the graphs' filled input buffers."""
        self._send_replay(OP_MIXED, bucket, num_sampled, dev64, dev32)

    def _send_replay(self, op: int, a: int, b: int, dev64: torch.Tensor, dev32: torch.Tensor) -> None:
        """A graph replay's header ``(op, a, b)``, then its input buffers (``recv_into``)."""
        self._send_header(op, a, b)
        self._bcast(dev64)
        self._bcast(dev32)

    def send_stop(self) -> None:
        """Announce STOP (the followers exit) and return once it has left this rank:
        on CUDA the broadcast is waited for, so that rank 0 may abort its communicators
        next without cutting STOP off. Blocks while a follower is inside another call:
        ``TPGroup.close`` bounds it."""
        self._send_header(OP_STOP)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- ranks > 0 --------------------------------------------------------------
    def recv_header(self) -> list[int]:
        """The next header: ``[op, sizes...]`` (blocks until rank 0 sends one)."""
        self._bcast(self._header)
        return self._header.tolist()

    def recv_forward(self, header: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``(input_ids, positions, metadata)`` of a FORWARD header's payload."""
        _, t, num_seqs, max_blocks, max_query_len, max_seq_len, has_padding, host_lens = header
        p64 = torch.empty(3 * t, dtype=torch.int64, device=self.device)
        p32 = torch.empty(num_seqs * max_blocks + 2 * num_seqs + 1, dtype=torch.int32, device=self.device)
        self._bcast(p64)
        self._bcast(p32)
        end = num_seqs * max_blocks
        qsl, seq_lens = p32[end:end + num_seqs + 1], p32[end + num_seqs + 1:]
        meta = AttentionMetadata(
            slot_mapping=p64[2 * t:], block_tables=p32[:end].view(num_seqs, max_blocks), query_start_loc=qsl,
            seq_lens=seq_lens, max_query_len=max_query_len, max_seq_len=max_seq_len,
            has_padding=bool(has_padding))
        if host_lens:  # rank 0's backend got the lengths as lists too: give ours the same
            starts = qsl.tolist()
            meta.query_lens_cpu = [b - a for a, b in itertools.pairwise(starts)]
            meta.seq_lens_cpu = seq_lens.tolist()
        return p64[:t], p64[t:2 * t], meta

    def recv_hidden(self, header: list[int]) -> torch.Tensor:
        """The hidden states ``[n, hidden_size]`` of a LOGITS header."""
        hidden = torch.empty((header[1], self.hidden_size), dtype=self.dtype, device=self.device)
        self._bcast(hidden)
        return hidden

    def recv_into(self, *buffers: torch.Tensor) -> None:
        """Fill ``buffers`` in place from rank 0's (a DECODE or MIXED header's payload)."""
        for b in buffers:
            self._bcast(b)
