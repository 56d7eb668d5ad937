"""The sparse mixture-of-experts feed-forward of Qwen3-MoE (``Qwen3MoeSparseMoeBlock``) and
Mixtral (``MixtralSparseMoeBlock``).

Each token's hidden state goes through a router (a bias-free linear, ``[H] -> [E]``), a
float32 softmax over the ``E`` experts and a top-``K`` pick; with ``norm_topk_prob`` the
``K`` probabilities are renormalised to sum to 1, then cast to the model dtype. The token's
output is the weighted sum of its ``K`` experts' SwiGLU MLPs (``kernels/fused_moe.py``: the
Triton grouped GEMM on CUDA, a loop over experts elsewhere).

Which layers are sparse is ``ModelConfig.is_moe_layer`` (``mlp_only_layers``,
``decoder_sparse_step``); the others keep the dense MLP of ``intermediate_size``.
Mixtral is the same block on every layer with ``norm_topk_prob`` always on: a softmax over
all ``E`` logits, top-2, renormalised, is the softmax over the two picked logits; it has
no shared expert. (transformers' Mixtral keeps the two weights in float32 where this
block casts them to the model dtype, as Qwen3-MoE's does: equal in float32, one bfloat16
rounding apart in bfloat16.)

Weights: the experts' gate/up projections are stacked as ``w13 [E, 2I, H]`` (per expert,
gate rows then up rows) and the down projections as ``w2 [E, H, I]``, with ``I`` =
``moe_intermediate_size``. ``hf_expert_target`` maps a checkpoint's per-expert tensors
(``mlp.experts.{e}.gate_proj.weight``, as Qwen's checkpoints and transformers'
``save_pretrained`` write them) or transformers' stacked ones (``mlp.experts.gate_up_proj``)
onto them; the router's ``mlp.gate.weight`` needs no mapping. Mixtral's checkpoints name
the block ``block_sparse_moe`` and an expert's gate, down and up projections ``w1``,
``w2`` and ``w3`` (``block_sparse_moe.experts.{e}.w1.weight``, router
``block_sparse_moe.gate.weight``): ``hf_moe_name`` renames the block, and
``hf_expert_target`` reads ``w1``/``w3``/``w2`` as gate/up/down.

Sources: Qwen team, "Qwen3 Technical Report" (2025); Jiang et al., "Mixtral of Experts"
(2024); math as transformers' ``modeling_qwen3_moe.py`` and ``modeling_mixtral.py``.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kernels.fused_moe import fused_moe, fused_moe_ref
from worker.models.config import ModelConfig
from worker.models.linear import Linear

# HF name (after "model." and ``hf_moe_name``) of one expert's projection (Qwen's names or
# Mixtral's w1/w3/w2), or of transformers' stacked tensors.
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
                     r"|(gate_up_proj|down_proj))$")
#: Mixtral's expert projections by the names of the others.
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
#: The MoE block's name in Mixtral's checkpoints (transformers 5.x renames it ``mlp``).
_MIXTRAL_BLOCK = ".block_sparse_moe."


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``top_k`` routing of ``router_logits [T, E]``: softmax in float32, top-k, with
    ``renormalize`` the picked probabilities divided by their sum.

    Returns:
        ``(weights, ids)``: ``[T, top_k]`` in ``router_logits``' dtype and int64.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class SparseMoeBlock(nn.Module):
    """Router plus ``num_experts`` SwiGLU experts; maps ``[T, H] -> [T, H]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(h, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``; ``fused``: the Triton kernel where it runs (CUDA),
        else the PyTorch reference. A step being captured into a CUDA graph always takes
        the kernel: the reference reads the chosen experts back to the host."""
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        if fused or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return fused_moe(x, self.w13, self.w2, weights, ids)
        return fused_moe_ref(x, self.w13, self.w2, weights, ids)


def hf_moe_name(name: str) -> str:
    """A checkpoint tensor name with Mixtral's ``block_sparse_moe`` block named ``mlp``, as
    the decoder names every feed-forward (``layers.0.block_sparse_moe.gate.weight`` ->
    ``layers.0.mlp.gate.weight``); other names unchanged."""
    return name.replace(_MIXTRAL_BLOCK, ".mlp.", 1)


def hf_expert_target(cfg: ModelConfig, name: str) -> tuple[str, tuple[int, int] | None] | None:
    """Where checkpoint tensor ``name`` (``model.`` prefix dropped) goes, if it is an
    expert tensor: ``(parameter, rows)``, ``rows`` a ``(start, end)`` range of the
    parameter with its first two dims merged (``w13`` as ``[E * 2I, H]``, ``w2`` as
    ``[E * H, I]``), ``None`` for the whole parameter. ``None`` for any other tensor."""
    m = _EXPERT.match(name)
    if not m:
        return None
    layer, expert, proj, stacked = m.groups()
    proj = _MIXTRAL_PROJ.get(proj, proj)
    if stacked is not None:
        return f"layers.{layer}.mlp.{'w13' if stacked == 'gate_up_proj' else 'w2'}", None
    e, i, h = int(expert), cfg.moe_intermediate_size, cfg.hidden_size
    if proj == "down_proj":
        return f"layers.{layer}.mlp.w2", (e * h, (e + 1) * h)
    start = 2 * e * i + (i if proj == "up_proj" else 0)
    return f"layers.{layer}.mlp.w13", (start, start + i)


def expert_row_ranges(cfg: ModelConfig, param_name: str) -> list[tuple[int, int]]:
    """The row ranges of ``param_name`` that a per-expert checkpoint fills (see
    ``hf_expert_target``); empty for a parameter that is not ``w13`` or ``w2``."""
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if param_name.endswith(".mlp.w13"):
        return [(start, start + i) for start in range(0, 2 * e * i, i)]
    if param_name.endswith(".mlp.w2"):
        return [(k * h, (k + 1) * h) for k in range(e)]
    return []
