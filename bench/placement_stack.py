"""The deployment one point of ``bench/placement_bench.py`` runs on, and what it counts.

``Stack``: a fresh embedded Redis, G ``inferq gateway`` processes (own ports, one
``--dispatch-policy``) and N ``inferq worker`` processes (``w0``..``w<N-1>``, each with its
own ``/metrics`` port), all children that die with this process. ``Stack.snapshot``
scrapes their counters; ``cache_stats`` turns two snapshots into a phase's prefix-cache
hit rate, per-worker prompt tokens and placements.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.procs import cpu_s, free_port, redis_pid, spawn, stop, wait_for_gateway, wait_for_workers
from shared.embedded_redis import EmbeddedRedis

#: Worker counters read around each phase (worker/metrics.py), by short name. ``prompt``:
#: prompt tokens the worker took in, where it exports them (else ``queries`` stands in).
WORKER_COUNTERS = {"queries": "inferq:prefix_cache_queries_total", "hits": "inferq:prefix_cache_hits_total",
                   "prompt": "inferq:prompt_tokens_total"}
#: The gateway's placements per worker and reason (gateway/metrics.py).
PLACEMENTS = "inferq:placements_total"
#: A gauge the gateway keeps per worker it can place on (its view of the ready workers).
GATEWAY_VIEW = "inferq:worker_num_running"
#: Far above any workload's requests in flight: the benchmark measures placement, not 429s.
MAX_QUEUE_LEN = 100_000


@dataclass(frozen=True, slots=True)
class StackConfig:
    """How to start a stack. ``max_num_seqs``, ``num_kv_blocks`` 0: the worker's default. ``model_folder``
    None: the default model (sim and the CPU engine); with ``load_format`` dummy, random
    weights of its config. ``env``: ``INFERQ_*`` variables for every process."""

    backend: str = "sim"
    num_gateways: int = 1
    max_num_seqs: int = 0
    num_kv_blocks: int = 0
    max_model_len: int = 4096
    sim_step_time_ms: float = 10.0
    sim_prefill_ms_per_token: float | None = None  # None: the sim backend's default
    model_folder: Path | None = None
    load_format: str = "auto"
    device: str = "auto"
    cuda_devices: tuple[str, ...] = ()
    #: GPUs per worker (``--tensor-parallel-size``): worker ``i`` gets ``cuda_devices[i*tp:(i+1)*tp]``
    tensor_parallel_size: int = 1
    torch_threads: int = 1  # inferq on CPU: OMP_NUM_THREADS per worker
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    log_dir: Path = Path("/tmp/inferq-placement-bench")

    def __post_init__(self) -> None:
        assert self.backend in ("sim", "inferq") and self.num_gateways >= 1
        assert self.max_num_seqs >= 0 and self.num_kv_blocks >= 0
        assert self.tensor_parallel_size >= 1
        assert self.tensor_parallel_size == 1 or self.backend == "inferq", "tensor parallelism: --backend inferq only"
        assert self.sim_step_time_ms >= 0
        if self.sim_prefill_ms_per_token is not None:
            assert self.sim_prefill_ms_per_token >= 0

    def as_json(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}

    def worker_argv(self, i: int, metrics_port: int) -> tuple[list[str], dict[str, str]]:
        """Flags and extra environment of worker ``i``."""
        argv = ["--backend", self.backend, "--worker-id", f"w{i}", "--metrics-port", str(metrics_port),
                "--max-model-len", str(self.max_model_len), "--tensor-parallel-size", str(self.tensor_parallel_size),
                "--log-level", "warning"]
        if self.model_folder is not None:
            argv += ["--model", str(self.model_folder), "--load-format", self.load_format]
        if self.max_num_seqs:
            argv += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.num_kv_blocks:
            argv += ["--num-kv-blocks", str(self.num_kv_blocks)]
        if self.device != "auto":
            argv += ["--device", self.device]
        env: dict[str, str] = {}
        if self.backend == "sim":
            argv += ["--sim-step-time-ms", str(self.sim_step_time_ms)]
            if self.sim_prefill_ms_per_token is not None:
                argv += ["--sim-prefill-ms-per-token", str(self.sim_prefill_ms_per_token)]
        elif self.cuda_devices:
            tp = self.tensor_parallel_size
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.cuda_devices[i * tp:(i + 1) * tp])
        else:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.torch_threads)
        return argv, env

    def gateway_argv(self, policy: str, port: int) -> list[str]:
        argv = ["--port", str(port), "--dispatch-policy", policy, "--max-queue-len", str(MAX_QUEUE_LEN),
                "--max-model-len", str(self.max_model_len), "--log-level", "warning"]
        return argv + (["--model", str(self.model_folder)] if self.model_folder is not None else [])


class Stack:
    """One deployment for one point: ``start``, ``snapshot`` between phases, ``close``."""

    def __init__(self, cfg: StackConfig, num_workers: int, policy: str) -> None:
        self.cfg, self.num_workers, self.policy = cfg, num_workers, policy
        self.tag = f"{num_workers}w-{policy}"
        self.redis: EmbeddedRedis | None = None
        self.redis_pid = 0
        self.gateways: list[subprocess.Popen[bytes]] = []
        self.workers: list[subprocess.Popen[bytes]] = []
        self.gateway_urls: list[str] = []
        self.metrics_urls: dict[str, str] = {}  # worker id -> its /metrics
        self.client_pids: list[int] = []  # the load client's other processes (ClientPool), counted as "client"

    def _spawn(self, command: str, argv: list[str], name: str, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        assert self.redis is not None
        log = self.cfg.log_dir / f"{self.tag}-{name}.log"
        log.unlink(missing_ok=True)
        return spawn(["-m", "shared.cli", command, "--redis-url", self.redis.url, *argv], log,
                     {**self.cfg.env, **env}, die_with_parent=True)

    def start(self) -> float:
        """Start everything and wait until every gateway sees every worker; returns the
        seconds it took.

        Raises:
            AssertionError: a process exited. TimeoutError: not ready in ``start_timeout_s``.
        """
        t0 = time.monotonic()
        self.redis = EmbeddedRedis().start()
        self.redis_pid = redis_pid(self.redis.url)
        for g in range(self.cfg.num_gateways):
            port = free_port()
            self.gateways.append(self._spawn("gateway", self.cfg.gateway_argv(self.policy, port), f"gateway-{g}", {}))
            self.gateway_urls.append(f"http://127.0.0.1:{port}")
        for i in range(self.num_workers):
            port = free_port()
            argv, env = self.cfg.worker_argv(i, port)
            self.workers.append(self._spawn("worker", argv, f"worker-{i}", env))
            self.metrics_urls[f"w{i}"] = f"http://127.0.0.1:{port}/metrics"
        timeout_s = self.cfg.start_timeout_s
        for proc, url in zip(self.gateways, self.gateway_urls, strict=True):
            wait_for_gateway(url, proc, timeout_s - (time.monotonic() - t0))
        wait_for_workers(self.redis.url, self.num_workers, self.workers, timeout_s - (time.monotonic() - t0))
        self._wait_for_views(t0 + timeout_s)
        return time.monotonic() - t0

    def _wait_for_views(self, deadline: float) -> None:
        """Wait until each gateway's placement view holds every worker (its per-worker
        gauge has a sample for each), so the first requests can go to any of them."""
        for url in self.gateway_urls:
            while True:
                seen = {labels.get("worker") for labels, _ in scrape(url + "/metrics").get(GATEWAY_VIEW, [])}
                if len(seen) >= self.num_workers:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gateway {url} sees {len(seen)} of {self.num_workers} workers")
                time.sleep(0.2)

    async def snapshot(self, client: httpx.AsyncClient) -> dict[str, Any]:
        """Every worker's counters (``WORKER_COUNTERS``) and the gateways' placements summed
        (``{worker: {reason: n}}``)."""
        async def get(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
            response = await client.get(url, timeout=10)
            response.raise_for_status()
            return parse_samples(response.text)

        worker_ids = list(self.metrics_urls)
        pages = await asyncio.gather(*(get(self.metrics_urls[w]) for w in worker_ids),
                                     *(get(g + "/metrics") for g in self.gateway_urls))
        workers = {}
        for wid, samples in zip(worker_ids, pages, strict=False):
            workers[wid] = {short: sum(v for _, v in samples[name]) if name in samples else None
                            for short, name in WORKER_COUNTERS.items()}
        placements: dict[str, dict[str, float]] = {}
        for samples in pages[len(worker_ids):]:
            for labels, value in samples.get(PLACEMENTS, []):
                per_worker = placements.setdefault(labels.get("worker", "?"), {})
                reason = labels.get("reason", "?")
                per_worker[reason] = per_worker.get(reason, 0.0) + value
        return {"workers": workers, "placements": placements, "cpu_s": self.cpu_s(), "monotonic_s": time.monotonic()}

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds used so far by each process (``gateway-0``, ``worker-3``, ``redis``)
        and by the load client (``client``: this process and ``client_pids``); a process
        that is gone counts 0."""
        procs = {f"gateway-{g}": p.pid for g, p in enumerate(self.gateways)}
        procs |= {f"worker-{i}": p.pid for i, p in enumerate(self.workers)}
        procs["redis"] = self.redis_pid
        out = {name: _cpu_s_or_zero(pid) for name, pid in procs.items()}
        out["client"] = time.process_time() + sum(_cpu_s_or_zero(pid) for pid in self.client_pids)
        return out

    def exited(self) -> str | None:
        """The first process that has exited, as ``"worker-1 (exit code -9, log PATH)"``; None
        while all run."""
        procs = [(f"gateway-{g}", p) for g, p in enumerate(self.gateways)]
        procs += [(f"worker-{i}", p) for i, p in enumerate(self.workers)]
        for name, proc in procs:
            if proc.poll() is not None:
                return f"{name} (exit code {proc.returncode}, log {self.cfg.log_dir / f'{self.tag}-{name}.log'})"
        return None

    def close(self) -> dict[str, int]:
        """Stop the workers (SIGTERM drains), the gateways and Redis; their exit codes."""
        codes = {f"worker-{i}": stop(p) for i, p in enumerate(self.workers)}
        codes |= {f"gateway-{g}": stop(p) for g, p in enumerate(self.gateways)}
        if self.redis is not None:
            self.redis.close()
        return codes


