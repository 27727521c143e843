"""The upstream client: a pool per worker origin, lean headers, the HTTP/1.1 pool's
keep-alive, streaming, flow control and errors; and
the ASGI fast path's error rendering."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import uvloop

from kvroute.config import Settings
from kvroute.eval.procs import free_port
from kvroute.service import h1pool, upstream
from kvroute.service.app import create_app
from kvroute.service.upstream import create_client


async def _http_server(seen: list[bytes]) -> tuple[asyncio.Server, str]:
    """A keep-alive HTTP/1.1 server that records each request head and answers 200."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                seen.append(head)
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


@pytest.fixture
async def two_servers() -> AsyncIterator[tuple[list[bytes], list[str]]]:
    seen: list[bytes] = []
    servers = [await _http_server(seen) for _ in range(2)]
    yield seen, [url for _, url in servers]
    for server, _ in servers:
        server.close()
        await server.wait_closed()


async def test_one_pool_per_worker_and_drop(two_servers: tuple[list[bytes], list[str]]) -> None:
    seen, urls = two_servers
    client, pools = create_client(connect_s=2, first_byte_s=2, pool_s=2)
    try:
        for _ in range(5):
            for url in urls:
                r = await client.post(url + "/v1/completions", content=b"{}")
                assert r.status_code == 200 and r.content == b"ok"
        assert len(pools) == 2
        # Requests one after another reuse one kept-alive connection per worker.
        assert pools.connections() == 2
        # HEAD has no body to parse: it goes through httpcore's sharded pools.
        assert (await client.head(urls[1] + "/x")).status_code == 200
        assert len(pools) == 3 and len(pools._pools) == 1
        await pools.drop(urls[0] + "/")
        assert len(pools) == 2 and pools.connections() == 1
        await pools.drop("http://127.0.0.1:1")  # unknown: nothing happens
        assert len(pools) == 2
    finally:
        await client.aclose()
    assert len(pools) == 0
    head = seen[0].lower()
    assert head.startswith(b"post /v1/completions http/1.1\r\n")
    assert b"user-agent: kvroute" in head and b"content-length: 2" in head
    assert b"host: 127.0.0.1:" in head
    for dropped in (b"accept-encoding", b"accept:", b"connection:"):
        assert dropped not in head


# ----------------------------------------------------------------- the lean HTTP/1.1 pool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    """Start raw TCP servers whose handler gets (reader, writer, connection number)."""
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> str:
        count = 0

        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal count
            count += 1
            try:
                await handler(reader, writer, count)
            except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


@pytest.fixture
async def client() -> AsyncIterator[tuple[httpx.AsyncClient, upstream.PerWorkerPools]]:
    c, pools = create_client(connect_s=2, first_byte_s=1, pool_s=1)
    yield c, pools
    await c.aclose()


Client = tuple[httpx.AsyncClient, upstream.PerWorkerPools]


async def test_keep_alive_race_is_retried_on_a_new_connection(
    serve: Callable[[Handler], Awaitable[str]], client: Client
) -> None:
    """The worker closes a kept-alive connection just as the next request arrives (not
    one byte of answer): the request goes out again on a fresh connection."""
    conns: list[int] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await _read_request(r)
        conns.append(n)
        w.write(_ok(b"first" if n == 1 else b"again"))
        await w.drain()
        await _read_request(r)  # the next request on this connection: drop it unanswered

    url = await serve(handler)
    c, _ = client
    assert (await c.post(url + "/a", content=b"x")).content == b"first"
    assert (await c.post(url + "/a", content=b"y")).content == b"again"
    assert conns == [1, 2]


async def test_several_stale_connections_then_a_fresh_one(
    serve: Callable[[Handler], Awaitable[str]], client: Client
) -> None:
    """As after a worker restart: every kept-alive connection drops the next request
    unanswered; the request still gets through, on a new connection."""
    gate = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await _read_request(r)
        if n <= h1pool.STALE_RETRIES:
            await gate.wait()  # hold the first ones so they run side by side
            w.write(_ok(b"warm"))
            await w.drain()
            await _read_request(r)  # then drop the next request unanswered
            return
        w.write(_ok(b"fresh %d" % n))
        await w.drain()

    url = await serve(handler)
    c, pools = client
    warm = [asyncio.create_task(c.get(url + "/")) for _ in range(h1pool.STALE_RETRIES)]
    await asyncio.sleep(0.1)
    gate.set()
    assert [(await t).content for t in warm] == [b"warm"] * h1pool.STALE_RETRIES
    assert pools.connections() == h1pool.STALE_RETRIES
    r = await c.get(url + "/")
    assert r.content == b"fresh %d" % (h1pool.STALE_RETRIES + 1)


