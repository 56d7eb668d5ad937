"""``shared.queues`` against a real redis-server: a hand-made stream, consumer group,
pending entries (one redelivered) and heartbeat keys."""

from __future__ import annotations

import json

import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table
from rich.text import Text

from shared import protocol
from shared.keys import CONSUMER_GROUP, STREAM_FIELD, Keys
from shared.protocol import WorkerStatus
from shared.queues import queues_command, render, snapshot, to_json

NOW = 1_000_000.0
KEYS = Keys("tq")


def status(worker_id: str, model: str, updated_unix_s: float, running: int = 0) -> bytes:
    return protocol.encode(WorkerStatus(
        worker_id=worker_id, model=model, backend="sim", num_running=running, num_waiting=0,
        kv_usage=running / 4, num_free_blocks=4 - running, block_size=16, max_num_seqs=4,
        updated_unix_s=updated_unix_s, started_unix_s=updated_unix_s - 10, pid=123))


async def populate(client: aioredis.Redis) -> None:
    """Stream m1: 6 entries; w-live holds 2 (one delivered twice), w-dead holds 1, 3 wait.
    Stream m2 has no group. Heartbeats: w-live (1.5 s old), w-idle (not a consumer),
    and one undecodable key."""
    s1 = KEYS.requests_stream("m1")
    await client.xgroup_create(s1, CONSUMER_GROUP, id="0", mkstream=True)
    for i in range(6):
        await client.xadd(s1, {STREAM_FIELD: b"x%d" % i})
    await client.xreadgroup(CONSUMER_GROUP, "w-live", {s1: ">"}, count=2)
    await client.xreadgroup(CONSUMER_GROUP, "w-dead", {s1: ">"}, count=1)
    first = (await client.xpending_range(s1, CONSUMER_GROUP, "-", "+", 1))[0]["message_id"]
    await client.xclaim(s1, CONSUMER_GROUP, "w-live", 0, [first])  # a second delivery
    await client.xadd(KEYS.requests_stream("m2"), {STREAM_FIELD: b"y"})
    await client.set(KEYS.worker_key("w-live"), status("w-live", "m1", NOW - 1.5, running=2))
    await client.set(KEYS.worker_key("w-idle"), status("w-idle", "m1", NOW - 0.25))
    await client.set(KEYS.worker_key("w-bad"), b"not msgpack \xc1")
    await client.set(Keys("other").worker_key("w-dead"), status("w-dead", "m1", NOW))  # other namespace


async def test_snapshot_numbers(redis_server) -> None:
    client = aioredis.from_url(redis_server.url)
    try:
        await populate(client)
        snap = await snapshot(client, KEYS, None, now_unix_s=NOW)
    finally:
        await client.aclose()
    assert [s.model for s in snap.streams] == ["m1", "m2"]
    m1, m2 = snap.streams
    assert (m1.length, m1.num_pending, m1.num_waiting, m1.has_group) == (6, 3, 3, True)
    assert m1.last_delivered_id and m1.last_delivered_id.count("-") == 1
    assert {c.name: (c.num_pending, c.alive) for c in m1.consumers} == {"w-live": (2, True), "w-dead": (1, False)}
    assert m1.dead_consumers == ["w-dead"]
    assert m1.num_pending_scanned == 3 and m1.num_redelivered == 1
    deliveries = {p.entry_id: (p.consumer, p.num_deliveries) for p in m1.pending}
    assert sorted(deliveries.values()) == [("w-dead", 1), ("w-live", 1), ("w-live", 2)]
    assert (m2.length, m2.has_group, m2.num_waiting, m2.consumers) == (1, False, 1, [])
    by_key = {w.key: w for w in snap.workers}
    assert set(by_key) == {"tq:worker:w-live", "tq:worker:w-idle", "tq:worker:w-bad"}
    live = by_key["tq:worker:w-live"]
    assert live.status is not None and live.status.num_running == 2 and live.status.kv_usage == 0.5
    assert abs(live.heartbeat_age_s - 1.5) < 1e-9
    assert by_key["tq:worker:w-bad"].status is None and by_key["tq:worker:w-bad"].error


