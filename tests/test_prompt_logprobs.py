"""Prompt logprobs (``SamplingParams.prompt_logprobs``, worker/engine/prompt_logprobs.py)
on the real SmolLM2 (CPU, float32) against a log-softmax of Hugging Face transformers'
logits over the prompt: in one chunk, over several prefill chunks, beside a request
that does not ask, with a prompt whose prefix is cached, and not for a continuation."""

from __future__ import annotations

import pytest
import torch

from shared.protocol import TokenLogprobs
from shared.sampling import InvalidParameter, SamplingParams
from shared.settings import EngineSettings, ModelSettings
from tests.test_logprobs import hf_model  # noqa: F401 (the module-scoped reference model)
from worker.backends.base import RequestRejected
from worker.backends.sim import SimBackend
from worker.engine.prompt_logprobs import prompt_spans
from worker.engine.request import Request
from worker.engine.step_types import ScheduledRequest

TEXT = ("The capital of France is Paris, and the capital of Germany is Berlin. Rivers run to the sea, "
        "and the sea is salt. def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)")
TOP = 5


@pytest.fixture(scope="module")
def chunked(smollm_source):
    """An engine whose steps hold 16 tokens at most: a prompt is prefilled in chunks."""
    from worker.llm import LLM

    return LLM(dtype="float32", device="cpu", max_num_batched_tokens=16, num_kv_blocks=64, max_num_seqs=4)


def check_against_reference(hf, prompt_ids: list[int], entries: list[TokenLogprobs] | None) -> None:
    """``entries[i]`` is ``prompt_ids[i + 1]``'s logprob and the top ``TOP`` of the
    distribution that predicted it, within 2e-3 of transformers' float32 log-softmax."""
    assert entries is not None and len(entries) == len(prompt_ids) - 1
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt_ids])).logits[0, :-1].float(), dim=-1)
    for i, lp in enumerate(entries):
        assert lp.logprob == pytest.approx(ref[i, prompt_ids[i + 1]].item(), abs=2e-3), i
        ref_top = ref[i].topk(TOP)
        assert [v for _, v in lp.top] == pytest.approx(ref_top.values.tolist(), abs=2e-3), i
        for token, value in lp.top:  # the ids: each scores its own value (ties may swap order)
            assert value == pytest.approx(ref[i, token].item(), abs=2e-3), i


def test_one_chunk_matches_reference_beside_a_request_that_does_not_ask(offline, hf_model) -> None:  # noqa: F811
    prompt = offline.encode(TEXT)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    asked = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=TOP)
    plain, other = offline.generate([prompt, prompt[:12]], greedy)
    out, beside = offline.generate([prompt, prompt[:12]], [asked, greedy])
    check_against_reference(hf_model, prompt, out.prompt_logprobs)
    assert out.token_ids == plain.token_ids and beside.token_ids == other.token_ids  # greedy unchanged
    assert beside.prompt_logprobs is None and plain.prompt_logprobs is None
    assert out.logprobs == []  # prompt logprobs do not bring output logprobs


def test_chunked_prefill_with_a_cached_prefix(chunked, offline, hf_model) -> None:  # noqa: F811
    """Over 16-token chunks, in a batch with a request that does not ask, and for a prompt
    whose first blocks another request has just put in the prefix cache: every entry."""
    prompt = chunked.encode(TEXT)
    assert len(prompt) > 3 * 16
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    (warm,) = chunked.generate([prompt[:40]], greedy)  # caches the first two blocks
    out, beside = chunked.generate([prompt, prompt[:20]],
                                   [SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=TOP), greedy])
    check_against_reference(hf_model, prompt, out.prompt_logprobs)
    assert out.num_cached_tokens == 0  # it bypassed the cache (a cached block has no logits)
    assert beside.num_cached_tokens == 16 and beside.prompt_logprobs is None  # the cache still serves others
    (plain,) = offline.generate([prompt], greedy)
    assert out.token_ids == plain.token_ids
    assert warm.prompt_logprobs is None


def test_continuation_and_one_token_prompt(chunked) -> None:
    """A failover continuation gets none (its client has them); a one-token prompt an
    empty list; ``prompt_logprobs=0`` entries without alternatives."""
    engine = chunked.engine
    prompt = chunked.encode(TEXT)[:20]
    engine.add_request("resumed", prompt, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2),
                       output_token_ids=[11])
    engine.add_request("one", prompt[:1], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))
    engine.add_request("zero", prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert all(out.prompt_logprobs is None for got in outs.values() for out in got[1:])  # first output only
    firsts = {rid: got[0] for rid, got in outs.items()}
    assert firsts["resumed"].first_index == 1 and firsts["resumed"].prompt_logprobs is None
    assert firsts["one"].prompt_logprobs == []
    zero = firsts["zero"].prompt_logprobs
    assert zero is not None and len(zero) == 19 and all(lp.top == [] for lp in zero)


def test_spans_skip_positions_already_gathered() -> None:
    """After a preemption mid-prefill the request computes from position 0 again; only
    the positions it has no entry for are scored, and none past the prompt's last but one."""
    params = SamplingParams(prompt_logprobs=3)
    r = Request("r", list(range(1, 31)), params, prompt_logprobs=[TokenLogprobs(-1.0)] * 10)
    plain = Request("p", [1, 2, 3, 4], SamplingParams())
    spans = prompt_spans([ScheduledRequest(plain, 4), ScheduledRequest(r, 16)])
    assert [(s.item, s.row, s.first, s.num, s.num_top) for s in spans] == [(1, 4 + 10, 10, 6, 3)]
    r.num_computed_tokens = 16
    (last,) = prompt_spans([ScheduledRequest(r, 14)])
    assert (last.row, last.first, last.num) == (0, 16, 13)  # positions 16..28 score tokens 17..29
    r.prompt_logprobs = None  # delivered
    assert prompt_spans([ScheduledRequest(r, 14)]) == []


def test_validation_and_sim_backend_refuses() -> None:
    SamplingParams(prompt_logprobs=0).validate()
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(prompt_logprobs=21).validate()
    assert err.value.param == "prompt_logprobs"
    sim = SimBackend(ModelSettings(max_model_len=64), EngineSettings(), step_time_ms=0.0)
    with pytest.raises(RequestRejected, match="prompt_logprobs"):
        sim.add_request("a", [1, 2, 3], SamplingParams(prompt_logprobs=1))
    assert not sim.has_unfinished_requests()


@pytest.mark.timeout(120)
async def test_worker_publishes_prompt_logprobs_on_the_first_entry(smollm_source, offline, client) -> None:
    """The worker's Redis adapter carries the engine's prompt logprobs into the
    request's first ``TokenOutput`` only."""

    from tests.test_worker_paths import serve_one
    from worker.backends.inferq import InferqBackend

    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    prompt = offline.encode(TEXT)[:24]
    (want,) = offline.generate([prompt], params)
    backend = InferqBackend(smollm_source, ModelSettings(dtype="float32", device="cpu", max_model_len=256),
                            EngineSettings(num_kv_blocks=64, max_num_seqs=4))
    got = await serve_one(client, backend, "tpl", "pl", prompt, params)
    assert got[0].prompt_logprobs is not None and all(out.prompt_logprobs is None for out in got[1:])
    assert len(got[0].prompt_logprobs) == len(prompt) - 1
    for lp, ref in zip(got[0].prompt_logprobs, want.prompt_logprobs, strict=True):
        assert lp.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert [t for t, _ in lp.top] == [t for t, _ in ref.top]
