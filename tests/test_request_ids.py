"""Client request ids (``X-Request-Id``, gateway/request_ids.py): reserved while a request
runs (409 for a second one of the same tenant), free again as soon as it ends, whether
it finished, failed on the worker or lost its client; each tenant's ids are its own; on
the wire the id carries a random suffix (fixtures: gateway_harness.py)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from shared import protocol
from shared.protocol import ErrorMessage, GenerateRequest
from shared.settings import GatewaySettings
from tests.gateway_harness import ANSWER, MODEL, FakeWorker, answer_tokens

pytestmark = pytest.mark.timeout(60)
BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 8}


@pytest.fixture
def gateway_settings() -> GatewaySettings:
    """The id key's TTL (the request timeout) far above any wait here: only the release
    at the request's end can free an id within a test."""
    return GatewaySettings(request_timeout_s=300.0)


async def post(harness, request_id: str, key: str | None = None, **extra) -> httpx.Response:
    auth = {} if key is None else {"Authorization": f"Bearer {key}"}
    return await harness.http.post("/v1/completions", headers={"X-Request-Id": request_id, **auth},
                                   json={**BODY, **extra})


async def wait_for_requests(worker: FakeWorker, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(worker.requests) < n:
        assert time.monotonic() < deadline, worker.requests
        await asyncio.sleep(0.01)


async def test_id_is_409_while_in_flight_and_free_once_finished(harness) -> None:
    release = asyncio.Event()

    async def held(req: GenerateRequest, w: FakeWorker) -> None:
        await release.wait()
        await answer_tokens(req, w)

    harness.worker.behavior = held
    first = asyncio.create_task(post(harness, "retry-1"))
    await wait_for_requests(harness.worker, 1)
    again = await post(harness, "retry-1")
    assert again.status_code == 409 and again.json()["error"]["code"] == "duplicate_request"
    assert again.json()["error"]["param"] == "X-Request-Id"
    release.set()
    done = await first
    assert done.status_code == 200 and done.json()["id"] == "cmpl-retry-1"
    assert done.headers["x-request-id"] == "cmpl-retry-1"
    # Reusable at once; each run has its own wire id (the client's id + "#" + random hex).
    reused = await post(harness, "retry-1")
    assert reused.status_code == 200 and reused.json()["choices"][0]["text"] == ANSWER
    wire_ids = [r.request_id for r in harness.worker.requests]
    assert len(wire_ids) == 2 and len(set(wire_ids)) == 2
    assert all(w.startswith("cmpl-retry-1#") for w in wire_ids)
    assert await harness.worker.client.exists(harness.keys.request_id_key(MODEL, "anonymous", "cmpl-retry-1")) == 0


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(api_keys=("k1", "k2"), request_timeout_s=300.0)])
async def test_ids_are_per_tenant(harness) -> None:
    """k2 may use an id k1 has in flight (no 409 telling k2 it exists, nothing k2 could
    hold against k1), and each tenant still gets 409 for its own id in flight."""
    release = asyncio.Event()
    answers: list[asyncio.Task] = []

    async def answer_on_release(req: GenerateRequest, w: FakeWorker) -> None:
        await release.wait()
        await answer_tokens(req, w)

    async def held(req: GenerateRequest, w: FakeWorker) -> None:  # the fake worker pulls on meanwhile
        answers.append(asyncio.create_task(answer_on_release(req, w)))

    harness.worker.behavior = held
    first_k1 = asyncio.create_task(post(harness, "shared-1", "k1"))
    await wait_for_requests(harness.worker, 1)
    first_k2 = asyncio.create_task(post(harness, "shared-1", "k2"))
    await wait_for_requests(harness.worker, 2)  # enqueued: not refused
    for key in ("k1", "k2"):
        again = await post(harness, "shared-1", key)
        assert again.status_code == 409 and again.json()["error"]["code"] == "duplicate_request", (key, again.text)
    tenants = harness.app.state.inferq.tenants
    id_keys = [harness.keys.request_id_key(MODEL, tenants.key_tenant(k), "cmpl-shared-1") for k in ("k1", "k2")]
    assert await harness.worker.client.exists(*id_keys) == 2
    release.set()
    for task in (first_k1, first_k2):
        done = await task
        assert done.status_code == 200 and done.json()["id"] == "cmpl-shared-1", done.text


async def test_id_is_free_after_the_worker_rejects_the_request(harness) -> None:
    async def reject(req: GenerateRequest, w: FakeWorker) -> None:
        error = ErrorMessage(request_id=req.request_id, attempt=req.attempt, worker_id="w1", status=400,
                             message="the engine refused it")
        await w.client.publish(req.reply_channel, protocol.encode(error))

    harness.worker.behavior = reject
    failed = await post(harness, "retry-2")
    assert failed.status_code == 400
    harness.worker.behavior = answer_tokens
    retried = await post(harness, "retry-2")
    assert retried.status_code == 200 and retried.json()["choices"][0]["text"] == ANSWER


async def test_id_is_free_after_the_client_leaves(harness) -> None:
    async def never_answers(req: GenerateRequest, w: FakeWorker) -> None:
        return None

    harness.worker.behavior = never_answers
    async with harness.http.stream("POST", "/v1/completions", headers={"X-Request-Id": "retry-3"},
                                   json={**BODY, "stream": True}) as resp:
        assert resp.status_code == 200
        await wait_for_requests(harness.worker, 1)
    # The gateway notices the disconnect, closes the request and frees the id.
    harness.worker.behavior = answer_tokens
    deadline = time.monotonic() + 10
    while (retried := await post(harness, "retry-3")).status_code == 409:
        assert time.monotonic() < deadline, "the id stayed reserved after the client left"
        await asyncio.sleep(0.1)
    assert retried.status_code == 200 and retried.json()["choices"][0]["text"] == ANSWER
