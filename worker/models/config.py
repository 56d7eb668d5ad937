"""The architecture parameters of a decoder-only model, read from a HF ``config.json``.

One parameterised decoder (``worker/models/llama.py``) runs every supported family; this
module is where the families differ: each one's ``config.json`` keys are turned into the
same ``ModelConfig`` fields (``_FAMILIES``), and whatever a family asks for that the
decoder does not implement is refused here, at load, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: ``layer_types`` entries (HF's names).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: Rotary scalings the decoder applies (``llama.rope_inv_freq``); others are refused.
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and constants of one decoder-only model (Llama 2/3, Mistral, Mixtral,
    Qwen2/2.5/3, Qwen3-MoE, SmolLM2, Gemma 3 text).

    ``rope_scaling`` is the HF dict as sorted items (``rope_type`` ``llama3`` or
    ``linear``; empty: none), applied to the global layers' rotary. ``layer_types`` has
    one entry per layer, ``FULL_ATTENTION`` or ``SLIDING_ATTENTION``; a sliding layer's
    query at position p attends to keys at positions k with ``p - k < sliding_window``.
    The Gemma fields: ``hidden_act`` (``silu`` or ``gelu_pytorch_tanh``), ``norm_offset``
    (RMSNorm scales by ``norm_offset + weight``), ``sandwich_norms`` (norms after the
    attention and the MLP too), ``embed_scale`` (embeddings times it), ``attn_scale``
    (softmax scale; None: ``head_dim ** -0.5``), ``rope_local_theta`` (rotary base of the
    sliding layers, unscaled; None: ``rope_theta``), ``final_logit_softcapping``.
    The mixture-of-experts fields (Qwen3-MoE, Mixtral; ``worker/models/moe.py``): ``num_experts``
    (0: a dense model), ``num_experts_per_tok`` (top-k), ``moe_intermediate_size`` (each
    expert's ``I``), ``norm_topk_prob`` (renormalise the top-k router probabilities),
    ``decoder_sparse_step`` and ``mlp_only_layers`` (which layers are sparse:
    ``is_moe_layer``).
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
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    model_type: str = "llama"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    attn_scale: float | None = None
    rope_local_theta: float | None = None
    final_logit_softcapping: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        assert not self.layer_types or len(self.layer_types) == self.num_layers, "one layer type per layer"
        assert set(self.layer_types) <= {FULL_ATTENTION, SLIDING_ATTENTION}, self.layer_types
        assert self.sliding_window is not None or SLIDING_ATTENTION not in self.layer_types
        assert self.hidden_act in ("silu", "gelu_pytorch_tanh"), self.hidden_act
        assert self.num_experts == 0 or 0 < self.num_experts_per_tok <= self.num_experts, "top-k within the experts"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF ``config.json`` (transformers 4.x or 5.x layout).

        Raises:
            ValueError: the ``model_type`` is not supported (the message lists those that
                are), or the config asks for something the decoder does not implement
                (a rope scaling type, attention logit softcapping, Qwen's sliding window).
        """
        model_type = cfg.get("model_type", "llama")
        family = _FAMILIES.get(model_type)
        if family is None:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)})")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        num_layers = int(cfg["num_hidden_layers"])
        theta, scaling = _rope(cfg, model_type)
        fields: dict[str, Any] = {
            "hidden_size": hidden,
            "intermediate_size": int(cfg["intermediate_size"]),
            "num_layers": num_layers,
            "num_heads": num_heads,
            "num_kv_heads": int(cfg.get("num_key_value_heads") or num_heads),
            "head_dim": int(cfg.get("head_dim") or hidden // num_heads),
            "vocab_size": int(cfg["vocab_size"]),
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "rope_theta": theta,
            "rope_scaling": tuple(sorted(scaling.items())),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "attention_bias": bool(cfg.get("attention_bias", False)),
            "mlp_bias": bool(cfg.get("mlp_bias", False)),
            "model_type": model_type,
        }
        fields["o_proj_bias"] = fields["attention_bias"]
        fields.update(family(cfg, fields))
        act = cfg.get("hidden_act") if model_type != "gemma3_text" else fields["hidden_act"]
        if act not in (None, "silu", "gelu_pytorch_tanh"):
            raise ValueError(f"{model_type}: activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
        return cls(**fields)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` in tokens, or None: full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window when every layer slides with it (Mistral), else None (Gemma 3's
        global layers keep every token)."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s feed-forward is the sparse MoE block (as transformers'
        ``Qwen3MoeDecoderLayer``: not in ``mlp_only_layers``, every ``decoder_sparse_step``-th)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def _params(self, active: bool) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        norms = (4 if self.sandwich_norms else 2) * h + (2 * d if self.qk_norm else 0)
        experts = self.num_experts_per_tok if active else self.num_experts
        moe = h * self.num_experts + experts * 3 * h * self.moe_intermediate_size  # router + experts
        layers = sum(attn + norms + (moe if self.is_moe_layer(n) else 3 * h * i) for n in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return layers + self.vocab_size * h + head + h

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings and LM head included; biases left out)."""
        return self._params(active=False)

    @property
    def num_active_params(self) -> int:
        """Parameters one token's decode step reads: ``num_params`` with only
        ``num_experts_per_tok`` experts per MoE layer (the router whole); equal to
        ``num_params`` for a dense model. The embedding table is counted whole."""
        return self._params(active=True)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one token takes over all layers (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _rope(cfg: dict[str, Any], model_type: str) -> tuple[float, dict[str, Any]]:
    """``(rope_theta, scaling dict)`` of the global layers; transformers 5.x nests them in
    ``rope_parameters`` (per layer type for Gemma 3), 4.x has ``rope_theta`` and
    ``rope_scaling`` at the top.

    Raises:
        ValueError: a rope type outside ``SUPPORTED_ROPE_TYPES``.
    """
    rope = dict(cfg.get("rope_parameters") or {})
    if FULL_ATTENTION in rope:
        rope = dict(rope[FULL_ATTENTION] or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    if not scaling and rope.get("rope_type", "default") not in ("default", None):
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{model_type}: rope scaling {rope_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        scaling = {}
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    return theta, scaling


def _llama(cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Llama 2/3 and SmolLM2: the shared decoder as it stands."""
    return {}


def _mistral(cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Mistral: every layer slides when ``sliding_window`` is set (v0.1), none when null."""
    window = cfg.get("sliding_window")
    if window is None:
        return {}
    return {"sliding_window": int(window), "layer_types": (SLIDING_ATTENTION,) * fields["num_layers"]}


def _qwen(cfg: dict[str, Any], fields: dict[str, Any], qk_norm: bool) -> dict[str, Any]:
    """Qwen2/2.5 (Q/K/V biases, none on the output projection) and Qwen3 (q/k RMSNorm)."""
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{cfg.get('model_type')}: use_sliding_window (a window on the layers past "
                         "max_window_layers) is not supported")
    if qk_norm:
        return {"qk_norm": True}
    return {"attention_bias": bool(cfg.get("attention_bias", True)), "o_proj_bias": False}


def _gemma3_text(cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 text: interleaved local (sliding, own rope base, unscaled) and global
    layers, q/k norm, GeGLU, sandwich norms, RMSNorm by ``1 + weight``, embeddings times
    ``sqrt(hidden_size)``, softmax scale ``query_pre_attn_scalar ** -0.5``."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("gemma3_text: attn_logit_softcapping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("gemma3_text: use_bidirectional_attention is not supported (a decoder only)")
    num_layers = fields["num_layers"]
    layer_types = cfg.get("layer_types")
    if not layer_types:  # transformers 4.x: every n-th layer is global
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        layer_types = [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers)]
    rope = cfg.get("rope_parameters") or {}
    local_rope = rope.get(SLIDING_ATTENTION) or {}
    if local_rope.get("rope_type", "default") != "default":
        raise ValueError(f"gemma3_text: rope scaling {local_rope['rope_type']!r} on the local layers is not supported")
    local = local_rope.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0
    softcap = cfg.get("final_logit_softcapping")
    return {
        "qk_norm": True,
        "hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "embed_scale": fields["hidden_size"] ** 0.5,
        "attn_scale": float(cfg.get("query_pre_attn_scalar") or fields["head_dim"]) ** -0.5,
        "rope_local_theta": float(local),
        "sliding_window": int(cfg.get("sliding_window") or 4096),
        "layer_types": tuple(layer_types[:num_layers]),
        "final_logit_softcapping": None if softcap is None else float(softcap),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }


def _qwen3_moe(cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE: Qwen3's attention (q/k norm) and a sparse MoE feed-forward on the
    layers ``is_moe_layer`` picks. transformers 5.x writes ``num_local_experts`` for
    ``num_experts``."""
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    return {
        **_qwen(cfg, fields, qk_norm=True),
        "num_experts": num_experts,
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 0) if num_experts else 0,
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or 0),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(cfg.get("decoder_sparse_step") or 1),
        "mlp_only_layers": tuple(int(n) for n in cfg.get("mlp_only_layers") or ()),
    }


def _mixtral(cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Mixtral: Mistral's attention (every layer slides when ``sliding_window`` is set) and
    a sparse MoE feed-forward on every layer: ``num_local_experts`` SwiGLU experts of
    ``intermediate_size``, top ``num_experts_per_tok``, the picked router probabilities
    always renormalised (transformers' ``MixtralTopKRouter``), no shared expert."""
    num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg["num_experts_per_tok"]) if cfg.get("num_experts_per_tok") is not None else 2
    if not 0 < top_k <= num_experts:
        raise ValueError(f"mixtral: num_experts_per_tok {top_k} must be between 1 and num_local_experts "
                         f"({num_experts})")
    return {
        **_mistral(cfg, fields),
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": fields["intermediate_size"],
        "norm_topk_prob": True,
    }


#: model_type -> the family's fields on top of the shared ones (``ModelConfig.from_hf``).
_FAMILIES: dict[str, Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": lambda cfg, fields: _qwen(cfg, fields, qk_norm=False),
    "qwen3": lambda cfg, fields: _qwen(cfg, fields, qk_norm=True),
    "gemma3_text": _gemma3_text,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)
