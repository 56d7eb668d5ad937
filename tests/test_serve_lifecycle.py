"""``inferq serve`` as a family of processes (serve, its worker, its embedded
redis-server, its extra gateway processes with ``--gateway-workers``): SIGTERM and
SIGINT stop all of them in order and let the requests in flight finish; a SIGKILLed
serve leaves no child behind (docs/operations.md, Signals). Real processes, the sim
backend, Linux ``/proc``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.app import GATEWAY_ID_HEADER, GRACEFUL_SHUTDOWN_S
from gateway.cli import GATEWAY_EXIT_MARGIN_S, SERVE_WORKER_EXIT_MARGIN_S
from tests import processes
from tests.test_gateway_workers import gateway_ids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PDEATHSIG is Linux")]
MODEL = "SmolLM2-135M-Instruct"
DRAIN_TIMEOUT_S = 2.0
# EmbeddedRedis.stop's SIGTERM wait, seconds.
REDIS_STOP_S = 5.0
# A SIGKILLed serve: the kernel signals its children at once; this only bounds the wait.
ORPHAN_EXIT_S = 10.0
# Streams opened at most to reach every gateway process (the kernel picks one per
# connection: all on one of two is a chance of 2^-15).
MAX_STREAMS = 16


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, start time in clock ticks)`` of ``pid``, or ``None`` if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name: state, ppid, ..., starttime (22nd)
    return fields[0], int(fields[1]), int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root`` (scanning ``/proc``): pid -> start time."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None and stat[0] != "Z":
            children.setdefault(stat[1], []).append((int(entry), stat[2]))
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            found[pid] = start
            todo.append(pid)
    return found


def _alive(family: dict[int, int]) -> dict[int, str]:
    """The members of ``family`` still running (not gone, not a zombie, pid not reused): pid -> command."""
    alive = {}
    for pid, start in family.items():
        stat = _stat(pid)
        if stat is not None and stat[0] != "Z" and stat[2] == start:
            alive[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return alive


@dataclass
class Serve:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    family: dict[int, int]  # serve's descendants: pid -> start time
    num_gateways: int  # --gateway-workers

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture()
def serve(request: pytest.FixtureRequest, tmp_path: Path, smollm_source) -> Iterator[Serve]:
    """``inferq serve --backend sim --gateway-workers N`` (``N``: the fixture's param,
    default 1) in its own session, every gateway process listening; afterwards every
    member of its family still running is SIGKILLed."""
    num_gateways = getattr(request, "param", 1)
    port = processes.free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    # No INFERQ_* from the caller: serve must start its own embedded Redis.
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", "serve", "--backend", "sim", "--sim-step-time-ms", "10",
             "--port", str(port), "--drain-timeout-s", str(DRAIN_TIMEOUT_S), "--gateway-workers", str(num_gateways)],
            cwd=processes.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    family: dict[int, int] = {}
    try:
        processes.wait_for_gateway(url, proc, timeout_s=240)
        gateway_ids(url, num_gateways)
        family = _descendants(proc.pid)
        commands = list(_alive(family).values())
        assert len(commands) == 3 + num_gateways - 1, commands
        assert sum("redis-server" in c for c in commands) == 1, commands
        assert sum("shared.cli worker" in c for c in commands) == 1, commands
        assert sum("shared.cli batch-worker" in c for c in commands) == 1, commands
        assert sum("shared.cli gateway" in c for c in commands) == num_gateways - 1, commands
        yield Serve(proc, url, log_path, family, num_gateways)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pid in _alive(family):
            os.kill(pid, signal.SIGKILL)
        # A killed serve cannot remove its embedded Redis's directory.
        if found := re.search(r"embedded Redis at unix://(\S+)/redis\.sock", log_path.read_text(errors="replace")):
            shutil.rmtree(found[1], ignore_errors=True)


async def _streams_and_signal(serve: Serve, sig: int, max_tokens: int) -> list[tuple[str | None, int]]:
    """Open streams, each on a connection of its own, until they reach every gateway
    process of serve; send ``sig`` to serve once each stream has its first token; return
    ``(finish_reason, completion_tokens)`` of each finished stream."""
    body = {"model": MODEL, "prompt": "Count from one to ten:", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        responses: list[httpx.Response] = []
        try:
            while len({r.headers[GATEWAY_ID_HEADER] for r in responses}) < serve.num_gateways:
                assert len(responses) < MAX_STREAMS, "the kernel sent every connection to one gateway"
                resp = await client.send(client.build_request("POST", f"{serve.url}/v1/completions", json=body),
                                         stream=True)
                responses.append(resp)
                assert resp.status_code == 200, await resp.aread()
            first_tokens = [asyncio.Event() for _ in responses]
            tasks = [asyncio.create_task(_read_stream(resp, first)) for resp, first in zip(responses, first_tokens)]
            await asyncio.gather(*[first.wait() for first in first_tokens])
            serve.proc.send_signal(sig)
            return await asyncio.gather(*tasks)
        finally:
            for resp in responses:
                await resp.aclose()


async def _read_stream(resp: httpx.Response, first_token: asyncio.Event) -> tuple[str | None, int]:
    finish, used = None, -1
    async for line in resp.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        if event["choices"]:
            finish = event["choices"][0]["finish_reason"] or finish
            first_token.set()
        if event.get("usage"):
            used = event["usage"]["completion_tokens"]
    return finish, used


@pytest.mark.parametrize(("serve", "sig"), [(1, signal.SIGTERM), (1, signal.SIGINT), (2, signal.SIGTERM)],
                         indirect=["serve"], ids=["SIGTERM", "SIGINT", "SIGTERM-2-gateways"])
def test_stop_signal_drains_and_stops_the_family(serve: Serve, sig: int) -> None:
    """The in-flight streams (on every gateway process) end complete, the worker drains
    (exit 0), the gateway processes exit 0, serve exits 0, and none of its processes is
    left running."""
    max_tokens = 40
    results = asyncio.run(_streams_and_signal(serve, sig, max_tokens))
    assert results == [("length", max_tokens)] * len(results), serve.log()
    # The gateway processes stop together; serve's own shutdown, then at most the margin.
    gateways_s = GRACEFUL_SHUTDOWN_S + (GATEWAY_EXIT_MARGIN_S if serve.num_gateways > 1 else 0)
    bound_s = gateways_s + DRAIN_TIMEOUT_S + SERVE_WORKER_EXIT_MARGIN_S + REDIS_STOP_S
    try:
        status = serve.proc.wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve still running {bound_s} s after {signal.Signals(sig).name}:\n{serve.log()}")
    # serve reaps its children before it exits: nothing of the family may be left now.
    assert _alive(serve.family) == {}, serve.log()
    assert status == 0, serve.log()
    assert re.search(r"(?<!batch )worker \d+ exited with status 0", serve.log())  # drained, not killed
    assert re.search(r"batch worker \d+ exited with status 0", serve.log())
    assert len(re.findall(r"gateway \d+ exited with status 0", serve.log())) == serve.num_gateways - 1


@pytest.mark.parametrize("serve", [1, 2], indirect=True, ids=["1-gateway", "2-gateways"])
def test_sigkilled_serve_leaves_no_child(serve: Serve) -> None:
    """SIGKILL gives serve no chance to clean up: the worker, the embedded Redis and
    the other gateway processes exit by themselves (parent-death signal)."""
    serve.proc.kill()
    serve.proc.wait()
    deadline = time.monotonic() + ORPHAN_EXIT_S
    while _alive(serve.family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(serve.family) == {}, serve.log()


# A child that asks for SIGKILL on its parent's death, says "ready", then sleeps.
_CHILD = """
import os, signal, sys, time
from shared import lifecycle
if sys.argv[1] == "watchdog":
    lifecycle._prctl = lambda: None  # the path of hosts without prctl
