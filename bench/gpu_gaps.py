"""Where the GPU idles during an offline prefill: a torch.profiler trace of one
``LLM.generate`` of ``--num-prompts`` random prompts of ``--prompt-len`` tokens
(``--max-tokens``, default 1), its kernels and copies ordered in time, and the gaps
between them. With ``--groups G``, the prompts are G groups that each share a
``--prefix-len``-token prefix before their own ``--prompt-len`` tokens (side_by_side's
``shared_prefix`` workload: ``--groups 32 --num-prompts 256 --prefix-len 2000
--prompt-len 100 --max-tokens 64``), prefix caching on, and the JSON counts the prompt
tokens the cache served (``cached_tokens``).

Prints and writes (``--out``): the call's wall time, the GPU's span and busy time, the
gaps over ``--min-gap-us`` by the pair of operations around them (summed ms, count,
longest ms) (a gap after the
sampled ids' copy to the host and before the next step's input copy is the host's time
between two steps), the busiest kernels (ms, launches) and the time per kind of kernel
(``bench/kernel_profile.py``'s ``summarize``), and the wall time of the same batch shape run
again without the profiler (``wall_ms_unprofiled``: with ``--max-tokens 1``, the TTFT).
``--prefill-config`` overrides the prefill attention launch's config (A/B of a kernel
choice in the whole engine).

    python bench/gpu_gaps.py --quantization fp8 --out bench/results/gpu_gaps_fp8_h100.json

Needs CUDA; dummy weights of ``--model`` (a ``DUMMY_CONFIGS`` name).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from datetime import date
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels.paged_attention as pa
from bench.kernel_profile import summarize, trace_events
from shared.model_source import DUMMY_CONFIGS
from shared.sampling import SamplingParams
from worker.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen2.5-7B", choices=sorted(DUMMY_CONFIGS))
    ap.add_argument("--quantization", default="none", choices=("none", "fp8"))
    ap.add_argument("--prompt-len", type=int, default=2048, help="each prompt's own tokens")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--groups", type=int, default=0, help="prompts sharing a prefix, in this many groups (0: none)")
    ap.add_argument("--prefix-len", type=int, default=2000, help="the shared prefix of each group, tokens")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    ap.add_argument("--prefill-config", default="",
                    help="JSON over the prefill attention launch's config (kernels/paged_attention.py "
                         "_attention_config), e.g. '{\"NEW_KV_TMA\": true}'; set before the engine starts")
    ap.add_argument("--engine-json", default="",
                    help="JSON of more LLM() keywords (EngineSettings fields), e.g. '{\"graph_pieces\": 1}'")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.groups < 0 or args.num_prompts < max(args.groups, 1):
        ap.error("--groups must be 0 or at most --num-prompts")
    if args.prefill_config:
        force = json.loads(args.prefill_config)
        base = pa._attention_config
        # Positional argument 4 is max_query_len: > 1 is the prefill launch.
        pa._attention_config = lambda *a, **kw: dict(base(*a, **kw), **force) if a[4] > 1 else base(*a, **kw)
    shared = args.groups > 0
    llm = LLM(model=args.model, load_format="dummy", max_num_seqs=args.max_num_seqs,
              max_model_len=max(4096, (args.prefix_len if shared else 0) + args.prompt_len + args.max_tokens),
              max_num_batched_tokens=args.max_num_batched_tokens, quantization=args.quantization,
              enable_prefix_caching=shared, **(json.loads(args.engine_json) if args.engine_json else {}))
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 150000) for _ in range(n)]

    def prompts(n: int) -> list[list[int]]:
        if not shared:
            return [ids(args.prompt_len) for _ in range(n)]
        prefixes = [ids(args.prefix_len) for _ in range(args.groups)]
        batch = [prefixes[i % args.groups] + ids(args.prompt_len) for i in range(n)]
        rng.shuffle(batch)
        return batch

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    llm.generate([ids(args.prompt_len) for _ in range(2)], params)  # warm-up, nothing shared with the batch
    batch = prompts(args.num_prompts)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        outs = llm.generate(batch, params)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    # The same batch shape again without the profiler (new prompts: nothing cached).
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts(args.num_prompts), params)
    torch.cuda.synchronize()
    unprofiled_ms = (time.perf_counter() - t0) * 1e3
    events = trace_events(prof)
    res = {"date": date.today().isoformat(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "model": args.model, "quantization": args.quantization, "prompt_len": args.prompt_len,
           "num_prompts": args.num_prompts, "groups": args.groups,
           "prefix_len": args.prefix_len if shared else 0, "max_tokens": args.max_tokens,
           "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
           "prompt_tokens": sum(len(p) for p in batch), "cached_tokens": sum(o.num_cached_tokens for o in outs),
           "prefill_config": args.prefill_config, "engine_json": args.engine_json,
           "wall_ms": round(wall_ms, 2), "wall_ms_unprofiled": round(unprofiled_ms, 2),
           **summarize(events, args.min_gap_us, top=20)}
    print(json.dumps(res, indent=1))
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
