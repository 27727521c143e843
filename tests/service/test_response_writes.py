"""The router's client connections send a response's head and body in one write."""

from __future__ import annotations

from typing import Any

from kvroute.service.connections import COALESCE_MAX, _HeadHoldingTransport

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


class Recording:
    """A transport that records what is written to it and how it is closed."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.events: list[str] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.events.append("close")

    def write_eof(self) -> None:
        self.events.append("eof")

    def abort(self) -> None:
        self.events.append("abort")

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str) -> Any:
        return f"info:{name}"


async def test_head_and_body_leave_in_one_write() -> None:
    rec = Recording()
    t = _HeadHoldingTransport(rec)  # type: ignore[arg-type]
    t.write(HEAD)
    assert rec.writes == []
    t.write(b"ok")
    assert rec.writes == [HEAD + b"ok"]
    t.write(HEAD)  # the next answer on the connection, its body empty
    t.write(b"")
    assert rec.writes == [HEAD + b"ok", HEAD]


def test_a_big_body_follows_its_head_in_a_second_write() -> None:
    rec = Recording()
    t = _HeadHoldingTransport(rec)  # type: ignore[arg-type]
    big = b"x" * (COALESCE_MAX + 1)
    t.write(HEAD)
    t.write(big)
    assert rec.writes == [HEAD, big]


def test_a_stream_head_goes_out_at_once() -> None:
    """A chunked answer's first chunk may be seconds away: its head is not held."""
    rec = Recording()
    t = _HeadHoldingTransport(rec)  # type: ignore[arg-type]
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    t.write(head)
    assert rec.writes == [head]
    t.write(b"9\r\ndata: 1\n\n\r\n")
    assert rec.writes == [head, b"9\r\ndata: 1\n\n\r\n"]


def test_a_held_head_is_sent_by_flush_close_and_eof() -> None:
    for end in ("flush", "close", "write_eof"):
        rec = Recording()
        t = _HeadHoldingTransport(rec)  # type: ignore[arg-type]
        t.write(HEAD)
        getattr(t, end)()
        assert rec.writes == [HEAD], end
        assert rec.events == ({"close": ["close"], "write_eof": ["eof"]}.get(end, [])), end


def test_other_writes_pass_straight_through() -> None:
    rec = Recording()
    t = _HeadHoldingTransport(rec)  # type: ignore[arg-type]
    t.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # interim answers are not held
    t.write(b"abc")
    assert rec.writes == [b"HTTP/1.1 100 Continue\r\n\r\n", b"abc"]
    assert t.get_extra_info("peername") == "info:peername"


def test_abort_drops_the_held_head() -> None:
    rec = Recording()
    t = _HeadHoldingTransport(rec)  # type: ignore[arg-type]
    t.write(HEAD)
    t.abort()
    assert rec.writes == [] and rec.events == ["abort"]


async def test_keep_alive_deadline_needs_no_timer_per_request() -> None:
    """The keep-alive timeout after each answer is a deadline behind the connection's
    one timer (no uvicorn timer created and cancelled per request), and an idle
    kept-alive connection is still closed when it runs out."""
    import asyncio

    import uvicorn

    from kvroute.eval.procs import free_port
    from kvroute.service.connections import guarded_protocol

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http=guarded_protocol(8192, 5.0, 5.0),
        timeout_keep_alive=0.3,
        lifespan="off",
        log_level="warning",
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(5):
            writer.write(b"GET /x HTTP/1.1\r\nhost: a\r\n\r\n")
            answer = await asyncio.wait_for(reader.readuntil(b"ok"), 5)
            assert answer.startswith(b"HTTP/1.1 200 ")
            (proto,) = server.server_state.connections
            assert proto.timeout_keep_alive_task is None  # type: ignore[attr-defined]
        # Idle past the keep-alive timeout: the router closes the connection.
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
