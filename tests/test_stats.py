"""``GET /stats`` (gateway/stats.py) end to end: the gateway under uvicorn, a real Redis and
the harness's FakeWorker (fixtures: gateway_harness.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from shared import protocol
from shared.batch_store import BatchStore
from shared.keys import CONSUMER_GROUP, HEARTBEAT_TTL_S, STREAM_FIELD
from shared.protocol import WorkerStatus
from shared.settings import GatewaySettings
from tests.gateway_harness import MODEL

pytestmark = pytest.mark.timeout(60)

OTHER = "other-model"  # a stream the FakeWorker does not consume


async def test_stats_lists_worker_streams_batches_and_gateway(harness, tmp_path) -> None:
    client = aioredis.from_url(harness.redis.url)
    try:
        stream = harness.keys.requests_stream(OTHER)
        await client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
        await client.xadd(stream, {STREAM_FIELD: b"x"})
        await asyncio.sleep(0.01)  # the next entries get a later millisecond
        oldest_waiting = (await client.xadd(stream, {STREAM_FIELD: b"x"})).decode()
        await client.xadd(stream, {STREAM_FIELD: b"x"})
        # The first entry taken by a consumer without a heartbeat: pending, not waiting.
        await client.xreadgroup(CONSUMER_GROUP, "gone", {stream: ">"}, count=1)
        # A worker whose engine step has run past its stall timeout.
        stalled = WorkerStatus(worker_id="w-stalled", model=OTHER, backend="sim", num_running=1, num_waiting=0,
                               kv_usage=0.5, num_free_blocks=7, block_size=16, max_num_seqs=4,
                               updated_unix_s=time.time(), started_unix_s=time.time(), pid=0, num_steps=3,
                               last_step_unix_s=time.time() - 9, step_running_s=9.0, engine_stall_timeout_s=5.0)
        await client.set(harness.keys.worker_key("w-stalled"), protocol.encode(stalled), ex=HEARTBEAT_TTL_S)
        store = BatchStore(client, harness.keys, str(tmp_path))
        for i, status in enumerate(("in_progress", "completed", "completed")):
            await store.create_batch({"id": f"batch_{i}", "created_at": int(time.time()), "status": status})
        await asyncio.sleep(0.02)  # the oldest waiting entry is now older than 0 ms
        r = await harness.http.get("/stats")
    finally:
        await client.aclose()
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["namespace"] == harness.keys.namespace
    workers = {w["worker_id"]: w for w in body["workers"]}
    worker = workers["w1"]  # the FakeWorker's heartbeat (gateway_harness.py)
    assert worker == {**worker, "worker_id": "w1", "model": MODEL, "backend": "fake", "alive": True,
                      "stalled": False, "num_running": 0, "num_waiting": 0, "kv_usage": 0.0,
                      "num_free_blocks": 100, "max_num_seqs": 8, "num_steps": 0, "last_step_age_s": None}
    assert 0 <= worker["heartbeat_age_s"] < 30
    w = workers["w-stalled"]
    assert (w["alive"], w["stalled"], w["num_running"], w["kv_usage"], w["num_steps"]) == (False, True, 1, 0.5, 3)
    assert w["last_step_age_s"] >= 9
    streams = {s["model"]: s for s in body["streams"]}
    other = streams[OTHER]
    assert (other["num_waiting"], other["num_pending"], other["num_dead_consumers"]) == (2, 1, 1)
    # The oldest waiting entry is the second one (the first is pending), aged from its id.
    assert other["oldest_waiting_age_s"] == pytest.approx(
        body["taken_unix_s"] - int(oldest_waiting.split("-")[0]) / 1000, abs=1e-6)
    assert other["oldest_waiting_age_s"] > 0
    if MODEL in streams:  # the FakeWorker's stream: nothing waits
        assert streams[MODEL]["num_waiting"] == 0 and streams[MODEL]["oldest_waiting_age_s"] is None
    assert body["batches"]["completed"] == 2 and body["batches"]["in_progress"] == 1
    assert body["batches"]["failed"] == 0
    gw = body["gateway"]
    assert gw["gateway_id"] == harness.app.state.gateway_id and gw["model"] == MODEL
    assert gw["num_in_flight"] == 0 and gw["uptime_s"] >= 0


async def test_stats_counts_a_request_in_flight(harness) -> None:
    """While the worker holds a request, the gateway's relay counts it in flight."""
    release = asyncio.Event()

    async def hold(req, w) -> None:
        await release.wait()
        await w.send(req, 0, [w.tok.eos_token_id], "stop")

    harness.worker.behavior = hold
    call = asyncio.create_task(harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}))
    try:
        deadline = time.monotonic() + 10
        while not harness.worker.requests:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        gw = (await harness.http.get("/stats")).json()["gateway"]
        assert gw["num_in_flight"] == 1
    finally:
        release.set()
        assert (await call).status_code == 200


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(api_keys=("k1",))])
async def test_stats_needs_the_api_key(harness) -> None:
    r = await harness.http.get("/stats")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert (await harness.http.get("/stats", headers={"Authorization": "Bearer k1"})).status_code == 200


async def test_stats_redis_down_is_503(harness) -> None:
    harness.redis.stop()
    try:
        r = await harness.http.get("/stats")
    finally:
        harness.redis.start()
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "redis_unavailable"
