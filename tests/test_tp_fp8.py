"""FP8 weights under tensor parallelism (``worker/parallel/fp8_shards.py``, the loader's
sliced reads): each rank holds its slice of TP=1's FP8 weights and scales.

A tiny Llama whose sharded sizes are multiples of 128 (hidden 256, MLP 512, 4 heads and 2
KV heads of head_dim 128: over 2 ranks 256 query rows, 128 of k, of v and a rank's MLP;
over 4 one head, a replicated KV head, 128 MLP rows) is saved as a float32 checkpoint and
as an FP8 one (per-channel and per-tensor scales, a column- and a row-parallel projection
left unquantized, as vLLM writes them). Without processes, each rank's shard is loaded as
a worker loads it (``loader.load_model`` with the rank's ``ShardSpec``): its weights and
scales, dequantized and put side by side, are TP=1's dequantized weights bit for bit, for
128x128 block scales (quantized at load) and per-channel ones (from the checkpoint), in
the column-parallel (qkv_proj, gate_up_proj) and the row-parallel (o_proj, down_proj)
projections, at TP=2 and TP=4. A model whose KV rows do not split on blocks (head_dim 64)
is refused with block scales and works with per-channel ones. Llama-3-70B's shapes split
on blocks at TP=2, 4 and 8 (the plan only, no weights).

The slow tests run a TP=2 engine over gloo (this process rank 0, one follower process, as
``inferq worker --tensor-parallel-size 2`` starts them) against TP=1: with block scales
the same greedy tokens; from the FP8 checkpoint, first-step logits that differ from TP=1's
by less than FP8 itself changes them (a row-parallel rank rounds its inputs per token
over its own columns). The ``cuda`` test runs the block case on 2 GPUs over NCCL.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.model_source import DUMMY_CONFIGS
from shared.sampling import SamplingParams
from tests.test_tensor_parallel import tp_engine
from worker.models.config import ModelConfig
from worker.models.fp8 import FP8_BLOCK, FP8_DTYPE, FP8_MAX, block_mm_fits, dequantize_weight, quantize_rows
from worker.models.linear import Linear
from worker.models.llama import LlamaForCausalLM
from worker.models.loader import fp8_linears, load_model
from worker.parallel.fp8_shards import (
    PROJECTIONS,
    ShardCut,
    check_fp8_shards,
    fp8_shard_error,
    fp8_tp_sizes,
    projection_shape,
    shard_cuts,
)
from worker.parallel.layers import ShardSpec, shard_spec, tensor_slice

CPU = torch.device("cpu")
#: Sharded sizes multiples of 128 at TP=2 and TP=4 (module docstring); the attention's biases on.
ALIGNED = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 256,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "attention_bias": True, "tie_word_embeddings": False,
           "max_position_embeddings": 512, "eos_token_id": 0}
#: head_dim 64: 128 KV rows a projection, 64 a rank at TP=2 (and 64 query rows at TP=4).
UNALIGNED = ALIGNED | {"head_dim": 64}
#: What the FP8 checkpoint keeps unquantized (a column- and a row-parallel projection).
KEPT = ("model.layers.0.mlp.gate_proj", "model.layers.1.mlp.down_proj")
#: Saved with one scale for the whole tensor: k (a part of the fused qkv_proj) and an o_proj.
PER_TENSOR = ("model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.o_proj")


def write_checkpoint(folder: Path, config: dict, seed: int = 0) -> Path:
    """A HF folder of random float32 weights (normal, std 0.05) for ``config``."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv, v = config["num_attention_heads"] * d, config["num_key_value_heads"] * d, config["vocab_size"]

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.05

    t = {"model.embed_tokens.weight": r(v, h), "lm_head.weight": r(v, h), "model.norm.weight": 1 + 0.1 * r(h)}
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        for name, shape in shapes.items():
            t[f"{p}{name}.weight"] = r(*shape)
            if name.startswith("self_attn"):  # Llama's attention_bias: o_proj's too (rank 0's alone under TP)
                t[f"{p}{name}.bias"] = 0.1 * r(shape[0])
        t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * r(h), 1 + 0.1 * r(h)
    save_file(t, str(folder / "model.safetensors"))
    return folder


