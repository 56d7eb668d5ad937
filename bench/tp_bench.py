"""Tensor parallelism on one host's GPUs: decode step time at TP=1 and TP=N, against the
floor (each rank reads its share of the weights once per step).

For each ``--models`` entry (dummy weights, bf16, CUDA graphs on) and each ``--tp`` size,
this process builds the engine (rank 0; the other ranks are spawned, ``worker/parallel/``),
puts ``batch`` requests of ``CONTEXT`` random prompt tokens through prefill, then times
``--steps`` engine steps of decode at batch 1 and 64. The floor of a step is
``(rank 0's weight bytes + its KV bytes read) / copy bandwidth``: with TP=2 each rank
holds half of every layer (and half of the vocabulary), so the floor is about half of
TP=1's; the gap to it is the all-reduces (2 per layer) and the per-step sync.

Run (2 GPUs), one process per tensor-parallel size (after a TP=1 engine in the same
process, the first 2-GPU run found no memory left for TP=2's KV cache):
    python bench/tp_bench.py --models Qwen2.5-7B,Llama-3-8B --tp 1 --out tp1.json
    python bench/tp_bench.py --models Qwen2.5-7B --tp 2 --out tp2.json
Each row is written as soon as it is timed, before the engine's teardown.

``--serve MODEL`` instead serves ``MODEL``'s dummy config end to end (``inferq serve
--tensor-parallel-size N --load-format dummy``, a model folder with ``--tokenizer-dir``'s
tokenizer, ``bench/model_folder.py``), sends ``--num-requests`` completions of 64 tokens
through the gateway at once and records the start-up time, the wall time and output
tokens/s; e.g. the 70B shape on 2 GPUs:
    python bench/tp_bench.py --serve Llama-3-70B --tp 2 --tokenizer-dir .tokenizer --out tp70b.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from collections.abc import Callable
from datetime import date
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.engine_bench import CONTEXT, copy_bandwidth_bps, decode_step_ms
from shared.model_source import DUMMY_CONFIGS
from worker.llm import LLM

BATCHES = (1, 64)
MAX_MODEL_LEN = 4096


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from this rank's weights: every parameter once, except
    an untied embedding table (a step reads only its rows)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if getattr(model, "lm_head", None) is not None:
        emb = model.embed_tokens.weight  # type: ignore[union-attr]
        total -= emb.numel() * emb.element_size()
    return total


def run_one(model: str, tp: int, args: argparse.Namespace, copy_bps: float,
            on_row: Callable[[dict[str, Any]], None] = lambda row: None) -> dict[str, Any]:
    """Build ``model`` at tensor-parallel size ``tp``, time its decode steps, hand the row
    to ``on_row`` (before the teardown, which hung on the first 2-GPU run), tear it down."""
    settings = {"load_format": "dummy", "max_num_seqs": max(BATCHES), "max_model_len": MAX_MODEL_LEN,
                "max_num_batched_tokens": 4096, "gpu_memory_utilization": args.gpu_memory_utilization,
                "tensor_parallel_size": tp}
    t0 = time.perf_counter()
    llm = None
    try:
        llm = LLM(model=model, **settings)  # at tp > 1 it starts its group (LLM.close stops it)
        runner = llm.engine.runner
        wb = weight_bytes(runner.model)
        kv_per_token = runner.model.shard_config.kv_bytes_per_token(runner.kv_caches[0][0].element_size())
        row: dict[str, Any] = {"model": model, "tp": tp, "build_s": round(time.perf_counter() - t0, 1),
                               "graph_capture_s": round(runner.capture_time_s, 1),
                               "weight_bytes_per_rank": wb, "num_kv_blocks": runner.num_blocks}
        rng = random.Random(0)
        for batch in BATCHES:
            step = decode_step_ms(llm.engine, batch, args.steps, rng, llm.engine.model_config.vocab_size,
                                  max_tokens=llm.engine.max_model_len - CONTEXT)
            floor = (wb + batch * (CONTEXT + 18) * kv_per_token) / copy_bps * 1e3
            row[f"decode_b{batch}_ms"] = round(step, 3)
            row[f"floor_b{batch}_ms"] = round(floor, 3)
            print(f"{model} TP={tp} batch {batch}: {step:.2f} ms/step (floor {floor:.2f} ms)", flush=True)
        on_row(row)
        return row
    finally:
        if llm is not None:
            llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def serve_e2e(model: str, tp: int, args: argparse.Namespace) -> dict[str, Any]:
    """Start ``inferq serve`` on ``model``'s dummy folder at TP=``tp``, wait for /ready,
    send ``args.num_requests`` completions at once, stop serve (SIGTERM: it drains)."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import httpx

    from bench import procs
    from bench.model_folder import build_model_folder
    from bench.product_bench import wait_ready

    work = Path(tempfile.mkdtemp(prefix="tp-serve-"))
    folder = build_model_folder(model, work, Path(args.tokenizer_dir) if args.tokenizer_dir else None)[0]
    port = procs.free_port()
    log = Path(args.out).with_suffix(".serve.log")
    argv = ["-m", "shared.cli", "serve", "--model", str(folder), "--load-format", "dummy",
            "--tensor-parallel-size", str(tp), "--max-model-len", str(MAX_MODEL_LEN), "--port", str(port),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    t0 = time.perf_counter()
    proc = procs.spawn(argv, log, die_with_parent=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log, timeout_s=1800)
        startup_s = time.perf_counter() - t0
        body = {"model": folder.name, "prompt": "The capital of France is", "max_tokens": 64, "ignore_eos": True,
                "temperature": 0.0}

        def one(_: int) -> int:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=600, trust_env=False)
            if r.status_code != 200:
                raise RuntimeError(f"completion: HTTP {r.status_code}: {r.text[:500]}")
            return int(r.json()["usage"]["completion_tokens"])

        t1 = time.perf_counter()
        with ThreadPoolExecutor(args.num_requests) as pool:
            tokens = sum(pool.map(one, range(args.num_requests)))
        wall_s = time.perf_counter() - t1
        row = {"serve": model, "tp": tp, "startup_s": round(startup_s, 1), "num_requests": args.num_requests,
               "completion_tokens": tokens, "wall_s": round(wall_s, 2), "output_tok_s": round(tokens / wall_s, 1)}
        print(json.dumps(row), flush=True)
        return row
    finally:
        row_rc = procs.stop(proc, timeout_s=120)
        print(f"serve exited {row_rc}; log: {log}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="Qwen2.5-7B,Llama-3-8B",
                    help=f"comma-separated dummy configs ({', '.join(sorted(DUMMY_CONFIGS))})")
    ap.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes")
    ap.add_argument("--steps", type=int, default=50, help="decode steps timed per batch size")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--serve", default="", help="serve this dummy config end to end instead (see above)")
    ap.add_argument("--tokenizer-dir", default="", help="--serve: tokenizer files (default: the default model's)")
    ap.add_argument("--num-requests", type=int, default=16, help="--serve: completions sent at once")
    args = ap.parse_args()
    if args.serve:
        rows = [serve_e2e(args.serve, int(tp), args) for tp in args.tp.split(",")]
        with open(args.out, "w") as f:
            json.dump({"date": date.today().isoformat(), "runs": rows}, f, indent=1)
        return
    copy_bps = copy_bandwidth_bps()
    res: dict[str, Any] = {"date": date.today().isoformat(), "device": torch.cuda.get_device_name(),
                           "num_gpus": torch.cuda.device_count(), "torch": torch.__version__,
                           "context_tokens": CONTEXT, "copy_bps": copy_bps, "runs": []}
    print(f"copy bandwidth {copy_bps / 1e12:.2f} TB/s on {res['device']} x{res['num_gpus']}", flush=True)
    for model in (m.strip() for m in args.models.split(",") if m.strip()):
        for tp in (int(t) for t in args.tp.split(",")):
            def save(row: dict[str, Any]) -> None:
                res["runs"].append(row)
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)

            try:
                run_one(model, tp, args, copy_bps, save)
            except Exception as exc:  # noqa: BLE001 -- keep the other runs' results
                import traceback

                traceback.print_exc()
                save({"model": model, "tp": tp, "error": repr(exc)})
    for r in res["runs"]:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
    # No interpreter teardown after NCCL groups (docs/architecture.md, "Stopping"): its C++
    # destructors could abort the process after the results are written.
    from worker.parallel.group import exit_process

    exit_process(0)
