"""Several gateway processes on one port (``inferq serve --gateway-workers N``,
``inferq gateway --workers N``; docs/operations.md, "Several gateway processes").

The gateway is stateless: each process makes its own ``gateway_id``, subscribes to its
own reply channel and fails over its own requests, so N of them need no shared state,
only a way to split the connections. The process the user started binds N TCP sockets
to the port with ``SO_REUSEPORT`` (``bind_listeners``), serves on the first itself and
hands each of the others to a child (``start_gateway``: ``python -m shared.cli gateway
--listen-fd FD``). Linux then spreads new connections over the listening sockets by a
hash of their addresses; a connection stays with the process that accepted it. One
socket shared by all the processes would instead let whichever process wakes first
accept a whole burst of connections.

Each process starts listening when its uvicorn starts, so no connection waits on a
process that is still loading its tokenizer. The children are ordinary children of the
starting process: they get SIGKILL from the kernel when it dies (shared/lifecycle.py)
and SIGTERM from it when it stops (``gateway/cli.py``), so ``serve`` keeps its ordered stop.
uvicorn's own ``workers=N`` supervisor would signal and restart its children on its own
terms, and needs the app as an import string that reads its settings from the
environment.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)


def _bind(family: socket.AddressFamily, host: str, port: int, reuse_port: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn does: a restart may bind while old connections sit in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def bind_listeners(host: str, port: int, num_sockets: int) -> list[socket.socket]:
    """``num_sockets`` TCP sockets bound to ``host:port``, not listening yet (uvicorn
    listens on them when it starts). With more than one, each has ``SO_REUSEPORT``, so
    that all of them can listen on the port. Port 0 binds every socket to one free port.

    Raises:
        OSError: the address is in use (by any process, also by another group of inferq
            gateways on that port, which this group would otherwise join and split the
            connections with) or cannot be bound.
        RuntimeError: more than one socket anywhere but Linux, whose ``SO_REUSEPORT``
            is the one that spreads connections.
    """
    reuse_port = num_sockets > 1
    if reuse_port and not sys.platform.startswith("linux"):
        raise RuntimeError("several gateway processes on one port need Linux (SO_REUSEPORT)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if reuse_port and port != 0:
        # A bind without SO_REUSEPORT fails while anything listens on the port. Sockets
        # with it would join a group already listening there (same user) and share
        # its connections without an error.
        _bind(family, host, port, reuse_port=False).close()
    sockets: list[socket.socket] = []
    try:
        for _ in range(num_sockets):
            sockets.append(_bind(family, host, port, reuse_port))
            port = sockets[0].getsockname()[1]
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def start_gateway(sock: socket.socket, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start a gateway process that serves on ``sock`` (``python -m shared.cli gateway
    --listen-fd FD --parent-pid PID``), with its settings in ``env``'s ``INFERQ_*``
    variables and this process's log level; it gets SIGKILL when this process dies.

    Closes this process's copy of ``sock``: a copy kept here would stay in the port's
    group after the child died, and the kernel would go on routing connections to it.
    Call from the main thread (the parent-death signal follows the forking thread).
    """
    fd = sock.fileno()
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    try:
        return subprocess.Popen([sys.executable, "-m", "shared.cli", "gateway", "--log-level", level,
                                 "--listen-fd", str(fd), "--parent-pid", str(os.getpid())],
                                env=dict(env), pass_fds=(fd,))
    finally:
        sock.close()


def terminate(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each of ``procs`` still running (uvicorn's graceful shutdown). Safe in a
    signal handler: no waiting, no logging."""
    for proc in procs:
        if proc.returncode is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:  # reaped between the check and the kill
                pass
