"""Connections that never finish a request are closed (gateway/http_timeouts.py), and a
client that leaves mid-body is one INFO line (gateway/errors.py): a real ``inferq gateway``
process with short timeouts (header and body 1.5 s, keep-alive 1 s) and a ``--backend sim``
worker, only on 127.0.0.1. The flood is 1,000 silent connections and 100 with partial
headers; the test reads the gateway's descriptors from ``/proc`` before and after."""

from __future__ import annotations

import json
import os
import resource
import selectors
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import processes

pytestmark = pytest.mark.timeout(120)
MODEL = "SmolLM2-135M-Instruct"
HEADER_TIMEOUT_S = 1.5
BODY_TIMEOUT_S = 1.5
KEEP_ALIVE_TIMEOUT_S = 1.0
NUM_SILENT = 1000
NUM_PARTIAL = 100
#: How late past its timeout a connection may close on a loaded 2-core host, s.
SLACK_S = 1.0
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}


class Gateway:
    def __init__(self, url: str, port: int, pid: int, log_path: Path) -> None:
        self.url, self.port, self.pid, self.log_path = url, port, pid, log_path

    def num_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def log(self) -> str:
        return self.log_path.read_text()

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[Gateway]:
    from shared.embedded_redis import EmbeddedRedis

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 3 * (NUM_SILENT + NUM_PARTIAL)  # this process's ends, and the gateway's (it inherits the limit)
    if soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.skip(f"needs {wanted} descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    logs = tmp_path_factory.mktemp("timeouts")
    server = EmbeddedRedis().start()
    worker = gateway = None
    try:
        worker = processes.start("worker", server.url, "--backend", "sim", "--worker-id", "sim-0",
                                 log_path=logs / "worker.log")
        for attempt in range(3):  # another test's server may take the free port first
            port = processes.free_port()
            log_path = logs / f"gateway-{attempt}.log"
            gateway = processes.start("gateway", server.url, "--port", str(port), "--header-timeout-s",
                                      str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S),
                                      "--keep-alive-timeout-s", str(KEEP_ALIVE_TIMEOUT_S), log_path=log_path)
            if _listening(gateway, log_path, port):
                break
        url = f"http://127.0.0.1:{port}"
        processes.wait_for_gateway(url, gateway)
        processes.wait_for_workers(server.url, 1, [worker])
        yield Gateway(url, port, gateway.pid, log_path)
    finally:
        for proc in (gateway, worker):
            if proc is not None:
                processes.stop(proc)
        server.close()
        if soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _listening(proc: processes.subprocess.Popen[bytes], log_path: Path, port: int, timeout_s: float = 60) -> bool:
    """Whether ``proc`` itself (not another server) came to listen on ``port``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if f"listening on 127.0.0.1:{port} " in log_path.read_text():  # it bound the port itself
            return True
        time.sleep(0.1)
    processes.stop(proc)
    return False


def _wait_closed(socks: dict[socket.socket, float], deadline_s: float) -> dict[socket.socket, tuple[float, bytes]]:
    """For each socket (opened at the monotonic time given), when the server closed it
    (EOF) and what it had sent before; stops at ``deadline_s``."""
    closed: dict[socket.socket, tuple[float, bytes]] = {}
    received: dict[socket.socket, bytes] = {s: b"" for s in socks}
    with selectors.DefaultSelector() as sel:
        for s in socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        while len(closed) < len(socks) and time.monotonic() < deadline_s:
            for key, _ in sel.select(timeout=max(0.0, deadline_s - time.monotonic())):
                s = key.fileobj
                try:
                    data = s.recv(65536)
                except ConnectionResetError:
                    data = b""
                if data:
                    received[s] += data
                else:
                    closed[s] = (time.monotonic(), received[s])
                    sel.unregister(s)
    return closed


def _timed_completion(url: str) -> float:
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=10, trust_env=False)
    assert r.status_code == 200, r.text
    return time.monotonic() - start


def test_silent_and_partial_connections_are_closed_within_the_header_timeout(gateway: Gateway) -> None:
    baseline_s = min(_timed_completion(gateway.url) for _ in range(3))
    fds_before = gateway.num_fds()
    socks: dict[socket.socket, float] = {}
    try:
        for _ in range(NUM_SILENT):
            socks[gateway.connect()] = time.monotonic()
        partial = []
        for i in range(NUM_PARTIAL):  # a request line, some headers, never the blank line that ends them
            s = gateway.connect()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + (b"Content-Type: app" if i % 2 else b""))
            socks[s] = time.monotonic()
            partial.append(s)
        time.sleep(0.2)
        fds_held = gateway.num_fds()
        during_s = [_timed_completion(gateway.url) for _ in range(3)]  # the flood is held meanwhile
        closed = _wait_closed(socks, time.monotonic() + HEADER_TIMEOUT_S + SLACK_S + 1.0)
    finally:
        for s in socks:
            s.close()
    time.sleep(0.2)
    fds_after = gateway.num_fds()
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} connections still open"
    open_s = sorted(at - socks[s] for s, (at, _) in closed.items())
    print(f"descriptors: before {fds_before}, holding {fds_held}, after {fds_after}; connections open "
          f"{open_s[0]:.2f}-{open_s[-1]:.2f} s; completion latency {baseline_s * 1000:.0f} ms alone, "
          f"{max(during_s) * 1000:.0f} ms at worst during the flood")
    assert fds_held >= fds_before + NUM_SILENT + NUM_PARTIAL  # the gateway did hold them all
    assert HEADER_TIMEOUT_S - 0.1 <= open_s[0] and open_s[-1] <= HEADER_TIMEOUT_S + SLACK_S, open_s
    assert all(closed[s][1] == b"" for s in socks if s not in partial)  # silent: closed without a word
    for s in partial:  # partial: a 408 with an OpenAI error, then closed
        head, _, body = closed[s][1].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), head
        assert json.loads(body)["error"]["code"] == "request_timeout"
    assert fds_after <= fds_before + 2, (fds_before, fds_after)
    assert max(during_s) < max(1.0, 10 * baseline_s)


def _post_in_pieces(gateway: Gateway, body: bytes, pieces: list[bytes], gap_s: float) -> bytes:
    """Headers for ``body``, then ``pieces`` (which join to a prefix of it) ``gap_s`` apart;
    returns what the gateway sent until it closed or 10 s passed."""
    s = gateway.connect()
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
        for piece in pieces:
            time.sleep(gap_s)
            s.sendall(piece)
        s.settimeout(10)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out
    finally:
        s.close()


def test_a_body_that_stops_is_cut_one_that_trickles_is_not(gateway: Gateway) -> None:
    body = json.dumps(COMPLETION).encode()
    step = -(-len(body) // 4)
    pieces = [body[i:i + step] for i in range(0, len(body), step)]  # 0.5 s apart: 2 s in all, past the timeout
    start = time.monotonic()
    trickled = _post_in_pieces(gateway, body, pieces, gap_s=BODY_TIMEOUT_S / 3)
    assert time.monotonic() - start > BODY_TIMEOUT_S and trickled.startswith(b"HTTP/1.1 200 "), trickled[:200]
    start = time.monotonic()
    stopped = _post_in_pieces(gateway, body, [body[:10]], gap_s=0.0)
    waited_s = time.monotonic() - start
    head, _, error = stopped.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), stopped[:200]
    assert json.loads(error)["error"]["code"] == "request_timeout"
    assert BODY_TIMEOUT_S - 0.1 <= waited_s <= BODY_TIMEOUT_S + SLACK_S, waited_s
    _wait_for_log(gateway, "was cut off (no body data for 1.5 s) before its request body was complete")


def test_idle_keep_alive_connection_is_closed(gateway: Gateway) -> None:
    s = gateway.connect()
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        response = b""
        while b"\r\n\r\n" not in response or not response.endswith(b"}"):  # the JSON body, whole
            response += s.recv(65536)
        assert response.startswith(b"HTTP/1.1 200 "), response
        answered = time.monotonic()
        assert s.recv(65536) == b""  # EOF: the gateway closed the idle connection
        idle_s = time.monotonic() - answered
    finally:
        s.close()
    assert KEEP_ALIVE_TIMEOUT_S - 0.1 <= idle_s <= KEEP_ALIVE_TIMEOUT_S + SLACK_S, idle_s


def _wait_for_log(gateway: Gateway, text: str, timeout_s: float = 5.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = gateway.log()
        if text in log:
            return log
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in the gateway's log:\n{gateway.log()[-3000:]}")


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])  # the direct route, and a routed one
def test_client_gone_mid_body_is_one_info_line(gateway: Gateway, path: str) -> None:
    s = gateway.connect()
    port = s.getsockname()[1]
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              "Content-Length: 1000\r\n\r\n{\"model\": ".encode())
    time.sleep(0.2)  # the app is reading the body
    s.close()
    line = f"client 127.0.0.1:{port} left before its request body was complete: POST {path}"
    log = _wait_for_log(gateway, line)
    ours = [entry for entry in log.splitlines() if f"127.0.0.1:{port}" in entry]
    assert len(ours) == 1 and " INFO " in ours[0], ours
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]

