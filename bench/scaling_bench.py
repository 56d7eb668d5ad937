"""Scaling benchmark: output throughput with 1, 2, 4, 8 workers behind one Redis and 1 or 2 gateways.

Starts one embedded Redis, the gateways (``python -m shared.cli gateway``) and the workers
(``python -m shared.cli worker``), each its own process, and drives them with the load
generator (``bench.loadgen``, streaming ``/v1/completions``, token-id prompts, ``ignore_eos``),
which splits requests round-robin over the gateways in use. The offered work per worker is
fixed: ``max_num_seqs`` concurrent streams per worker (concurrency = ``max_num_seqs * N``),
each stream sending ``rounds`` requests of ``output_len`` tokens one after another, so a
perfect system has every sequence slot busy all the time.

- ``--backend sim`` (default): model-free workers that emit one token per running request
  every ``step_time_ms``: the ideal is ``N * max_num_seqs * 1000 / step_time_ms`` tok/s, so
  anything below it is queue, relay or gateway overhead.
- ``--backend inferq``: the real engine with the default model (SmolLM2-135M-Instruct) on the
  CPU, 1 against 2 workers, one gateway. Each worker gets ``--torch-threads`` intra-op
  threads through ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` (default: CPU cores // largest
  worker count, i.e. 1 on a 2-core machine), so N workers use N cores and never
  oversubscribe them; the gateway, Redis and the load client share the same cores.

Scaling efficiency = tput(N) / (N * tput(1)), with tput(1) the one-worker point of the same
gateway count. Each point records the CPU seconds of every process during the measured run
(``/proc/PID/stat``; the client from ``time.process_time``): a gateway near 1 core, Redis near
1 core, or all processes together near the host's core count, shows where efficiency is lost.

Usage: ``python -m bench.scaling_bench`` (sim) or ``python -m bench.scaling_bench --backend
inferq``; results to ``bench/results/scaling_sim.json`` / ``scaling_cpu_model.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.loadgen.client import RequestOutput
from bench.loadgen.config import BenchConfig
from bench.loadgen.report import BenchResult
from bench.loadgen.runner import run_benchmark
from bench.procs import ROOT, cpu_s, free_port, redis_pid, start, stop, wait_for_gateway, wait_for_workers

RESULT_PATHS = {"sim": ROOT / "bench/results/scaling_sim.json", "inferq": ROOT / "bench/results/scaling_cpu_model.json"}
# Per backend, when not given on the command line: (worker counts, gateway counts), and rounds
# (a real model on the CPU is slow: 2 rounds keep the run to a few minutes).
DEFAULT_COUNTS = {"sim": ((1, 2, 4, 8), (1, 2)), "inferq": ((1, 2), (1,))}
DEFAULT_ROUNDS = {"sim": 4, "inferq": 2}
DEFAULT_LOG_DIR = "/tmp/inferq-scaling-bench"


@dataclass(frozen=True, slots=True)
class ScalingConfig:
    """One scaling run. Lengths in tokens; ``rounds`` = requests each stream sends in turn."""

    backend: str = "sim"
    worker_counts: tuple[int, ...] = (1, 2, 4, 8)
    gateway_counts: tuple[int, ...] = (1, 2)
    max_num_seqs: int = 16
    step_time_ms: float = 50.0  # sim only
    input_len: int = 16
    output_len: int = 64
    rounds: int = 4
    warmup_output_len: int = 4
    torch_threads: int = 1  # inferq only: intra-op threads per worker
    request_timeout_s: float = 600.0
    start_timeout_s: float = 300.0
    seed: int = 0
    show_progress: bool = True
    log_dir: str = DEFAULT_LOG_DIR  # one log file per process

    def __post_init__(self) -> None:
        assert self.backend in RESULT_PATHS, f"backend must be one of {list(RESULT_PATHS)}"
        assert self.worker_counts and all(n >= 1 for n in self.worker_counts)
        assert list(self.worker_counts) == sorted(set(self.worker_counts)), "worker counts: distinct, ascending"
        assert self.gateway_counts and all(g >= 1 for g in self.gateway_counts)
        assert self.max_num_seqs >= 1 and self.step_time_ms > 0 and self.rounds >= 1
        assert self.input_len >= 1 and self.output_len >= 2 and self.torch_threads >= 1

    def concurrency(self, num_workers: int) -> int:
        """Streams in flight with ``num_workers`` workers: every sequence slot busy."""
        return self.max_num_seqs * num_workers

    def ideal_output_throughput(self, num_workers: int) -> float | None:
        """Sim: every slot emits a token per step, tok/s. None for a real model (no ideal known)."""
        if self.backend != "sim":
            return None
        return num_workers * self.max_num_seqs * 1000.0 / self.step_time_ms


@dataclass(slots=True)
class PointResult:
    """One measured point. Throughputs per second of ``duration_s``; CPU in seconds and cores."""

    num_workers: int
    num_gateways: int
    concurrency: int
    sent: int
    completed: int
    failed: int
    total_output_tokens: int
    expected_output_tokens: int  # sent * output_len (ignore_eos)
    duration_s: float
    output_throughput: float  # tok/s over the whole run
    steady_output_throughput: float  # tok/s between the 10th and 90th percentile token receive times
    request_throughput: float  # req/s
    ideal_output_throughput: float | None
    mean_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    mean_itl_ms: float
    p99_itl_ms: float
    cpu_s: dict[str, float]  # per process during the run
    cpu_cores: dict[str, float]  # per role: cpu_s / duration_s (1.0 = one core busy all the time)
    efficiency: float | None = None  # tput(N) / (N * tput(1)), same gateway count
    steady_efficiency: float | None = None  # the same from steady_output_throughput
    fraction_of_ideal: float | None = None  # sim only: tput(N) / ideal(N)
    errors: list[str] = field(default_factory=list)  # first distinct request errors


def steady_output_throughput(outputs: list[RequestOutput], low_q: float = 0.1, high_q: float = 0.9) -> float:
    """Output tok/s between the ``low_q`` and ``high_q`` quantiles of content-chunk receive times.

    Leaves out the ramp (every stream's first request arriving at once) and the tail (the last
    requests finishing), which weigh more with more workers. A chunk counts as
    ``output_tokens / num_chunks`` of its request's tokens (one each unless the server merged some).
    """
    times_s, tokens = [], []
    for out in outputs:
        if out.success:
            chunk_s = out.start_s + out.ttft_s + np.concatenate(([0.0], np.cumsum(out.itls_s)))
            times_s.append(chunk_s)
            tokens.append(np.full(chunk_s.size, out.output_tokens / chunk_s.size))
    if not times_s:
        return 0.0
    all_s, all_tokens = np.concatenate(times_s), np.concatenate(tokens)
    low_s, high_s = np.quantile(all_s, [low_q, high_q])
    inside = (all_s > low_s) & (all_s <= high_s)
    return float(all_tokens[inside].sum() / (high_s - low_s)) if high_s > low_s else 0.0


def role_cores(cpu: dict[str, float], duration_s: float) -> dict[str, float]:
    """CPU cores used per role: each gateway's and worker's maximum, totals, Redis, client, all."""
    by_role: dict[str, list[float]] = {"gateway": [], "worker": []}
    for name, seconds in cpu.items():
        role = name.split("-")[0]
        if role in by_role:
            by_role[role].append(seconds)
    cores = {
        "gateway_max": max(by_role["gateway"], default=0.0) / duration_s,
        "gateways": sum(by_role["gateway"]) / duration_s,
        "worker_max": max(by_role["worker"], default=0.0) / duration_s,
        "workers": sum(by_role["worker"]) / duration_s,
        "redis": cpu["redis"] / duration_s,
        "client": cpu["client"] / duration_s,
    }
    cores["all"] = sum(cpu.values()) / duration_s
    return cores


class Cluster:
    """One Redis, gateways and workers as child processes; workers are added, never removed."""

    def __init__(self, cfg: ScalingConfig) -> None:
        from shared.embedded_redis import EmbeddedRedis

        self.cfg = cfg
        self.logs = Path(cfg.log_dir)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.redis = EmbeddedRedis().start()
        self.redis_pid = redis_pid(self.redis.url)
        self.gateways: list[tuple[subprocess.Popen[bytes], str]] = []
        self.workers: list[subprocess.Popen[bytes]] = []

    def add_gateways(self, total: int) -> None:
        """Start gateways until ``total`` run, and wait until each answers ``/health``."""
        started = []
        while len(self.gateways) < total:
            port = free_port()
            i = len(self.gateways)
            proc = start("gateway", self.redis.url, "--port", str(port), "--log-level", "warning",
                         log_path=self.logs / f"gateway-{i}.log")
            self.gateways.append((proc, f"http://127.0.0.1:{port}"))
            started.append(self.gateways[-1])
        for proc, url in started:
            wait_for_gateway(url, proc, self.cfg.start_timeout_s)

    def worker_args(self, i: int) -> tuple[list[str], dict[str, str]]:
        """CLI flags and extra environment of worker ``i``."""
        cfg = self.cfg
        args = ["--backend", cfg.backend, "--worker-id", f"{cfg.backend}-{i}", "--max-num-seqs",
                str(cfg.max_num_seqs), "--log-level", "warning"]
        if cfg.backend == "sim":
            return [*args, "--sim-step-time-ms", str(cfg.step_time_ms)], {}
        threads = str(cfg.torch_threads)
        return args, {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}

    def scale_workers(self, total: int) -> None:
        """Start workers until ``total`` run, and wait for all their heartbeats."""
        while len(self.workers) < total:
            args, env = self.worker_args(len(self.workers))
            log_path = self.logs / f"worker-{len(self.workers)}.log"
            self.workers.append(start("worker", self.redis.url, *args, log_path=log_path, env=env))
        wait_for_workers(self.redis.url, total, self.workers, self.cfg.start_timeout_s)

    def pids(self) -> dict[str, int]:
        """Process ids by name: ``gateway-0``, ``worker-3``, ``redis``."""
        pids = {f"gateway-{i}": proc.pid for i, (proc, _) in enumerate(self.gateways)}
        pids |= {f"worker-{i}": proc.pid for i, proc in enumerate(self.workers)}
        pids["redis"] = self.redis_pid
        return pids

    def close(self) -> list[int]:
        """Stop workers (SIGTERM drains), gateways and Redis; returns the workers' exit codes."""
        codes = [stop(w) for w in self.workers]
        for proc, _ in self.gateways:
            stop(proc)
        self.redis.close()
        return codes


