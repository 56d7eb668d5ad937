"""Prefix caching end to end on the real SmolLM2 (CPU, float32): requests that share a
~1,000-token prefix produce the same greedy tokens with caching on and off, and with
it on they start from cached blocks."""

from __future__ import annotations

from shared.sampling import SamplingParams
from worker.llm import LLM

QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Summarise the text above."]
NUM_OUTPUT = 32  # compared per prompt: ignore_eos, so an early EOS cannot shorten the comparison


def _prompts(llm: LLM) -> list[list[int]]:
    assert llm.tokenizer is not None
    text = " ".join(f"Fact {i}: the river number {i} flows past the town of Ashford {i % 7}." for i in range(120))
    prefix = llm.encode(text)[:1000]
    assert len(prefix) == 1000
    return [prefix + llm.encode(" " + q) for q in QUESTIONS]


def _run(enable: bool) -> tuple[list[list[int]], list[int]]:
    llm = LLM(dtype="float32", device="cpu", enable_prefix_caching=enable)
    prompts = _prompts(llm)
    params = SamplingParams(max_tokens=NUM_OUTPUT, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[:1], params)  # fills the cache with the prefix's blocks
    rest = llm.generate(prompts[1:], params)
    outs = first + rest
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in rest]


def test_prefix_caching_same_tokens() -> None:
    on_tokens, on_cached = _run(True)
    off_tokens, off_cached = _run(False)
    assert all(len(t) == NUM_OUTPUT for t in on_tokens)
    assert on_tokens == off_tokens
    assert all(n >= 992 for n in on_cached), on_cached  # the prefix's 62 full blocks
    assert off_cached == [0, 0]
