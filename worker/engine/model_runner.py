"""Turns a scheduled step into tensors, runs the model over the paged cache, samples.

How a batch changes form:
    scheduler: [(request, num_tokens), ...]                       (Python, CPU)
 -> flat lists: input_ids, positions, slot_mapping, query lens,
    seq lens, block tables (padded), logits indices               (Python lists)
 -> one host-to-device copy each                                  (tensors, model device)
 -> model forward over [num_tokens] -> hidden [num_tokens, H]
 -> hidden[logits_indices] -> logits [num_sampled, V] float32 -> sampler -> ids (one D2H copy)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from shared.settings import EngineSettings
from worker.engine.sampler import Sampler
from worker.engine.scheduler import ScheduledRequest
from worker.models.attention import AttentionMetadata, select_backend
from worker.models.config import ModelConfig
from worker.models.llama import KVCache, LlamaForCausalLM

log = logging.getLogger(__name__)


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[KVCache]:
    """Per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)]


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler."""

    def __init__(self, model: LlamaForCausalLM, settings: EngineSettings, num_blocks: int,
                 dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        self.model = model
        self.cfg = model.config
        self.device = device
        self.dtype = dtype
        self.block_size = settings.block_size
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_cache(self.cfg, num_blocks, self.block_size, dtype, device)
        self.backend = select_backend(settings.attention_backend, device)
        self.sampler = Sampler(device, seed)
        log.info("model runner: %d KV blocks of %d tokens, %s attention, %s on %s",
                 num_blocks, self.block_size, self.backend.name, dtype, device)

    def _to_device(self, values: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
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
            table = req.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            q_lens.append(item.num_tokens)
            s_lens.append(end)
            if item.samples:
                logits_indices.append(len(input_ids) - 1)
        max_blocks = max(len(item.request.block_table) for item in batch)
        tables = [item.request.block_table + [0] * (max_blocks - len(item.request.block_table)) for item in batch]
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots, torch.int64),
            block_tables=self._to_device([b for row in tables for b in row], torch.int32).view(len(batch), max_blocks),
            query_start_loc=self._to_device(qsl, torch.int32),
            seq_lens=self._to_device(s_lens, torch.int32),
            max_query_len=max(q_lens),
            max_seq_len=max(s_lens),
            query_lens_cpu=q_lens,
            seq_lens_cpu=s_lens,
        )
        return (self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64), meta,
                self._to_device(logits_indices, torch.int64))

    @torch.inference_mode()
    def execute(self, batch: Sequence[ScheduledRequest]) -> list[int | None]:
        """Run one step. Returns, per scheduled request, its sampled token or ``None``
        (a partial prefill chunk samples nothing)."""
        input_ids, positions, meta, logits_indices = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        sampled_items = [item for item in batch if item.samples]
        tokens: list[int] = []
        if sampled_items:
            logits = self.model.compute_logits(hidden.index_select(0, logits_indices))
            reqs = [item.request for item in sampled_items]
            tokens = self.sampler(logits, [r.request_id for r in reqs], [r.sampling for r in reqs],
                                  [r.token_ids for r in reqs], [r.num_prompt_tokens for r in reqs])
        it = iter(tokens)
        return [next(it) if item.samples else None for item in batch]
