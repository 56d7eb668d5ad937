"""Logprobs (docs/operations.md, "Logprobs"): the engine's raw logprobs against a
log-softmax of Hugging Face transformers' logits for the same sequence, greedy output
unchanged by asking for them, the wire format, and parameter validation."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from shared import protocol
from shared.protocol import TokenBatch, TokenLogprobs, TokenOutput
from shared.sampling import InvalidParameter, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def hf_model(smollm_source):
    """The reference path: transformers' own Llama over the same weights, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm_source.path), torch_dtype=torch.float32).eval()


def reference_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """``[len(output_ids), vocab]`` log-softmax of the logits that predicted each output token."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt_ids) - 1:].float()
    return torch.log_softmax(logits, dim=-1)


def test_greedy_logprobs_match_reference_and_leave_output_unchanged(offline, hf_model) -> None:
    plain = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    asked = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, logprobs=5))
    for without, out in zip(plain, asked, strict=True):
        assert out.token_ids == without.token_ids
        assert without.logprobs == []
        assert len(out.logprobs) == len(out.token_ids)
        ref = reference_logprobs(hf_model, out.prompt_token_ids, out.token_ids)
        for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert len(lp.top) == 5
            top_ids = [t for t, _ in lp.top]
            top_values = [v for _, v in lp.top]
            assert top_values == sorted(top_values, reverse=True)
            assert top_ids[0] == token  # greedy: the sampled token is the most likely
            assert lp.logprob == pytest.approx(top_values[0])
            assert lp.logprob == pytest.approx(ref[i, token].item(), abs=2e-3)
            ref_top = ref[i].topk(5)
            assert top_values == pytest.approx(ref_top.values.tolist(), abs=2e-3)


def test_sampled_logprobs_are_raw_and_top_zero_gives_none(offline, hf_model) -> None:
    """At temperature 1.5 with top-k the sampled token's logprob is still the raw model's
    (vLLM's default ``raw_logprobs``), and ``logprobs=0`` gives no alternatives."""
    params = SamplingParams(temperature=1.5, top_k=20, seed=7, max_tokens=6, logprobs=0)
    (out,) = offline.generate(PROMPTS[:1], params)
    ref = reference_logprobs(hf_model, out.prompt_token_ids, out.token_ids)
    assert [lp.top for lp in out.logprobs] == [[]] * len(out.token_ids)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert lp.logprob == pytest.approx(ref[i, token].item(), abs=2e-3)
        assert lp.logprob <= 0.0


def test_mixed_batch_only_asking_rows_get_logprobs(offline) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=4, logprobs=2), SamplingParams(temperature=0.0, max_tokens=4)]
    asked, plain = offline.generate(PROMPTS, params)
    assert len(asked.logprobs) == 4 and all(len(lp.top) == 2 for lp in asked.logprobs)
    assert plain.logprobs == []


def test_validation() -> None:
    SamplingParams(logprobs=0).validate()
    SamplingParams(logprobs=20).validate()
    for bad in (-1, 21):
        with pytest.raises(InvalidParameter) as err:
            SamplingParams(logprobs=bad).validate()
        assert err.value.param == "logprobs"


def test_wire_round_trip_and_absent_when_not_asked() -> None:
    lps = [TokenLogprobs(-0.5, [(3, -0.5), (9, -1.25)]), TokenLogprobs(-2.0, [])]
    batch = TokenBatch(worker_id="w", outputs=[
        TokenOutput(request_id="a", attempt=0, first_index=0, token_ids=[3, 4], logprobs=lps),
        TokenOutput(request_id="b", attempt=0, first_index=0, token_ids=[5])])
    back = protocol.decode(protocol.encode(batch))
    assert isinstance(back, TokenBatch)
    assert back.outputs[0].logprobs == lps and back.outputs[1].logprobs is None
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(batch.outputs[1]))
    assert "logprobs" not in plain  # a request without logprobs pays nothing on the wire
    assert math.isclose(back.outputs[0].logprobs[0].top[1][1], -1.25)


