"""Relay load bench: how many tokens/s one gateway process delivers, and how much latency
the Redis + gateway path adds per token, with model-free sim workers.

Starts an embedded Redis, ``--num-workers`` sim workers (``SimBackend``: one token per
running request per ``--step-time-ms`` step, the echo of the prompt) and one gateway
process, then runs two phases of streaming ``/v1/completions`` requests with token-id
prompts (``ignore_eos``):

- ``light``: a few concurrent streams, so nothing queues: the per-token relay latency
  (worker publish -> client receive) of an unloaded gateway;
- ``load``: ``--num-requests`` streams at once: the relay capacity (output tokens/s
  delivered to clients) and the latency under that load.

Every stream's text must equal the decoded echo and its usage ``completion_tokens``
must equal ``max_tokens``: a lost or duplicated token fails the request.

Per-token latency: the bench's worker launcher (``python -m bench.relay_bench worker``)
wraps ``Worker._publish`` and records ``time.time()`` just before each step's publish
pipeline, per (request, first_index); the client records ``time.time()`` per content
chunk. Prompt tokens are words that each decode on their own, so chunk ``i`` is output
token ``i``. All processes share one host clock, so the difference is exact up to
scheduling. (Across hosts this needs a ``sent_unix_s`` field on ``TokenBatch``.)

Usage: ``python -m bench.relay_bench`` (run) or ``python -m bench.relay_bench worker ...``
(one sim worker; the run starts these itself). Results: JSON + a table.
``python -m bench.relay_bench inline`` measures the gateway's own pass over token batches
(decode, order, detokenize, deliver, SSE-encode) in process, without HTTP or Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.loadgen.client import sse_chunks
from bench.procs import ROOT, cpu_s, free_port, redis_pid, spawn, start, stop, wait_for_gateway, wait_for_workers

MODEL = "SmolLM2-135M-Instruct"


# -- the sim worker launcher ---------------------------------------------------------
def worker_main(args: argparse.Namespace) -> None:
    """One sim worker with publish timestamps; SIGTERM drains, then timings are written
    as JSON ``{request_id: [[first_index, publish_unix_s], ...]}`` to ``--timings-path``."""
    import logging

    import redis.asyncio as aioredis

    from shared.keys import Keys
    from shared.model_source import resolve_model
    from shared.settings import EngineSettings, ModelSettings
    from worker.backends.base import RequestOutput
    from worker.backends.sim import SimBackend
    from worker.service import Worker

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    backend = SimBackend(ModelSettings(max_model_len=args.max_model_len),
                         EngineSettings(max_num_seqs=args.max_num_seqs), step_time_ms=args.step_time_ms,
                         config=resolve_model(MODEL).config)
    timings: dict[str, list[tuple[int, float]]] = {}

    class TimedWorker(Worker):
        async def _publish(self, outputs: list[RequestOutput]) -> None:
            now = time.time()
            for out in outputs:
                timings.setdefault(out.request_id, []).append((out.first_index, now))
            await super()._publish(outputs)

    async def serve() -> None:
        client = aioredis.from_url(args.redis_url)
        service = TimedWorker(client, Keys(args.namespace), MODEL, args.worker_id, backend)
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, service.drain)
        try:
            await service.run()
        finally:
            await client.aclose()

    asyncio.run(serve())
    Path(args.timings_path).write_text(json.dumps(timings))


# -- prompts -------------------------------------------------------------------------
def word_token_ids(tokenizer: Any, limit: int = 4000) -> list[int]:
    """Ids of tokens that decode on their own to `` word`` (space + 3-8 lowercase
    letters): each output token then yields exactly one text chunk."""
    ids = []
    for token_id in range(1000, tokenizer.vocab_size):
        if re.fullmatch(r" [a-z]{3,8}", tokenizer.decode([token_id])):
            ids.append(token_id)
            if len(ids) == limit:
                break
    return ids


def echo(prompt: list[int], max_tokens: int) -> list[int]:
    """What the sim backend answers: output token i = prompt[i % len(prompt)]."""
    return [prompt[i % len(prompt)] for i in range(max_tokens)]


# -- client ------------------------------------------------------------------------------
@dataclass(slots=True)
class StreamResult:
    request_id: str
    prompt: list[int]
    ok: bool = False
    error: str = ""
    text: str = ""
    completion_tokens: int = -1
    recv_unix_s: list[float] = field(default_factory=list)  # one per non-empty content chunk
    start_unix_s: float = 0.0


async def one_stream(client: Any, url: str, model: str, rid: str, prompt: list[int], max_tokens: int) -> StreamResult:

    res = StreamResult(request_id="cmpl-" + rid, prompt=prompt)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    texts: list[str] = []
    res.start_unix_s = time.time()
    try:
        async with client.stream("POST", url, json=body, headers={"X-Request-Id": rid}) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return res
            async for chunk in sse_chunks(resp):
                if "error" in chunk:
                    res.error = f"stream error: {chunk['error']}"
                    return res
                if chunk.get("usage"):
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        res.recv_unix_s.append(time.time())
                        texts.append(choice["text"])
    except Exception as exc:  # noqa: BLE001 - record and go on: a failed stream is a result
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.text = "".join(texts)
    res.ok = True
    return res


async def run_phase(base_url: str, prompts: dict[str, list[int]], max_tokens: int,
                    timeout_s: float = 120.0) -> tuple[list[StreamResult], float]:
    """All ``prompts`` at once (one stream each); returns results and wall seconds.

    Raises:
        TimeoutError: the phase took longer than ``timeout_s`` (a stuck stream).
    """
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as client:
        start = time.perf_counter()
        streams = (one_stream(client, base_url + "/v1/completions", MODEL, rid, p, max_tokens)
                   for rid, p in prompts.items())
        results = await asyncio.wait_for(asyncio.gather(*streams), timeout_s)
        return list(results), time.perf_counter() - start


# -- analysis ------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def dist_ms(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"mean": statistics.fmean(ms) if ms else float("nan"), "p50": pct(ms, 50), "p90": pct(ms, 90),
            "p99": pct(ms, 99), "max": max(ms) if ms else float("nan"), "n": len(ms)}


def analyse(results: list[StreamResult], wall_s: float, max_tokens: int, tokenizer: Any,
            publish: dict[str, dict[int, float]]) -> dict[str, Any]:
    """Correctness counts, throughput and latency of one phase."""
    failures: dict[str, int] = {}
    recv_all: list[float] = []
    itls: list[float] = []
    relay: list[float] = []
    ttfts: list[float] = []
    for r in results:
        expected = echo(r.prompt, max_tokens)
        problem = r.error.split(":")[0] if r.error else ""
        if not problem and r.completion_tokens != max_tokens:
            problem = f"usage {r.completion_tokens} != {max_tokens}"
        if not problem and r.text != tokenizer.decode(expected):
            problem = "text != echo (lost or duplicated tokens)"
        if not problem and len(r.recv_unix_s) != max_tokens:
            problem = f"{len(r.recv_unix_s)} content chunks != {max_tokens}"
        if problem:
            failures[problem] = failures.get(problem, 0) + 1
            r.ok = False
            continue
        recv_all.extend(r.recv_unix_s)
        ttfts.append(r.recv_unix_s[0] - r.start_unix_s)
        itls.extend(b - a for a, b in zip(r.recv_unix_s, r.recv_unix_s[1:]))
        sent = publish.get(r.request_id, {})
        relay.extend(t - sent[i] for i, t in enumerate(r.recv_unix_s) if i in sent)
    recv_all.sort()
    n = len(recv_all)
    lo, hi = recv_all[n // 10] if n else 0.0, recv_all[(9 * n) // 10] if n else 0.0
    return {
        "num_requests": len(results), "completed": sum(r.ok for r in results),
        "failed": len(results) - sum(r.ok for r in results), "failures": failures,
        "output_tokens": n, "wall_s": wall_s,
        "output_tokens_per_s": n / wall_s if wall_s else 0.0,
        # Rate between the 10th and 90th percentile of token receive times: the steady
        # state, without the admission ramp at the start and the tail at the end.
        "steady_output_tokens_per_s": (0.8 * n) / (hi - lo) if hi > lo else float("nan"),
        "ttft_ms": dist_ms(ttfts), "client_itl_ms": dist_ms(itls), "relay_latency_ms": dist_ms(relay),
    }


# -- the run -------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    from shared.embedded_redis import EmbeddedRedis
    from shared.model_source import resolve_model
    from shared.tokenizer_loader import load_tokenizer

    loadavg_before = os.getloadavg()  # other work on the host skews every number here
    tokenizer = load_tokenizer(resolve_model(MODEL).path)
    pool = word_token_ids(tokenizer)
    rng = random.Random(args.seed)
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    server = EmbeddedRedis().start()
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    gateway = start("gateway", server.url, "--port", str(port), "--max-queue-len", "100000",
                    "--log-level", "warning", log_path=logs / "gateway.log")
    workers = [spawn(["-m", "bench.relay_bench", "worker", "--redis-url", server.url, "--worker-id", f"sim-{i}",
                      "--step-time-ms", str(args.step_time_ms), "--max-num-seqs", str(args.max_num_seqs),
                      "--timings-path", str(logs / f"timings-{i}.json")], logs / f"worker-{i}.log")
               for i in range(args.num_workers)]
    procs = [gateway, *workers]
    phases: dict[str, Any] = {}
    try:
        wait_for_workers(server.url, args.num_workers, procs, timeout_s=180.0)
        wait_for_gateway(base_url, gateway, timeout_s=180.0)
        server_pid = redis_pid(server.url)
        asyncio.run(run_phase(base_url, {f"warm-{i}": rng.sample(pool, args.prompt_len) for i in range(8)}, 8,
                              args.phase_timeout_s))
        raw: dict[str, tuple[list[StreamResult], float, dict[str, float]]] = {}
        for name, count in (("light", args.light_requests), ("load", args.num_requests)):
            prompts = {f"{name}-{i}": rng.sample(pool, args.prompt_len) for i in range(count)}
            pids = {"gateway": gateway.pid, "redis": server_pid, **{f"worker-{i}": w.pid for i, w in enumerate(workers)}}
            cpu0 = {k: cpu_s(p) for k, p in pids.items()}
            client0 = time.process_time()
            results, wall_s = asyncio.run(run_phase(base_url, prompts, args.max_tokens, args.phase_timeout_s))
            cpu = {k: cpu_s(p) - cpu0[k] for k, p in pids.items()}
            cpu["client"] = time.process_time() - client0
            raw[name] = (results, wall_s, cpu)
            time.sleep(0.5)
    finally:
        codes = [stop(w) for w in workers]
        stop(gateway)
        server.close()
    from gateway.request_ids import WIRE_ID_SEPARATOR

    publish: dict[str, dict[int, float]] = {}
    for i in range(args.num_workers):
        path = logs / f"timings-{i}.json"
        if path.exists():
            for wire_id, pairs in json.loads(path.read_text()).items():
                # The worker sees the wire id: the client's id plus a random suffix.
                rid = wire_id.split(WIRE_ID_SEPARATOR)[0]
                publish.setdefault(rid, {}).update({int(k): t for k, t in pairs})
    for name, (results, wall_s, cpu) in raw.items():
        phase = analyse(results, wall_s, args.max_tokens, tokenizer, publish)
        workers_cpu = sum(v for k, v in cpu.items() if k.startswith("worker-"))
        phase["cpu_s"] = {"gateway": cpu["gateway"], "redis": cpu["redis"], "workers": workers_cpu,
                          "client": cpu["client"]}
        phase["gateway_cpu_us_per_token"] = 1e6 * cpu["gateway"] / max(1, phase["output_tokens"])
        phase["num_concurrent"] = len(results)
        phases[name] = phase
    return {
        "bench": "relay_sim", "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": "python -m bench.relay_bench " + " ".join(sys.argv[1:]),
        "device": f"{platform.node()}: {os.cpu_count()} CPU cores shared by the gateway, Redis, "
                  f"{args.num_workers} sim workers and the load client (no GPU)",
        "host_loadavg_before": [round(x, 2) for x in loadavg_before],
        "config": {k: v for k, v in vars(args).items() if k not in ("cmd", "log_dir", "out", "timings_path")},
        "worker_exit_codes": codes, "phases": phases,
        "notes": NOTES,
    }


NOTES = [
    ("relay_latency = client receive time - the worker's time.time() just before its publish pipeline (one host "
     "clock): Redis pub/sub + gateway relay, detokenization and SSE + client parsing; under overload, queueing"),
    ("capacity = steady_output_tokens_per_s of the load phase; gateway_cpu_us_per_token = the gateway process's "
     "CPU per delivered token (1e6 / it ~ tokens/s one dedicated core could relay)"),
    "all processes share the host's CPU cores: the client and sim workers take CPU the gateway would otherwise get",
]


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"relay bench (sim workers) - {result['device']}")
    table.add_column("metric")
    for name in result["phases"]:
        table.add_column(f"{name} ({result['phases'][name]['num_concurrent']} streams)", justify="right")
    rows = [("completed / failed", lambda p: f"{p['completed']} / {p['failed']}"),
            ("output tokens", lambda p: str(p["output_tokens"])),
            ("wall s", lambda p: f"{p['wall_s']:.2f}"),
            ("tokens/s (all)", lambda p: f"{p['output_tokens_per_s']:.0f}"),
            ("tokens/s (steady 10-90%)", lambda p: f"{p['steady_output_tokens_per_s']:.0f}"),
            ("gateway CPU us/token", lambda p: f"{p['gateway_cpu_us_per_token']:.0f}"),
            ("CPU s gw/redis/workers/client", lambda p: "/".join(f"{v:.1f}" for v in p["cpu_s"].values())),
            ("TTFT ms p50 / p99", lambda p: f"{p['ttft_ms']['p50']:.1f} / {p['ttft_ms']['p99']:.1f}"),
            ("client ITL ms p50 / p99", lambda p: f"{p['client_itl_ms']['p50']:.1f} / {p['client_itl_ms']['p99']:.1f}"),
            ("relay latency ms p50 / p90 / p99",
             lambda p: "{p50:.2f} / {p90:.2f} / {p99:.2f}".format(**p["relay_latency_ms"]))]
    for label, fmt in rows:
        table.add_row(label, *(fmt(p) for p in result["phases"].values()))
    Console().print(table)
    for name, p in result["phases"].items():
        if p["failures"]:
            print(f"{name} failures: {p['failures']}")


# -- the relay's own pass, in process ---------------------------------------------------------
def inline_main(args: argparse.Namespace) -> dict[str, Any]:
    """CPU per token of the gateway's work on a token batch without HTTP or Redis:
    ``Relay.dispatch`` of ``--num-steps`` batches of ``--batch-size`` entries (decode, the
    record's ordering, ``DecodeStream``, stop strings, delivery) for requests with no stop
    string and with one, then the SSE encoding of every step."""
    import redis.asyncio as aioredis

    from gateway.generation import Generation
    from gateway.output import OutputProcessor
    from gateway.relay import Relay
    from gateway.responses import ResponseShape
    from shared import protocol
    from shared.model_source import resolve_model
    from shared.protocol import TokenBatch, TokenOutput
    from shared.tokenizer_loader import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(MODEL).path)
    words = word_token_ids(tokenizer)
    num_tokens = args.batch_size * args.num_steps

    async def one(stops: list[str]) -> dict[str, float]:
        relay = Relay(aioredis.Redis(unix_socket_path="/nonexistent"), "bench")  # never connects
        gens = []
        for i in range(args.batch_size):
            processor = OutputProcessor(tokenizer, words[:8], stops, {tokenizer.eos_token_id})
            gen = Generation(request_id=f"r{i}", processor=processor, arrival_s=0.0, deadline_s=1e9,
                             on_close=lambda g: None)
            relay.register(gen)
            gens.append(gen)
        payloads = [protocol.encode(TokenBatch(worker_id="w", outputs=[
            TokenOutput(request_id=f"r{i}", attempt=0, first_index=t, token_ids=[words[(i + t) % len(words)]])
            for i in range(args.batch_size)])) for t in range(args.num_steps)]
        start_s = time.process_time()
        for payload in payloads:
            relay.dispatch(payload)
        dispatched_s = time.process_time()
        for i, gen in enumerate(gens):
            shape = ResponseShape(gen.request_id, MODEL, 0, chat=False)
            async for steps in gen.updates():
                b"".join([shape.chunk_event(s.text, s.finish_reason) for s in steps])
                break
        encoded_s = time.process_time()
        return {"dispatch_us_per_token": 1e6 * (dispatched_s - start_s) / num_tokens,
                "sse_encode_us_per_token": 1e6 * (encoded_s - dispatched_s) / num_tokens}

    result = {"no_stop_strings": asyncio.run(one([])), "one_stop_string": asyncio.run(one(["never appears"]))}
    return {"bench": "relay_inline", "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": "python -m bench.relay_bench inline " + " ".join(sys.argv[2:]),
            "device": f"{platform.node()}: {os.cpu_count()} CPU cores, one thread",
            "host_loadavg_before": [round(x, 2) for x in os.getloadavg()],
            "config": {"batch_size": args.batch_size, "num_steps": args.num_steps}, "results": result}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    w = sub.add_parser("worker", help="one sim worker with publish timestamps (started by the run)")
    w.add_argument("--redis-url", required=True)
    w.add_argument("--namespace", default="inferq")
    w.add_argument("--worker-id", default="")
    w.add_argument("--step-time-ms", type=float, default=10.0)
    w.add_argument("--max-num-seqs", type=int, default=256)
    w.add_argument("--max-model-len", type=int, default=2048)
    w.add_argument("--timings-path", required=True)
    inline = sub.add_parser("inline", help="CPU per token of the relay's pass over token batches, in process")
    inline.add_argument("--batch-size", type=int, default=256, help="entries per batch (requests)")
    inline.add_argument("--num-steps", type=int, default=64, help="batches (tokens per request)")
    inline.add_argument("--out", default=str(ROOT / "bench" / "results" / "relay_inline.json"))
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--step-time-ms", type=float, default=10.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--num-requests", type=int, default=1000, help="concurrent streams of the load phase")
    parser.add_argument("--light-requests", type=int, default=20, help="concurrent streams of the light phase")
    parser.add_argument("--prompt-len", type=int, default=16, help="tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phase-timeout-s", type=float, default=120.0)
    parser.add_argument("--log-dir", default="/tmp/inferq-relay-bench")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "relay_sim.json"))
    args = parser.parse_args(argv)
    if args.cmd == "worker":
        worker_main(args)
        return
    if args.cmd == "inline":
        inline_result = inline_main(args)
        Path(args.out).write_text(json.dumps(inline_result, indent=2) + "\n")
        print(json.dumps(inline_result["results"], indent=2))
        print(f"wrote {args.out}")
        return
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out}")
    ok = all(p["failed"] == 0 for p in result["phases"].values())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
