"""The gateway's commands: ``serve`` (embedded Redis, one worker and one batch worker as
child processes, and the gateway processes) and ``gateway`` (the HTTP gateway against an
existing Redis). ``shared.cli.load_commands`` adds them to the ``inferq`` app; the worker
and the batch worker run as ``python -m shared.cli worker`` / ``batch-worker`` processes,
so nothing here imports the worker's code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import TYPE_CHECKING

import typer

from shared.cli import option_param, settings_command, settings_env
from shared.redis_url import parse_redis_url
from shared.settings import (
    BatchSettings,
    EngineSettings,
    GatewaySettings,
    ModelSettings,
    RedisSettings,
    WorkerSettings,
)

if TYPE_CHECKING:
    from shared.embedded_redis import EmbeddedRedis

log = logging.getLogger("inferq")


# How long ``serve`` waits for its worker past the worker's own drain bound
# (``drain_timeout_s``: hand-back, closing its Redis client and engine thread) before
# killing it, seconds.
SERVE_WORKER_EXIT_MARGIN_S = 10.0
# How long ``serve`` and ``gateway`` wait for their gateway processes past uvicorn's
# graceful shutdown (then the app's shutdown: relay, Redis client, tokenizer threads)
# before killing them, seconds.
GATEWAY_EXIT_MARGIN_S = 5.0


def _listen(gateway: GatewaySettings) -> list[socket.socket]:
    """One bound socket per gateway process (gateway/multiproc.py). A port in use or
    an unsupported platform ends the command: one line, exit code 1."""
    from gateway.multiproc import bind_listeners
    from shared.serve_ready import http_url

    try:
        return bind_listeners(gateway.host, gateway.port, gateway.gateway_workers)
    except (OSError, RuntimeError) as exc:
        typer.echo(f"Error: cannot listen on {http_url(gateway.host, gateway.port)}: {exc}", err=True)
        raise typer.Exit(1) from None


@settings_command("serve", ModelSettings, EngineSettings, RedisSettings, GatewaySettings, WorkerSettings,
                  BatchSettings)
def serve(model: ModelSettings, engine: EngineSettings, redis_settings: RedisSettings,
          gateway: GatewaySettings, worker: WorkerSettings, batch: BatchSettings) -> None:
    """Run everything: an embedded Redis (unless --redis-url is given), one worker
    process, one batch worker (Batch API jobs) and --gateway-workers gateway processes
    on one port (serve itself and N-1 children). SIGTERM and SIGINT (Ctrl-C) stop them all in order (the gateways, then
    the worker drains, then Redis) and exit 0; the children also exit by themselves if
    serve is killed. A worker that exits unasked (it could not start, or it died) stops
    the rest the same way, and serve exits with status 1 after printing why."""
    from gateway.app import run as run_gateway
    from gateway.multiproc import start_gateway, terminate
    from shared.embedded_redis import EmbeddedRedis
    from shared.model_source import resolve_model
    from shared.serve_ready import announce_when_ready

    # uvicorn handles SIGTERM and SIGINT itself, shuts the gateway down, restores the
    # handlers it found and raises the signal again. SIGTERM's default action then killed
    # serve before the cleanup below, leaving the worker and Redis running; raised as
    # KeyboardInterrupt, like SIGINT, the gateway's run absorbs it and returns, and the
    # cleanup runs (docs/operations.md, Signals).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    embedded = None
    child = None
    # The worker's exit unasked stops the gateway (``stop``); ``stopping``: serve stops it itself.
    stop, stopping = threading.Event(), threading.Event()
    worker_exit: list[int] = []  # its status, once it exited unasked
    reason_dir = tempfile.mkdtemp(prefix="inferq-serve-")
    reason_path = os.path.join(reason_dir, "worker-exit")
    gateways: list[subprocess.Popen[bytes]] = []
    batch_child: subprocess.Popen[bytes] | None = None
    try:
        listeners = _listen(gateway)  # a port in use fails before anything starts
        source = resolve_model(model.model, model.load_format, model.model_cache_dir)  # convert once, here
        if not redis_settings.redis_url:
            embedded = EmbeddedRedis()
            embedded.start()
            redis_settings = dataclasses.replace(redis_settings, redis_url=embedded.url)
            log.info("embedded Redis at %s", embedded.url)
        env = {**os.environ, **settings_env(model, engine, redis_settings, worker)}
        # From the main thread: the children's parent-death signal follows the forking thread.
        child = subprocess.Popen([sys.executable, "-m", "shared.cli", "worker", "--parent-pid", str(os.getpid()),
                                  "--exit-reason-file", reason_path], env=env)
        threading.Thread(target=_watch_worker, args=(child, stopping, stop, worker_exit), name="serve-worker-watch",
                         daemon=True).start()
        port = listeners[0].getsockname()[1]
        # arq cannot run on a Redis Cluster: serve then runs no batch worker (the gateway
        # answers the Batch API with 501).
        if parse_redis_url(redis_settings.redis_url).kind != "cluster":
            batch_child = _start_batch_worker(batch, redis_settings, gateway, port)
        gateway_env = {**os.environ, **settings_env(model, redis_settings, gateway, batch)}
        for sock in listeners[1:]:
            gateways.append(start_gateway(sock, gateway_env))
        announce_when_ready(gateway.host, port)  # logs "inferq ready: URL" once a worker is ready
        # Returns once a signal (or the worker's exit: ``stop``) has stopped it; that stops the
        # other gateways at once.
        run_gateway(gateway, redis_settings, model, source, sock=listeners[0], on_stop=lambda: terminate(gateways),
                    batch=batch, stop=stop)
    except KeyboardInterrupt:  # a signal before or after uvicorn's own handling
        pass
    finally:
        stopping.set()
        if batch_child is not None:  # first: it sends to the gateways (its batches resume later)
            _stop("batch worker", [batch_child], GATEWAY_EXIT_MARGIN_S, [])
        _stop_children(gateways, child, embedded, worker.drain_timeout_s + SERVE_WORKER_EXIT_MARGIN_S)
        reason = _read_reason(reason_path)
        shutil.rmtree(reason_dir, ignore_errors=True)
    if worker_exit:
        stopped = "the gateway and Redis" if embedded is not None else "the gateway"
        typer.echo(f"Error: {_worker_exit_text(worker_exit[0], reason)}; stopped {stopped}", err=True)
        raise typer.Exit(1)


def _watch_worker(child: subprocess.Popen[bytes], stopping: threading.Event, stop: threading.Event,
                  worker_exit: list[int]) -> None:
    """serve's watch on its worker (a daemon thread): when ``child`` exits before serve
    stops it (``stopping`` not set), record its status in ``worker_exit`` and set
    ``stop``, which stops the gateway as SIGTERM does (``gateway.app.run``)."""
    status = child.wait()
    if not stopping.is_set():
        worker_exit.append(status)
        log.error("worker %d exited unasked (status %d): stopping", child.pid, status)
        stop.set()


def _read_reason(path: str) -> str:
    """The worker's one-line start-up failure (``--exit-reason-file``), or "" when it wrote none."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _worker_exit_text(status: int, reason: str) -> str:
    """Why serve's worker is gone, in words: its exit ``status`` (negative: the signal
    that killed it, as ``Popen.returncode``) and its one-line ``reason`` (may be empty)."""
    if status < 0:
        try:
            how = f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            how = f"was killed by signal {-status}"
    else:
        how = f"exited with status {status}"
    return f"the worker {how}" + (f": {reason}" if reason else "")


