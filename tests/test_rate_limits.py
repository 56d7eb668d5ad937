"""Rate limits per tenant (gateway/rate_limits.py) and the tenant of a request
(gateway/tenants.py): the gateway under uvicorn with a fake worker and a real Redis
(fixtures: gateway_harness.py), and two gateways on one Redis under a burst and
naming keys alike. A batch's lines under its owner's limits end to end:
tests/test_tenants.py."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import math
import re
import time
import uuid

import httpx
import pytest
import redis.asyncio as aioredis
from starlette.requests import Request

from gateway.app import create_app
from gateway.metrics import GatewayMetrics
from gateway.rate_limits import RateLimiter, format_reset
from gateway.tenants import ANONYMOUS, Tenants, tenant_id, tenant_of
from shared.keys import Keys
from shared.server_secret import BATCH_TENANT_HEADER, batch_credential
from shared.settings import GatewaySettings, ModelSettings, RedisSettings, SettingsError
from tests.gateway_harness import MODEL, FakeWorker, serving, sse_events

pytestmark = pytest.mark.timeout(60)

RATE_HEADERS = [f"x-ratelimit-{what}-{kind}" for kind in ("requests", "tokens")
                for what in ("limit", "remaining", "reset")]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def completion(prompt: str = "Hi", **fields: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, **fields}


def rate_headers(r: httpx.Response) -> dict[str, str]:
    return {h: r.headers[h] for h in RATE_HEADERS if h in r.headers}


def reset_s(text: str) -> float:
    """An ``x-ratelimit-reset-*`` value (``59.9s``, ``1m0s``, ``17ms``) in seconds."""
    match = re.fullmatch(r"(?:(\d+)m)?(\d+(?:\.\d+)?)(m?s)", text)
    assert match is not None, text
    minutes, number, unit = match.groups()
    return int(minutes or 0) * 60 + float(number) / (1000 if unit == "ms" else 1)


def check_429(r: httpx.Response, kind: str) -> int:
    """Assert an OpenAI rate-limit 429 on ``kind``; returns its Retry-After, s."""
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error", error
    assert f"on {kind} per min" in error["message"], error
    retry_after_s = int(r.headers["retry-after"])
    assert retry_after_s >= 1
    return retry_after_s


# -- tenants and settings ----------------------------------------------------------------

def make_request(headers: dict[str, str]) -> Request:
    return Request({"type": "http", "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})


def test_tenant_id_is_a_keyed_hash_never_the_plain_one() -> None:
    hashed = tenant_id(b"server secret", "sk-one")
    assert re.fullmatch(r"[0-9a-f]{16}", hashed) and "sk-one" not in hashed
    assert hashed == hmac.new(b"server secret", b"sk-one", "sha256").hexdigest()[:16]
    assert hashed != hashlib.sha256(b"sk-one").hexdigest()[:16]
    assert tenant_id(b"server secret", "sk-two") != hashed
    assert tenant_id(b"another secret", "sk-one") != hashed  # unguessable without the secret


def test_tenant_of_each_source() -> None:
    keyed = make_request(bearer("sk-one"))
    hashed = tenant_id(b"s", "sk-one")  # the caller's key tenant (gateway/tenants.py, identify)
    api_key = GatewaySettings()
    assert tenant_of(keyed, "alice", api_key, hashed) == hashed  # the default source ignores the user field
    assert tenant_of(make_request({}), None, api_key, ANONYMOUS) == ANONYMOUS
    user = GatewaySettings(tenant_source="user")
    assert tenant_of(keyed, "alice", user, hashed) == "user:alice"
    assert tenant_of(keyed, None, user, hashed) == tenant_of(keyed, "", user, hashed) == hashed
    assert tenant_of(keyed, "x" * 1000, user, hashed).startswith("user:sha256-")
    header = GatewaySettings(tenant_source="header:X-Team")
    assert tenant_of(make_request({**bearer("sk-one"), "x-team": "red"}), "alice", header, hashed) == "header:red"
    assert tenant_of(keyed, "alice", header, hashed) == hashed


@pytest.mark.parametrize("fields,problem", [
    ({"tenant_source": "cookie"}, "must be api_key, user or header:<Name>"),
    ({"tenant_source": "header:"}, "must be api_key, user or header:<Name>"),
    ({"tenant_source": "header:X Team"}, "must be api_key, user or header:<Name>"),
    ({"rate_limit_rpm": -1}, "must be at least 0"),
    ({"rate_limits": "sk-secret=60"}, "key=rpm:tpm"),
    ({"rate_limits": "sk-secret=1:2,sk-secret=3:4"}, "given twice"),
    ({"rate_limits": "sk-secret=1:2", "api_keys": ("sk-other",)}, "not among --api-key"),
    ({"api_keys": ("sk-secret",), "admin_api_keys": ("sk-secret",)}, "both --api-key and --admin-api-key"),
])
def test_bad_settings_are_named_and_keys_not_shown(fields: dict[str, object], problem: str) -> None:
    with pytest.raises(SettingsError) as err:
        GatewaySettings(**fields)  # type: ignore[arg-type]
    assert problem in str(err.value) and "sk-secret" not in str(err.value)


def test_reset_is_written_as_openai_does() -> None:
    assert [format_reset(ms) for ms in (0, 17, 1000, 1500, 360_000, 86_400, 3_600_000)] == [
        "0s", "17ms", "1s", "1.5s", "6m0s", "1m26.4s", "1h0m0s"]


async def test_redis_down_is_503() -> None:
    client = aioredis.from_url("redis://127.0.0.1:1", socket_connect_timeout=1)
    settings = GatewaySettings(rate_limit_rpm=10)
    tenants = Tenants(client, Keys("t"), settings)
    limiter = RateLimiter(client, Keys("t"), MODEL, settings, GatewayMetrics(MODEL), tenants)
    for call in (limiter.admit(ANONYMOUS, ANONYMOUS, 10), tenants.ready()):  # the tenant secret too
        with pytest.raises(Exception) as err:
            await call
        assert getattr(err.value, "status", None) == 503 and err.value.code == "redis_unavailable"  # type: ignore[attr-defined]
    await client.aclose()


# -- one gateway ----------------------------------------------------------------------------

@pytest.mark.parametrize("gateway_settings", [GatewaySettings(rate_limit_rpm=3)])
async def test_requests_per_minute_hold_per_tenant(harness):
    http = harness.http
    remaining = []
    for _ in range(3):
        r = await http.post("/v1/completions", json=completion(), headers=bearer("a"))
        assert r.status_code == 200, r.text
        assert set(rate_headers(r)) == set(RATE_HEADERS[:3])  # tokens unlimited: no tokens triple
        assert r.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
    assert remaining == [2, 1, 0]
    assert 55 <= reset_s(r.headers["x-ratelimit-reset-requests"]) <= 60, r.headers  # full again in a minute
    num_enqueued = len(harness.worker.requests)
    r = await http.post("/v1/completions", json=completion(), headers=bearer("a"))
    retry_after_s = check_429(r, "requests")
    assert 15 <= retry_after_s <= 20  # one request refills in 60 / 3 s
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    await asyncio.sleep(0.2)
    assert len(harness.worker.requests) == num_enqueued  # nothing enqueued
    assert harness.app.state.inferq.relay.num_in_flight == 0  # nothing registered
    # Another tenant has its own bucket; so does a streaming request of it.
    async with http.stream("POST", "/v1/completions", json=completion(stream=True), headers=bearer("b")) as r:
        assert r.status_code == 200
        assert r.headers["x-ratelimit-remaining-requests"] == "2"
        await r.aread()
    assert 'inferq:rate_limited_total{kind="requests",model_name="SmolLM2-135M-Instruct"} 1.0' in harness.metrics()
    assert 'reason="rate_limited"' in harness.metrics()


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(rate_limit_tpm=300)])
async def test_tokens_per_minute_count_prompt_and_max_tokens_of_every_choice(harness):
    http = harness.http
    r = await http.post("/v1/completions", json=completion(max_tokens=20), headers=bearer("a"))
    assert r.status_code == 200, r.text
    num_prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert set(rate_headers(r)) == set(RATE_HEADERS[3:])
    left = int(r.headers["x-ratelimit-remaining-tokens"])
    assert left == 300 - (num_prompt_tokens + 20)
    # Two prompts x n=3: six children, each reserving its prompt and max_tokens.
    body = completion(prompt=["Hi", "Hi"], n=3, max_tokens=10)
    r = await http.post("/v1/completions", json=body, headers=bearer("a"))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 6
    before, left = left, int(r.headers["x-ratelimit-remaining-tokens"])
    assert before - left in (6 * (num_prompt_tokens + 10), 6 * (num_prompt_tokens + 10) - 1)  # refill: < 1 token
    # Streaming: the headers come with the stream's 200.
    async with http.stream("POST", "/v1/completions", json=completion(max_tokens=10, stream=True),
                           headers=bearer("a")) as r:
        assert r.status_code == 200
        before, left = left, int(r.headers["x-ratelimit-remaining-tokens"])
        sse_events((await r.aread()).decode())
    assert 0 < before - left <= num_prompt_tokens + 10
    # More than what is left: 429, nothing taken; a small one still passes.
    num_enqueued = len(harness.worker.requests)
    r = await http.post("/v1/completions", json=completion(max_tokens=left + 5), headers=bearer("a"))
    check_429(r, "tokens")
    assert "Rate limit reached" in r.json()["error"]["message"]
    r = await http.post("/v1/completions", json=completion(max_tokens=2), headers=bearer("a"))
    assert r.status_code == 200, r.text
    assert int(r.headers["x-ratelimit-remaining-tokens"]) >= left - (num_prompt_tokens + 2)
    assert len(harness.worker.requests) == num_enqueued + 1
    # Larger than the whole limit: never admitted, said so.
    r = await http.post("/v1/completions", json=completion(max_tokens=250, n=2), headers=bearer("c"))
    check_429(r, "tokens")
    assert "Request too large" in r.json()["error"]["message"]


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(rate_limit_rpm=5, max_queue_len=0)])
async def test_a_refusal_after_the_limiter_carries_the_headers(harness):
    r = await harness.http.post("/v1/completions", json=completion(), headers=bearer("a"))
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
    assert r.headers["x-ratelimit-remaining-requests"] == "4"  # it passed the limiter, and counts


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(rate_limit_rpm=100, rate_limits="k1=1:0,k2=0:0")])
async def test_per_key_limits_override_the_defaults(harness):
    http = harness.http
    assert (await http.post("/v1/completions", json=completion(), headers=bearer("k1"))).status_code == 200
    check_429(await http.post("/v1/completions", json=completion(), headers=bearer("k1")), "requests")
    r = await http.post("/v1/completions", json=completion(), headers=bearer("k2"))  # k2: unlimited
    assert r.status_code == 200 and rate_headers(r) == {}
    r = await http.post("/v1/completions", json=completion(), headers=bearer("k3"))  # others: the defaults
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "100"


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(rate_limit_rpm=1, tenant_source="user")])
async def test_users_of_one_key_are_separate_tenants(harness):
    http = harness.http
    for user in ("alice", "bob"):
        r = await http.post("/v1/chat/completions", headers=bearer("k"), json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "user": user})
        assert r.status_code == 200, r.text
    r = await http.post("/v1/completions", json=completion(user="alice"), headers=bearer("k"))
    check_429(r, "requests")


async def test_limits_off_add_no_headers_and_no_redis_calls(harness):
    info = aioredis.from_url(harness.redis.url)
    try:
        # Other scripts (the fair queue's enqueue and pull) run too: the limiter's own script
        # must not have been loaded (redis-py loads a script on its first call).
        await info.script_flush()
        r = await harness.http.post("/v1/completions", json=completion(), headers=bearer("a"))
        assert r.status_code == 200 and rate_headers(r) == {}
        assert await info.script_exists(harness.app.state.inferq.rate_limiter._take.sha) == [False]
        assert await info.keys(f"{harness.keys.namespace}:*rate-limit*") == []
    finally:
        await info.aclose()


async def batch_headers(harness, owner_key: str) -> dict[str, str]:
    """What the batch worker sends for a line of ``owner_key``'s batch: the batch
    credential, read from Redis as the worker does, and the owner's key tenant."""
    from shared.server_secret import load_server_secret

    client = aioredis.from_url(harness.redis.url)
    try:
        credential = batch_credential(await load_server_secret(client, harness.keys))
    finally:
        await client.aclose()
    tenants = harness.app.state.inferq.tenants
    await tenants.ready()
    return {"Authorization": f"Bearer {credential}", BATCH_TENANT_HEADER: tenants.key_tenant(owner_key),
            "X-Priority": "batch"}


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(api_keys=("k1", "k2"), rate_limits="k2=1:0")])
async def test_a_batch_line_runs_under_its_owners_limits_and_no_key_can_name_a_tenant(harness):
    http = harness.http
    assert (await http.post("/v1/completions", json=completion(), headers=bearer("k2"))).status_code == 200
    check_429(await http.post("/v1/completions", json=completion(), headers=bearer("k2")), "requests")
    tenants = harness.app.state.inferq.tenants
    tenant_k1, tenant_k2 = tenants.key_tenant("k1"), tenants.key_tenant("k2")
    # A client key cannot name a tenant, not even its own: 401, nothing counted or queued.
    num_enqueued = len(harness.worker.requests)
    for key, named in (("k1", tenant_k2), ("k2", tenant_k1), ("k2", tenant_k2)):
        r = await http.post("/v1/completions", json=completion(), headers={**bearer(key), BATCH_TENANT_HEADER: named})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert rate_headers(r) == {}
    assert len(harness.worker.requests) == num_enqueued
    # The batch worker's line of k2's batch: k2's bucket, already empty.
    line_k2 = await batch_headers(harness, "k2")
    check_429(await http.post("/v1/completions", json=completion(), headers=line_k2), "requests")
    # A line of k1's batch runs as k1 (unlimited), in the batch class of k1's streams.
    r = await http.post("/v1/completions", json=completion(), headers=await batch_headers(harness, "k1"))
    assert r.status_code == 200 and rate_headers(r) == {}, r.text
    assert harness.worker.requests[-1].priority == 2
    probe = aioredis.from_url(harness.redis.url)
    try:
        streams = {m.decode() for m in await probe.smembers(harness.keys.model_streams(MODEL))}
        assert harness.keys.class_stream(MODEL, "batch", tenant_k1) in streams
        assert await probe.exists(harness.keys.rate_limit_key(MODEL, tenant_k2)) == 1
    finally:
        await probe.aclose()
    text = harness.metrics()
    assert f'priority_class="batch",tenant="{tenant_k1}"}} 1.0' in text
    # The credential alone is no API key; a malformed tenant is a 400.
    r = await http.post("/v1/completions", json=completion(), headers={"Authorization": line_k2["Authorization"]})
    assert r.status_code == 401
    r = await http.post("/v1/completions", json=completion(), headers={**line_k2, BATCH_TENANT_HEADER: "k2"})
    assert r.status_code == 400 and r.json()["error"]["param"] == BATCH_TENANT_HEADER


