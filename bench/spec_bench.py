"""CPU benchmark of speculative decoding (n-gram prompt lookup) in the in-house engine,
on SmolLM2-135M-Instruct (float32), concurrency 1, greedy (outputs are token-identical
with speculation on and off, which the run checks).

Sections:
  cost     the time of one step of one sequence (256-token context) with ``1 + k`` query
           tokens, k = 0..8, ms: the marginal cost of a draft token, and the ratio
           ``r = b / a`` of the linear fit ``a + b * tokens`` that
           ``--speculative-token-cost`` takes.
  copy     chat prompts that ask to repeat or edit a given passage (the n-gram case):
           output tok/s with speculation off and on, the speed-up, the acceptance rate,
           the mean accepted length and the proposer's time.
  novel    chat prompts with nothing to copy: the same (speculation must not lose).

Run: python -m bench.spec_bench --out bench/results/spec_cpu.json

GPU section (``--gpu``; ``gpu_main``): a draft model on a dummy-weight target, Qwen2.5-7B
shape (bfloat16), with a SmolLM2-135M-shaped draft of the target's vocabulary (dummy
weights, ``--speculative-method draft``), CUDA graphs on, ``max_num_seqs`` 16, contexts of
256 tokens. At batch 1 and 16: the median time of a plain decode step (a graph replay),
of one verify step with ``k`` = 1..8 drafts per sequence (eager, greedy verification
included), and of the draft's ``k`` proposal steps (``DraftProposer._propose``: the
one-token catch-up and ``k`` decode steps, graph replays); then the break-even acceptance
rate per ``k``: the ``alpha`` at which ``expected_tokens(alpha, k) * decode`` equals
``verify + propose`` (speculation wins above it; ``null``: never, even at ``alpha`` 1).
Random weights accept nothing, so ``e2e`` forces the acceptance (``forced_verify``, a
bench-only stand-in for ``spec_decode.verify`` that accepts each draft with probability
``alpha``, until the first rejection: the ``alpha`` of ``expected_tokens``) and measures
output tok/s at batch 1 against speculation off (async scheduling on there), with the
adaptive ``k`` at work. ``--smoke`` runs the same on tiny configs (CPU works; its figures
mean nothing).

Run (H100, about 2 minutes): python -m bench.spec_bench --gpu --out bench/results/spec_gpu_h100.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

from bench.host import cpu_description
from shared.model_source import DUMMY_CONFIGS
from shared.sampling import SamplingParams
from worker.engine import model_runner
from worker.engine.spec_decode import SpecStats, expected_tokens
from worker.engine.step_types import ScheduledRequest
from worker.llm import LLM

MODEL = "SmolLM2-135M-Instruct"
PASSAGES = (
    ("The old lighthouse keeper climbed the spiral stairs every evening at dusk. He polished the great lens, "
    "trimmed the wick, and watched the ships pass safely beyond the rocks. In winter the storms came early, "
    "and he kept the lamp burning through the night."),
    ("def merge_sorted(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            result.append(a[i])\n            i += 1\n        else:\n"
    "            result.append(b[j])\n            j += 1\n    result.extend(a[i:])\n    result.extend(b[j:])\n"
    "    return result\n"),
    ("Our office will be closed on Monday for the public holiday. All orders placed over the weekend will be "
    "shipped on Tuesday morning. If you have any questions, please contact the support team by email."),
)
COPY_TASKS = ("Repeat the following text exactly, word for word:\n\n{}",
              "Rewrite the following text, changing only 'the' to 'THE':\n\n{}")
NOVEL = ("Write a short poem about autumn leaves.", "Give three tips for learning a new language.",
         "Explain why the sky is blue in two sentences.", "Invent a name for a coffee shop and describe it.")


def _chat(llm: LLM, text: str) -> list[int]:
    assert llm.tokenizer is not None
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return llm.encode(chat)


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int, speculate: bool, proposer: Any
         ) -> tuple[float, int, list[list[int]], SpecStats]:
    """Generate one prompt at a time; returns (seconds, output tokens, outputs, stats)."""
    llm.engine.proposer = proposer if speculate else None
    if proposer is not None:
        proposer.stats = SpecStats()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs, elapsed = [], 0.0
    for p in prompts:
        llm.engine.scheduler.block_manager.reset_prefix_cache()
        t0 = time.perf_counter()
        outputs.append(llm.generate([p], params)[0].token_ids)
        elapsed += time.perf_counter() - t0
    return elapsed, sum(map(len, outputs)), outputs, proposer.stats if proposer is not None else SpecStats()


def bench_set(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    proposer = llm.engine.proposer
    _run(llm, prompts[:1], 8, True, proposer)  # warm-up
    off_s, num_tokens, off, _ = _run(llm, prompts, max_tokens, False, proposer)
    on_s, num_on, on, stats = _run(llm, prompts, max_tokens, True, proposer)
    llm.engine.proposer = proposer
    assert on == off, "greedy outputs differ with speculation on"
    return {"num_prompts": len(prompts), "output_tokens": num_tokens,
            "off_tok_s": round(num_tokens / off_s, 2), "on_tok_s": round(num_on / on_s, 2),
            "speedup": round(off_s / on_s, 3), "acceptance_rate": round(stats.acceptance_rate, 3),
            "mean_accepted_length": round(stats.mean_accepted_length, 3),
            "num_draft_tokens": stats.num_draft_tokens, "proposer_time_s": round(stats.proposer_time_s, 4),
            "proposer_share_of_on_time": round(stats.proposer_time_s / on_s, 4)}


def bench_cost(llm: LLM, context: int = 256, max_k: int = 6, repeat: int = 5) -> dict[str, Any]:
    """Step time with ``1 + k`` query tokens for one sequence after a ``context``-token
    prompt, ms (median of ``repeat``); drafts are written past the context and never
    counted as computed."""
    engine = llm.engine
    proposer, engine.proposer = engine.proposer, None
    engine.add_request("cost", list(range(1000, 1000 + context)), SamplingParams(temperature=0.0, max_tokens=64))
    engine.step()  # the prefill
    req = engine.scheduler.running[0]
    engine.scheduler.block_manager.allocate(req, 1 + max_k)
    times = []
    for k in range(max_k + 1):
        req.spec_token_ids = [1] * k
        item = ScheduledRequest(req, 1 + k, k)
        engine.runner.execute([item])
        samples = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            engine.runner.execute([item])
            samples.append((time.perf_counter() - t0) * 1e3)
        times.append(statistics.median(samples))
    req.spec_token_ids = []
    engine.abort("cost")
    engine.proposer = proposer
    n = len(times)
    mean_k, mean_t = (n - 1) / 2, statistics.fmean(times)
    b = sum((k - mean_k) * (t - mean_t) for k, t in enumerate(times)) / sum((k - mean_k) ** 2 for k in range(n))
    a = times[0] - b  # the batch-1 decode step is a + b (one token)
    return {"context_tokens": context, "step_ms_by_num_drafts": [round(t, 2) for t in times],
            "ms_per_draft_token": round(b, 3), "token_cost_ratio_b_over_a": round(b / a, 4)}


# -- GPU section: a draft model on a 7B-shaped target ---------------------------------------
#: Tiny configs of ``--smoke`` (the draft shares the target's vocabulary).
_SMOKE_TARGET = {**DUMMY_CONFIGS["SmolLM2-135M"], "hidden_size": 128, "intermediate_size": 256,
                 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
_SMOKE_DRAFT = {**_SMOKE_TARGET, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


def _config_folder(root: Path, name: str, config: dict[str, Any]) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return str(folder)


def _timed_ms(fn: Any, repeat: int, sync: Any) -> float:
    """Median wall time of ``fn()`` over ``repeat`` runs after one warm-up, ms."""
    fn()
    sync()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def break_even_alpha(decode_ms: float, step_ms: float, k: int) -> float | None:
    """The acceptance rate at which ``k`` drafts break even: ``expected_tokens(alpha, k)
    * decode_ms == step_ms`` (verify + propose), by bisection; None when even alpha = 1
    (``k + 1`` tokens a step) loses."""
    if (k + 1) * decode_ms <= step_ms:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) * decode_ms < step_ms else (lo, mid)
    return round(hi, 4)


def forced_verify(alpha: float, seed: int = 0) -> Any:
    """A stand-in for ``spec_decode.verify`` (bench only: the output is not the target's)
    that accepts each draft with probability ``alpha`` independently, then emits the
    target's argmax at the first rejection (or a bonus token)."""
    rng = random.Random(seed)

    def verify(probs: Any, argmax: torch.Tensor, drafts: list[int], generator: Any, seeded: bool = False) -> list[int]:
        a = 0
        while a < len(drafts) and rng.random() < alpha:
            a += 1
        return [*drafts[:a], int(argmax[a])]

    return verify


def bench_gpu_steps(llm: LLM, batch: int, context: int, max_k: int, repeat: int) -> dict[str, Any]:
    """Decode, verify and propose times at ``batch`` sequences of ``context`` tokens."""
    engine = llm.engine
    proposer = engine.proposer
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=4 * max_k + 64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"gpu-{i}", [rng.randrange(vocab) for _ in range(context)], params)
    # The prefills, and speculative steps of those done first (no async step stays in flight).
    while any(r.num_computed_tokens < context for r in engine.scheduler.requests.values()):
        engine.step()
    reqs = list(engine.scheduler.running)
    assert len(reqs) == batch
    for r in reqs:
        engine.scheduler.block_manager.allocate(r, 1 + max_k)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    runner = engine.runner
    decode_ms = _timed_ms(lambda: runner.execute([ScheduledRequest(r, 1) for r in reqs]), repeat, sync)
    rows = []
    for k in range(1, max_k + 1):
        for r in reqs:
            r.spec_token_ids = [1] * k
        verify_ms = _timed_ms(lambda k=k: runner.execute([ScheduledRequest(r, 1 + k, k) for r in reqs]), repeat, sync)
        propose_ms = _timed_ms(lambda k=k: proposer._propose([(r, k) for r in reqs]), repeat, sync)
        rows.append({"k": k, "verify_ms": round(verify_ms, 3), "propose_ms": round(propose_ms, 3),
                     "verify_over_decode": round(verify_ms / decode_ms, 3),
                     "break_even_alpha": break_even_alpha(decode_ms, verify_ms + propose_ms, k),
                     "break_even_alpha_free_proposer": break_even_alpha(decode_ms, verify_ms, k)})
    for r in reqs:
        r.spec_token_ids = []
        engine.abort(r.request_id)
    return {"batch": batch, "context_tokens": context, "decode_ms": round(decode_ms, 3), "by_k": rows}


