"""Tensor parallelism (``worker/parallel/``) on the CPU over gloo.

A tiny Llama checkpoint (every bias on, a vocabulary that does not split evenly, so the
last shard carries padding, and a byte-level tokenizer of printable ASCII for grammars)
is saved once as safetensors: TP=2 (this process as rank 0 and one spawned follower,
each reading only its slices) must give the greedy tokens of TP=1 and the same logits
within 1e-5, through prefill, decode, speculative verification and prompt-logprob calls
of the LM head; and the same tokens on a workload that takes every engine path that
runs under TP: prefill chunks that share steps with decodes (a token budget of 32),
prefix-cache hits, ngram speculative decoding, a JSON-schema request (its grammar mask
applied on rank 0's gathered logits), penalties and a seeded sampled request. The
sharding math is checked without processes by summing the shards' partial products by
hand, for a split and a replicated-KV layout. Killing the follower must take the group
down: rank 0's watcher fires and a step fails instead of hanging. (The worker's stop,
as processes: ``test_tp_teardown.py``.)

The default model (SmolLM2-135M: 9 heads, 3 KV heads) does not split over 2 ranks; it is
refused with the reason (``test_refuses_what_does_not_split``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from msgspec.structs import replace
from safetensors.torch import save_file

from shared.model_source import DUMMY_CONFIGS
from shared.sampling import SamplingParams, StructuredOutput
from worker.models.config import ModelConfig
from worker.models.llama import LlamaForCausalLM
from worker.models.loader import load_hf_weights
from worker.parallel.group import MULTICAST_OFF
from worker.parallel.layers import ZERO, TensorParallelLM, shard_spec, tensor_slice

HIDDEN, INTER, LAYERS, VOCAB, HEAD_DIM = 64, 96, 2, 251, 16
ENGINE = {"dtype": "float32", "num_kv_blocks": 64, "max_num_seqs": 4, "cpu_threads": 1, "max_model_len": 256}
#: The CPU engines of this module (TP=1 and TP=2 alike): prefill chunks of at most 32
#: tokens, so a long prompt's chunks share steps with other requests' decodes; ngram
#: speculative decoding; prefix caching (on by default).
CPU_ENGINE = {**ENGINE, "max_num_batched_tokens": 32, "speculative_method": "ngram"}
#: TP=2 sizes its cache from a byte budget instead: 2 layers x K and V x 16 tokens x 1 KV
#: head of 16 float32 per rank = 4,096 bytes a block, so 128 blocks (64 for the full model).
TP_KV_CACHE_BYTES, TP_NUM_BLOCKS = 128 * 4096, 128
#: Set for every process the cuda tests start: no NVLink multicast (NVLS), as the worker
#: sets it (``group.MULTICAST_OFF``).
NCCL_ENV = MULTICAST_OFF
PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 140)), [7, 7, 7]]
#: The last request also scores its prompt and returns logprobs: more LM-head calls.
PARAMS = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * 2 + [
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)]


def tiny_config(num_heads: int = 4, num_kv_heads: int = 2) -> dict:
    return {"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
            "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": HEAD_DIM,
            "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "attention_bias": True,
            "mlp_bias": True, "tie_word_embeddings": False, "max_position_embeddings": 512, "eos_token_id": 0}


def write_checkpoint(folder: Path, config: dict, seed: int = 0) -> Path:
    """A HF folder (config.json + one safetensors file) of random weights for ``config``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    nh, kv, d, h, i = (config["num_attention_heads"], config["num_key_value_heads"], HEAD_DIM, HIDDEN, INTER)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    t = {"model.embed_tokens.weight": r(VOCAB, h), "lm_head.weight": r(VOCAB, h), "model.norm.weight": 1 + r(h)}
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        shapes = {"self_attn.q_proj": (nh * d, h), "self_attn.k_proj": (kv * d, h), "self_attn.v_proj": (kv * d, h),
                  "self_attn.o_proj": (h, nh * d), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h),
                  "mlp.down_proj": (h, i)}
        for name, shape in shapes.items():
            t[f"{p}{name}.weight"], t[f"{p}{name}.bias"] = r(*shape), r(shape[0])
        t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"] = 1 + r(h), 1 + r(h)
    save_file(t, str(folder / "model.safetensors"))
    return folder


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer of printable ASCII (no merges: one token a character,
    ids 1..95; EOS ``</s>`` is 0, the config's ``eos_token_id``) saved in ``folder``:
    enough for llguidance to build JSON grammars over the tiny model's 251 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\u0120"] + [chr(c) for c in range(33, 127)]  # byte-level's space, then itself
    tok = Tokenizer(models.BPE(vocab={"</s>": 0, **{c: i for i, c in enumerate(chars, 1)}}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_checkpoint(tmp_path_factory.mktemp("tp") / "tiny", tiny_config())
    write_tokenizer(folder)
    return folder


def generate(llm) -> tuple[list[list[int]], list[torch.Tensor], list]:
    """Greedy tokens, every logits tensor rank 0's LM head returned, and the outputs."""
    logits: list[torch.Tensor] = []
    model = llm.engine.runner.model
    compute = model.compute_logits
    model.compute_logits = lambda hidden: logits.append(compute(hidden).clone()) or logits[-1]
    try:
        outs = llm.generate(PROMPTS, PARAMS)
    finally:
        del model.compute_logits
    return [o.token_ids for o in outs], logits, outs


@pytest.fixture(scope="module")
def llm1(tiny_folder: Path):
    from worker.llm import LLM

    return LLM(model=str(tiny_folder), device="cpu", **CPU_ENGINE)


@pytest.fixture(scope="module")
def tp1(llm1):
    return generate(llm1)


#: Keys of ``tp_engine``'s settings that are the model's (``ModelSettings``); the rest are
#: the engine's.
MODEL_KEYS = ("dtype", "max_model_len", "quantization")


@contextlib.contextmanager
def tp_engine(folder: Path, device: str, size: int = 2, engine_settings: dict | None = None,
              kv_cache_bytes: int | None = TP_KV_CACHE_BYTES) -> Iterator[tuple]:
    """Rank 0 of a TP=``size`` engine of ``engine_settings`` (``LLM`` keywords, default
    ``ENGINE``) in this process (its followers are processes), the group, and the
    follower deaths rank 0's watcher saw (instead of exiting the test process). On CPU
    each rank sizes its cache from ``kv_cache_bytes`` (None: the settings' block count);
    on CUDA it keeps the explicit block count (sized from free memory, a second engine in
    this process would find the first one's cache)."""
    from shared.model_source import resolve_model
    from shared.settings import ModelSettings
    from worker.llm import LLM, offline_engine_settings
    from worker.parallel.follower import start_for_engine

    deaths: list[float] = []
    settings = dict(engine_settings or ENGINE)
    if device == "cpu" and kv_cache_bytes is not None:
        settings = {**{k: v for k, v in settings.items() if k != "num_kv_blocks"}, "kv_cache_bytes": kv_cache_bytes}
    model = {k: v for k, v in settings.items() if k in MODEL_KEYS}
    engine = {k: v for k, v in settings.items() if k not in MODEL_KEYS}
    # The followers' settings must be rank 0's: LLM's (its offline defaults on a GPU too),
    # or the ranks would capture other graph buckets and desync.
    group = start_for_engine(resolve_model(str(folder)), ModelSettings(model=str(folder), device=device, **model),
                             offline_engine_settings({"tensor_parallel_size": size, **engine}, device),
                             on_death=lambda: deaths.append(time.monotonic()))
    llm = None
    try:
        llm = LLM(model=str(folder), tensor_parallel_size=size, device=device, **settings)
        yield llm, group, deaths
    finally:
        sync = None if deaths or llm is None else llm.engine.runner.step_sync
        group.close(sync.send_stop if sync is not None else None)


@pytest.fixture(scope="module")
def tp2(tiny_folder: Path):
    with tp_engine(tiny_folder, "cpu", engine_settings=CPU_ENGINE) as out:
        yield out


@pytest.mark.slow
def test_llm_starts_and_stops_its_own_group(tiny_folder: Path) -> None:
    """``LLM(tensor_parallel_size=2)`` with no group in the process starts one (as vLLM's
    ``LLM`` does), gives TP=1's greedy tokens, and ``close`` ends its follower. (First in
    the module: the ``tp2`` fixture's group lives from its first use to the module's end.)"""
    from worker.llm import LLM
    from worker.parallel import group as tp_group

    greedy = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    want = [o.token_ids for o in LLM(model=str(tiny_folder), device="cpu", **ENGINE).generate(PROMPTS, greedy)]
    assert tp_group.current() is None
    settings = {k: v for k, v in ENGINE.items() if k != "num_kv_blocks"}
    with LLM(model=str(tiny_folder), device="cpu", tensor_parallel_size=2, kv_cache_bytes=TP_KV_CACHE_BYTES,
             **settings) as llm:
        group = tp_group.current()
        assert group is not None and llm._group is group
        [follower] = group.followers
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == want
    assert tp_group.current() is None and not follower.is_alive() and follower.exitcode == 0


def test_tp2_matches_tp1(tp1, tp2) -> None:
    tokens1, logits1, outs1 = tp1
    llm, _, _ = tp2
    assert isinstance(llm.engine.runner.model, TensorParallelLM)
    k_cache = llm.engine.runner.kv_caches[0][0]
    assert k_cache.shape[2] == 1, "each rank caches its own KV head only"
    # ... so the same bytes hold twice the blocks of the full model's cache.
    assert llm.engine.runner.num_blocks == llm.engine.scheduler.block_manager.num_blocks == TP_NUM_BLOCKS
    tokens2, logits2, outs2 = generate(llm)
    assert tokens2 == tokens1
    assert len(logits2) == len(logits1) > 16  # prefill, decode and prompt-logprob calls
    for a, b in zip(logits1, logits2, strict=True):
        assert a.shape == b.shape and a.shape[1] == VOCAB
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    lp1, lp2 = outs1[2].prompt_logprobs, outs2[2].prompt_logprobs
    assert lp1 is not None and lp2 is not None and len(lp2) == len(PROMPTS[2]) - 1


#: A JSON schema whose every output is short: an enum and a bounded integer.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "n"],
          "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
#: Two prompt prefixes of two full blocks and more: the second round's prompts that
#: start with them find their blocks cached. The second repeats itself, so ngram
#: lookups find drafts in it.
PREFIX_A, PREFIX_B = list(range(10, 50)), [3, 1, 4, 1, 5, 9, 2, 6] * 4


def paths_workload() -> list[list[tuple[list[int], SamplingParams]]]:
    """Two rounds of ``(prompt, params)``, every prompt of a round added at once (the
    second round after the first has finished, so that its prefixes are cached)."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    structured = SamplingParams(max_tokens=40, temperature=0.0,
                                structured=StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA, sort_keys=True)))
    penalties = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                               presence_penalty=0.5)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    return [[(PREFIX_A + [60, 61], greedy), ([7, 8, 9], replace(greedy, max_tokens=20)),
             (PREFIX_B + [2, 7], greedy), ([20, 21, 22, 23, 24], structured)],
            [(PREFIX_A + [70, 71, 72], greedy), (PREFIX_B + [8, 8], penalties), ([9, 10, 11, 12], seeded),
             (list(range(150, 200)), greedy)]]


def run_paths(llm) -> tuple[list, list[tuple[bool, bool]]]:
    """``paths_workload`` through ``llm``: the outputs of both rounds, and per step whether
    it computed a prefill chunk and whether it decoded (rank 0's scheduled batches)."""
    steps: list[tuple[bool, bool]] = []
    runner = llm.engine.runner
    execute = runner.execute

    def record(batch, *args, **kwargs):
        prefill = [item.request.num_computed_tokens < item.request.num_prompt_tokens for item in batch]
        steps.append((any(prefill), not all(prefill)))
        return execute(batch, *args, **kwargs)

    runner.execute = record
    try:
        outs = [out for round_ in paths_workload() for out in llm.generate(*map(list, zip(*round_)))]
    finally:
        del runner.execute
    return outs, steps


def test_tp2_matches_tp1_on_every_engine_path(llm1, tp2) -> None:
    """Mixed prefill + decode steps, prefix-cache hits, ngram drafts verified, a JSON
    schema, penalties and a seeded sample: TP=2's tokens are TP=1's, and so are its
    cache hits and its speculation counts."""
    llm2, _, deaths = tp2
    spec1, spec2 = llm1.engine.spec_stats, llm2.engine.spec_stats
    drafts_before = spec1.num_draft_tokens, spec2.num_draft_tokens
    outs1, _ = run_paths(llm1)
    outs2, steps = run_paths(llm2)
    assert not deaths
    assert [o.token_ids for o in outs2] == [o.token_ids for o in outs1]
    assert [o.num_cached_tokens for o in outs2] == [o.num_cached_tokens for o in outs1]
    assert outs2[4].num_cached_tokens >= 32 and outs2[5].num_cached_tokens >= 32  # two blocks of each prefix
    assert any(prefill and decode for prefill, decode in steps), "no step mixed a prefill chunk with decodes"
    drafts = spec1.num_draft_tokens - drafts_before[0], spec2.num_draft_tokens - drafts_before[1]
    assert drafts[1] == drafts[0] > 0
    assert spec2.num_accepted_tokens == spec1.num_accepted_tokens
    answer = json.loads(outs2[3].text)
    assert outs2[3].finish_reason == "stop" and answer["color"] in ("red", "green") and 0 <= answer["n"] <= 99


def test_dead_follower_takes_the_group_down(tp2) -> None:
    """The follower is SIGKILLed: rank 0's watcher reports it within seconds (in the
    worker it exits with ``EXIT_RANK_DIED``), and a step fails rather than hangs."""
    llm, group, deaths = tp2
    killed = time.monotonic()
    os.kill(group.followers[0].pid, signal.SIGKILL)
    while not deaths and time.monotonic() - killed < 10:
        time.sleep(0.05)
    assert deaths and deaths[0] - killed < 10
    result: list[BaseException | None] = []

    def step() -> None:
        try:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
            result.append(None)
        except RuntimeError as exc:  # gloo: the peer's connection is closed
            result.append(exc)

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    thread.join(30)
    assert result and isinstance(result[0], RuntimeError), "a step with a dead rank must fail, not hang"


def _sum_shards(full: LlamaForCausalLM, shards: list[TensorParallelLM], x: torch.Tensor, ids: torch.Tensor) -> None:
    """Rebuild layer 0's attention projections, MLP, embedding and LM head from the
    shards (their collectives done by hand) and compare them with the full model's."""
    fa, fm = full.layers[0].self_attn, full.layers[0].mlp
    cfg, n = full.config, len(shards)
    group = cfg.num_heads // cfg.num_kv_heads
    q_full, k_full, _ = fa.qkv_proj(x).split([fa.q_size, fa.kv_size, fa.kv_size], -1)
    mlp_out = torch.zeros_like(x)
    embed = torch.zeros(ids.shape[0], cfg.hidden_size)
    logits = []
    for s in shards:
        sa, sm, spec = s.layers[0].self_attn, s.layers[0].mlp, s.spec
        q, k, _ = sa.qkv_proj(x).split([sa.q_size, sa.kv_size, sa.kv_size], -1)
        torch.testing.assert_close(q, q_full[:, slice(*spec.rows("q"))])
        torch.testing.assert_close(k, k_full[:, slice(*spec.rows("kv"))])
        first_head = spec.rows("q")[0] // cfg.head_dim
        assert first_head // group == spec.kv_head_start  # its query heads use its KV head
        gate, up = sm.gate_up_proj(x).chunk(2, -1)
        mlp_out += F.linear(F.silu(gate) * up, sm.down_proj.weight, sm.down_proj.bias)
        emb = s.embed_tokens
        inside = (ids >= emb.vocab_start) & (ids < emb.vocab_end)
        embed += F.embedding((ids - emb.vocab_start).clamp(0, emb.weight.shape[0] - 1), emb.weight) * inside[:, None]
        logits.append(F.linear(x, s.lm_head.weight))
    torch.testing.assert_close(mlp_out, fm(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(embed, full.embed_tokens(ids))
    torch.testing.assert_close(torch.cat(logits, -1)[:, :cfg.vocab_size], full.lm_head(x))
    assert sum(sh.spec.vocab_end - sh.spec.vocab_start for sh in shards) == cfg.vocab_size
    assert sum(sh.shard_config.num_heads for sh in shards) == cfg.num_heads
    assert n * shards[0].shard_config.intermediate_size == cfg.intermediate_size


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "world_size"), [(4, 2, 2), (8, 2, 4)])
def test_shards_sum_to_the_full_model(tmp_path: Path, num_heads: int, num_kv_heads: int, world_size: int) -> None:
    """Split KV heads (4/2 over 2) and replicated ones (8/2 over 4), loaded through the
    sliced reads of ``load_hf_weights``; row-parallel biases only on rank 0."""
    folder = write_checkpoint(tmp_path, tiny_config(num_heads, num_kv_heads), seed=1)
    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    full = LlamaForCausalLM(cfg, 64)
    load_hf_weights(full, folder)
    shards = []
    for rank in range(world_size):
        shard = TensorParallelLM(shard_spec(cfg, rank, world_size), 64, None)
        load_hf_weights(shard, folder)
        assert all(bool((b == 0).all()) == (rank > 0) for b in shard.row_parallel_biases())
        shards.append(shard)
    x = torch.randn(5, HIDDEN)
    _sum_shards(full, shards, x, torch.tensor([0, 62, 63, 125, 200, VOCAB - 1]))


def test_tensor_slice_names() -> None:
    spec = shard_spec(ModelConfig.from_hf(tiny_config()), 1, 2)
    assert tensor_slice(spec, "layers.0.self_attn.q_proj.weight") == (0, 32, 64)
    assert tensor_slice(spec, "layers.0.self_attn.k_proj.bias") == (0, 16, 32)
    assert tensor_slice(spec, "layers.1.self_attn.o_proj.weight") == (1, 32, 64)
    assert tensor_slice(spec, "layers.1.mlp.down_proj.weight") == (1, 48, 96)
    assert tensor_slice(spec, "layers.1.mlp.down_proj.bias") == ZERO
    assert tensor_slice(spec, "lm_head.weight") == (0, 126, VOCAB)  # ceil(251 / 2) rows a rank
    assert tensor_slice(spec, "layers.0.input_layernorm.weight") is None


def test_refuses_what_does_not_split() -> None:
    smollm = ModelConfig.from_hf(DUMMY_CONFIGS["SmolLM2-135M"])
    with pytest.raises(ValueError, match="does not divide num_attention_heads 9"):
        shard_spec(smollm, 0, 2)
    assert shard_spec(smollm, 2, 3).config.num_kv_heads == 1  # 9 heads, 3 KV heads over 3 ranks
    with pytest.raises(ValueError, match="num_key_value_heads 4 neither divides"):
        shard_spec(ModelConfig.from_hf(tiny_config(12, 4)), 0, 6)
    with pytest.raises(ValueError, match="intermediate_size 100"):
        shard_spec(ModelConfig.from_hf({**tiny_config(8, 8), "intermediate_size": 100}), 0, 8)
    with pytest.raises(ValueError, match="not mixtures of experts"):
        shard_spec(ModelConfig.from_hf(DUMMY_CONFIGS["Qwen3-30B-A3B"]), 0, 2)


def test_compose_tp_worker_reserves_its_gpus() -> None:
    """compose.yaml's ``tp`` profile: one worker whose GPU reservation is the group size,
    found by Prometheus under the workers' DNS name."""
    import subprocess

    from tests.test_compose import ROOT, compose_binary

    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_", "INFERQ_"))}
    out = subprocess.run([str(compose_binary()), "-f", "compose.yaml", "--profile", "tp", "config", "--format", "json"],
                         cwd=ROOT, env={**env, "INFERQ_TENSOR_PARALLEL_SIZE": "4"}, capture_output=True, text=True,
                         timeout=120, check=True)
    service = json.loads(out.stdout)["services"]["worker-tp"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"] == 4 and service["environment"]["INFERQ_TENSOR_PARALLEL_SIZE"] == "4"
    assert "worker" in service["networks"]["default"]["aliases"]


def test_llama3_70b_dummy_config_splits() -> None:
    """The 70B shape for an end-to-end ``--tensor-parallel-size 2 --load-format dummy`` run."""
    cfg = ModelConfig.from_hf(DUMMY_CONFIGS["Llama-3-70B"])
    assert cfg.num_params == pytest.approx(70.55e9, rel=0.01)
    for n in (2, 4, 8):
        assert shard_spec(cfg, n - 1, n).config.num_kv_heads == 8 // n


two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.fixture()
def nccl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """``NCCL_ENV`` in this process (rank 0) and so in the followers it spawns."""
    for name, value in NCCL_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.mark.cuda
@two_gpus
def test_tp2_over_nccl_matches_tp1(tiny_folder: Path, nccl_env: None) -> None:
    """Two GPUs, NCCL: the decode steps replay CUDA graphs that hold the all-reduces and
    the logits all-gather on both ranks (through the one-shot all-reduce,
    ``worker/parallel/all_reduce.py``, at these sizes), prefill steps the mixed-step
    graphs (rank 0 sends their packed inputs, ``StepSync.send_mixed``); greedy tokens
    equal TP=1's on one GPU, with and without logprobs asked (without, the decode chain
    of async scheduling and the steps scheduled ahead run)."""
    from worker.llm import LLM

    llm1 = LLM(model=str(tiny_folder), device="cuda", **ENGINE)
    tokens1, logits1, _ = generate(llm1)
    # Greedy, no logprobs: every step may be enqueued behind the one in flight.
    ahead1 = [o.token_ids for o in llm1.generate(PROMPTS, PARAMS[0])]
    with tp_engine(tiny_folder, "cuda") as (llm, _, deaths):
        runner = llm.engine.runner
        assert runner.graphs is not None and runner.mixed is not None, "decode and mixed-step graphs under TP"
        tokens2, logits2, _ = generate(llm)
        assert runner.graphs.num_replays > 0
        assert llm.engine.look_ahead
        from worker.parallel.all_reduce import installed

        assert installed() is not None, "the one-shot all-reduce is set up on NVLink-connected GPUs"
        replays = runner.mixed.num_replays
        ahead2 = [o.token_ids for o in llm.generate(PROMPTS, PARAMS[0])]
        assert runner.mixed.num_replays > replays, "the greedy prompts' prefill replays a mixed-step graph"
        assert not deaths
    assert tokens2 == tokens1
    assert ahead2 == ahead1
    # Decode logits stay inside the graphs; the first prefill's come out of the LM head.
    torch.testing.assert_close(logits2[0], logits1[0], rtol=0, atol=1e-3)


@pytest.mark.cuda
@two_gpus
def test_tp2_over_nccl_on_every_engine_path(tiny_folder: Path, nccl_env: None) -> None:
    """``test_tp2_matches_tp1_on_every_engine_path`` on two GPUs: mixed steps run eagerly
    under TP, decode steps replay the graphs, the JSON-schema request's decode steps take
    the async path (its mask applied to the graphs' gathered logits)."""
    from worker.llm import LLM

    llm1 = LLM(model=str(tiny_folder), device="cuda", **CPU_ENGINE)
    outs1, _ = run_paths(llm1)
    with tp_engine(tiny_folder, "cuda", engine_settings=CPU_ENGINE) as (llm2, _, deaths):
        outs2, steps = run_paths(llm2)
        assert llm2.engine.runner.graphs is not None and llm2.engine.runner.graphs.num_replays > 0
        assert not deaths
    assert [o.token_ids for o in outs2] == [o.token_ids for o in outs1]
    assert [o.num_cached_tokens for o in outs2] == [o.num_cached_tokens for o in outs1]
    assert any(prefill and decode for prefill, decode in steps)
    assert json.loads(outs2[3].text)["color"] in ("red", "green")
