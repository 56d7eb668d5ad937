"""What request options cost the offline engine (issue 14): ``logprobs``, echo's prompt
logprobs and ``n = 4`` against plain requests, on prompts of the same shape.

``--num-prompts`` prompts of ``--input-len`` random token ids, ``--output-len`` output
tokens each (``ignore_eos``), all submitted at once to one engine, sampled at temperature 1
with a seed per request. Each kind runs once on 4 short requests first (its warm-up time
is recorded: a first use may compile kernels), then, timed:
  plain          one completion per prompt;
  logprobs       the same, with ``logprobs = 5`` (the token's logprob and the top 5);
  prompt_logprobs  the same, with ``prompt_logprobs = 1`` (echo with logprobs);
  n4             four completions per prompt: four requests with one prompt and seeds
                 ``seed + j`` (what the gateway's fan-out sends), which share the prompt's
                 KV through in-batch prefix caching.
Per run: wall time (add to last token, s), output tok/s, prompt tokens the engine computed
(prompt tokens minus prefix-cache hits) and the ratio of output tok/s to ``plain``.

    python -m bench.options_bench --out bench/results/options_cpu.json             # SmolLM2, CPU
    python -m bench.options_bench --dummy-model Qwen2.5-7B --tokenizer-dir .tokenizer \\
        --device cuda --num-prompts 64 --out $OUT/options_h100.json               # on a GPU
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

from bench.host import cpu_description

RUNS = ("plain", "logprobs", "prompt_logprobs", "n4")


def requests_of(run: str, prompts: list[list[int]], output_len: int, seed: int) -> tuple[list[list[int]], list[Any]]:
    """The prompts (repeated for ``n4``) and their sampling parameters for ``run``."""
    from shared.sampling import SamplingParams

    base = {"max_tokens": output_len, "temperature": 1.0, "ignore_eos": True}
    if run == "n4":
        return ([p for p in prompts for _ in range(4)],
                [SamplingParams(**base, seed=seed + i * 4 + j) for i in range(len(prompts)) for j in range(4)])
    extra = {"logprobs": {"logprobs": 5}, "prompt_logprobs": {"prompt_logprobs": 1}}.get(run, {})
    return prompts, [SamplingParams(**base, seed=seed + i, **extra) for i in range(len(prompts))]


def measure(llm: Any, run: str, prompts: list[list[int]], output_len: int, seed: int) -> dict[str, Any]:
    """One run on ``llm``'s engine: wall time, output tok/s and prompt tokens computed."""
    batch, params = requests_of(run, prompts, output_len, seed)
    stats = llm.engine.scheduler.block_manager
    hits_before = stats.num_prefix_hits
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    wall_s = time.perf_counter() - t0
    num_output = sum(len(o.token_ids) for o in outs)
    assert num_output == len(batch) * output_len, num_output
    if run == "logprobs":
        assert all(len(o.logprobs) == output_len for o in outs)
    if run == "prompt_logprobs":
        assert all(len(o.prompt_logprobs or ()) == len(p) - 1 for o, p in zip(outs, batch, strict=True))
    num_prompt = sum(len(p) for p in batch)
    return {"num_requests": len(batch), "wall_s": wall_s, "output_tok_s": num_output / wall_s,
            "prompt_tokens": num_prompt, "prompt_tokens_computed": num_prompt - (stats.num_prefix_hits - hits_before)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="a model inferq loads (CPU: the default)")
    ap.add_argument("--dummy-model", help="a named dummy config (bench/model_folder.py) instead of --model")
    ap.add_argument("--tokenizer-dir", type=Path, help="with --dummy-model: the tokenizer files to put beside its config")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/options_cpu.json"))
    args = ap.parse_args(argv)

    from worker.llm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        model, extra = args.model, {}
        if args.dummy_model:
            from bench.model_folder import build_model_folder

            model = str(build_model_folder(args.dummy_model, Path(tmp), args.tokenizer_dir)[0])
            extra = {"load_format": "dummy"}
        # n4 has 4 sequences per prompt: every run gets room for all of them at once.
        llm = LLM(model, device=args.device, max_num_seqs=4 * args.num_prompts, **extra)
        rng = random.Random(args.seed)
        vocab = llm.engine.model_config.vocab_size

        def make(n: int) -> list[list[int]]:
            return [[rng.randrange(1000, min(vocab, 30000)) for _ in range(args.input_len)] for _ in range(n)]

        warmup_s = {}
        for run in RUNS:  # a first use can compile kernels (the eager path of prompt logprobs): not timed
            t0 = time.perf_counter()
            llm.generate(*requests_of(run, make(4), 4, 0))
            warmup_s[run] = time.perf_counter() - t0
        print("warm-up", json.dumps(warmup_s), flush=True)
        results: dict[str, Any] = {}
        for run in RUNS:  # fresh prompts per run: no run finds another's prompts cached
            results[run] = measure(llm, run, make(args.num_prompts), args.output_len, args.seed)
            results[run]["vs_plain"] = results[run]["output_tok_s"] / results["plain"]["output_tok_s"]
            print(run, json.dumps(results[run]), flush=True)
        device = llm.engine.device
        out = {"benchmark": "bench.options_bench", "date": date.today().isoformat(),
               "model": args.dummy_model or args.model, "dtype": str(llm.engine.dtype),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description(),
               "settings": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "seed")},
               "warmup_s": warmup_s, "runs": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
