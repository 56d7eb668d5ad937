"""The batch worker (``inferq batch-worker``): an arq worker whose jobs run batches of the
Batch API by sending their lines to the gateway's own HTTP API (docs/operations.md,
"Batches").

Tenant: each line runs as the batch's owner. The runner authenticates with the batch
credential (``shared/server_secret.py``), which no client has, and names the owner's key
tenant in ``BATCH_TENANT_HEADER``; the gateway then applies the owner's rate limits, fair
share and metrics, in the batch class. A line the owner's rate limit refuses (429) waits
for the ``Retry-After`` the gateway gave, and so does the rest of the batch (``Pacer``);
a line larger than the owner's whole limit, which no wait cures, is a result (the 429
goes to the error file).

Delivery: a job takes a lease on its batch (``Keys.batch_lease``, renewed every third
of ``batch_lease_s``), so one runner drives a batch at a time. Each line's result is
written once, keyed by ``custom_id`` (``BatchStore.record``); a runner that starts on a
batch skips the lines that have one. A runner killed mid-batch leaves its lease to
lapse; the ``resume_batches`` cron job (every ``batch_resume_interval_s``, and at
startup) enqueues a job for each unfinished batch without a lease. A line whose request
was sent but whose result was not yet written is sent again: at-least-once delivery,
deduplicated by ``custom_id`` in the output.

Input file deleted: the runner stops sending (its watcher looks every
``WATCH_INTERVAL_S``) and the batch ends ``failed`` with ``file_not_found`` (a
``cancelling`` one ``cancelled``), whatever status it had reached; the results recorded
so far go to its output and error files, ordered by ``custom_id``.
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
from arq import cron
from arq.worker import Worker, func

from shared.batch_store import ACTIVE_STATUSES, FINAL_STATUSES, RUN_BATCH_JOB, BatchStore, enqueue_run
from shared.fair_queue import PRIORITY_CLASSES, PRIORITY_HEADER
from shared.keys import Keys
from shared.redis_connect import arq_client, connect
from shared.server_secret import BATCH_TENANT_HEADER, batch_credential, load_server_secret
from shared.settings import BatchSettings, RedisSettings

log = logging.getLogger(__name__)

#: Batch lines go to the lowest priority class (``shared/fair_queue.py``).
BATCH_PRIORITY = PRIORITY_CLASSES[-1]
#: Answers after which a line is sent again (the owner's rate limit or a full queue, the
#: gateway without a worker, or restarting) rather than recorded.
RETRY_STATUSES = (429, 502, 503, 504)
#: How the gateway's 429 message starts for a request larger than the whole limit
#: (gateway/rate_limits.py, OpenAI's wording): no wait cures it, so it is a result.
NEVER_FITS_PREFIX = "Request too large"
#: Backoff between tries of one line, seconds: doubles from the first, capped.
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 5.0
#: Longest pause a 429's ``Retry-After`` imposes on a batch at once, seconds (the
#: runner asks again after it).
MAX_RETRY_AFTER_S = 60.0
#: Timeout of one line's HTTP request, seconds (the gateway's own request timeout
#: answers first in normal operation).
LINE_TIMEOUT_S = 900.0
#: How often a runner re-reads its batch's status (cancel), the clock (expiry) and
#: whether its input file still exists, seconds.
WATCH_INTERVAL_S = 0.2
#: ``resume_batches`` enqueues at most one job per batch in this many of its intervals
#: (a batch waiting for a free job slot would otherwise collect one job per tick).
RESUME_MARK_INTERVALS = 3
#: What an expired line's error says (OpenAI's code and wording).
EXPIRED_ERROR = {"code": "batch_expired",
                 "message": "This request could not be executed before the completion window expired."}
#: ``errors`` of a batch whose input file was deleted.
INPUT_GONE_ERRORS = {"object": "list", "data": [{"code": "file_not_found", "message": "the input file was deleted",
                                                 "param": "input_file_id", "line": None}]}

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


class Pacer:
    """One batch's pause after a 429: every line waits until ``hold``'s deadline."""

    def __init__(self) -> None:
        self._until_s = 0.0  # time.monotonic()

    def hold(self, pause_s: float) -> None:
        """Pause sending for ``pause_s`` seconds from now (a later deadline wins)."""
        self._until_s = max(self._until_s, time.monotonic() + pause_s)

    async def wait(self, stop: asyncio.Event) -> bool:
        """Wait out the pause. Returns False if ``stop`` was set meanwhile."""
        while (left_s := self._until_s - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(stop.wait(), left_s)
            except TimeoutError:
                continue
            return False
        return not stop.is_set()


class BatchRunner:
    """Runs batches: one ``run(batch_id)`` per arq job."""

    def __init__(self, store: BatchStore, settings: BatchSettings, http: httpx.AsyncClient) -> None:
        self.store = store
        self.settings = settings
        self.http = http
        self._lease = store.redis.register_script(_LEASE)
        self._credential = ""

    async def credential(self, reload: bool = False) -> str:
        """The batch credential (read from Redis on first use, or again with ``reload``).

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable (the job fails; its
            batch is resumed).
        """
        if reload or not self._credential:
            self._credential = batch_credential(await load_server_secret(self.store.redis, self.store.keys))
        return self._credential

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
        stored = await store.get_batch(batch_id)
        if stored is None:
            await store.redis.srem(store.keys.active_batches(), batch_id)
            return "gone"
        batch, owner = stored.obj, stored.owner
        if batch["status"] in FINAL_STATUSES:
            await store.redis.srem(store.keys.active_batches(), batch_id)
            return str(batch["status"])
        path = store.path(batch["input_file_id"])
        if not path.exists():
            return await self._end_without_input(batch_id, owner)
        if batch["status"] == "validating":
            try:
                total, errors = await asyncio.to_thread(_check_endpoint, path, batch["endpoint"])
            except FileNotFoundError:
                return await self._end_without_input(batch_id, owner)
            if errors:
                await store.transition(batch_id, ("validating",), "failed", failed_at=int(time.time()), errors={
                    "object": "list", "data": [{"code": "invalid_request", "message": m, "param": "input_file_id",
                                                "line": line} for line, m in errors]})
                return "failed"
            await store.transition(batch_id, ("validating",), "in_progress", in_progress_at=int(time.time()),
                                   total=total)
        stored = await store.get_batch(batch_id)
        assert stored is not None
        if stored.obj["status"] == "in_progress":
            await self._send_all(stored.obj, owner, path)
        return await self._finish(batch_id, owner, path)

    async def _send_all(self, batch: dict[str, Any], owner: str, path: Path) -> None:
        """Send every line of ``path`` without a result as tenant ``owner``,
        ``batch_concurrency`` at a time, until done, cancelled, expired or the input
        file is gone."""
        batch_id = batch["id"]
        done = await self.store.done_ids(batch_id)
        stop = asyncio.Event()
        pacer = Pacer()

        async def watch() -> None:
            while not stop.is_set():
                status, expires_at = await self.store.redis.hmget(self.store.keys.batch_key(batch_id),
                                                                  ["status", "expires_at"])
                if (status is None or json.loads(status) != "in_progress" or time.time() >= json.loads(expires_at)
                        or not path.exists()):
                    stop.set()
                    return
                await asyncio.sleep(WATCH_INTERVAL_S)

        watcher = asyncio.create_task(watch())
        slots = asyncio.Semaphore(self.settings.batch_concurrency)
        tasks: set[asyncio.Task[None]] = set()

        async def one(line: dict[str, Any]) -> None:
            try:
                result = await self._send(line, owner, stop, pacer)
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
        except FileNotFoundError:
            pass  # deleted before it was opened: _finish ends the batch
        finally:
            for task in tasks:
                task.cancel()
            watcher.cancel()

    async def _send(self, line: dict[str, Any], owner: str, stop: asyncio.Event,
                    pacer: Pacer) -> dict[str, Any] | None:
        """POST one line to the gateway as tenant ``owner``, trying again on connection
        errors and ``RETRY_STATUSES`` (a 429 after its ``Retry-After``, which pauses the
        whole batch) until it answers or ``stop`` is set (then None: no result).

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable while reading the
            batch credential.
        """
        url = self.settings.batch_gateway_url.rstrip("/") + line["url"]
        wait_s = RETRY_FIRST_S
        reloaded = False
        while True:
            if not await pacer.wait(stop):
                return None
            headers = {PRIORITY_HEADER: BATCH_PRIORITY, BATCH_TENANT_HEADER: owner,
                       "Authorization": f"Bearer {await self.credential()}"}
            try:
                answer = await self.http.post(url, json=line["body"], headers=headers)
                if answer.status_code == 401 and not reloaded:  # Redis may have remade the secret
                    reloaded = True
                    await self.credential(reload=True)
                    continue
                if answer.status_code not in RETRY_STATUSES or _never_fits(answer):
                    break
                if answer.status_code == 429:
                    pacer.hold(_retry_after_s(answer))
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

    async def _finish(self, batch_id: str, owner: str, path: Path) -> str:
        """Write the output and error files (owned by ``owner``) and move the batch to its
        final status."""
        store = self.store
        stored = await store.get_batch(batch_id)
        assert stored is not None
        batch = stored.obj
        status = batch["status"]
        order = await asyncio.to_thread(_custom_ids, path)
        if order is None:
            return await self._end_without_input(batch_id, owner)
        now = int(time.time())
        if status == "cancelling":
            final = "cancelled"
        elif status == "in_progress" and now >= batch["expires_at"] and (
                missing := set(order) - await store.done_ids(batch_id)):
            for custom_id in [c for c in order if c in missing]:
                await store.record(batch_id, custom_id, {"id": f"batch_req_{secrets.token_hex(12)}",
                                                         "custom_id": custom_id, "response": None,
                                                         "error": EXPIRED_ERROR}, ok=False)
            final = "expired"
        else:
            if status == "in_progress" and not await store.transition(
                    batch_id, ("in_progress",), "finalizing", finalizing_at=now):
                return await self._finish(batch_id, owner, path)  # cancelled meanwhile
            final = "completed"
        results = await store.results(batch_id)
        await self._write_results(batch_id, owner, [results[c] for c in order if c in results])
        await store.transition(batch_id, (status, "finalizing"), final, **{f"{final}_at": int(time.time())})
        log.info("batch %s %s", batch_id, final)
        return final

    async def _end_without_input(self, batch_id: str, owner: str) -> str:
        """End a batch whose input file is gone: ``cancelled`` if it was cancelling, else
        ``failed`` with ``INPUT_GONE_ERRORS``; the results so far go to its files, ordered
        by custom_id (the input order is gone with the file)."""
        store = self.store
        stored = await store.get_batch(batch_id)
        assert stored is not None
        final = "cancelled" if stored.obj["status"] == "cancelling" else "failed"
        results = await store.results(batch_id)
        await self._write_results(batch_id, owner, [results[c] for c in sorted(results)])
        fields: dict[str, Any] = {f"{final}_at": int(time.time())}
        if final == "failed":
            fields["errors"] = INPUT_GONE_ERRORS
        if not await store.transition(batch_id, ACTIVE_STATUSES, final, **fields):
            return await self._drive(batch_id)  # it reached a final status meanwhile
        log.info("batch %s %s: its input file %s was deleted", batch_id, final, stored.obj["input_file_id"])
        return final

    async def _write_results(self, batch_id: str, owner: str, lines: list[dict[str, Any]]) -> None:
        """Store ``lines`` as the batch's output file (answered 200) and error file (the
        rest), owned by ``owner``, and record their ids on the batch."""
        ok = [r for r in lines if (r["response"] or {}).get("status_code") == 200]
        failed = [r for r in lines if (r["response"] or {}).get("status_code") != 200]
        hex_id = batch_id.split("_", 1)[1]
        output_id = await self._write_file(f"file-{hex_id}-output", ok, owner)
        error_id = await self._write_file(f"file-{hex_id}-errors", failed, owner)
        await self.store.set_fields(batch_id, output_file_id=output_id, error_file_id=error_id)
        log.info("batch %s: %d output lines, %d error lines", batch_id, len(ok), len(failed))

    async def _write_file(self, file_id: str, lines: list[dict[str, Any]], owner: str) -> str | None:
        """Store ``lines`` as JSONL file ``file_id`` (purpose ``batch_output``) owned by
        ``owner``; None if empty."""
        if not lines:
            return None
        tmp = self.store.temp_path()
        await asyncio.to_thread(tmp.write_text, "".join(json.dumps(line) + "\n" for line in lines))
        await self.store.add_file(file_id, tmp, f"{file_id}.jsonl", "batch_output", owner)
        return file_id


def _never_fits(answer: httpx.Response) -> bool:
    """Whether ``answer`` is the owner's rate limit refusing a line larger than the whole
    limit (``NEVER_FITS_PREFIX``)."""
    if answer.status_code != 429:
        return False
    try:
        message = answer.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(message, str) and message.startswith(NEVER_FITS_PREFIX)


def _retry_after_s(answer: httpx.Response) -> float:
    """A 429's ``Retry-After`` (whole seconds), at most ``MAX_RETRY_AFTER_S``;
    ``RETRY_FIRST_S`` when absent or not a number."""
    try:
        return min(max(float(answer.headers.get("retry-after", "")), 0.0), MAX_RETRY_AFTER_S)
    except ValueError:
        return RETRY_FIRST_S


def _custom_ids(path: Path) -> list[str] | None:
    """The custom_ids of the input file at ``path``, in order; None when it is gone."""
    try:
        with open(path, "rb") as f:
            return [json.loads(raw)["custom_id"] for raw in f]
    except FileNotFoundError:
        return None


def _check_endpoint(path: Path, endpoint: str) -> tuple[int, list[tuple[int, str]]]:
    """``(num_lines, errors)``: lines whose ``url`` is not the batch's ``endpoint``
    (``(line, message)``, at most 10).

    Raises:
        FileNotFoundError: the file is gone.
    """
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
        ValueError: no Redis URL, or a Redis Cluster's (``arq_client``).
    """
    if not redis_settings.redis_url:
        raise ValueError("the batch worker needs a Redis URL (redis://host:port/0, unix:///path or "
                         "redis+sentinel://...)")
    keys = Keys(redis_settings.namespace)
    pool = arq_client(redis_settings.redis_url)

    async def startup(ctx: dict[str, Any]) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per batch line
        logging.getLogger("arq.worker").setLevel(logging.WARNING)  # nor one per resume check (every few s)
        client = connect(redis_settings.redis_url)
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
