"""The vLLM backend in-process on SmolLM2 float32 (CPU): greedy outputs equal our engine's,
resumes continue, aborts free vLLM's KV cache, pulling stops while vLLM has a queue.

One vLLM engine serves the whole module (about 30 s to start on 2 cores): eager mode,
max_model_len 1024, a 128 MiB KV cache (22 blocks of 128 tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from shared.sampling import SamplingParams
from worker.backends.base import RequestOutput, RequestRejected

if TYPE_CHECKING:  # vllm may be missing: the module must still import for pytest to skip it
    from worker.backends.vllm import VllmBackend

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
TEXTS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each of them is prime.",
    "The quick brown fox jumps over the lazy dog. " * 8,
    "Once upon a time, in a kingdom by the mountains, there lived a clockmaker who " * 12,
]


@pytest.fixture()
def backend(vllm_backend) -> VllmBackend:
    """The session's vLLM engine (tests/conftest.py)."""
    return vllm_backend


@pytest.fixture(scope="module")
def prompts(smollm_tokenizer) -> list[list[int]]:
    """Six prompts of 2 to about 200 tokens, chat-templated like the gateway does."""
    return [list(smollm_tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                      tokenize=True)["input_ids"]) for t in TEXTS]


def run_all(backend, max_steps: int = 500) -> dict[str, tuple[list[int], str]]:
    """Step until idle; every (not resumed) request's output ids and finish reason,
    checking that indices are contiguous and nothing follows a finish."""
    got: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for _ in range(max_steps):
        if not backend.has_unfinished_requests():
            break
        out: RequestOutput
        for out in backend.step():
            ids = got.setdefault(out.request_id, [])
            assert out.request_id not in finish, "output after the finish"
            assert out.first_index == len(ids)
            ids.extend(out.new_token_ids)
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
    assert not backend.has_unfinished_requests()
    assert set(finish) == set(got)
    return {rid: (ids, finish[rid]) for rid, ids in got.items()}


def assert_idle(backend) -> None:
    s = backend.stats()
    assert (s.num_running, s.num_waiting, s.kv_usage) == (0, 0, 0.0)
    assert s.num_free_blocks == s.num_blocks


def test_greedy_equals_inferq_engine(backend, prompts, offline, smollm_source) -> None:
    from shared.model_source import eos_token_ids

    assert len({len(p) for p in prompts}) == 6 and max(len(p) for p in prompts) > 150
    for i, p in enumerate(prompts):
        backend.add_request(f"g{i}", p, GREEDY)
    got = run_all(backend)
    expected = offline.generate(prompts, GREEDY)
    eos = eos_token_ids(smollm_source.config)
    for i, exp in enumerate(expected):
        assert got[f"g{i}"] == (exp.token_ids, exp.finish_reason), f"prompt {i} ({len(prompts[i])} tokens)"
        if exp.finish_reason == "length":
            assert len(exp.token_ids) == GREEDY.max_tokens and not eos & set(exp.token_ids)
        else:  # ends on the EOS token it stopped on, and on no earlier one
            assert exp.finish_reason == "stop" and exp.token_ids[-1] in eos and not eos & set(exp.token_ids[:-1])
    # Both ends are covered: a short chat answer stops on EOS, longer ones run to max_tokens.
    assert {exp.finish_reason for exp in expected} == {"stop", "length"}
    assert all(len(exp.token_ids) >= 8 for exp in expected), [len(exp.token_ids) for exp in expected]
    assert_idle(backend)


def test_resumed_request_continues_after_delivered_tokens(backend, prompts) -> None:
    backend.add_request("whole", prompts[5], GREEDY)
    whole, whole_finish = run_all(backend)["whole"]
    num_delivered = len(whole) // 2
    assert num_delivered >= 4
    hits_before = backend.stats().prefix_cache_hits
    backend.add_request("resumed", prompts[5], GREEDY, output_token_ids=whole[:num_delivered])
    outs = []
    while backend.has_unfinished_requests():
        outs += backend.step()
    assert outs[0].first_index == num_delivered and outs[0].num_prompt_tokens == len(prompts[5])
    assert whole[:num_delivered] + [t for o in outs for t in o.new_token_ids] == whole
    assert outs[-1].finish_reason == whole_finish
    # The resumed request found what "whole" left in the cache: every full 128-token block
    # of its prompt (the prompt plus the delivered tokens), not counting the last token,
    # which vLLM always computes.
    num_full_blocks = (len(prompts[5]) + num_delivered - 1) // 128
    assert num_full_blocks >= 1
    assert backend.stats().prefix_cache_hits - hits_before == 128 * num_full_blocks


