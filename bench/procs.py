"""Child processes of benchmarks and integration tests: start inferq's gateway and workers,
wait for them, read their CPU time, stop them.

One module for both ``bench/`` and ``tests/`` (tests import it; it imports nothing from tests).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from shared.keys import Keys
from shared.redis_connect import connect_sync

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
          die_with_parent: bool = False) -> subprocess.Popen[bytes]:
    """``python argv...`` in the repo root, stdout and stderr appended to ``log_path``.

    ``env`` adds to (and overrides) this process's environment. ``die_with_parent``: the
    child gets SIGTERM when this process dies (``shared.lifecycle``; call from the main
    thread), so a killed benchmark leaves no server behind.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    preexec = None
    if die_with_parent:
        from shared.lifecycle import parent_death_preexec

        preexec = parent_death_preexec(signal.SIGTERM)
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=full_env, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=preexec)  # noqa: PLW1509


def start(command: str, redis_url: str, *args: str, log_path: Path,
          env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``python -m shared.cli <command> --redis-url URL args...``, output to ``log_path``."""
    return spawn(["-m", "shared.cli", command, "--redis-url", redis_url, *args], log_path, env)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
    """Send ``sig`` (default SIGTERM: workers drain), wait up to ``timeout_s`` seconds, then SIGKILL.

    Returns the exit code (negative: killed by that signal).
    """
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a running process has used so far (Linux ``/proc/PID/stat``).

    Raises ``FileNotFoundError`` when the process is gone (its zombie still has a stat file).
    """
    return sum(cpu_times(pid))


def cpu_times(pid: int) -> tuple[float, float]:
    """``(user, system)`` CPU seconds a running process has used so far (Linux
    ``/proc/PID/stat``). System time holds the kernel's work for the process, such as a
    socket write's delivery over loopback to a client on the same host.

    Raises ``FileNotFoundError`` when the process is gone (its zombie still has a stat file).
    """
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the ")" closing the command name, utime and stime are the 12th and 13th fields.
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cmdline(pid: int) -> list[str]:
    """The argv of a running process (``/proc/PID/cmdline``); empty for a zombie.

    Raises ``FileNotFoundError`` when the process is gone.
    """
    return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]


def descendants(pid: int) -> list[tuple[int, int]]:
    """``(pid, parent pid)`` of every live descendant of ``pid`` (children, grandchildren...),
    each parent before its children, from a scan of ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # exited during the scan
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found: list[tuple[int, int]] = []
    todo = [pid]
    while todo:
        parent = todo.pop(0)
        for child in sorted(children.get(parent, [])):
            found.append((child, parent))
            todo.append(child)
    return found


def redis_pid(redis_url: str) -> int:
    """Process id of the redis-server behind ``redis_url`` (from ``INFO server``)."""
    client = connect_sync(redis_url)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


def wait_for_gateway(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    """Wait until ``GET url/health`` answers 200.

    Raises ``AssertionError`` if the gateway exits, ``TimeoutError`` after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "gateway exited"
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("gateway did not become healthy")


def wait_for_workers(redis_url: str, n: int, procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 120.0,
                     namespace: str = "inferq") -> None:
    """Wait until at least ``n`` workers have a heartbeat key under ``namespace``.

    Raises ``AssertionError`` if one of ``procs`` exits, ``TimeoutError`` after ``timeout_s`` seconds.
    """
    client = connect_sync(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), "a worker exited"
            if len(list(client.scan_iter(Keys(namespace).worker_pattern()))) >= n:
                return
            time.sleep(0.2)
    finally:
        client.close()
    raise TimeoutError(f"{n} workers did not report a heartbeat")