lifecycle.exit_with_parent(int(sys.argv[2]), signal.SIGKILL)
print("ready", flush=True)
time.sleep(60)
"""
# A parent that starts that child, prints its pid and sleeps.
_PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], str(os.getpid())], stdout=subprocess.PIPE)
assert child.stdout.readline() == b"ready\\n"
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("mechanism", ["prctl", "watchdog"])
def test_python_child_exits_when_its_parent_is_killed(mechanism: str) -> None:
    """``exit_with_parent`` through prctl and through the polling thread of hosts without it."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CHILD, mechanism], cwd=processes.ROOT,
                              stdout=subprocess.PIPE)
    child_pid = 0
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        family = {child_pid: _stat(child_pid)[2]}  # type: ignore[index]
        assert _alive(family)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + ORPHAN_EXIT_S
        while _alive(family) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(family) == {}
    finally:
        parent.kill()
        parent.wait()
        if child_pid and _stat(child_pid) is not None:
            try:
                os.kill(child_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("mechanism", ["prctl", "watchdog"])
def test_child_whose_parent_is_already_gone_exits(mechanism: str) -> None:
    """The race: the parent died before the child set its death signal (the child
    already has another parent), so no death is left to report it."""
    # Pid 1 stands for the dead parent: it is not this child's parent.
    child = subprocess.Popen([sys.executable, "-c", _CHILD, mechanism, "1"], cwd=processes.ROOT,
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b""  # gone before it could say "ready"
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