async def test_bytes_past_the_answer_retire_the_connection(
    serve: Callable[[Handler], Awaitable[str]], client: Client
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while True:
            await _read_request(r)
            w.write(_ok(b"answer %d" % n))
            await w.drain()
            await asyncio.sleep(0.05)
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nextra")  # unasked
            await w.drain()

    url = await serve(handler)
    c, _ = client
    async with c.stream("GET", url + "/") as resp:
        await asyncio.sleep(0.2)  # the extra bytes arrive before the body is read
        assert await resp.aread() == b"answer 1"
    assert (await c.get(url + "/")).content == b"answer 2"


async def test_idle_connection_closed_by_worker_is_not_reused(
    serve: Callable[[Handler], Awaitable[str]], client: Client
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await _read_request(r)
        w.write(_ok(b"%d" % n))
        await w.drain()  # then close: the loop tells the pool before the next request

    url = await serve(handler)
    c, pools = client
    assert (await c.get(url + "/")).content == b"1"
    for _ in range(100):
        if pools.connections() == 0:
            break
        await asyncio.sleep(0.01)
    assert pools.connections() == 0
    assert (await c.get(url + "/")).content == b"2"


async def test_connection_close_and_close_delimited_bodies(
    serve: Callable[[Handler], Awaitable[str]], client: Client
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        req = await _read_request(r)
        if b"/delimited" in req:  # no length, no chunks: the body ends when the socket does
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil close")
        else:
            w.write(_ok(b"bye", b"connection: close\r\n"))
        await w.drain()

    url = await serve(handler)
    c, pools = client
    r = await c.get(url + "/delimited")
    assert r.content == b"until close" and r.headers["content-type"] == "text/plain"
    r = await c.get(url + "/")
    assert r.content == b"bye"
    assert pools.connections() == 0


async def test_informational_answers_are_skipped(
    serve: Callable[[Handler], Awaitable[str]], client: Client
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while True:
            await _read_request(r)
            w.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n")
            await w.drain()
            await asyncio.sleep(0.1)  # the hint arrives alone
            w.write(_ok(b"final", b"x-n: %d\r\n" % n))
            await w.drain()

    url = await serve(handler)
    c, pools = client
    for _ in range(2):
        r = await c.get(url + "/")
        assert r.status_code == 200 and r.content == b"final"
        assert "link" not in r.headers and r.headers["x-n"] == "1"
    assert pools.connections() == 1


async def test_chunked_stream_arrives_piece_by_piece(
    serve: Callable[[Handler], Awaitable[str]], client: Client
) -> None:
    go = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await w.drain()
        await go.wait()
        w.write(b"6\r\n world\r\n0\r\n\r\n")
        await w.drain()
        await _read_request(r)
        w.write(_ok(b"reused"))
        await w.drain()

    url = await serve(handler)
    c, pools = client
    async with c.stream("POST", url + "/s", content=b"{}") as resp:
        pieces = resp.aiter_raw()
        assert await anext(pieces) == b"hello"  # before the worker sent the rest
        go.set()
        assert [p async for p in pieces] == [b" world"]
    assert (await c.post(url + "/s", content=b"{}")).content == b"reused"
    assert pools.connections() == 1


async def test_stream_closed_early_closes_the_worker_connection(
    serve: Callable[[Handler], Awaitable[str]], client: Client
) -> None:
    eof = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await w.drain()
        if await r.read(1) == b"":
            eof.set()

    url = await serve(handler)
    c, pools = client
    async with c.stream("POST", url + "/s", content=b"{}") as resp:
        async for _ in resp.aiter_raw():
            break
    await asyncio.wait_for(eof.wait(), 2)
    assert pools.connections() == 0


async def test_errors_are_httpx_errors(
    serve: Callable[[Handler], Awaitable[str]], client: Client
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        req = await _read_request(r)
        if b"/short" in req:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf")
        elif b"/garbage" in req:
            w.write(b"NOT HTTP AT ALL\r\n\r\n")
        elif b"/silent" in req:
            await asyncio.sleep(3)
        elif b"/nothing" in req:
            pass  # close without a byte, on a fresh connection
        await w.drain()

    url = await serve(handler)
    c, pools = client
    with pytest.raises(httpx.RemoteProtocolError):
        await c.get(url + "/short")
    with pytest.raises(httpx.RemoteProtocolError):
        await c.get(url + "/garbage")
    with pytest.raises(httpx.RemoteProtocolError):
        await c.get(url + "/nothing")
    with pytest.raises(httpx.ReadTimeout):
        await c.get(url + "/silent")  # first-byte timeout of 1 s
    with pytest.raises(httpx.ConnectError):
        await c.get(f"http://127.0.0.1:{free_port()}/")
    with pytest.raises(httpx.LocalProtocolError):
        await c.get(url + "/", headers={"x-bad": "a\r\nx-injected: 1"})
    assert pools.connections() == 0


async def test_pool_limit_waits_then_times_out(
    serve: Callable[[Handler], Awaitable[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    release = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while True:
            await _read_request(r)
            await release.wait()
            w.write(_ok(b"%d" % n))
            await w.drain()

    monkeypatch.setattr(upstream, "MAX_CONNECTIONS_PER_WORKER", 1)
    url = await serve(handler)
    c, pools = create_client(connect_s=2, first_byte_s=5, pool_s=0.3)
    try:
        first = asyncio.create_task(c.get(url + "/"))
        await asyncio.sleep(0.05)
        with pytest.raises(httpx.PoolTimeout):
            await c.get(url + "/")
        second = asyncio.create_task(c.get(url + "/"))  # waits for the slot, then reuses it
        await asyncio.sleep(0.05)
        release.set()
        assert (await first).content == b"1" and (await second).content == b"1"
        assert pools.connections() == 1
    finally:
        await c.aclose()


async def test_slow_reader_pauses_the_worker_connection(
    serve: Callable[[Handler], Awaitable[str]], client: Client
) -> None:
    size = 16 * h1pool.HIGH_WATER

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        piece = b"x" * 65536
        for _ in range(size // len(piece)):
            w.write(piece)
            await w.drain()

    url = await serve(handler)
    c, pools = client
    got = 0
    async with c.stream("GET", url + "/big") as resp:
        conn = next(iter(pools._origins.values())).open.copy().pop()
        async for chunk in resp.aiter_raw():
            got += len(chunk)
            await asyncio.sleep(0.01)  # a slow client
            # Never more than the high-water mark plus what one read brings in.
            assert conn.buffered <= h1pool.HIGH_WATER + 262144
    assert got == size


@pytest.mark.timeout(60)
def test_pool_on_uvloop() -> None:
    """The router serves on uvloop, whose transports differ from asyncio's: keep-alive
    reuse, a streamed body and an early close there."""

    async def scenario() -> None:
        requests = 0

        async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            nonlocal requests
            try:
                while True:
                    req = await _read_request(r)
                    requests += 1
                    if b"/stream" in req:
                        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                        w.write(b"2\r\nab\r\n2\r\ncd\r\n0\r\n\r\n")
                    else:
                        w.write(_ok(b"ok"))
                    await w.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                w.close()

        server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        c, pools = create_client(connect_s=2, first_byte_s=2, pool_s=2)
        try:
            for _ in range(3):
                assert (await c.post(url + "/x", content=b"{}")).content == b"ok"
            assert (await c.post(url + "/stream", content=b"{}")).content == b"abcd"
            assert pools.connections() == 1 and requests == 4
            async with c.stream("POST", url + "/stream", content=b"{}") as resp:
                async for _ in resp.aiter_raw():
                    break
            assert pools.connections() in (0, 1)  # closed early unless it had all come in
        finally:
            await c.aclose()
            server.close()

    uvloop.run(scenario())


async def test_fast_path_renders_unexpected_errors_as_openai_500() -> None:
    app = create_app(Settings(worker_urls=["http://w1:8000"]).validate())

    async def broken(*_: object) -> None:
        raise RuntimeError("boom")

    app.inference = broken  # type: ignore[assignment]
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://router"
    ) as c:
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["code"] == "internal_error" and "boom" not in err["message"]
        # Other routes still go through FastAPI.
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/v1/completions")).status_code == 405


def _no_request(*args: object, **kwargs: object) -> None:
    raise AssertionError("an httpx.Request was built")


async def test_forward_writes_the_request_as_the_transport_would(
    two_servers: tuple[list[bytes], list[str]],
) -> None:
    """``Forward.post`` writes a plain-HTTP worker's request itself (no httpx.Request):
    the same head, byte for byte, as the transport writes for the same request; a CR or
    LF in a header is refused; a worker dropped and added back gets new connections."""
    seen, urls = two_servers
    client, pools = create_client(connect_s=2, first_byte_s=2, pool_s=2)
    forward = upstream.Forward(client, pools)
    headers = {"content-type": "application/json", "x-request-id": "r1", "accept": "*/*"}
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(httpx.Request, "__init__", _no_request)
            r = await forward.post(urls[0] + "/v1/chat/completions", b'{"a":1}', headers)
        assert r.status_code == 200 and await r.aread() == b"ok"
        raw = [(k.encode(), v.encode()) for k, v in headers.items()]
        raw += [(b"host", urls[0].removeprefix("http://").encode()), (b"content-length", b"7")]
        raw.append((b"user-agent", b"kvroute"))
        old = httpx.Request(
            "POST",
            urls[0] + "/v1/chat/completions",
            stream=httpx.ByteStream(b'{"a":1}'),
            headers=raw,
            extensions=forward.extensions,
        )
        r = await pools.handle_async_request(old)
        await r.aread()
        assert len(seen) == 2 and seen[0] == seen[1]
        assert seen[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        with pytest.raises(httpx.LocalProtocolError):
            await forward.post(urls[0] + "/x", b"{}", {"x-request-id": "a\r\nx-evil: 1"})
        assert len(seen) == 2  # nothing went out
        assert pools.connections() == 1
        await pools.drop(urls[0])
        assert pools.connections() == 0
        r = await forward.post(urls[0] + "/v1/chat/completions", b"{}", headers)
        assert r.status_code == 200 and await r.aread() == b"ok"
        assert pools.connections() == 1  # a new pool, not the dropped one
    finally:
        await client.aclose()


async def test_answers_read_whole_without_header_lookups_or_spare_exceptions(
    serve: Callable[[Handler], Awaitable[str]], client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain answer from the worker connections is read whole without httpx.Headers
    lookups and without building the timeout exceptions it did not need; an answer with
    a Content-Encoding still goes through httpx's decoder."""
    import gzip

    from kvroute.service.attempts import read_answer

    packed = gzip.compress(b"unpacked")

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while True:
            path = (await _read_request(r)).split(b" ")[1]
            if path == b"/gz":
                w.write(_ok(packed, b"Content-Encoding: gzip\r\n"))
            elif path == b"/late":  # the body after the head, in two pieces
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n")
                await w.drain()
                await asyncio.sleep(0.05)
                w.write(b"late ")
                await w.drain()
                await asyncio.sleep(0.05)
                w.write(b"body!")
            else:
                w.write(_ok(b"hello", b"Content-Type: application/json\r\n"))
            await w.drain()

    url = await serve(handler)
    c, pools = client
    forward = upstream.Forward(c, pools)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("not on this path")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(httpx.Headers, "__contains__", refuse)
        m.setattr(httpx.Headers, "__getitem__", refuse)
        m.setattr(httpx.TimeoutException, "__init__", refuse)
        for _ in range(2):
            answer = await forward.post(url + "/v1/completions", b"{}", {})
            assert await read_answer(answer) == b"hello"
            assert answer.is_closed
        names = [k.lower() for k, _ in h1pool.raw_headers(answer)]
        assert names == [b"content-length", b"content-type"]
        answer = await forward.post(url + "/late", b"{}", {})
        assert await read_answer(answer) == b"late body!"
    assert pools.connections() == 1  # kept alive and reused
    answer = await forward.post(url + "/gz", b"{}", {})
    assert await read_answer(answer) == b"unpacked"


async def test_a_body_read_times_out_after_a_silence_not_a_long_stream(
    serve: Callable[[Handler], Awaitable[str]], client: Client
) -> None:
    """The body's read timeout (1 s here) counts from the last bytes received: a stream
    whose chunks come 0.4 s apart for 2 s is read whole (one timer, re-armed, serves
    every wait), one that goes silent for longer fails with ReadTimeout; so does a read
    of the whole body."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while True:
            req = await _read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
            await w.drain()
            if b"/steady" in req:
                for _ in range(4):
                    await asyncio.sleep(0.4)
                    w.write(b"1\r\na\r\n")
                    await w.drain()
                w.write(b"0\r\n\r\n")
                await w.drain()
            else:
                await asyncio.sleep(3)
                return

    url = await serve(handler)
    c, pools = client
    async with c.stream("POST", url + "/steady", content=b"{}") as resp:
        body = b"".join([chunk async for chunk in resp.aiter_raw()])
    assert body == b"a" * 5
    assert (await c.post(url + "/steady", content=b"{}")).content == b"a" * 5
    with pytest.raises(httpx.ReadTimeout):
        async with c.stream("POST", url + "/silent", content=b"{}") as resp:
            async for _ in resp.aiter_raw():
                pass
    with pytest.raises(httpx.ReadTimeout):
        await c.post(url + "/silent", content=b"{}")
    assert pools.connections() == 0
