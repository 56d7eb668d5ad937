"""Speculative decoding (worker/engine/spec_decode.py): the n-gram proposer, the adaptive
draft length, the acceptance rule's output distribution, KV rollback in the scheduler,
and greedy/seeded outputs of the real default model with speculation on."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from shared.sampling import SamplingParams
from shared.settings import EngineSettings, SettingsError
from tests.engine_swap import swapped_engine
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request
from worker.engine.sampler import Sampler
from worker.engine.scheduler import Scheduler
from worker.engine.spec_decode import NgramProposer, choose_num_drafts, ngram_propose, verify
from worker.metrics import _spec

PASSAGE = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk. He polished the "
           "great lens, trimmed the wick, and watched the ships pass safely beyond the rocks.")
COPY_PROMPT = f"Repeat this passage exactly.\n\n{PASSAGE}\n\nRepeated passage:\n{PASSAGE[:40]}"


# -- the proposer -------------------------------------------------------------------
def test_ngram_prefers_the_longest_and_most_recent_match() -> None:
    tokens = [1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 5, 0, 2, 3]
    # Suffix [2, 3]: its last earlier occurrence (index 6) is followed by 7, 6, 5.
    assert ngram_propose(tokens, max_n=4, min_n=2, num_tokens=3) == [7, 6, 5]
    # The longer suffix [0, 2, 3] never occurred before, so n falls back to 2.
    assert ngram_propose(tokens, max_n=3, min_n=3, num_tokens=3) == []
    # A 3-gram match wins over a more recent 2-gram one.
    tokens = [4, 2, 3, 10, 11, 1, 2, 3, 12, 13, 9, 2, 3, 14, 4, 2, 3]
    assert ngram_propose(tokens, max_n=3, min_n=2, num_tokens=2) == [10, 11]


def test_ngram_proposes_what_follows_and_no_more() -> None:
    tokens = [5, 6, 7, 8, 5, 6]
    assert ngram_propose(tokens, max_n=2, min_n=1, num_tokens=10) == [7, 8, 5, 6]
    assert ngram_propose(tokens, max_n=2, min_n=1, num_tokens=1) == [7]
    assert ngram_propose(tokens, max_n=2, min_n=1, num_tokens=0) == []
    assert ngram_propose([1, 2, 3, 4], max_n=2, min_n=1, num_tokens=3) == []  # nothing repeats


def test_adaptive_draft_length() -> None:
    assert choose_num_drafts(0.0, 8, 0.1, 1) == 0  # nothing is ever accepted: off
    assert choose_num_drafts(0.95, 8, 0.01, 1) == 8  # nearly free and nearly always right
    low_batch, high_batch = choose_num_drafts(0.7, 8, 0.1, 1), choose_num_drafts(0.7, 8, 0.1, 64)
    assert low_batch > high_batch  # a large batch pays nearly a token per draft
    proposer = NgramProposer(max_k=5, max_n=3, min_n=1, token_cost=0.1)
    for _ in range(20):
        proposer.record("r", num_drafts=5, num_accepted=0)
    assert proposer.alpha("r") < 0.1
    assert choose_num_drafts(proposer.alpha("r"), 5, 0.1, 1) <= 1


def test_settings_refuse_what_cannot_run() -> None:
    with pytest.raises(SettingsError, match="needs a draft model"):
        EngineSettings(speculative_method="draft")
    with pytest.raises(SettingsError, match="tensor-parallel-size 1"):
        EngineSettings(speculative_method="draft", speculative_model="m", tensor_parallel_size=2)
    with pytest.raises(SettingsError, match="speculative-method"):
        EngineSettings(speculative_method="eagle")
    assert EngineSettings(speculative_method="ngram").num_speculative_tokens == 5


# -- the acceptance rule keeps the target distribution --------------------------------
# Chi-squared critical values at p = 0.001 (df = vocab - 1 = 5, and 3 for top-k 4).
_CHI2_CRIT = {5: 20.52, 3: 16.27}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)])
def test_rejection_sampling_keeps_the_target_distribution(params: SamplingParams) -> None:
    """A tiny-vocab 'model' (fixed logits at three positions), two fixed drafts: the
    first emitted token follows p0, and given the first draft was accepted the second
    follows p1 (Leviathan et al. 2023, Theorem 1). Breaking the rule (accepting with
    probability 1, or not removing the draft on rejection) fails this."""
    vocab, n = 6, 12000
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, vocab, generator=gen) * 1.5
    drafts = [int(logits[0].topk(2).indices[1]), 1]  # the second most likely: often rejected
    sampler = Sampler(torch.device("cpu"), seed=11)
    probs, argmax = sampler.target_probs(logits.clone(), params)
    assert probs is not None
    # Reference target: temperature, then top-k, then softmax.
    ref = logits / params.temperature
    if params.top_k > 0:
        ref = ref.masked_fill(ref < ref.topk(params.top_k, dim=-1).values[:, -1:], float("-inf"))
    torch.testing.assert_close(probs, torch.softmax(ref, dim=-1))
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    generator = sampler.generator("r", params)
    for _ in range(n):
        out = verify(probs, argmax, drafts, generator)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    df = int((probs[0] > 0).sum()) - 1
    assert _chi2(first, probs[0]) < _CHI2_CRIT[df], (first / n, probs[0])
    assert second.sum() > 200
    df = int((probs[1] > 0).sum()) - 1
    assert _chi2(second, probs[1]) < _CHI2_CRIT[df], (second / second.sum(), probs[1])


def test_greedy_verify_takes_the_longest_matching_prefix() -> None:
    argmax = torch.tensor([4, 7, 2, 9])
    assert verify(None, argmax, [4, 7, 3], None) == [4, 7, 2]
    assert verify(None, argmax, [4, 7, 2], None) == [4, 7, 2, 9]  # all accepted: a bonus token
    assert verify(None, argmax, [5, 7, 2], None) == [4]


# -- rollback in the scheduler ------------------------------------------------------------
def test_rejected_drafts_are_rolled_back_and_their_blocks_freed() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    req = Request("r", list(range(10, 16)), SamplingParams(temperature=0.0, max_tokens=20))
    sched.add(req)
    out = sched.schedule()  # prefill of 6 tokens: 2 blocks
    sched.update(out, [50])
    assert (req.num_computed_tokens, len(req.block_table)) == (6, 2)
    req.spec_token_ids = [51, 52, 53, 54, 55]
    out = sched.schedule()
    assert out.scheduled[0].num_tokens == 6 and out.scheduled[0].num_spec_tokens == 5
    assert len(req.block_table) == 3  # positions 6..11
    free_before = bm.num_free_blocks
    sched.update(out, [[60]])  # the first draft rejected: the target's token instead
    assert req.output_token_ids == [50, 60]
    assert req.num_computed_tokens == 7 and req.spec_token_ids == []
    assert len(req.block_table) == 2 and bm.num_free_blocks == free_before + 1
    # Accept two drafts and a bonus: KV through the second draft counts as computed.
    req.spec_token_ids = [61, 62]
    out = sched.schedule()
    sched.update(out, [[61, 62, 63]])
    assert req.output_token_ids == [50, 60, 61, 62, 63] and req.num_computed_tokens == 10
    assert len(req.block_table) == 3
    # Only blocks full of kept tokens are in the prefix cache.
    assert len(req.block_hashes) == 2 and bm.find_cached_prefix(req) == req.block_table[:2]


def test_a_stop_among_accepted_drafts_ends_the_request_there() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    req = Request("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20), eos_token_ids=frozenset({0}))
    sched.add(req)
    sched.update(sched.schedule(), [5])
    req.spec_token_ids = [6, 0, 7]
    results, finished = sched.update(sched.schedule(), [[6, 0, 7, 8]])
    assert results[0].new_token_ids == [6, 0] and finished == [req]
    assert req.finish_reason == "stop" and bm.num_free_blocks == bm.num_blocks


# -- the real model ------------------------------------------------------------------------
@contextmanager
def _small_engine(engine, speculate: bool) -> Iterator[NgramProposer | None]:
    """The shared offline engine with a small scheduler (8 KV blocks, 32 tokens a step:
    preemption and chunked prefill) and, when ``speculate``, an n-gram proposer;
    restored afterwards, with its prefix cache forgotten (the small scheduler's blocks
    overwrote cached KV)."""
    es = EngineSettings(speculative_method="ngram")
    proposer = NgramProposer(es.num_speculative_tokens, es.speculative_ngram_max, es.speculative_ngram_min,
                             es.speculative_token_cost) if speculate else None
    with swapped_engine(engine, proposer, num_blocks=8):
        yield proposer


@pytest.fixture(scope="module")
def prompts(smollm_tokenizer) -> list[list[int]]:
    copy = smollm_tokenizer.encode(COPY_PROMPT)
    edit = smollm_tokenizer.encode(f"Fix the spelling: {PASSAGE.replace('the', 'teh')}\nFixed: {PASSAGE[:30]}")
    plain = smollm_tokenizer.encode("List three uses of a paperclip:")
    return [copy, edit, plain]


@pytest.mark.slow
def test_outputs_are_identical_with_preemption_and_chunks(offline, prompts) -> None:
    """Speculation changes no token: greedy requests, and seeded sampled ones (their
    noise rows follow the positions), in a batch whose small KV cache forces preemption
    and whose 32-token budget chunks the prefills and trims drafts."""
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # Temperature 1 with this seed rejects drafts of the seeded request (checked below):
    # its generator must then rewind to the last emitted token's noise row.
    seeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=1234)
    batch = [*prompts, prompts[0]]
    params = [greedy] * 3 + [seeded]
    engine = offline.engine
    with _small_engine(engine, speculate=False):
        reference = offline.generate(batch, params)
    with _small_engine(engine, speculate=True) as proposer:
        assert proposer is not None
        rejected: set[int] = set()  # request numbers (LLM ids "offline-N") with a rejected draft
        record = proposer.record
        proposer.record = lambda rid, n, a: (rejected.add(int(rid.split("-")[1])) if a < n else None,  # type: ignore[method-assign]
                                             record(rid, n, a))[1]
        outputs = offline.generate(batch, params)
        num_preemptions = engine.scheduler.num_preemptions
        # What the worker's /metrics reads from its engine.
        accepted_metric = _spec(SimpleNamespace(backend=engine), "num_accepted_tokens")
    assert max(rejected) == next(offline._ids) - 1  # the seeded request, added last, had rejections
    assert accepted_metric == proposer.stats.num_accepted_tokens
    assert num_preemptions > 0
    assert proposer.stats.num_verify_steps > 0 and proposer.stats.num_accepted_tokens > 0
    for ref, out in zip(reference, outputs):
        assert out.token_ids == ref.token_ids
