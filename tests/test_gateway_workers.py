"""Several gateway processes on one port (``inferq serve --gateway-workers N``,
``inferq gateway --workers N``; gateway/multiproc.py): the sockets share one port and
refuse a port already served, concurrent requests spread over the processes and all
come back whole, and failover and aborts work for the requests of each process.

Real processes, a real Redis, ``sim`` workers (their output echoes the prompt, so each
text is known). Which process answered is the response header ``x-inferq-gateway``
(its gateway id); the kernel picks the process per connection, so each request here
opens its own connection or comes from a pool of many."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from bench.procs import spawn
from gateway.app import GATEWAY_ID_HEADER
from gateway.multiproc import bind_listeners
from shared.settings import GatewaySettings, SettingsError, build
from tests import processes
from tests.test_faults import LONG_MAX_TOKENS, MODEL, SIM_WORKER_ARGS, Stack, echo_text, wait_no_pending

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT spreads only on Linux")]
NUM_GATEWAYS = 2
#: How long the kernel gets to show every gateway process listening, s (start-up: the
#: tokenizer loads in each; this only bounds the wait).
ALL_LISTENING_TIMEOUT_S = 120.0


def gateway_ids(url: str, num_gateways: int, timeout_s: float = ALL_LISTENING_TIMEOUT_S) -> set[str]:
    """The ids of ``num_gateways`` gateway processes behind ``url``, seen on new
    connections to ``/health``; waits until that many listen.

    Raises ``TimeoutError`` after ``timeout_s`` seconds with fewer seen.
    """
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < num_gateways:
        if time.monotonic() > deadline:
            raise TimeoutError(f"saw {len(seen)} of {num_gateways} gateway processes: {seen}")
        resp = httpx.get(f"{url}/health", timeout=10, trust_env=False)  # a new connection each time
        assert resp.status_code == 200, resp.text
        seen.add(resp.headers[GATEWAY_ID_HEADER])
    return seen


async def stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                 on_token: Callable[[], None] | None = None, stop_after: int = 0) -> tuple[str, str, int]:
    """Stream one completion (``ignore_eos``); returns ``(gateway id, text, completion
    tokens)``. With ``stop_after`` the client leaves after that many tokens (usage -1)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, used, num_tokens = "", -1, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event["choices"]:
                text += event["choices"][0]["text"]
                num_tokens += 1
                if on_token is not None:
                    on_token()
                if num_tokens == stop_after:
                    break
            if event.get("usage"):
                used = event["usage"]["completion_tokens"]
        return resp.headers[GATEWAY_ID_HEADER], text, used