async def test_named_models_missing_stream_and_json_render(redis_server) -> None:
    client = aioredis.from_url(redis_server.url)
    try:
        await populate(client)
        snap = await snapshot(client, KEYS, ["m1", "absent"], pending_limit=1, now_unix_s=NOW)
    finally:
        await client.aclose()
    m1, absent = snap.streams
    assert m1.num_pending_scanned == 1 and len(m1.pending) == 1
    assert (absent.model, absent.length, absent.has_group) == ("absent", 0, False)
    decoded = json.loads(to_json(snap))
    assert decoded["streams"][0]["num_pending"] == 3 and decoded["namespace"] == "tq"
    tables = render(snap)
    classes, streams, consumers, pending, workers = (rows(t) for t in tables)
    assert [(r["model"], r["class"], r["waiting"], r["pending"]) for r in classes] == [
        ("absent", "default", "0", "0"), ("m1", "default", str(m1.num_waiting), "3")]
    assert [(r["model"], r["pending"], r["redelivered"], r["consumers"], r["dead"]) for r in streams] == [
        ("m1", "3", "1+", "2", "1"), ("absent", "0", "0", "0", "0")]  # 1 of 3 pending scanned: "1+"
    # Each consumer's own row: the one without a heartbeat holding an entry is dead.
    assert {r["consumer"]: (r["model"], r["pending"], r["heartbeat"]) for r in consumers} == {
        "w-live": ("m1", "2", "alive"), "w-dead": ("m1", "1", "dead")}
    assert [(r["model"], r["deliveries"]) for r in pending] == [("m1", "2")]  # the oldest: claimed twice
    by_worker = {r["worker"]: r for r in workers}
    assert set(by_worker) == {"w-live", "w-idle", "tq:worker:w-bad"}
    assert (by_worker["w-live"]["running"], by_worker["w-live"]["kv usage"]) == ("2", "50.0%")
    assert (by_worker["w-idle"]["running"], by_worker["tq:worker:w-bad"]["model"]) == ("0", "?")
    console = Console(record=True, width=200)
    for table in tables:
        console.print(table)
    printed = [[cell.strip() for cell in line.strip("│").split("│")] for line in console.export_text().splitlines()]
    assert [(r[1], r[2], r[4]) for r in printed if r[1:2] in (["w-dead"], ["w-live"])] == [
        ("w-dead", "1", "dead"), ("w-live", "2", "alive")]  # printed columns 1, 2, 4: consumer, pending, heartbeat


def rows(table: Table) -> list[dict[str, str]]:
    """A rich table's rows as {column header: cell text without markup}."""
    columns = [(str(c.header), [Text.from_markup(str(cell)).plain for cell in c.cells]) for c in table.columns]
    return [{header: cells[i] for header, cells in columns} for i in range(table.row_count)]


def test_queues_command_prints_json(redis_server, capsys) -> None:
    import asyncio

    async def setup() -> None:
        client = aioredis.from_url(redis_server.url)
        try:
            await populate(client)
        finally:
            await client.aclose()

    asyncio.run(setup())
    queues_command(redis_server.url, "tq", as_json=True)
    out = json.loads(capsys.readouterr().out)
    assert [s["model"] for s in out["streams"]] == ["m1", "m2"]
    queues_command(redis_server.url, "tq", as_json=False)
    assert "request streams (tq)" in capsys.readouterr().out


def test_cli_queues_with_sim_worker(redis_server, tmp_path) -> None:
    """``inferq worker --backend sim`` serves through a real gateway (the echo of the
    prompt comes back), and ``inferq queues --json`` in another process shows that
    worker and the stream's delivered entry."""
    import subprocess
    import sys

    import httpx

    from tests.processes import ROOT, free_port, start, stop, wait_for_gateway, wait_for_workers

    log = tmp_path / "procs.log"
    worker = start("worker", redis_server.url, "--backend", "sim", "--sim-step-time-ms", "1",
                   "--worker-id", "sim-1", log_path=log)
    port = free_port()
    gateway = start("gateway", redis_server.url, "--port", str(port), log_path=log)
    try:
        wait_for_workers(redis_server.url, 1, [worker])
        wait_for_gateway(f"http://127.0.0.1:{port}", gateway)
        prompt = [11, 12, 13]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30, json={
            "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 7, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        assert body["choices"][0]["finish_reason"] == "length"
        out = subprocess.run([sys.executable, "-m", "shared.cli", "queues", "--redis-url", redis_server.url, "--json"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
        snap = json.loads(out)
        (stream,) = [s for s in snap["streams"] if s["model"] == "SmolLM2-135M-Instruct"]
        # Acked entries are deleted: the stream is empty, the group has read one entry.
        assert (stream["has_group"], stream["length"], stream["num_pending"]) == (True, 0, 0)
        assert stream["entries_read"] in (1, None)  # None before Redis 7
        (w,) = [w for w in snap["workers"] if w["status"]["worker_id"] == "sim-1"]
        assert (w["status"]["backend"], w["status"]["model"], w["status"]["pid"]) == (
            "sim", "SmolLM2-135M-Instruct", worker.pid)
    finally:
        # uvicorn re-raises the SIGTERM it handled after its graceful shutdown: -15.
        codes = stop(gateway), stop(worker)
        assert codes[0] in (0, -15) and codes[1] == 0, log.read_text()[-3000:]
