"""Keep-alive HTTP/1.1 connections to one worker, for the router's httpx client.

Why not httpcore (httpx's default transport): with uvicorn and an instant worker on
loopback, forwarding one request through httpx + httpcore cost ~1.5-2 ms of router CPU,
of which httpcore (its pool bookkeeping, h11's pure-Python parser, anyio's per-call
wrappers) was ~1 ms. Here a connection is an ``asyncio.Protocol``: the event loop hands
it bytes, httptools (the C parser uvicorn already uses for the router's own clients)
parses them, and a request is one ``transport.write``. httpx stays the client API: this
is a transport (``httpx.AsyncBaseTransport``), so requests, responses, streaming,
decoding and the exceptions callers catch are httpx's own.

Scope: plain ``http://`` origins, methods with a response body (GET, POST, PUT,
PATCH, DELETE, OPTIONS); ``upstream.PerWorkerPools`` sends anything else (``https://``
workers, HEAD) through httpcore. Request bodies are read whole and sent with a
Content-Length, as the router always has the body in hand.

Behaviour callers rely on, as httpcore's:
- timeouts from the request's ``timeout`` extension: ``connect`` (ConnectTimeout),
  ``write`` (WriteTimeout), ``read`` for each wait for response bytes, head or body
  (ReadTimeout), ``pool`` for a free connection slot (PoolTimeout);
- errors are httpx's: ConnectError, ReadError/WriteError (socket errors),
  RemoteProtocolError (invalid HTTP, or the worker closed the connection early);
- a connection goes back to the pool only after a complete response the worker did not
  mark ``Connection: close``; a response closed early (client went away mid-stream,
  cancelled, failed) closes its connection, so the worker sees the abort;
- a kept-alive connection the worker closed while idle is noticed by the event loop
  (``connection_lost``) instead of polled on reuse; if the worker closes it just as a
  request goes out (the keep-alive race: not one response byte came back), the request
  is sent again (on another idle connection or a new one, up to ``STALE_RETRIES``).
- a slow reader is not buffered without bound: reading from the worker pauses past
  ``HIGH_WATER`` bytes queued and resumes below ``LOW_WATER``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, cast

import httptools
import httpx

# Sends of one request over kept-alive connections found closed before a response byte
# (a worker that restarted leaves several; the loop usually notices them first).
STALE_RETRIES = 3
HIGH_WATER = 1 << 20
LOW_WATER = 1 << 18
# Methods whose answer has a body to read (HEAD's does not, and the parser cannot be told).
METHODS = frozenset(("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"))
# Request headers this transport writes itself.
_FRAMING = (b"content-length", b"transfer-encoding")


def _expire(fut: asyncio.Future[None], exc: type[httpx.TimeoutException], msg: str) -> None:
    if not fut.done():
        fut.set_exception(exc(msg))


async def _wait(
    fut: asyncio.Future[None],
    limit_s: float | None,
    exc: type[httpx.TimeoutException],
    msg: str,
) -> None:
    """Await ``fut``; past ``limit_s`` seconds it fails with ``exc(msg)`` (one timer, no
    task; the exception is built only if the time runs out)."""
    if limit_s is None:
        await fut
        return
    handle = fut.get_loop().call_later(limit_s, _expire, fut, exc, msg)
    try:
        await fut
    finally:
        handle.cancel()


class _Stale(Exception):
    """A reused connection closed before a single response byte: safe to send again."""


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; at most one exchange at a time."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.counted = True  # holds one of the origin's connection slots
        self.reused = False
        self.idle_since = 0.0
        self.writable: asyncio.Future[None] | None = None
        # The body read's timeout: a deadline (loop time) behind one lazily re-armed
        # timer, not a timer per wait: a stream waits once per event, and creating and
        # cancelling a timer costs ~1.7 µs each time (more than the rest of the wait).
        self.read_due: float | None = None
        self.read_timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.active = False
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head: asyncio.Future[None] | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.got_bytes = False
        self.reading_paused = False

    # ---------------------------------------------------------------- protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if not self.active or self.complete:
            # Bytes nobody asked for (idle, or past the end of the answer): the
            # connection is out of step and not reused; what was read stays readable.
            self.close()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("the worker switched protocols"))
            self.close()
        except httptools.HttpParserError as e:
            self._fail(httpx.RemoteProtocolError(f"invalid HTTP from the worker: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._drop_read_timer()
        self.origin.forget(self)
        if self.writable is not None and not self.writable.done():
            self.writable.set_exception(httpx.WriteError("connection closed while writing"))
        if not self.active or self.complete:
            return
        if self.head is not None and not self.head.done():
            if self.reused and not self.got_bytes:
                self._fail(_Stale())
            else:
                self._fail(
                    httpx.RemoteProtocolError("Server disconnected without sending a response.")
                )
        elif self._until_close():
            self._done()
        else:
            self._fail(
                httpx.RemoteProtocolError("the worker closed the connection before the body ended")
            )

    def pause_writing(self) -> None:
        self.writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    # ---------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        self.reason = b""
        self.headers = []

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status < 200:  # informational (103 Early Hints, ...): the answer follows
            return
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.reading_paused and self.transport:
            self.reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def take(self) -> bytes:
        """The body bytes received so far (there are some), joined; reading resumes if
        it was paused for them."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()
        return data

    def on_message_complete(self) -> None:
        if self.status < 200:
            return
        self.keep_alive = self.parser.should_keep_alive()
        self._done()

    # ---------------------------------------------------------------- exchange

    def _until_close(self) -> bool:
        """Whether the answer's body is delimited by the connection closing."""
        for name, value in self.headers:
            n = name.lower()
            if n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value):
                return False
        return True

    def _done(self) -> None:
        self.complete = True
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        for fut in (self.head, self.waiter):
            if fut is not None and not fut.done():
                fut.set_exception(exc)

    async def send(self, data: bytes, timeouts: dict[str, float | None]) -> None:
        """Write the request and wait for the answer's head (status and headers)."""
        assert self.transport is not None
        self.active = True
        self.head = self.loop.create_future()
        self.transport.write(data)
        if self.writable is not None:
            await _wait(
                self.writable,
                timeouts.get("write"),
                httpx.WriteTimeout,
                "write timed out",
            )
        # _wait's steps, inlined (every request waits here: one frame less on resume).
        head = self.head
        limit_s = timeouts.get("read")
        if limit_s is None:
            await head
            return
        handle = self.loop.call_later(limit_s, _expire, head, httpx.ReadTimeout, "read timed out")
        try:
            await head
        finally:
            handle.cancel()

    def finish(self) -> None:
        """End the exchange: keep the connection for the next request or close it."""
        if self.closed:
            return
        if self.complete and self.keep_alive and self.error is None and not self.chunks:
            self._reset()
            self.reused = True
            self.origin.release(self)
        else:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True
        self._drop_read_timer()
        self.origin.forget(self)

    def _drop_read_timer(self) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None

    async def wait_body(self, limit_s: float | None) -> None:
        """Wait for more of the answer's body; past ``limit_s`` seconds without any, the
        wait fails with ``httpx.ReadTimeout`` (the deadline of ``read_due``)."""
        fut = self.waiter = self.loop.create_future()
        if limit_s is None:
            await fut
            return
        self.read_due = self.loop.time() + limit_s
        if self.read_timer is None:
            self.read_timer = self.loop.call_at(self.read_due, self._read_timer_fired)
        try:
            await fut
        finally:
            self.read_due = None

    def _read_timer_fired(self) -> None:
        """The body read's timer: a wait still past its deadline fails; a later wait's
        deadline re-arms it; with no wait left it is dropped."""
        self.read_timer = None
        due = self.read_due
        if due is None or self.closed:
            return
        if self.loop.time() < due:
            self.read_timer = self.loop.call_at(due, self._read_timer_fired)
            return
        _expire(self.waiter, httpx.ReadTimeout, "read timed out")  # type: ignore[arg-type]


