"""Sampler: greedy, temperature, top-k, top-p, min-p, seeds and penalties on hand-made logits."""

from __future__ import annotations

import torch

from shared.sampling import SamplingParams
from worker.engine.sampler import Sampler

CPU = torch.device("cpu")


def sample(logits: torch.Tensor, params: list[SamplingParams], ids: list[str] | None = None,
           sampler: Sampler | None = None, tokens: list[list[int]] | None = None) -> list[int]:
    s = sampler or Sampler(CPU, seed=1)
    n = len(params)
    return s(logits.clone(), ids or [f"r{i}" for i in range(n)], params, tokens or [[]] * n, [0] * n)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(4, 50)
    assert sample(logits, [SamplingParams(temperature=0.0)] * 4) == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_argmax_even_hot() -> None:
    logits = torch.randn(8, 100)
    expected = logits.argmax(-1).tolist()
    assert sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8) == expected
    assert sample(logits, [SamplingParams(temperature=1.5, top_p=1e-6)] * 8) == expected


def test_top_k_never_samples_outside_the_k_best() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 20).repeat(400, 1)
    allowed = set(logits[0].topk(3).indices.tolist())
    got = sample(logits, [SamplingParams(temperature=1.0, top_k=3)] * 400)
    assert set(got) <= allowed and len(set(got)) == 3


def test_top_p_keeps_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = probs.log().repeat(500, 1)
    got = sample(logits, [SamplingParams(temperature=1.0, top_p=0.75)] * 500)
    assert set(got) == {0, 1}  # 0.5 alone is short of 0.75; 0.5 + 0.3 reaches it


def test_min_p_drops_unlikely_tokens() -> None:
    probs = torch.tensor([0.6, 0.3, 0.05, 0.05])
    got = sample(probs.log().repeat(500, 1), [SamplingParams(temperature=1.0, min_p=0.2)] * 500)
    assert set(got) == {0, 1}  # threshold 0.2 * 0.6 = 0.12


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.7, 0.2, 0.1])
    got = torch.tensor(sample(probs.log().repeat(4000, 1), [SamplingParams(temperature=1.0)] * 4000))
    freq = torch.bincount(got, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_seed_reproduces_across_samplers_and_batches() -> None:
    logits = torch.randn(1, 1000)
    p = SamplingParams(temperature=1.0, seed=42)
    runs = []
    for batch_extra in (0, 3):
        s = Sampler(CPU, seed=batch_extra)  # different global seeds must not matter
        seq = []
        for _ in range(5):
            rows = logits.repeat(1 + batch_extra, 1)
            params = [p] + [SamplingParams(temperature=1.0)] * batch_extra
            ids = ["seeded"] + [f"o{i}" for i in range(batch_extra)]
            seq.append(sample(rows, params, ids, s)[0])
        runs.append(seq)
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_greedy_and_sampled_rows_mix() -> None:
    logits = torch.randn(2, 30)
    out = sample(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)])
    assert out == logits.argmax(-1).tolist()


def test_repetition_penalty_demotes_seen_tokens() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample(logits, [p], tokens=[[0]]) == [1]  # 2.0 / 2 < 1.9


def test_presence_and_frequency_penalties() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    s = Sampler(CPU)
    p = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    # token 0 appeared twice in the *output* (the prompt is token 1): 3.0 - 0.6 = 2.4 < 2.5
    assert s(logits.clone(), ["a"], [p], [[1, 0, 0]], [1]) == [1]
    p = SamplingParams(temperature=0.0, presence_penalty=0.4)
    assert s(logits.clone(), ["a"], [p], [[1, 0]], [1]) == [0]  # 2.6 > 2.5