def write_fp8_checkpoint(source: Path, folder: Path) -> Path:
    """``source`` saved in FP8 as vLLM writes it: per-channel scales ``[N, 1]``,
    ``PER_TENSOR`` with a scale ``[]``, ``KEPT`` left in float32 (``ignored_layers``),
    static ``input_scale``s beside."""
    tensors = {}
    for name, w in load_file(str(source / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if not name.endswith("proj.weight") or module in KEPT:
            tensors[name] = w
            continue
        if module in PER_TENSOR:
            scale = w.abs().amax() / FP8_MAX
            q = (w / scale).to(FP8_DTYPE)
        else:
            q, scale = quantize_rows(w)
        tensors[name], tensors[f"{module}.weight_scale"] = q, scale
        tensors[f"{module}.input_scale"] = torch.tensor(1.0)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "ignored_layers": list(KEPT)}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def _cfg(folder: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))


def load(folder: Path, spec: ShardSpec | None = None) -> LlamaForCausalLM:
    """The FP8 model of ``folder`` as a worker loads it (``load_model``: quantized at load
    in 128x128 blocks, or a checkpoint saved in FP8 with its scales), its FP8 weights kept
    stored; rank ``spec.rank``'s share with ``spec``."""
    prequantized = "quantization_config" in json.loads((folder / "config.json").read_text())
    return load_model(_cfg(folder), folder, False, torch.float32, CPU, 64, quantization="fp8",
                      prequantized=prequantized, spec=spec)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``aligned`` and ``unaligned`` (float32), and each saved in FP8 (``*-fp8``)."""
    root = tmp_path_factory.mktemp("tp_fp8")
    out = {}
    for seed, (name, config) in enumerate((("aligned", ALIGNED), ("unaligned", UNALIGNED))):
        out[name] = write_checkpoint(root / name, config, seed)
        out[f"{name}-fp8"] = write_fp8_checkpoint(out[name], root / f"{name}-fp8")
    return out


def _projection(model: LlamaForCausalLM, layer: int, projection: str) -> Linear:
    block = model.layers[layer]
    return getattr(block.self_attn if projection in ("qkv_proj", "o_proj") else block.mlp, projection)


def _scale_slice(scale: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """The scales of rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of a
    weight: blocks ``start / 128`` on for block scales; per-row scales of rows only."""
    if scale.dim() == 2:
        assert start % FP8_BLOCK == 0
        block = slice(start // FP8_BLOCK, -(-stop // FP8_BLOCK))
        return scale[block] if dim == 0 else scale[:, block]
    return scale[start:stop] if dim == 0 else scale


def assert_shards_are_tp1(full: LlamaForCausalLM, shards: list[LlamaForCausalLM], block_scales: bool) -> None:
    """Every FP8 projection of every shard, dequantized, put back where its rows (or
    columns) sit in the full weight: TP=1's dequantized weight bit for bit, every row and
    column covered; each shard's E4M3 codes and scales are the slices of TP=1's."""
    cfg = full.config
    for layer in range(cfg.num_layers):
        for projection, (dim, _) in PROJECTIONS.items():
            whole = _projection(full, layer, projection)
            assert whole.is_fp8 and whole.weight_scale.dim() == (2 if block_scales else 1)
            expected = dequantize_weight(whole.weight, whole.weight_scale)
            rebuilt = torch.full_like(expected, float("nan"))
            for shard in shards:
                local = _projection(shard, layer, projection)
                assert local.is_fp8 and local.weight_scale.dim() == whole.weight_scale.dim()
                deq = dequantize_weight(local.weight, local.weight_scale)
                cuts = [c for c in shard_cuts(shard.spec) if c.projection == projection]
                full_at = local_at = 0  # the part's first row/column in the full and in the shard's weight
                for cut in cuts:
                    src = slice(local_at, local_at + cut.size)
                    dst = slice(full_at + cut.start, full_at + cut.stop)
                    if dim == 0:
                        rebuilt[dst] = deq[src]
                        codes, whole_codes = local.weight[src], whole.weight[dst]
                    else:
                        rebuilt[:, dst] = deq[:, src]
                        codes, whole_codes = local.weight[:, src], whole.weight[:, dst]
                    assert torch.equal(codes.view(torch.uint8), whole_codes.view(torch.uint8)), (projection, cut)
                    assert torch.equal(_scale_slice(local.weight_scale, dim, src.start, src.stop),
                                       _scale_slice(whole.weight_scale, dim, dst.start, dst.stop)), (projection, cut)
                    full_at, local_at = full_at + cut.full_size, local_at + cut.size
                assert local_at == local.weight.shape[dim] and full_at == whole.weight.shape[dim]
            assert torch.equal(rebuilt, expected), (layer, projection)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("checkpoint", ["aligned", "aligned-fp8", "unaligned-fp8"])
def test_shards_dequantize_to_tp1_weights(folders: dict[str, Path], checkpoint: str, world_size: int) -> None:
    """``aligned``: block scales, quantized at load by each rank from its slice;
    ``*-fp8``: per-channel and per-tensor scales read from the checkpoint, and the
    projections it kept quantized per row at load (the row-parallel one from its full
    rows); per-channel scales split anywhere, head_dim 64 too."""
    folder = folders[checkpoint]
    full = load(folder)
    shards = [load(folder, shard_spec(full.config, rank, world_size)) for rank in range(world_size)]
    assert len(fp8_linears(full)) == 4 * full.config.num_layers
    assert_shards_are_tp1(full, shards, block_scales=checkpoint == "aligned")


def test_scales_are_read_where_the_rows_split() -> None:
    """A column-parallel rank reads the per-row scales of its rows, a row-parallel one all
    of them (the loader reads one-value per-tensor scales whole)."""
    spec = shard_spec(ModelConfig.from_hf(ALIGNED), 1, 2)
    assert tensor_slice(spec, "layers.0.self_attn.k_proj.weight_scale") == (0, 128, 256)
    assert tensor_slice(spec, "layers.0.mlp.up_proj.weight_scale") == (0, 256, 512)
    assert tensor_slice(spec, "layers.0.self_attn.o_proj.weight_scale") is None
    assert tensor_slice(spec, "layers.0.mlp.down_proj.weight_scale") is None
    assert tensor_slice(spec, "layers.0.mlp.down_proj.weight") == (1, 256, 512)


def test_block_scales_that_do_not_split_are_refused(folders: dict[str, Path]) -> None:
    """head_dim 64: 128 k rows split 64 to a rank at TP=2. Block scales are refused at
    load with the projection, the sizes and the TP sizes that work; per-channel ones load
    (``test_shards_dequantize_to_tp1_weights``)."""
    cfg = ModelConfig.from_hf(UNALIGNED)
    message = ("--quantization fp8 (block scales) with --tensor-parallel-size 2: qkv_proj's k rows (128 in all) "
               "split 64 to a rank, not a multiple of the 128x128 FP8 weight block; tensor parallel sizes that "
               "work for this model: 1")
    with pytest.raises(ValueError) as refused:
        load(folders["unaligned"], shard_spec(cfg, 0, 2))
    assert str(refused.value) == message
    assert "\n" not in message
    assert fp8_tp_sizes(cfg, "channel") == [1, 2, 4]
    assert fp8_tp_sizes(ModelConfig.from_hf(ALIGNED), "block") == [1, 2, 4]
    # An MLP that splits off blocks (384 rows: 192 a rank) is named too.
    mlp = ModelConfig.from_hf(ALIGNED | {"intermediate_size": 384})
    assert fp8_shard_error(mlp, 2, "block") == ("gate_up_proj's gate rows (384 in all) split 192 to a rank, not a "
                                                "multiple of the 128x128 FP8 weight block")
    # A shard too narrow for the FP8 products (8 MLP columns a rank) would stay unquantized.
    narrow = ModelConfig.from_hf(UNALIGNED | {"intermediate_size": 32})
    assert fp8_shard_error(narrow, 4, "channel") == ("down_proj of a rank is [256, 8], not multiples of 16 as the "
                                                     "FP8 products need (torch._scaled_mm), so the rank would keep "
                                                     "it unquantized")


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_llama3_70b_splits_on_fp8_blocks(world_size: int) -> None:
    """Llama-3-70B (hidden 8192, MLP 28672, 64 heads, 8 KV heads, head_dim 128) with
    128x128 block scales: every rank's slice of every part starts and ends on a block,
    the slices tile each part (split KV heads; at TP=8 one each), and each shard's
    projections have dims multiples of 128, so prefill runs the block-scaled
    ``torch._scaled_mm`` rather than dequantizing."""
    cfg = ModelConfig.from_hf(DUMMY_CONFIGS["Llama-3-70B"])
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        8192, 28672, 64, 8, 128)
    check_fp8_shards(cfg, world_size, "block")
    covered: dict[tuple[str, str], list[ShardCut]] = {}
    for rank in range(world_size):
        spec = shard_spec(cfg, rank, world_size)
        for cut in shard_cuts(spec):
            assert cut.start % FP8_BLOCK == 0 and cut.stop % FP8_BLOCK == 0, cut
            covered.setdefault((cut.projection, cut.part), []).append(cut)
        for projection in PROJECTIONS:
            assert block_mm_fits(*projection_shape(spec.config, projection)), (projection, world_size)
    assert len(covered) == 7  # q, k, v, o's columns, gate, up, down's columns
    for cuts in covered.values():
        cuts.sort(key=lambda c: c.start)
        assert cuts[0].start == 0 and cuts[-1].stop == cuts[0].full_size
        assert all(a.stop == b.start for a, b in itertools.pairwise(cuts))
    assert projection_shape(shard_spec(cfg, 0, 2).config, "qkv_proj") == (4096 + 2 * 512, 8192)


# -- engines: TP=2 over gloo against TP=1 ---------------------------------------------

ENGINE = {"dtype": "float32", "max_num_seqs": 4, "cpu_threads": 1, "max_model_len": 256}
PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 140)), [7, 7, 7]]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def generate(llm, prompts: list[list[int]] = PROMPTS) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of ``prompts`` and every logits tensor rank 0's LM head returned
    (float32, on the CPU)."""
    logits: list[torch.Tensor] = []
    model = llm.engine.runner.model
    compute = model.compute_logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        out = compute(hidden)  # once: under TP each call is a collective of every rank
        logits.append(out.float().cpu())
        return out

    model.compute_logits = record
    try:
        outs = llm.generate(prompts, PARAMS)
    finally:
        del model.compute_logits
    return [o.token_ids for o in outs], logits


