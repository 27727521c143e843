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
