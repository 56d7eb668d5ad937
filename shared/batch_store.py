"""State of the Batch API, shared by gateways and batch workers: file metadata and batch
objects in Redis (key names: ``shared/keys.py``), file bodies in ``files_dir``
(docs/operations.md, "Batches").

A file is ``{files_dir}/{file_id}.jsonl`` plus an OpenAI file object (JSON, with its
owner in the extra field ``owner``) under ``Keys.file_key``. A batch is a hash of its
OpenAI batch object's fields and ``owner`` (JSON values) under ``Keys.batch_key``; its
results (custom_id -> result line) are a second hash, written once per custom_id by one
Lua script that also counts the line, so a line that is run twice (at-least-once
delivery) is recorded and counted once.

Every file and batch has an owner: the key tenant (``gateway/tenants.py``) that uploaded
or created it, or, for a batch's output and error files, the batch's owner. Besides the
indexes of everything (for admin keys, ``/stats`` and the batch worker) each owner has
its own index of files and of batches (``Keys.owner_files``, ``Keys.owner_batches``), so
listing one owner's objects reads only theirs. Objects stored before owners existed have
the owner "", which only admin keys see.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from shared.keys import Keys

#: Endpoints a batch line (and a batch) may target.
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
#: The only completion window OpenAI accepts.
COMPLETION_WINDOW = "24h"
#: Statuses after which nothing changes.
FINAL_STATUSES = ("completed", "failed", "expired", "cancelled")
#: Statuses a batch worker drives forward (``resume_batches`` picks these up).
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")

# KEYS[1] batch hash; ARGV[1] JSON list of allowed current statuses, ARGV[2] new status,
# ARGV[3] JSON object of further fields (values already JSON). Returns 1 if moved.
_TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return 0 end
local allowed = cjson.decode(ARGV[1])
for _, s in ipairs(allowed) do
  if cjson.encode(s) == current then
    redis.call('HSET', KEYS[1], 'status', cjson.encode(ARGV[2]))
    for k, v in pairs(cjson.decode(ARGV[3])) do redis.call('HSET', KEYS[1], k, v) end
    return 1
  end
end
return 0
"""
# KEYS[1] results hash, KEYS[2] batch hash; ARGV[1] custom_id, ARGV[2] line, ARGV[3] the
# counter field (completed | failed). Returns 1 if the line is new.
_RECORD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
"""


@dataclass(frozen=True, slots=True)
class StoredFile:
    """A file's OpenAI file object (``obj``, what the API answers) and its ``owner``."""

    obj: dict[str, Any]
    owner: str


@dataclass(frozen=True, slots=True)
class StoredBatch:
    """A batch's OpenAI batch object (``obj``, ``request_counts`` filled in) and its ``owner``."""

    obj: dict[str, Any]
    owner: str


def default_files_dir() -> Path:
    """``~/.cache/inferq/files``: where files live when ``files_dir`` is empty."""
    return Path.home() / ".cache" / "inferq" / "files"


def new_id(prefix: str) -> str:
    """A fresh OpenAI-style id, e.g. ``file-3f2a...`` (24 hex digits)."""
    return f"{prefix}-{secrets.token_hex(12)}"