def _tp_settings(dtype: str = "float32", quantization: str = "fp8", **settings: object) -> dict:
    """``tp_engine``'s settings of this module's TP=2 engines: ``--quantization
    quantization`` in ``dtype``, 64 blocks however much memory a rank has."""
    return {"dtype": dtype, "max_model_len": 256, "quantization": quantization, "max_num_seqs": 4,
            "num_kv_blocks": 64, **settings}


def _tp1_and_tp2(folder: Path, quantization: str, block_scales: bool) -> tuple[tuple, tuple]:
    """``generate`` on TP=1 and on TP=2 (gloo) of ``folder`` under ``--quantization
    quantization``; every FP8 projection of both in the CPU reference with ``block_scales``."""
    from worker.llm import LLM

    tp1 = LLM(model=str(folder), device="cpu", quantization=quantization, num_kv_blocks=64, **ENGINE)
    assert all(m.fp8_reference and m.fp8_block_scales == block_scales for m in fp8_linears(tp1.engine.runner.model))
    out1 = generate(tp1)
    del tp1
    with tp_engine(folder, "cpu", engine_settings=_tp_settings(quantization=quantization, cpu_threads=1),
                   kv_cache_bytes=None) as (llm, _, deaths):
        model = llm.engine.runner.model
        assert len(fp8_linears(model)) == 4 * model.config.num_layers
        assert all(m.fp8_reference and m.fp8_block_scales == block_scales for m in fp8_linears(model))
        out2 = generate(llm)
        assert not deaths
        return out1, out2


