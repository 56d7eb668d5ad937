"""Placement benchmark: dispatch policies and worker counts on prefix-heavy
workloads, through the whole product, in one command.

For each point (number of workers, ``--dispatch-policy``) it starts a fresh stack, so no
cache carries over: an embedded Redis, ``--gateways`` ``inferq gateway`` processes (own
ports, the client round-robins over them) and N ``inferq worker`` processes (worker ``i``
is ``w<i>``, with its own ``/metrics`` port and, with ``--cuda-devices``, its own GPU as
``CUDA_VISIBLE_DEVICES``: one GPU each, or with ``--tensor-parallel-size N`` the next N, over
which it leads its own group of ranks). One-worker
points run once (placement has one choice). Each point sends a small unmeasured warm-up,
then the workloads of ``--workloads`` in turn, the same prompts at every point
(``bench/placement_workloads.py``: burst, multi_turn, shared_prefix, throughput; streamed
``/v1/completions`` with token-id prompts, ``ignore_eos``, greedy, fixed ``max_tokens``).

Around every phase (the burst, each multi-turn round, the shared-prefix and throughput
runs) it scrapes each worker's ``/metrics`` (``inferq:prefix_cache_queries_total`` and
``..._hits_total``, tokens; ``inferq:prompt_tokens_total`` where a worker exports it, else
the queries stand for its prompt tokens) and each gateway's ``inferq:placements_total``
(per worker and reason). Hit rate = sum of the workers' hit deltas / sum of their query
deltas; a worker's share = its prompt tokens / all workers' in the phase.

Headline per workload (speedup against the one-worker point; scaling = speedup / N):
burst: the round's wall time; multi_turn: the follow-up rounds' total wall time and their
hit rate; shared_prefix and throughput: output tok/s. Writes one JSON (after every point:
a run cut short keeps what it measured) and prints one table per workload.

Multi-turn follow-ups append the previous answer's token ids: from the stream when the
gateway sends them (vLLM's ``return_token_ids``, asked for on every request), else by the
sim backend's echo rule (``worker/backends/sim.py``: output ``i`` is prompt token
``i mod len``), else a stand-in of random ids of the answer's length (the answer's KV is
then not reused, so the follow-up hit rate is a lower bound by up to ``turn_output_len``
tokens a turn; re-tokenizing the text is no better: a dummy model's random output does
not round-trip). ``answer_ids`` in the JSON counts each source.

The client sends from ``--client-processes`` processes (``bench/placement_clients.py``;
default 8 for inferq workers, 1 for sim workers and with ``--device cpu``: a single
process cannot read two GPU workers' streams in time). Each point also records the cores
every role used (``cpu_cores``: gateways, workers, Redis, the client's processes; ``all``
near the host's core count means the host, not the stack, set the pace). On the CPU,
sim workers (``SIM_SIZES``, ``SIM_WORKER``: 10-ms steps, 8 slots, the sim's own prefill
cost per token). On the 2-core host, shared with other work (load
average 6-10), this took 4.8 minutes, 3.1 of them starting the 7 stacks (15-43 s each);
all four workloads took 6.5::

    python -m bench.placement_bench --backend sim --workers 1,2,8 --workloads multi_turn,shared_prefix

Two GPUs (docs/operations.md, "On a GPU machine without a package index", for the
wheels), the real engine, Qwen2.5-7B shapes with dummy weights, the default sizes, all
four workloads: about 6 minutes on 2 x H200::

    python -m bench.placement_bench --export-tokenizer .tokenizer        # here, to carry along
    python -m bench.placement_bench --backend inferq --model Qwen2.5-7B --tokenizer-dir .tokenizer \\
        --workers 1,2 --cuda-devices 0,1 --gateways 2 --log-dir /tmp/pblogs --out $OUT/placement_h200x2.json

Flags of ``inferq worker`` / ``inferq gateway`` that are not this script's own
(``--max-num-batched-tokens 8192``...) go to every process as ``INFERQ_*`` variables.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.host import cpu_description
from bench.loadgen.client import first_model_id
from bench.model_folder import build_model_folder, export_tokenizer
from bench.placement_clients import ClientPool
from bench.placement_stack import Stack, StackConfig, cache_stats
from bench.placement_workloads import (
    WORKLOADS,
    Completion,
    Sent,
    Sizes,
    burst_prompts,
    first_turns,
    next_turn,
    random_ids,
    send_all,
    shared_prefix_prompts,
    summarize,
    throughput_requests,
)
from bench.procs import ROOT
from bench.product_bench import passthrough_env
from shared.model_source import DUMMY_CONFIGS
from shared.settings import DISPATCH_POLICIES

#: Sizes for sim workers on a small CPU host (``--backend sim``): every workload's shape,
#: scaled so that 1, 2 and 8 workers x 3 policies of two workloads run in minutes on 2
#: cores (module docstring). Enough requests per worker slot (``SIM_WORKER``) that one worker needs
#: several waves: the sim's step time does not grow with the batch as a GPU's does, so
#: only waves and prefill make one worker slower than eight.
SIM_SIZES = Sizes(burst_requests=64, burst_prompt_len=1024, burst_output_len=16, users=64, rounds=4,
                  first_prompt_len=1024, turn_len=50, turn_output_len=16, groups=16, prompts_per_group=8,
                  system_prompt_len=1024, question_len=64, shared_output_len=32, throughput_requests=512,
                  throughput_concurrency=128, throughput_input_len=256, throughput_output_len=32)
#: Sim workers' defaults: step time (ms), sequence slots, KV blocks (16 tokens each: 131k
#: tokens, more than any scaled-down workload holds, so one worker evicts nothing).
SIM_WORKER = {"sim_step_time_ms": 10.0, "max_num_seqs": 8, "num_kv_blocks": 8192}
DEFAULT_WORKERS = {"sim": (1, 2, 8), "inferq": (1, 2)}
#: Load client processes beside GPU workers (bench/placement_clients.py). Sim workers and
#: inferq on CPU get one: their token rates leave one process time, and more would take
#: cores from the stack on a small host.
GPU_CLIENT_PROCESSES = 8
#: Headline of each workload: (key in its result, "time" (lower is better) or "rate"),
#: and the key of its hit rate.
HEADLINES = {"burst": ("wall_s", "time", "hit_rate"), "multi_turn": ("follow_up_wall_s", "time", "follow_up_hit_rate"),
             "shared_prefix": ("output_tok_s", "rate", "hit_rate"), "throughput": ("output_tok_s", "rate", "hit_rate")}
WARMUP_PROMPT_LEN, WARMUP_OUTPUT_LEN = 32, 4


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """One run: the points (``worker_counts`` x ``policies``), the workloads and their sizes."""

    stack: StackConfig
    worker_counts: tuple[int, ...]
    policies: tuple[str, ...]
    workloads: tuple[str, ...]
    sizes: Sizes
    session_ids: bool = False  # multi_turn requests carry X-Session-ID: user-<u>
    seed: int = 0
    client_processes: int = 1  # load client processes (bench/placement_clients.py)

    def __post_init__(self) -> None:
        assert self.worker_counts and min(self.worker_counts) >= 1, "worker counts must be at least 1"
        assert list(self.worker_counts) == sorted(set(self.worker_counts)), "worker counts: distinct, ascending"
        assert self.policies and set(self.policies) <= set(DISPATCH_POLICIES), \
            f"policies: some of {', '.join(DISPATCH_POLICIES)}"
        assert self.workloads and set(self.workloads) <= set(WORKLOADS), f"workloads: some of {', '.join(WORKLOADS)}"
        assert self.client_processes >= 1, "client processes: at least 1"
        devices, tp = self.stack.cuda_devices, self.stack.tensor_parallel_size
        assert not devices or len(devices) >= tp * max(self.worker_counts), \
            f"--cuda-devices names {len(devices)} devices for up to {max(self.worker_counts)} workers of {tp} GPUs"

    def points(self) -> list[tuple[int, str]]:
        """``(num_workers, policy)`` in run order: one point for one worker (the first
        policy), every policy for more."""
        return [(n, p) for n in self.worker_counts for p in (self.policies[:1] if n == 1 else self.policies)]


# -- one point ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Run:
    """What the workloads of one point share: the client, the stack's URLs and the model."""

    client: httpx.AsyncClient
    stack: Stack
    model: str
    settings: BenchSettings
    pool: ClientPool | None = None  # sends the phases when the client has several processes
    answer_sources: dict[str, int] = field(default_factory=dict)

    @property
    def urls(self) -> list[str]:
        return [f"{g}/v1/completions" for g in self.stack.gateway_urls]

    def rng(self, workload: str) -> np.random.Generator:
        """The same prompts for a workload at every point; different ones per workload."""
        return np.random.default_rng([self.settings.seed, WORKLOADS.index(workload)])

    async def phase(self, requests: Sequence[Sent], concurrency: int = 0) -> tuple[dict[str, Any], list[Completion]]:
        """Send ``requests``; what the client saw and what the workers and gateways counted."""
        before = await self.stack.snapshot(self.client)
        done, wall_s = await self.send(requests, concurrency)
        after = await self.stack.snapshot(self.client)
        return {**summarize(requests, done, wall_s), **cache_stats(before, after)}, done

    async def send(self, requests: Sequence[Sent], concurrency: int = 0) -> tuple[list[Completion], float]:
        """``send_all`` from this process, or over the pool when there is one."""
        if self.pool is None:
            return await send_all(self.client, self.urls, self.model, requests, concurrency)
        return await self.pool.send_all(self.urls, self.model, requests, concurrency)

    def answer_ids(self, prompt: list[int], done: Completion, rng: np.random.Generator) -> list[int]:
        """The token ids a request generated (module docstring: from the stream, by the sim's
        echo rule, else a stand-in of the same length)."""
        n = done.output.output_tokens if done.output.success else 0
        sim = self.settings.stack.backend == "sim"
        echo = [prompt[i % len(prompt)] for i in range(n)] if sim else []
        if done.token_ids is not None and len(done.token_ids) == n:
            # A sim answer that is not its prompt's echo came back for another request.
            source, ids = "stream" if not sim or done.token_ids == echo else "stream_not_its_prompt", done.token_ids
        elif sim:
            source, ids = "sim_echo", echo
        else:
            source, ids = "stand_in", random_ids(rng, n)
        self.answer_sources[source] = self.answer_sources.get(source, 0) + 1
        return ids


