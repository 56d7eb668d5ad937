"""Start inferq's real processes (gateway, workers) for integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

from shared.keys import Keys

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(command: str, redis_url: str, *args: str, log_path: Path) -> subprocess.Popen[bytes]:
    """``python -m shared.cli <command> --redis-url URL args...``, output to ``log_path``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "shared.cli", command, "--redis-url", redis_url, *args],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


def wait_for_gateway(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "gateway exited"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("gateway did not become healthy")


def wait_for_workers(redis_url: str, n: int, procs: list[subprocess.Popen[bytes]], timeout_s: float = 120) -> None:
    client = redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), "a worker exited"
            if len(list(client.scan_iter(Keys().worker_pattern()))) >= n:
                return
            time.sleep(0.2)
    finally:
        client.close()
    raise TimeoutError(f"{n} workers did not report a heartbeat")
