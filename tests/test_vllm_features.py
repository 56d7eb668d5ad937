"""The vLLM backend against our engine on the same inputs (SmolLM2 float32 on CPU, both):
greedy tokens and their logprobs, streamed one step at a time; raw logprobs of sampled
tokens; prompt logprobs; a JSON-schema structured output; a logit bias that bans the
greedy first token; logprobs through the worker's Redis adapter. docs/operations.md, "Logprobs", says what the logprobs are.

One vLLM engine serves the module (about 30 s to start on 2 cores, as in
tests/test_vllm_backend.py). Both engines run float32 (``vllm_dtype``: our ``auto`` is
float32 on CPU), so logprobs differ only by the order of float32 sums in different
kernels: measured at most 6e-5 (vLLM against ours, output and prompt logprobs, and
against Hugging Face's float32 Llama), so ``LOGPROB_TOL`` is 5e-4.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest
import torch

from shared.protocol import TokenLogprobs
from shared.sampling import SamplingParams, StructuredOutput
from worker.backends.base import RequestOutput, RequestRejected

if TYPE_CHECKING:  # vllm may be missing: the module must still import for pytest to skip it
    from worker.backends.vllm import VllmBackend

pytestmark = [pytest.mark.vllm]

LOGPROB_TOL = 5e-4
TEXTS = ["What is the capital of France?", "Write a haiku about the sea.",
         "List three prime numbers and explain why each of them is prime."]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"enum": ["chess", "music", "running"]}, "maxItems": 2}},
    "required": ["name", "age", "hobbies"]}


@pytest.fixture()
def backend(vllm_backend) -> VllmBackend:
    """The session's vLLM engine (tests/conftest.py)."""
    return vllm_backend


@pytest.fixture(scope="module")
def hf_model(smollm_source):
    """The reference where our engine cannot run the same inputs (vLLM's sampled tokens
    come from its own random stream): transformers' Llama, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm_source.path), torch_dtype=torch.float32).eval()


def chat(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True)["input_ids"])


@pytest.fixture(scope="module")
def prompts(smollm_tokenizer) -> list[list[int]]:
    return [chat(smollm_tokenizer, t) for t in TEXTS]


def run(backend, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    """Add ``requests`` (id: prompt, params) to one batch and step until idle; each
    request's outputs, step by step, checked to be contiguous with one logprob entry per
    new token exactly when the request asked for logprobs."""
    for rid, (prompt, params) in requests.items():
        backend.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for _ in range(500):
        if not backend.has_unfinished_requests():
            break
        for out in backend.step():
            steps = outs[out.request_id]
            assert out.first_index == sum(len(o.new_token_ids) for o in steps)
            if requests[out.request_id][1].logprobs is None:
                assert out.logprobs is None
            else:
                assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
            steps.append(out)
    assert not backend.has_unfinished_requests()
    assert all(steps and steps[-1].finish_reason is not None for steps in outs.values())
    return outs


def token_ids(steps: list[RequestOutput]) -> list[int]:
    return [t for o in steps for t in o.new_token_ids]


def logprobs(steps: list[RequestOutput]) -> list[TokenLogprobs]:
    return [lp for o in steps for lp in o.logprobs or ()]


def assert_close(got: list[TokenLogprobs], expected: list[TokenLogprobs], num_top: int) -> None:
    """Same length, each with ``num_top`` alternatives, most likely first; the scored
    token's logprob and the top values within ``LOGPROB_TOL``, the most likely id equal."""
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert len(g.top) == num_top, i
        assert [v for _, v in g.top] == sorted((v for _, v in g.top), reverse=True), i
        assert g.logprob == pytest.approx(e.logprob, abs=LOGPROB_TOL), i
        assert [v for _, v in g.top] == pytest.approx([v for _, v in e.top], abs=LOGPROB_TOL), i
        assert g.top[0][0] == e.top[0][0], i


def reference(hf_model, ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """Hugging Face's log-softmax scoring ``ids[1:]``: entry ``i`` scores ``ids[i + 1]``."""
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    top = lp.topk(num_top)
    return [TokenLogprobs(lp[i, t].item(), list(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True)))
            for i, t in enumerate(ids[1:])]