def _start_batch_worker(batch: BatchSettings, redis_settings: RedisSettings, gateway: GatewaySettings,
                        port: int) -> subprocess.Popen[bytes]:
    """Start serve's batch worker (``inferq batch-worker``), sending lines to serve's own
    gateway (on loopback when it listens on a wildcard address) unless
    --batch-gateway-url says otherwise. It authenticates with the batch credential
    (``shared/server_secret.py``), not with an API key."""
    from shared.serve_ready import http_url

    if batch.batch_gateway_url == BatchSettings().batch_gateway_url:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(gateway.host, gateway.host)
        batch = dataclasses.replace(batch, batch_gateway_url=http_url(host, port))
    env = {**os.environ, **settings_env(redis_settings, batch)}
    return subprocess.Popen([sys.executable, "-m", "shared.cli", "batch-worker", "--parent-pid", str(os.getpid())],
                            env=env)


def _stop_children(gateways: list[subprocess.Popen[bytes]], worker: subprocess.Popen[bytes] | None,
                   embedded: EmbeddedRedis | None, worker_wait_s: float) -> None:
    """Stop the children in order: SIGTERM the gateway processes ``gateways`` and wait
    for them up to uvicorn's graceful shutdown + ``GATEWAY_EXIT_MARGIN_S``; then SIGTERM
    the ``worker`` (it drains) and wait up to ``worker_wait_s`` seconds; SIGKILL what
    still runs after its wait; then stop ``embedded``. A second SIGINT or SIGTERM
    meanwhile cuts the waits short."""
    from gateway.app import GRACEFUL_SHUTDOWN_S

    signals: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: signals.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _stop("gateway", gateways, GRACEFUL_SHUTDOWN_S + GATEWAY_EXIT_MARGIN_S, signals)
        if worker is not None:
            if worker.poll() is None:
                log.info("stopping: worker %d drains (at most %.0f s), then Redis", worker.pid, worker_wait_s)
            _stop("worker", [worker], worker_wait_s, signals)
        if embedded is not None:
            embedded.close()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop(kind: str, procs: list[subprocess.Popen[bytes]], wait_s: float, signals: list[int]) -> None:
    """SIGTERM ``procs``, wait up to ``wait_s`` seconds for all of them (less once
    ``signals`` is not empty: a second stop signal came), SIGKILL those still running,
    and reap them."""
    import time

    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + wait_s
    while any(proc.poll() is None for proc in procs) and not signals and time.monotonic() < deadline:
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            log.warning("%s %d still running (%s): killing it", kind, proc.pid,
                        "second stop signal" if signals else f"{wait_s:.0f} s after SIGTERM")
            proc.kill()
        log.info("%s %d exited with status %s", kind, proc.pid, proc.wait())


