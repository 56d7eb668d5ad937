"""The batch worker (``inferq batch-worker``): an arq worker whose jobs run batches of the
Batch API by sending their lines to the gateway's own HTTP API (docs/operations.md,
"Batches").

Delivery: a job takes a lease on its batch (``Keys.batch_lease``, renewed every third
of ``batch_lease_s``), so one runner drives a batch at a time. Each line's result is
written once, keyed by ``custom_id`` (``BatchStore.record``); a runner that starts on a
batch skips the lines that have one. A runner killed mid-batch leaves its lease to
lapse; the ``resume_batches`` cron job (every ``batch_resume_interval_s``, and at
startup) enqueues a job for each unfinished batch without a lease. A line whose request
was sent but whose result was not yet written is sent again: at-least-once delivery,
deduplicated by ``custom_id`` in the output.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from arq import cron
from arq.connections import ArqRedis
from arq.worker import Worker, func

from shared.batch_store import FINAL_STATUSES, RUN_BATCH_JOB, BatchStore, enqueue_run
from shared.fair_queue import PRIORITY_CLASSES, PRIORITY_HEADER
from shared.keys import Keys
from shared.settings import BatchSettings, RedisSettings

log = logging.getLogger(__name__)

#: Batch lines go to the lowest priority class (``shared/fair_queue.py``).
BATCH_PRIORITY = PRIORITY_CLASSES[-1]
#: Answers after which a line is sent again (the gateway is overloaded, without a
#: worker, or restarting) rather than recorded.
RETRY_STATUSES = (429, 502, 503, 504)
#: Backoff between tries of one line, seconds: doubles from the first, capped.
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 5.0
#: Timeout of one line's HTTP request, seconds (the gateway's own request timeout
#: answers first in normal operation).
LINE_TIMEOUT_S = 900.0
#: How often a runner re-reads its batch's status (cancel) and the clock (expiry), seconds.
WATCH_INTERVAL_S = 0.2
#: ``resume_batches`` enqueues at most one job per batch in this many of its intervals
#: (a batch waiting for a free job slot would otherwise collect one job per tick).
RESUME_MARK_INTERVALS = 3
#: What an expired line's error says (OpenAI's code and wording).
EXPIRED_ERROR = {"code": "batch_expired",
                 "message": "This request could not be executed before the completion window expired."}

# Renew (ARGV[1] = token, ARGV[2] = ms) or release (ARGV[2] = 0) the lease KEYS[1] if held.
_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if tonumber(ARGV[2]) > 0 then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaseLost(Exception):
    """Another runner holds the batch now (this one stalled past its lease)."""


class BatchRunner:
    """Runs batches: one ``run(batch_id)`` per arq job."""

    def __init__(self, store: BatchStore, settings: BatchSettings, http: httpx.AsyncClient) -> None:
        self.store = store
        self.settings = settings
        self.http = http
        self._lease = store.redis.register_script(_LEASE)

    async def run(self, batch_id: str) -> str:
        """Drive ``batch_id`` to a final status if no other runner holds it. Returns what
        happened: ``busy`` (leased elsewhere), ``gone``, or the batch's final status."""
        lease_key = self.store.keys.batch_lease(batch_id)
        token = secrets.token_hex(8)
        lease_ms = int(self.settings.batch_lease_s * 1000)
        if not await self.store.redis.set(lease_key, token, nx=True, px=lease_ms):
            return "busy"
        main = asyncio.current_task()
        assert main is not None

        async def renew() -> None:
            while True:
                await asyncio.sleep(self.settings.batch_lease_s / 3)
                if not await self._lease(keys=[lease_key], args=[token, lease_ms]):
                    log.warning("batch %s: lease lost, stopping", batch_id)
                    main.cancel()
                    return

        renewer = asyncio.create_task(renew())
        try:
            return await self._drive(batch_id)
        finally:
            renewer.cancel()
            await self._lease(keys=[lease_key], args=[token, 0])

    async def _drive(self, batch_id: str) -> str:
        store = self.store
        batch = await store.get_batch(batch_id)
        if batch is None:
            await store.redis.srem(store.keys.active_batches(), batch_id)
            return "gone"
        if batch["status"] in FINAL_STATUSES:
            await store.redis.srem(store.keys.active_batches(), batch_id)
            return str(batch["status"])
        path = store.path(batch["input_file_id"])
        if batch["status"] in ("validating", "in_progress") and not path.exists():
            await store.transition(batch_id, ("validating", "in_progress"), "failed", failed_at=int(time.time()),
                                   errors={"object": "list", "data": [{
                                       "code": "file_not_found", "message": "the input file was deleted",
                                       "param": "input_file_id", "line": None}]})
            return "failed"
        if batch["status"] == "validating":
            total, errors = await asyncio.to_thread(_check_endpoint, path, batch["endpoint"])
            if errors:
                await store.transition(batch_id, ("validating",), "failed", failed_at=int(time.time()), errors={
                    "object": "list", "data": [{"code": "invalid_request", "message": m, "param": "input_file_id",
                                                "line": line} for line, m in errors]})
                return "failed"
            await store.transition(batch_id, ("validating",), "in_progress", in_progress_at=int(time.time()),
                                   total=total)
        batch = await store.get_batch(batch_id)
        assert batch is not None
        if batch["status"] == "in_progress":
            await self._send_all(batch, path)
        return await self._finish(batch_id, path)

    async def _send_all(self, batch: dict[str, Any], path: Path) -> None:
        """Send every line of ``path`` without a result, ``batch_concurrency`` at a time,
        until done, cancelled or expired."""
        batch_id = batch["id"]
        done = await self.store.done_ids(batch_id)
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                status, expires_at = await self.store.redis.hmget(self.store.keys.batch_key(batch_id),
                                                                  ["status", "expires_at"])
                if status is None or json.loads(status) != "in_progress" or time.time() >= json.loads(expires_at):
                    stop.set()
                    return
                await asyncio.sleep(WATCH_INTERVAL_S)

        watcher = asyncio.create_task(watch())
        slots = asyncio.Semaphore(self.settings.batch_concurrency)
        tasks: set[asyncio.Task[None]] = set()

        async def one(line: dict[str, Any]) -> None:
            try:
                result = await self._send(line, stop)
                if result is not None:
                    ok = result["response"]["status_code"] == 200
                    await self.store.record(batch_id, line["custom_id"], result, ok)
            finally:
                slots.release()

        try:
            with open(path, "rb") as f:  # noqa: ASYNC230 - local disk, one line at a time
                for raw in f:
                    line = json.loads(raw)
                    if line["custom_id"] in done:
                        continue
                    await slots.acquire()
                    if stop.is_set():
                        slots.release()
                        break
                    task = asyncio.create_task(one(line))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            watcher.cancel()

    async def _send(self, line: dict[str, Any], stop: asyncio.Event) -> dict[str, Any] | None:
        """POST one line to the gateway, trying again on connection errors and
        ``RETRY_STATUSES`` until it answers or ``stop`` is set (then None: no result)."""
        headers = {PRIORITY_HEADER: BATCH_PRIORITY}
        if self.settings.batch_api_key:
            headers["Authorization"] = f"Bearer {self.settings.batch_api_key}"
        url = self.settings.batch_gateway_url.rstrip("/") + line["url"]
        wait_s = RETRY_FIRST_S
        while True:
            try:
                answer = await self.http.post(url, json=line["body"], headers=headers)
                if answer.status_code not in RETRY_STATUSES:
                    break
                reason = f"HTTP {answer.status_code}"
            except httpx.TransportError as exc:
                reason = repr(exc)
            log.debug("line %s: %s, trying again in %.1f s", line["custom_id"], reason, wait_s)
            try:
                await asyncio.wait_for(stop.wait(), wait_s)
                return None
            except TimeoutError:
                wait_s = min(wait_s * 2, RETRY_MAX_S)
        try:
            body: Any = answer.json()
        except ValueError:
            body = {"error": {"message": answer.text, "type": "server_error"}}
        request_id = answer.headers.get("x-request-id") or (body.get("id") if isinstance(body, dict) else None)
        return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line["custom_id"],
                "response": {"status_code": answer.status_code, "request_id": request_id, "body": body},
                "error": None}

    async def _finish(self, batch_id: str, path: Path) -> str:
        """Write the output and error files and move the batch to its final status."""
        store = self.store
        batch = await store.get_batch(batch_id)
        assert batch is not None
        status = batch["status"]
        now = int(time.time())
        if status == "cancelling":
            final = "cancelled"
        elif status == "in_progress" and now >= batch["expires_at"] and not await self._all_done(batch_id, path):
            for custom_id in await self._missing(batch_id, path):
                await store.record(batch_id, custom_id, {"id": f"batch_req_{secrets.token_hex(12)}",
                                                         "custom_id": custom_id, "response": None,
                                                         "error": EXPIRED_ERROR}, ok=False)
            final = "expired"
        else:
            if status == "in_progress" and not await store.transition(
                    batch_id, ("in_progress",), "finalizing", finalizing_at=now):
                return await self._finish(batch_id, path)  # cancelled meanwhile
            final = "completed"
        results = await store.results(batch_id)
        order = await asyncio.to_thread(_custom_ids, path)
        output = [results[c] for c in order if c in results and (results[c]["response"] or {}).get("status_code") == 200]
        errors = [results[c] for c in order if c in results and (results[c]["response"] or {}).get("status_code") != 200]
        hex_id = batch_id.split("_", 1)[1]
        output_id = await self._write_file(f"file-{hex_id}-output", output)
        error_id = await self._write_file(f"file-{hex_id}-errors", errors)
        await store.set_fields(batch_id, output_file_id=output_id, error_file_id=error_id)
        await store.transition(batch_id, (status, "finalizing"), final, **{f"{final}_at": int(time.time())})
        log.info("batch %s %s: %d output lines, %d error lines", batch_id, final, len(output), len(errors))
        return final

    async def _write_file(self, file_id: str, lines: list[dict[str, Any]]) -> str | None:
        """Store ``lines`` as JSONL file ``file_id`` (purpose ``batch_output``); None if empty."""
        if not lines:
            return None
        tmp = self.store.temp_path()
        await asyncio.to_thread(tmp.write_text, "".join(json.dumps(line) + "\n" for line in lines))
        await self.store.add_file(file_id, tmp, f"{file_id}.jsonl", "batch_output")
        return file_id

    async def _missing(self, batch_id: str, path: Path) -> list[str]:
        done = await self.store.done_ids(batch_id)
        return [c for c in await asyncio.to_thread(_custom_ids, path) if c not in done]

    async def _all_done(self, batch_id: str, path: Path) -> bool:
        return not await self._missing(batch_id, path)


