"""Attention over the paged KV cache as the model sees it: metadata of a flat batch and
the backend that writes new K/V and attends (PyTorch reference, CPU kernel or Triton).

With an fp8 cache (``--kv-cache-dtype fp8``) the backend quantizes on write and
dequantizes on read with the layer's ``KVQuant`` (its K bias and K/V scales, calibrated at
load: ``worker/engine/kv_calibration.py``); without one, scales of 1.0 and no bias, vLLM's
default without calibration (see docs/operations.md, "FP8 KV cache")."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels.cpu_attention import decode_attention
from kernels.kv_cache_write import kv_cache_write_ref
from kernels.paged_attention import paged_attention_ref

log = logging.getLogger(__name__)

#: Per-tensor scale of an fp8 KV cache layer that has no ``KVQuant``: entries are
#: ``x / scale``. 1.0 as vLLM without calibration: K and V of the Llama-family models we
#: serve stay far inside e4m3's ±448 (SmolLM2-135M, 2,000 tokens: max |K| 33.5, max |V| 14.9,
#: measured by bench/fp8_kv_quality.py).
DEFAULT_KV_SCALE = 1.0


@dataclass(slots=True)
class KVQuant:
    """How one layer's keys and values are encoded in an fp8 KV cache: entries are
    ``(k - k_bias) / k_scale`` and ``v / v_scale`` (``kernels/kv_cache_write.py``); readers
    multiply by the scales and never add the bias back (exact for softmax attention).

    Every key of every request in a layer has the same bias and scale, so blocks written by
    one request are valid for any other (prefix caching) and a recomputed block equals the
    first. Set once at load, before CUDA-graph capture (the graphs hold the scales as
    kernel arguments and ``k_bias``'s address), and never changed while the cache holds data.

    Fields:
        k_bias: ``[num_kv_heads, head_dim]`` float32 on the model's device, written in place.
        k_scale, v_scale: per-tensor scales (floats > 0).
    """

    k_bias: torch.Tensor
    k_scale: float = DEFAULT_KV_SCALE
    v_scale: float = DEFAULT_KV_SCALE

    @classmethod
    def identity(cls, num_kv_heads: int, head_dim: int, device: torch.device) -> KVQuant:
        """No bias (zeros, allocated here for calibration to fill) and scales of 1.0."""
        return cls(torch.zeros(num_kv_heads, head_dim, dtype=torch.float32, device=device))


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
                 scale: float, sliding_window: int | None = None, kv_quant: KVQuant | None = None) -> torch.Tensor:
        """Write ``k, v`` (``[T, num_kv_heads, head_dim]``) to the cache, then attend
        with ``q`` (``[T, num_heads, head_dim]``); returns ``[T, num_heads, head_dim]``.

        ``sliding_window``: ``None`` (full causal attention) or ``w >= 1`` (this layer's
        window): the query at position ``p`` sees keys ``p - w < k <= p`` only, as
        transformers masks them; see ``kernels/paged_attention.py``.

        ``kv_quant``: the layer's fp8 encoding (``KVQuant``), fp8 caches only; ``None``:
        scales of 1.0 and no bias.

        Raises:
            ValueError: bad shapes or dtypes, or a ``sliding_window`` that is not ``None``
                or a positive int.
        """
        k_scale, v_scale, k_bias = _encoding(kv_quant)
        kv_cache_write_ref(k, v, k_cache, v_cache, meta.slot_mapping, meta.has_padding, k_scale, v_scale, k_bias)
        # With an fp8 cache the reference reads K back from it (biased), never this ``k``.
        return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                   meta.seq_lens, scale, query_lens_cpu=meta.query_lens_cpu,
                                   seq_lens_cpu=meta.seq_lens_cpu, key=k, value=v, sliding_window=sliding_window,
                                   k_scale=k_scale, v_scale=v_scale)


class CpuAttentionBackend:
    """CPU: decode tokens through the C++ paged decode kernel (``kernels/cpu_attention.py``,
    K/V read in place), prefill chunks through the reference's flash SDPA path; the model
    runs the C++ residual-add + RMSNorm, rotary and SiLU-and-mul kernels with it."""

    name = "cpu"
    fused_ops: frozenset[str] = frozenset({"rmsnorm", "rotary", "silu_mul"})

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, sliding_window: int | None = None, kv_quant: KVQuant | None = None) -> torch.Tensor:
        """Same contract as ``TorchAttentionBackend.__call__``; no fp8 cache, so ``kv_quant``
        is always ``None`` (``select_backend`` refuses this backend with fp8)."""
        assert kv_quant is None, "the cpu attention backend has no fp8 KV cache"
        kv_cache_write_ref(k, v, k_cache, v_cache, meta.slot_mapping, meta.has_padding)
        out = torch.empty_like(q)
        index = decode_index(meta)
        if index is not None:
            decode_attention(out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, *index, scale,
                             sliding_window)
        if index is None or index[0].numel() < meta.seq_lens.numel():
            paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                scale, out=out, query_lens_cpu=meta.query_lens_cpu,
                                seq_lens_cpu=meta.seq_lens_cpu, key=k, value=v, skip_decode=True,
                                sliding_window=sliding_window)
        return out


class TritonAttentionBackend:
    """Triton kernels on CUDA: KV write and varlen paged attention, CUDA-graph safe."""

    name = "triton"
    #: Fused Triton ops the model uses with this backend (see ``worker/models/llama.py``):
    #: "rmsnorm" (residual add + RMSNorm), "rotary", "silu_mul". An instance attribute
    #: so that benchmarks can compare subsets (recapture CUDA graphs after a change).
    #: "fp8_out": the attention writes its output quantized for an FP8 ``o_proj``
    #: (``attend_fp8_out``).
    ALL_FUSED_OPS = frozenset({"rmsnorm", "rotary", "silu_mul", "fp8_out"})

    def __init__(self, fused_ops: frozenset[str] | None = None) -> None:
        self.fused_ops = self.ALL_FUSED_OPS if fused_ops is None else frozenset(fused_ops)
        import kernels.paged_attention as attention_kernels
        from kernels.kv_cache_write import kv_cache_write

        self._write = kv_cache_write
        self._kernels = attention_kernels

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, sliding_window: int | None = None, kv_quant: KVQuant | None = None) -> torch.Tensor:
        """Same contract as ``TorchAttentionBackend.__call__``."""
        return self._write_and_attend(self._kernels.paged_attention, q, k, v, k_cache, v_cache, meta, scale,
                                      sliding_window, kv_quant)

    def attend_fp8_out(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, pad_rows_to: int, sliding_window: int | None = None,
                       kv_quant: KVQuant | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``__call__`` with the output quantized for a block-scaled FP8 ``o_proj``
        (``kernels.paged_attention.paged_attention_fp8_out``, one E4M3 group per head row,
        rows padded to a multiple of ``pad_rows_to``): ``(out [T', num_heads * head_dim]
        float8_e4m3fn, scale [T', num_heads] float32, column-major)``."""
        return self._write_and_attend(self._kernels.paged_attention_fp8_out, q, k, v, k_cache, v_cache, meta,
                                      scale, sliding_window, kv_quant, pad_rows_to=pad_rows_to)

    def _write_and_attend(self, attend: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                          sliding_window: int | None, kv_quant: KVQuant | None, **extra: int) -> Any:
        """Write ``k, v`` to the cache with the layer's encoding, then run ``attend`` (one
        of ``kernels/paged_attention.py``'s entry points, looked up at each call) over it;
        prefill chunks read their own keys from ``k, v`` (a cache of q's dtype)."""
        k_scale, v_scale, k_bias = _encoding(kv_quant)
        self._write(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale, k_bias)
        return attend(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
                      max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, sliding_window=sliding_window,
                      k_scale=k_scale, v_scale=v_scale, key=k, value=v, **extra)


def _encoding(kv_quant: KVQuant | None) -> tuple[float, float, torch.Tensor | None]:
    """``(k_scale, v_scale, k_bias)`` of a layer's ``KVQuant``; 1.0, 1.0, ``None`` without one."""
    if kv_quant is None:
        return DEFAULT_KV_SCALE, DEFAULT_KV_SCALE, None
    return kv_quant.k_scale, kv_quant.v_scale, kv_quant.k_bias


AttentionBackend = TorchAttentionBackend | CpuAttentionBackend | TritonAttentionBackend


def select_backend(name: str, device: torch.device, kv_cache_dtype: str = "auto") -> AttentionBackend:
    """``auto`` picks Triton on CUDA when it imports, the CPU kernel on CPU when it builds
    (a C++ compiler and ninja; the first build takes about a minute), else the PyTorch
    reference. With ``kv_cache_dtype="fp8"`` ``auto`` never picks the CPU kernel (it reads
    float32/bfloat16 caches only): the reference dequantizes fp8 in its gather instead.

    Raises:
        ValueError: ``triton`` or ``cpu`` asked for where it cannot run, or ``cpu`` with
            an fp8 cache.
    """
    from kernels import cpu_extension, triton_available

    if kv_cache_dtype == "fp8" and name in ("cpu", "auto") and device.type == "cpu":
        if name == "cpu":
            raise ValueError("the cpu attention backend has no fp8 KV cache; use --attention-backend torch "
                             "(or auto) with --kv-cache-dtype fp8, or --kv-cache-dtype auto")
        log.info("fp8 KV cache on CPU: the torch attention backend (the cpu kernel reads no fp8)")
        return TorchAttentionBackend()
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