async def run_burst(run: Run) -> dict[str, Any]:
    sizes = run.settings.sizes
    requests = [Sent(p, sizes.burst_output_len) for p in burst_prompts(sizes, run.rng("burst"))]
    result, _ = await run.phase(requests)
    return result


async def run_multi_turn(run: Run) -> dict[str, Any]:
    sizes, rng = run.settings.sizes, run.rng("multi_turn")
    histories = first_turns(sizes, rng)
    headers = [{"X-Session-ID": f"user-{u}"} if run.settings.session_ids else {} for u in range(sizes.users)]
    before = await run.stack.snapshot(run.client)
    rounds = []
    for r in range(sizes.rounds):
        requests = [Sent(h, sizes.turn_output_len, headers[u]) for u, h in enumerate(histories)]
        result, done = await run.phase(requests)
        rounds.append(result)
        if r + 1 < sizes.rounds:
            answers = [run.answer_ids(h, d, rng) for h, d in zip(histories, done, strict=True)]
            histories = [next_turn(h, a, sizes, rng) for h, a in zip(histories, answers, strict=True)]
    whole = cache_stats(before, await run.stack.snapshot(run.client))
    follow = rounds[1:]
    queries = sum(r["cache_queries"] for r in follow)
    return {"rounds": rounds, "follow_up_wall_s": sum(r["wall_s"] for r in follow),
            "follow_up_hit_rate": sum(r["cache_hits"] for r in follow) / queries if queries else None,
            "sent": sum(r["sent"] for r in rounds), "completed": sum(r["completed"] for r in rounds),
            "failed": sum(r["failed"] for r in rounds),
            "prompt_tokens_sent": sum(r["prompt_tokens_sent"] for r in rounds),
            "output_tokens": sum(r["output_tokens"] for r in rounds),
            "output_tokens_expected": sum(r["output_tokens_expected"] for r in rounds),
            "answer_ids": dict(run.answer_sources), **whole}


