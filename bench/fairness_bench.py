"""Fair share and priority classes under load (docs/operations.md, "Priority classes and
fair share"), with model-free sim workers or our engine.

Starts an embedded Redis, one gateway, a batch worker and ``--num-workers`` workers
(``--backend sim``: one token per running request per ``--step-time-ms`` step; ``--backend
inferq``: our engine on the default model, CPU float32), then measures the
time to first token (TTFT: request sent -> first content chunk of the stream) of a
trickle of probe requests, one every ``--probe-interval-s``, in five phases:

- ``b_unloaded``: tenant B's probes alone;
- ``b_with_flood``: tenant A sends ``--num-flood`` requests at once (output lengths spread
  around ``--max-tokens``: ``flood_max_tokens``), then B's probes
  start (B has its own API key, so its own tenant: fair share applies);
- ``b_same_tenant_as_flood``: as above, but B's probes use A's key (one tenant, so first
  come first served, as the queue was before fair share: the reference);
- ``interactive_unloaded``: probes with ``X-Priority: interactive`` alone;
- ``interactive_with_batch``: ``--num-flood`` requests with ``X-Priority: batch`` at once
  (the class Batch API lines use), then the interactive probes; the batch must finish;
- ``interactive_with_batch_api``: a ``--batch-lines``-line batch through the Batch API
  (``POST /v1/files`` + ``POST /v1/batches``, run by an ``inferq batch-worker``), then the
  interactive probes; the batch must complete (its wall time is recorded).

The flood runs in a process of its own, so the probes' own event loop times only them.

The gateway runs without API keys, so a bearer token names a tenant without being
checked (``gateway/tenants.py``). Usage: ``python -m bench.fairness_bench`` (results:
``bench/results/fairness_sim.json`` and a table); the real model on CPU: ``python -m
bench.fairness_bench --backend inferq --num-workers 1 --num-flood 200 --max-tokens 16``;
on a GPU, a real config's shapes with dummy weights: add ``--device cuda --dummy-model
Qwen2.5-7B --tokenizer-dir DIR``. ``--phases`` runs a subset (a reduced run; the ratios
need each loaded phase's unloaded one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.procs import free_port, start, stop, wait_for_gateway, wait_for_workers
from shared.model_source import DUMMY_CONFIGS

MODEL = "SmolLM2-135M-Instruct"
PROMPT = [504, 3458, 282, 4649, 314, 2]  # token ids: the sim echoes them
PHASES = ("b_unloaded", "b_with_flood", "b_same_tenant_as_flood", "interactive_unloaded", "interactive_with_batch",
          "interactive_with_batch_api")


async def ttft_s(client: Any, url: str, headers: dict[str, str], max_tokens: int) -> float:
    """One streaming completion; seconds to its first content chunk (it is read to the end).

    Raises:
        RuntimeError: a non-200 answer or an error event.
    """
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    start_s = time.perf_counter()
    first_s: float | None = None
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]" and "error" in json.loads(line[5:]):
                raise RuntimeError(line[:200])  # an error event (a token's text may be "error")
            if first_s is None and line.startswith("data:") and '"text"' in line:
                first_s = time.perf_counter() - start_s
    assert first_s is not None, "no content"
    return first_s


def _http_client(timeout_s: float) -> Any:
    import httpx

    # No keep-alive: a connection idle past the server's keep-alive timeout can be closed
    # just as a probe reuses it (a ReadError that has nothing to do with the queue).
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
                             timeout=httpx.Timeout(timeout_s), trust_env=False)


def flood_max_tokens(num: int, max_tokens: int) -> list[int]:
    """The flood's output lengths: uniform over ``[max_tokens / 2, 3 * max_tokens / 2]``
    (mean ``max_tokens``), fixed seed. Equal lengths that all start in one step would
    free every sequence slot in the same step and none in between, a lockstep that real
    traffic does not have, and a new request would wait for the next turnover."""
    import random

    rng = random.Random(0)
    return [rng.randint(max(1, max_tokens // 2), max_tokens * 3 // 2) for _ in range(num)]


async def _flood(url: str, headers: dict[str, str], num: int, max_tokens: int, timeout_s: float,
                 started: Any) -> list[float]:
    async with _http_client(timeout_s) as client:
        sends = [ttft_s(client, url, headers, n) for n in flood_max_tokens(num, max_tokens)]
        started.set()
        return list(await asyncio.gather(*sends))


def _flood_process(url: str, headers: dict[str, str], num: int, max_tokens: int, timeout_s: float,
                   results: Any, started: Any) -> None:
    """Child-process body: the flood's TTFTs, or the error, put on ``results``; ``started``
    is set just before the requests go out."""
    try:
        results.put(asyncio.run(_flood(url, headers, num, max_tokens, timeout_s, started)))
    except Exception as exc:  # noqa: BLE001 (reported to the parent, which raises)
        started.set()
        results.put(repr(exc))


async def phase(base_url: str, args: argparse.Namespace, probe_headers: dict[str, str],
                flood_headers: dict[str, str] | None) -> dict[str, Any]:
    """Optionally a flood of ``--num-flood`` requests at once (from a child process), then
    ``--num-probes`` probes one per ``--probe-interval-s``; returns the probes' TTFTs and
    the flood's wall time.

    Raises:
        RuntimeError: a flood request failed.
    """
    import multiprocessing

    url = base_url + "/v1/completions"
    ctx = multiprocessing.get_context("spawn")
    results, started = ctx.Queue(), ctx.Event()
    flood = None
    if flood_headers is not None:
        flood = ctx.Process(target=_flood_process, args=(url, flood_headers, args.num_flood, args.max_tokens,
                                                         args.phase_timeout_s, results, started))
        flood.start()
        await asyncio.to_thread(started.wait, args.phase_timeout_s)  # the child has imported and connects
    start_s = time.perf_counter()
    if flood is not None:
        await asyncio.sleep(args.flood_head_start_s)  # the flood is queued before the first probe
    probe_ttfts = await _probes(url, args, probe_headers)
    flood_ttfts: list[float] = []
    if flood is not None:
        got = await asyncio.to_thread(results.get, True, args.phase_timeout_s)
        flood.join()
        if isinstance(got, str):
            raise RuntimeError(f"flood failed: {got}")
        flood_ttfts = got
    wall_s = time.perf_counter() - start_s
    out: dict[str, Any] = {"probe_ttft_s": [round(t, 4) for t in probe_ttfts],
                           "probe_median_ttft_s": round(statistics.median(probe_ttfts), 4)}
    if flood_ttfts:
        out.update(flood_requests_finished=len(flood_ttfts), flood_median_ttft_s=round(statistics.median(flood_ttfts), 4),
                   flood_max_ttft_s=round(max(flood_ttfts), 4), phase_wall_s=round(wall_s, 2))
    return out


async def _probes(url: str, args: argparse.Namespace, headers: dict[str, str]) -> list[float]:
    """``--num-probes`` probes, one per ``--probe-interval-s``; their TTFTs, seconds."""
    async with _http_client(args.phase_timeout_s) as client:
        probes = []
        for _ in range(args.num_probes):
            probes.append(asyncio.ensure_future(ttft_s(client, url, headers, args.max_tokens)))
            await asyncio.sleep(args.probe_interval_s)
        return list(await asyncio.gather(*probes))


def batch_lines(num_lines: int, max_tokens: int) -> bytes:
    """A Batch API input file: ``num_lines`` chat completions, ``custom_id`` line-<i>."""
    return "".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": f"line {i}"}]},
    }) + "\n" for i in range(num_lines)).encode()


async def batch_api_phase(base_url: str, args: argparse.Namespace, probe_headers: dict[str, str],
                          batch_headers: dict[str, str]) -> dict[str, Any]:
    """Upload and start a ``--batch-lines`` batch, probe while it runs, then wait for it.

    Raises:
        RuntimeError: the batch did not complete, or not with every line.
    """
    async with _http_client(args.phase_timeout_s) as client:
        upload = await client.post(base_url + "/v1/files", headers=batch_headers, data={"purpose": "batch"},
                                   files={"file": ("in.jsonl", batch_lines(args.batch_lines, args.max_tokens))})
        upload.raise_for_status()
        start_s = time.perf_counter()
        created = await client.post(base_url + "/v1/batches", headers=batch_headers, json={
            "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        created.raise_for_status()
        batch_id = created.json()["id"]
        await asyncio.sleep(args.flood_head_start_s)
        probe_ttfts = await _probes(base_url + "/v1/completions", args, probe_headers)
        batch: dict[str, Any] = {}
        while time.perf_counter() - start_s < args.phase_timeout_s:
            batch = (await client.get(f"{base_url}/v1/batches/{batch_id}", headers=batch_headers)).json()
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                break
            await asyncio.sleep(0.2)
        wall_s = time.perf_counter() - start_s
    counts = batch.get("request_counts") or {}
    if batch.get("status") != "completed" or counts.get("completed") != args.batch_lines:
        raise RuntimeError(f"batch {batch_id} ended {batch.get('status')} with {counts}")
    return {"probe_ttft_s": [round(t, 4) for t in probe_ttfts],
            "probe_median_ttft_s": round(statistics.median(probe_ttfts), 4),
            "batch_lines_completed": counts["completed"], "batch_wall_s": round(wall_s, 2)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from shared.embedded_redis import EmbeddedRedis

    loadavg_before = os.getloadavg()
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    server = EmbeddedRedis().start()
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    files_dir = logs / "files"
    # --dummy-model: a real config's shapes with dummy weights (a GPU machine has no GGUF),
    # served under the default model's name so that the requests stay the same.
    model: list[str] = []
    if args.dummy_model:
        from bench.model_folder import build_model_folder

        folder, _ = build_model_folder(args.dummy_model, logs / "model", args.tokenizer_dir)
        model = ["--model", str(folder), "--served-model-name", MODEL]
    gateway = start("gateway", server.url, "--port", str(port), "--max-queue-len", "100000", *model,
                    "--files-dir", str(files_dir), "--log-level", "warning", "--workers", str(args.gateway_workers),
                    log_path=logs / "gateway.log")
    batch_worker = start("batch-worker", server.url, "--files-dir", str(files_dir), "--batch-gateway-url", base_url,
                         "--log-level", "warning", log_path=logs / "batch-worker.log")
    if args.backend == "sim":
        backend = ["--backend", "sim", "--sim-step-time-ms", str(args.step_time_ms)]
    elif args.dummy_model:
        backend = ["--backend", "inferq", *model, "--load-format", "dummy", "--device", args.device]
    else:
        backend = ["--backend", "inferq", "--device", args.device, "--dtype", "float32"]
    workers = [start("worker", server.url, *backend, "--max-num-seqs", str(args.max_num_seqs),
                     "--worker-id", f"{args.backend}-{i}", "--log-level", "warning",
                     log_path=logs / f"worker-{i}.log") for i in range(args.num_workers)]
    key_a, key_b = {"Authorization": "Bearer tenant-a"}, {"Authorization": "Bearer tenant-b"}
    batch, interactive = {"X-Priority": "batch"}, {"X-Priority": "interactive"}
    plan = {
        "b_unloaded": (key_b, None),
        "b_with_flood": (key_b, key_a),
        "b_same_tenant_as_flood": (key_a, key_a),
        "interactive_unloaded": ({**key_b, **interactive}, None),
        "interactive_with_batch": ({**key_b, **interactive}, {**key_a, **batch}),
    }
    plan = {name: value for name, value in plan.items() if name in args.phases}
    phases: dict[str, Any] = {}
    try:
        # A loaded host can take minutes to start a real-model worker.
        wait_for_workers(server.url, args.num_workers, [gateway, *workers], timeout_s=max(180.0, args.phase_timeout_s))
        wait_for_gateway(base_url, gateway, timeout_s=max(180.0, args.phase_timeout_s))
        asyncio.run(phase(base_url, argparse.Namespace(**{**vars(args), "num_probes": 4, "probe_interval_s": 0.1}),
                          key_b, None))  # warm-up
        for name, (probe_headers, flood_headers) in plan.items():
            phases[name] = asyncio.run(phase(base_url, args, probe_headers, flood_headers))
            print(name, json.dumps(phases[name]), flush=True)
            time.sleep(1.0)
        name = "interactive_with_batch_api"
        if name in args.phases:
            phases[name] = asyncio.run(batch_api_phase(base_url, args, {**key_b, **interactive}, key_a))
            print(name, json.dumps(phases[name]), flush=True)
    finally:
        codes = [stop(w) for w in workers]
        stop(batch_worker)
        stop(gateway)
        server.close()
    ratio = {name: phases[loaded]["probe_median_ttft_s"] / phases[unloaded]["probe_median_ttft_s"]
             for name, loaded, unloaded in [
                 ("b_with_flood_vs_unloaded", "b_with_flood", "b_unloaded"),
                 ("b_same_tenant_vs_unloaded", "b_same_tenant_as_flood", "b_unloaded"),
                 ("interactive_with_batch_vs_unloaded", "interactive_with_batch", "interactive_unloaded"),
                 ("interactive_with_batch_api_vs_unloaded", "interactive_with_batch_api", "interactive_unloaded")]
             if loaded in phases and unloaded in phases}
    return {
        "bench": f"fairness_{args.backend}", "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": "python -m bench.fairness_bench " + " ".join(sys.argv[1:]),
        "device": f"{platform.node()}: {os.cpu_count()} CPU cores shared by the gateway, Redis, "
                  f"{args.num_workers} {args.backend} workers and the load client"
                  + (f"; the engine on {_gpu_name()}" if args.device == "cuda" else " (no GPU)"),
        "model": args.dummy_model or MODEL,
        "host_loadavg_before": [round(x, 2) for x in loadavg_before],
        "config": {k: v for k, v in vars(args).items() if k not in ("log_dir", "out", "tokenizer_dir")},
        "worker_exit_codes": codes, "phases": phases,
        "median_ttft_ratios": {k: round(v, 2) for k, v in ratio.items()},
    }


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--gateway-workers", type=int, default=1,
                        help="gateway processes on the one port (`inferq gateway --workers`)")
    parser.add_argument("--step-time-ms", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-flood", type=int, default=500)
    parser.add_argument("--num-probes", type=int, default=16)
    parser.add_argument("--probe-interval-s", type=float, default=0.5)
    parser.add_argument("--flood-head-start-s", type=float, default=1.0)
    parser.add_argument("--phase-timeout-s", type=float, default=300.0)
    parser.add_argument("--batch-lines", type=int, default=1000, help="lines of the Batch API phase's batch")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help="comma-separated subset of the phases to run (a reduced run; default: all)")
    parser.add_argument("--log-dir", default="/tmp/inferq-fairness-bench")
    parser.add_argument("--backend", choices=("sim", "inferq"), default="sim",
                        help="sim workers, or our engine on the default model (CPU, float32)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the inferq engine's device")
    parser.add_argument("--dummy-model", choices=sorted(DUMMY_CONFIGS), default=None,
                        help="inferq backend: this config's shapes with dummy weights (e.g. Qwen2.5-7B on a GPU)")
    parser.add_argument("--tokenizer-dir", type=Path, default=None,
                        help="with --dummy-model: the default model's tokenizer files (bench.product_bench "
                             "--export-tokenizer)")
    parser.add_argument("--out", default=None, help="default: bench/results/fairness_<backend>.json")
    args = parser.parse_args(argv)
    if args.dummy_model and args.backend != "inferq":
        parser.error("--dummy-model needs --backend inferq")
    args.phases = [p for p in args.phases.split(",") if p]
    if unknown := set(args.phases) - set(PHASES):
        parser.error(f"unknown phases {sorted(unknown)}; choose from {', '.join(PHASES)}")
    args.out = args.out or f"bench/results/fairness_{args.backend}.json"
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'phase':<26} {'probe median TTFT s':>20} {'flood finished':>15}")
    for name, p in result["phases"].items():
        finished = p.get("flood_requests_finished", p.get("batch_lines_completed", "-"))
        print(f"{name:<26} {p['probe_median_ttft_s']:>20.3f} {finished:>15}")
    print(json.dumps(result["median_ttft_ratios"]))


if __name__ == "__main__":
    main()
