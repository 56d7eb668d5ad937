"""Attention over the paged KV cache as the model sees it: metadata of a flat batch and
the backend that writes new K/V and attends (PyTorch reference or Triton)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_cache_write import kv_cache_write_ref
from kernels.paged_attention import paged_attention_ref


@dataclass(slots=True)
class AttentionMetadata:
    """How a flat batch of ``num_tokens`` tokens from ``num_seqs`` sequences maps onto
    the paged cache. Built once per step by the model runner, shared by every layer.

    Tensors (on the model's device):
        slot_mapping: ``[num_tokens]`` int64, cache slot of each new token (-1: padding).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query lengths.
        seq_lens: ``[num_seqs]`` int32, context length after this step's tokens.
    Host values: ``max_query_len``, ``max_seq_len`` (tokens) and, for the reference
    backend, the per-sequence lengths as lists; ``has_padding`` is ``False`` when every
    slot is a real token (an eager step), which spares the reference a check per layer.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    has_padding: bool = True


class TorchAttentionBackend:
    """PyTorch reference backend (CPU and CUDA); the oracle for the Triton one."""

    name = "torch"
    fused_ops: frozenset[str] = frozenset()  # the model runs its plain PyTorch ops

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float) -> torch.Tensor:
        """Write ``k, v`` (``[T, num_kv_heads, head_dim]``) to the cache, then attend
        with ``q`` (``[T, num_heads, head_dim]``); returns ``[T, num_heads, head_dim]``."""
        kv_cache_write_ref(k, v, k_cache, v_cache, meta.slot_mapping, meta.has_padding)
        return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                   meta.seq_lens, scale, query_lens_cpu=meta.query_lens_cpu,
                                   seq_lens_cpu=meta.seq_lens_cpu, key=k, value=v)


class TritonAttentionBackend:
    """Triton kernels on CUDA: KV write and varlen paged attention, CUDA-graph safe."""

    name = "triton"
    #: Fused Triton ops the model uses with this backend (see ``worker/models/llama.py``):
    #: "rmsnorm" (residual add + RMSNorm), "rotary", "silu_mul". An instance attribute
    #: so that benchmarks can compare subsets (recapture CUDA graphs after a change).
    ALL_FUSED_OPS = frozenset({"rmsnorm", "rotary", "silu_mul"})

    def __init__(self, fused_ops: frozenset[str] | None = None) -> None:
        self.fused_ops = self.ALL_FUSED_OPS if fused_ops is None else frozenset(fused_ops)
        from kernels.kv_cache_write import kv_cache_write
        from kernels.paged_attention import paged_attention

        self._write = kv_cache_write
        self._attend = paged_attention

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float) -> torch.Tensor:
        """Same contract as ``TorchAttentionBackend.__call__``."""
        self._write(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                            scale, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)


AttentionBackend = TorchAttentionBackend | TritonAttentionBackend


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks Triton on CUDA when it imports, else the PyTorch reference.

    Raises:
        ValueError: ``triton`` asked for where it cannot run.
    """
    from kernels import triton_available

    if name == "torch" or (name == "auto" and (device.type != "cuda" or not triton_available())):
        return TorchAttentionBackend()
    if device.type != "cuda" or not triton_available():
        raise ValueError("the triton attention backend needs CUDA and the triton package")
    return TritonAttentionBackend()
