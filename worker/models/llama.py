"""One parameterised decoder for every supported family (Llama 2/3, Mistral, Qwen2/2.5/3,
SmolLM2, Gemma 3 text) over the paged KV cache. Where the families differ is decided
in ``worker/models/config.py`` (``ModelConfig`` fields); here each difference is one
switch: q/k norm, sliding-window layers, Gemma's norm offset, sandwich norms, GeGLU,
embedding scale, a second rotary for local layers, logit soft-capping, Qwen3-MoE's
mixture-of-experts feed-forward (``make_mlp``).

Shapes: the model works on a *flat* batch: ``input_ids`` and ``positions`` are
``[num_tokens]`` (the tokens of every sequence in the step, concatenated); hidden
states are ``[num_tokens, hidden_size]``. Q/K/V and gate/up projections are fused into
one matmul each. Rotary embedding is the non-interleaved (rotate-half) form of HF
transformers, with Llama 3 or linear frequency scaling when the config asks for it.

Fused ops: when the backend names them in ``fused_ops`` (Triton on CUDA, C++ on CPU),
the residual-add + RMSNorm, the rotary embedding and SiLU-and-mul run as one kernel
launch each (``kernels/``); otherwise as plain PyTorch ops, which is the oracle. The
fused norm and SiLU-and-mul assume Llama's math: Gemma's norms and GeGLU always run as
plain PyTorch ops.

Source: Touvron et al., "Llama 2" (2023); Llama 3 rope scaling from Meta's
reference ``apply_scaling``; layout of fused projections as in vLLM's ``LlamaModel``;
Gemma 3 as transformers' ``modeling_gemma3.py`` (Gemma Team, "Gemma 3", 2025), which
the oracle tests (``tests/test_model_families.py``) compare with.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused_add_rms_norm import fused_add_rms_norm
from kernels.rotary import apply_rotary, rotary_rows
from kernels.rotary import rotary as rotary_fused
from worker.models.attention import AttentionBackend, AttentionMetadata, KVQuant
from worker.models.config import ModelConfig
from worker.models.fp8 import FP8_BLOCK, block_input_padding
from worker.models.linear import (
    Linear,
    PackedWeight,
    choose_max_rows,
    linear,
    pack_weight,
    packable_layers,
)
from worker.models.moe import SparseMoeBlock

KVCache = tuple[torch.Tensor, torch.Tensor]
RopeTables = tuple[torch.Tensor, torch.Tensor]


class ForwardStopped(Exception):
    """A forward pass stopped between layers because its ``stop`` check said so. The KV
    of its positions is written for the layers before the stop only: the caller must
    not count them as computed (the engine schedules them again)."""


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich, 2019), optionally fused with the residual add. It scales
    by ``offset + weight``: offset 0 (Llama) or 1 (Gemma, whose norm also normalises and
    scales in float32 before casting back, as HF's ``Gemma3RMSNorm``; the fused kernel
    assumes Llama's math, so Gemma's norms run as plain PyTorch ops)."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fused: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(norm(x + residual), x + residual)``; both ``[T, size]``."""
        if fused and x.dim() == 2 and self.offset == 0.0:
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self.norm(x), x

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., size]`` normalised over its last dim, in ``x``'s dtype."""
        if self.offset == 0.0:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        out = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * (self.offset + self.weight.float())
        return out.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` float32 of base ``theta``, with the HF
    ``rope_scaling`` dict applied: ``llama3`` (Meta's ``apply_scaling``) or ``linear``
    (frequencies divided by ``factor``); None or empty: unscaled."""
    d = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
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
    """Rotary position embedding with a precomputed cos/sin table ``[max_pos, head_dim]``
    of the inverse frequencies ``inv_freq [head_dim / 2]`` (``rope_inv_freq``)."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int) -> None:
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
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


def effective_window(cfg: ModelConfig, layer: int, max_positions: int) -> int | None:
    """Layer ``layer``'s sliding window in tokens, or None where it attends to every
    earlier token: full attention, or a window of at least ``max_positions`` (a query at
    position p < max_positions then never sees a key further than the window)."""
    window = cfg.layer_window(layer)
    return window if window is not None and window < max_positions else None


class Attention(nn.Module):
    """Grouped-query self-attention whose K/V live in the paged cache; a sliding layer
    (``effective_window``) passes its window to the backend."""

    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
        self.window = window
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        # fp8 KV cache only: this layer's K bias and K/V scales, set at load by
        # worker/engine/kv_calibration.py (None: scales of 1.0, no bias).
        self.kv_quant: KVQuant | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend,
                rope: RopeTables | None = None) -> torch.Tensor:
        """``x [T, hidden]`` (normalised) -> ``[T, hidden]``."""
        return self.attend(self.qkv_proj(x), positions, rotary, kv_cache, meta, backend, rope)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: Rotary, kv_cache: KVCache,
               meta: AttentionMetadata, backend: AttentionBackend,
               rope: RopeTables | None = None) -> torch.Tensor:
        """The layer past ``qkv_proj``: ``qkv [T, q_size + 2 * kv_size]`` -> ``[T, hidden]``."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.norm(q), self.k_norm.norm(k)
        q, k = rotary(positions, q, k, "rotary" in backend.fused_ops, rope)
        options: dict = {} if self.kv_quant is None else {"kv_quant": self.kv_quant}
        if self.window is not None:
            options["sliding_window"] = self.window
        if "fp8_out" in backend.fused_ops and self.head_dim == FP8_BLOCK and self.o_proj.takes_quantized_input(t):
            # Each head row of the output is one 1x128 group of o_proj's block-scaled input:
            # the attention writes it quantized (no bfloat16 output, no quantizer launch).
            o8, o_scale = backend.attend_fp8_out(q, k, v, kv_cache[0], kv_cache[1], meta,  # type: ignore[union-attr]
                                                 self.scale, block_input_padding(t), **options)
            return self.o_proj.forward_quantized(o8, o_scale, t, q.dtype)
        o = backend(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, **options)  # type: ignore[arg-type]
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    """Gated feed-forward ``down(act(gate(x)) * up(x))`` with gate/up fused: SwiGLU
    (``silu``) or Gemma's GeGLU (``gelu_pytorch_tanh``, plain PyTorch ops)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        return self.from_gate_up(self.gate_up_proj(x), fused)

    def from_gate_up(self, gate_up: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """The block past ``gate_up_proj``: ``gate_up [T, 2 * intermediate]`` -> ``[T, hidden]``."""
        if fused and not self.gelu:
            return self.down_proj.forward_silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


def make_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    """The feed-forward block of layer ``layer``: the one place a family picks its MLP
    (``forward(x [T, hidden], fused: bool) -> [T, hidden]``): Qwen3-MoE's and Mixtral's sparse layers
    take the mixture of experts (``worker/models/moe.py``)."""
    if cfg.is_moe_layer(layer):
        return SparseMoeBlock(cfg)
    return MLP(cfg)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; with ``sandwich_norms`` (Gemma) the attention and MLP
    outputs are normalised too before they join the residual stream."""

    def __init__(self, cfg: ModelConfig, layer: int, max_positions: int) -> None:
        super().__init__()
        eps, offset = cfg.rms_norm_eps, cfg.norm_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.self_attn = Attention(cfg, effective_window(cfg, layer, max_positions))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.mlp = make_mlp(cfg, layer)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: Rotary, kv_cache: KVCache, meta: AttentionMetadata,
                backend: AttentionBackend, rope: RopeTables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous layer's branch output, ``residual``: the stream before it
        (None at layer 0); returns this layer's pair, both ``[T, hidden_size]``."""
        fused = backend.fused_ops
        if "rmsnorm" in fused and not self.sandwich:
            # Each norm with the product that reads it (FP8: its output quantized as computed).
            qkv, residual = self.self_attn.qkv_proj.forward_add_rms_norm(x, residual, self.input_layernorm)
            h = self.self_attn.attend(qkv, positions, rotary, kv_cache, meta, backend, rope)
            if isinstance(self.mlp, MLP):
                gate_up, residual = self.mlp.gate_up_proj.forward_add_rms_norm(h, residual,
                                                                               self.post_attention_layernorm)
                return self.mlp.from_gate_up(gate_up, "silu_mul" in fused), residual
            h, residual = self.post_attention_layernorm(h, residual, True)
            return self.mlp(h, "silu_mul" in fused), residual
        h, residual = self.input_layernorm(x, residual, "rmsnorm" in fused)
        h = self.self_attn(h, positions, rotary, kv_cache, meta, backend, rope)
        if self.sandwich:
            h = self.post_attention_layernorm.norm(h)
            h, residual = self.pre_feedforward_layernorm(h, residual, "rmsnorm" in fused)
            return self.post_feedforward_layernorm.norm(self.mlp(h, "silu_mul" in fused)), residual
        h, residual = self.post_attention_layernorm(h, residual, "rmsnorm" in fused)
        return self.mlp(h, "silu_mul" in fused), residual


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus LM head of every supported family (``ModelConfig``);
    parameter names follow ``weight_loader``'s map."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        # The heads and vocabulary rows this process holds, which size its KV cache: the
        # whole model, or one rank's share under tensor parallelism (worker/parallel/layers.py).
        self.shard_config = cfg
        self.max_positions = max_positions
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, max_positions) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.rotary = Rotary(rope_inv_freq(cfg.head_dim, cfg.rope_theta, dict(cfg.rope_scaling)), max_positions)
        # Gemma 3's local layers rotate with their own base, unscaled.
        self.rotary_local = None if cfg.rope_local_theta is None else Rotary(
            rope_inv_freq(cfg.head_dim, cfg.rope_local_theta), max_positions)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logits_packed: PackedWeight | None = None  # tied LM head, prepacked on CPU
        self.packed_max_rows: int | None = None  # row limit of the packed weights (prepack_for_cpu)

    def _layer_rotary(self, layer: int) -> Rotary:
        if self.rotary_local is not None and self.config.layer_window(layer) is not None:
            return self.rotary_local
        return self.rotary

    def check_backend(self, backend: AttentionBackend) -> None:
        """Refuse, at load, a backend that cannot run this model's attention.

        Raises:
            ValueError: a layer's window is shorter than ``max_positions`` (the engine's
                ``max_model_len``) and ``backend`` takes no ``sliding_window``: it would
                attend past the window and give wrong tokens.
        """
        windows = [layer.self_attn.window for layer in self.layers if layer.self_attn.window is not None]
        if windows and "sliding_window" not in inspect.signature(type(backend).__call__).parameters:
            raise ValueError(
                f"{self.config.model_type}: sliding_window {min(windows)} is shorter than max_model_len "
                f"{self.max_positions}, and the {backend.name} attention backend has no sliding-window "
                f"attention; pass --max-model-len {min(windows)} (or less)")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, backend: AttentionBackend,
                stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden_size]`` after the final norm.

        Args:
            input_ids, positions: ``[num_tokens]`` int64.
            kv_caches: per layer ``(k_cache, v_cache)``, each
                ``[num_blocks, block_size, num_kv_heads, head_dim]``; written in place.
            stop: checked after each layer but the last (eager passes only: a captured
                graph runs whole).

        Raises:
            ForwardStopped: ``stop()`` returned True.
        """
        assert len(kv_caches) == len(self.layers), (len(kv_caches), len(self.layers))
        x, residual = self.run_layers(self.embed(input_ids), None, positions, kv_caches, meta, backend,
                                      0, len(self.layers), stop)
        return self.final_norm(x, residual, backend)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings ``[num_tokens, hidden_size]`` of ``input_ids`` ``[num_tokens]``
        int64 (Gemma: scaled)."""
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:  # Gemma: the scale rounded to the model dtype first, as HF
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype).item()
        return x

    def run_layers(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                   kv_caches: list[KVCache], meta: AttentionMetadata, backend: AttentionBackend,
                   start: int, end: int, stop: Callable[[], bool] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers ``[start, end)`` over ``x`` (the previous layer's output, or ``embed``'s)
        and ``residual`` (None before layer 0), both ``[num_tokens, hidden_size]``;
        returns the pair after layer ``end - 1``. A pass may run in pieces, each a CUDA
        graph (``worker/engine/cuda_graphs.py``: the engine looks at arrivals between
        them). ``stop`` is checked after each layer of the range but its last; arguments
        otherwise as ``forward``.

        Raises:
            ForwardStopped: ``stop()`` returned True.
        """
        fused_rope = "rotary" in backend.fused_ops
        rope = None if fused_rope else self.rotary.cos_sin(positions, x.dtype)
        rope_local = None if fused_rope or self.rotary_local is None else self.rotary_local.cos_sin(positions, x.dtype)
        for i in range(start, end):
            rotary = self._layer_rotary(i)
            tables = rope_local if rotary is self.rotary_local else rope
            x, residual = self.layers[i](x, residual, positions, rotary, kv_caches[i], meta, backend, tables)
            if stop is not None and i + 1 < end and stop():
                raise ForwardStopped(f"stopped after layer {i}")
        return x, residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None, backend: AttentionBackend) -> torch.Tensor:
        """The final norm of the last layer's ``(x, residual)``: hidden states
        ``[num_tokens, hidden_size]``."""
        return self.norm(x, residual, "rmsnorm" in backend.fused_ops)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab_size]`` float32 for hidden states ``[n, hidden_size]``
        (Gemma: soft-capped, ``cap * tanh(logits / cap)``, when the config sets a cap)."""
        if self.lm_head is None:
            logits = linear(hidden, self.embed_tokens.weight, None, self.logits_packed).float()
        else:
            logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

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