@settings_command("gateway", ModelSettings, RedisSettings, GatewaySettings, BatchSettings,
                  aliases={"gateway_workers": "--workers"},
                  extra=(
    option_param("listen_fd", int, -1, "--listen-fd", hidden=True,
            help="Serve on this bound socket, one of its parent's gateway processes (gateway/multiproc.py)"),
    option_param("parent_pid", int, 0, "--parent-pid", hidden=True,
            help="Exit when this process (the serve or gateway that started this one) dies"),
))
def gateway_cmd(model: ModelSettings, redis_settings: RedisSettings, gateway: GatewaySettings,
                batch: BatchSettings, listen_fd: int, parent_pid: int) -> None:
    """Run the OpenAI-compatible HTTP gateway against an existing Redis: --workers
    processes on one port (this one and N-1 children). SIGTERM and SIGINT stop them all
    (graceful shutdown) and exit 0."""
    from gateway.app import run as run_gateway
    from gateway.multiproc import start_gateway, terminate
    from shared.model_source import resolve_model

    if parent_pid:
        from shared.lifecycle import exit_with_parent

        # SIGKILL, as for serve's worker: the parent died without stopping its children
        # (a crash or SIGKILL), and nothing may delay this process's exit.
        exit_with_parent(parent_pid, signal.SIGKILL)
    if not redis_settings.redis_url:
        raise typer.BadParameter("the gateway needs --redis-url (or INFERQ_REDIS_URL)")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as in serve: run returns, the children stop below
    gateways: list[subprocess.Popen[bytes]] = []
    try:
        if listen_fd >= 0:  # a child: one process, on the socket its parent bound
            source = resolve_model(model.model, model.load_format, model.model_cache_dir)
            run_gateway(gateway, redis_settings, model, source, sock=socket.socket(fileno=listen_fd), batch=batch)
            # Stopped. The parent's SIGTERM to all its gateways may still come; during
            # the interpreter's exit (Python handlers gone) it would end this one with -15.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            return
        listeners = _listen(gateway)
        source = resolve_model(model.model, model.load_format, model.model_cache_dir)
        env = {**os.environ, **settings_env(model, redis_settings, gateway, batch)}
        for sock in listeners[1:]:  # from the main thread, as in serve
            gateways.append(start_gateway(sock, env))
        run_gateway(gateway, redis_settings, model, source, sock=listeners[0], on_stop=lambda: terminate(gateways),
                    batch=batch)
    except KeyboardInterrupt:
        pass
    finally:
        _stop_children(gateways, None, None, 0.0)
