"""OpenAI's Responses API on the chat path (docs/operations.md, "The Responses API"):
``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A Responses body becomes a chat request (gateway/responses_request.py) that goes
through ``gateway.handlers.admit`` like any chat request: auth, tenants, rate limits,
priority, the chat template and tools, structured outputs, admission, placement and
failover are the chat path's. Its one generation's released text becomes output items
and stream events (gateway/responses_output.py), and the finished response is stored
for ``previous_response_id`` and ``GET`` (gateway/response_store.py) unless ``store`` is
false. Errors of the chat path name the Responses field they come from (``messages`` is
``input``, ``max_completion_tokens`` is ``max_output_tokens``).

Streaming, OpenAI's order, each event ``event: <type>`` and ``data: <json>`` with a
``sequence_number`` counting from 0: ``response.created``, ``response.in_progress``, the
items' events as the text arrives, then ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it), after the response is
stored; a generation that fails ends with ``response.failed`` (its ``error``). There is
no ``[DONE]``. A failure before the generation starts (a bad body, 401, 429...) is an
HTTP error, streaming or not, as in chat; so is a failure of a non-streaming response.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Send

from gateway.errors import OpenAIError
from gateway.generation import ClientDisconnected, Generation
from gateway.handlers import Admitted, admit
from gateway.output import Step
from gateway.response_store import ResponseStore, StoredResponse
from gateway.responses import usage
from gateway.responses_output import Event, OutputItems, ResponseHead, new_id, response_error, responses_usage
from gateway.responses_request import ResponsesChatRequest, ResponsesRequest, canonical_item, to_chat
from gateway.schemas import parse_body
from gateway.sse import ChoicesStream
from gateway.state import GatewayState
from gateway.tenants import Caller, identify
from gateway.tool_parser import ToolCallStream

log = logging.getLogger(__name__)

#: Fields of the chat request named in the chat path's errors -> the Responses fields.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}
#: Prefix of a response's wire request id (X-Request-Id); the response's own id is
#: ``resp_<hex>``, random even when the client sent an X-Request-Id.
REQUEST_ID_PREFIX = "resp-"

_json = msgspec.json.Encoder().encode


def renamed(error: OpenAIError) -> OpenAIError:
    """``error`` with the Responses name of the chat field it names (``_PARAMS``)."""
    if error.param in _PARAMS:
        error.param = _PARAMS[error.param]
    return error


def store_of(state: GatewayState) -> ResponseStore:
    """The stored responses of ``state``'s Redis and namespace."""
    return ResponseStore(state.redis, state.keys, state.settings.responses_ttl_s)


class ResponseRun:
    """One response while its generation runs: its ``head``, its output items, the
    stream's sequence numbers; stores it when over (``store``). Has what the chat
    stream's loop needs of a choice (``gen``, ``step_events``)."""

    def __init__(self, state: GatewayState, admitted: Admitted) -> None:
        chat = admitted.req
        assert isinstance(chat, ResponsesChatRequest)
        body, params = chat.body, admitted.params[0]
        self.gen: Generation = admitted.gens[0]
        self.body = body
        self._chat = chat
        self._caller = admitted.caller
        self._num_prompt_tokens = len(admitted.prompts[0])
        self._store = store_of(state) if body.store is not False else None
        self.head = ResponseHead(new_id("resp"), int(time.time()), state.served_model_name, {
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": self._store is not None,
            "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": body.text_format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "truncation": "disabled",
            "user": body.user})
        parser = ToolCallStream(chat.max_num_tool_calls, chat.tool_format) if chat.parses_tool_calls else None
        self.output = OutputItems(parser)
        self._num_events = 0

    # -- streaming ---------------------------------------------------------------------
    def sse(self, events: list[Event]) -> bytes:
        """``events`` as SSE, numbered on from the previous ones."""
        out = []
        for event in events:
            event["sequence_number"] = self._num_events
            self._num_events += 1
            out.append(b"event: " + event["type"].encode() + b"\ndata: " + _json(event) + b"\n\n")
        return b"".join(out)

    def start_events(self) -> bytes:
        """``response.created`` and ``response.in_progress``."""
        response = self.head.build("in_progress", [])
        return self.sse([{"type": "response.created", "response": response},
                         {"type": "response.in_progress", "response": response}])

    def step_events(self, steps: list[Step]) -> bytes:
        """The items' events of the released text (ChoicesStream's loop calls it)."""
        events: list[Event] = []
        for step in steps:
            over = step.finish_reason is not None
            events += self.output.feed(step.text, over)
            if over:
                events += self.output.finish(step.finish_reason != "length")
        return self.sse(events)

    async def end_events(self) -> bytes:
        """Once the output is over: store the response, then ``response.completed`` (or
        ``response.incomplete``).

        Raises:
            OpenAIError: 503 when storing it failed.
        """
        response = await self.finished()
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return self.sse([{"type": kind, "response": response}])

    def failed_events(self, error: OpenAIError) -> bytes:
        """``response.failed`` with ``error`` and the output so far."""
        response = self.head.build("failed", self.output.snapshot(), error=response_error(error))
        return self.sse([{"type": "response.failed", "response": response}])

    # -- one body ----------------------------------------------------------------------
    async def whole(self, headers: dict[str, str]) -> Response:
        """Wait for the whole output and answer the ``response`` object (stored first), or
        the error (499 when the client left)."""
        gen = self.gen
        try:
            text = await gen.result()
        except OpenAIError as exc:
            return renamed(exc).response()
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            gen.close()
        self.output.feed(text, finished=True)
        self.output.finish(gen.finish_reason != "length")
        try:
            response = await self.finished()
        except OpenAIError as exc:
            return exc.response()
        return JSONResponse(response, headers=headers)

    async def finished(self) -> dict[str, Any]:
        """The finished ``response`` (output over, items closed), stored unless ``store``
        is false.

        Raises:
            OpenAIError: 503 when storing it failed.
        """
        gen = self.gen
        status = "incomplete" if gen.finish_reason == "length" else "completed"
        chat_usage = usage(self._num_prompt_tokens, gen.num_output_tokens, gen.num_cached_tokens)
        response = self.head.build(status, list(self.output.items), responses_usage(chat_usage),
                                   completed_at=int(time.time()) if status == "completed" else None)
        if self._store is not None:
            await self._store.put(StoredResponse(owner=self._caller.key_tenant, response=response,
                                                 input_items=self._chat.conversation_items))
        return response


