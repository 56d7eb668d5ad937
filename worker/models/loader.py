"""Build the decoder (``LlamaForCausalLM``, every family) and fill its weights from a HF
folder or at random."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from worker.models.config import ModelConfig
from worker.models.fp8 import FP8_DTYPE, FP8_SCHEMES, quantize_rows, scaled_mm_fits
from worker.models.linear import UNLIMITED_ROWS, Linear, packed_linear_error
from worker.models.llama import MLP, LlamaForCausalLM, RMSNorm
from worker.models.moe import expert_row_ranges, hf_expert_target, hf_moe_name
from worker.parallel import group as tp_group
from worker.parallel.fp8_shards import check_fp8_shards
from worker.parallel.layers import ZERO, ShardSpec, TensorParallelLM, shard_spec, tensor_slice

if TYPE_CHECKING:
    import torch.distributed as dist

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
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias|weight_scale)$")
#: Tensors of FP8 checkpoints that have no home: static activation scales (activations
#: are scaled per token, ``worker/models/fp8.py``).
_IGNORED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")


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

    Under tensor parallelism (``model.spec``, ``worker/parallel/layers.py``) each tensor
    is read only in this rank's slice (``safe_open(...).get_slice``).

    Raises:
        WeightLoadError: unknown tensor name, shape mismatch, or missing parameters.
    """
    cfg = model.shard_config
    spec = getattr(model, "spec", None)
    params = dict(model.named_parameters())
    filled: set[str] = set()
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors in {folder}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys() but is not iterable)
                if "rotary_emb" in name or name.endswith(_IGNORED_SUFFIXES):
                    continue
                target, bounds = _map_name(cfg, name.removeprefix("model."))
                if target is None:
                    continue
                if target not in params:
                    raise WeightLoadError(f"{file.name}: tensor {name} maps to unknown parameter {target}")
                param = params[target]
                # Bounds of a stacked-experts parameter ([E, rows, cols]) index its first two dims merged.
                rows = param.data.flatten(0, 1) if param.dim() == 3 else param.data
                dest = param.data if bounds is None else rows[bounds[0]:bounds[1]]
                tensor = f.get_tensor(name) if spec is None else _read_shard(f, name, spec)
                if tensor is None:  # a row-parallel bias on a rank > 0: zero, so the all-reduce adds it once
                    dest.zero_()
                    filled.add(f"{target}#{bounds}")
                    continue
                if spec is not None and target.endswith(("embed_tokens.weight", "lm_head.weight")) and \
                        tensor.shape[0] < dest.shape[0]:  # the last vocab shard's padding rows
                    dest[tensor.shape[0]:].zero_()
                    dest = dest[:tensor.shape[0]]
                if target.endswith(".weight_scale"):  # FP8: per-tensor ([] or [1]) or per-channel
                    tensor = tensor.float().reshape(-1).expand(dest.shape) if tensor.numel() == 1 \
                        else tensor.float().reshape(-1)
                elif dest.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:  # a layer the checkpoint kept
                    tensor, scale = _quantize_kept(f, name, spec, tensor)
                    scales = params[f"{target}_scale"].data
                    scales[slice(*bounds) if bounds else slice(None)] = scale.view(-1)
                    filled.add(f"{target}_scale#{bounds}")
                elif tensor.dtype == FP8_DTYPE and dest.dtype != FP8_DTYPE:
                    raise WeightLoadError(f"{name} is saved in FP8 but {target} is kept in {dest.dtype} "
                                          "(FP8 weights are supported for the attention and dense MLP projections)")
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
        elif experts := expert_row_ranges(cfg, pname):
            expected.update(f"{pname}#{r}" for r in experts)
        else:
            expected.add(f"{pname}#None")
    # A parameter filled whole (e.g. transformers' stacked experts) needs none of its shards.
    missing = {key for key in expected - filled if f"{key.split('#')[0]}#None" not in filled}
    if missing:
        raise WeightLoadError(f"parameters not in the checkpoint: {sorted(missing)[:5]} ...")