@pytest.mark.timeout(120)
async def test_worker_publishes_logprobs(smollm_source, offline, client) -> None:
    """The worker's Redis adapter (``worker/service.py``) carries each token's logprobs
    from the real engine into its ``TokenOutput``s."""

    from shared.settings import EngineSettings, ModelSettings
    from tests.test_worker_paths import serve_one
    from worker.backends.inferq import InferqBackend

    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3)
    prompt = offline.encode(PROMPTS[0])
    (want,) = offline.generate([prompt], params)
    backend = InferqBackend(smollm_source, ModelSettings(dtype="float32", device="cpu", max_model_len=256),
                            EngineSettings(num_kv_blocks=64, max_num_seqs=4))
    got = await serve_one(client, backend, "tlp", "lp", prompt, params)
    ids = [t for out in got for t in out.token_ids]
    logprobs = [lp for out in got for lp in out.logprobs or ()]
    assert ids == want.token_ids and len(logprobs) == len(ids)
    for lp, ref in zip(logprobs, want.logprobs, strict=True):
        assert lp.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert [t for t, _ in lp.top] == [t for t, _ in ref.top]


@pytest.mark.cuda
def test_cuda_graphs_and_async_path() -> None:
    """On CUDA (graphs, async scheduling): greedy output with logprobs equals greedy
    output without, in a batch where only some requests ask; the pinned copies arrive
    whole (each sampled token's logprob is its row's top-1)."""
    from worker.llm import LLM

    llm = LLM(model="SmolLM2-135M", load_format="dummy", dtype="float32", device="cuda", num_kv_blocks=256,
              max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)
    prompts = [[1 + i, 7, 9 + i, 11] for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = llm.generate(prompts, greedy)
    mixed = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=4 if i % 2 else None)
             for i in range(len(prompts))]
    asked = llm.generate(prompts, mixed)
    for i, (a, b) in enumerate(zip(plain, asked, strict=True)):
        assert a.token_ids == b.token_ids
        if i % 2 == 0:
            assert b.logprobs == []
            continue
        assert len(b.logprobs) == len(b.token_ids)
        for token, lp in zip(b.token_ids, b.logprobs, strict=True):
            assert lp.top[0][0] == token and lp.logprob == pytest.approx(lp.top[0][1])
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.mark.cuda
def test_cuda_prompt_logprobs_agree_with_output_logprobs() -> None:
    """On CUDA (Triton attention, graphs, async scheduling): the prompt logprobs of a
    prompt that is another request's prompt + greedy output (an eager prefill, over
    several chunks) equal that request's output logprobs (decode graphs), and requests
    that do not ask, in the same batches, keep their greedy tokens."""
    from worker.llm import LLM

    llm = LLM(model="SmolLM2-135M", load_format="dummy", dtype="float32", device="cuda", num_kv_blocks=256,
              max_num_seqs=8, max_num_batched_tokens=16, max_model_len=512)
    prompts = [[1 + i, 7, 9 + i, 11] * 5 for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=4))
    extended = [p + out.token_ids for p, out in zip(prompts, first, strict=True)]
    plain = llm.generate(extended, greedy)
    eager_before = llm.engine.runner.num_eager_steps
    mixed = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=4 if i % 2 else None)
             for i in range(len(extended))]
    asked = llm.generate(extended, mixed)
    assert llm.engine.runner.num_eager_steps > eager_before  # the scoring steps ran eagerly
    for i, (a, b) in enumerate(zip(plain, asked, strict=True)):
        assert a.token_ids == b.token_ids
        if i % 2 == 0:
            assert b.prompt_logprobs is None
            continue
        assert b.prompt_logprobs is not None and len(b.prompt_logprobs) == len(extended[i]) - 1
        scored = b.prompt_logprobs[len(prompts[i]) - 1:]  # the positions that predicted first[i]'s tokens
        for lp, ref in zip(scored, first[i].logprobs, strict=True):
            assert lp.logprob == pytest.approx(ref.logprob, abs=2e-3)
            assert [v for _, v in lp.top] == pytest.approx([v for _, v in ref.top], abs=2e-3)