async def run_shared_prefix(run: Run) -> dict[str, Any]:
    sizes = run.settings.sizes
    prompts = shared_prefix_prompts(sizes, run.rng("shared_prefix"))
    requests = [Sent(p, sizes.shared_output_len) for _, p in prompts]
    result, _ = await run.phase(requests, sizes.shared_concurrency)
    return result


async def run_throughput(run: Run) -> dict[str, Any]:
    sizes = run.settings.sizes
    requests = [Sent(p, n) for p, n in throughput_requests(sizes, run.rng("throughput"))]
    result, _ = await run.phase(requests, sizes.throughput_concurrency)
    return result


RUNNERS = {"burst": run_burst, "multi_turn": run_multi_turn, "shared_prefix": run_shared_prefix,
           "throughput": run_throughput}


async def run_point(settings: BenchSettings, stack: Stack) -> dict[str, Any]:
    """Warm up (unmeasured: connections, first steps), then every workload in turn."""
    sizes = settings.sizes
    concurrency = max(sizes.burst_requests, sizes.users, sizes.throughput_concurrency,
                      sizes.shared_concurrency or sizes.groups * sizes.prompts_per_group)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(settings.stack.request_timeout_s)
    pool = None
    if settings.client_processes > 1:
        pool = ClientPool(settings.client_processes, concurrency, settings.stack.request_timeout_s)
        stack.client_pids = pool.pids
    try:
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
            model = await first_model_id(client, stack.gateway_urls[0], {})
            run = Run(client, stack, model, settings, pool)
            rng = np.random.default_rng([settings.seed, len(WORKLOADS)])
            # Enough warm-up requests that every client process opens a connection.
            num_warm = max(2 * stack.num_workers, settings.client_processes)
            warmup = [Sent(random_ids(rng, WARMUP_PROMPT_LEN), WARMUP_OUTPUT_LEN) for _ in range(num_warm)]
            warm, _ = await run.send(warmup)
            failed = [c.output.error for c in warm if not c.output.success]
            if failed:
                raise RuntimeError(f"warm-up failed: {failed[0]}")
            results = {}
            for workload in settings.workloads:
                results[workload] = await RUNNERS[workload](run)
                print_workload(stack.num_workers, stack.policy, workload, results[workload])
    finally:
        if pool is not None:
            pool.close()
            stack.client_pids = []
    return results


