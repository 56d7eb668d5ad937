"""The Triton backend (with fused ops, CUDA graphs on and off) against the PyTorch
reference backend, end to end through the engine with dummy weights.

Greedy tokens must agree on >= 95% of positions in bfloat16 and on all of them in
float32. Prefills are chunked (small token budget) so that sequences start decoding at
different steps and the graphs run padded buckets.
"""

from __future__ import annotations

import gc
import json
import os
import random
from pathlib import Path

import pytest
import torch

from shared.sampling import SamplingParams
from worker.llm import LLM

pytestmark = pytest.mark.cuda

NUM_PROMPTS, NUM_OUTPUT = 8, 64
_REF: dict[tuple[str, str], list[list[int]]] = {}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17, 33, 64, 100, 129, 200, 250)]


def _generate(model: str, dtype: str, backend: str, enforce_eager: bool) -> tuple[list[list[int]], int]:
    llm = LLM(model=model, load_format="dummy", dtype=dtype, device="cuda", attention_backend=backend,
              enforce_eager=enforce_eager, num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=128,
              max_model_len=1024)
    vocab = llm.engine.model_config.vocab_size
    outs = llm.generate(_prompts(vocab), SamplingParams(max_tokens=NUM_OUTPUT, temperature=0.0, ignore_eos=True))
    graphs = llm.engine.runner.graphs
    replays = graphs.num_replays if graphs is not None else 0
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.token_ids for o in outs], replays


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("model", ["SmolLM2-135M", "Llama-3.2-1B"])
def test_triton_matches_reference(model: str, dtype: str, graphs: bool) -> None:
    if model == "Llama-3.2-1B" and dtype == "bfloat16":
        # Measured on the H100 (2026-11-22): with random weights and a 128k vocabulary the
        # greedy choice is a near-tie at many steps, and one flip changes the rest of the
        # sequence. The reference backend agrees with *itself* on only 83% of positions
        # across two runs (cuBLAS bf16 is not bitwise reproducible), Triton without fused
        # ops on 20%, with them on 24%; float32 agrees exactly. The 95% bar is checked on
        # SmolLM2 shapes, where it holds (98-99%).
        pytest.xfail("bf16 greedy on random Llama-3.2-1B weights is chaotic (reference vs itself: 83%)")
    key = (model, dtype)
    if key not in _REF:
        _REF[key] = _generate(model, dtype, "torch", enforce_eager=True)[0]
    ref = _REF[key]
    got, replays = _generate(model, dtype, "triton", enforce_eager=not graphs)
    assert (replays > 0) == graphs
    assert all(len(g) == NUM_OUTPUT for g in got)
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    frac = same / (NUM_PROMPTS * NUM_OUTPUT)
    print(f"{model} {dtype} graphs={graphs}: {frac:.1%} of positions agree, {replays} graph replays")
    if dtype == "float32":
        assert got == ref, f"{frac:.1%} of positions agree"
    else:
        assert frac >= 0.95, f"only {frac:.1%} of positions agree"


def _max_tokens(i: int) -> int:
    return 12 + 5 * i


def _scripted_run(async_scheduling: bool, stop_tokens: dict[int, int]) -> dict[str, tuple[list[int], str | None]]:
    """Drive the engine step by step: requests arrive at different steps, some stop on a
    stop token (``stop_tokens``: request index -> token id) or at staggered max_tokens,
    some sample with seeds, one is aborted. Returns request id -> (tokens, finish reason)."""
    llm = LLM(model="SmolLM2-135M", load_format="dummy", dtype="float32", device="cuda", num_kv_blocks=256,
              max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, async_scheduling=async_scheduling)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompts = _prompts(vocab)
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}

    def add(i: int) -> None:
        seeded = i % 3 == 2
        params = SamplingParams(max_tokens=_max_tokens(i), temperature=0.8 if seeded else 0.0,
                                seed=1000 + i if seeded else None, ignore_eos=True,
                                stop_token_ids=[stop_tokens[i]] if i in stop_tokens else [])
        engine.add_request(f"r{i}", prompts[i], params)

    for i in range(4):
        add(i)
    step = 0
    while engine.has_unfinished_requests():
        # Triggers on delivered tokens, not on step counts: the async loop admits new
        # requests one step later than the synchronous one.
        if len(outs.get("r0", [])) >= 3 and "r4" not in engine.scheduler.requests and "r4" not in outs:
            for i in range(4, 8):
                add(i)
        if len(outs.get("r6", [])) >= 5 and "r6" in engine.scheduler.requests:
            engine.abort("r6")
        for out in engine.step():
            assert out.first_index == len(outs.setdefault(out.request_id, []))
            outs[out.request_id].extend(out.new_token_ids)
            reasons[out.request_id] = out.finish_reason
        step += 1
        assert step < 1000
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert (engine.num_async_steps > 0) == async_scheduling
    # Steps scheduled while the one before them ran (``_look_ahead``): those that admit
    # the arrivals or follow a prefill, through the mixed-step graphs.
    assert (engine.num_steps_ahead > 0) == async_scheduling
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {rid: (toks, reasons.get(rid)) for rid, toks in outs.items()}


