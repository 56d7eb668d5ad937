"""Mixed-step packing on the CPU: ``StepInputs`` against the per-token definitions, and a
step padded to a token bucket and to ``max_num_seqs`` (what a mixed-step CUDA graph
runs, here eagerly through the reference backend) against the same step unpadded.
The graphs themselves are tested on CUDA (``tests/test_cuda_warmup.py``,
``tests/test_engine_cuda.py``)."""

from __future__ import annotations

import random
from itertools import pairwise

import torch

from shared.sampling import SamplingParams
from worker.engine.mixed_graphs import MixedGraphs, StepInputs, token_buckets
from worker.engine.model_runner import slot
from worker.llm import LLM


def test_token_buckets() -> None:
    assert token_buckets(16) == [16]
    assert token_buckets(100) == [16, 32, 64, 100]
    b = token_buckets(2048)
    assert b[:8] == [16, 32, 64, 128, 192, 256, 288, 320] and b[-1] == 2048
    assert all(x < y for x, y in pairwise(b))
    # Above 256 tokens a step never pads by more than 1/8 of its size.
    assert all((y - x) / x <= 1 / 8 for x, y in pairwise(b[5:]))


def _engine(max_num_seqs: int = 6, max_num_batched_tokens: int = 96) -> LLM:
    return LLM(model="SmolLM2-135M", load_format="dummy", device="cpu", dtype="float32",
               attention_backend="torch", num_kv_blocks=64, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max_num_batched_tokens, max_model_len=512)


def _start(llm: LLM, lengths: list[int], max_tokens: int = 8) -> None:
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    for i, n in enumerate(lengths):
        llm.engine.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(n)],
                               SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_fill_matches_definitions() -> None:
    """Every packed field equals its per-token definition, and padding rows are padding."""
    llm = _engine()
    _start(llm, [3, 40, 70, 1])
    engine = llm.engine
    engine.step()  # prefills start; the next step mixes decodes and chunks
    out = engine.scheduler.schedule()
    batch = out.scheduled
    assert any(item.num_tokens == 1 for item in batch) and any(item.num_tokens > 1 for item in batch)
    inputs = StepInputs(128, 8, 40, 16, torch.device("cpu"))
    shape = inputs.fill(batch, pad_tokens_to=128)
    ids, pos, slots, want_idx, q_lens = [], [], [], [], []
    for item in batch:
        r, s = item.request, item.request.num_computed_tokens
        ids += r.token_ids[s:s + item.num_tokens]
        pos += range(s, s + item.num_tokens)
        slots += [slot(r.block_table, p, 16) for p in range(s, s + item.num_tokens)]
        q_lens.append(item.num_tokens)
        if item.samples:
            want_idx.append(len(ids) - 1)
    n, t = len(batch), len(ids)
    assert (shape.num_tokens, shape.num_seqs, shape.num_sampled) == (t, n, len(want_idx))
    i64, p64, meta, idx = inputs.views(128, 8, 8, 128, 512)
    assert i64[:t].tolist() == ids and p64[:t].tolist() == pos
    assert meta.slot_mapping[:t].tolist() == slots and set(meta.slot_mapping[t:].tolist()) == {-1}
    assert meta.query_start_loc.tolist() == [sum(q_lens[:i]) for i in range(n + 1)] + [t] * (8 - n)
    assert meta.seq_lens.tolist() == [it.request.num_computed_tokens + it.num_tokens for it in batch] + [0] * (8 - n)
    assert idx.tolist() == want_idx + [0] * (8 - len(want_idx))
    for i, item in enumerate(batch):
        row = item.request.block_table
        assert meta.block_tables[i, :len(row)].tolist() == row
    # A smaller step refilled into the same buffers leaves no stale padding behind.
    shape = inputs.fill(batch[:1], pad_tokens_to=64)
    assert set(meta.slot_mapping[shape.num_tokens:64].tolist()) == {-1}
    assert meta.query_start_loc[2:].tolist() == [shape.num_tokens] * 7


def test_padded_step_equals_unpadded() -> None:
    """The hidden rows a padded mixed step gathers equal the unpadded step's, over the
    steps of a workload with chunked prefill beside decodes (reference attention)."""
    llm = _engine(max_num_batched_tokens=48)
    _start(llm, [5, 45, 17, 2, 30], max_tokens=4)
    engine, runner = llm.engine, llm.engine.runner
    mixed = MixedGraphs(runner.model, runner.kv_caches, runner.backend, 6, 48, 32, 512, 16, torch.device("cpu"))
    checked = 0
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        batch = out.scheduled
        num_tokens = sum(item.num_tokens for item in batch)
        bucket = next(b for b in mixed.buckets if b >= num_tokens)
        with torch.inference_mode():
            ids, pos, meta, idx = runner.prepare(batch)
            want = runner.model(ids, pos, runner.kv_caches, meta, runner.backend).index_select(0, idx)
            shape = mixed.inputs.fill(batch, pad_tokens_to=bucket)
            mixed.forward(bucket)  # rewrites the same K/V, reads what the unpadded step read
        got = mixed.rows[:shape.num_sampled]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        checked += bucket > num_tokens and 1 < len(batch) < 6
        engine._apply(out, *runner.execute(batch))
    assert checked >= 3  # steps that really padded both tokens and sequences
