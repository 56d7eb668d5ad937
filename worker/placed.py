"""The worker's side of placement (docs/architecture.md, "Placement"): its KV index in
Redis, which other workers' placed streams it may take entries from, and the cleanup
after a dead worker.

- ``add_kv_events``: a step's KV events (``worker/backends/kv_events.py``) as commands on
  the worker's KV index (``Keys.kv_index``), queued in the pipeline that publishes the
  step's tokens.
- ``steal_sources``: from the model's streams and the live workers (the reaper's scan,
  every ``REAP_INTERVAL_S``), the other workers' placed streams and how long an entry must
  have waited in each before this worker takes it: ``steal_after_ms`` on a live worker's
  (0: never), at once on a dead one's (``FairQueue.pull``'s ``steal``).
- ``forget_dead_workers``: one atomic script per dead worker drops its KV index and its
  empty placed streams (SREM from the model's set, DEL) and its fields of the load and
  held-requests hashes, then, once none is left, its fields of the placed-tokens and
  placed-requests hashes and its doorbell. A placed stream that still holds
  entries stays: live workers take its undelivered entries (``steal_sources``) and the
  reaper claims its pending ones, and a later pass deletes it.
"""

from __future__ import annotations

from collections.abc import Iterable

from redis.asyncio.client import Pipeline
from redis.exceptions import NoScriptError

from shared.fair_queue import PRIORITY_CLASSES, StealFrom, placed_owner
from shared.keys import Keys
from shared.redis_connect import AsyncClient
from worker.backends.kv_events import KVEvents

# KEYS: the model's stream set, the placed-tokens hash, the worker's KV index, its
#       doorbell, the load hash, the held-requests hash, the placed-requests hash, then
#       its placed streams (one per class).
# ARGV: the worker's id.
# Returns how many of its placed streams still hold entries.
_FORGET = """
local left = 0
for i = 8, #KEYS do
  if redis.call('XLEN', KEYS[i]) == 0 then
    redis.call('SREM', KEYS[1], KEYS[i])
    redis.call('DEL', KEYS[i])
  else
    left = left + 1
  end
end
redis.call('DEL', KEYS[3])
redis.call('HDEL', KEYS[5], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
if left == 0 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[7], ARGV[1])
  redis.call('DEL', KEYS[4])
end
return left
"""


def add_kv_events(pipe: Pipeline, key: str, events: KVEvents) -> int:
    """Queue ``events`` on the KV index ``key`` in ``pipe``: DEL when cleared, then SADD
    the stored hashes, SREM the removed ones. Returns how many commands it queued (their
    replies come first in the pipeline's results when queued first)."""
    num = 0
    if events.cleared:
        pipe.delete(key)
        num += 1
    if events.stored:
        pipe.sadd(key, *events.stored)
        num += 1
    if events.removed:
        pipe.srem(key, *events.removed)
        num += 1
    return num


def placed_owners(keys: Keys, model: str, streams: Iterable[str]) -> set[str]:
    """The workers that own a placed stream among ``streams`` (``placed_owner``)."""
    return {owner[0] for s in streams if (owner := placed_owner(keys, model, s)) is not None}


def steal_sources(keys: Keys, model: str, streams: Iterable[str], worker_id: str, live: set[str],
                  steal_after_ms: int) -> list[StealFrom]:
    """The placed streams among ``streams`` that worker ``worker_id`` may take entries
    from: another live worker's after ``steal_after_ms`` (none when 0), a dead one's
    (not in ``live``) at once. Ordered by class, highest first, then by stream name."""
    out = []
    for stream in sorted(streams):
        owner = placed_owner(keys, model, stream)
        if owner is None or owner[0] == worker_id or owner[1] not in PRIORITY_CLASSES:
            continue
        if owner[0] not in live:
            out.append(StealFrom(owner[0], owner[1], 0))
        elif steal_after_ms > 0:
            out.append(StealFrom(owner[0], owner[1], steal_after_ms))
    return sorted(out, key=lambda s: PRIORITY_CLASSES.index(s.priority_class))


async def forget_dead_workers(client: AsyncClient, keys: Keys, model: str, worker_ids: Iterable[str]) -> None:
    """Run the cleanup script (module docstring) for each of ``worker_ids``, which must
    be dead, in one pipeline.

    Raises:
        redis.exceptions.RedisError, OSError: Redis unreachable.
    """
    ids = sorted(set(worker_ids))
    if not ids:
        return
    script = client.register_script(_FORGET)
    # EVALSHA, with one SCRIPT LOAD and a second try when Redis does not hold the script
    # (a cluster pipeline, unlike a plain one, does not load the scripts it runs).
    for attempt in range(2):
        async with client.pipeline(transaction=False) as pipe:
            for wid in ids:
                wkeys = [keys.model_streams(model), keys.placed_tokens(model), keys.kv_index(model, wid),
                         keys.worker_doorbell(model, wid), keys.worker_load(model), keys.worker_held(model),
                         keys.placed_requests(model),
                         *(keys.placed_stream(model, wid, c) for c in PRIORITY_CLASSES)]
                pipe.evalsha(script.sha, len(wkeys), *wkeys, wid)
            replies = await pipe.execute(raise_on_error=False)
        if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
            await client.script_load(_FORGET)
            continue
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return