def bench_config(cfg: ScalingConfig, urls: list[str], concurrency: int, num_prompts: int, output_len: int,
                 seed: int) -> BenchConfig:
    """The load generator's settings for one run over ``urls`` (round-robin)."""
    return BenchConfig(base_url=urls[0], extra_base_urls=tuple(urls[1:]), random_input_len=cfg.input_len,
                       random_output_len=output_len, num_prompts=num_prompts, max_concurrency=concurrency,
                       ignore_eos=True, seed=seed, timeout_s=cfg.request_timeout_s,
                       show_progress=cfg.show_progress)


def measure(cluster: Cluster, bench: BenchConfig) -> tuple[BenchResult, dict[str, float]]:
    """Run ``bench`` and return its result and each process's CPU seconds during the run."""
    pids = cluster.pids()
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    client_before = time.process_time()
    result = asyncio.run(run_benchmark(bench))
    cpu = {name: cpu_s(pid) - before[name] for name, pid in pids.items()}
    cpu["client"] = time.process_time() - client_before
    return result, cpu


def run_point(cluster: Cluster, cfg: ScalingConfig, num_workers: int, num_gateways: int, seed: int) -> PointResult:
    """Warm up, then measure ``rounds`` requests per stream with ``num_workers`` and ``num_gateways``."""
    urls = [url for _, url in cluster.gateways[:num_gateways]]
    concurrency = cfg.concurrency(num_workers)
    # Warm-up (not measured): connections, and the first forward passes of a real model.
    asyncio.run(run_benchmark(dataclasses.replace(
        bench_config(cfg, urls, concurrency, concurrency, cfg.warmup_output_len, seed + 1), show_progress=False)))
    sent = cfg.rounds * concurrency
    result, cpu = measure(cluster, bench_config(cfg, urls, concurrency, sent, cfg.output_len, seed))
    m = result.metrics
    ideal = cfg.ideal_output_throughput(num_workers)
    return PointResult(
        num_workers=num_workers, num_gateways=num_gateways, concurrency=concurrency, sent=sent,
        completed=m.completed, failed=m.failed, total_output_tokens=m.total_output_tokens,
        expected_output_tokens=sent * cfg.output_len, duration_s=m.duration_s,
        output_throughput=m.output_throughput, steady_output_throughput=steady_output_throughput(result.outputs),
        request_throughput=m.request_throughput,
        ideal_output_throughput=ideal, fraction_of_ideal=None if ideal is None else m.output_throughput / ideal,
        mean_ttft_ms=m.latency["ttft"].mean_ms, p99_ttft_ms=m.latency["ttft"].percentiles_ms[99.0],
        mean_tpot_ms=m.latency["tpot"].mean_ms, mean_itl_ms=m.latency["itl"].mean_ms,
        p99_itl_ms=m.latency["itl"].percentiles_ms[99.0], cpu_s=cpu, cpu_cores=role_cores(cpu, m.duration_s),
        errors=sorted({o.error for o in result.outputs if o.error})[:5],
    )


