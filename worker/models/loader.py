"""Build a ``LlamaForCausalLM`` and fill its weights from a HF folder or at random."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from worker.models.config import ModelConfig
from worker.models.linear import UNLIMITED_ROWS, packed_linear_error
from worker.models.llama import LlamaForCausalLM

# HF name (after the "model." prefix is dropped) -> (our parameter, shard index) where
# shard index says which slice of a fused parameter it fills (None: the whole tensor).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
log = logging.getLogger(__name__)
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")


class WeightLoadError(RuntimeError):
    """A checkpoint tensor has no home in the model, or a parameter stayed unset."""


def _shard_bounds(cfg: ModelConfig, fused: str, index: int) -> tuple[int, int]:
    if fused.endswith("qkv_proj"):
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][index]
    i = cfg.intermediate_size
    return [(0, i), (i, 2 * i)][index]


def load_hf_weights(model: LlamaForCausalLM, folder: Path) -> None:
    """Copy every ``*.safetensors`` tensor of ``folder`` into ``model`` (dtype cast).

    Raises:
        WeightLoadError: unknown tensor name, shape mismatch, or missing parameters.
    """
    cfg = model.config
    params = dict(model.named_parameters())
    filled: set[str] = set()
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors in {folder}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys() but is not iterable)
                if "rotary_emb" in name:
                    continue
                target, bounds = _map_name(cfg, name.removeprefix("model."))
                if target is None:
                    continue
                if target not in params:
                    raise WeightLoadError(f"{file.name}: tensor {name} maps to unknown parameter {target}")
                tensor = f.get_tensor(name)
                param = params[target]
                dest = param.data if bounds is None else param.data[bounds[0]:bounds[1]]
                if dest.shape != tensor.shape:
                    raise WeightLoadError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
                dest.copy_(tensor.to(dest.dtype))
                filled.add(f"{target}#{bounds}")
    expected = set()
    for pname in params:
        base = pname.rsplit(".", 1)[0]
        n = 3 if base.endswith("qkv_proj") else 2 if base.endswith("gate_up_proj") else 0
        if n:
            expected.update(f"{pname}#{_shard_bounds(cfg, base, i)}" for i in range(n))
        else:
            expected.add(f"{pname}#None")
    missing = expected - filled
    if missing:
        raise WeightLoadError(f"parameters not in the checkpoint: {sorted(missing)[:5]} ...")


def _map_name(cfg: ModelConfig, name: str) -> tuple[str | None, tuple[int, int] | None]:
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None, None
    m = _LAYER.match(name)
    if not m:
        return name, None
    layer, module, kind = m.groups()
    if module in _FUSED:
        fused, index = _FUSED[module]
        return f"layers.{layer}.{fused}.{kind}", _shard_bounds(cfg, fused, index)
    return f"layers.{layer}.{module}.{kind}", None


def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights with the scale of trained ones (normal, std 0.02; norms 1)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)


def _prepack_and_log(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """Prepack the CPU linears where oneDNN's packed path works in ``dtype`` and log, in one
    line, which path the linears take and why (``worker/models/linear.py``)."""
    n = model.prepack_for_cpu()
    if n:
        why = ("oneDNN beat MKL on a prefill-sized product here" if model.packed_max_rows == UNLIMITED_ROWS
               else "MKL won the prefill-sized product here, so larger steps use F.linear")
        rows = "all" if model.packed_max_rows == UNLIMITED_ROWS else f"up to {model.packed_max_rows}"
        log.info("CPU linears in %s: %d weights prepacked for oneDNN, used for steps of %s rows (%s)",
                 dtype, n, rows, why)
    else:
        log.info("CPU linears in %s: F.linear, since the prepacked oneDNN path does not work here: %s",
                 dtype, packed_linear_error(dtype))


def build_model(cfg: ModelConfig, folder: Path | None, dummy: bool, dtype: torch.dtype,
                device: torch.device, max_positions: int, seed: int = 0) -> LlamaForCausalLM:
    """Create the model on ``device`` in ``dtype`` and load its weights.

    Raises:
        WeightLoadError: see ``load_hf_weights``.
    """
    with torch.device(device):
        model = LlamaForCausalLM(cfg, max_positions)
    # Rotary tables stay float32; everything else takes the model dtype.
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            p.data = p.data.to(dtype)
    if dummy or folder is None:
        init_dummy_weights(model, seed)
    else:
        load_hf_weights(model, folder)
    if device.type == "cpu":
        _prepack_and_log(model, dtype)
    return model.eval()