def test_abort_frees_the_request_in_vllm(backend, prompts) -> None:
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    backend.add_request("run", prompts[5], long)
    backend.add_request("queued", prompts[4], long)
    assert backend.abort("queued")  # never stepped: leaves vLLM's waiting queue
    for _ in range(3):
        backend.step()
    s = backend.stats()
    assert (s.num_running, s.num_waiting) == (1, 0) and s.kv_usage > 0.0
    assert backend.abort("run") and not backend.abort("run") and not backend.abort("never-seen")
    assert not backend.has_unfinished_requests()
    assert_idle(backend)
    assert backend.step() == []  # nothing more comes out of an aborted request


def test_pulls_nothing_while_vllm_leaves_requests_waiting(backend) -> None:
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    assert backend.num_admittable() == backend.max_num_seqs == 8
    for i in range(9):  # one more than vLLM's max_num_seqs
        backend.add_request(f"w{i}", [1, 2, 3, 4 + i], short)
    assert backend.num_admittable() == 0
    assert backend.stats().num_waiting_prefill_tokens == 9 * 4  # nothing computed yet
    num_tokens = len([t for out in backend.step() for t in out.new_token_ids])
    s = backend.stats()
    assert (s.num_running, s.num_waiting) == (8, 1)
    assert s.num_waiting_prefill_tokens == 4  # the one left waiting
    assert not backend.take_kv_events() and backend.max_num_batched_tokens > 0  # vLLM's hashes are not ours
    assert backend.num_admittable() == 0  # vLLM kept one waiting: leave the rest in Redis
    while backend.has_unfinished_requests():
        num_tokens += len([t for out in backend.step() for t in out.new_token_ids])
    assert num_tokens == 9 * 2
    assert backend.num_admittable() == 8


def test_rejects_what_cannot_run(backend) -> None:
    ok = SamplingParams(max_tokens=4)
    backend.add_request("dup", [1, 2, 3], ok)
    cases = [
        ("dup", [1, 2, 3], ok, None, "already running"),
        ("empty", [], ok, None, "empty prompt"),
        ("long", [1] * 1020, SamplingParams(max_tokens=8), None, "max_model_len"),
        ("done", [1, 2], ok, [5, 6, 7, 8], "resumed"),
        ("temp", [1, 2], SamplingParams(temperature=-1.0), None, "temperature"),
        ("vocab", [1, 10**6], ok, None, ""),  # vLLM's own check, its wording
    ]
    for rid, prompt, params, outputs, message in cases:
        with pytest.raises(RequestRejected, match=message):
            backend.add_request(rid, prompt, params, output_token_ids=outputs)
    assert backend.abort("dup")
    assert not backend.has_unfinished_requests()


def test_sampling_parameters_map_to_vllms() -> None:
    from vllm.sampling_params import RequestOutputKind

    from worker.backends.vllm import vllm_sampling

    ours = SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05, seed=7,
                          stop_token_ids=(2, 5), ignore_eos=True, min_tokens=4, repetition_penalty=1.1,
                          presence_penalty=0.5, frequency_penalty=-0.5)
    v = vllm_sampling(ours, num_resumed=6)
    assert (v.max_tokens, v.min_tokens, v.temperature, v.top_p, v.top_k, v.min_p, v.seed) == \
        (14, 0, 0.7, 0.9, 0, 0.05, 7)
    assert v.stop_token_ids == [2, 5] and v.ignore_eos
    assert (v.repetition_penalty, v.presence_penalty, v.frequency_penalty) == (1.1, 0.5, -0.5)
    assert v.output_kind == RequestOutputKind.DELTA and not v.detokenize
    assert vllm_sampling(SamplingParams(top_k=40, min_tokens=4)).top_k == 40
    assert vllm_sampling(SamplingParams(min_tokens=4), num_resumed=1).min_tokens == 3
    assert vllm_sampling(SamplingParams(logit_bias=((5, 100.0), (9, -100.0)))).logit_bias == {5: 100.0, 9: -100.0}
    assert vllm_sampling(SamplingParams()).logit_bias is None
