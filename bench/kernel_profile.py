"""Where each engine's GPU time goes on the same offline batch: a torch.profiler trace of
one ``generate`` of ``--num-prompts`` random prompts of ``--prompt-len`` token ids
(``--max-tokens`` each, greedy, ``ignore_eos``), through inferq's ``LLM`` or vLLM's,
summed per kernel and per kind of kernel (``KINDS``: matmuls, attention, norms, ...), with
the GPU's idle time between operations (``gaps_by_neighbours``). Run it once per engine on
the same GPU and compare the JSONs (``--compare a.json b.json`` prints the kinds side by
side): a kind that takes longer on one engine is where its time goes.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here) so that the
profiler sees its kernels; its wall time is then not the figure of its usual
two-process layout, but its kernels' times are. This file imports only the standard
library and torch at the top, because vLLM's run has vLLM's ``PYTHONPATH`` alone
(``python3 -P bench/kernel_profile.py --engine vllm ...``, as ``bench/side_by_side.py``
starts vLLM; the model folder from ``bench/model_folder.py``).

    python bench/kernel_profile.py --engine inferq --model-dir /tmp/m/Qwen2.5-7B --out prof_inferq.json
    PYTHONPATH=/tmp/vsite python3 -P bench/kernel_profile.py --engine vllm --model-dir /tmp/m/Qwen2.5-7B \\
        --out prof_vllm.json
    python bench/kernel_profile.py --compare prof_inferq.json prof_vllm.json
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path

#: Trace event categories that occupy the GPU.
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

#: Kinds of GPU work by kernel name (first match wins; lower-case names). Matmul
#: libraries name their kernels after tile shapes (cuBLAS ``nvjet``/``sm90_xmma``,
#: CUTLASS), our GEMVs and Triton matmuls after the op.
KINDS: tuple[tuple[str, str], ...] = (
    ("copy", r"^memcpy|^memset|copy_kernel|elementwise_kernel_with_index"),
    ("attention", r"attn|attention|flash|fmha|paged|reshape_and_cache|_kv_"),
    ("matmul", r"gemm|gemv|nvjet|xmma|cutlass|cublas|splitk|matmul|_mm_"),
    ("norm", r"rms|norm"),
    ("activation", r"silu|swiglu|act_and_mul|gelu"),
    ("rotary", r"rotary|rope"),
    ("sampling", r"argmax|sample|topk|top_k|softmax|logits|gather|scatter|index"),
)


def kind_of(name: str) -> str:
    """The ``KINDS`` entry a kernel name falls in, else ``other``."""
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def trace_events(prof: object) -> list[dict]:
    """The events of a finished ``torch.profiler.profile`` as its chrome trace holds them."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))  # type: ignore[attr-defined]
        return json.loads(trace.read_text())["traceEvents"]


def gaps_by_neighbours(events: list[dict], min_gap_us: float) -> tuple[collections.Counter, collections.Counter, dict]:
    """Idle microseconds between consecutive GPU events (sorted by start), longer than
    ``min_gap_us``, per (event before, event after) name pair: their sum, their count
    and the longest."""
    total: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    longest: dict = {}
    for a, b in itertools.pairwise(events):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap > min_gap_us:
            key = (a["name"][:60], b["name"][:60])
            total[key] += gap
            count[key] += 1
            longest[key] = max(longest.get(key, 0.0), gap)
    return total, count, longest