# -- the conversion alone -------------------------------------------------------------
def test_token_logprobs_converts_vllms_positions() -> None:
    from vllm.logprobs import FlatLogprobs, Logprob

    from worker.backends.vllm import output_logprobs, token_logprobs

    # vLLM's dict: the scored token first (its rank), then the top k (ranks 1..k).
    outside = {7: Logprob(-3.0, 4), 1: Logprob(-0.5, 1), 2: Logprob(-1.0, 2)}
    assert token_logprobs(outside, 7, 2) == TokenLogprobs(-3.0, [(1, -0.5), (2, -1.0)])
    inside = {2: Logprob(-1.0, 2), 1: Logprob(-0.5, 1)}  # the scored token among the top: merged
    assert token_logprobs(inside, 2, 2) == TokenLogprobs(-1.0, [(1, -0.5), (2, -1.0)])
    assert token_logprobs({5: Logprob(-0.1, 1)}, 5, 0) == TokenLogprobs(-0.1, [])
    flat = FlatLogprobs()
    flat.extend([outside, inside])
    assert output_logprobs(flat, [7, 2], 2) == [token_logprobs(outside, 7, 2), token_logprobs(inside, 2, 2)]
    for bad in [lambda: token_logprobs(outside, 9, 2), lambda: token_logprobs(outside, 7, 1),
                lambda: output_logprobs([outside], [7, 2], 2)]:
        with pytest.raises(ValueError):
            bad()


def test_logprobs_map_to_vllms() -> None:
    from worker.backends.vllm import vllm_sampling

    v = vllm_sampling(SamplingParams(logprobs=5, prompt_logprobs=3))
    assert (v.logprobs, v.prompt_logprobs) == (5, 3)
    resumed = vllm_sampling(SamplingParams(max_tokens=8, logprobs=0, prompt_logprobs=3), num_resumed=2)
    assert (resumed.logprobs, resumed.prompt_logprobs) == (0, None)
    assert (vllm_sampling(SamplingParams()).logprobs, vllm_sampling(SamplingParams()).prompt_logprobs) == (None, None)


# -- against our engine ------------------------------------------------------------------
@pytest.mark.slow
def test_greedy_tokens_and_logprobs_equal_inferq(backend, prompts, offline) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5)
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    requests = {f"lp{i}": (p, params) for i, p in enumerate(prompts)} | {"plain": (prompts[0], plain)}
    got = run(backend, requests)
    expected = offline.generate(prompts, params)
    for i, exp in enumerate(expected):
        steps = got[f"lp{i}"]
        assert len(steps) == len(exp.token_ids)  # one token per step: every delta is checked
        assert token_ids(steps) == exp.token_ids, i
        assert_close(logprobs(steps), exp.logprobs, 5)
        for out in steps:  # greedy: each step's token is its own most likely one
            assert [lp.top[0][0] for lp in out.logprobs] == out.new_token_ids
    assert token_ids(got["plain"]) == expected[0].token_ids  # asking for logprobs changes nothing


@pytest.mark.slow
def test_sampled_logprobs_are_raw(backend, prompts, hf_model) -> None:
    """At temperature 1.5 with top-k the logprobs are still the model's own (vLLM's
    default ``raw_logprobs``, as ours), and ``logprobs=0`` gives no alternatives."""
    params = SamplingParams(max_tokens=6, temperature=1.5, top_k=20, seed=3, logprobs=0)
    steps = run(backend, {"hot": (prompts[1], params)})["hot"]
    ids = token_ids(steps)
    ref = reference(hf_model, prompts[1] + ids, 1)[len(prompts[1]) - 1:]
    assert [lp.top for lp in logprobs(steps)] == [[]] * len(ids)
    assert [lp.logprob for lp in logprobs(steps)] == pytest.approx([r.logprob for r in ref], abs=LOGPROB_TOL)


