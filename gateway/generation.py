"""One enqueued request as the gateway sees it: replies from the relay queue, put in
order by ``first_index``, turned into text steps, under the request's deadline.

Ordering: ``received`` counts output tokens consumed so far. A message whose
``first_index`` is below it overlaps (a redelivery): its already-seen prefix is
trimmed. One above it means tokens were lost: the request fails (500) rather than
return text with a hole.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.errors import OpenAIError
from gateway.output import OutputProcessor, Step
from gateway.relay import RelayItem, RelayLost
from gateway.tokenize import TokenizerWorker
from shared.protocol import ErrorMessage, GenerateRequest

#: How often a non-streaming request checks whether its client is still there, s.
DISCONNECT_POLL_S = 1.0


class ClientDisconnected(Exception):
    """The client went away before the output was complete."""


class Generation:
    """Consumes one request's replies; ``steps()`` yields text as it becomes final.

    Times are ``time.monotonic()`` seconds. ``worker_done`` is True once the worker
    ended the request itself (finish_reason or error), so no abort is needed.
    ``on_close(self)`` runs exactly once, from ``close()``.
    """

    def __init__(self, *, request_id: str, queue: asyncio.Queue[RelayItem], processor: OutputProcessor,
                 tokenizer: TokenizerWorker, arrival_s: float, deadline_s: float,
                 on_close: Callable[[Generation], None],
                 is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> None:
        self.request_id = request_id
        self._queue = queue
        self.processor = processor
        self._tokenizer = tokenizer
        self.arrival_s = arrival_s
        self.deadline_s = deadline_s
        self._on_close = on_close
        self._is_disconnected = is_disconnected
        self.received = 0
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.token_gaps_s: list[float] = []
        self.worker_done = False
        self.finish_reason: str | None = None
        self.stop_string: str | None = None
        self.error: OpenAIError | None = None
        self.disconnected = False
        self._closed = False
        # For failover: the queued request, its stream entry, the worker that runs it
        # (from its last message) and the output token ids received so far.
        self.message: GenerateRequest | None = None
        self.entry_id: bytes | None = None
        self.worker_id: str | None = None
        self.output_ids: list[int] = []

    def submitted(self, message: GenerateRequest, entry_id: bytes) -> None:
        """Record the queued request and its stream entry id."""
        self.message, self.entry_id = message, entry_id

    def resubmitted(self, message: GenerateRequest, entry_id: bytes) -> None:
        """A continuation replaced the entry: its owner is not known yet."""
        self.message, self.entry_id, self.worker_id = message, entry_id, None

    @property
    def num_output_tokens(self) -> int:
        """Output tokens consumed (up to a stop string) = OpenAI ``completion_tokens``."""
        return self.processor.num_output_tokens

    async def steps(self) -> AsyncIterator[Step]:
        """Yield text steps until the output is over; the last one has ``finish_reason``.

        Raises:
            OpenAIError: worker error (its status), 500 for an aborted request or lost
                tokens, 503 when the relay lost Redis, 504 past the deadline.
            ClientDisconnected: the client left (non-streaming polling only).
        """
        try:
            while True:
                item = await self._next()
                step = await self._handle(item)
                if step is None:
                    continue
                yield step
                if step.finish_reason is not None:
                    self.finish_reason = step.finish_reason
                    self.stop_string = step.stop_string
                    return
        except OpenAIError as exc:
            self.error = exc
            raise
        except ClientDisconnected:
            self.disconnected = True
            raise

    async def _next(self) -> RelayItem:
        while True:
            remaining_s = self.deadline_s - time.monotonic()
            if remaining_s <= 0:
                raise OpenAIError(504, "the request deadline passed before generation finished",
                                  code="deadline_exceeded")
            wait_s = min(remaining_s, DISCONNECT_POLL_S) if self._is_disconnected else remaining_s
            try:
                return await asyncio.wait_for(self._queue.get(), wait_s)
            except TimeoutError:
                if self._is_disconnected is not None and await self._is_disconnected():
                    raise ClientDisconnected() from None

    async def _handle(self, item: RelayItem) -> Step | None:
        if isinstance(item, RelayLost):
            raise OpenAIError(503, item.reason, code="redis_unavailable")
        if isinstance(item, ErrorMessage):
            self.worker_done = True
            raise OpenAIError(item.status, item.message)
        if item.finish_reason == "abort":
            self.worker_done = True
            raise OpenAIError(500, "the request was aborted by the worker", code="aborted")
        if self.message is not None and item.attempt < self.message.attempt:
            return None  # a late message of an attempt that failover replaced
        if item.first_index > self.received:
            raise OpenAIError(500, f"lost output tokens {self.received}..{item.first_index - 1}",
                              code="missing_tokens")
        self.worker_id = item.worker_id
        new_ids = item.token_ids[self.received - item.first_index:]
        if item.finish_reason is not None:
            self.worker_done = True
        if not new_ids and item.finish_reason is None:
            return None  # a pure duplicate
        self.received += len(new_ids)
        self.output_ids.extend(new_ids)
        now = time.monotonic()
        if new_ids:
            if self.first_token_s is None:
                self.first_token_s = now
            elif self.last_token_s is not None:
                self.token_gaps_s.append(now - self.last_token_s)
            self.last_token_s = now
        return await self._tokenizer.run(self.processor.process, new_ids, item.finish_reason)

    def close(self) -> None:
        """Release the request (unregister, abort if the worker still runs it, metrics).
        Synchronous so it is safe in ``finally`` of a cancelled task. Idempotent."""
        if not self._closed:
            self._closed = True
            self._on_close(self)

    @property
    def abort_reason(self) -> str | None:
        """Why the worker must be told to stop, or None when it already stopped."""
        if self.worker_done:
            return None
        if self.stop_string is not None:
            return "stop string"
        if self.error is not None:
            return "deadline" if self.error.status == 504 else f"error {self.error.status}"
        return "client disconnected"