class ResponsesStream(ChoicesStream):
    """A streamed response: ChoicesStream's loop (a write per wake-up, the watcher that
    closes the generation when the client leaves) over one ``ResponseRun``, with the
    Responses events around it (module docstring)."""

    def __init__(self, run: ResponseRun, headers: dict[str, str]) -> None:
        # The loop and the watcher use a choice's ``gen`` and ``step_events`` only.
        super().__init__([run], 0, False, headers=headers)  # type: ignore[list-item]
        self._run = run

    async def _write_events(self, send: Send) -> None:
        run = self._run
        try:
            await send({"type": "http.response.body", "body": run.start_events(), "more_body": True})
            await self._write_one(run, send)  # type: ignore[arg-type]
            if self.disconnected:
                return
            tail = await run.end_events()
        except OpenAIError as exc:
            tail = run.failed_events(renamed(exc))
        except Exception as exc:
            log.exception("stream of response %s failed", run.head.response_id)
            tail = run.failed_events(OpenAIError(500, f"internal error: {type(exc).__name__}"))
        if not self.disconnected:
            await send({"type": "http.response.body", "body": tail, "more_body": True})


async def handle_create(state: GatewayState, request: Request) -> Response:
    """Serve ``POST /v1/responses``: the response object, or (``stream``) its events."""
    store = store_of(state)

    async def parse(caller: Caller, raw: bytes) -> ResponsesChatRequest:
        body: ResponsesRequest = parse_body(ResponsesRequest, raw)
        body.check()
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = await store.get(body.previous_response_id, caller, "previous_response_id")
            history = previous.input_items + [canonical_item(item, "previous_response_id")
                                              for item in previous.response["output"]]
        return to_chat(body, history)

    try:
        admitted = await admit(state, request, parse, id_prefix=REQUEST_ID_PREFIX, batch_allowed=False)
    except OpenAIError as exc:
        return renamed(exc).response()
    run = ResponseRun(state, admitted)
    headers = {"X-Request-Id": admitted.request_id, **admitted.rate_headers}
    if run.body.stream:
        return ResponsesStream(run, headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await run.whole(headers)


def install_response_routes(app: FastAPI) -> None:
    """Add ``GET`` and ``DELETE /v1/responses/{id}`` to ``app`` (whose ``state.inferq`` is
    the GatewayState); gateway/app.py serves ``POST /v1/responses`` (``handle_create``)."""

    def state_of(request: Request) -> GatewayState:
        return request.app.state.inferq  # type: ignore[no-any-return]

    @app.get("/v1/responses/{response_id}", include_in_schema=False)
    async def retrieve_response(response_id: str, request: Request, stream: bool = False) -> Response:
        state = state_of(request)
        caller = await identify(state.settings, state.tenants, request)
        if stream:
            raise OpenAIError(400, "stream: replaying a stored response's events is not supported (there is no "
                              "background mode)", param="stream")
        record = await store_of(state).get(response_id, caller)
        return JSONResponse(record.response)

    @app.delete("/v1/responses/{response_id}", include_in_schema=False)
    async def delete_response(response_id: str, request: Request) -> Response:
        state = state_of(request)
        caller = await identify(state.settings, state.tenants, request)
        await store_of(state).delete(response_id, caller)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