def relative_change(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|b - a| / |a|`` (Frobenius norms)."""
    return float((b - a).norm() / a.norm())


@pytest.mark.slow
def test_tp2_block_fp8_serves_tp1s_tokens(folders: dict[str, Path]) -> None:
    """Quantized at load in 128x128 blocks: TP=2 holds TP=1's weights and rounds inputs in
    the same 1x128 groups (``test_shards_dequantize_to_tp1_weights``), so what differs is
    the order of the float32 sums (the row-parallel partial sums), and an input within
    that difference of an e4m3 rounding boundary, which then rounds the other way (about
    one element a step here: 0.5-1.5% of one prompt's logits, the others within 1e-5).
    The same greedy tokens, and every step's logits within 5% (a scale or slice on the
    wrong rows, or a missing all-reduce, is off by tens of %)."""
    (tokens1, logits1), (tokens2, logits2) = _tp1_and_tp2(folders["aligned"], "fp8", block_scales=True)
    assert tokens2 == tokens1
    assert len(logits2) == len(logits1) >= PARAMS.max_tokens
    changes = [relative_change(a, b) for a, b in zip(logits1, logits2, strict=True)]
    print(f"logits, TP=2 against TP=1: largest change {max(changes):.4f}")
    assert max(changes) < 0.05


@pytest.mark.slow
def test_tp2_serves_an_fp8_checkpoint(folders: dict[str, Path]) -> None:
    """Saved in FP8 (per-channel and per-tensor scales, two projections kept in float32),
    served in FP8 under ``--quantization none`` (config.json decides, on every rank).
    Both hold the same weights (``test_shards_dequantize_to_tp1_weights``), but a
    row-parallel rank rounds each token's input through e4m3 with the scale of its own
    columns (``fp8_shards`` docstring), so greedy tokens may part at a near-tie. Checked
    on the first step (the same prompts on both): TP=2's logits are closer to TP=1's than
    TP=1's FP8 logits are to the float32 model's (measured 0.064 against 0.085; per-row
    scales in the wrong order give 0.31)."""
    from worker.llm import LLM

    (_, logits1), (_, logits2) = _tp1_and_tp2(folders["aligned-fp8"], "none", block_scales=False)
    _, exact = generate(LLM(model=str(folders["aligned"]), device="cpu", num_kv_blocks=64, **ENGINE))
    tp_change, fp8_change = relative_change(logits1[0], logits2[0]), relative_change(exact[0], logits1[0])
    print(f"first-step logits: TP=2 against TP=1 {tp_change:.4f}, TP=1 FP8 against float32 {fp8_change:.4f}")
    assert 0 < tp_change < fp8_change


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_block_fp8_over_nccl_matches_tp1(folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two GPUs, NCCL, bfloat16, 128x128 blocks, decode CUDA graphs: the FP8 kernels on
    each rank's slices, and the row-parallel products whose input the kernel before them
    quantizes (``RowParallelLinear.forward_quantized``: SwiGLU into down_proj, attention
    into o_proj, at 40 rows; at 100 the dequantized weight, K being 256) all-reduced. The FP8 products write bfloat16 and TP=2
    rounds each rank's partial sum where TP=1 rounds the whole, so inputs near an e4m3
    boundary round apart more often than in float32: the first step's logits (the same
    prompts on both) must be closer to TP=1's than TP=1's FP8 logits are to its bfloat16
    ones (a missing all-reduce or a wrong scale slice is off by far more), and each
    prompt's first token the same; the share of equal greedy tokens is printed (random
    weights in bfloat16 have near-ties). On 2 H200s (2026-11-28) both were far off until
    products with K under 512 stopped going to cuBLASLt's block-scaled GEMM
    (``fp8.BLOCK_SCALED_MM_K``): this model's K is 256."""
    from worker.llm import LLM

    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        monkeypatch.setenv(name, value)  # the spawned follower inherits them
    folder = folders["aligned"]
    prompts = [list(range(1, 6)), list(range(100, 140)), [(7 * i) % 256 for i in range(100)]]
    settings = {"model": str(folder), "device": "cuda", "dtype": "bfloat16", "num_kv_blocks": 64,
                "max_num_seqs": 4, "max_model_len": 256}
    exact = LLM(**settings)  # type: ignore[arg-type]
    _, logits_bf16 = generate(exact, prompts)
    del exact
    tp1 = LLM(quantization="fp8", **settings)  # type: ignore[arg-type]
    assert all(m.is_fp8 and m.weight_scale.dim() == 2 for m in fp8_linears(tp1.engine.runner.model))
    tokens1, logits1 = generate(tp1, prompts)
    del tp1
    torch.cuda.empty_cache()
    with tp_engine(folder, "cuda", engine_settings=_tp_settings(dtype="bfloat16")) as (llm, _, deaths):
        model = llm.engine.runner.model
        assert llm.engine.runner.graphs is not None
        assert model.layers[0].mlp.down_proj.takes_quantized_input(40)  # so through forward_quantized
        tokens2, logits2 = generate(llm, prompts)
        assert llm.engine.runner.graphs.num_replays > 0
        assert not deaths
    tp_change, fp8_change = relative_change(logits1[0], logits2[0]), relative_change(logits_bf16[0], logits1[0])
    same = sum(x == y for r, g in zip(tokens1, tokens2, strict=True) for x, y in zip(r, g, strict=True))
    print(f"first-step logits: TP=2 against TP=1 {tp_change:.4f}, FP8 against bfloat16 {fp8_change:.4f}; "
          f"{same} of {sum(map(len, tokens1))} greedy tokens equal")
    assert tp_change < fp8_change
    assert [t[0] for t in tokens2] == [t[0] for t in tokens1]
