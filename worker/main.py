"""Entry point of a worker process: settings in, Redis client and engine built, SIGTERM
drains, SIGINT stops."""

from __future__ import annotations

import asyncio
import logging
import signal

from shared.gc_heap import freeze_startup_heap
from shared.keys import Keys
from shared.liveness import ready_workers
from shared.model_source import ModelSourceError, resolve_model, served_model_name
from shared.redis_connect import AsyncClient, connect
from shared.settings import EngineSettings, ModelSettings, RedisSettings, WorkerSettings
from worker.backends.factory import create_backend
from worker.engine_thread import EngineThread
from worker.service import Worker, default_worker_id

log = logging.getLogger(__name__)


class WorkerStartError(Exception):
    """The worker cannot start. ``inferq worker`` prints the message as one line,
    ``inferq worker: <message>``, and exits with status 1 (``inferq serve`` then stops
    and shows it: docs/operations.md, "Signals")."""


def start_error(exc: BaseException) -> WorkerStartError:
    """``exc``, raised while the worker starts, as a ``WorkerStartError`` of one line: the
    message of a ``ValueError`` or ``ModelSourceError`` (what the operator passed does not
    fit), else the exception's type and message; the traceback is logged at debug level."""
    log.debug("worker start-up failed", exc_info=exc)
    if isinstance(exc, WorkerStartError):
        return exc
    text = " ".join(str(exc).split()) or "no message"
    if isinstance(exc, ValueError | ModelSourceError):  # SettingsError is a ValueError
        return WorkerStartError(text)
    return WorkerStartError(f"{type(exc).__name__}: {text}")


async def serve_worker(worker: WorkerSettings, redis_settings: RedisSettings, model: ModelSettings,
                       engine: EngineSettings) -> None:
    """Build the backend, connect to Redis and run until SIGTERM has drained the worker.

    Raises:
        WorkerStartError: the worker cannot start: no Redis URL (a worker never starts an
            embedded Redis itself), a model that does not resolve or load, settings that do
            not fit it (e.g. a tensor-parallel size that does not divide its heads), or a
            live worker of the model that announces another block size
            (``block_size_conflict``). The message is one line.
    """
    if not redis_settings.redis_url:
        raise WorkerStartError("a worker needs --redis-url (or INFERQ_REDIS_URL)")
    tp = None
    engine_thread = EngineThread()
    try:
        # Resolved once (the first start may convert the default model): the backend and
        # the served name both come from it.
        source = await asyncio.to_thread(resolve_model, model.model, model.load_format, model.model_cache_dir)
        if engine.tensor_parallel_size > 1:  # this process is rank 0 (docs/architecture.md, "Tensor parallelism")
            if worker.backend != "inferq":
                raise ValueError(f"--tensor-parallel-size needs the inferq backend, not {worker.backend}")
            from worker.parallel.follower import start_for_engine

            tp = await asyncio.to_thread(start_for_engine, source, model, engine)
        backend = await engine_thread.run(create_backend, worker.backend, source, model, engine)
    except Exception as exc:  # any start-up failure: one line (the traceback at debug level)
        engine_thread.close()
        if tp is not None:
            tp.close(abort=False)  # the process ends next (worker.cli: exit_process)
        raise start_error(exc) from exc
    client = connect(redis_settings.redis_url, health_check_interval=10)
    service = Worker(client, Keys(redis_settings.namespace), served_model_name(model, source),
                     worker.worker_id or default_worker_id(), backend, worker.drain_timeout_s, engine_thread,
                     engine_stall_timeout_s=worker.engine_stall_timeout_s,
                     max_waiting_prefill_tokens=worker.max_waiting_prefill_tokens,
                     steal_after_ms=worker.steal_after_ms)
    if worker.fault_hang_after_steps:  # fault injection for tests (worker/faults.py); off by default
        from worker.faults import hang_after_steps

        service.step_fn = hang_after_steps(service.step_fn, worker.fault_hang_after_steps)
    if worker.step_trace:
        from worker.progress import StepTrace

        service.trace = StepTrace(worker.step_trace)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, service.drain)
    main_task = asyncio.current_task()
    assert main_task is not None
    loop.add_signal_handler(signal.SIGINT, main_task.cancel)  # Ctrl-C: stop now, no drain
    metrics_server = None
    try:
        if worker.metrics_port:
            from worker.metrics import start_metrics_server

            try:
                metrics_server = start_metrics_server(worker.metrics_port, service)
            except OSError as exc:  # e.g. the port is taken
                raise WorkerStartError(f"cannot serve metrics on --metrics-port {worker.metrics_port}: {exc}") from exc
        freeze_startup_heap()  # the engine and its graphs live until exit: no full collection walks them
        conflict = await block_size_conflict(client, service.keys, service.model, backend.block_size)
        if conflict is not None:
            raise WorkerStartError(conflict)
        log.info("worker %s serving %r from stream %s (backend %s)", service.worker_id, service.model,
                 service.stream, backend.name)
        await service.run()
    finally:
        try:
            if metrics_server is not None:
                metrics_server.shutdown()
            if service.trace is not None:
                service.trace.close()
            await client.aclose()
        finally:  # even when a second SIGINT cancels the awaits above
            stop = None
            if tp is not None:
                sync = getattr(getattr(backend, "runner", None), "step_sync", None)
                # STOP is a collective: it goes after the step in progress (SIGINT does
                # not wait for it), from the thread that issues all of rank 0's.
                stop = None if sync is None else engine_thread.submit(sync.send_stop).result
            engine_thread.close()
            if tp is not None:  # the process ends next (worker.cli: exit_process), its communicators with it
                tp.close(stop, abort=False)


async def block_size_conflict(client: AsyncClient, keys: Keys, model: str, block_size: int) -> str | None:
    """Why this worker must not serve ``model``: a live worker of it announces another
    block size (its heartbeat's ``block_size``), so the block hashes of the two would
    name different tokens, and gateways place prompts by the hashes of one size
    (``shared/block_hashes.py``); None when none does.

    Raises:
        redis.exceptions.RedisError, OSError: Redis unreachable.
    """
    for status in await ready_workers(client, keys, model):
        if status.block_size and status.block_size != block_size:
            return (f"worker {status.worker_id} of model {model!r} runs with block size {status.block_size}, "
                    f"this one with {block_size}: give every worker of a model the same --block-size")
    return None