def add_efficiency(points: list[PointResult]) -> None:
    """Set ``efficiency`` = (tput(N) / N) / (tput(N0) / N0), N0 the fewest workers of the same
    gateway count (1 by default), and ``steady_efficiency`` likewise from the steady throughput."""
    for point in points:
        base = min((p for p in points if p.num_gateways == point.num_gateways), key=lambda p: p.num_workers)
        scale = point.num_workers / base.num_workers
        if base.output_throughput > 0:
            point.efficiency = point.output_throughput / (scale * base.output_throughput)
        if base.steady_output_throughput > 0:
            point.steady_efficiency = point.steady_output_throughput / (scale * base.steady_output_throughput)


def run(cfg: ScalingConfig) -> list[PointResult]:
    """Every (workers, gateways) point: workers ascending, each gateway count at each worker count."""
    cluster = Cluster(cfg)
    points: list[PointResult] = []
    try:
        cluster.add_gateways(max(cfg.gateway_counts))
        for num_workers in cfg.worker_counts:
            cluster.scale_workers(num_workers)
            for num_gateways in cfg.gateway_counts:
                seed = cfg.seed + 1000 * len(points)  # fresh prompts per point: no prefix-cache reuse
                points.append(run_point(cluster, cfg, num_workers, num_gateways, seed))
                print_point(points[-1])
    finally:
        codes = cluster.close()
    if any(codes):
        print(f"warning: worker exit codes {codes} (see {cfg.log_dir})", file=sys.stderr)
    add_efficiency(points)
    return points


