"""What placement costs the gateway per request: the CPU time of hashing a prompt's blocks
(``Placer.query``) and of reading and scoring the workers (``Placer.place``: one pipeline
of the read script, then ``choose``), against a real Redis (embedded), with W live
workers whose KV indexes hold the prompt's prefix on one of them.

Prints and writes, per prompt length and worker count: hashing µs/request, place µs of
gateway CPU per request (``time.process_time``, so Redis's own time, in its process, is
left out and reported apart as the pipeline's wall time per request), and Redis round
trips per request (one pipeline per ``--batch`` requests). The prompts are hashed as the
gateway queues them (``TokenIds``, int32 bytes, made for the stream entry whatever the
policy); ``pack_us_per_request`` is that encoding, reported apart, beside
``list_encode_us_per_request``, what msgpack took for the list of ids that the entry
carried before (protocol version 2).

Usage: ``python -m bench.placement_cost [--prompt-lens 1000,4000] [--workers 2,8]
[--requests 400] [--batch 1] [--out bench/results/placement_cost.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
import uuid
from pathlib import Path

import msgspec
import redis.asyncio as aioredis

from gateway.placement import Placer
from shared import protocol
from shared.block_hashes import block_hashes
from shared.embedded_redis import EmbeddedRedis
from shared.keys import Keys
from shared.protocol import WorkerStatus
from shared.token_ids import TokenIds

BLOCK_SIZE = 16
MODEL = "m"


async def _measure(url: str, prompt_len: int, num_workers: int, num_requests: int, batch: int) -> dict[str, float]:
    client = aioredis.from_url(url)
    keys = Keys(f"pc{uuid.uuid4().hex[:8]}")
    rng = random.Random(0)
    id_lists = [[rng.randrange(50_000) for _ in range(prompt_len)] for _ in range(8)]
    t0 = time.process_time()
    for _ in range(num_requests):
        prompts = [TokenIds.of(ids) for ids in id_lists]
    pack_cpu = (time.process_time() - t0) / len(id_lists)
    encoder = msgspec.msgpack.Encoder()
    t0 = time.process_time()
    for _ in range(num_requests):
        for ids in id_lists:
            encoder.encode(ids)
    list_encode_cpu = (time.process_time() - t0) / len(id_lists)
    for w in range(num_workers):
        status = WorkerStatus(worker_id=f"w{w}", model=MODEL, backend="sim", num_running=0, num_waiting=0,
                              kv_usage=0.0, num_free_blocks=1000, block_size=BLOCK_SIZE, max_num_seqs=64,
                              updated_unix_s=time.time(), started_unix_s=time.time(), pid=1,
                              max_num_batched_tokens=2048)
        await client.set(keys.worker_key(f"w{w}"), protocol.encode(status), ex=60)
    for i, p in enumerate(prompts):  # each prompt's prefix cached on one worker
        await client.sadd(keys.kv_index(MODEL, f"w{i % num_workers}"), *block_hashes(p[:-1], BLOCK_SIZE))
    placer = Placer(client, keys, MODEL, "cache_aware", 8.0)
    await placer.refresh()
    await placer.place([placer.query(prompts[0])])  # loads the script
    hash_cpu = place_cpu = place_wall = 0.0
    for start in range(0, num_requests, batch):
        chunk = [prompts[(start + k) % len(prompts)] for k in range(min(batch, num_requests - start))]
        t0 = time.process_time()
        queries = [placer.query(p) for p in chunk]
        t1 = time.process_time()
        w0 = time.perf_counter()
        await placer.place(queries)
        place_wall += time.perf_counter() - w0
        place_cpu += time.process_time() - t1
        hash_cpu += t1 - t0
    await client.aclose()
    return {"prompt_len": prompt_len, "num_workers": num_workers, "batch": batch, "num_requests": num_requests,
            "pack_us_per_request": 1e6 * pack_cpu / num_requests,
            "list_encode_us_per_request": 1e6 * list_encode_cpu / num_requests,
            "hash_us_per_request": 1e6 * hash_cpu / num_requests,
            "place_cpu_us_per_request": 1e6 * place_cpu / num_requests,
            "place_wall_us_per_request": 1e6 * place_wall / num_requests,
            "total_cpu_us_per_request": 1e6 * (hash_cpu + place_cpu) / num_requests,
            "round_trips_per_request": 1 / batch}


def _cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-lens", default="1000,4000")
    ap.add_argument("--workers", default="2,8")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--batch", type=int, default=1, help="requests per pipeline (a group commit)")
    ap.add_argument("--out", default="bench/results/placement_cost.json")
    args = ap.parse_args()
    server = EmbeddedRedis().start()
    try:
        rows = [asyncio.run(_measure(server.url, int(n), int(w), args.requests, args.batch))
                for n in args.prompt_lens.split(",") for w in args.workers.split(",")]
    finally:
        server.stop()
    for r in rows:
        print(f"prompt {r['prompt_len']:>5}  workers {r['num_workers']}  (pack {r['pack_us_per_request']:5.1f} us, "
              f"list msgpack {r['list_encode_us_per_request']:5.1f} us)  hash {r['hash_us_per_request']:7.1f} us  "
              f"place {r['place_cpu_us_per_request']:7.1f} us CPU ({r['place_wall_us_per_request']:7.1f} us wall)  "
              f"total {r['total_cpu_us_per_request']:7.1f} us  round trips {r['round_trips_per_request']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(["python -m bench.placement_cost", *sys.argv[1:]]),
                                          "host": platform.node(), "cpu": _cpu_model(),
                                          "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
