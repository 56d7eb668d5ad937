"""Every error status the gateway answers, end to end (fixtures: gateway_harness.py)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import redis.asyncio as aioredis

from shared import protocol
from shared.keys import CONSUMER_GROUP, STREAM_FIELD
from shared.protocol import ErrorMessage
from shared.settings import GatewaySettings
from tests.gateway_harness import ANSWER, MODEL, FakeWorker, sse_events

pytestmark = pytest.mark.timeout(60)

# -- errors -------------------------------------------------------------------------------

def _assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 1000}, "max_tokens"),
    ({"model": MODEL, "prompt": "hello " * 300}, "prompt"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": [999999]}, "prompt"),
    ({"model": MODEL, "prompt": [5, -1, 7]}, "prompt"),
    ({"model": MODEL, "prompt": [[5], [7, 999999]]}, "prompt"),
    ({"model": MODEL, "prompt": "x", "n": 17}, "n"),
    ({"model": MODEL, "prompt": "x", "logprobs": 6}, "logprobs"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": MODEL, "prompt": {"a": 1}}, "prompt"),
])
async def test_invalid_completion_is_400(harness, body, param):
    _assert_openai_error(await harness.http.post("/v1/completions", json=body), 400, param)


async def test_invalid_chat_is_400(harness):
    r = await harness.http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"})
    _assert_openai_error(r, 400, "messages")
    r = await harness.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10_000})
    _assert_openai_error(r, 400, "max_completion_tokens")
    r = await harness.http.post("/v1/chat/completions", content=b"not json")
    _assert_openai_error(r, 400)


async def test_fastapi_422_becomes_400(harness):
    @harness.app.get("/typed")
    async def typed(n: int) -> dict:
        return {"n": n}
    r = await harness.http.get("/typed", params={"n": "abc"})
    _assert_openai_error(r, 400, "n")


async def test_generation_posts_skip_fastapis_stack_and_still_answer_errors(harness, monkeypatch):
    """``GatewayApp.serve_directly``: a POST to /v1/completions or /v1/chat/completions
    reaches its endpoint without FastAPI's middleware stack and router; other requests go
    through them. An unexpected exception is still a logged OpenAI-shaped 500."""
    import fastapi

    import gateway.app

    stack_calls: list[str] = []
    stack = fastapi.FastAPI.__call__

    async def counted(self, scope, receive, send):
        if scope["type"] == "http":
            stack_calls.append(scope["path"])
        await stack(self, scope, receive, send)
    monkeypatch.setattr(fastapi.FastAPI, "__call__", counted)
    _assert_openai_error(await harness.http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    _assert_openai_error(await harness.http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"}), 400)
    assert stack_calls == []
    assert (await harness.http.get("/v1/models")).status_code == 200
    assert (await harness.http.get("/v1/completions")).status_code == 405  # other methods: the router's answer
    assert stack_calls == ["/v1/models", "/v1/completions"]

    async def broken(*args, **kwargs):
        raise RuntimeError("boom")
    monkeypatch.setattr(gateway.app, "handle_generate", broken)
    err = _assert_openai_error(await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 500)
    assert "RuntimeError" in err["message"]


async def test_unknown_model_is_404(harness):
    r = await harness.http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert _assert_openai_error(r, 404, "model")["code"] == "model_not_found"


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(max_body_bytes=1000)])
async def test_large_body_is_413(harness):
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 2000})
    _assert_openai_error(r, 413)
    chunked = (b'{"model": "%s", "prompt": "' % MODEL.encode(), b"y" * 2000, b'"}')

    async def body():
        for part in chunked:
            yield part
    r = await harness.http.post("/v1/completions", content=body())
    _assert_openai_error(r, 413)


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(api_keys=("k1", "k2"))])
async def test_auth_401(harness):
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    _assert_openai_error(r, 401)
    r = await harness.http.get("/v1/models", headers={"Authorization": "Bearer nope"})
    _assert_openai_error(r, 401)
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                                headers={"Authorization": "Bearer k2"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ANSWER


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(max_queue_len=1)])
async def test_queue_full_is_429_and_pending_entries_do_not_count(harness):
    stream = harness.keys.requests_stream(MODEL)
    await harness.worker.stop()  # nobody consumes: what is XADDed stays waiting
    client = aioredis.from_url(harness.redis.url)
    try:
        await client.xadd(stream, {STREAM_FIELD: b"filler"})
        r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        err = _assert_openai_error(r, 429)
        assert err["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
        # Once a worker has taken the entry (pending in the group), the queue is empty again.
        taken = await client.xreadgroup(CONSUMER_GROUP, "w9", {stream: ">"}, count=1)
        assert taken[0][1][0][1] == {STREAM_FIELD: b"filler"}
        worker = FakeWorker(harness.redis.url, harness.keys, MODEL, harness.worker.tok)
        await worker.start()
        try:
            r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
            assert r.status_code == 200, r.text
        finally:
            await worker.stop()
        assert 'reason="queue_full"' in harness.metrics()
    finally:
        await client.aclose()
        harness.worker = FakeWorker(harness.redis.url, harness.keys, MODEL, harness.worker.tok)
        await harness.worker.start()


@pytest.mark.parametrize("gateway_settings", [GatewaySettings(request_timeout_s=0.5)])
async def test_deadline_is_504_and_aborts(harness):
    async def silent(req, w):
        return None
    harness.worker.behavior = silent
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert _assert_openai_error(r, 504)["code"] == "deadline_exceeded"
    abort = await harness.worker.wait_for_abort(harness.worker.requests[-1].request_id)
    assert abort.reason == "deadline"


async def test_worker_error_message_status(harness):
    async def failing(req, w):
        msg = ErrorMessage(request_id=req.request_id, attempt=0, worker_id="w1", status=504, message="expired")
        await w.client.publish(req.reply_channel, protocol.encode(msg))
    harness.worker.behavior = failing
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert _assert_openai_error(r, 504)["message"] == "expired"
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "504"


async def test_worker_abort_finish_is_500(harness):
    async def aborting(req, w):
        await w.send(req, 0, [5], "abort")
    harness.worker.behavior = aborting
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    _assert_openai_error(r, 500)
    assert harness.worker.aborts == []  # the worker stopped it itself: no abort to send


async def test_client_disconnect_mid_stream_aborts(harness):
    async def endless(req, w):
        ids = w.tok.encode(ANSWER, add_special_tokens=False)
        await w.send(req, 0, ids[:1])
        for i in range(1, 200):
            await asyncio.sleep(0.05)
            await w.send(req, i, ids[1:2])
    harness.worker.behavior = endless
    harness.worker.ack = False

    async def read_one() -> str:
        async with harness.http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "x", "stream": True, "max_tokens": 200}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return json.loads(line[6:])["id"]
        raise AssertionError("no event")
    consume = asyncio.create_task(read_one())
    request_id = await consume
    abort = await harness.worker.wait_for_abort(request_id, timeout_s=10)
    assert abort.reason == "client disconnected"
    assert harness.app.state.inferq.relay.num_in_flight == 0
    assert 'inferq:request_aborts_total{model_name="SmolLM2-135M-Instruct",reason="client disconnected"} 1.0' \
        in harness.metrics()


async def test_redis_down_is_503_and_recovers(harness):
    harness.redis.stop()
    try:
        r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert _assert_openai_error(r, 503)["code"] == "redis_unavailable"
        _assert_openai_error(await harness.http.get("/health"), 503)
    finally:
        harness.redis.start()
    await harness.worker.stop()
    harness.worker = FakeWorker(harness.redis.url, harness.keys, MODEL, harness.worker.tok)
    await harness.worker.start()
    deadline = time.monotonic() + 15
    while (await harness.http.get("/health")).status_code != 200:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert await harness.app.state.inferq.relay.wait_ready(10)
    r = await harness.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ANSWER


# A client's request id is reserved only while its request runs: tests/test_request_ids.py.