def parse_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text -> sample name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``parse_samples`` of ``GET url``; empty when it does not answer."""
    try:
        return parse_samples(httpx.get(url, timeout=5, trust_env=False).text)
    except httpx.HTTPError:
        return {}


def _cpu_s_or_zero(pid: int) -> float:
    """``bench.procs.cpu_s``, 0 for a process that is gone."""
    try:
        return cpu_s(pid)
    except (FileNotFoundError, ValueError):
        return 0.0


def cpu_cores(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Cores each role used between two snapshots (CPU seconds / wall seconds; 1.0 = one
    core busy): gateways and workers summed, the busiest worker, Redis, the client, and
    ``all`` (near the host's core count: the host itself was the bottleneck)."""
    wall_s = after["monotonic_s"] - before["monotonic_s"]
    if wall_s <= 0:
        return {}
    used = {k: v - before["cpu_s"].get(k, 0.0) for k, v in after["cpu_s"].items()}
    workers = [v for k, v in used.items() if k.startswith("worker-")]
    return {"gateways": sum(v for k, v in used.items() if k.startswith("gateway-")) / wall_s,
            "workers": sum(workers) / wall_s, "worker_max": max(workers, default=0.0) / wall_s,
            "redis": used.get("redis", 0.0) / wall_s, "client": used.get("client", 0.0) / wall_s,
            "all": sum(used.values()) / wall_s}