class BatchStore:
    """Files and batches over one asyncio Redis client (bytes replies) and ``files_dir``."""

    def __init__(self, client: aioredis.Redis, keys: Keys, files_dir: str) -> None:
        self.redis = client
        self.keys = keys
        self.dir = Path(files_dir) if files_dir else default_files_dir()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._transition = client.register_script(_TRANSITION)
        self._record = client.register_script(_RECORD)

    # --- files ---

    def path(self, file_id: str) -> Path:
        """Where the body of ``file_id`` lives."""
        return self.dir / f"{file_id}.jsonl"

    def temp_path(self) -> Path:
        """A fresh temporary path in ``files_dir`` (same filesystem: ``os.replace`` is atomic)."""
        return self.dir / f".tmp-{secrets.token_hex(8)}"

    async def add_file(self, file_id: str, src: Path, filename: str, purpose: str, owner: str) -> dict[str, Any]:
        """Move ``src`` to ``file_id``'s path and record its file object (returned),
        owned by key tenant ``owner``, in one transaction with both indexes.

        Raises:
            OSError: ``src`` could not be moved; redis errors: Redis unreachable.
        """
        os.replace(src, self.path(file_id))
        obj = {"id": file_id, "object": "file", "bytes": self.path(file_id).stat().st_size,
               "created_at": int(time.time()), "filename": filename, "purpose": purpose,
               "status": "processed", "expires_at": None, "status_details": None}
        score = time.time()  # finer than ``created_at``: files of one second keep their order
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.file_key(file_id), json.dumps({**obj, "owner": owner}))
            pipe.zadd(self.keys.files_index(), {file_id: score})
            pipe.zadd(self.keys.owner_files(owner), {file_id: score})
            await pipe.execute()
        return obj

    async def get_file(self, file_id: str) -> StoredFile | None:
        """The file object of ``file_id`` and its owner, or None."""
        raw = await self.redis.get(self.keys.file_key(file_id))
        return None if raw is None else _stored_file(raw)

    async def list_files(self, owner: str | None, purpose: str | None = None) -> list[dict[str, Any]]:
        """The file objects of ``owner`` (None: every file), newest first, optionally of
        one ``purpose``."""
        index = self.keys.files_index() if owner is None else self.keys.owner_files(owner)
        ids = [i.decode() for i in await self.redis.zrevrange(index, 0, -1)]
        raws = await self.redis.mget([self.keys.file_key(i) for i in ids]) if ids else []
        objs = [_stored_file(r).obj for r in raws if r is not None]
        return [o for o in objs if purpose is None or o["purpose"] == purpose]

    async def delete_file(self, file_id: str, owner: str) -> bool:
        """Delete ``file_id`` (owned by ``owner``): its metadata and index entries in one
        transaction, then its body. Returns False if it did not exist."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.file_key(file_id))
            pipe.zrem(self.keys.files_index(), file_id)
            pipe.zrem(self.keys.owner_files(owner), file_id)
            existed, _, _ = await pipe.execute()
        self.path(file_id).unlink(missing_ok=True)
        return bool(existed)

    # --- batches ---

    async def create_batch(self, obj: dict[str, Any], owner: str = "") -> None:
        """Store a new batch object owned by key tenant ``owner`` ("": admin keys only),
        index it and mark it active, in one transaction."""
        score = time.time()  # finer than ``created_at``: batches of one second keep their order
        async with self.redis.pipeline(transaction=True) as pipe:
            fields = {k: json.dumps(v) for k, v in obj.items()}
            pipe.hset(self.keys.batch_key(obj["id"]), mapping={**fields, "owner": json.dumps(owner)})
            pipe.zadd(self.keys.batches_index(), {obj["id"]: score})
            pipe.zadd(self.keys.owner_batches(owner), {obj["id"]: score})
            pipe.sadd(self.keys.active_batches(), obj["id"])
            await pipe.execute()

    async def get_batch(self, batch_id: str) -> StoredBatch | None:
        """The OpenAI batch object of ``batch_id`` (``request_counts`` filled in) and its
        owner, or None."""
        raw = await self.redis.hgetall(self.keys.batch_key(batch_id))
        if not raw:
            return None
        fields = {k.decode(): json.loads(v) for k, v in raw.items()}
        owner = str(fields.pop("owner", ""))
        completed, failed = int(fields.pop("completed", 0)), int(fields.pop("failed", 0))
        fields["request_counts"] = {"total": fields.pop("total", 0), "completed": completed, "failed": failed}
        return StoredBatch(obj=fields, owner=owner)

    async def list_batches(self, owner: str | None, limit: int, after: str | None
                           ) -> tuple[list[dict[str, Any]], bool]:
        """Up to ``limit`` batch objects of ``owner`` (None: every batch), newest first,
        after batch id ``after`` (none when ``after`` is not one of them); and whether
        more follow. Reads ``limit`` + 1 ids of the owner's index from ``after``'s rank."""
        index = self.keys.batches_index() if owner is None else self.keys.owner_batches(owner)
        start = 0
        if after is not None:
            rank = await self.redis.zrevrank(index, after)
            if rank is None:
                return [], False
            start = rank + 1
        ids = [i.decode() for i in await self.redis.zrevrange(index, start, start + limit)]
        page = [b.obj for b in [await self.get_batch(i) for i in ids[:limit]] if b is not None]
        return page, len(ids) > limit

    async def count_by_status(self) -> dict[str, int]:
        """Number of batches in each OpenAI status (every status listed, 0 when none):
        one ZRANGE of the index, then one pipeline of HGET status (O(batches)).

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable.
        """
        counts = dict.fromkeys(ACTIVE_STATUSES + FINAL_STATUSES, 0)
        ids = await self.redis.zrange(self.keys.batches_index(), 0, -1)
        async with self.redis.pipeline(transaction=False) as pipe:
            for batch_id in ids:
                pipe.hget(self.keys.batch_key(batch_id.decode()), "status")
            statuses = await pipe.execute() if ids else []
        for raw in statuses:
            if raw is not None:  # indexed, hash gone
                status = json.loads(raw)
                counts[status] = counts.get(status, 0) + 1
        return counts

    async def set_fields(self, batch_id: str, **fields: Any) -> None:
        """Set batch fields (values JSON-encoded here)."""
        await self.redis.hset(self.keys.batch_key(batch_id), mapping={k: json.dumps(v) for k, v in fields.items()})

    async def transition(self, batch_id: str, allowed: tuple[str, ...], status: str, **fields: Any) -> bool:
        """Atomically move the batch to ``status`` (setting ``fields``) if its status is one
        of ``allowed``. Returns whether it moved."""
        extra = json.dumps({k: json.dumps(v) for k, v in fields.items()})
        moved = await self._transition(keys=[self.keys.batch_key(batch_id)],
                                       args=[json.dumps(list(allowed)), status, extra])
        if moved and status in FINAL_STATUSES:
            await self.redis.srem(self.keys.active_batches(), batch_id)
        return bool(moved)

    async def record(self, batch_id: str, custom_id: str, line: dict[str, Any], ok: bool) -> bool:
        """Record the result ``line`` of ``custom_id`` once, counting it as completed (``ok``)
        or failed. Returns False if it already had one (nothing changes)."""
        new = await self._record(keys=[self.keys.batch_results(batch_id), self.keys.batch_key(batch_id)],
                                 args=[custom_id, json.dumps(line), "completed" if ok else "failed"])
        return bool(new)

    async def done_ids(self, batch_id: str) -> set[str]:
        """The custom_ids of ``batch_id`` that have a result."""
        return {k.decode() for k in await self.redis.hkeys(self.keys.batch_results(batch_id))}

    async def results(self, batch_id: str) -> dict[str, dict[str, Any]]:
        """Every recorded result line of ``batch_id`` by custom_id."""
        raw = await self.redis.hgetall(self.keys.batch_results(batch_id))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    async def active_ids(self) -> list[str]:
        """The ids of batches not yet in a final status."""
        return [i.decode() for i in await self.redis.smembers(self.keys.active_batches())]


def _stored_file(raw: bytes) -> StoredFile:
    obj = json.loads(raw)
    owner = str(obj.pop("owner", ""))
    return StoredFile(obj=obj, owner=owner)


#: Name of the arq function that runs a batch (``worker/batch_jobs.py``).
RUN_BATCH_JOB = "run_batch"


async def enqueue_run(store: BatchStore, batch_id: str) -> None:
    """Enqueue an arq job that drives ``batch_id`` forward. Each call enqueues a new job
    (a fresh job id); a job that finds another runner's lease on the batch returns at
    once, so extra jobs cost nothing (docs/operations.md, "Batches")."""
    from arq.connections import ArqRedis

    arq = ArqRedis(connection_pool=store.redis.connection_pool)
    await arq.enqueue_job(RUN_BATCH_JOB, batch_id, _job_id=f"{batch_id}:{time.time_ns()}",
                          _queue_name=store.keys.arq_queue())
