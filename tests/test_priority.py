"""Priority classes at the gateway (gateway/priority.py): the header and vLLM's body
field, their mapping onto the class a request is queued in, and 400s for bad values.
The gateway under uvicorn with the fake worker (fixtures: gateway_harness.py), which
pulls from every class and tenant stream as a worker does."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from gateway.metrics import MAX_TENANT_LABELS, OTHER_TENANT, GatewayMetrics
from gateway.priority import class_of_priority
from tests.gateway_harness import MODEL

pytestmark = pytest.mark.timeout(60)

KEY_B = {"Authorization": "Bearer key-b"}


def completion(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **fields}


def test_the_integer_priority_maps_onto_three_classes() -> None:
    assert [class_of_priority(p) for p in (-5, -1, 0, 1, 7)] == [
        "interactive", "interactive", "default", "batch", "batch"]


async def test_requests_are_queued_in_their_class_and_tenant(harness) -> None:
    cases = [({}, {}, 1), ({"priority": -1}, {}, 0), ({"priority": 3}, {}, 2),
             ({}, {"X-Priority": "Interactive"}, 0),
             ({"priority": -1}, {"X-Priority": "batch"}, 2)]  # the header wins: batch lines stay batch
    for body, headers, rank in cases:
        r = await harness.http.post("/v1/completions", json=completion(**body),
                                    headers={**headers, "Authorization": "Bearer key-a"})
        assert r.status_code == 200, r.text
        assert harness.worker.requests[-1].priority == rank, (body, headers)
    probe = aioredis.from_url(harness.redis.url)
    try:
        streams = {m.decode() for m in await probe.smembers(harness.keys.model_streams(MODEL))}
    finally:
        await probe.aclose()
    tenant = harness.app.state.inferq.tenants.key_tenant("key-a")
    assert {harness.keys.class_stream(MODEL, c, tenant) for c in ("interactive", "default", "batch")} <= streams


@pytest.mark.parametrize(("body", "headers", "param"), [
    ({}, {"X-Priority": "urgent"}, "X-Priority"),
    ({"priority": "high"}, {}, "priority"),
    ({"priority": 1.5}, {}, "priority"),
])
async def test_a_bad_priority_is_a_400(harness, body, headers, param) -> None:
    before = len(harness.worker.requests)
    r = await harness.http.post("/v1/completions", json=completion(**body), headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert len(harness.worker.requests) == before  # nothing queued


async def test_admissions_are_counted_per_class_and_tenant(harness) -> None:
    for headers in ({"X-Priority": "batch"}, {"X-Priority": "batch"}, {}):
        r = await harness.http.post("/v1/completions", json=completion(), headers={**headers, **KEY_B})
        assert r.status_code == 200, r.text
    r = await harness.http.post("/v1/completions", json=completion(max_tokens=10**6), headers=KEY_B)
    assert r.status_code == 400  # refused before its class was known: not counted per class
    text = harness.metrics()
    tenant = harness.app.state.inferq.tenants.key_tenant("key-b")
    assert f'inferq:class_admitted_total{{model_name="{MODEL}",priority_class="batch",tenant="{tenant}"}} 2.0' in text
    assert f'inferq:class_admitted_total{{model_name="{MODEL}",priority_class="default",tenant="{tenant}"}} 1.0' in text


def test_tenant_series_are_capped() -> None:
    metrics = GatewayMetrics("m")
    assert [metrics.tenant_label(f"t{i}") for i in range(MAX_TENANT_LABELS + 2)][-3:] == [
        f"t{MAX_TENANT_LABELS - 1}", OTHER_TENANT, OTHER_TENANT]
    by_tenant = {("batch", f"t{i}"): (i + 1, float(i)) for i in range(MAX_TENANT_LABELS + 5)}
    metrics.set_classes({"interactive": (0, 0.0), "default": (0, 0.0), "batch": (325, 24.0)}, by_tenant)
    text = metrics.render().decode()
    series = [line for line in text.splitlines() if line.startswith("inferq:tenant_queue_depth{")]
    assert len(series) == MAX_TENANT_LABELS + 1
    assert 'inferq:tenant_queue_depth{model_name="m",priority_class="batch",tenant="other"} 15.0' in text  # 1+..+5
    assert 'inferq:tenant_oldest_wait_seconds{model_name="m",priority_class="batch",tenant="other"} 4.0' in text
