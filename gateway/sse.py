"""The SSE response of a streaming request: its choices' chunks as they arrive, then the
usage chunk when asked and ``[DONE]`` (docs/architecture.md, "One request, step by step",
step 14, and "The relay").

This is the gateway's hottest path (one write per stream per engine step), so it is an
ASGI response of its own rather than Starlette's ``StreamingResponse`` over a chain of
async generators:

- A lone choice (the common case) is a plain loop in the response: take the steps queued
  on its record (``Generation.take_steps``), send their bytes in one write, wait for more
  (``Generation.wait``: one bare future, woken by the relay's pass). Steps that arrived
  while a write was under way go out together in the next. Several choices merge through
  ``merged_updates`` (one task per child feeding a queue).
- The client leaving: uvicorn (ASGI 2.3) turns writes to a closed connection into no-ops
  and says ``http.disconnect`` only to ``receive``, so one watcher task per response
  waits on ``receive``. When the client leaves it closes every child at once (which
  aborts the ones the worker still runs, reason "client disconnected") and wakes the
  loop, which stops. Starlette's ``StreamingResponse`` runs the same watcher in an anyio
  task group of two tasks; this costs one plain task and no cancellation.
- The body's writes go to the server's own ``send`` when the app put it in the scope
  (``SERVER_SEND_KEY``: gateway/app.py's ``GatewayApp``), past the two wrappers that
  Starlette's exception middlewares put around ``send`` to note that the response has
  started (the start message still goes through them). So middlewares that would
  rewrite a body (GZip...) do not see a stream's chunks; the gateway installs none.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.choices import Choice, close_all, fail_siblings, usage_of
from gateway.errors import OpenAIError
from gateway.output import Step
from gateway.responses import DONE_EVENT, sse_event

log = logging.getLogger(__name__)

#: The scope key of the ASGI server's own ``send`` callable (set by ``GatewayApp``).
SERVER_SEND_KEY = "inferq.server_send"


class ChoicesStream(Response):
    """``text/event-stream`` response of ``choices`` (in index order) that always closes
    its children, also when the client leaves before the stream starts.

    ``num_prompt_tokens`` and ``include_usage`` make the usage chunk
    (``stream_options.include_usage``).
    """

    media_type = "text/event-stream"

    def __init__(self, choices: list[Choice], num_prompt_tokens: int, include_usage: bool,
                 headers: dict[str, str] | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(headers)
        self._choices = choices
        self._num_prompt_tokens = num_prompt_tokens
        self._include_usage = include_usage
        self.disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher: asyncio.Task[None] | None = None
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            send = scope.get(SERVER_SEND_KEY, send)
            watcher = asyncio.ensure_future(self._watch(receive))
            await self._write_events(send)
            watcher.cancel()
            if not self.disconnected:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if watcher is not None:
                watcher.cancel()
            close_all(self._choices)

    async def _watch(self, receive: Receive) -> None:
        """Wait for ``http.disconnect``; then close every child and wake the loop."""
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception as exc:  # noqa: BLE001 - a broken receive means the client is gone
            log.debug("receive failed: %r", exc)
        self.disconnected = True
        close_all(self._choices)  # also wakes every child's ``wait``

    async def _write_events(self, send: Send) -> None:
        """Each chat choice's role chunk, the children's chunks as they arrive
        (``Choice.step_events``), the usage chunk when asked, then ``[DONE]``. An error in
        any child is an ``{"error": ...}`` event then ``[DONE]`` (every child fails with
        it). Stops quietly when the client left."""
        choices = self._choices
        try:
            firsts = [c.shape.first_chunk() for c in choices]
            if firsts[0] is not None:
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"".join([sse_event(f) for f in firsts if f is not None])})
            if len(choices) == 1:
                await self._write_one(choices[0], send)
            else:
                async for batch in merged_updates(choices):
                    if self.disconnected:
                        return
                    data = b"".join([choice.step_events(steps) for choice, steps in batch])
                    if data:
                        await send({"type": "http.response.body", "body": data, "more_body": True})
            if self.disconnected:
                return
            tail = DONE_EVENT
            if self._include_usage:
                usage_ = usage_of(choices, self._num_prompt_tokens)
                tail = sse_event(choices[0].shape.usage_chunk(usage_)) + DONE_EVENT
            await send({"type": "http.response.body", "body": tail, "more_body": True})
        except OpenAIError as exc:
            fail_siblings(choices, exc)
            await send({"type": "http.response.body", "body": sse_event(exc.body()) + DONE_EVENT, "more_body": True})
        except Exception as exc:
            log.exception("stream of %s failed", choices[0].gen.request_id)
            error = OpenAIError(500, f"internal error: {type(exc).__name__}")
            fail_siblings(choices, error)
            await send({"type": "http.response.body", "body": sse_event(error.body()) + DONE_EVENT,
                        "more_body": True})

    async def _write_one(self, choice: Choice, send: Send) -> None:
        """A lone choice's chunks, one write per wake-up, until its output is over.

        Raises:
            OpenAIError: as ``Generation.updates`` (after the steps delivered before it).
        """
        gen = choice.gen
        while not (self.disconnected or gen.closed):  # closed: only by the watcher so far
            steps = gen.take_steps()
            if steps:
                data = choice.step_events(steps)
                if data:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            elif gen.over:
                if gen.error is not None:
                    raise gen.error
                return
            else:
                await gen.wait()


_Update = tuple[Choice, list[Step] | None, BaseException | None]


async def merged_updates(choices: list[Choice]) -> AsyncIterator[list[tuple[Choice, list[Step]]]]:
    """The children's steps as they arrive, in batches of what arrived meanwhile, until
    every child's output is over (or closed). Raises the first child's error (after the
    steps delivered before it)."""
    queue: asyncio.Queue[_Update] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for steps in choice.gen.updates():
                queue.put_nowait((choice, steps, None))
        except Exception as exc:  # noqa: BLE001 - handed to the stream, which reports it
            queue.put_nowait((choice, None, exc))
            return
        queue.put_nowait((choice, None, None))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        num_open = len(choices)
        while num_open:
            updates = [await queue.get()]
            while not queue.empty():
                updates.append(queue.get_nowait())
            batch = []
            for choice, steps, error in updates:
                if error is not None:
                    if batch:
                        yield batch
                    raise error
                if steps is None:
                    num_open -= 1
                else:
                    batch.append((choice, steps))
            if batch:
                yield batch
    finally:
        for task in tasks:
            task.cancel()
