"""The SSE response of a stream (gateway/sse.py, docs/architecture.md "The relay"): a lone
choice's loop sends every step once, in order, coalescing the steps that queued while it
was not running into one write; the client leaving closes the request (abort "client
disconnected") and ends the loop. Driven through its ASGI interface with the relay fed
by hand (tests/test_relay_batches.py's ``Requests``) and the real SmolLM2 tokenizer. Also the
bulk observe of a request's inter-token gaps (``gateway.metrics.observe_many``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response

from gateway.app import GatewayApp
from gateway.choices import Choice
from gateway.generation import Generation
from gateway.responses import DONE_EVENT, ResponseShape
from gateway.sse import SERVER_SEND_KEY, ChoicesStream
from tests.test_relay_batches import Requests, out

pytestmark = pytest.mark.timeout(60)


class Client:
    """An ASGI client: records every message sent; ``leave()`` makes ``receive`` say
    ``http.disconnect`` (uvicorn's send to a closed connection is a no-op, as here)."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self._left = asyncio.Event()

    async def send(self, message: dict[str, Any]) -> None:
        if not self._left.is_set():
            self.sent.append(message)

    async def receive(self) -> dict[str, Any]:
        await self._left.wait()
        return {"type": "http.disconnect"}

    def leave(self) -> None:
        self._left.set()

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body" and m["body"]]


def _stream(r: Requests, request_id: str, closed: list[Generation]) -> tuple[Generation, ChoicesStream]:
    gen = r.add(request_id)
    on_close = gen._on_close

    def record_close(g: Generation) -> None:
        closed.append(g)
        on_close(g)

    gen._on_close = record_close
    shape = ResponseShape(request_id, "m", 0, chat=False)
    return gen, ChoicesStream([Choice(gen, shape)], num_prompt_tokens=3, include_usage=True)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_lone_stream_writes_every_step_once_and_coalesces_what_queued(smollm_tokenizer) -> None:
    r = Requests(smollm_tokenizer)
    closed: list[Generation] = []
    gen, response = _stream(r, "s", closed)
    client = Client()
    ids = r.ids(" Paris is the capital of France")
    r.send(out("s", 0, ids[:1]))
    r.send(out("s", 1, ids[1:2]))  # both queued before the response runs: one write
    through_middlewares: list[dict[str, Any]] = []

    async def wrapped_send(message: dict[str, Any]) -> None:
        through_middlewares.append(message)

    # The body goes to the server's own send (GatewayApp puts it in the scope).
    scope = {"type": "http", SERVER_SEND_KEY: client.send}
    task = asyncio.ensure_future(response(scope, client.receive, wrapped_send))
    await _settle()
    assert [m["type"] for m in through_middlewares] == ["http.response.start"]
    shape = ResponseShape("s", "m", 0, chat=False)
    assert client.bodies == [shape.chunk_event(" Paris") + shape.chunk_event(" is")]
    for i in range(2, len(ids)):
        r.send(out("s", i, ids[i:i + 1]))
        await _settle()
    r.send(out("s", len(ids), [smollm_tokenizer.eos_token_id], "stop"))
    await asyncio.wait_for(task, 5)
    bodies = client.bodies
    assert len(bodies) == len(ids) - 1 + 2  # one write per later step, the finish chunk, usage + [DONE]
    events = [e for body in bodies for e in body.split(b"\n\n") if e]
    assert events[-1] + b"\n\n" == DONE_EVENT
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " Paris is the capital of France"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": len(ids) + 1,
                                   "total_tokens": len(ids) + 4, "prompt_tokens_details": {"cached_tokens": 0}}
    assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert closed == [gen] and gen.abort_reason is None  # closed once; the worker ended it itself


async def test_the_client_leaving_closes_the_request_and_ends_the_stream(smollm_tokenizer) -> None:
    r = Requests(smollm_tokenizer)
    closed: list[Generation] = []
    gen, response = _stream(r, "d", closed)
    client = Client()
    task = asyncio.ensure_future(response({"type": "http"}, client.receive, client.send))
    r.send(out("d", 0, r.ids(" Paris")))
    await _settle()
    assert len(client.bodies) == 1
    client.leave()
    await _settle()
    assert closed == [gen]  # at once, not when the output ends
    assert gen.abort_reason == "client disconnected"
    assert r.relay.num_in_flight == 0
    await asyncio.wait_for(task, 5)  # the loop stopped without more output
    assert closed == [gen]


async def test_the_app_keeps_the_servers_send_in_the_scope() -> None:
    app = GatewayApp()
    seen: list[Any] = []

    @app.get("/x")
    async def x(request: Request) -> Response:
        seen.append(request.scope.get(SERVER_SEND_KEY))
        return Response()

    client = Client()
    scope = {"type": "http", "method": "GET", "path": "/x", "raw_path": b"/x", "query_string": b"", "headers": [],
             "root_path": "", "scheme": "http", "server": ("t", 80), "asgi": {"version": "3.0"}}
    await app(scope, client.receive, client.send)
    assert seen == [client.send]
    assert client.sent[0]["status"] == 200


def test_observe_many_matches_observe_per_value() -> None:
    """The per-request bulk observe of inter-token gaps gives the series that
    ``observe`` per gap gives (it reads prometheus_client's own fields)."""
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from gateway.metrics import observe_many

    rng = random.Random(0)
    gaps = [rng.choice([0.0, 0.01, 0.1, 1.0, 99.0]) if rng.random() < 0.2 else rng.expovariate(30)
            for _ in range(500)]
    rendered = []
    for bulk in (False, True):
        registry = CollectorRegistry()
        child = Histogram("gap_seconds", "gaps", ["m"], buckets=(0.001, 0.01, 0.1, 1.0), registry=registry).labels("a")
        if bulk:
            observe_many(child, gaps[:250])
            observe_many(child, [])
            observe_many(child, gaps[250:])
        else:
            for g in gaps:
                child.observe(g)
        rendered.append({line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                         for line in generate_latest(registry).decode().splitlines()
                         if line.startswith("gap_seconds_") and "_created" not in line})
    assert rendered[0]['gap_seconds_count{m="a"}'] == 500
    assert rendered[1].keys() == rendered[0].keys()
    for key, value in rendered[0].items():  # buckets and count exact, the sum up to rounding
        assert rendered[1][key] == pytest.approx(value, rel=1e-12), key