NOTES = [
    "efficiency = output_throughput(N) / (N * output_throughput(1 worker)) at the same gateway count",
    ("steady_output_throughput counts only tokens received between the 10th and 90th percentile of receive times "
     "(no ramp, no tail); steady_efficiency is efficiency computed from it"),
    ("cpu_cores = CPU seconds of a process (or role) during the measured run / its duration: 1.0 is one core busy; "
     "'all' near host_cpu_count means the host itself is saturated (every process shares its cores)"),
    ("each point runs after an unmeasured warm-up of `concurrency` short requests; workers are added between "
     "points and never removed; every point uses fresh random prompts"),
]


def ideal_text(cfg: ScalingConfig) -> str:
    """What a perfect system would deliver, in words."""
    if cfg.backend == "sim":
        per_worker = cfg.max_num_seqs * 1000.0 / cfg.step_time_ms
        return (f"N * max_num_seqs * 1000 / step_time_ms = N * {per_worker:g} output tok/s (every sequence slot "
                "emits one token per sim step), i.e. efficiency 1.0")
    return (f"N * output_throughput(1 worker), efficiency 1.0; each worker has {cfg.torch_threads} torch thread(s) "
            f"(OMP_NUM_THREADS) on a {os.cpu_count()}-core host shared with the gateway, Redis and the load client")


def report(cfg: ScalingConfig, points: list[PointResult], loadavg_before: tuple[float, ...]) -> dict[str, Any]:
    """The result JSON: settings, the ideal, one row per point, notes."""
    return {
        "bench": "scaling", "backend": cfg.backend, "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": "python -m bench.scaling_bench " + " ".join(sys.argv[1:]),
        "device": f"{platform.node()}: {os.cpu_count()} CPU cores (no GPU) shared by every process",
        "host_cpu_count": os.cpu_count(), "host_loadavg_before": [round(x, 2) for x in loadavg_before],
        "config": dataclasses.asdict(cfg), "ideal": ideal_text(cfg),
        "ideal_output_throughput_per_worker": cfg.ideal_output_throughput(1),
        "points": [dataclasses.asdict(p) for p in points], "notes": NOTES,
    }