def _custom_ids(path: Path) -> list[str]:
    """The custom_ids of the input file at ``path``, in order."""
    with open(path, "rb") as f:
        return [json.loads(raw)["custom_id"] for raw in f]


def _check_endpoint(path: Path, endpoint: str) -> tuple[int, list[tuple[int, str]]]:
    """``(num_lines, errors)``: lines whose ``url`` is not the batch's ``endpoint``
    (``(line, message)``, at most 10)."""
    errors: list[tuple[int, str]] = []
    num_lines = 0
    with open(path, "rb") as f:
        for num_lines, raw in enumerate(f, start=1):
            url = json.loads(raw)["url"]
            if url != endpoint and len(errors) < 10:
                errors.append((num_lines, f"line {num_lines}: `url` {url!r} is not the batch's endpoint {endpoint!r}"))
    return num_lines, errors


# --- the arq worker ---

async def run_batch(ctx: dict[str, Any], batch_id: str) -> str:
    """arq job: drive one batch (``BatchRunner.run``)."""
    return await ctx["runner"].run(batch_id)


async def resume_batches(ctx: dict[str, Any]) -> int:
    """arq cron job: enqueue a run for every unfinished batch without a live runner.
    Returns how many it enqueued."""
    store: BatchStore = ctx["store"]
    settings: BatchSettings = ctx["settings"]
    num = 0
    for batch_id in await store.active_ids():
        if await store.redis.exists(store.keys.batch_lease(batch_id)):
            continue
        if await store.redis.set(store.keys.batch_resumed(batch_id), 1, nx=True,
                                 ex=RESUME_MARK_INTERVALS * settings.batch_resume_interval_s):
            await enqueue_run(store, batch_id)
            num += 1
    if num:
        log.info("resume: enqueued %d batch(es) without a runner", num)
    return num


