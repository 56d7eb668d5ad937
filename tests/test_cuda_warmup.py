"""On CUDA, everything compiles and captures while the engine is built: serving a varied
workload afterwards (staggered arrivals, prompts of 1 to 1,500 tokens, chunked prefill
beside decodes, prefix-cache hits, greedy, sampled, seeded and penalised requests, an
abort, preemption) compiles no Triton kernel, captures no CUDA graph and runs no step
eagerly: every step replays a decode or a mixed-step graph; and the sampler never waits
on the device. Steps that score prompt logprobs run eagerly, and compile nothing either:
the runner warmed that path up too."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from shared.sampling import SamplingParams
from worker.llm import LLM

pytestmark = pytest.mark.cuda


def _params(rng: random.Random, i: int) -> SamplingParams:
    max_tokens = rng.choice([1, 2, 7, 33, 64])
    kind = i % 5
    if kind == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if kind == 1:
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_k=40, top_p=0.9, ignore_eos=True)
    if kind == 2:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, min_p=0.05, ignore_eos=True)
    if kind == 3:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, repetition_penalty=1.2,
                              presence_penalty=0.5, frequency_penalty=0.3, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.7, ignore_eos=True)


def test_nothing_compiles_or_captures_after_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime.jit import JITFunction

    llm = LLM(model="SmolLM2-135M", load_format="dummy", dtype="bfloat16", device="cuda", max_num_seqs=16,
              max_num_batched_tokens=512, max_model_len=2048, num_kv_blocks=320)
    engine, runner = llm.engine, llm.engine.runner
    assert runner.graphs is not None and runner.mixed is not None
    print(f"start-up: graphs and warm-up {runner.capture_time_s:.1f} s, decode buckets {runner.graphs.buckets} "
          f"x tiers {runner.graphs.tiers}, mixed buckets {runner.mixed.buckets}")
    captures = runner.graphs.num_captures + runner.mixed.num_captures

    compiled: list[str] = []
    original = JITFunction._do_compile

    def counting(self: JITFunction, *args: object, **kwargs: object) -> object:
        compiled.append(self.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", counting)

    # The sampler never waits on the device (the caller's copy of the ids is the step's
    # one synchronisation): with sync debugging at "error", any sync inside it raises.
    from worker.engine.sampler import Sampler

    sample = Sampler.sample

    def sample_without_sync(self: Sampler, *args: object, **kwargs: object) -> torch.Tensor:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return sample(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(Sampler, "sample", sample_without_sync)

    rng = random.Random(7)
    vocab = engine.model_config.vocab_size
    lengths = [1, 2, 15, 16, 17, 100, 511, 512, 513, 1000, 1500] + [rng.randrange(1, 1501) for _ in range(29)]
    shared_prefix = [rng.randrange(vocab) for _ in range(300)]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    prompts += [shared_prefix + [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(6)]
    pending = list(enumerate(prompts))
    outputs: dict[str, list[int]] = {}
    aborted = False
    steps = 0
    while pending or engine.has_unfinished_requests():
        for _ in range(min(len(pending), rng.choice([0, 0, 1, 3]))):  # staggered arrivals
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, _params(rng, i))
        if not aborted:  # abort the first request seen mid-output
            rid = next((r for r, toks in outputs.items() if len(toks) >= 2 and r in engine.scheduler.requests), None)
            aborted = rid is not None and engine.abort(rid)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        assert steps < 3000, f"no end after {steps} steps: {engine.stats()}"

    assert compiled == [], f"Triton compiled after start-up: {compiled}"
    assert runner.graphs.num_captures + runner.mixed.num_captures == captures
    assert runner.num_eager_steps == 0
    assert runner.mixed.num_replays > 0 and runner.graphs.num_replays > 0
    assert aborted and engine.scheduler.num_preemptions > 0
    assert len(outputs) == len(prompts)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    print(f"{steps} steps: {runner.mixed.num_replays} mixed replays, {runner.graphs.num_replays} decode replays, "
          f"{engine.num_async_steps} async, {engine.scheduler.num_preemptions} preemptions")

    # Prompt logprobs: one chunk or several, alone or beside decodes and other chunks.
    eager_before = runner.num_eager_steps
    scored = [[rng.randrange(vocab) for _ in range(n)] for n in (2, 3, 17, 32, 100, 171, 256, 333, 512, 700, 1200)]
    pending = list(enumerate(scored))
    scores: dict[str, int] = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(min(len(pending), rng.choice([0, 1, 2]))):
            i, prompt = pending.pop(0)
            params = SamplingParams(max_tokens=rng.choice([1, 5, 20]), temperature=0.0, ignore_eos=True,
                                    prompt_logprobs=i % 3 * 2)
            engine.add_request(f"p{i}", prompt, params)
            engine.add_request(f"q{i}", prompt[:1] * 3, _params(rng, i))  # a neighbour that does not score
        for out in engine.step():
            if out.prompt_logprobs is not None:
                scores[out.request_id] = len(out.prompt_logprobs)
        steps += 1
        assert steps < 6000, f"no end after {steps} steps: {engine.stats()}"
    assert compiled == [], f"Triton compiled for prompt logprobs: {compiled}"
    assert runner.num_eager_steps > eager_before
    assert scores == {f"p{i}": len(p) - 1 for i, p in enumerate(scored)}
    del llm, engine, runner
    gc.collect()
    torch.cuda.empty_cache()
