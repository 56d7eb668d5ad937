"""One request in flight at this gateway: the one record of its state, owned by the relay
(``Relay.requests``, wire request id -> ``Generation``, as SGLang's rid -> state map).

The relay's reader calls ``accept`` for each of the request's token entries, in the
order they arrive, on the event loop: the attempt filter, the ``first_index`` ordering,
detokenization and stop strings (``OutputProcessor``) all happen there, in one pass
over a batch. The request's handler only waits for the steps that come out
(``updates`` for a stream, ``result`` for one body); failover reads the same record.

Ordering: ``output_ids`` holds the output tokens consumed so far. An entry whose
``first_index`` is below ``len(output_ids)`` overlaps (a redelivery): its already-seen
prefix is trimmed. One above it means tokens were lost: the request fails (500) rather
than return text with a hole. Entries of an attempt older than ``attempt`` (replaced by
a failover continuation) are dropped.

Timers: one per request (its deadline), none per token. A streaming request's handler
wakes once per batch of steps (one bare future, ``wait``), a non-streaming one only when
the output is over, and polls its client every ``DISCONNECT_POLL_S`` meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.errors import OpenAIError
from gateway.output import OutputProcessor, Step
from shared.protocol import ErrorMessage, GenerateRequest, TokenLogprobs, TokenOutput

#: How often a non-streaming request checks whether its client is still there, s.
DISCONNECT_POLL_S = 1.0


class ClientDisconnected(Exception):
    """The client went away before the output was complete."""


class Generation:
    """One request's progress, output state and delivery to its handler.

    Times are ``time.monotonic()`` seconds. ``worker_done`` is True once the worker
    ended the request itself (finish_reason or error), so no abort is needed.
    ``on_close(self)`` runs exactly once, from ``close()``. With ``is_disconnected``
    the output is read whole with ``result()``, else step by step with ``updates()``.
    ``constraint_param``: the request field of its structured-output constraint (None:
    none), named in the 400 a worker answers when the grammar fails there.
    """

    def __init__(self, *, request_id: str, processor: OutputProcessor, arrival_s: float, deadline_s: float,
                 on_close: Callable[[Generation], None],
                 is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                 constraint_param: str | None = None) -> None:
        self.request_id = request_id
        self.constraint_param = constraint_param
        self.processor = processor
        self.arrival_s = arrival_s
        self.deadline_s = deadline_s
        self._on_close = on_close
        self._is_disconnected = is_disconnected
        #: Entries of older attempts are dropped (a failover continuation replaced them).
        self.attempt = 0
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.token_gaps_s: list[float] = []
        self.worker_done = False
        self.finish_reason: str | None = None
        self.stop_string: str | None = None
        self.error: OpenAIError | None = None
        # For failover: the queued request, its stream and entry, the worker that runs it
        # (from its last token batch) and the output token ids received so far.
        self.message: GenerateRequest | None = None
        self.stream = ""
        self.class_stream = ""
        self.entry_id: bytes | None = None
        self.worker_id: str | None = None
        self.output_ids: list[int] = []
        #: The prompt tokens' logprobs (``TokenOutput.prompt_logprobs``: entry ``i`` scores
        #: prompt token ``i + 1``), from the first entry, when the request asked for them.
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        #: Prompt tokens the worker found in its prefix cache (``TokenOutput.num_cached_tokens``
        #: of the first entry of the newest attempt, at most the prompt's length): OpenAI's
        #: ``usage.prompt_tokens_details.cached_tokens`` (``gateway/choices.py``, ``usage_of``).
        self.num_cached_tokens = 0
        self._cached_attempt = -1  # the attempt whose first entry set ``num_cached_tokens``
        # Delivery: steps not yet taken by the handler; ``_waiter`` (the handler waiting in
        # ``wait``) is woken when there are some (streams), when the output is over
        # (``_over``: finished or failed) and on ``close``.
        self._steps: list[Step] = []
        self._waiter: asyncio.Future[None] | None = None
        self._over = False
        self._deadline: asyncio.TimerHandle | None = None
        self._closed = False

    # -- the queue side -------------------------------------------------------------
    def submitted(self, message: GenerateRequest, entry_id: bytes, stream: str = "", class_stream: str = "") -> None:
        """Record the queued request, the stream that holds its entry (a worker's placed
        stream, or its (class, tenant) stream), that (class, tenant) stream
        (``class_stream``, default ``stream``: where a failover continuation goes) and
        the entry id; the deadline starts to count."""
        self.message, self.entry_id, self.stream = message, entry_id, stream
        self.class_stream = class_stream or stream
        if self._deadline is None and not self._closed:
            delay_s = max(0.0, self.deadline_s - time.monotonic())
            self._deadline = asyncio.get_running_loop().call_later(delay_s, self._expire)

    def resubmitted(self, message: GenerateRequest, entry_id: bytes) -> None:
        """A continuation replaced the entry (its ``attempt`` is already ``self.attempt``):
        its owner is not known yet."""
        self.message, self.entry_id, self.worker_id = message, entry_id, None

    @property
    def num_output_tokens(self) -> int:
        """Output tokens consumed (up to a stop string) = OpenAI ``completion_tokens``."""
        return self.processor.num_output_tokens

    # -- the relay side (synchronous, on the event loop) ------------------------------
    def accept(self, out: TokenOutput, worker_id: str, now_s: float) -> bool:
        """Consume one token entry sent by ``worker_id``, received at ``now_s``.

        Returns False when the entry was dropped as one of an older attempt. Lost
        tokens and a worker abort fail the request; an error of the tokenizer (a token id
        it rejects) is raised, and the relay fails the request with it.
        """
        if out.attempt < self.attempt:
            return False
        if out.attempt > self._cached_attempt:
            self._note_cached_tokens(out)
        if out.finish_reason is not None:
            self.worker_done = True
        if self._over:
            return True
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finish_reason == "abort":
            self.fail(OpenAIError(500, "the request was aborted by the worker", code="aborted"))
            return True
        num_received = len(self.output_ids)
        if out.first_index > num_received:
            self.fail(OpenAIError(500, f"lost output tokens {num_received}..{out.first_index - 1}",
                                  code="missing_tokens"))
            return True
        self.worker_id = worker_id
        new_ids = out.token_ids[num_received - out.first_index:]
        if not new_ids and out.finish_reason is None:
            return True  # a pure duplicate
        if new_ids:
            self.output_ids.extend(new_ids)
            if self.first_token_s is None:
                self.first_token_s = now_s
            elif self.last_token_s is not None:
                self.token_gaps_s.append(now_s - self.last_token_s)
            self.last_token_s = now_s
        logprobs = out.logprobs[num_received - out.first_index:] if out.logprobs else None
        self._deliver(self.processor.process(new_ids, out.finish_reason, logprobs))
        return True

    def _note_cached_tokens(self, out: TokenOutput) -> None:
        """Take the prefix-cache hit from an attempt's first entry. Later entries may carry
        another (a preempted request re-admitted with its own outputs in the cache); a
        failover continuation's hit counts its prompt part only (its ``num_prompt_tokens``
        is the original prompt's length; 0 from a build that sent none: not capped)."""
        self._cached_attempt = out.attempt
        cached = out.num_cached_tokens
        self.num_cached_tokens = min(cached, out.num_prompt_tokens) if out.num_prompt_tokens else cached

    def worker_failed(self, error: ErrorMessage) -> bool:
        """The worker ended the request with ``error``; False when it was dropped as one
        of an older attempt. A 400 of a constrained request names ``constraint_param``:
        the gateway checked everything else a worker refuses with a 400 (its grammar
        failing at admission or mid-generation, worker/service.py)."""
        if error.attempt < self.attempt:
            return False
        self.worker_done = True
        param = self.constraint_param if error.status == 400 else None
        self.fail(OpenAIError(error.status, error.message, param=param))
        return True

    def fail(self, error: OpenAIError) -> None:
        """End the output with ``error`` (after the steps already delivered); no effect
        once the output is over."""
        if not self._over:
            self.error = error
            self._end()

    def _expire(self) -> None:
        self.fail(OpenAIError(504, "the request deadline passed before generation finished",
                              code="deadline_exceeded"))

    def _deliver(self, step: Step) -> None:
        if step.text or step.finish_reason is not None or step.logprobs:
            self._steps.append(step)
        if step.finish_reason is not None:
            self.finish_reason, self.stop_string = step.finish_reason, step.stop_string
            self._end()
        elif (step.text or step.logprobs) and self._is_disconnected is None:
            self._wake()

    def _end(self) -> None:
        self._over = True
        self._wake()
        if self._deadline is not None:
            self._deadline.cancel()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- the handler side ---------------------------------------------------------------
    @property
    def over(self) -> bool:
        """True once the output is finished or failed (``error``)."""
        return self._over

    @property
    def closed(self) -> bool:
        """True once ``close`` ran."""
        return self._closed

    def take_steps(self) -> list[Step]:
        """The steps delivered since the last call (a stream's handler; empty when none)."""
        steps, self._steps = self._steps, []
        return steps

    async def wait(self) -> None:
        """Wait until steps are delivered (streams), the output is over or the record is
        closed; returns at once when steps are queued or it is over or closed already."""
        if self._steps or self._over or self._closed:
            return
        await self._next_wake()

    async def _wait_over(self) -> None:
        while not self._over:
            await self._next_wake()

    async def _next_wake(self) -> None:
        """Wait for the next wake-up: a delivery, the end of the output, or ``close``."""
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            if self._waiter is waiter:
                self._waiter = None

    async def updates(self) -> AsyncIterator[list[Step]]:
        """Yield the steps delivered since the last yield (at least one each time),
        until the output is over (the last step has ``finish_reason``) or the record is
        closed (the client left: it ends early).

        Raises:
            OpenAIError: worker error (its status), 500 for an aborted request or lost
                tokens, 503 when the relay lost Redis, 504 past the deadline (after the
                steps delivered before it).
        """
        while True:
            await self.wait()
            if self._steps:
                yield self.take_steps()
            elif self._over:
                if self.error is not None:
                    raise self.error
                return
            elif self._closed:
                return

    async def result(self) -> str:
        """Wait for the whole output and return its text.

        Raises:
            OpenAIError: as ``updates``.
            ClientDisconnected: the client left (polled every ``DISCONNECT_POLL_S``).
        """
        while not self._over:
            try:
                await asyncio.wait_for(self._wait_over(), DISCONNECT_POLL_S)
            except TimeoutError:
                if self._is_disconnected is not None and await self._is_disconnected():
                    raise ClientDisconnected() from None
        if self.error is not None:
            raise self.error
        return "".join(step.text for step in self._steps)

    def output_logprobs(self) -> tuple[list[int], list[TokenLogprobs]]:
        """After ``result()``: the output token ids and their logprobs (empty when the
        request did not ask for them)."""
        ids = [t for step in self._steps for t in step.token_ids]
        return ids, [lp for step in self._steps for lp in step.logprobs]

    def close(self) -> None:
        """Release the request (unregister, abort if the worker still runs it, metrics).
        Synchronous so it is safe in ``finally`` of a cancelled task. Idempotent."""
        if not self._closed:
            self._closed = True
            if self._deadline is not None:
                self._deadline.cancel()
            self._wake()
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
