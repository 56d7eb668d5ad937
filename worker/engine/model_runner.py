"""Turns a scheduled step into tensors, runs the model over the paged cache, samples.

How a batch changes form:
    scheduler: [(request, num_tokens), ...]                       (Python, CPU)
 -> flat lists: input_ids, positions, slot_mapping, query lens,
    seq lens, block tables (padded), logits indices               (Python lists)
 -> two host-to-device copies (int64: ids | positions | slots | logits indices;
    int32: block tables | query_start_loc | seq_lens), views of them  (tensors, model device)
 -> model forward over [num_tokens] -> hidden [num_tokens, H]
 -> hidden[logits_indices] -> logits [num_sampled, V] float32 -> sampler -> ids (one D2H copy)

A step in which every sequence has one query token and samples (a decode step) runs
instead as the replay of a CUDA graph (``cuda_graphs.py``) when the device is CUDA, the
backend is Triton and ``enforce_eager`` is off. Nothing in a step waits on the device
except the copy of the sampled ids.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from shared.settings import EngineSettings
from worker.engine.cuda_graphs import DecodeGraphs
from worker.engine.request import Request
from worker.engine.sampler import Sampler
from worker.engine.scheduler import ScheduledRequest
from worker.models.attention import AttentionMetadata, select_backend
from worker.models.config import ModelConfig
from worker.models.llama import KVCache, LlamaForCausalLM

log = logging.getLogger(__name__)


def slot(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The KV-cache slot of the token at ``position``: its block's id times
    ``block_size`` plus its offset in the block (``slot_mapping``'s entries)."""
    return block_table[position // block_size] * block_size + position % block_size


def decode_inputs(requests: Sequence[Request]) -> tuple[list[int], list[int]]:
    """``(positions, input_ids)`` of a decode step whose inputs are on the host: each
    request's first token without KV (``num_computed_tokens``)."""
    positions = [r.num_computed_tokens for r in requests]
    return positions, [r.token_ids[p] for r, p in zip(requests, positions)]


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[KVCache]:
    """Per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)]


class DecodeLaunch:
    """A decode step enqueued on the GPU: its sampled ids on the device, and a copy of
    them to pinned host memory that ``token_ids`` waits for."""

    def __init__(self, sampled: torch.Tensor) -> None:
        self.sampled = sampled  # [n] int64, device
        self._host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        self._host.copy_(sampled, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def token_ids(self) -> list[int]:
        """The sampled ids; blocks until the step has run."""
        self._ready.synchronize()
        return self._host.tolist()


class ModelRunner:
    """Owns the model, the KV cache tensors, the decode CUDA graphs and the sampler."""

    def __init__(self, model: LlamaForCausalLM, settings: EngineSettings, num_blocks: int, max_model_len: int,
                 dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        """``max_model_len``: the longest sequence, tokens (``shared.model_source.max_model_len``;
        the model's rotary table covers it), which sizes the decode graphs' block tables."""
        self.model = model
        self.cfg = model.config
        self.device = device
        self.dtype = dtype
        self.block_size = settings.block_size
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_cache(self.cfg, num_blocks, self.block_size, dtype, device)
        self.backend = select_backend(settings.attention_backend, device)
        self.sampler = Sampler(device, seed)
        self.max_model_len = max_model_len
        self.graphs: DecodeGraphs | None = None
        if device.type == "cuda" and not settings.enforce_eager and self.backend.name == "triton":
            max_blocks = -(-self.max_model_len // self.block_size)
            self.graphs = DecodeGraphs(model, self.kv_caches, self.backend, settings.max_num_seqs, max_blocks,
                                       self.max_model_len, device)
            self.graphs.capture()
        log.info("model runner: %d KV blocks of %d tokens, %s attention, %s on %s, CUDA graphs %s",
                 num_blocks, self.block_size, self.backend.name, dtype, device,
                 self.graphs.buckets if self.graphs else "off")

    def _to_device(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    def prepare(self, batch: Sequence[ScheduledRequest]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten a step into ``(input_ids, positions, metadata, logits_indices)``."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        s_lens: list[int] = []
        logits_indices: list[int] = []
        bs = self.block_size
        for item in batch:
            req, start = item.request, item.request.num_computed_tokens
            end = start + item.num_tokens
            input_ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(slot(req.block_table, p, bs) for p in range(start, end))
            q_lens.append(item.num_tokens)
            s_lens.append(end)
            if item.samples:
                logits_indices.append(len(input_ids) - 1)
        num_tokens, num_seqs = len(input_ids), len(batch)
        max_blocks = max(len(item.request.block_table) for item in batch)
        ints32 = [b for item in batch for b in item.request.block_table + [0] * (max_blocks - len(item.request.block_table))]
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        d64 = self._to_device(input_ids + positions + slots + logits_indices, torch.int64)
        d32 = self._to_device(ints32 + qsl + s_lens, torch.int32)
        nbt = num_seqs * max_blocks
        meta = AttentionMetadata(
            slot_mapping=d64[2 * num_tokens:3 * num_tokens],
            block_tables=d32[:nbt].view(num_seqs, max_blocks),
            query_start_loc=d32[nbt:nbt + num_seqs + 1],
            seq_lens=d32[nbt + num_seqs + 1:],
            max_query_len=max(q_lens),
            max_seq_len=max(s_lens),
            query_lens_cpu=q_lens,
            seq_lens_cpu=s_lens,
            has_padding=False,
        )
        return d64[:num_tokens], d64[num_tokens:2 * num_tokens], meta, d64[3 * num_tokens:]

    def _decode_logits(self, requests: Sequence[Request], positions: Sequence[int],
                       input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab]`` of a decode step (one token per request) through the
        captured graphs, enqueued without waiting for the GPU.

        Args:
            requests: the sequences, each with a block table that already holds
                ``positions[i]``.
            positions: the position of each request's input token (tokens).
            input_ids: the input tokens, on the host, or ``[n]`` int64 on the device (the
                sampled ids of the step still in flight: async scheduling).
        """
        graphs = self.graphs
        assert graphs is not None and len(requests) <= graphs.max_batch_size
        bs = self.block_size
        on_device = isinstance(input_ids, torch.Tensor)
        host_ids = [0] * len(requests) if on_device else list(input_ids)  # type: ignore[arg-type]
        slots = [slot(r.block_table, p, bs) for r, p in zip(requests, positions)]
        lens = [p + 1 for p in positions]
        graphs.inputs.fill(host_ids, list(positions), slots, [r.block_table for r in requests], lens)
        graphs.inputs.upload()
        if on_device:  # stream-ordered after the upload and the step that sampled them
            graphs.inputs.dev64[:len(requests)].copy_(input_ids)  # type: ignore[arg-type]
        return graphs.run(len(requests), max(lens), upload=False)

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """``Sampler.sample`` of one row of ``logits`` per request: ``[n]`` int64 ids on
        the device, not synchronised."""
        return self.sampler.sample(logits, [r.request_id for r in requests], [r.sampling for r in requests],
                                   [r.token_ids for r in requests], [r.num_prompt_tokens for r in requests])

    def can_launch_decode(self, n: int) -> bool:
        """True when a decode step of ``n`` sequences can run as a graph replay
        (``launch_decode``)."""
        return self.graphs is not None and n <= self.graphs.max_batch_size

    @torch.inference_mode()
    def launch_decode(self, requests: Sequence[Request], positions: Sequence[int],
                      input_ids: Sequence[int] | torch.Tensor) -> DecodeLaunch:
        """Enqueue a decode step (one token per request) through the CUDA graphs and its
        sampling, without waiting for the GPU. Arguments as ``_decode_logits``.

        Returns:
            The launch; ``DecodeLaunch.token_ids()`` waits for and returns the sampled ids.
        """
        return DecodeLaunch(self._sample(self._decode_logits(requests, positions, input_ids), requests))

    @torch.inference_mode()
    def execute(self, batch: Sequence[ScheduledRequest]) -> list[int | None]:
        """Run one step. Returns, per scheduled request, its sampled token or ``None``
        (a partial prefill chunk samples nothing)."""
        sampled_items = [item for item in batch if item.samples]
        if self.can_launch_decode(len(batch)) and all(item.num_tokens == 1 and item.samples for item in batch):
            requests = [item.request for item in batch]
            logits: torch.Tensor | None = self._decode_logits(requests, *decode_inputs(requests))
        else:
            input_ids, positions, meta, logits_indices = self.prepare(batch)
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
            logits = None
            if sampled_items:
                if len(sampled_items) < hidden.shape[0]:
                    hidden = hidden.index_select(0, logits_indices)
                logits = self.model.compute_logits(hidden)
        tokens: list[int] = []
        if logits is not None:  # the step's one synchronisation: the ids' copy to the host
            tokens = self._sample(logits, [item.request for item in sampled_items]).tolist()
        it = iter(tokens)
        return [next(it) if item.samples else None for item in batch]
