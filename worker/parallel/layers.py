"""Megatron-style tensor parallelism of the decoder (``worker/models/llama.py``): which
slice of each weight a rank holds, and the layers whose output needs a collective.

Every rank of a group of N holds (Shoeybi et al., "Megatron-LM", 2019; vLLM's
``ColumnParallelLinear``/``RowParallelLinear``/``VocabParallelEmbedding``):
    qkv_proj, gate_up_proj   column-parallel: num_heads/N query heads, num_kv_heads/N KV
                             heads (one head, replicated N/num_kv_heads times, when
                             num_kv_heads < N), intermediate_size/N rows of gate and of up
    o_proj, down_proj        row-parallel: the matching input columns; the partial sums
                             are added by ONE all-reduce each (the bias on rank 0 only)
    embed_tokens             vocab-parallel: rows [rank*V_r, (rank+1)*V_r) with
                             V_r = ceil(vocab/N) (the last rank's tail is zero padding);
                             ids outside the shard look up zeros, one all-reduce sums them
    lm_head (or tied embed)  vocab-parallel: each rank's logits [n, V_r], all-gathered
                             into [n, vocab] (rank 0's sampler reads them)
    norms, rotary            replicated
So a layer costs two all-reduces of ``[num_tokens, hidden]``, and each rank's KV cache
holds its local KV heads only. The model built for a rank is ``LlamaForCausalLM`` of the
shard's config (``ShardSpec.config``); ``TensorParallelLM`` swaps in the parallel layers.
Supported: the dense families of ``worker/models/config.py`` (``SUPPORTED_TP``); MoE is
refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker.models.attention import AttentionBackend, AttentionMetadata
from worker.models.config import ModelConfig
from worker.models.linear import Linear
from worker.models.llama import KVCache, LlamaForCausalLM
from worker.parallel.all_reduce import all_reduce

if TYPE_CHECKING:
    from worker.parallel.step_sync import StepSync

# torch 2.13 renamed all_gather_into_tensor (same contract); older wheels have only the old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: ``model_type``s that run under tensor parallelism (every dense family).
SUPPORTED_TP = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """Rank ``rank`` of ``world_size``: its slice of every sharded dimension.

    ``config`` is the full config with ``num_heads``, ``num_kv_heads``,
    ``intermediate_size`` and ``vocab_size`` replaced by this rank's share
    (``vocab_size`` = ``ceil(full vocab / world_size)``, padding included)."""

    rank: int
    world_size: int
    full: ModelConfig
    config: ModelConfig

    @property
    def kv_head_start(self) -> int:
        """The first of this rank's KV heads in the full model (replicated heads: the one
        that this rank's query heads attend with)."""
        full, local = self.full, self.config
        if full.num_kv_heads >= self.world_size:
            return self.rank * local.num_kv_heads
        return self.rank // (self.world_size // full.num_kv_heads)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.config.vocab_size

    @property
    def vocab_end(self) -> int:
        """One past this rank's last real vocabulary row (``<= vocab_start + V_r``)."""
        return min(self.full.vocab_size, self.vocab_start + self.config.vocab_size)

    def rows(self, kind: str) -> tuple[int, int]:
        """``[start, stop)`` of the full tensor's sharded dimension for this rank:
        ``kind`` is ``q``, ``kv`` (rows of q/k/v, head_dim each per head), ``mlp``
        (rows of gate/up, columns of down) or ``vocab``."""
        d, local = self.full.head_dim, self.config
        if kind == "q":
            return self.rank * local.num_heads * d, (self.rank + 1) * local.num_heads * d
        if kind == "kv":
            start = self.kv_head_start * d
            return start, start + local.num_kv_heads * d
        if kind == "mlp":
            i = local.intermediate_size
            return self.rank * i, (self.rank + 1) * i
        assert kind == "vocab", kind
        return self.vocab_start, self.vocab_end