def _first_new_token(tokens: list[int], start: int) -> tuple[int, int]:
    """(index, token) of the first token at or after ``start`` that does not occur before it."""
    k = next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])
    return k, tokens[k]


def test_async_scheduling_matches_sync() -> None:
    """Async scheduling (next decode enqueued before the tokens reach the host) gives
    exactly the tokens, finish reasons and indices of the synchronous loop, through
    arrivals, stops, seeded sampling and an abort, and leaks no KV block."""
    # Stop tokens that the requests do produce, taken from a run without any. Greedy decoding
    # of random weights repeats one token, so r1 (greedy, there from the start) stops on its
    # first token; r5 (seeded sampling, arrives later) stops mid-output.
    free = _scripted_run(async_scheduling=False, stop_tokens={})
    (k1, stop1), (k5, stop5) = _first_new_token(free["r1"][0], 0), _first_new_token(free["r5"][0], 6)
    sync = _scripted_run(async_scheduling=False, stop_tokens={1: stop1, 5: stop5})
    got = _scripted_run(async_scheduling=True, stop_tokens={1: stop1, 5: stop5})
    assert got == sync
    assert len(sync) == 8 and len(sync["r6"][0]) == 5 and sync["r6"][1] is None  # aborted: no finish reason
    # A request stops on its stop token, which is the last token it returns.
    assert sync["r1"] == (free["r1"][0][:k1 + 1], "stop")
    assert sync["r5"] == (free["r5"][0][:k5 + 1], "stop")
    for i in (0, 2, 3, 4, 7):  # no stop token: ignore_eos runs them to max_tokens
        assert sync[f"r{i}"][1] == "length" and len(sync[f"r{i}"][0]) == _max_tokens(i)


def test_mixed_graphs_match_eager() -> None:
    """Steps with prefill chunks beside decodes replay the mixed-step graphs (padded to a
    token bucket and to max_num_seqs) and give exactly the tokens of the eager engine
    (float32, greedy); no step runs eagerly."""
    rng = random.Random(3)
    results = []
    for eager in (True, False):
        llm = LLM(model="SmolLM2-135M", load_format="dummy", dtype="float32", device="cuda", enforce_eager=eager,
                  num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024)
        vocab = llm.engine.model_config.vocab_size
        rng.seed(3)
        prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 700))] for _ in range(24)]
        params = [SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.0, ignore_eos=True) for _ in prompts]
        outs = llm.generate(prompts, params)
        runner = llm.engine.runner
        if not eager:
            assert runner.mixed is not None and runner.mixed.num_replays > 0 and runner.num_eager_steps == 0
        results.append([o.token_ids for o in outs])
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert results[1] == results[0]


@pytest.fixture(scope="module")
def dummy_smollm(tmp_path_factory) -> str:
    """SmolLM2-135M's config beside the default model's tokenizer (grammars need one): from
    the converted model here, or from ``$INFERQ_TOKENIZER_DIR`` on a machine without it
    (a lent GPU: ``bench.model_folder.export_tokenizer``'s files)."""
    from bench.model_folder import build_model_folder

    tokenizer_dir = os.environ.get("INFERQ_TOKENIZER_DIR")
    folder, _ = build_model_folder("SmolLM2-135M", tmp_path_factory.mktemp("models"),
                                   Path(tokenizer_dir) if tokenizer_dir else None)
    return str(folder)


def _structured_run(model: str, async_scheduling: bool) -> tuple[list[tuple[list[int], str | None]], int]:
    """Grammar-constrained requests only (regex, choice, a bounded JSON schema; greedy and
    seeded sampling), random weights in float32: each output and the async step count."""
    from shared.sampling import StructuredOutput

    llm = LLM(model=model, load_format="dummy", dtype="float32", device="cuda", num_kv_blocks=256,
              max_num_seqs=8, max_model_len=512, async_scheduling=async_scheduling)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "w": {"enum": ["red", "green", "blue"]}},
              "required": ["n", "w"], "additionalProperties": False}
    specs = [StructuredOutput(kind="regex", spec=r"[0-9]{3}-[0-9]{4}"),
             StructuredOutput(kind="choice", spec=json.dumps(["yes", "no", "maybe not"])),
             StructuredOutput(kind="json_schema", spec=json.dumps(schema))]
    params = [SamplingParams(max_tokens=80, temperature=0.0 if i % 2 == 0 else 0.9, seed=7 + i, structured=s)
              for i, s in enumerate(specs * 2)]
    prompts = _prompts(llm.engine.model_config.vocab_size)[:len(params)]
    outs = llm.generate(prompts, params)
    num_async = llm.engine.num_async_steps
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [(o.token_ids, o.finish_reason) for o in outs], num_async


def test_async_scheduling_with_grammars_matches_sync(dummy_smollm) -> None:
    """Requests with a grammar take the async path too (forward enqueued, previous tokens
    applied to the grammars while it runs, then sampled under the masks) and give exactly
    the synchronous loop's tokens and finish reasons."""
    sync, num_sync = _structured_run(dummy_smollm, async_scheduling=False)
    got, num_async = _structured_run(dummy_smollm, async_scheduling=True)
    assert num_sync == 0 and num_async > 0
    assert all(reason == "stop" for _, reason in sync), sync
    assert got == sync