def build_worker(batch: BatchSettings, redis_settings: RedisSettings) -> Worker:
    """The arq ``Worker`` of the batch jobs (call from inside a running event loop).

    Raises:
        ValueError: no Redis URL.
    """
    if not redis_settings.redis_url:
        raise ValueError("the batch worker needs a Redis URL (redis://host:port/0 or unix:///path)")
    keys = Keys(redis_settings.namespace)
    pool = ArqRedis.from_url(redis_settings.redis_url)

    async def startup(ctx: dict[str, Any]) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per batch line
        logging.getLogger("arq.worker").setLevel(logging.WARNING)  # nor one per resume check (every few s)
        client = aioredis.from_url(redis_settings.redis_url)
        store = BatchStore(client, keys, batch.files_dir)
        http = httpx.AsyncClient(timeout=LINE_TIMEOUT_S, trust_env=False,
                                 limits=httpx.Limits(max_connections=batch.batch_concurrency * batch.batch_max_jobs))
        ctx.update(client=client, store=store, http=http, runner=BatchRunner(store, batch, http), settings=batch)
        log.info("batch worker: queue %s, gateway %s, files in %s", keys.arq_queue(), batch.batch_gateway_url,
                 store.dir)

    async def shutdown(ctx: dict[str, Any]) -> None:
        if "http" in ctx:
            await ctx["http"].aclose()
            await ctx["client"].aclose()

    timeout_s = batch.batch_completion_window_s + 3600  # arq's default (300 s) would cut long batches
    return Worker(
        functions=[func(run_batch, name=RUN_BATCH_JOB, timeout=timeout_s)],
        cron_jobs=[cron(resume_batches, second=set(range(0, 60, batch.batch_resume_interval_s)),
                        run_at_startup=True, unique=True, timeout=60)],
        redis_pool=pool, queue_name=keys.arq_queue(), max_jobs=batch.batch_max_jobs + 1,
        keep_result=0, on_startup=startup, on_shutdown=shutdown, handle_signals=True,
        health_check_key=f"{keys.arq_queue()}:health-check")


async def serve_batch_worker(batch: BatchSettings, redis_settings: RedisSettings) -> None:
    """Run the batch worker until SIGINT or SIGTERM (arq cancels running jobs; their
    batches resume from their recorded lines)."""
    worker = build_worker(batch, redis_settings)
    try:
        await worker.async_run()
    except asyncio.CancelledError:
        pass
    finally:
        await worker.close()
