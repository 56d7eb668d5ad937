"""Placement through the whole product: a gateway and two sim workers (whose prefix cache
model hashes blocks as the real engine does) on a real Redis. Multi-turn conversations
placed ``cache_aware`` find their history on the worker that served the turn before
(follow-up hit rate near 1); placed at random they find it about half the time. A
session id keeps a conversation on one worker under ``--dispatch-policy load`` too."""

from __future__ import annotations

import asyncio
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared.embedded_redis import EmbeddedRedis
from tests.test_faults import MODEL, SIM_WORKER_ARGS, Stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_USERS = 12
NUM_FOLLOW_UPS = 2
PROMPT_LEN = 400
MAX_TOKENS = 8


@pytest.fixture()
def stack() -> Iterator[Stack]:
    server = EmbeddedRedis().start()
    s = Stack(redis_url=server.url, logs=Path(tempfile.mkdtemp(prefix="inferq-placement-")), server=server)
    try:
        yield s
    finally:
        for proc in [*s.workers.values(), *s.gateways.values()]:
            proc.kill()
            proc.wait()
        server.stop()


async def _complete(client: httpx.AsyncClient, url: str, prompt: list[int], session: str = "") -> list[int]:
    """One non-streamed completion of token-id ``prompt``; the sim echoes the prompt, so
    the output token ids are its first ``MAX_TOKENS``."""
    headers = {"X-Session-ID": session} if session else {}
    resp = await client.post(f"{url}/v1/completions", headers=headers, json={
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS
    return prompt[:MAX_TOKENS]


def _hits(stack: Stack) -> tuple[int, int]:
    """(hits, queries) in prompt tokens summed over the workers' heartbeats."""
    statuses = [stack.status(name) for name in stack.workers]
    assert all(s is not None for s in statuses)
    return sum(s.prefix_cache_hits for s in statuses if s), sum(s.prefix_cache_queries for s in statuses if s)


async def _wait_heartbeats(stack: Stack) -> None:
    await asyncio.sleep(2.5)  # heartbeats every second: a fresh one from each worker


async def _conversations(stack: Stack, url: str, sessions: bool = False) -> float:
    """Round 0, then ``NUM_FOLLOW_UPS`` rounds that append the answer and 50 new tokens to
    each user's history; returns the follow-up rounds' prefix-cache hit rate."""
    histories = [[(u * 7919 + i) % 40_000 + 100 for i in range(PROMPT_LEN)] for u in range(NUM_USERS)]
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        async def turn(u: int) -> None:
            out = await _complete(client, url, histories[u], f"user-{u}" if sessions else "")
            histories[u] = histories[u] + out + [(u + r) % 90 + 10 for r in range(50)]

        await asyncio.gather(*(turn(u) for u in range(NUM_USERS)))
        await _wait_heartbeats(stack)
        hits0, queries0 = _hits(stack)
        for _ in range(NUM_FOLLOW_UPS):
            await asyncio.gather(*(turn(u) for u in range(NUM_USERS)))
        await _wait_heartbeats(stack)
    hits, queries = _hits(stack)
    return (hits - hits0) / (queries - queries0)


def _start(stack: Stack, *gateway_args: str) -> str:
    for name in ("wa", "wb"):
        stack.add_worker(name, *SIM_WORKER_ARGS)
    return stack.add_gateway("gw", *gateway_args)


def _placements(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return {(m[0], m[1]): float(m[2]) for m in re.findall(
        r'inferq:placements_total\{[^}]*reason="([a-z_]+)"[^}]*worker="([^"]+)"\} ([0-9.e+]+)', text)}


def test_follow_ups_find_their_history_when_placed_by_cache(stack: Stack) -> None:
    url = _start(stack, "--dispatch-policy", "cache_aware")
    hit_rate = asyncio.run(_conversations(stack, url))
    # Each follow-up's history (all but the last 50 tokens and the partial block) is cached.
    assert hit_rate > 0.85, hit_rate
    placed = _placements(url)
    workers = {w for (_, w) in placed if w != "shared"}
    assert workers == {"wa", "wb"}, placed  # round 0 spread over both
    assert sum(n for (reason, _), n in placed.items() if reason == "cache") >= NUM_USERS * NUM_FOLLOW_UPS


def test_random_placement_loses_half_the_history(stack: Stack) -> None:
    url = _start(stack, "--dispatch-policy", "random")
    hit_rate = asyncio.run(_conversations(stack, url))
    assert hit_rate < 0.8, hit_rate


def test_a_session_stays_on_its_worker_under_load_placement(stack: Stack) -> None:
    url = _start(stack, "--dispatch-policy", "load")
    hit_rate = asyncio.run(_conversations(stack, url, sessions=True))
    assert hit_rate > 0.85, hit_rate
    assert all(reason == "session" for (reason, _) in _placements(url)), _placements(url)