# -- two gateways, one Redis ----------------------------------------------------------------

@contextlib.asynccontextmanager
async def gateways_on(settings: GatewaySettings, url: str, keys: Keys, source, tokenizer, count: int = 2):
    """``count`` gateways (apps under uvicorn) on one Redis namespace: yields per gateway
    ``(http client, app)``; all stopped on exit."""
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for _ in range(count):
            app = create_app(settings, RedisSettings(redis_url=url, namespace=keys.namespace),
                             ModelSettings(max_model_len=256), source, tokenizer=tokenizer)
            base_url = await stack.enter_async_context(serving(app, relay_timeout_s=10))
            http = await stack.enter_async_context(httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits))
            out.append((http, app))
        yield out


@pytest.mark.parametrize("tenant_secret", ["", "configured secret"])
async def test_gateways_on_one_redis_name_a_key_alike(redis_server, source, tokenizer, tenant_secret):
    """Two gateway processes' worth of apps: one tenant id per key, so one bucket, from
    the secret in Redis (made once by whichever came first) or from --tenant-secret."""
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    settings = GatewaySettings(rate_limits="k=1:0", tenant_secret=tenant_secret, request_timeout_s=20.0)
    async with gateways_on(settings, redis_server.url, keys, source, tokenizer) as gateways:
        worker = FakeWorker(redis_server.url, keys, MODEL, tokenizer)
        await worker.start()
        try:
            first = await gateways[0][0].post("/v1/completions", json=completion(), headers=bearer("k"))
            assert first.status_code == 200, first.text
            check_429(await gateways[1][0].post("/v1/completions", json=completion(), headers=bearer("k")),
                      "requests")
            ids = {app.state.inferq.tenants.key_tenant("k") for _, app in gateways}
            assert len(ids) == 1
            (tenant,) = ids
            assert tenant != hashlib.sha256(b"k").hexdigest()[:16]
            if tenant_secret:
                assert tenant == tenant_id(tenant_secret.encode(), "k")
            assert f'tenant="{tenant}"' in gateways[0][1].state.metrics.render().decode()
        finally:
            await worker.stop()


