"""The product against the offline engine, in one command (issue 13): the same workload
through (a) the offline engine (``worker.llm.LLM``'s engine, no Redis) and (b) the full
stack, ``inferq serve`` (embedded Redis, gateway, one worker) driven by the load client
(``bench.loadgen``), at several concurrencies, two passes after each start.

1. Builds the model folder (``bench.model_folder``): the ``config.json`` of ``--model``
   (a ``DUMMY_CONFIGS`` name) beside the default model's tokenizer files (``--tokenizer-dir``,
   written here by ``--export-tokenizer DIR``; default the converted SmolLM2 folder).
2. Offline engine, one subprocess per distinct ``max_num_seqs`` (its GPU memory is gone
   before serve starts): ``--num-prompts`` prompts of ``--input-len`` random token ids,
   ``--output-len`` tokens, ``ignore_eos``, greedy, all submitted at once, after a small
   warm-up; output tok/s. ``max_num_seqs`` = min(concurrency, ``--max-num-seqs``).
3. Full stack, one ``serve`` start per concurrency (``--load-format dummy``, same
   ``max_num_seqs``), ``/ready`` awaited, then ``--passes`` passes of the client at that
   concurrency. Pass 1 (the first after start) sends the offline run's prompts; later passes
   send fresh ones, so the prefix cache does not serve them. Per pass: output tok/s and its
   ratio to the offline run, TTFT and ITL mean / median / p99, and the CPU seconds per 1,000
   output tokens of the gateway, the worker and Redis (serve's process tree, from /proc) and
   of the client (this process).
4. Writes one JSON (after every step: a run cut short keeps what it measured) and prints a
   markdown table for docs/benchmarks.md.

Flags of ``inferq serve`` that are not this script's own (``--max-num-batched-tokens 4096``,
``--no-enable-prefix-caching``...) go, as ``INFERQ_*`` variables, to serve and to the
offline engine alike. ``--max-seconds`` stops starting new steps after that many seconds.

    python -m bench.product_bench --export-tokenizer tokenizer/          # here, to carry
    python -m bench.product_bench --tokenizer-dir tokenizer/ --out $OUT/product_h100.json
    python -m bench.product_bench --model SmolLM2-135M --device cpu --num-prompts 16 \\
        --input-len 32 --output-len 8 --concurrency 4 --out /tmp/product_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import typing
from datetime import date
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.host import cpu_description
from bench.kv_sampler import KVSampler
from bench.loadgen import BenchConfig, run_benchmark
from bench.loadgen.multiproc import run_split
from bench.loadgen.runner import build_requests
from bench.model_folder import build_model_folder, export_tokenizer
from bench.procs import ROOT, cmdline, cpu_times, descendants, free_port, spawn, stop
from shared.model_source import DUMMY_CONFIGS
from shared.settings import ALL_SETTINGS, env_name, flag_name

ROLES = ("gateway", "worker", "redis", "client")
#: Settings this script sets itself (a pass-through flag may not override them).
OWN_SETTINGS = frozenset({"model", "served_model_name", "load_format", "device", "max_num_seqs", "host", "port",
                          "redis_url", "namespace"})
WARMUP_PROMPTS, WARMUP_OUTPUT_LEN = 8, 4  # offline warm-up, as bench/engine_bench.py's serve section


class Clock:
    """The ``--max-seconds`` guard: time left, and whether to start another step."""

    def __init__(self, max_s: float) -> None:
        self.start_s, self.max_s = time.monotonic(), max_s

    def elapsed_s(self) -> float:
        return time.monotonic() - self.start_s

    def left_s(self) -> float:
        return self.max_s - self.elapsed_s()


def passthrough_env(tokens: list[str]) -> dict[str, str]:
    """``INFERQ_*`` variables for the settings flags in ``tokens`` (``--flag value``,
    ``--flag=value``, ``--switch`` / ``--no-switch``).

    Raises:
        ValueError: an unknown flag, a flag this script sets itself, a missing value.
    """
    fields: dict[str, tuple[dataclasses.Field[Any], bool]] = {}
    for cls in ALL_SETTINGS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            fields[flag_name(f)] = (f, hints[f.name] is bool)
    env: dict[str, str] = {}
    rest = list(tokens)
    while rest:
        flag, _, value = rest.pop(0).partition("=")
        negated = flag.startswith("--no-") and fields.get("--" + flag[5:], (None, False))[1]
        f, is_bool = fields.get("--" + flag[5:] if negated else flag, (None, False))
        if f is None:
            raise ValueError(f"unknown flag {flag!r} (neither this script's nor a setting of inferq serve)")
        if f.name in OWN_SETTINGS:
            raise ValueError(f"{flag} is set by the benchmark itself")
        if is_bool:
            value = "false" if negated else (value or "true")
        elif not value:
            if not rest:
                raise ValueError(f"{flag} needs a value")
            value = rest.pop(0)
        env[env_name(f)] = value
    return env


def workload(args: argparse.Namespace, seed: int, **overrides: Any) -> BenchConfig:
    """The client's settings for one pass (also what the offline run's prompts are built from)."""
    return BenchConfig(random_input_len=args.input_len, random_output_len=args.output_len,
                       num_prompts=args.num_prompts, ignore_eos=True, seed=seed, show_progress=False, **overrides)


def max_num_seqs_for(args: argparse.Namespace, concurrency: int) -> int:
    """The engine's ``max_num_seqs`` at ``concurrency``: no more slots than streams, at most the cap."""
    return min(concurrency, args.max_num_seqs)