def summarize(events: list[dict], min_gap_us: float, top: int) -> dict:
    """Span, busy and idle milliseconds of the GPU events of a chrome trace, the largest
    gaps by their neighbours, time per ``KINDS`` kind and the ``top`` busiest kernels
    (name, ms, launches)."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e), key=lambda e: e["ts"])
    if not gpu:
        return {"error": "no GPU events in the trace"}
    gaps, gap_counts, gap_longest = gaps_by_neighbours(gpu, min_gap_us)
    kernels: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    for e in gpu:
        kernels[e["name"][:90]] += e["dur"]
        calls[e["name"][:90]] += 1
        kinds[kind_of(e["name"])] += e["dur"]
    return {"matmul_by_shape_ms": matmul_by_shape(events, gpu),
            "gpu_span_ms": round((gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]) / 1e3, 2),
            "gpu_busy_ms": round(sum(e["dur"] for e in gpu) / 1e3, 2),
            "gaps_ms": round(sum(gaps.values()) / 1e3, 2),
            "kinds_ms": {k: round(v / 1e3, 2) for k, v in kinds.most_common()},
            "gaps_by_neighbours_ms": [[a, b, round(g / 1e3, 3), gap_counts[a, b], round(gap_longest[a, b] / 1e3, 3)]
                                      for (a, b), g in gaps.most_common(10)],
            "busiest_ms": [[n, round(d / 1e3, 2), calls[n]] for n, d in kernels.most_common(top)]}


def matmul_by_shape(events: list[dict], gpu: list[dict], top: int = 30) -> list[list]:
    """The matmul kernels' time by the operator that launched them and its input shapes
    (a trace recorded with ``record_shapes``; ``graph`` where a CUDA graph replay
    launched them): ``[op, shapes, ms, launches, kernel names]``, the ``top`` largest."""
    ops = {e["args"]["External id"]: (e["name"], json.dumps(e["args"].get("Input Dims", [])))
           for e in events if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    total: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    names: dict = collections.defaultdict(set)
    for e in gpu:
        if kind_of(e["name"]) != "matmul":
            continue
        key = ops.get(e.get("args", {}).get("External id"), ("graph", ""))
        total[key] += e["dur"]
        calls[key] += 1
        names[key].add(e["name"][:60])
    return [[op, dims, round(us / 1e3, 2), calls[op, dims], sorted(names[op, dims])]
            for (op, dims), us in total.most_common(top)]


def inferq_generate(model_dir: str, max_num_seqs: int, max_model_len: int) -> Callable[[list[list[int]], int], None]:
    """``generate(prompts, max_tokens)`` over inferq's offline ``LLM`` (its GPU defaults)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from shared.sampling import SamplingParams
    from worker.llm import LLM

    llm = LLM(model=model_dir, load_format="dummy", max_num_seqs=max_num_seqs, max_model_len=max_model_len)

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    return generate


def vllm_generate(model_dir: str, max_num_seqs: int, max_model_len: int) -> Callable[[list[list[int]], int], None]:
    """``generate(prompts, max_tokens)`` over vLLM's ``LLM`` in this process (its defaults)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, load_format="dummy", max_num_seqs=max_num_seqs, max_model_len=max_model_len,
              enable_prefix_caching=False, seed=0)

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0), use_tqdm=False)
    return generate


def compare(paths: Sequence[str]) -> str:
    """A markdown table of the kinds' milliseconds (and span, busy, idle) of each JSON."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    kinds = sorted({k for r in results for k in r.get("kinds_ms", {})},
                   key=lambda k: -results[0].get("kinds_ms", {}).get(k, 0))
    figures = (("wall ms (profiled)", "wall_ms"), ("wall ms (unprofiled)", "wall_ms_unprofiled"),
               ("GPU span ms", "gpu_span_ms"), ("GPU busy ms", "gpu_busy_ms"), ("GPU idle ms (gaps)", "gaps_ms"))
    rows = [*([label, *(r.get(key, "-") for r in results)] for label, key in figures),
            *([k, *(r.get("kinds_ms", {}).get(k, 0.0) for r in results)] for k in kinds)]
    head = "| | " + " | ".join(r["engine"] for r in results) + " |\n| --- |" + " --- |" * len(results) + "\n"
    return head + "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("inferq", "vllm"))
    ap.add_argument("--model-dir", help="a Hugging Face folder (config.json, tokenizer files); dummy weights")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=40, help="kernels listed by time")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="print the kinds of these results side by side")
    args = ap.parse_args()
    if args.compare:
        print(compare(args.compare))
        return 0
    if not (args.engine and args.model_dir and args.out):
        ap.error("--engine, --model-dir and --out are required (or --compare)")
    import torch
    from torch.profiler import ProfilerActivity, profile

    build = inferq_generate if args.engine == "inferq" else vllm_generate
    generate = build(args.model_dir, args.max_num_seqs, args.max_model_len)
    rng = random.Random(0)
    vocab_size = int(json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"])

    def prompts() -> list[list[int]]:
        return [[rng.randrange(100, vocab_size) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    generate(prompts()[:8], args.max_tokens)  # warm-up
    sync()
    t0 = time.perf_counter()
    generate(prompts(), args.max_tokens)
    sync()
    unprofiled_ms = (time.perf_counter() - t0) * 1e3
    batch = prompts()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        t0 = time.perf_counter()
        generate(batch, args.max_tokens)
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
    events = trace_events(prof)
    res = {"date": date.today().isoformat(), "engine": args.engine, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "model_dir": args.model_dir, "num_prompts": args.num_prompts,
           "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
           "wall_ms": round(wall_ms, 2), "wall_ms_unprofiled": round(unprofiled_ms, 2),
           **summarize(events, args.min_gap_us, args.top)}
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "busiest_ms"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