async def complete(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[str, str, int]:
    """One non-streamed completion: ``(gateway id, text, completion tokens)``."""
    resp = await client.post(f"{url}/v1/completions",
                             json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return resp.headers[GATEWAY_ID_HEADER], body["choices"][0]["text"], body["usage"]["completion_tokens"]


# -- settings and sockets ----------------------------------------------------------------

def test_gateway_workers_setting_is_checked() -> None:
    assert build(GatewaySettings, {}, {"INFERQ_GATEWAY_WORKERS": "3"}).gateway_workers == 3
    with pytest.raises(SettingsError, match=r"--gateway-workers \(INFERQ_GATEWAY_WORKERS\) = 0: must be at least 1"):
        build(GatewaySettings, {}, {"INFERQ_GATEWAY_WORKERS": "0"})


def test_listeners_share_one_port_and_refuse_a_served_one() -> None:
    """The sockets of one group listen on one port; a second group on that port is
    refused, not joined (it would take half of the connections)."""
    group = bind_listeners("127.0.0.1", 0, 3)
    try:
        ports = {sock.getsockname()[1] for sock in group}
        assert len(ports) == 1
        for sock in group:
            sock.listen()
        port = ports.pop()
        for num_sockets in (1, 2):
            with pytest.raises(OSError, match="in use"):
                bind_listeners("127.0.0.1", port, num_sockets)
    finally:
        for sock in group:
            sock.close()


@pytest.mark.slow
def test_cli_on_a_served_port_says_so(tmp_path: Path) -> None:
    """``inferq gateway --workers 2`` on a port something listens on: one line, exit 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log_path = tmp_path / "gateway.log"
        proc = processes.start("gateway", "redis://127.0.0.1:1/0", "--workers", "2", "--port", str(port),
                               log_path=log_path)
        assert proc.wait(timeout=120) == 1
    assert f"Error: cannot listen on http://127.0.0.1:{port}:" in log_path.read_text()


# -- serve: concurrent requests spread over the processes ---------------------------------

@pytest.fixture()
def serve_two_gateways(tmp_path: Path, smollm_source) -> Iterator[tuple[str, Path]]:
    """``inferq serve --gateway-workers 2`` with a sim worker; ``(url, log path)``."""
    port = processes.free_port()
    log_path = tmp_path / "serve.log"
    proc = spawn(["-m", "shared.cli", "serve", "--backend", "sim", "--sim-step-time-ms", "10",
                  "--max-num-seqs", "64", "--port", str(port), "--gateway-workers", str(NUM_GATEWAYS),
                  "--drain-timeout-s", "2"], log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        processes.wait_for_gateway(url, proc, timeout_s=240)
        yield url, log_path
    finally:
        assert processes.stop(proc) == 0, log_path.read_text()


@pytest.mark.slow
def test_concurrent_requests_spread_over_gateway_processes(serve_two_gateways, smollm_tokenizer) -> None:
    url, log_path = serve_two_gateways
    ids = gateway_ids(url, NUM_GATEWAYS)
    logged = set(re.findall(r"gateway (\w+) serving", log_path.read_text()))
    assert ids == logged  # the header is the id each process logged at start
    num_requests, max_tokens = 128, 16
    prompts = [f"Request {i} counts {i + 1} {i + 2}" for i in range(num_requests)]

    async def run() -> list[tuple[str, str, int]]:
        limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as client:
            return await asyncio.gather(*[
                (stream if i % 2 else complete)(client, url, p, max_tokens) for i, p in enumerate(prompts)])

    results = asyncio.run(asyncio.wait_for(run(), 240))
    for prompt, (_, text, used) in zip(prompts, results, strict=True):
        assert (text, used) == (echo_text(smollm_tokenizer, prompt, max_tokens), max_tokens)
    per_gateway = Counter(gateway_id for gateway_id, _, _ in results)
    assert set(per_gateway) == ids, per_gateway  # every process answered some


# -- inferq gateway --workers 2: failover and aborts in each process ---------------------

@pytest.fixture()
def stack(tmp_path: Path, smollm_source) -> Iterator[Stack]:
    from shared.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis().start()
    s = Stack(server.url, tmp_path, server)
    try:
        yield s
    finally:
        for proc in [*s.workers.values(), *s.gateways.values()]:
            processes.stop(proc, signal.SIGKILL)
        server.close()


def _open_streams(url: str, ids: set[str], num_streams: int, max_tokens: int, *, stop_after: int = 0,
                  until: Callable[[list[int]], bool] | None = None, then: Callable[[], None] | None = None
                  ) -> list[tuple[str, str, int]]:
    """Run ``num_streams`` streams (``"Stream i:"``) on their own connections; once
    ``until(tokens seen per stream)`` holds, call ``then()`` (both optional). Checks that
    the streams reached every gateway process of ``ids``."""
    seen = [0] * num_streams

    async def run() -> list[tuple[str, str, int]]:
        async with httpx.AsyncClient(timeout=120, trust_env=False,
                                     limits=httpx.Limits(max_connections=num_streams)) as client:
            tasks = [asyncio.create_task(stream(client, url, f"Stream {i}:", max_tokens, stop_after=stop_after,
                                                on_token=lambda i=i: seen.__setitem__(i, seen[i] + 1)))
                     for i in range(num_streams)]
            if until is not None and then is not None:
                while not until(seen):
                    assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(then)
            return await asyncio.gather(*tasks)

    results = asyncio.run(asyncio.wait_for(run(), 240))
    assert {gateway_id for gateway_id, _, _ in results} == ids
    return results


@pytest.mark.slow
def test_worker_killed_every_request_of_each_gateway_fails_over(stack: Stack, smollm_tokenizer) -> None:
    """All streams run on worker ``wa``; a second worker starts, ``wa`` is SIGKILLed:
    each gateway process moves its own requests, and every stream ends whole."""
    num_streams, max_tokens = 16, 300  # at 40 ms a step, 12 s on wa: time for wb to start
    stack.add_worker("wa", "--backend", "sim", "--sim-step-time-ms", "40", "--max-num-seqs", str(num_streams))
    processes.wait_for_workers(stack.redis_url, 1, [stack.workers["wa"]])
    url = stack.add_gateway("gw", "--workers", str(NUM_GATEWAYS))
    ids = gateway_ids(url, NUM_GATEWAYS)

    def all_running_on_wa(seen: list[int]) -> bool:
        status = stack.status("wa")
        return min(seen) >= 3 and status is not None and status.num_running == num_streams

    def start_wb_and_kill_wa() -> None:
        stack.add_worker("wb", "--backend", "sim", "--sim-step-time-ms", "5", "--max-num-seqs", str(num_streams))
        processes.wait_for_workers(stack.redis_url, 2, [stack.workers["wb"]])
        stack.workers["wa"].send_signal(signal.SIGKILL)

    results = _open_streams(url, ids, num_streams, max_tokens, until=all_running_on_wa, then=start_wb_and_kill_wa)
    for i, (_, text, used) in enumerate(results):
        assert (text, used) == (echo_text(smollm_tokenizer, f"Stream {i}:", max_tokens), max_tokens)
    assert stack.log("gw").count("failover of") == num_streams, stack.log("gw")
    wait_no_pending(stack.redis_url)


@pytest.mark.slow
def test_client_disconnects_abort_in_each_gateway(stack: Stack) -> None:
    """Clients of both processes leave mid-stream: the worker stops every sequence long
    before ``max_tokens``."""
    num_streams = 16
    stack.add_worker("ws", "--max-num-seqs", str(num_streams), *SIM_WORKER_ARGS)
    processes.wait_for_workers(stack.redis_url, 1, [stack.workers["ws"]])
    url = stack.add_gateway("gw", "--workers", str(NUM_GATEWAYS))
    ids = gateway_ids(url, NUM_GATEWAYS)
    num_steps_before = stack.num_steps("ws")
    results = _open_streams(url, ids, num_streams, LONG_MAX_TOKENS, stop_after=5)
    assert all(used == -1 for _, _, used in results)  # every client left before the end
    stack.wait_aborted("ws", num_steps_before)
    wait_no_pending(stack.redis_url)
