"""Attention over the paged KV cache as the model sees it: metadata of a flat batch and
the backend that writes new K/V and attends (PyTorch reference, CPU kernel or Triton)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_attention import decode_attention
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
    #: CPU backend: ``(token_idx, seq_idx)`` int32 of the decode tokens, built by the
    #: first layer that needs it (``decode_index``) and shared by the rest.
    cpu_decode_index: tuple[torch.Tensor, torch.Tensor] | None = None


def decode_index(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(token_idx, seq_idx)``, each ``[n]`` int32: the step's single-token queries (row
    in the flat batch, sequence), or ``None`` when it has none. Cached on ``meta``."""
    if meta.cpu_decode_index is None:
        q_lens = meta.query_lens_cpu
        if q_lens is None:
            q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
        seqs = [i for i, n in enumerate(q_lens) if n == 1]
        if not seqs:
            return None
        starts = meta.query_start_loc.tolist()
        device = meta.query_start_loc.device
        meta.cpu_decode_index = (torch.tensor([starts[i] for i in seqs], dtype=torch.int32, device=device),
                                 torch.tensor(seqs, dtype=torch.int32, device=device))
    return meta.cpu_decode_index


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


class CpuAttentionBackend:
    """CPU: decode tokens through the C++ paged decode kernel (``kernels/cpu_attention.py``,
    K/V read in place), prefill chunks through the reference's flash SDPA path; the model
    runs the C++ residual-add + RMSNorm, rotary and SiLU-and-mul kernels with it."""

    name = "cpu"
    fused_ops: frozenset[str] = frozenset({"rmsnorm", "rotary", "silu_mul"})

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float) -> torch.Tensor:
        """Same contract as ``TorchAttentionBackend.__call__``."""
        kv_cache_write_ref(k, v, k_cache, v_cache, meta.slot_mapping, meta.has_padding)
        out = torch.empty_like(q)
        index = decode_index(meta)
        if index is not None:
            decode_attention(out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, *index, scale)
        if index is None or index[0].numel() < meta.seq_lens.numel():
            paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                scale, out=out, query_lens_cpu=meta.query_lens_cpu,
                                seq_lens_cpu=meta.seq_lens_cpu, key=k, value=v, skip_decode=True)
        return out


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


AttentionBackend = TorchAttentionBackend | CpuAttentionBackend | TritonAttentionBackend


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks Triton on CUDA when it imports, the CPU kernel on CPU when it builds
    (a C++ compiler and ninja; the first build takes about a minute), else the PyTorch
    reference.

    Raises:
        ValueError: ``triton`` or ``cpu`` asked for where it cannot run.
    """
    from kernels import cpu_extension, triton_available

    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        if device.type == "cpu" and cpu_extension.available():
            return CpuAttentionBackend()
        if name == "cpu":
            raise ValueError("the cpu attention backend needs a CPU device and a C++ compiler with ninja")
    if name == "torch" or (name == "auto" and (device.type != "cuda" or not triton_available())):
        return TorchAttentionBackend()
    if device.type != "cuda" or not triton_available():
        raise ValueError("the triton attention backend needs CUDA and the triton package")
    return TritonAttentionBackend()
