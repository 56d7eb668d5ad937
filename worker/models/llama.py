"""One parameterised Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5/3, SmolLM2)
over the paged KV cache.

Shapes: the model works on a *flat* batch: ``input_ids`` and ``positions`` are
``[num_tokens]`` (the tokens of every sequence in the step, concatenated); hidden
states are ``[num_tokens, hidden_size]``. Q/K/V and gate/up projections are fused into
one matmul each. Rotary embedding is the non-interleaved (rotate-half) form of HF
transformers, with Llama 3 frequency scaling when the config asks for it.

Fused ops: when the backend names them in ``fused_ops`` (the Triton backend on CUDA),
the residual-add + RMSNorm, the rotary embedding and SiLU-and-mul run as one Triton
launch each (``kernels/``); otherwise as plain PyTorch ops, which is the oracle.

Source: Touvron et al., "Llama 2" (2023); Llama 3 rope scaling from Meta's
reference ``apply_scaling``; layout of fused projections as in vLLM's ``LlamaModel``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused_add_rms_norm import fused_add_rms_norm
from kernels.rotary import apply_rotary, rotary_rows
from kernels.rotary import rotary as rotary_fused
from kernels.silu_and_mul import silu_and_mul
from worker.models.attention import AttentionBackend, AttentionMetadata
from worker.models.config import ModelConfig
from worker.models.linear import (
    Linear,
    PackedWeight,
    choose_max_rows,
    linear,
    pack_weight,
    packable_layers,
)

KVCache = tuple[torch.Tensor, torch.Tensor]
RopeTables = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich, 2019), optionally fused with the residual add."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fused: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(norm(x + residual), x + residual)``; both ``[T, size]``."""
        if fused and x.dim() == 2:
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps), x


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` float32, with Llama 3 scaling if set."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = dict(cfg.rope_scaling)
    if scaling:
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


class Rotary(nn.Module):
    """Rotary position embedding with a precomputed cos/sin table ``[max_pos, head_dim]``."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """``(cos, sin)``, each ``[T, 1, D]`` in ``dtype``, of token positions ``[T]``:
        looked up once per step and shared by every layer."""
        return rotary_rows(positions, self.cos, self.sin, dtype)  # type: ignore[arg-type]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, fused: bool = False,
                tables: RopeTables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, H, D]`` and ``k [T, KVH, D]`` by their token positions ``[T]``
        (``tables``: this step's ``cos_sin(positions)``, when the caller has it)."""
        if fused:
            return rotary_fused(positions, q, k, self.cos, self.sin)  # type: ignore[arg-type]
        return apply_rotary(q, k, *(tables if tables is not None else self.cos_sin(positions, q.dtype)))


class Attention(nn.Module):
    """Grouped-query self-attention whose K/V live in the paged cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend,
                rope: RopeTables | None = None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        q, k = rotary(positions, q, k, "rotary" in backend.fused_ops, rope)
        o = backend(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` with gate/up fused."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused:
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: Rotary, kv_cache: KVCache, meta: AttentionMetadata,
                backend: AttentionBackend, rope: RopeTables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        fused = backend.fused_ops
        h, residual = self.input_layernorm(x, residual, "rmsnorm" in fused)
        h = self.self_attn(h, positions, rotary, kv_cache, meta, backend, rope)
        h, residual = self.post_attention_layernorm(h, residual, "rmsnorm" in fused)
        return self.mlp(h, "silu_mul" in fused), residual


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus LM head; parameter names follow ``weight_loader``'s map."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg, max_positions)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logits_packed: PackedWeight | None = None  # tied LM head, prepacked on CPU
        self.packed_max_rows: int | None = None  # row limit of the packed weights (prepack_for_cpu)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden_size]`` after the final norm.

        Args:
            input_ids, positions: ``[num_tokens]`` int64.
            kv_caches: per layer ``(k_cache, v_cache)``, each
                ``[num_blocks, block_size, num_kv_heads, head_dim]``; written in place.
        """
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        rope = None if "rotary" in backend.fused_ops else self.rotary.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rotary, kv_cache, meta, backend, rope)
        return self.norm(x, residual, "rmsnorm" in backend.fused_ops)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab_size]`` float32 for hidden states ``[n, hidden_size]``."""
        if self.lm_head is None:
            return linear(hidden, self.embed_tokens.weight, None, self.logits_packed).float()
        return self.lm_head(hidden).float()

    def prepack_for_cpu(self, max_rows: int | None = None) -> int:
        """Prepack the linear weights (and tied LM head) for oneDNN on CPU, used for steps
        of up to ``max_rows`` rows (default: chosen by timing, ``linear.choose_max_rows``);
        see ``worker/models/linear.py``. Returns how many weights were packed: 0 where the
        packed path does not work in the model's dtype on this CPU (``packed_linear_error``)."""
        layers = packable_layers(self)
        if not layers:
            return 0
        if max_rows is None:
            max_rows = choose_max_rows(max((m.weight for m in layers), key=torch.Tensor.numel))
        for m in layers:
            m.prepack(max_rows)
        self.packed_max_rows = max_rows
        if self.lm_head is None:
            self.logits_packed = pack_weight(self.embed_tokens.weight, max_rows)
        return len(layers) + (self.lm_head is None)
