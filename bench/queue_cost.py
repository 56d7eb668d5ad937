"""The cost of the queue on a CPU: output tok/s of the same workload through
(a) the offline engine (``worker.llm.LLM``), (b) gateway + Redis + worker (``inferq serve``
driven by ``bench.serve_bench``'s client), and (c) Hugging Face ``generate`` as the peer.

Workload: random token-id prompts of ``--input-len`` tokens, ``--output-len`` output
tokens with ``ignore_eos``, greedy, at each concurrency in ``--concurrency``. At
concurrency ``c`` the offline engine runs with ``max_num_seqs = c`` and HF ``generate``
decodes padded batches of ``c``.

    python -m bench.queue_cost --concurrency 1,16 --out bench/results/queue_cost_cpu.json
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import torch
import typer

from bench.loadgen import BenchConfig, run_benchmark
from bench.loadgen.runner import build_requests
from shared.sampling import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parents[1]


def offline_tok_s(prompts: list[list[int]], concurrency: int, output_len: int) -> float:
    from worker.llm import LLM

    llm = LLM(max_num_seqs=concurrency, enable_prefix_caching=False)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    elapsed = time.perf_counter() - t0
    assert all(len(o.token_ids) == output_len for o in outs)
    return len(prompts) * output_len / elapsed


def hf_tok_s(prompts: list[list[int]], concurrency: int, output_len: int) -> float:
    from transformers import AutoModelForCausalLM

    from shared.model_source import resolve_model

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(MODEL).path), dtype=torch.float32).eval()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), concurrency):
            batch = torch.tensor(prompts[i:i + concurrency])  # equal lengths: no padding needed
            out = model.generate(batch, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
            assert out.shape[1] == batch.shape[1] + output_len
    return len(prompts) * output_len / (time.perf_counter() - t0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def served_result(cfg: BenchConfig, max_num_seqs: int) -> dict:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", "--port", str(port),
                             "--max-num-seqs", str(max_num_seqs), "--no-enable-prefix-caching",
                             "--log-level", "warning"], cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:  # healthy gateway, and a worker that answers
            assert proc.poll() is None and time.monotonic() < deadline, "inferq serve did not come up"
            try:
                r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                               timeout=60)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        result = asyncio.run(run_benchmark(replace(cfg, base_url=base)))
        return result.to_dict()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(concurrency: str = "1,16", input_len: int = 256, output_len: int = 64,
         prompts_per_slot: int = 2, out: Path = Path("bench/results/queue_cost_cpu.json"),
         skip_hf: bool = False) -> None:
    """Run (a), (b), (c) at each concurrency and write one JSON file."""
    rows = []
    for c in (int(x) for x in concurrency.split(",")):
        n = max(4, prompts_per_slot * c)
        cfg = BenchConfig(model=MODEL, random_input_len=input_len, random_output_len=output_len, num_prompts=n,
                          max_concurrency=c, ignore_eos=True, seed=c, show_progress=False)
        prompts = [list(r.prompt) for r in build_requests(cfg)]
        assert all(len(p) == input_len for p in prompts)
        offline = offline_tok_s(prompts, c, output_len)
        served = served_result(cfg, c)
        hf = None if skip_hf else hf_tok_s(prompts, c, output_len)
        row = {"concurrency": c, "num_prompts": n, "offline_output_tok_s": offline,
               "served_output_tok_s": served["output_throughput"], "hf_generate_output_tok_s": hf,
               "queue_cost_ratio": served["output_throughput"] / offline,
               "served_failed": served["failed"], "served_total_output_tokens": served["total_output_tokens"],
               "served_mean_ttft_ms": served["mean_ttft_ms"], "served_mean_tpot_ms": served["mean_tpot_ms"],
               "served_p99_itl_ms": served["p99_itl_ms"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": f"CPU {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, torch {torch.__version__}", "model": MODEL, "dtype": "float32",
            "input_len": input_len, "output_len": output_len,
            "command": "python -m bench.queue_cost " + " ".join(sys.argv[1:])}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    typer.run(main)
