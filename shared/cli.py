"""The ``inferq`` command: ``serve`` (embedded Redis + worker + batch worker + gateway),
``gateway``, ``worker``, ``batch-worker`` (Batch API jobs), ``queues`` (inspect streams,
pending entries and workers) and ``settings`` (print the settings table).

Every settings field becomes a flag (``--max-num-seqs``) whose default is unset, so the
precedence flag > ``INFERQ_*`` variable > dataclass default is applied in one place
(``shared.settings.build``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import typer

from shared.redis_url import parse_redis_url
from shared.settings import (
    ENV_PREFIX,
    BatchSettings,
    EngineSettings,
    GatewaySettings,
    ModelSettings,
    RedisSettings,
    SettingsError,
    WorkerSettings,
    build,
    flag_name,
    settings_table,
)

if TYPE_CHECKING:
    from shared.embedded_redis import EmbeddedRedis

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="inferq: queue-driven LLM serving (OpenAI API -> Redis streams -> paged-KV workers)")

log = logging.getLogger("inferq")


def _parameters(classes: tuple[type, ...], aliases: dict[str, str]) -> list[inspect.Parameter]:
    params = [inspect.Parameter("log_level", inspect.Parameter.KEYWORD_ONLY, annotation=str,
                                default=typer.Option("info", "--log-level", help="debug | info | warning"))]
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            annotation: Any = list[str] | None if typing.get_origin(hint) is tuple else hint | None
            flag = flag_name(f)
            if hint is bool:  # --x / --no-x, as vLLM spells its switches
                flag = f"{flag}/--no-{flag[2:]}"
            flags = (flag, aliases[f.name]) if f.name in aliases else (flag,)
            option = typer.Option(None, *flags, help=f"{f.metadata.get('help', '')} [env {ENV_PREFIX}{f.name.upper()}; "
                                                     f"default {f.default!r}]", show_default=False)
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                            annotation=annotation))
    return params


def settings_command(name: str, *classes: type, extra: tuple[inspect.Parameter, ...] = (),
                     aliases: dict[str, str] | None = None) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register ``fn(*settings, **extra)`` as command ``name`` with a flag per settings
    field, plus the command's own options ``extra`` (passed as keywords). ``aliases``
    gives fields a second flag in this command (``{"gateway_workers": "--workers"}``)."""

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        def command(**kwargs: Any) -> None:
            logging.basicConfig(level=kwargs.pop("log_level").upper(),
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            try:
                built = [build(cls, {f.name: kwargs[f.name] for f in dataclasses.fields(cls)}) for cls in classes]
            except SettingsError as exc:  # a bad flag or variable: say which, no traceback
                typer.echo(f"Error: {exc}", err=True)
                raise typer.Exit(2) from None
            fn(*built, **{p.name: kwargs[p.name] for p in extra})

        command.__signature__ = inspect.Signature([*_parameters(classes, aliases or {}), *extra])  # type: ignore[attr-defined]
        command.__doc__ = fn.__doc__
        command.__name__ = name
        app.command(name)(command)
        return fn

    return decorate


def settings_env(*settings: Any) -> dict[str, str]:
    """``INFERQ_*`` variables that reproduce ``settings`` in a child process."""
    env: dict[str, str] = {}
    for obj in settings:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            env[ENV_PREFIX + f.name.upper()] = ",".join(value) if isinstance(value, tuple) else str(value)
    return env


def _option(name: str, annotation: Any, default: Any, *flags: str, help: str, hidden: bool = False
            ) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *flags, help=help, hidden=hidden))


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
    _option("listen_fd", int, -1, "--listen-fd", hidden=True,
            help="Serve on this bound socket, one of its parent's gateway processes (gateway/multiproc.py)"),
    _option("parent_pid", int, 0, "--parent-pid", hidden=True,
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


@settings_command("worker", ModelSettings, EngineSettings, RedisSettings, WorkerSettings, extra=(
    inspect.Parameter("parent_pid", inspect.Parameter.KEYWORD_ONLY, annotation=int, default=typer.Option(
        0, "--parent-pid", hidden=True, help="Exit when this process (the serve that started the worker) dies")),
    _option("exit_reason_file", str, "", "--exit-reason-file", hidden=True,
            help="Also write why the worker could not start (one line) to this file (serve shows it)"),
))
def worker_cmd(model: ModelSettings, engine: EngineSettings, redis_settings: RedisSettings,
               worker: WorkerSettings, parent_pid: int, exit_reason_file: str) -> None:
    """Run one worker: pull requests of the model's stream into the engine. SIGTERM
    drains (finish held requests, then exit 0). A worker that cannot start (a model that
    does not load, settings that do not fit it) prints one line, ``inferq worker:
    <reason>``, and exits with status 1."""
    import asyncio

    if parent_pid:
        from shared.lifecycle import exit_with_parent

        # SIGKILL, not SIGTERM's drain: with serve gone its gateway cannot deliver what the
        # worker would finish, and a stuck step or thread cannot delay the exit.
        exit_with_parent(parent_pid, signal.SIGKILL)
    from worker.main import WorkerStartError, serve_worker

    try:
        asyncio.run(serve_worker(worker, redis_settings, model, engine))
    except WorkerStartError as exc:
        typer.echo(f"inferq worker: {exc}", err=True)
        if exit_reason_file:
            with open(exit_reason_file, "w") as f:
                f.write(f"{exc}\n")
        raise typer.Exit(1) from None
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass


@settings_command("batch-worker", RedisSettings, BatchSettings, extra=(
    _option("parent_pid", int, 0, "--parent-pid", hidden=True,
            help="Exit when this process (the serve that started it) dies"),
))
def batch_worker_cmd(redis_settings: RedisSettings, batch: BatchSettings, parent_pid: int) -> None:
    """Run the batch worker: an arq worker that runs the Batch API's batches by sending
    their lines to --batch-gateway-url. SIGTERM and SIGINT stop it (running batches
    resume from their recorded lines on the next start)."""
    import asyncio

    if parent_pid:
        from shared.lifecycle import exit_with_parent

        exit_with_parent(parent_pid, signal.SIGKILL)  # as serve's worker
    if not redis_settings.redis_url:
        raise typer.BadParameter("the batch worker needs --redis-url (or INFERQ_REDIS_URL)")
    if parse_redis_url(redis_settings.redis_url).kind == "cluster":
        raise typer.BadParameter("the batch worker needs a Redis that is not a cluster (arq's jobs span hash "
                                 "slots): a single server or redis+sentinel://")
    from worker.batch_jobs import serve_batch_worker

    try:
        asyncio.run(serve_batch_worker(batch, redis_settings))
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass


@settings_command("queues", RedisSettings, extra=(
    _option("as_json", bool, False, "--json", help="Print JSON instead of tables"),
    _option("models", list[str] | None, None, "--model", help="Only these models' streams (repeat; default all)"),
))
def queues_cmd(redis_settings: RedisSettings, as_json: bool, models: list[str] | None) -> None:
    """Inspect the queues: per model stream length, consumer-group lag, pending entries
    per consumer with idle time, redeliveries, and live workers with heartbeat age,
    running/waiting requests and KV usage."""
    from shared.queues import queues_command

    if not redis_settings.redis_url:
        raise typer.BadParameter("inferq queues needs --redis-url (or INFERQ_REDIS_URL)")
    queues_command(redis_settings.redis_url, redis_settings.namespace, as_json, models or None)


@app.command("settings")
def settings_cmd() -> None:
    """Print every setting with its variable and default (markdown)."""
    typer.echo(settings_table())


if __name__ == "__main__":
    app()
