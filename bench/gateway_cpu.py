"""Gateway CPU per output token on a model-free stack, one command
(docs/operations.md, "Gateway CPU per token"; issue 13's goal: at most 50 µs).

Starts ``inferq serve --backend sim --sim-step-time-ms 12 --max-num-seqs 64`` (one gateway
process: serve itself; a sim worker, no model) on the default model or on a dummy-model
folder (``--config``, built by ``bench.model_folder``), waits for ``/health``, then runs the
load client (``bench.loadgen``: 64 concurrent streams, 1,000 prompts of 256 random token
ids, 64 output tokens each, ``ignore_eos``) ``--runs`` times against that one start, reading
serve's user and system CPU seconds from ``/proc`` around each run. Writes one JSON:

    python -m bench.gateway_cpu --runs 3 --out bench/results/gateway_cpu.json
    python -m bench.gateway_cpu --config Qwen2.5-7B --tokenizer-dir .tokenizer   # on a GPU host
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.host import cpu_description
from bench.loadgen import BenchConfig, run_benchmark
from bench.procs import ROOT, cpu_times, free_port, spawn, stop, wait_for_gateway


def one_run(url: str, serve_pid: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One pass of the load client; serve's CPU per output token (µs: user, system, both)."""
    cfg = BenchConfig(base_url=url, max_concurrency=args.concurrency, num_prompts=args.num_prompts,
                      random_input_len=args.input_len, random_output_len=args.output_len, ignore_eos=True,
                      seed=seed, show_progress=False)
    user0, system0 = cpu_times(serve_pid)
    result = asyncio.run(run_benchmark(cfg))
    user1, system1 = cpu_times(serve_pid)
    m = result.metrics
    tokens = max(m.total_output_tokens, 1)
    return {"seed": seed, "completed": m.completed, "failed": m.failed, "output_tokens": m.total_output_tokens,
            "duration_s": m.duration_s, "output_tok_s": m.output_throughput,
            "gateway_us_per_token": (user1 - user0 + system1 - system0) * 1e6 / tokens,
            "gateway_user_us_per_token": (user1 - user0) * 1e6 / tokens,
            "gateway_system_us_per_token": (system1 - system0) * 1e6 / tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="dummy config name (bench.model_folder); default: the default model")
    ap.add_argument("--tokenizer-dir", type=Path, help="tokenizer files for --config (default: the default model's)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--step-time-ms", type=float, default=12.0, help="the sim worker's step time")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/gateway_cpu.json")
    args = ap.parse_args()

    port = free_port()
    serve_args = ["-m", "shared.cli", "serve", "--backend", "sim", "--sim-step-time-ms", str(args.step_time_ms),
                  "--max-num-seqs", str(args.concurrency), "--port", str(port)]
    with tempfile.TemporaryDirectory() as tmp:
        if args.config:
            from bench.model_folder import build_model_folder

            folder, _ = build_model_folder(args.config, Path(tmp), args.tokenizer_dir)
            serve_args += ["--model", str(folder), "--load-format", "dummy"]
        log = Path(tmp) / "serve.log"
        proc = spawn(serve_args, log, die_with_parent=True)
        url = f"http://127.0.0.1:{port}"
        try:
            started = time.monotonic()
            wait_for_gateway(url, proc, timeout_s=300)
            runs = [one_run(url, proc.pid, args, seed) for seed in range(args.runs)]
        finally:
            stop(proc)
            if proc.returncode not in (0, None):
                print(log.read_text()[-3000:])
    figures = [r["gateway_us_per_token"] for r in runs]
    record = {"benchmark": "gateway_cpu", "command": "python -m bench.gateway_cpu " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "host_cpu": cpu_description(),
              "cpu_count": os.cpu_count(), "settings": {k: str(v) for k, v in vars(args).items()},
              "start_s": time.monotonic() - started, "runs": runs,
              "gateway_us_per_token": {"median": statistics.median(figures), "min": min(figures),
                                       "max": max(figures)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    for r in runs:
        print(f"seed {r['seed']}: {r['completed']} done, {r['output_tok_s']:,.0f} tok/s, gateway "
              f"{r['gateway_us_per_token']:.1f} µs/token (user {r['gateway_user_us_per_token']:.1f}, "
              f"system {r['gateway_system_us_per_token']:.1f})")
    print(f"median {record['gateway_us_per_token']['median']:.1f} µs/token; wrote {args.out}")


if __name__ == "__main__":
    main()
