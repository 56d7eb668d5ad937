"""The per-gateway reply relay: ONE pub/sub connection subscribed to this gateway's
channel, and a reader task that hands each decoded message to the queue of the request
it belongs to.

Requests register before their XADD so no reply can arrive for an unknown id. Messages
of unknown requests (finished, aborted) and of older attempts (after a failover
re-enqueue) are dropped. When the connection drops, every in-flight request gets a
``RelayLost`` (its replies published meanwhile are gone) and the reader reconnects with
exponential backoff, re-subscribing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import redis.exceptions

from shared import protocol
from shared.protocol import ErrorMessage, TokenMessage

log = logging.getLogger(__name__)

#: Seconds one ``get_message`` waits before the loop checks again.
_POLL_TIMEOUT_S = 1.0
#: How many orphaned request ids the relay remembers having asked to abort.
_ORPHANS_KEPT = 4096


@dataclass(frozen=True, slots=True)
class RelayLost:
    """Put on every in-flight request's queue when the pub/sub connection is lost."""

    reason: str


RelayItem = TokenMessage | ErrorMessage | RelayLost


@dataclass(slots=True)
class _Entry:
    attempt: int
    queue: asyncio.Queue[RelayItem]


class Relay:
    """Dispatches replies on ``channel`` to per-request queues.

    ``ready`` is set while subscribed; requests must not be enqueued otherwise (a worker
    publishing to zero subscribers takes the gateway for dead).
    """

    def __init__(self, client: aioredis.Redis, channel: str, *, backoff_initial_s: float = 0.05,
                 backoff_max_s: float = 2.0, on_orphan: Callable[[str], None] | None = None) -> None:
        self._client = client
        self.channel = channel
        self._entries: dict[str, _Entry] = {}
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self.ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.num_reconnects = 0
        self._subscribed = False
        self.num_dropped = 0
        # Tokens for a request this gateway no longer waits on mean a worker still runs
        # it (its abort was lost, e.g. Redis was down): ``on_orphan`` asks for another
        # abort, once per request id (the last ``_ORPHANS_KEPT`` ids are remembered).
        self._on_orphan = on_orphan
        self._orphans: OrderedDict[str, None] = OrderedDict()

    # -- requests ---------------------------------------------------------------
    def register(self, request_id: str, attempt: int = 0) -> asyncio.Queue[RelayItem]:
        """Start collecting replies for ``request_id``.

        Raises:
            KeyError: the id is already in flight on this gateway.
        """
        if request_id in self._entries:
            raise KeyError(request_id)
        entry = _Entry(attempt, asyncio.Queue())
        self._entries[request_id] = entry
        return entry.queue

    def set_attempt(self, request_id: str, attempt: int) -> None:
        """From now on drop replies of attempts older than ``attempt`` (failover)."""
        self._entries[request_id].attempt = attempt

    def unregister(self, request_id: str) -> None:
        """Forget ``request_id``; later replies for it are dropped. Idempotent."""
        self._entries.pop(request_id, None)

    @property
    def num_in_flight(self) -> int:
        """Requests registered now."""
        return len(self._entries)

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
        pubsub = self._client.pubsub()
        try:
            await pubsub.subscribe(self.channel)
            # The subscribe confirmation proves the subscription is live on the server.
            while True:
                msg = await pubsub.get_message(timeout=_POLL_TIMEOUT_S)
                if msg is not None and msg["type"] == "subscribe":
                    break
            self.ready.set()
            self._subscribed = True
            log.info("relay subscribed to %s", self.channel)
            while True:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=_POLL_TIMEOUT_S)
                if msg is not None and msg["type"] == "message":
                    self.dispatch(msg["data"])
        finally:
            self.ready.clear()
            try:
                await pubsub.aclose()
            except Exception as exc:  # noqa: BLE001 - the connection is already broken
                log.debug("relay pubsub close failed: %r", exc)

    def dispatch(self, payload: bytes) -> None:
        """Decode one published payload and queue it for its request (or drop it)."""
        try:
            msg = protocol.decode(payload)
        except protocol.ProtocolError as exc:
            self.num_dropped += 1
            log.warning("relay dropped a message: %s", exc)
            return
        if not isinstance(msg, (TokenMessage, ErrorMessage)):
            self.num_dropped += 1
            log.warning("relay dropped an unexpected %s message", type(msg).__name__)
            return
        entry = self._entries.get(msg.request_id)
        if entry is None or msg.attempt < entry.attempt:
            self.num_dropped += 1
            if (entry is None and isinstance(msg, TokenMessage) and msg.finish_reason is None
                    and self._on_orphan is not None and msg.request_id not in self._orphans):
                self._orphans[msg.request_id] = None
                if len(self._orphans) > _ORPHANS_KEPT:
                    self._orphans.popitem(last=False)
                self._on_orphan(msg.request_id)
            return
        entry.queue.put_nowait(msg)

    def _fail_all(self, reason: str) -> None:
        for entry in self._entries.values():
            entry.queue.put_nowait(RelayLost(reason))