# -- the offline engine, in its own process ----------------------------------------------------
def offline_child(spec_path: Path) -> int:
    """Run the offline engine as ``spec_path`` (JSON) says; write the result beside it."""
    import torch

    from shared.sampling import SamplingParams
    from shared.settings import EngineSettings, ModelSettings, build
    from worker.llm import LLM

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(spec_path.read_text())
    args = argparse.Namespace(**spec["args"])
    # Settings as serve builds them: this script's flags over the INFERQ_* pass-through variables.
    model = build(ModelSettings, {"model": spec["model_dir"], "load_format": "dummy", "device": args.device})
    engine_settings = build(EngineSettings, {"max_num_seqs": spec["max_num_seqs"]})
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(model), **dataclasses.asdict(engine_settings))
    build_s = time.perf_counter() - t0
    engine = llm.engine
    warmup = [list(r.prompt) for r in build_requests(workload(args, args.seed + 1000))][:WARMUP_PROMPTS]
    llm.generate(warmup, SamplingParams(max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True, temperature=0.0))
    prompts = [list(r.prompt) for r in build_requests(workload(args, args.seed))]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"offline-{i}", prompt, params)
    num_output_tokens = num_steps = 0
    async_before = engine.num_async_steps
    trace: list[dict[str, float]] = []  # per step, as the worker's StepTrace (running / waiting after it)
    while engine.has_unfinished_requests():
        num_output_tokens += sum(len(out.new_token_ids) for out in engine.step())
        num_steps += 1
        if spec.get("step_trace"):
            stats = engine.stats()
            trace.append({"done": time.monotonic(), "running": stats.num_running, "waiting": stats.num_waiting})
    wall_s = time.perf_counter() - t0
    assert num_output_tokens == len(prompts) * args.output_len, num_output_tokens
    device = engine.device
    result = {"max_num_seqs": spec["max_num_seqs"], "num_prompts": len(prompts),
              "total_output_tokens": num_output_tokens, "wall_s": wall_s, "output_tok_s": num_output_tokens / wall_s,
              "engine": {"steps": num_steps, "async_steps": engine.num_async_steps - async_before,
                         "busy_s": wall_s, "ms_per_step": wall_s * 1000 / max(num_steps, 1)},
              "build_s": build_s, "backend": engine.runner.backend.name, "dtype": str(engine.dtype),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description(),
              "torch": torch.__version__}
    if spec.get("step_trace"):
        Path(spec["step_trace"]).write_text("".join(json.dumps(line) + "\n" for line in trace))
    spec_path.with_suffix(".result.json").write_text(json.dumps(result))
    # A group (--tensor-parallel-size N) it started: its ranks exit; this process ends next.
    llm.close(abort=False)
    if engine_settings.tensor_parallel_size > 1:
        # No interpreter teardown after NCCL (docs/architecture.md, "Stopping"): its C++
        # destructors aborted this process after the result was written (2 H200s).
        from worker.parallel.group import exit_process

        exit_process(0)
    return 0