def bench_gpu_e2e(llm: LLM, alphas: tuple[float, ...], context: int, max_tokens: int) -> dict[str, Any]:
    """Output tok/s at batch 1 with speculation off, then on with forced acceptance."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompt = [random.Random(1).randrange(vocab) for _ in range(context)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    proposer, real_verify = engine.proposer, model_runner.verify

    def tok_s() -> float:
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
        t0 = time.perf_counter()
        n = len(llm.generate([prompt], params)[0].token_ids)
        return n / (time.perf_counter() - t0)

    engine.proposer = None
    result: dict[str, Any] = {"batch": 1, "context_tokens": context, "max_tokens": max_tokens,
                              "off_tok_s": round(tok_s(), 2), "on": []}
    engine.proposer = proposer
    try:
        for alpha in alphas:
            model_runner.verify = forced_verify(alpha)  # type: ignore[assignment]
            proposer.stats = SpecStats()
            proposer._counts.clear()
            on = tok_s()
            st = proposer.stats
            result["on"].append({"alpha": alpha, "tok_s": round(on, 2), "speedup": round(on / result["off_tok_s"], 3),
                                 "acceptance_rate": round(st.acceptance_rate, 3),
                                 "mean_accepted_length": round(st.mean_accepted_length, 3),
                                 "proposer_time_s": round(st.proposer_time_s, 4)})
    finally:
        model_runner.verify = real_verify  # type: ignore[assignment]
    return result


def gpu_main(args: argparse.Namespace) -> dict[str, Any]:
    """The GPU section (module docstring); ``args.smoke``: tiny configs, fewer repeats."""
    smoke = args.smoke
    with tempfile.TemporaryDirectory() as tmp:
        if smoke:
            target, draft = _config_folder(Path(tmp), "target", _SMOKE_TARGET), _SMOKE_DRAFT
        else:
            target = "Qwen2.5-7B"
            draft = {**DUMMY_CONFIGS["SmolLM2-135M"], "vocab_size": DUMMY_CONFIGS[target]["vocab_size"]}
        llm = LLM(target, load_format="dummy", speculative_method="draft",
                  speculative_model=_config_folder(Path(tmp), "draft", draft), speculative_model_load_format="dummy",
                  num_speculative_tokens=8, max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=2048,
                  num_kv_blocks=128 if smoke else 2048, cpu_threads=args.threads)
    engine = llm.engine
    result: dict[str, Any] = {
        "bench": "spec_bench_gpu", "target": "smoke" if smoke else target, "draft": "smoke" if smoke else
        "SmolLM2-135M shape, target vocabulary", "dtype": str(engine.dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else cpu_description(),
        "date": date.today().isoformat(), "cuda_graphs": engine.runner.graphs is not None,
        "draft_graphs": getattr(engine.proposer, "graphs", None) is not None}
    context, max_k, repeat = (32, 3, 2) if smoke else (256, 8, 20)
    result["steps"] = [bench_gpu_steps(llm, b, context, max_k, repeat) for b in ((1, 2) if smoke else (1, 16))]
    for section in result["steps"]:
        print("steps", json.dumps(section), file=sys.stderr, flush=True)
    result["e2e"] = bench_gpu_e2e(llm, (0.5, 0.8) if smoke else (0.5, 0.7, 0.9), context, 16 if smoke else 128)
    print("e2e", json.dumps(result["e2e"]), file=sys.stderr, flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-prompts", type=int, default=3, help="copy prompts (novel: one fewer)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: a shared 2-core host oversubscribed by other work makes OpenMP "
                         "barriers stall for whole scheduler slices)")
    ap.add_argument("--num-speculative-tokens", type=int, default=5)
    ap.add_argument("--gpu", action="store_true", help="the GPU section: a draft model on a 7B-shaped target")
    ap.add_argument("--smoke", action="store_true", help="with --gpu: tiny configs (runs on CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.gpu:
        _write(gpu_main(args), args.out)
        return
    llm = LLM(MODEL, cpu_threads=args.threads, speculative_method="ngram", num_speculative_tokens=args.num_speculative_tokens)
    copy = [_chat(llm, task.format(p)) for p in PASSAGES for task in COPY_TASKS][:args.num_prompts]
    novel = [_chat(llm, text) for text in NOVEL][:max(1, args.num_prompts - 1)]
    result = {"bench": "spec_bench", "model": MODEL, "dtype": "float32", "device": cpu_description(),
              "torch_threads": torch.get_num_threads(), "date": date.today().isoformat(),
              "num_speculative_tokens": args.num_speculative_tokens, "max_tokens": args.max_tokens,
              "concurrency": 1}
    for name, fn in (("cost", lambda: bench_cost(llm)), ("copy", lambda: bench_set(llm, copy, args.max_tokens)),
                     ("novel", lambda: bench_set(llm, novel, args.max_tokens))):
        result[name] = fn()
        print(name, json.dumps(result[name]), file=sys.stderr, flush=True)
    _write(result, args.out)


def _write(result: dict[str, Any], out: str) -> None:
    print(json.dumps(result, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