class _Body(httpx.AsyncByteStream):
    def __init__(self, conn: Connection, read_timeout: float | None) -> None:
        self.conn = conn
        self.read_timeout = read_timeout
        self.ended = False
        self.raw_headers = conn.headers  # as received (a new list per answer)

    async def read_all(self) -> bytes:
        """The rest of the body, whole (what iterating would yield, joined), without
        an async generator."""
        conn = self.conn
        parts: list[bytes] = []
        while True:
            if conn.chunks:
                parts.append(conn.take())
                continue
            if conn.complete:
                break
            if conn.error is not None:
                raise conn.error
            await conn.wait_body(self.read_timeout)
        return b"" if not parts else parts[0] if len(parts) == 1 else b"".join(parts)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self.conn
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            await conn.wait_body(self.read_timeout)

    async def aclose(self) -> None:
        if not self.ended:
            self.ended = True
            self.conn.finish()


class Origin:
    """The connections to one worker (host, port): idle ones kept for reuse, newest first."""

    def __init__(
        self, host: str, port: int, max_connections: int, max_keepalive: int, expiry_s: float
    ) -> None:
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.max_keepalive = max_keepalive
        self.expiry_s = expiry_s
        self.idle: list[Connection] = []
        self.open: set[Connection] = set()
        self.slots: deque[asyncio.Future[None]] = deque()  # requests waiting for a slot
        self.dropped = False

    def __len__(self) -> int:
        return len(self.open)

    async def acquire(self, timeouts: dict[str, float | None]) -> Connection:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if conn.closed:
                continue
            if now - conn.idle_since > self.expiry_s:
                conn.close()
                continue
            return conn
        while len(self.open) >= self.max_connections:
            slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.slots.append(slot)
            try:
                await _wait(
                    slot,
                    timeouts.get("pool"),
                    httpx.PoolTimeout,
                    "no free connection",
                )
            finally:
                if slot in self.slots:
                    self.slots.remove(slot)
            if self.idle:
                return await self.acquire(timeouts)
        return await self._connect(timeouts.get("connect"))

    async def _connect(self, limit_s: float | None) -> Connection:
        loop = asyncio.get_running_loop()
        conn = Connection(self)
        self.open.add(conn)
        try:
            async with asyncio.timeout(limit_s):
                await loop.create_connection(lambda: conn, self.host, self.port)
        except TimeoutError:
            self.forget(conn)
            raise httpx.ConnectTimeout(f"connect to {self.host}:{self.port} timed out") from None
        except OSError as e:
            self.forget(conn)
            raise httpx.ConnectError(f"{e.strerror or e} ({self.host}:{self.port})") from None
        except BaseException:
            conn.close()
            raise
        return conn

    def release(self, conn: Connection) -> None:
        if self.dropped or len(self.idle) >= self.max_keepalive:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self.idle.append(conn)
        self._wake_one()

    def forget(self, conn: Connection) -> None:
        """A connection closed: its slot is free."""
        if conn.counted:
            conn.counted = False
            self.open.discard(conn)
            self._wake_one()

    def _wake_one(self) -> None:
        while self.slots:
            slot = self.slots.popleft()
            if not slot.done():
                slot.set_result(None)
                return

    def close(self) -> None:
        self.dropped = True
        for conn in list(self.open):
            if not conn.active:
                conn.close()
        self.idle.clear()


