"""The per-gateway reply relay: ONE pub/sub connection subscribed to this gateway's
channel, a reader that decodes each message, and the map of requests in flight here
(``requests``: wire request id -> ``Generation``, the one record of a request's state).

Workers publish one ``TokenBatch`` per engine step for this gateway (every request of
it that got tokens); the reader hands each entry to its ``Generation.accept``, which
orders, detokenizes and delivers it, all in one pass on the event loop. The reader
blocks on the socket (``pubsub.listen()``): no timer per message.

Requests register before their XADD so no reply can arrive for an unknown id. Entries
of unknown requests (finished, aborted) are dropped; an unfinished one means a worker
still runs a request nobody waits for, and is aborted (``on_orphans``). When the
connection drops, every in-flight request fails with 503 (its replies published
meanwhile are gone) and the reader reconnects with exponential backoff, re-subscribing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import redis.exceptions

from gateway.errors import OpenAIError
from gateway.generation import Generation
from shared import protocol
from shared.protocol import ErrorMessage, TokenBatch
from shared.redis_connect import AsyncClient
from shared.redis_connect import pubsub as subscriber

log = logging.getLogger(__name__)

#: How many orphaned request ids the relay remembers having asked to abort.
_ORPHANS_KEPT = 4096


class Relay:
    """Dispatches replies on ``channel`` to the requests in flight.

    ``ready`` is set while subscribed; requests must not be enqueued otherwise (a worker
    publishing to zero subscribers takes the gateway for dead).
    """

    def __init__(self, client: AsyncClient, channel: str, *, backoff_initial_s: float = 0.05,
                 backoff_max_s: float = 2.0, on_orphans: Callable[[list[str]], None] | None = None) -> None:
        self._client = client
        self.channel = channel
        #: The requests in flight on this gateway, by wire request id.
        self.requests: dict[str, Generation] = {}
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self.ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.num_reconnects = 0
        self._subscribed = False
        self.num_dropped = 0
        # Tokens for a request this gateway no longer waits on mean a worker still runs
        # it (its abort was lost, e.g. Redis was down): ``on_orphans`` asks for another
        # abort, once per request id (the last ``_ORPHANS_KEPT`` ids are remembered).
        self._on_orphans = on_orphans
        self._orphans: OrderedDict[str, None] = OrderedDict()

    # -- requests ---------------------------------------------------------------
    def register(self, gen: Generation) -> None:
        """Start relaying replies to ``gen``.

        Raises:
            KeyError: its request id is already in flight on this gateway.
        """
        if gen.request_id in self.requests:
            raise KeyError(gen.request_id)
        self.requests[gen.request_id] = gen

    def unregister(self, request_id: str) -> None:
        """Forget ``request_id``; later replies for it are dropped. Idempotent."""
        self.requests.pop(request_id, None)

    @property
    def num_in_flight(self) -> int:
        """Requests registered now."""
        return len(self.requests)

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the subscription; True when subscribed."""
        if self.ready.is_set():
            return True
        try:
            await asyncio.wait_for(self.ready.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    # -- reader -----------------------------------------------------------------
    def start(self) -> None:
        """Start the reader task (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"relay:{self.channel}")
            self._task.add_done_callback(self._reader_done)

    @staticmethod
    def _reader_done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.critical("relay reader died: %r", task.exception(), exc_info=task.exception())

    async def stop(self) -> None:
        """Cancel the reader and wait for it."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        backoff_s = self._backoff_initial_s
        while True:
            try:
                await self._listen()
            except Exception as exc:
                if not isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)):
                    log.error("relay reader error; reconnecting", exc_info=exc)
                if self._subscribed:
                    self._subscribed = False
                    log.warning("relay lost Redis (%s); reconnecting", exc)
                    backoff_s = self._backoff_initial_s
                    self._fail_all(f"lost the connection to Redis: {exc}")
                else:
                    log.debug("relay cannot reach Redis (%s); retrying in %.2f s", exc, backoff_s)
                self.num_reconnects += 1
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self._backoff_max_s)

    async def _listen(self) -> None:
        pubsub = await subscriber(self._client, self.channel)
        try:
            await pubsub.subscribe(self.channel)
            async for msg in pubsub.listen():
                kind = msg["type"]
                if kind == "message":
                    self.dispatch(msg["data"])
                elif kind == "subscribe":
                    # The confirmation proves the subscription is live on the server.
                    self.ready.set()
                    self._subscribed = True
                    log.info("relay subscribed to %s", self.channel)
            raise redis.exceptions.ConnectionError("pub/sub subscription ended")
        finally:
            self.ready.clear()
            try:
                await pubsub.aclose()
            except Exception as exc:  # noqa: BLE001 - the connection is already broken
                log.debug("relay pubsub close failed: %r", exc)

    def dispatch(self, payload: bytes) -> None:
        """Decode one published payload and hand each entry to its request (or drop it)."""
        try:
            msg = protocol.decode(payload)
        except protocol.ProtocolError as exc:
            self.num_dropped += 1
            log.warning("relay dropped a message: %s", exc)
            return
        if isinstance(msg, TokenBatch):
            self._dispatch_batch(msg)
        elif isinstance(msg, ErrorMessage):
            gen = self.requests.get(msg.request_id)
            if gen is None or not gen.worker_failed(msg):
                self.num_dropped += 1
        else:
            self.num_dropped += 1
            log.warning("relay dropped an unexpected %s message", type(msg).__name__)

    def _dispatch_batch(self, batch: TokenBatch) -> None:
        now_s = time.monotonic()
        orphans: list[str] = []
        for out in batch.outputs:
            gen = self.requests.get(out.request_id)
            if gen is None:
                self.num_dropped += 1
                if out.finish_reason is None and out.request_id not in self._orphans:
                    orphans.append(out.request_id)
                continue
            try:
                if not gen.accept(out, batch.worker_id, now_s):
                    self.num_dropped += 1
            except Exception as exc:  # one request's failure must not stop the others
                log.exception("relaying %s failed", out.request_id)
                gen.fail(OpenAIError(500, f"internal error: {type(exc).__name__}"))
        if orphans and self._on_orphans is not None:
            for request_id in orphans:
                self._orphans[request_id] = None
            while len(self._orphans) > _ORPHANS_KEPT:
                self._orphans.popitem(last=False)
            self._on_orphans(orphans)

    def _fail_all(self, reason: str) -> None:
        for gen in list(self.requests.values()):
            gen.fail(OpenAIError(503, reason, code="redis_unavailable"))
