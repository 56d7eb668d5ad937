"""Speculative decoding with a draft model (worker/engine/draft_proposer.py): outputs of the
real default model are token-identical with a draft on (the same model as draft: nearly
every draft accepted; a tiny random draft of the same vocabulary: few accepted, under
preemption and chunked prefill); the draft's KV rollback; its blocks freed; a draft of
another vocabulary refused; the engine's KV budget counting the draft's blocks; on CUDA,
the same with the draft's graphs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from shared.model_source import DUMMY_CONFIGS, ModelSource
from shared.sampling import SamplingParams
from shared.settings import EngineSettings, ModelSettings, SettingsError
from tests.engine_swap import swapped_engine
from worker.engine.draft_proposer import DraftProposer, check_shared_vocab, draft_num_blocks, load_draft_model
from worker.engine.engine import num_kv_blocks
from worker.engine.request import Request
from worker.models.config import ModelConfig
from worker.models.loader import build_model

#: A draft of the default model's vocabulary, two layers of width 64, random weights.
TINY = {**DUMMY_CONFIGS["SmolLM2-135M"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
NUM_TARGET_BLOCKS = 8  # with a 32-token step budget: preemption and chunked prefill
ES = EngineSettings(speculative_method="draft", speculative_model="SmolLM2-135M-Instruct", block_size=16)


@pytest.fixture(scope="module")
def tiny_draft():
    return build_model(ModelConfig.from_hf(TINY), None, True, torch.float32, torch.device("cpu"), 2048, seed=5)


@contextmanager
def _with_draft(engine, draft, small: bool) -> Iterator[DraftProposer | None]:
    """The shared offline engine, with a small scheduler when ``small``, and, unless
    ``draft`` is None, a draft proposer over ``draft``; restored afterwards, its prefix
    cache forgotten."""
    proposer = None if draft is None else DraftProposer(
        draft, ES, draft_num_blocks(NUM_TARGET_BLOCKS, ES), engine.max_model_len, torch.float32, engine.device)
    with swapped_engine(engine, proposer, num_blocks=NUM_TARGET_BLOCKS if small else None):
        yield proposer


@pytest.fixture(scope="module")
def prompts(smollm_tokenizer) -> list[list[int]]:
    # About 30 tokens each: three of them and a sibling outgrow the 8 blocks (preemption).
    texts = [("The old lighthouse keeper climbed the spiral stairs every evening at dusk and polished "
             "the great lens. List three things he saw:"),
             ("Our office will be closed on Monday for the public holiday, and orders placed over the "
             "weekend ship on Tuesday. Summarise this notice:"),
             ("A merge of two sorted lists walks both with two indices and appends the smaller head "
             "each time. Explain why it is linear:")]
    return [smollm_tokenizer.encode(t) for t in texts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=99)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["same", "tiny"])
def test_outputs_are_identical_with_a_draft_model(which, offline, prompts, tiny_draft) -> None:
    """The same model as its own draft proposes the target's greedy tokens (acceptance
    near 1; wrong draft inputs or KV would lower it); a tiny random draft is mostly
    rejected, under a small scheduler (preemption, chunked prefill; the same model as
    draft costs a forward pass per draft, too slow for that here). Either way no token
    changes and every draft block is free afterwards (finished and preempted requests
    release theirs)."""
    engine = offline.engine
    small = which == "tiny"
    batch = [*prompts, prompts[0]] if small else [prompts[0], prompts[1], prompts[0]]
    params = [GREEDY] * (len(batch) - 1) + [SEEDED]
    with _with_draft(engine, None, small):
        reference = [o.token_ids for o in offline.generate(batch, params)]
    draft = engine.runner.model if which == "same" else tiny_draft
    with _with_draft(engine, draft, small) as proposer:
        assert proposer is not None
        counts: dict[str, list[int]] = {}  # request id -> [drafts verified, accepted]
        record = proposer.record

        def spy(request_id: str, num_drafts: int, num_accepted: int) -> None:
            c = counts.setdefault(request_id, [0, 0])
            c[0], c[1] = c[0] + num_drafts, c[1] + num_accepted
            record(request_id, num_drafts, num_accepted)

        proposer.record = spy  # type: ignore[method-assign]
        outputs = offline.generate(batch, params)
        num_preemptions = engine.scheduler.num_preemptions if small else 1
    seeded_id = f"offline-{next(offline._ids) - 1}"  # added last
    stats = proposer.stats
    assert num_preemptions > 0 and stats.num_verify_steps > 0
    num_drafts, num_accepted = map(sum, zip(*(c for rid, c in counts.items() if rid != seeded_id)))
    if which == "same":  # greedy requests: the draft's argmax is the target's
        assert num_accepted / num_drafts > 0.9, counts
    else:
        assert stats.acceptance_rate < 0.3, stats
    assert stats.proposer_time_s > 0
    assert [o.token_ids for o in outputs] == reference
    bm = proposer.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not proposer._seqs


def test_rejected_drafts_kv_is_rolled_back(tiny_draft) -> None:
    """After a verify step that kept ``a`` of ``k`` drafts, the draft's KV covers the
    request's tokens up to and including the ``a`` accepted drafts, and no more blocks."""
    es = EngineSettings(speculative_method="draft", speculative_model="x", block_size=4, num_speculative_tokens=6)
    proposer = DraftProposer(tiny_draft, es, 32, 256, torch.float32, torch.device("cpu"))
    req = Request("r", list(range(100, 109)), SamplingParams(temperature=0.0, max_tokens=20))
    req.num_computed_tokens = req.num_tokens - 1  # the target has prefilled it
    proposer._propose([(req, 6)])
    drafts = req.spec_token_ids
    seq = proposer._seqs["r"]
    assert len(drafts) == 6 and seq.num_computed_tokens == 9 + 5 and len(seq.block_table) == 4
    # The target accepts two drafts and emits its own token instead of the third.
    req.token_ids += [*drafts[:2], (drafts[2] + 1) % TINY["vocab_size"]]
    proposer._sync(req)
    assert seq.num_computed_tokens == 9 + 2 and len(seq.block_table) == 3
    assert seq.token_ids == req.token_ids
    # Every draft accepted and a bonus token: the KV of the k - 1 drafts it wrote stays.
    req.num_computed_tokens = req.num_tokens - 1
    proposer._propose([(req, 3)])
    n = req.num_tokens
    req.token_ids += [*req.spec_token_ids, 7]
    proposer._sync(req)
    assert seq.num_computed_tokens == n + 2
    proposer.preempted("r")
    assert proposer.block_manager.num_free_blocks == 32 and not proposer._seqs