def _head(request: httpx.Request, body: bytes) -> bytes:
    url = request.url
    lines = [request.method.encode(), b" ", url.raw_path, b" HTTP/1.1\r\n"]
    n = 2  # line ends: the request line's and the blank line's
    for name, value in request.headers.raw:
        if name.lower() not in _FRAMING:
            lines += (name, b": ", value, b"\r\n")
            n += 1
    if body or request.method in ("POST", "PUT", "PATCH"):
        lines += (b"content-length: ", str(len(body)).encode(), b"\r\n")
        n += 1
    lines.append(b"\r\n")
    head = b"".join(lines)
    check_head(head, n)
    return head


def check_head(head: bytes, lines: int) -> None:
    """Refuse a request head with a CR or LF inside a header name or value (it would
    add a line: header injection). ``lines``: the line ends it should have."""
    if head.count(b"\n") != lines or head.count(b"\r") != lines:
        raise httpx.LocalProtocolError("a request header contains CR or LF")


async def send(origin: Origin, request: httpx.Request) -> httpx.Response:
    """Send ``request`` over one of ``origin``'s connections; the response streams."""
    timeouts: dict[str, Any] = request.extensions.get("timeout", {})
    body = await request.aread()
    return await exchange(origin, _head(request, body) + body, timeouts)


async def exchange(
    origin: Origin, data: bytes, timeouts: dict[str, float | None]
) -> httpx.Response:
    """Send a whole request (``data``: head and body) over one of ``origin``'s
    connections; the response streams."""
    for attempt in range(STALE_RETRIES + 1):
        try:
            conn = await origin.acquire(timeouts)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            if attempt == 0:
                raise
            # The request went out on a connection that then closed, and the worker no
            # longer takes connections: it died with the request on it, which says as
            # much about the request as about the worker (kvroute.service.attempts).
            raise httpx.RemoteProtocolError(
                "Server disconnected without sending a response, then refused a new connection."
            ) from None
        try:
            await conn.send(data, timeouts)
        except _Stale:
            conn.close()
            if attempt < STALE_RETRIES:
                continue
            raise httpx.RemoteProtocolError(
                "Server disconnected without sending a response."
            ) from None
        except BaseException:
            conn.close()
            raise
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=_Body(conn, timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": conn.reason},
        )
    raise AssertionError("unreachable")


def raw_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    """The answer's headers as received (names as the worker spelled them), without
    going through ``httpx.Headers`` (whose lookups of a missing name raise and catch
    a KeyError, and which works out the headers' encoding first) when it came from here."""
    stream = response.stream
    if isinstance(stream, _Body):
        return stream.raw_headers
    return response.headers.raw


async def read_whole(response: httpx.Response) -> bytes | None:
    """An answer of this pool with no Content-Encoding: its whole body, the response
    closed (its connection kept for reuse). None: not one of those; read it with httpx."""
    stream = response.stream
    if not isinstance(stream, _Body):
        return None
    for name, _ in stream.raw_headers:
        if name.lower() == b"content-encoding":
            return None
    try:
        return await stream.read_all()
    finally:
        response.is_closed = True
        await stream.aclose()
