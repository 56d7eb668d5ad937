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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date
from typing import Any

import torch

from bench.host import cpu_description
from shared.sampling import SamplingParams
from worker.engine.scheduler import ScheduledRequest
from worker.engine.spec_decode import SpecStats
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-prompts", type=int, default=3, help="copy prompts (novel: one fewer)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: a shared 2-core host oversubscribed by other work makes OpenMP "
                         "barriers stall for whole scheduler slices)")
    ap.add_argument("--num-speculative-tokens", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
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
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
