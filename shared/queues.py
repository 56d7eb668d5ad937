"""Queue inspection for operators (``inferq queues``): what sits on each model's request
streams, per priority class and tenant (``shared/fair_queue.py``), who holds it, and
which workers are alive.

``snapshot`` finds the models (by SCAN of ``{ns}:{*}:requests`` streams and
``{ns}:{*}:queues`` sets unless models are named) and reads, per stream of a model (its
base stream, and every (class, tenant) stream listed in ``{ns}:{{model}}:queues`` that
holds entries; empty ones are left out): XLEN, XINFO GROUPS (group ``workers``), XINFO CONSUMERS, the first pending
entries (XPENDING with a range) with their delivery counts, and every heartbeat key
``{ns}:worker:*`` decoded as a ``WorkerStatus``, judged alive or not by
``shared.liveness.is_alive``, and the age of the oldest waiting entry (the first entry
after the group's last delivered id, XRANGE; its id's milliseconds are when it was
XADDed, on Redis's clock). A consumer without a live heartbeat is
reported dead: its pending entries wait for a worker's reaper (XPENDING + XCLAIM) or a
gateway's failover.

Read-only: nothing here writes to Redis. The reads are not one atomic view (Redis
moves on between commands), which is fine for an operator's snapshot. ``classes``
sums the streams per (model, class): waiting, pending, oldest wait, tenants.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from redis.exceptions import ResponseError
from rich.console import Console
from rich.table import Table

from shared import liveness, protocol
from shared.fair_queue import PRIORITY_CLASSES, stream_class_tenant
from shared.keys import CONSUMER_GROUP, Keys
from shared.protocol import WorkerStatus
from shared.redis_connect import AsyncClient, connect, mget
from shared.streams import MAX_SCANNED_PENDING, PendingEntry, as_text, num_waiting, pending_entries

#: Pending entries shown per stream (``streams.MAX_SCANNED_PENDING`` are read to count
#: redeliveries).
PENDING_SHOW_LIMIT = 20


class ConsumerInfo(msgspec.Struct, kw_only=True):
    """One consumer of the group. ``alive``: it has a live heartbeat key."""

    name: str
    num_pending: int
    idle_ms: int
    alive: bool


class StreamInfo(msgspec.Struct, kw_only=True):
    """One request stream of a model (one priority class and tenant) and its ``workers``
    consumer group.

    ``num_waiting`` = entries not yet delivered to a worker: XLEN - pending, exact because
    workers XDEL every entry they XACK (``streams.num_waiting``, as the gateway's admission).
    ``lag`` and ``entries_read`` come from Redis >= 7 only (None on 6.2).
    ``num_redelivered`` counts pending entries delivered more than once among the
    ``num_pending_scanned`` first ones; ``pending`` lists the first few of them.
    ``oldest_waiting_age_s``: now minus the XADD time of the oldest entry no worker has
    taken (None: none waits); an entry put back by failover counts from its new XADD.
    ``virtual_tokens``: the tenant's virtual token counter in its class (None: not in
    the class's active set, i.e. nothing of it waited at the last pull or enqueue).
    """

    model: str
    stream: str
    priority_class: str = "default"
    tenant: str = "anonymous"
    virtual_tokens: float | None = None
    length: int
    has_group: bool
    num_pending: int = 0
    num_waiting: int = 0
    last_delivered_id: str = ""
    entries_read: int | None = None
    lag: int | None = None
    consumers: list[ConsumerInfo] = msgspec.field(default_factory=list)
    dead_consumers: list[str] = msgspec.field(default_factory=list)
    num_pending_scanned: int = 0
    num_redelivered: int = 0
    oldest_waiting_age_s: float | None = None
    pending: list[PendingEntry] = msgspec.field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class ClassInfo:
    """One priority class of a model, summed over its tenants' streams. ``num_tenants``:
    streams of the class holding entries (waiting or running); ``oldest_waiting_age_s``:
    the longest wait among them (None: none waits). A dataclass, not a msgspec struct like
    its neighbours: the gateway's ``/stats`` answers it as is, and FastAPI documents
    dataclasses in its OpenAPI schema."""

    model: str
    priority_class: str
    num_waiting: int
    num_pending: int
    oldest_waiting_age_s: float | None
    num_tenants: int


class WorkerInfo(msgspec.Struct, kw_only=True):
    """A worker whose heartbeat key exists. ``heartbeat_age_s``: now - its last update.
    ``alive``: ``shared.liveness.is_alive`` (False: its engine is stalled)."""

    key: str
    heartbeat_age_s: float
    status: WorkerStatus | None  # None: the key's value did not decode
    error: str = ""
    alive: bool = True


class QueueSnapshot(msgspec.Struct, kw_only=True):
    """Everything ``inferq queues`` shows. ``taken_unix_s``: wall-clock time of the snapshot."""

    namespace: str
    taken_unix_s: float
    streams: list[StreamInfo]
    workers: list[WorkerInfo]
    classes: list[ClassInfo] = msgspec.field(default_factory=list)


async def _model_names(client: AsyncClient, keys: Keys) -> list[str]:
    base_prefix, base_suffix = keys.requests_stream("\0").split("\0")
    set_prefix, set_suffix = keys.model_streams("\0").split("\0")
    names = {as_text(k)[len(base_prefix):-len(base_suffix)]
             async for k in client.scan_iter(match=keys.requests_stream("*"), _type="stream")}
    names |= {as_text(k)[len(set_prefix):-len(set_suffix)]
              async for k in client.scan_iter(match=keys.model_streams_pattern(), _type="set")}
    return sorted(names)


async def _model_streams(client: AsyncClient, keys: Keys, model: str) -> list[str]:
    """The base stream, then the model's other streams that hold entries, sorted."""
    base = keys.requests_stream(model)
    others = sorted({as_text(m) for m in await client.smembers(keys.model_streams(model))} - {base})
    if others:
        async with client.pipeline(transaction=False) as pipe:
            for name in others:
                pipe.xlen(name)
            lengths = await pipe.execute()
        others = [name for name, length in zip(others, lengths, strict=True) if int(length)]
    return [base, *others]


def _classes(streams: list[StreamInfo]) -> list[ClassInfo]:
    out: dict[tuple[str, str], ClassInfo] = {}
    for s in streams:
        c = out.setdefault((s.model, s.priority_class), ClassInfo(
            model=s.model, priority_class=s.priority_class, num_waiting=0, num_pending=0,
            oldest_waiting_age_s=None, num_tenants=0))
        c.num_waiting += s.num_waiting
        c.num_pending += s.num_pending
        c.num_tenants += s.length > 0
        if s.oldest_waiting_age_s is not None:
            c.oldest_waiting_age_s = max(c.oldest_waiting_age_s or 0.0, s.oldest_waiting_age_s)
    rank = {name: i for i, name in enumerate(PRIORITY_CLASSES)}
    return sorted(out.values(), key=lambda c: (c.model, rank.get(c.priority_class, len(rank))))


async def _workers(client: AsyncClient, keys: Keys, now_unix_s: float) -> list[WorkerInfo]:
    names = sorted({as_text(k) async for k in client.scan_iter(match=keys.worker_pattern())})
    values = await mget(client, names)
    workers = []
    for key, value in zip(names, values):
        if value is None:  # expired between SCAN and MGET
            continue
        try:
            status = protocol.decode(value)
        except protocol.ProtocolError as exc:
            workers.append(WorkerInfo(key=key, heartbeat_age_s=0.0, status=None, error=str(exc)))
            continue
        if not isinstance(status, WorkerStatus):
            workers.append(WorkerInfo(key=key, heartbeat_age_s=0.0, status=None,
                                      error=f"holds a {type(status).__name__}"))
            continue
        workers.append(WorkerInfo(key=key, heartbeat_age_s=now_unix_s - status.updated_unix_s, status=status,
                                  alive=liveness.is_alive(value)))
    return workers


def _live_ids(workers: list[WorkerInfo], keys: Keys) -> set[str]:
    prefix = keys.worker_key("")
    ids = {w.key[len(prefix):] for w in workers}
    ids.update(w.status.worker_id for w in workers if w.status is not None)
    return ids


def entry_age_s(entry_id: str, now_unix_s: float) -> float:
    """Seconds since a stream entry was added: ``now_unix_s`` minus the milliseconds
    part of its id ``<ms>-<seq>`` (Redis's clock; never below 0 under clock skew)."""
    return max(0.0, now_unix_s - int(entry_id.split("-", 1)[0]) / 1000)


async def _oldest_waiting_age_s(client: AsyncClient, stream: str, after_id: str | None,
                                now_unix_s: float) -> float | None:
    # Entries after the group's last delivered id were never delivered (finished ones are
    # XDELed), so the first of them is the oldest waiting. No group: every entry waits.
    first = await client.xrange(stream, min="-" if after_id is None else f"({after_id}", max="+", count=1)
    return entry_age_s(as_text(first[0][0]), now_unix_s) if first else None


async def _stream(client: AsyncClient, keys: Keys, model: str, stream: str, live: set[str],
                  pending_limit: int, now_unix_s: float) -> StreamInfo:
    priority_class, tenant = stream_class_tenant(keys, model, stream)
    named: dict[str, Any] = {"model": model, "stream": stream, "priority_class": priority_class, "tenant": tenant}
    if priority_class in PRIORITY_CLASSES:
        score = await client.zscore(keys.active_streams(model, priority_class), stream)
        named["virtual_tokens"] = None if score is None else float(score)
    length = int(await client.xlen(stream))
    try:
        groups = await client.xinfo_groups(stream)
    except ResponseError:  # no such key (the stream went away since SCAN)
        groups = []
    group = next((g for g in groups if as_text(g["name"]) == CONSUMER_GROUP), None)
    if group is None:
        return StreamInfo(**named, length=length, has_group=False, num_waiting=length,
                          oldest_waiting_age_s=await _oldest_waiting_age_s(client, stream, None, now_unix_s))
    raw_consumers = await client.xinfo_consumers(stream, CONSUMER_GROUP)
    consumers = [ConsumerInfo(name=as_text(c["name"]), num_pending=int(c["pending"]), idle_ms=int(c["idle"]),
                              alive=as_text(c["name"]) in live) for c in raw_consumers]
    num_pending = int(group["pending"])
    pending = await pending_entries(client, stream, pending_limit) if num_pending else []
    lag, entries_read = group.get("lag"), group.get("entries-read")
    last_delivered_id = as_text(group["last-delivered-id"])
    waiting = num_waiting(length, num_pending)
    oldest_s = await _oldest_waiting_age_s(client, stream, last_delivered_id, now_unix_s) if waiting else None
    return StreamInfo(
        **named, length=length, has_group=True, num_pending=num_pending,
        num_waiting=waiting, last_delivered_id=last_delivered_id, oldest_waiting_age_s=oldest_s,
        entries_read=None if entries_read is None else int(entries_read), lag=None if lag is None else int(lag),
        consumers=consumers, dead_consumers=[c.name for c in consumers if not c.alive],
        num_pending_scanned=len(pending), num_redelivered=sum(p.redelivered for p in pending),
        pending=pending[:PENDING_SHOW_LIMIT])


async def snapshot(client: AsyncClient, keys: Keys, models: list[str] | None = None, *,
                   pending_limit: int = MAX_SCANNED_PENDING, now_unix_s: float | None = None) -> QueueSnapshot:
    """Read the state of the request streams and the workers.

    ``models``: the models whose streams to read (a missing base stream reads as empty);
    None finds every model by SCAN (module docstring). ``pending_limit``: pending
    entries fetched per stream to count redeliveries. ``now_unix_s`` (default: now)
    is the clock heartbeat ages are measured against.

    Raises:
        redis.exceptions.ConnectionError: Redis unreachable.
    """
    now = time.time() if now_unix_s is None else now_unix_s
    workers = await _workers(client, keys, now)
    live = _live_ids(workers, keys)
    streams = []
    for model in models if models is not None else await _model_names(client, keys):
        for name in await _model_streams(client, keys, model):
            streams.append(await _stream(client, keys, model, name, live, pending_limit, now))
    return QueueSnapshot(namespace=keys.namespace, taken_unix_s=now, streams=streams, workers=workers,
                         classes=_classes(streams))


def to_json(snap: QueueSnapshot) -> str:
    """The snapshot as indented JSON (field names as in the structs)."""
    return msgspec.json.format(msgspec.json.encode(snap).decode(), indent=2)


def render(snap: QueueSnapshot) -> list[Table]:
    """Rich tables: classes, streams (per class and tenant), consumers, first pending
    entries, workers."""
    classes = Table(title="priority classes (summed over tenants)")
    for col in ("model", "class", "waiting", "pending", "oldest wait s", "tenants"):
        classes.add_column(col, justify="left" if col in ("model", "class") else "right")
    for c in snap.classes:
        oldest = "-" if c.oldest_waiting_age_s is None else f"{c.oldest_waiting_age_s:.1f}"
        classes.add_row(c.model, c.priority_class, str(c.num_waiting), str(c.num_pending), oldest,
                        str(c.num_tenants))
    streams = Table(title=f"request streams ({snap.namespace})")
    for col in ("model", "class", "tenant", "length", "waiting", "oldest wait s", "pending", "redelivered",
                "virtual tokens", "consumers", "dead", "last delivered"):
        streams.add_column(col, justify="left" if col in ("model", "class", "tenant", "last delivered") else "right")
    consumers = Table(title="consumers (group workers)")
    for col in ("model", "consumer", "pending", "idle s", "heartbeat"):
        consumers.add_column(col, justify="right" if col in ("pending", "idle s") else "left")
    pending = Table(title=f"first pending entries (up to {PENDING_SHOW_LIMIT} per stream)")
    for col in ("model", "entry", "consumer", "idle s", "deliveries"):
        pending.add_column(col, justify="right" if col in ("idle s", "deliveries") else "left")
    for s in snap.streams:
        redelivered = f"{s.num_redelivered}" + ("+" if s.num_pending_scanned < s.num_pending else "")
        dead = f"[red]{len(s.dead_consumers)}[/red]" if any(
            c.num_pending for c in s.consumers if not c.alive) else str(len(s.dead_consumers))
        oldest = "-" if s.oldest_waiting_age_s is None else f"{s.oldest_waiting_age_s:.1f}"
        vtc = "-" if s.virtual_tokens is None else f"{s.virtual_tokens:.0f}"
        streams.add_row(s.model, s.priority_class, s.tenant, str(s.length), str(s.num_waiting), oldest,
                        str(s.num_pending), redelivered, vtc, str(len(s.consumers)), dead, s.last_delivered_id or ("-" if s.has_group else "no group"))
        for c in s.consumers:
            state = "alive" if c.alive else ("[red]dead[/red]" if c.num_pending else "gone")
            consumers.add_row(s.model, c.name, str(c.num_pending), f"{c.idle_ms / 1000:.1f}", state)
        for p in s.pending:
            pending.add_row(s.model, p.entry_id, p.consumer, f"{p.idle_ms / 1000:.1f}", str(p.num_deliveries))
    workers = Table(title="live workers (heartbeat keys)")
    for col in ("worker", "model", "backend", "state", "running", "waiting", "kv usage", "heartbeat age s", "pid"):
        workers.add_column(col, justify="left" if col in ("worker", "model", "backend") else "right")
    for w in snap.workers:
        st = w.status
        if st is None:
            workers.add_row(w.key, "?", f"[red]{w.error}[/red]", "alive", "", "", "", "", "")
            continue
        state = "alive" if w.alive else "[red]stalled[/red]"
        workers.add_row(st.worker_id, st.model, st.backend, state, str(st.num_running), str(st.num_waiting),
                        f"{st.kv_usage:.1%}", f"{w.heartbeat_age_s:.1f}", str(st.pid))
    return [classes, streams, consumers, pending, workers]


def queues_command(redis_url: str, namespace: str = "inferq", as_json: bool = False,
                   models: list[str] | None = None) -> None:
    """``inferq queues``: print a snapshot as tables (or JSON with ``as_json``).

    Raises:
        ValueError: empty ``redis_url``.
        redis.exceptions.ConnectionError: Redis unreachable.
    """
    if not redis_url:
        raise ValueError("inferq queues needs --redis-url (or INFERQ_REDIS_URL)")

    async def take() -> QueueSnapshot:
        client = connect(redis_url)
        try:
            return await snapshot(client, Keys(namespace), models)
        finally:
            await client.aclose()

    snap = asyncio.run(take())
    if as_json:
        print(to_json(snap))
        return
    console = Console()
    for table in render(snap):
        console.print(table)