def _folder(tmp_path: Path, name: str, config: dict, vocab: dict[str, int] | None = None) -> ModelSource:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if vocab is not None:
        (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))
    return ModelSource(name, folder, config, dummy=True)


def test_a_draft_of_another_vocabulary_is_refused(tmp_path) -> None:
    target = _folder(tmp_path, "target", TINY, {"a": 0, "b": 1})
    with pytest.raises(SettingsError, match="--speculative-model.*vocab_size is 151936, the target's 49152"):
        check_shared_vocab(target, _folder(tmp_path, "qwen", {**TINY, "vocab_size": 151936}), "qwen")
    with pytest.raises(SettingsError, match="tokenizer differs"):
        check_shared_vocab(target, _folder(tmp_path, "other", TINY, {"a": 1, "b": 0}), "other")
    check_shared_vocab(target, _folder(tmp_path, "same", TINY, {"a": 0, "b": 1}), "same")
    check_shared_vocab(target, _folder(tmp_path, "none", TINY), "none")  # nothing to compare: the sizes agree


def test_the_draft_loads_and_shares_the_kv_budget(tmp_path) -> None:
    draft = _folder(tmp_path, "draft", TINY)
    es = EngineSettings(speculative_method="draft", speculative_model=str(draft.path),
                        speculative_model_load_format="dummy", kv_cache_bytes=64 * 2**20)
    model = load_draft_model(es, ModelSettings(), _folder(tmp_path, "target", TINY), torch.float32,
                             torch.device("cpu"), 512)
    assert model.config.hidden_size == 64
    target_cfg = ModelConfig.from_hf(DUMMY_CONFIGS["SmolLM2-135M"])
    alone = num_kv_blocks(target_cfg, es, torch.float32, torch.device("cpu"))
    shared = num_kv_blocks(target_cfg, es, torch.float32, torch.device("cpu"), model.config)
    per_token = target_cfg.kv_bytes_per_token(4), model.config.kv_bytes_per_token(4)
    assert shared == 64 * 2**20 // ((per_token[0] + per_token[1]) * es.block_size) < alone
    # Room for the target's tokens plus k - 1 drafts and a partial block per sequence.
    assert draft_num_blocks(10, es) == 10 + es.max_num_seqs * 2


@pytest.mark.cuda
@pytest.mark.parametrize("draft_config", [DUMMY_CONFIGS["SmolLM2-135M"], TINY], ids=["same-weights", "tiny"])
def test_draft_model_changes_no_token_on_cuda(draft_config, tmp_path) -> None:
    """Dummy weights, float32, CUDA graphs: a draft with the target's config (and so, with
    the same seed, its weights: acceptance near 1) or a tiny one; the draft's one-token
    steps replay its own decode graphs."""
    import gc
    import random

    from worker.llm import LLM

    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **draft_config}))
    rng = random.Random(3)
    prompts = [[rng.randrange(49152) for _ in range(n)] for n in (7, 40, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = []
    for method in ("off", "draft"):
        llm = LLM(model="SmolLM2-135M", load_format="dummy", dtype="float32", device="cuda", num_kv_blocks=256,
                  max_num_seqs=8, max_num_batched_tokens=128, max_model_len=1024, speculative_method=method,
                  speculative_model=str(folder) if method == "draft" else "", speculative_model_load_format="dummy")
        outputs.append([o.token_ids for o in llm.generate(prompts, params)])
        proposer = llm.engine.proposer
        if proposer is not None:
            stats = proposer.stats
            assert stats.num_verify_steps > 0
            assert proposer.graphs is not None and proposer.graphs.num_replays > 0
            assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks
            if draft_config is not TINY:
                assert stats.acceptance_rate > 0.9, stats
        del llm, proposer
        gc.collect()
        torch.cuda.empty_cache()
    assert outputs[0] == outputs[1]
