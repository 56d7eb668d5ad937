"""Timeouts for a connection that does not finish its request: uvicorn's httptools
protocol with a header timer and a body timer (docs/operations.md, "Connection timeouts").

uvicorn closes a keep-alive connection that stays idle after a response
(``timeout_keep_alive``), but a connection that never sends a whole request has no timer
at all: silent connections, or ones that trickle their headers or body, hold a
descriptor each for ever, and enough of them exhaust the process's descriptors. As
nginx does (``client_header_timeout``, ``client_body_timeout``, ``keepalive_timeout``):

- **headers**: from the connection's opening (its first request) or from a request's
  first byte (a later one on a keep-alive connection, whose idle time before that byte
  is the keep-alive timeout's), the request line and headers must be in within
  ``header_timeout_s``; otherwise the connection is closed, after a 408 when part of a
  request had arrived.
- **body**: once the headers are in, the time between two pieces of the body (and before
  the first) may not exceed ``body_timeout_s``. The clock stops while uvicorn itself has
  paused reading (the app has not taken the body buffered so far) and while the client
  waits for ``100 Continue``. When it runs out, the app sees a disconnect (its body read
  raises ``ClientDisconnect``, logged at INFO by gateway/errors.py), and the client gets a
  408 if no response had started, then the connection closes.

Cost: a timer per connection while its first request's headers arrive, and one only
while headers or a body span several reads of the socket (a request that arrives in one
read, as nearly all API requests do, starts no other timer); the body timer is re-armed
once per timeout, not per piece.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.errors import BODY_TIMEOUT_KEY, error_body

log = logging.getLogger(__name__)

#: The code of the 408's error object.
REQUEST_TIMEOUT_CODE = "request_timeout"


def timed_protocol(header_timeout_s: float, body_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with these timeouts, for ``uvicorn.Config(http=...)``.

    Raises:
        ValueError: a timeout that is not positive.
    """
    if not (header_timeout_s > 0 and body_timeout_s > 0):
        raise ValueError(f"timeouts must be positive, got {header_timeout_s=} and {body_timeout_s=}")
    return type("TimedHttpToolsProtocol", (TimedHttpToolsProtocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})


class TimedHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with the header and body timers (module docstring);
    ``timed_protocol`` sets the two class attributes."""

    header_timeout_s = 30.0
    body_timeout_s = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._reading_headers = False  # a request has begun and its headers are not all in
        self._reading_body = False  # its headers are in and its body is not
        self._last_body_s = 0.0  # loop time of the last piece of body (or of the headers' end)

    # -- the protocol's events -------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Timers only for what this read left unfinished.
        if self._reading_headers and self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)
        elif self._reading_body and self._body_timer is None and not self.transport.is_closing():
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timeout)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_headers = True

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._reading_body = True
        self._last_body_s = self.loop.time()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._last_body_s = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._reading_body = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    # -- the timers ----------------------------------------------------------------------
    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        log.debug("closing a connection from %s: no complete request headers within %g s",
                  _address(self.client), self.header_timeout_s)
        if self._reading_headers:
            self._send_408(f"the request headers did not arrive within {self.header_timeout_s:g} s")
        self.transport.close()

    def _body_timeout(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or not self._reading_body:
            return
        cycle = self.cycle
        idle_s = self.loop.time() - self._last_body_s
        if self.flow.read_paused or cycle.waiting_for_100_continue or idle_s < self.body_timeout_s:
            # Not the client's delay (or not yet a whole timeout of it): look again later.
            self._body_timer = self.loop.call_later(max(self.body_timeout_s - idle_s, 0.001), self._body_timeout)
            return
        cycle.scope[BODY_TIMEOUT_KEY] = self.body_timeout_s  # type: ignore[literal-required]
        if not cycle.response_started and not cycle.response_complete:
            # As a disconnect: the app's body read ends, and whatever it answers is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
            self._send_408(f"no part of the request body arrived for {self.body_timeout_s:g} s")
        self.transport.close()

    def _send_408(self, message: str) -> None:
        """Write a 408 with an OpenAI error object and ``connection: close``."""
        body = json.dumps(error_body(408, message, code=REQUEST_TIMEOUT_CODE)).encode()
        head = [STATUS_LINE[408]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                 b"\r\nconnection: close\r\n\r\n", body]
        self.transport.write(b"".join(head))


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown client"