def _read_shard(f: Any, name: str, spec: ShardSpec) -> torch.Tensor | None:
    """Rank ``spec.rank``'s part of checkpoint tensor ``name`` (``layers.tensor_slice``),
    read alone from the file; None: this rank keeps zeros. A per-tensor FP8 scale (one
    value, ``[]`` or ``[1]``) is read whole: it scales every rank's slice."""
    part = tensor_slice(spec, name.removeprefix("model."))
    if part is None:
        return f.get_tensor(name)
    if part == ZERO:
        return None
    dim, start, stop = part  # type: ignore[misc]
    sl = f.get_slice(name)
    if name.endswith(".weight_scale") and math.prod(sl.get_shape()) == 1:
        return f.get_tensor(name)
    return sl[start:stop] if dim == 0 else sl[:, start:stop]


def _quantize_kept(f: Any, name: str, spec: ShardSpec | None, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` (this rank's slice of checkpoint weight ``name``, which the FP8 checkpoint
    left unquantized) in E4M3 with one scale per row, ``([rows, cols] E4M3, [rows, 1]
    float32)``, as TP=1 quantizes it: each scale from the row's amax over the full weight
    (``quantize_rows``). A row-parallel slice has only some of each row's columns, so
    there the full weight is read, quantized, and sliced."""
    part = None if spec is None else tensor_slice(spec, name.removeprefix("model."))
    if not isinstance(part, tuple) or part[0] == 0:
        return quantize_rows(tensor)
    _, start, stop = part
    q, scale = quantize_rows(f.get_tensor(name))
    return q[:, start:stop].contiguous(), scale


def _map_name(cfg: ModelConfig, name: str) -> tuple[str | None, tuple[int, int] | None]:
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None, None
    name = hf_moe_name(name)
    expert = hf_expert_target(cfg, name)
    if expert is not None:
        return expert
    m = _LAYER.match(name)
    if not m:
        return name, None
    layer, module, kind = m.groups()
    if module in _FUSED:
        fused, index = _FUSED[module]
        return f"layers.{layer}.{fused}.{kind}", _shard_bounds(cfg, fused, index)
    return f"layers.{layer}.{module}.{kind}", None


def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights with the scale of trained ones (normal, std 0.02; norms scale by 1,
    which is a weight of 0 for Gemma's ``1 + weight`` norms)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, RMSNorm):
                param.data.fill_(1.0 - module.offset)
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


def fp8_linears(model: LlamaForCausalLM) -> list[Linear]:
    """The linears ``--quantization fp8`` stores in FP8: each layer's ``qkv_proj`` and
    ``o_proj`` and a dense MLP's ``gate_up_proj`` and ``down_proj``, where their shapes fit
    ``torch._scaled_mm`` (``fp8.scaled_mm_fits``). The embeddings, LM head, norms, the MoE
    router and experts stay in the model dtype (``worker/models/fp8.py``)."""
    out = []
    for layer in model.layers:
        mods = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
        if isinstance(layer.mlp, MLP):
            mods += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
        out += [m for m in mods if scaled_mm_fits(m.out_features, m.in_features)]
    return out


def fp8_layout(prequantized: bool, dummy: bool) -> str:
    """The layout (``fp8.FP8_SCHEMES``) FP8 weights load in: a checkpoint saved in FP8
    (``prequantized``) keeps its per-channel scales; weights quantized at load (from a
    bfloat16/float32 checkpoint, or ``dummy`` ones) take 128x128 blocks."""
    return "channel" if prequantized and not dummy else FP8_SCHEMES[0]


def build_model(cfg: ModelConfig, folder: Path | None, dummy: bool, dtype: torch.dtype,
                device: torch.device, max_positions: int, seed: int = 0, quantization: str = "none",
                prequantized: bool = False) -> LlamaForCausalLM:
    """Create the model on ``device`` in ``dtype``, load its weights (``load_model``) and
    ready it to serve: off CUDA, FP8 weights are dequantized back into ``dtype`` (the
    reference path, ``Linear.dequantize_fp8``) and the CPU linears prepacked.

    In a tensor-parallel group (``worker/parallel/group.py``) it builds this rank's share
    (``worker/parallel/layers.py``).

    Raises:
        WeightLoadError: see ``load_hf_weights``.
        ValueError: under tensor parallelism, a config that does not split
            (``layers.shard_spec``), or FP8 weights whose scales do not split with them
            (``fp8_shards.check_fp8_shards``).
    """
    tp = tp_group.current()
    spec = None if tp is None else shard_spec(cfg, tp.rank, tp.world_size)
    model = load_model(cfg, folder, dummy, dtype, device, max_positions, seed, quantization, prequantized,
                       spec, None if tp is None else tp.group)
    if quantization == "fp8":
        linears = fp8_linears(model)
        if device.type != "cuda":
            for m in linears:
                m.dequantize_fp8(dtype)
        log.info("FP8 weights: %d linears%s", len(linears),
                 "" if device.type == "cuda" else f" (reference: dequantized into {dtype}, inputs rounded through e4m3)")
    if device.type == "cpu":
        _prepack_and_log(model, dtype)
    return model.eval()


def load_model(cfg: ModelConfig, folder: Path | None, dummy: bool, dtype: torch.dtype, device: torch.device,
               max_positions: int, seed: int = 0, quantization: str = "none", prequantized: bool = False,
               spec: ShardSpec | None = None, group: dist.ProcessGroup | None = None) -> LlamaForCausalLM:
    """The model of ``cfg`` on ``device`` with its weights: all of it, or with ``spec`` the
    share of rank ``spec.rank`` (``TensorParallelLM`` over process group ``group``),
    sharded at load, or dummy weights drawn per rank with seed ``seed + rank``.

    ``quantization`` ``"fp8"`` stores ``fp8_linears`` in FP8 (``worker/models/fp8.py``),
    on any device (``build_model`` turns them into the CPU reference): quantized after
    loading in 128x128 blocks, or, with ``prequantized`` (the checkpoint is saved in FP8,
    ``fp8.resolve_quantization``), loaded as they are with per-channel scales. A rank's
    FP8 weight and scales are its slice of TP=1's (``worker/parallel/fp8_shards.py``).

    Raises:
        WeightLoadError: see ``load_hf_weights``.
        ValueError: with ``spec``, FP8 scales that do not split with their weights
            (``fp8_shards.check_fp8_shards``).
    """
    fp8 = quantization == "fp8"
    layout = fp8_layout(prequantized, dummy or folder is None)
    load_fp8 = fp8 and layout == "channel"
    if spec is not None and fp8:
        check_fp8_shards(cfg, spec.world_size, layout)
    # Parameters are created in ``dtype`` (float32 first would need 4 bytes a parameter:
    # 122 GB for Qwen3-30B-A3B); the rotary tables name float32 themselves.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, max_positions) if spec is None else \
                TensorParallelLM(spec, max_positions, group)
    finally:
        torch.set_default_dtype(default_dtype)
    # Rotary tables stay float32; everything else takes the model dtype.
    for module in model.modules():
        for p in module.parameters(recurse=False):
            p.data = p.data.to(dtype)
    if load_fp8:  # FP8 parameters first, so that the checkpoint's FP8 tensors land unchanged
        for m in fp8_linears(model):
            m.to_fp8(layout)  # the per-tensor / per-channel scales of FP8 checkpoints
    if dummy or folder is None:
        init_dummy_weights(model, seed if spec is None else seed + spec.rank)
        if isinstance(model, TensorParallelLM) and model.spec.rank > 0:
            for bias in model.row_parallel_biases():
                bias.data.zero_()
    else:
        load_hf_weights(model, folder)
    if fp8 and not load_fp8:
        for m in fp8_linears(model):
            m.to_fp8(layout)
    return model