async def test_a_burst_on_two_gateways_is_admitted_within_the_limit(redis_server, source, tokenizer):
    limit, num_requests = 100, 200
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    settings = GatewaySettings(rate_limit_rpm=limit, request_timeout_s=20.0)
    async with gateways_on(settings, redis_server.url, keys, source, tokenizer) as gateways:
        worker = FakeWorker(redis_server.url, keys, MODEL, tokenizer)
        await worker.start()
        try:
            start_s = time.monotonic()

            async def post(i: int) -> tuple[httpx.Response, float]:
                r = await gateways[i % 2][0].post("/v1/completions", json=completion(max_tokens=4),
                                                  headers=bearer("burst"))
                return r, time.monotonic() - start_s

            done = await asyncio.gather(*[post(i) for i in range(num_requests)])
            responses = [r for r, _ in done]
            elapsed_s = max(t for _, t in done)
            # The 429s answer as soon as the limiter refuses: the last one bounds the time
            # in which the burst was checked (the admitted ones then still stream).
            checked_s = max((t for r, t in done if r.status_code == 429), default=elapsed_s)
            statuses = [r.status_code for r in responses]
            assert set(statuses) <= {200, 429}, [r.text for r in responses if r.status_code not in (200, 429)][:3]
            num_admitted = statuses.count(200)
            # The bucket refills limit / 60 per second while the burst runs; nothing more passes.
            allowance = limit + math.floor(limit * elapsed_s / 60)
            expected = limit + limit * checked_s / 60
            print(json.dumps({"admitted": num_admitted, "allowance": allowance, "elapsed_s": round(elapsed_s, 2),
                              "checked_s": round(checked_s, 2)}))
            assert limit <= num_admitted <= allowance
            assert abs(num_admitted - expected) <= 0.05 * expected
            assert len(worker.requests) == num_admitted
            assert {r.headers.get("x-ratelimit-limit-requests") for r in responses} == {str(limit)}
        finally:
            await worker.stop()
