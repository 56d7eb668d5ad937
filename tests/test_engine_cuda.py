"""The Triton backend (with fused ops, CUDA graphs on and off) against the PyTorch
reference backend, end to end through the engine with dummy weights.

Greedy tokens must agree on >= 95% of positions in bfloat16 and on all of them in
float32. Prefills are chunked (small token budget) so that sequences start decoding at
different steps and the graphs run padded buckets.
"""

from __future__ import annotations

import gc
import random

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


def test_bucket_sizes() -> None:
    from worker.engine.cuda_graphs import bucket_sizes

    assert bucket_sizes(1) == [1]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert bucket_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]