def shard_spec(cfg: ModelConfig, rank: int, world_size: int) -> ShardSpec:
    """The share of ``cfg`` that rank ``rank`` of ``world_size`` holds.

    Raises:
        ValueError: a config that does not split: a family outside ``SUPPORTED_TP`` or a
            mixture of experts, ``num_heads % world_size``, ``intermediate_size %
            world_size``, or KV heads that neither split (``num_kv_heads % world_size``)
            nor replicate (``world_size % num_kv_heads``).
    """
    n = world_size
    name = f"{cfg.model_type}: tensor parallel size {n}"
    if cfg.model_type not in SUPPORTED_TP or cfg.num_experts:
        raise ValueError(f"{name}: tensor parallelism supports the dense families "
                         f"{', '.join(SUPPORTED_TP)} (not mixtures of experts)")
    if cfg.num_heads % n:
        raise ValueError(f"{name} does not divide num_attention_heads {cfg.num_heads}")
    if cfg.intermediate_size % n:
        raise ValueError(f"{name} does not divide intermediate_size {cfg.intermediate_size}")
    if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
        raise ValueError(f"{name}: num_key_value_heads {cfg.num_kv_heads} neither divides by it nor divides it")
    local = dataclasses.replace(
        cfg, num_heads=cfg.num_heads // n, num_kv_heads=max(1, cfg.num_kv_heads // n),
        intermediate_size=cfg.intermediate_size // n, vocab_size=-(-cfg.vocab_size // n))
    return ShardSpec(rank, n, cfg, local)


#: HF module -> (ShardSpec.rows kind, sharded dim of its weight): column-parallel
#: (dim 0, biases and per-row FP8 scales too) and row-parallel (dim 1; the bias is whole on
#: rank 0, zero elsewhere; per-row FP8 scales whole on every rank).
_SHARDED = {
    "self_attn.q_proj": ("q", 0), "self_attn.k_proj": ("kv", 0), "self_attn.v_proj": ("kv", 0),
    "self_attn.o_proj": ("q", 1), "mlp.gate_proj": ("mlp", 0), "mlp.up_proj": ("mlp", 0),
    "mlp.down_proj": ("mlp", 1), "embed_tokens": ("vocab", 0), "lm_head": ("vocab", 0),
}
#: ``tensor_slice``'s answer for a tensor this rank keeps at zero (a row-parallel bias, rank > 0).
ZERO = "zero"


def tensor_slice(spec: ShardSpec, name: str) -> tuple[int, int, int] | str | None:
    """Which part of checkpoint tensor ``name`` (HF name, ``model.`` dropped, e.g.
    ``layers.3.mlp.down_proj.weight``) rank ``spec.rank`` reads: ``(dim, start, stop)``,
    ``None`` (the whole tensor: norms, a row-parallel projection's per-row FP8
    ``weight_scale``) or ``ZERO`` (none of it: keep zeros). A per-tensor FP8 scale (one
    value) is read whole by the loader whatever this says."""
    module, _, kind = name.rpartition(".")
    key = module.split(".", 2)[2] if module.startswith("layers.") else module
    if key not in _SHARDED:
        return None
    rows, dim = _SHARDED[key]
    if dim == 1 and kind == "bias":
        return None if spec.rank == 0 else ZERO
    if dim == 1 and kind == "weight_scale":  # one scale per output row: every rank holds every row
        return None
    return (dim if kind == "weight" else 0, *spec.rows(rows))


class RowParallelLinear(Linear):
    """``Linear`` over this rank's input columns; ``forward`` (and, for an FP8 weight
    with 128x128 blocks, ``forward_quantized``, whose input arrives quantized by the
    kernel before it) sums the partial products of every rank with one all-reduce (in
    place, so CUDA graphs capture it). Its bias is zero on ranks > 0, so the sum adds it
    once."""

    group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sum_over_ranks(super().forward(x))

    def forward_quantized(self, q: torch.Tensor, scale: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
        return self.sum_over_ranks(super().forward_quantized(q, scale, rows, dtype))

    def sum_over_ranks(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` (this rank's partial product ``[rows, out_features]``) summed over the
        group, in place: the one collective of both paths."""
        all_reduce(out, self.group)
        return out


class VocabParallelEmbedding(nn.Embedding):
    """Embedding of rows ``[vocab_start, vocab_end)`` only: other ids look up zeros, and
    one all-reduce fills every row from the rank that holds it."""

    group: dist.ProcessGroup | None = None
    vocab_start = 0
    vocab_end = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        all_reduce(out, self.group)
        return out


class TensorParallelLM(LlamaForCausalLM):
    """One rank's share of the decoder (``ShardSpec``): ``LlamaForCausalLM`` of the
    shard's config with the row-parallel projections, the vocab-parallel embedding and
    the gathered LM head swapped in. ``config`` is the full model's (the runner sizes the
    sampler and grammar masks from it), ``shard_config`` this rank's (its KV cache).

    On rank 0, once ``sync`` is set (after start-up: graph captures run in lockstep on
    every rank without it), ``forward`` and ``compute_logits`` first broadcast their
    inputs (``step_sync.StepSync``) so that the other ranks run the same call."""

    def __init__(self, spec: ShardSpec, max_positions: int, group: dist.ProcessGroup | None) -> None:
        super().__init__(spec.config, max_positions)
        self.config, self.shard_config = spec.full, spec.config
        self.spec, self.group = spec, group
        self.sync: StepSync | None = None
        self.embed_tokens.__class__ = VocabParallelEmbedding
        emb = self.embed_tokens
        assert isinstance(emb, VocabParallelEmbedding)
        emb.group, emb.vocab_start, emb.vocab_end = group, spec.vocab_start, spec.vocab_end
        for layer in self.layers:
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.__class__ = RowParallelLinear
                proj.group = group

    def row_parallel_biases(self) -> list[torch.Tensor]:
        """The biases of the row-parallel projections (kept at zero on ranks > 0)."""
        return [p.bias for layer in self.layers for p in (layer.self_attn.o_proj, layer.mlp.down_proj)
                if p.bias is not None]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, backend: AttentionBackend,
                stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """As ``LlamaForCausalLM.forward``, announced to the other ranks first; ``stop``
        must be None: every rank runs each pass whole, or the group would desync."""
        assert stop is None, "a tensor-parallel pass cannot stop on one rank"
        if self.sync is not None:
            self.sync.send_forward(input_ids, positions, meta)
        return super().forward(input_ids, positions, kv_caches, meta, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab_size]`` float32 of hidden states ``[n, hidden_size]``: this
        rank's ``[n, V_r]`` (soft-capped: elementwise) all-gathered over the group."""
        if self.sync is not None:
            self.sync.send_logits(hidden)
        local = super().compute_logits(hidden).contiguous()
        n, world = local.shape[0], self.spec.world_size
        gathered = torch.empty((world * n, local.shape[1]), dtype=local.dtype, device=local.device)
        _all_gather(gathered, local, group=self.group)
        return gathered.view(world, n, -1).permute(1, 0, 2).reshape(n, -1)[:, :self.config.vocab_size]