def print_point(p: PointResult) -> None:
    """One line per point as it finishes."""
    cores = p.cpu_cores
    print(f"workers={p.num_workers} gateways={p.num_gateways}: {p.completed}/{p.sent} ok, "
          f"{p.output_throughput:.0f} tok/s in {p.duration_s:.1f} s; cores gw_max={cores['gateway_max']:.2f} "
          f"redis={cores['redis']:.2f} client={cores['client']:.2f} all={cores['all']:.2f}", flush=True)


def print_table(points: list[PointResult]) -> None:
    """Rich table of the points."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="scaling: output throughput")
    for header in ("gateways", "workers", "ok/sent", "tok/s", "steady tok/s", "ideal", "efficiency",
                   "steady eff.", "gw max", "redis", "workers", "client", "all cores"):
        table.add_column(header, justify="right")
    for p in points:
        c = p.cpu_cores
        table.add_row(str(p.num_gateways), str(p.num_workers), f"{p.completed}/{p.sent}",
                      f"{p.output_throughput:.0f}", f"{p.steady_output_throughput:.0f}",
                      "-" if p.ideal_output_throughput is None else f"{p.ideal_output_throughput:.0f}",
                      "-" if p.efficiency is None else f"{p.efficiency:.2f}",
                      "-" if p.steady_efficiency is None else f"{p.steady_efficiency:.2f}", f"{c['gateway_max']:.2f}",
                      f"{c['redis']:.2f}", f"{c['workers']:.2f}", f"{c['client']:.2f}", f"{c['all']:.2f}")
    Console(width=160).print(table)


def parse_counts(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``."""
    return tuple(int(v) for v in text.split(",") if v.strip())


def parse_args(argv: list[str] | None) -> tuple[ScalingConfig, Path]:
    """Command line -> settings and the output path (defaults depend on ``--backend``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=sorted(RESULT_PATHS), default="sim")
    parser.add_argument("--workers", type=parse_counts, help="worker counts (sim: 1,2,4,8; inferq: 1,2)")
    parser.add_argument("--gateways", type=parse_counts, help="gateway counts (sim: 1,2; inferq: 1)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="sequence slots (= streams) per worker")
    parser.add_argument("--step-time-ms", type=float, default=50.0, help="sim step time, ms")
    parser.add_argument("--input-len", type=int, default=16, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    parser.add_argument("--rounds", type=int, help="requests each stream sends in turn (sim: 4; inferq: 2)")
    parser.add_argument("--torch-threads", type=int, help="inferq: threads per worker (default cores // workers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--log-dir", default=DEFAULT_LOG_DIR)
    parser.add_argument("--out", type=Path, help="result JSON (default bench/results/scaling_<sim|cpu_model>.json)")
    args = parser.parse_args(argv)
    default_workers, default_gateways = DEFAULT_COUNTS[args.backend]
    workers = args.workers or default_workers
    threads = args.torch_threads or max(1, (os.cpu_count() or 1) // max(workers))
    try:
        cfg = ScalingConfig(
            backend=args.backend, worker_counts=workers, gateway_counts=args.gateways or default_gateways,
            max_num_seqs=args.max_num_seqs, step_time_ms=args.step_time_ms, input_len=args.input_len,
            output_len=args.output_len, rounds=args.rounds or DEFAULT_ROUNDS[args.backend], torch_threads=threads,
            seed=args.seed, show_progress=not args.no_progress, log_dir=args.log_dir)
    except AssertionError as exc:
        parser.error(str(exc))
    return cfg, args.out or RESULT_PATHS[args.backend]


def main(argv: list[str] | None = None) -> None:
    """Run, write the JSON, print the table; exit 1 if any request failed."""
    cfg, out = parse_args(argv)
    loadavg_before = os.getloadavg()  # other work on the host skews every number here
    points = run(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report(cfg, points, loadavg_before), indent=2) + "\n")
    print_table(points)
    print(f"wrote {out}")
    sys.exit(0 if all(p.completed == p.sent for p in points) else 1)


if __name__ == "__main__":
    main()
