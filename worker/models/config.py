"""The architecture parameters of a Llama-family model, read from a HF ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and constants of one Llama-family model (Llama 2/3, Mistral, Qwen2/2.5/3,
    SmolLM2). ``rope_scaling`` is the HF dict (``rope_type`` ``llama3`` is applied).
    The position limit and EOS ids are not architecture: ``shared.model_source``'s
    ``max_model_len`` and ``eos_token_ids`` read them for every backend and the gateway."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF ``config.json`` (transformers 4.x or 5.x layout).

        Raises:
            ValueError: the architecture is not a Llama-family one.
        """
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})")
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = dict(cfg.get("rope_scaling") or {})
        if not scaling and rope.get("rope_type", "default") not in ("default", None):
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            rope_scaling=tuple(sorted(scaling.items())) if scaling.get("rope_type", scaling.get("type")) == "llama3" else (),
        )

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings and LM head included)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * layer + self.vocab_size * h + head + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one token takes over all layers (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