def run_offline(args: argparse.Namespace, model_dir: Path, max_num_seqs: int, env: dict[str, str],
                work: Path, timeout_s: float) -> dict[str, Any]:
    """The offline engine at ``max_num_seqs`` in a subprocess (log in ``--log-dir``).

    Raises:
        RuntimeError: the subprocess failed or ran past ``timeout_s`` seconds.
    """
    spec = work / f"offline-{max_num_seqs}.json"
    workload_args = {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "seed", "device")}
    log = Path(args.log_dir) / f"offline-{max_num_seqs}.log"
    trace = str(Path(args.log_dir) / f"steps-offline-{max_num_seqs}.jsonl") if args.step_trace else None
    spec.write_text(json.dumps({"args": workload_args, "model_dir": str(model_dir), "max_num_seqs": max_num_seqs,
                                "step_trace": trace}))
    proc = spawn(["-m", "bench.product_bench", "--offline-child", str(spec)], log, env, die_with_parent=True)
    try:
        code = proc.wait(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        stop(proc, timeout_s=10)
        raise RuntimeError(f"offline run at max_num_seqs {max_num_seqs} passed {timeout_s:.0f} s; log {log}") from None
    if code != 0:
        raise RuntimeError(f"offline run exited {code}: {tail(log)}")
    return dict(json.loads(spec.with_suffix(".result.json").read_text()))


def tail(path: Path, num_chars: int = 2000) -> str:
    """The end of a log file ('' when it is missing)."""
    return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""


# -- the full stack ----------------------------------------------------------------------------
def serve_argv(args: argparse.Namespace, model_dir: Path, max_num_seqs: int, port: int) -> list[str]:
    """``python -m shared.cli serve ...`` arguments of one start (``--gateway-workers`` only when given)."""
    argv = ["-m", "shared.cli", "serve", "--model", str(model_dir), "--load-format", "dummy", "--device",
            args.device, "--max-num-seqs", str(max_num_seqs), "--port", str(port), "--log-level", "warning"]
    return argv + (["--gateway-workers", str(args.gateway_workers)] if args.gateway_workers else [])


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float, path: str = "/ready",
               name: str = "inferq serve") -> None:
    """Wait until ``GET url/ready`` (or ``path``) answers 200 (a worker is ready;
    gateway/readiness.py). ``name`` names the server in errors.

    Raises:
        RuntimeError: the server exited (with its log's end) or ``timeout_s`` seconds passed.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode}: {tail(log)}")
        try:
            if httpx.get(f"{url}{path}", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{name} not ready after {timeout_s:.0f} s: {tail(log)}")


def process_roles(serve_pid: int) -> dict[int, str]:
    """Role of serve's process and of every descendant: ``redis`` (redis-server), ``worker``
    (``shared.cli worker`` and its children), else ``gateway`` (serve itself, gateway processes)."""
    roles = {serve_pid: "gateway"}
    for pid, ppid in descendants(serve_pid):
        try:
            argv = cmdline(pid)
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm == "redis-server" or (argv and Path(argv[0]).name.startswith("redis-server")):
            roles[pid] = "redis"
        elif "shared.cli" in argv and "worker" in argv:
            roles[pid] = "worker"
        else:
            roles[pid] = roles.get(ppid, "gateway")
    return roles


#: The worker counters read around each pass (worker/metrics.py), by short name.
ENGINE_COUNTERS = {"steps": "inferq:engine_steps", "busy_s": "inferq:engine_busy_seconds",
                   "async_steps": "inferq:engine_async_steps"}


def engine_counters(metrics_url: str | None) -> dict[str, float]:
    """The worker's engine counters (``ENGINE_COUNTERS``) from its ``/metrics``; empty
    when there is no URL or the scrape fails (the pass is measured without them)."""
    if metrics_url is None:
        return {}
    try:
        text = httpx.get(metrics_url, timeout=5, trust_env=False).text
    except httpx.HTTPError:
        return {}
    totals = {f.name: sum(s.value for s in f.samples if s.name.endswith("_total"))
              for f in text_string_to_metric_families(text)}
    return {short: totals[name] for short, name in ENGINE_COUNTERS.items() if name in totals}


def engine_delta(before: dict[str, float], after: dict[str, float], duration_s: float) -> dict[str, float]:
    """What the engine did during a pass: steps, async steps, time in steps, ms per step and
    the busy fraction (time in steps / the pass's wall time)."""
    if not before or not after:
        return {}
    d = {k: after[k] - before[k] for k in before if k in after}
    if d.get("steps"):
        d["ms_per_step"] = d.get("busy_s", 0.0) * 1000 / d["steps"]
    if duration_s > 0 and "busy_s" in d:
        d["busy_fraction"] = d["busy_s"] / duration_s
    return d


def measure_pass(cfg: BenchConfig, serve_pid: int, client_processes: int = 1,
                 metrics_url: str | None = None) -> dict[str, Any]:
    """One pass of the client against serve: the load client's figures, each role's CPU
    and (with the worker's ``metrics_url``) what its engine did (``engine_delta``) and its
    KV usage and fragmentation while requests ran (``kv``: ``bench.kv_sampler``).
    With ``client_processes > 1`` the requests are sent from that many processes
    (``bench.loadgen.multiproc``), and ``client`` CPU is theirs in all."""
    roles = process_roles(serve_pid)
    before = {pid: cpu_times(pid) for pid in roles}
    engine_before = engine_counters(metrics_url)
    kv_sampler = KVSampler(metrics_url).start()
    start_monotonic_s = time.monotonic()  # the worker's step trace uses the same clock
    if client_processes > 1:
        result, client_s = run_split(cfg, client_processes)
    else:
        client_before_s = time.process_time()
        result = asyncio.run(run_benchmark(cfg))
        client_s = time.process_time() - client_before_s
    kv = kv_sampler.stop()
    if client_processes <= 1:  # the sampler's scrapes ran in this process: not the client's CPU
        client_s = max(client_s - kv_sampler.cpu_s, 0.0)
    cpu = dict.fromkeys(ROLES, 0.0)
    system = dict.fromkeys(ROLES[:3], 0.0)  # of which in the kernel (socket writes, epoll, ...)
    for pid, role in roles.items():
        try:
            user_s, system_s = cpu_times(pid)
        except FileNotFoundError:  # gone during the pass: its share is lost
            continue
        cpu[role] += user_s + system_s - sum(before[pid])
        system[role] += system_s - before[pid][1]
    cpu["client"] = client_s
    engine = engine_delta(engine_before, engine_counters(metrics_url), result.metrics.duration_s)
    m = result.metrics
    tokens = max(m.total_output_tokens, 1)

    def stats(name: str) -> dict[str, float]:
        s = m.latency[name]
        return {"mean": s.mean_ms, "median": s.median_ms, "p99": s.percentiles_ms[99.0]}

    return {"seed": cfg.seed, "concurrency": cfg.max_concurrency, "completed": m.completed, "failed": m.failed,
            "total_output_tokens": m.total_output_tokens, "duration_s": m.duration_s,
            "output_tok_s": m.output_throughput, "ttft_ms": stats("ttft"), "itl_ms": stats("itl"),
            "tpot_ms": stats("tpot"), "cpu_s": cpu, "cpu_s_per_1k_output_tokens": {
                r: cpu[r] * 1000 / tokens for r in ROLES},
            "cpu_cores": {r: cpu[r] / m.duration_s for r in ROLES},
            "system_cpu_share": {r: system[r] / cpu[r] if cpu[r] else 0.0 for r in system},
            "num_processes": {r: sum(1 for v in roles.values() if v == r) for r in ROLES[:3]},
            "engine": engine, "kv": kv, "monotonic_s": [start_monotonic_s, time.monotonic()],
            "errors": sorted({o.error for o in result.outputs if o.error})[:3]}


def run_serve(args: argparse.Namespace, model_dir: Path, concurrency: int, env: dict[str, str], clock: Clock,
              offline: dict[str, Any] | None, record: dict[str, Any], save: typing.Callable[[], None]) -> None:
    """One serve start at ``concurrency`` and its passes, appended to ``record["passes"]``
    (``save()`` after each).

    Raises:
        RuntimeError: serve did not become ready.
    """
    s = max_num_seqs_for(args, concurrency)
    port, metrics_port = free_port(), free_port()
    log = Path(args.log_dir) / f"serve-c{concurrency}.log"
    t0 = time.monotonic()
    # The worker's /metrics, for what its engine did in each pass (unless the caller set a port).
    env = {"INFERQ_METRICS_PORT": str(metrics_port), **env}
    if args.step_trace:  # the worker's per-step timeline (worker/progress.py, StepTrace), beside the logs
        env["INFERQ_STEP_TRACE"] = str(Path(args.log_dir) / f"steps-c{concurrency}.jsonl")
    metrics_url = f"http://127.0.0.1:{env['INFERQ_METRICS_PORT']}/metrics"
    proc = spawn(serve_argv(args, model_dir, s, port), log, env, die_with_parent=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log, min(args.start_timeout_s, max(clock.left_s(), 1.0)))
        record["startup_s"] = time.monotonic() - t0
        save()
        for i in range(args.passes):
            if clock.left_s() <= 0:
                record["stopped_early"] = f"--max-seconds {args.max_seconds:g} reached before pass {i + 1}"
                break
            cfg = workload(args, args.seed + i, base_url=url, model=model_dir.name, max_concurrency=concurrency,
                           timeout_s=max(clock.left_s(), 1.0))
            row = {"pass": i + 1, "first_after_start": i == 0,
                   **measure_pass(cfg, proc.pid, min(args.client_processes, concurrency), metrics_url)}
            if offline is not None:
                row["offline_output_tok_s"] = offline["output_tok_s"]
                row["ratio_to_offline"] = row["output_tok_s"] / offline["output_tok_s"]
            record["passes"].append(row)
            save()
            print(f"concurrency {concurrency} pass {i + 1}: {row['output_tok_s']:,.0f} output tok/s"
                  + (f", {row['ratio_to_offline']:.2f} of the offline engine" if offline else "")
                  + (f", {row['failed']} failed: {row['errors']}" if row["failed"] else ""), flush=True)
    finally:
        record["serve_exit_code"] = stop(proc, timeout_s=60)


# -- the table ---------------------------------------------------------------------------------
def engine_cell(engine: dict[str, float]) -> str:
    """``steps (async) / ms per step / busy fraction`` of one run ('-' when not measured)."""
    if not engine.get("steps"):
        return "-"
    busy = f"{engine['busy_fraction']:.2f}" if "busy_fraction" in engine else "1"
    return f"{engine['steps']:,.0f} ({engine.get('async_steps', 0):,.0f}) / {engine.get('ms_per_step', 0):.1f} / {busy}"


def kv_cell(kv: dict[str, Any]) -> str:
    """``KV usage / internal fragmentation / contiguous waste``, means while requests ran
    ('-' when not sampled)."""
    if not kv.get("samples"):
        return "-"
    return " / ".join(f"{kv[k]['mean']:.1%}" for k in ("kv_usage", "internal_fragmentation", "contiguous_waste_ratio"))


def markdown_table(res: dict[str, Any]) -> str:
    """The result as markdown: a heading line with model, device, date and command, then one
    row per concurrency and pass."""
    st = res["settings"]
    about = (f"Command: `{res['command']}`. {st['num_prompts']} prompts x {st['input_len']} random tokens in / "
             f"{st['output_len']} out, `ignore_eos`; max_num_seqs = min(concurrency, {st['max_num_seqs']}). "
             f"Host: {res['host_cpu']}.")
    header = ("| concurrency | pass | output tok/s | offline engine tok/s (max_num_seqs) | full / offline "
              "| TTFT mean / median / p99 ms | ITL mean / median / p99 ms "
              "| CPU s per 1k output tokens: gateway / worker / Redis / client "
              "| engine steps (async) / ms per step / busy: serve vs offline "
              "| KV usage / internal fragmentation / contiguous waste (means while running) |")
    lines = [f"## {st['model']} through `inferq serve` vs the offline engine: {res['device']}, {res['date']}", "",
             about, "", header, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in res["serve"]:
        offline = res["offline"].get(str(run["max_num_seqs"]))
        off = f"{offline['output_tok_s']:,.0f} ({run['max_num_seqs']})" if offline else "-"
        if not run["passes"]:
            why = "serve failed (`error` in the JSON)" if "error" in run else "not run"
            lines.append(f"| {run['concurrency']} | - | {why} | {off} | | | | | | |")
        for p in run["passes"]:
            ratio = f"{p['ratio_to_offline']:.2f}" if "ratio_to_offline" in p else "-"
            lat = {k: " / ".join(f"{p[k][q]:,.0f}" if p[k][q] >= 10 else f"{p[k][q]:.1f}"
                                 for q in ("mean", "median", "p99")) for k in ("ttft_ms", "itl_ms")}
            cpu = " / ".join(f"{p['cpu_s_per_1k_output_tokens'][r]:.3f}" for r in ROLES)
            failed = f" ({p['failed']} failed)" if p["failed"] else ""
            lines.append(f"| {run['concurrency']} | {p['pass']}{' (first after start)' if p['pass'] == 1 else ''} "
                         f"| {p['output_tok_s']:,.0f}{failed} | {off} | {ratio} | {lat['ttft_ms']} "
                         f"| {lat['itl_ms']} | {cpu} | {engine_cell(p.get('engine', {}))} vs "
                         f"{engine_cell(offline.get('engine', {}) if offline else {})} "
                         f"| {kv_cell(p.get('kv', {}))} |")
    starts = ", ".join(f"{r['startup_s']:.0f} s" for r in res["serve"] if "startup_s" in r)
    lines += ["", f"Serve start to ready: {starts or '-'}."]
    if res.get("stopped_early"):
        lines.append(f"Stopped early: {res['stopped_early']}.")
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen2.5-7B", choices=sorted(DUMMY_CONFIGS), help="dummy config name")
    ap.add_argument("--tokenizer-dir", type=Path, help="tokenizer files (default: the converted SmolLM2 folder)")
    ap.add_argument("--export-tokenizer", type=Path, metavar="DIR",
                    help="only write the default model's tokenizer files into DIR (to carry to a GPU machine)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens (ignore_eos)")
    ap.add_argument("--concurrency", default="64,256,1000", help="comma-separated client concurrencies")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="cap of the engine's max_num_seqs")
    ap.add_argument("--passes", type=int, default=2, help="client passes after each serve start")
    ap.add_argument("--gateway-workers", type=int, default=0, help="passed to serve when given")
    ap.add_argument("--client-processes", type=int, default=1,
                    help="load-client processes sharing each pass (at most the concurrency)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=480.0, help="start no new step after this")
    ap.add_argument("--start-timeout-s", type=float, default=300.0, help="serve start to /ready, at most")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/product_h100.json")
    ap.add_argument("--log-dir", default="/tmp/inferq-product-bench", help="logs of serve and the offline runs")
    ap.add_argument("--step-trace", action="store_true",
                    help="the worker writes its per-step timeline to --log-dir/steps-c<concurrency>.jsonl "
                         "(the offline engine its running and waiting counts to steps-offline-<max_num_seqs>.jsonl)")
    ap.add_argument("--offline-child", type=Path, help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args(argv)
    try:
        args.concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
        assert args.concurrencies and min(args.concurrencies) >= 1, "--concurrency needs values >= 1"
        assert min(args.num_prompts, args.input_len, args.output_len, args.max_num_seqs, args.passes,
                   args.client_processes) >= 1, \
            "counts and lengths must be >= 1"
        passthrough_env(extra)
    except (ValueError, AssertionError) as exc:
        ap.error(str(exc))
    if args.gateway_workers and not any(f.name == "gateway_workers" for cls in ALL_SETTINGS
                                        for f in dataclasses.fields(cls)):
        ap.error("--gateway-workers: this checkout's `inferq serve` has no such setting")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0 when every step ran and every request succeeded, else 1."""
    args, extra = parse_args(argv)
    if args.offline_child:
        return offline_child(args.offline_child)
    if args.export_tokenizer:
        num_bytes = export_tokenizer(args.export_tokenizer)
        print(f"wrote the tokenizer files to {args.export_tokenizer}: {num_bytes / 1e6:.1f} MB")
        return 0
    clock = Clock(args.max_seconds)
    env = passthrough_env(extra)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="inferq-product-bench-"))
    res: dict[str, Any] = {
        "benchmark": "bench.product_bench",
        "command": "python -m bench.product_bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "date": date.today().isoformat(), "device": None, "host_cpu": cpu_description(),
        "settings": {"model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
                     "output_len": args.output_len, "concurrencies": args.concurrencies,
                     "max_num_seqs": args.max_num_seqs, "passes": args.passes, "seed": args.seed,
                     "device": args.device, "gateway_workers": args.gateway_workers or None,
                     "client_processes": args.client_processes,
                     "passthrough": env, "max_seconds": args.max_seconds},
        "offline": {}, "serve": [], "stopped_early": None}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        res["elapsed_s"] = clock.elapsed_s()
        args.out.write_text(json.dumps(res, indent=1))

    ok = True
    try:
        model_dir, num_fillers = build_model_folder(args.model, work, args.tokenizer_dir)
        res["settings"]["tokenizer_filler_tokens"] = num_fillers
        for s in sorted({max_num_seqs_for(args, c) for c in args.concurrencies}):
            if clock.left_s() <= 0:
                res["stopped_early"] = f"--max-seconds {args.max_seconds:g} reached before the offline runs"
                break
            try:
                offline = run_offline(args, model_dir, s, env, work, clock.left_s())
            except RuntimeError as exc:
                ok = False
                res["offline_errors"] = {**res.get("offline_errors", {}), str(s): str(exc)}
                print(f"offline run at max_num_seqs {s} failed: {exc}", flush=True)
                continue
            res["offline"][str(s)] = offline
            res["device"], res["torch"] = offline["device"], offline["torch"]
            print(f"offline engine, max_num_seqs {s}: {offline['output_tok_s']:,.0f} output tok/s", flush=True)
            save()
        for c in args.concurrencies:
            if res["stopped_early"] or clock.left_s() <= 0:
                res["stopped_early"] = res["stopped_early"] or \
                    f"--max-seconds {args.max_seconds:g} reached before concurrency {c}"
                break
            record: dict[str, Any] = {"concurrency": c, "max_num_seqs": max_num_seqs_for(args, c), "passes": []}
            res["serve"].append(record)
            try:
                run_serve(args, model_dir, c, env, clock, res["offline"].get(str(record["max_num_seqs"])),
                          record, save)
            except RuntimeError as exc:
                record["error"] = str(exc)
                print(f"serve at concurrency {c} failed: {exc}", flush=True)
            res["stopped_early"] = record.pop("stopped_early", None)
            ok = ok and "error" not in record and all(p["failed"] == 0 for p in record["passes"])
            save()
    finally:
        save()
        shutil.rmtree(work, ignore_errors=True)
    print(markdown_table(res))
    print(f"\nwrote {args.out}")
    return 0 if ok and not res["stopped_early"] and len(res["serve"]) == len(args.concurrencies) else 1


if __name__ == "__main__":
    sys.exit(main())
