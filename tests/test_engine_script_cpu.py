"""The scripted engine run of tests/test_engine_cuda.py on the CPU: the engine driven step
by step with dummy weights of the SmolLM2 config (float32), requests arriving at
different steps, chunked prefills, greedy and seeded sampling, a stop on a stop token,
an abort mid-generation; at the end every KV block is free. Two runs of the script
give the same tokens, and a seeded request gives the same tokens alone as in the batch.
"""

from __future__ import annotations

import random

import pytest

from shared.sampling import SamplingParams
from worker.llm import LLM

pytestmark = pytest.mark.timeout(600)

PROMPT_LENS = (5, 17, 33, 64, 100, 129)
NUM_BLOCKS = 64
SEEDED = (2, 5)  # i % 3 == 2
STOPPED = 1
ABORTED, ABORT_AFTER = 4, 5
Outcome = dict[str, tuple[list[int], str | None]]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="SmolLM2-135M", load_format="dummy", dtype="float32", device="cpu", num_kv_blocks=NUM_BLOCKS,
               max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)


def prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENS]


def params(i: int, vocab_size: int) -> SamplingParams:
    """Greedy, or seeded at temperature 0.8 (``SEEDED``); request ``STOPPED`` stops on
    its 4th token (every id is a stop token once ``min_tokens`` are out)."""
    seeded = i in SEEDED
    stop = {"min_tokens": 4, "stop_token_ids": tuple(range(vocab_size))} if i == STOPPED else {}
    return SamplingParams(max_tokens=6 + 3 * i, temperature=0.8 if seeded else 0.0,
                          seed=1000 + i if seeded else None, ignore_eos=True, **stop)


def scripted_run(llm: LLM) -> Outcome:
    """r0-r2 first, r3-r5 once r0 has 3 tokens; r4 aborted after 5 of its tokens."""
    engine = llm.engine
    engine.scheduler.block_manager.reset_prefix_cache()  # each run starts alike
    vocab_size = engine.model_config.vocab_size
    ps = prompts(vocab_size)
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}

    def add(i: int) -> None:
        engine.add_request(f"r{i}", ps[i], params(i, vocab_size))

    for i in range(3):
        add(i)
    num_steps = 0
    while engine.has_unfinished_requests():
        if len(outs.get("r0", [])) >= 3 and "r3" not in engine.scheduler.requests and "r3" not in outs:
            for i in range(3, len(ps)):
                add(i)
        aborted = f"r{ABORTED}"
        if len(outs.get(aborted, [])) >= ABORT_AFTER and aborted in engine.scheduler.requests:
            assert engine.abort(aborted)
        for out in engine.step():
            assert out.first_index == len(outs.setdefault(out.request_id, []))
            outs[out.request_id] += out.new_token_ids
            reasons[out.request_id] = out.finish_reason
        num_steps += 1
        assert num_steps < 1000
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, NUM_BLOCKS)  # no leak
    return {rid: (tokens, reasons.get(rid)) for rid, tokens in outs.items()}


def test_scripted_run_is_reproducible_and_frees_every_block(llm: LLM) -> None:
    first = scripted_run(llm)
    vocab_size = llm.engine.model_config.vocab_size
    assert sorted(first) == [f"r{i}" for i in range(len(PROMPT_LENS))]
    for i in range(len(PROMPT_LENS)):
        tokens, reason = first[f"r{i}"]
        if i == ABORTED:
            assert (len(tokens), reason) == (ABORT_AFTER, None)
        elif i == STOPPED:
            assert (len(tokens), reason) == (4, "stop")
        else:
            assert (len(tokens), reason) == (params(i, vocab_size).max_tokens, "length")
    # The engine's own generator has moved on since the first run; seeded requests
    # draw from their own, so everything repeats.
    assert scripted_run(llm) == first
    # A seeded request alone (no batch around it) draws the same tokens.
    i = SEEDED[0]
    (alone,) = llm.generate([prompts(vocab_size)[i]], params(i, vocab_size))
    assert alone.token_ids == first[f"r{i}"][0]
    assert llm.engine.stats().num_free_blocks == NUM_BLOCKS