def cache_stats(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the processes counted between two snapshots (``Stack.snapshot``): per worker its
    prompt tokens (``prompt`` where exported, else ``queries``), queries and hits; their
    sums; the hit rate (None without queries); each worker's share of the prompt tokens and
    the largest; the placements per worker and reason, and how many went to the shared
    stream; the cores each role used (``cpu_cores``)."""
    workers: dict[str, dict[str, float]] = {}
    for wid, a in after["workers"].items():
        b = before["workers"].get(wid, {})

        def delta(short: str, a: dict[str, Any] = a, b: dict[str, Any] = b) -> float | None:
            return None if a.get(short) is None else a[short] - (b.get(short) or 0.0)

        queries, hits, prompt = delta("queries"), delta("hits"), delta("prompt")
        workers[wid] = {"prompt_tokens": prompt if prompt is not None else (queries or 0.0),
                        "cache_queries": queries or 0.0, "cache_hits": hits or 0.0}
    total_prompt = sum(w["prompt_tokens"] for w in workers.values())
    queries = sum(w["cache_queries"] for w in workers.values())
    hits = sum(w["cache_hits"] for w in workers.values())
    shares = {wid: w["prompt_tokens"] / total_prompt for wid, w in workers.items()} if total_prompt else {}
    placements: dict[str, dict[str, int]] = {}
    for worker, reasons in after["placements"].items():
        old = before["placements"].get(worker, {})
        diff = {r: int(v - old.get(r, 0.0)) for r, v in reasons.items() if v - old.get(r, 0.0) > 0}
        if diff:
            placements[worker] = diff
    return {"workers": workers, "cpu_cores": cpu_cores(before, after), "cache_queries": queries, "cache_hits": hits,
            "hit_rate": hits / queries if queries else None, "worker_prompt_tokens": total_prompt,
            "worker_shares": shares, "max_worker_share": max(shares.values()) if shares else None,
            "placements": placements, "to_shared_stream": sum(placements.get("shared", {}).values())}
