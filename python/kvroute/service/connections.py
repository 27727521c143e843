"""Connection hygiene: limits uvicorn's httptools protocol does not set by itself.

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``, set from
``--keep-alive-timeout-secs``) but, with httptools, neither the size of a request's
headers nor the time a client may take to send them or its body: a client could hold a
connection (and a file descriptor) forever with a request that never ends, or make the
parser buffer megabytes of headers. ``guarded_protocol`` subclasses uvicorn's
``HttpToolsProtocol`` with three guards:

* header size: the bytes of the request line and headers are counted as they arrive
  (raw bytes while the header is incomplete, then the parsed parts when it is); past
  ``--max-header-bytes`` the client gets ``431 Request Header Fields Too Large`` and the
  connection closes.
* header time: from the connection's start (or the first byte of a later request on a
  kept-alive connection) the headers must be complete within ``--header-timeout-secs``;
  otherwise ``408 Request Timeout`` (or a plain close if nothing was sent).
* body time: while a request body is still expected, each ``--body-timeout-secs``
  without a byte of it ends the request with ``408``; the app sees the client as gone.
  Time while reading is paused (the app has not consumed what arrived, e.g. while the
  request waits for admission) does not count.
* keep-alive: uvicorn arms a timer for ``--keep-alive-timeout-secs`` after each
  answer and cancels it when the next request arrives (a timer created and cancelled
  per request); here that deadline goes behind the connection's one timer too.

It also sends a response's head and the start of its body in one write: uvicorn writes
the status line and headers as soon as the app starts the response, then the body as a
second write, so a complete answer cost two ``send`` calls and two TCP segments (on
loopback the sender also pays the receiver's TCP processing), where the Rust routers
send both with one ``writev``. ``_HeadHoldingTransport`` keeps the head
of an answer whose length is known (``content-length``: its body follows at once, in
the same ``send`` sequence) until the body's write, the end of the response (a ``HEAD``
answer writes no body) or the connection's close. Other heads (streams: chunked, their
first chunk may be seconds away) go out at once. No callback is scheduled: one was an
extra turn of the event loop, and so an extra ``epoll_wait``, per request.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _response(status: bytes, message: bytes) -> bytes:
    body = b'{"error":{"message":"' + message + b'","type":"invalid_request_error","code":null}}'
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
    )


HEADER_TOO_LARGE = _response(b"431 Request Header Fields Too Large", b"request headers too large")
LINGER_S = 1.0  # how long a refused connection's late input is read and dropped
REQUEST_TIMEOUT = _response(b"408 Request Timeout", b"request not received in time")


COALESCE_MAX = 256 * 1024  # bodies up to this size are joined to their head
_BODY_HEADERS = (b"content-length", b"transfer-encoding")


class _HeadHoldingTransport:
    """The connection's transport, holding a response head until the next write."""

    __slots__ = ("_held", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if len(data) > COALESCE_MAX:  # a big body: not worth copying to save a call
                self._transport.write(held)
                self._transport.write(data)
            else:
                self._transport.write(held + data)
        elif data.startswith(b"HTTP/1.1 ") and b"\r\ncontent-length: " in data:
            # The head of an answer of known length (uvicorn writes it alone, with the
            # header names lowercased): its body is the next write.
            self._held = data
        else:
            self._transport.write(data)

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.flush()
        self._transport.set_protocol(protocol)

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:  # get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


def guarded_protocol(
    max_header_bytes: int, header_timeout_s: float, body_timeout_s: float
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the three guards (see the module docstring)."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_header = False
            self._header_bytes = 0
            # Deadlines (loop time) behind one timer per connection: a request used to
            # create and cancel three timers (~2 µs each); now a deadline is a float, and
            # the timer, when it fires early, re-arms for whatever is still due.
            self._header_due: float | None = None
            self._body_due: float | None = None
            self._idle_due: float | None = None  # uvicorn's keep-alive timeout
            self._timer: asyncio.TimerHandle | None = None
            self._timer_at = 0.0
            self._refused = False
            self._linger: asyncio.TimerHandle | None = None

        # -------------------------------------------------------- timers

        def _arm_header_timer(self) -> None:
            if self._header_due is None:
                now = self.loop.time()
                self._header_due = now + header_timeout_s
                # No later than the keep-alive timeout this request's end will set: then
                # that deadline never needs an earlier timer (the timer fires early at
                # worst, once per that many seconds, and re-arms).
                self._wake_at(now + min(header_timeout_s, self.timeout_keep_alive))

        def _arm_body_timer(self) -> None:
            self._body_due = self.loop.time() + body_timeout_s
            self._wake_at(self._body_due)

        def _wake_at(self, due: float) -> None:
            """Have the timer fire by ``due`` (it may fire earlier: ``_check`` re-arms)."""
            if self._timer is None or self._timer_at > due:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = self.loop.call_at(due, self._check)
                self._timer_at = due

        def _check(self) -> None:
            self._timer = None
            now = self.loop.time() + 0.001  # the loop's clock ticks in milliseconds
            if self._header_due is not None and now >= self._header_due:
                self._header_due = None
                self._header_late()
            elif self._body_due is not None and now >= self._body_due:
                self._body_due = None
                self._body_late()
            elif self._idle_due is not None and now >= self._idle_due:
                self._idle_due = None
                self.timeout_keep_alive_handler()  # uvicorn's: close the idle connection
            else:
                dues = [
                    d for d in (self._header_due, self._body_due, self._idle_due) if d is not None
                ]
                if dues:
                    self._wake_at(min(dues))

        def _cancel(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._header_due = self._body_due = self._idle_due = None

        def _refuse(self, response: bytes | None) -> None:
            """Answer ``response`` (unless a response is under way) and close."""
            self._refused = True
            self._cancel()
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                if cycle.response_started:
                    response = None
                cycle.disconnected = True  # the app's sends are dropped from here on
                cycle.message_event.set()  # and its receive() returns http.disconnect
            if self.transport.is_closing():
                return
            if response is None:
                self.transport.close()
                return
            self.transport.write(response)
            # A lingering close (as nginx's): stop sending, but read and drop what the
            # client is still sending for a moment; closing with unread data would send
            # a reset that can destroy the answer before the client reads it.
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self._linger = self.loop.call_later(LINGER_S, self.transport.close)
            else:
                self.transport.close()

        def _header_late(self) -> None:
            self._refuse(REQUEST_TIMEOUT if self._header_bytes else None)

        def _body_late(self) -> None:
            if self.flow is not None and self.flow.read_paused:
                # The app has not read what it has (queued for admission): the pause is
                # the router's, not the client's.
                self._arm_body_timer()
                return
            self._refuse(REQUEST_TIMEOUT)

        # -------------------------------------------------------- protocol

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            held = _HeadHoldingTransport(transport)
            super().connection_made(held)  # type: ignore[arg-type]
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel()
            if self._linger is not None:
                self._linger.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            self._idle_due = None  # not idle (uvicorn cancels its keep-alive timer here)
            super().data_received(data)
            if self._in_header and not self._refused:
                # Still inside the header after this chunk: all of it counts.
                self._header_bytes += len(data)
                if self._header_bytes > max_header_bytes:
                    self._refuse(HEADER_TOO_LARGE)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_header = True
            self._header_bytes = 0
            self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._in_header = False
            self._header_due = None  # the timer, if it fires, finds nothing due
            if self._refused:
                return
            # The parsed request line and headers, counted in one pass here rather than
            # in a Python callback per header (the parser calls back for each); all of
            # them arrived in the chunk being parsed, so the refusal comes no later.
            size = self._header_bytes + len(self.url)
            body = False
            for name, value in self.headers:
                size += len(name) + len(value) + 4
                if name in _BODY_HEADERS and value.strip() not in (b"0", b""):
                    body = True
            self._header_bytes = size
            if size > max_header_bytes:
                self._refuse(HEADER_TOO_LARGE)
                return
            super().on_headers_complete()
            if body:
                self._arm_body_timer()

        def on_body(self, body: bytes) -> None:
            if self._refused:
                return
            if self._body_due is not None:  # later only: the timer re-arms when it fires
                self._body_due = self.loop.time() + body_timeout_s
            super().on_body(body)

        def on_response_complete(self) -> None:
            self.transport.flush()  # type: ignore[attr-defined]  # a HEAD answer's head
            if self.pipeline or self.transport.is_closing():
                super().on_response_complete()
                return
            # uvicorn's own steps, but the keep-alive timeout is a deadline behind the
            # connection's one timer instead of a timer created and cancelled per request.
            self.server_state.total_requests += 1
            self._unset_keepalive_if_required()
            self.flow.resume_reading()
            self._idle_due = self.loop.time() + self.timeout_keep_alive
            self._wake_at(self._idle_due)

        def on_message_complete(self) -> None:
            if self._refused:
                return
            self._body_due = None
            super().on_message_complete()

    return GuardedHttpToolsProtocol