async def watched(work: Coroutine[Any, Any, dict[str, Any]], stack: Stack) -> dict[str, Any]:
    """``work``'s result, or RuntimeError as soon as a process of ``stack`` exits (its
    requests would otherwise wait for their deadline)."""
    task = asyncio.create_task(work)
    while not task.done():
        await asyncio.wait({task}, timeout=1.0)
        if not task.done() and (gone := stack.exited()) is not None:
            task.cancel()
            raise RuntimeError(f"{gone} exited during the point")
    return task.result()


def cell(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec``; "-" for None."""
    return "-" if value is None else format(value, spec)


def print_workload(num_workers: int, policy: str, workload: str, r: dict[str, Any]) -> None:
    """One line per workload as it finishes (multi_turn: each round's wall time and hit
    rate; burst: each worker's share of the prompt tokens)."""
    f = cell
    key, _, hit_key = HEADLINES[workload]
    line = (f"  {num_workers} worker(s), {policy}: {workload} {key}={r[key]:,.2f} hit_rate={f(r.get(hit_key), '.3f')} "
            f"max_share={f(r.get('max_worker_share'), '.2f')} ok={r['completed']}/{r['sent']}")
    if workload == "multi_turn":
        line += "; rounds " + " / ".join(f"{x['wall_s']:.2f} s ({f(x['hit_rate'], '.2f')})" for x in r["rounds"])
    elif workload == "burst":
        line += "; shares " + " ".join(f"{w} {v:.2f}" for w, v in r["worker_shares"].items())
    print(line, flush=True)


# -- the report ----------------------------------------------------------------------------------
def add_speedups(points: list[dict[str, Any]], workloads: Sequence[str]) -> list[dict[str, Any]]:
    """One summary row per (workload, point): headline, speedup against the point with the
    fewest workers (of the same policy when that count has several), scaling = speedup x
    base workers / workers, hit rate and its ratio to the base's, max worker share."""
    rows = []
    done = [p for p in points if "workloads" in p]
    if not done:
        return rows
    base_n = min(p["num_workers"] for p in done)
    for workload in workloads:
        key, kind, hit_key = HEADLINES[workload]
        for p in done:
            r = p["workloads"].get(workload)
            if r is None:
                continue
            bases = [b for b in done if b["num_workers"] == base_n and workload in b["workloads"]]
            base = next((b for b in bases if b["policy"] == p["policy"]), bases[0] if bases else None)
            value, row = r[key], {"workload": workload, "num_workers": p["num_workers"], "policy": p["policy"],
                                  "metric": key, "value": r[key], "hit_rate": r.get(hit_key),
                                  "max_worker_share": r.get("max_worker_share"), "failed": r["failed"],
                                  "to_shared_stream": r.get("to_shared_stream")}
            if base is not None:
                b = base["workloads"][workload]
                speedup = (b[key] / value if kind == "time" else value / b[key]) if value and b[key] else None
                row["speedup"] = speedup
                row["scaling"] = None if speedup is None else speedup * base_n / p["num_workers"]
                b_hit = b.get(hit_key)
                row["hit_rate_vs_base"] = r[hit_key] / b_hit if b_hit and r.get(hit_key) is not None else None
            rows.append(row)
    return rows


def print_tables(rows: list[dict[str, Any]], workloads: Sequence[str]) -> None:
    """One rich table per workload."""
    from rich.console import Console
    from rich.table import Table

    f = cell
    console = Console(width=150)
    for workload in workloads:
        key, kind, hit_key = HEADLINES[workload]
        table = Table(title=f"{workload}: {key} ({'lower' if kind == 'time' else 'higher'} is better), "
                            f"{hit_key.replace('_', ' ')}")
        for header in ("workers", "policy", key, "speedup", "scaling", "hit rate", "hit vs base", "max share",
                       "to shared stream", "failed"):
            table.add_column(header, justify="right")
        for r in (r for r in rows if r["workload"] == workload):
            table.add_row(str(r["num_workers"]), "-" if r["num_workers"] == 1 else r["policy"],
                          f(r["value"], ",.2f"), f(r.get("speedup"), ".2f"), f(r.get("scaling"), ".2f"),
                          f(r["hit_rate"], ".3f"), f(r.get("hit_rate_vs_base"), ".2f"),
                          f(r["max_worker_share"], ".2f"), f(r["to_shared_stream"], "d"), str(r["failed"]))
        console.print(table)


def device_text(stack: StackConfig) -> str:
    """What ran: the GPUs (nvidia-smi) when ``--cuda-devices`` is given, and the host CPU."""
    text = f"host CPU: {cpu_description()}"
    if stack.cuda_devices and shutil.which("nvidia-smi"):
        names = subprocess.run(["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"],
                               capture_output=True, text=True, check=False).stdout.strip().splitlines()
        text = f"GPUs {', '.join(names)}; workers on {','.join(stack.cuda_devices)}; {text}"
    return text


def run(settings: BenchSettings, out: Path, command: str) -> dict[str, Any]:
    """Every point, each on a fresh stack; the JSON written after each."""
    res: dict[str, Any] = {
        "benchmark": "bench.placement_bench", "command": command,
        "date": datetime.now().astimezone().isoformat(timespec="seconds"), "host": os.uname().nodename,
        "device": device_text(settings.stack), "host_cpu_count": os.cpu_count(),
        "host_loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "settings": {**dataclasses.asdict(settings), "stack": settings.stack.as_json()}, "points": []}
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        res["summary"] = add_speedups(res["points"], settings.workloads)
        out.write_text(json.dumps(res, indent=1) + "\n")

    for num_workers, policy in settings.points():
        print(f"{num_workers} worker(s), policy {policy}: starting a fresh stack", flush=True)
        point: dict[str, Any] = {"num_workers": num_workers, "policy": policy}
        res["points"].append(point)
        stack = Stack(settings.stack, num_workers, policy)
        try:
            point["startup_s"] = stack.start()
            point["workloads"] = asyncio.run(watched(run_point(settings, stack), stack))
        except Exception as exc:  # noqa: BLE001 - record the point's failure, go on with the next
            point["error"] = f"{type(exc).__name__}: {exc}"
            print(f"  failed: {point['error']} (logs in {settings.stack.log_dir})", flush=True)
        finally:
            point["exit_codes"] = stack.close()
        save()
    return res


# -- the command line ------------------------------------------------------------------------------
def parse_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, BenchSettings | None, dict[str, str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("sim", "inferq"), default="sim")
    ap.add_argument("--workers", type=parse_list, help="worker counts (sim: 1,2,8; inferq: 1,2)")
    ap.add_argument("--policies", type=parse_list, default=DISPATCH_POLICIES, help="dispatch policies")
    ap.add_argument("--workloads", type=parse_list, default=WORKLOADS, help=", ".join(WORKLOADS))
    ap.add_argument("--gateways", type=int, default=1, help="gateway processes (own ports, round-robin)")
    ap.add_argument("--session-ids", action="store_true", help="multi_turn sends X-Session-ID: user-<u>")
    ap.add_argument("--max-num-seqs", type=int, help="per worker (sim: 8; inferq: 0, the worker's default)")
    ap.add_argument("--num-kv-blocks", type=int, help="per worker (sim: 8192; inferq: 0, the worker's default)")
    ap.add_argument("--sim-step-time-ms", type=float, default=SIM_WORKER["sim_step_time_ms"],
                    help="sim: one step's fixed time, ms")
    ap.add_argument("--sim-prefill-ms-per-token", type=float,
                    help="sim: time each computed (uncached) prompt token adds to its step, ms (default: the sim's)")
    ap.add_argument("--model", choices=sorted(DUMMY_CONFIGS),
                    help="inferq: serve this config with dummy weights (folder built with --tokenizer-dir)")
    ap.add_argument("--model-folder", type=Path, help="inferq: serve this Hugging Face folder (its own weights)")
    ap.add_argument("--tokenizer-dir", type=Path, help="tokenizer files for --model (default: the default model's)")
    ap.add_argument("--export-tokenizer", type=Path, metavar="DIR", help="only write the tokenizer files into DIR")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--cuda-devices", type=parse_list, default=(),
                    help="worker i gets CUDA_VISIBLE_DEVICES=device i (devices i*tp .. i*tp+tp-1 with tensor parallelism)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="inferq: GPUs per worker (each worker leads its own group of ranks)")
    ap.add_argument("--torch-threads", type=int, help="inferq on CPU: threads per worker (default cores // workers)")
    for f in dataclasses.fields(Sizes):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default),
                        help=f"sim: {getattr(SIM_SIZES, f.name)}; inferq: {f.default}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client-processes", type=int,
                    help="load client processes (sim and --device cpu: 1; inferq: 8): one Python process "
                         "cannot read a GPU stack's streams in time (bench/placement_clients.py)")
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/inferq-placement-bench"))
    ap.add_argument("--out", type=Path, help="result JSON (default bench/results/placement/<backend>.json)")
    args, extra = ap.parse_known_args(argv)
    if args.export_tokenizer:
        return args, None, {}
    try:
        env = passthrough_env(extra)
        own = {"INFERQ_BACKEND", "INFERQ_DISPATCH_POLICY", "INFERQ_WORKER_ID", "INFERQ_METRICS_PORT",
               "INFERQ_MAX_MODEL_LEN", "INFERQ_SIM_STEP_TIME_MS", "INFERQ_TENSOR_PARALLEL_SIZE"}
        assert not own & set(env), f"{', '.join(sorted(own & set(env)))}: set by the benchmark itself"
        assert not (args.model and args.model_folder), "give --model or --model-folder, not both"
        assert args.backend == "inferq" or not (args.model or args.model_folder), "--model: --backend inferq only"
        assert set(args.workloads) <= set(WORKLOADS), f"workloads: some of {', '.join(WORKLOADS)}"
        sim = args.backend == "sim"
        base = SIM_SIZES if sim else Sizes()
        sizes = dataclasses.replace(base, **{f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)
                                             if getattr(args, f.name) is not None})
        counts = tuple(int(v) for v in args.workers) if args.workers else DEFAULT_WORKERS[args.backend]
        threads = args.torch_threads or max(1, (os.cpu_count() or 1) // max(counts))
        stack = StackConfig(
            backend=args.backend, num_gateways=args.gateways,
            max_num_seqs=args.max_num_seqs if args.max_num_seqs is not None else sim * SIM_WORKER["max_num_seqs"],
            num_kv_blocks=args.num_kv_blocks if args.num_kv_blocks is not None else sim * SIM_WORKER["num_kv_blocks"],
            max_model_len=sizes.max_total_len(args.workloads), sim_step_time_ms=args.sim_step_time_ms,
            sim_prefill_ms_per_token=args.sim_prefill_ms_per_token, model_folder=args.model_folder,
            device=args.device, cuda_devices=args.cuda_devices,
            tensor_parallel_size=args.tensor_parallel_size, torch_threads=threads, env=env,
            start_timeout_s=args.start_timeout_s, request_timeout_s=args.request_timeout_s, log_dir=args.log_dir)
        settings = BenchSettings(stack=stack, worker_counts=counts, policies=args.policies, workloads=args.workloads,
                                 sizes=sizes, session_ids=args.session_ids, seed=args.seed,
                                 client_processes=args.client_processes
                                 or (GPU_CLIENT_PROCESSES if not sim and args.device != "cpu" else 1))
    except (AssertionError, ValueError) as exc:
        ap.error(str(exc))
    return args, settings, env


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every point ran and every request succeeded, else 1."""
    args, settings, _ = parse_args(argv)
    if settings is None:
        num_bytes = export_tokenizer(args.export_tokenizer)
        print(f"wrote the tokenizer files to {args.export_tokenizer}: {num_bytes / 1e6:.1f} MB")
        return 0
    out = args.out or ROOT / f"bench/results/placement/{settings.stack.backend}.json"
    command = "python -m bench.placement_bench " + shlex.join(argv if argv is not None else sys.argv[1:])
    work = Path(tempfile.mkdtemp(prefix="inferq-placement-bench-"))
    try:
        if args.model:
            folder, _ = build_model_folder(args.model, work, args.tokenizer_dir)
            settings = dataclasses.replace(settings, stack=dataclasses.replace(
                settings.stack, model_folder=folder, load_format="dummy"))
        settings.stack.log_dir.mkdir(parents=True, exist_ok=True)
        res = run(settings, out, command)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_tables(res["summary"], settings.workloads)
    print(f"wrote {out}")
    ok = all("workloads" in p and all(w["failed"] == 0 for w in p["workloads"].values()) for p in res["points"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
