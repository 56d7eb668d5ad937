"""The worker's commands: ``worker`` (one engine pulling the model's streams) and
``batch-worker`` (the Batch API's arq worker). ``shared.cli.load_commands`` adds them to
the ``inferq`` app.
"""

from __future__ import annotations

import inspect
import signal

import typer

from shared.cli import option_param, settings_command
from shared.redis_url import parse_redis_url
from shared.settings import BatchSettings, EngineSettings, ModelSettings, RedisSettings, WorkerSettings


@settings_command("worker", ModelSettings, EngineSettings, RedisSettings, WorkerSettings, extra=(
    inspect.Parameter("parent_pid", inspect.Parameter.KEYWORD_ONLY, annotation=int, default=typer.Option(
        0, "--parent-pid", hidden=True, help="Exit when this process (the serve that started the worker) dies")),
    option_param("exit_reason_file", str, "", "--exit-reason-file", hidden=True,
            help="Also write why the worker could not start (one line) to this file (serve shows it)"),
))
def worker_cmd(model: ModelSettings, engine: EngineSettings, redis_settings: RedisSettings,
               worker: WorkerSettings, parent_pid: int, exit_reason_file: str) -> None:
    """Run one worker: pull requests of the model's stream into the engine. SIGTERM
    drains (finish held requests, then exit 0). A worker that cannot start (a model that
    does not load, settings that do not fit it) prints one line, ``inferq worker:
    <reason>``, and exits with status 1. With ``--tensor-parallel-size`` above 1 the
    worker ends with ``os._exit`` once its group is closed (``worker.parallel.group.exit_process``:
    no interpreter teardown, whose C++ destructors could wait for or abort on NCCL's threads)."""
    import asyncio

    if parent_pid:
        from shared.lifecycle import exit_with_parent

        # SIGKILL, not SIGTERM's drain: with serve gone its gateway cannot deliver what the
        # worker would finish, and a stuck step or thread cannot delay the exit.
        exit_with_parent(parent_pid, signal.SIGKILL)
    from worker.main import WorkerStartError, serve_worker

    status = 0
    try:
        asyncio.run(serve_worker(worker, redis_settings, model, engine))
    except WorkerStartError as exc:
        typer.echo(f"inferq worker: {exc}", err=True)
        if exit_reason_file:
            with open(exit_reason_file, "w") as f:
                f.write(f"{exc}\n")
        status = 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    if engine.tensor_parallel_size > 1:
        from worker.parallel.group import exit_process

        exit_process(status)
    if status:
        raise typer.Exit(status)


@settings_command("batch-worker", RedisSettings, BatchSettings, extra=(
    option_param("parent_pid", int, 0, "--parent-pid", hidden=True,
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
