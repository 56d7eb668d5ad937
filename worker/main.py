"""Entry point of a worker process: settings in, Redis client and engine built, SIGTERM
drains, SIGINT stops."""

from __future__ import annotations

import asyncio
import logging
import signal

import redis.asyncio as aioredis

from shared.gc_heap import freeze_startup_heap
from shared.keys import Keys
from shared.model_source import resolve_model, served_model_name
from shared.settings import EngineSettings, ModelSettings, RedisSettings, WorkerSettings
from worker.backends.base import create_backend
from worker.engine_thread import EngineThread
from worker.service import Worker, default_worker_id

log = logging.getLogger(__name__)


async def serve_worker(worker: WorkerSettings, redis_settings: RedisSettings, model: ModelSettings,
                       engine: EngineSettings) -> None:
    """Build the backend, connect to Redis and run until SIGTERM has drained the worker.

    Raises:
        ValueError: no Redis URL (a worker never starts an embedded Redis itself).
    """
    if not redis_settings.redis_url:
        raise ValueError("a worker needs --redis-url (or INFERQ_REDIS_URL)")
    # Resolved once (the first start may convert the default model): the backend and the
    # served name both come from it.
    source = await asyncio.to_thread(resolve_model, model.model, model.load_format, model.model_cache_dir)
    tp = None
    if engine.tensor_parallel_size > 1:  # this process is rank 0 (docs/architecture.md, "Tensor parallelism")
        if worker.backend != "inferq":
            raise ValueError(f"--tensor-parallel-size needs the inferq backend, not {worker.backend}")
        from worker.parallel.follower import start_for_engine

        tp = await asyncio.to_thread(start_for_engine, source, model, engine)
    engine_thread = EngineThread()
    backend = await engine_thread.run(create_backend, worker.backend, source, model, engine)
    client = aioredis.from_url(redis_settings.redis_url, health_check_interval=10)
    service = Worker(client, Keys(redis_settings.namespace), served_model_name(model, source),
                     worker.worker_id or default_worker_id(), backend, worker.drain_timeout_s, engine_thread,
                     engine_stall_timeout_s=worker.engine_stall_timeout_s)
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
    if worker.metrics_port:
        from worker.metrics import start_metrics_server

        metrics_server = start_metrics_server(worker.metrics_port, service)
    log.info("worker %s serving %r from stream %s (backend %s)", service.worker_id, service.model,
             service.stream, backend.name)
    freeze_startup_heap()  # the engine and its graphs live until exit: no full collection walks them
    try:
        await service.run()
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        if service.trace is not None:
            service.trace.close()
        await client.aclose()
        engine_thread.close()
        if tp is not None:
            sync = getattr(getattr(backend, "runner", None), "step_sync", None)
            tp.close(sync.send_stop if sync is not None else None)