@pytest.mark.slow
def test_prompt_logprobs_equal_inferq(backend, prompts, offline) -> None:
    """P - 1 entries on the first output only, entry i scoring prompt[i + 1], close to
    ours; the prefix cache does not shorten them; a resumed request gets none."""
    prompt = prompts[2]
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=4)
    (ours,) = offline.generate([prompt], params)
    assert ours.prompt_logprobs is not None and len(ours.prompt_logprobs) == len(prompt) - 1
    first = run(backend, {"p": (prompt, params)})["p"]
    again = run(backend, {"p2": (prompt, params)})["p2"]  # the prompt is cached now
    for steps in (first, again):
        got = steps[0].prompt_logprobs
        assert got is not None and len(got) == len(prompt) - 1
        assert all(out.prompt_logprobs is None for out in steps[1:])
        assert_close(got, ours.prompt_logprobs, 4)
    assert again[0].num_cached_tokens == 0  # vLLM reads no cache for a request that scores its prompt
    backend.add_request("r", prompt, params, output_token_ids=token_ids(first)[:1])
    outs = []
    while backend.has_unfinished_requests():
        outs += backend.step()
    assert outs and all(out.prompt_logprobs is None for out in outs)


@pytest.mark.slow
def test_json_schema_output_validates_on_both(backend, offline, smollm_tokenizer, smollm_source) -> None:
    """The same greedy answer through the same grammar engine (llguidance); vLLM then
    samples the EOS token its finished grammar forces, where ours stops."""
    import jsonschema_rs

    from shared.model_source import eos_token_ids

    prompt = chat(smollm_tokenizer, "Describe a person as JSON.")
    structured = StructuredOutput(kind="json_schema", spec=json.dumps(PERSON, sort_keys=True))
    params = SamplingParams(max_tokens=100, temperature=0.0, structured=structured)
    ours = offline.generate([prompt], params)[0]
    theirs = run(backend, {"json": (prompt, params)})["json"]
    assert (ours.finish_reason, theirs[-1].finish_reason) == ("stop", "stop")
    assert token_ids(theirs)[:-1] == ours.token_ids and token_ids(theirs)[-1] in eos_token_ids(smollm_source.config)
    jsonschema_rs.validate(PERSON, json.loads(smollm_tokenizer.decode(ours.token_ids)))
    with pytest.raises(RequestRejected, match="after the grammar mask"):  # vLLM's would be of the masked distribution
        backend.add_request("json-lp", prompt, SamplingParams(structured=structured, logprobs=1))
    assert not backend.has_unfinished_requests()


@pytest.mark.slow
def test_logit_bias_ban_changes_the_first_token_alike(backend, prompts, offline) -> None:
    probe = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2)
    (before,) = offline.generate([prompts[0]], probe)
    greedy_first, runner_up = (t for t, _ in before.logprobs[0].top)
    banned = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, logit_bias=((greedy_first, -100.0),))
    (ours,) = offline.generate([prompts[0]], banned)
    theirs = run(backend, {"ban": (prompts[0], banned)})["ban"]
    assert ours.token_ids[0] == runner_up != greedy_first
    assert token_ids(theirs) == ours.token_ids
    # Raw logprobs: the banned token is still the model's most likely on both.
    assert logprobs(theirs)[0].top[0][0] == ours.logprobs[0].top[0][0] == greedy_first


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_worker_publishes_vllm_logprobs(backend, prompts, client) -> None:
    """Through the worker's Redis adapter (``worker/service.py``): the first
    ``TokenOutput`` carries the prompt logprobs, every one a logprob per token."""

    from tests.test_worker_paths import serve_one

    prompt = prompts[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=1)
    got = await serve_one(client, backend, "tvlp", "vlp", prompt, params)
    ids = [t for out in got for t in out.token_ids]
    assert len(ids) == 4 and all(len(out.logprobs) == len(out.token_ids) for out in got)
    assert [lp.top[0][0] for out in got for lp in out.logprobs] == ids  # greedy
    assert len(got[0].prompt_logprobs) == len(prompt) - 1 and all(len(lp.top) == 1 for lp in got[0].prompt_logprobs)
    assert all(out.prompt_logprobs is None for out in got[1:])
