"""The router's client connections send a response's head and body in one write."""

from __future__ import annotations

import asyncio
from typing import Any

from kvroute.service.connections import _HeadHoldingTransport

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


def held(rec: Recording) -> _HeadHoldingTransport:
    return _HeadHoldingTransport(rec, asyncio.get_running_loop())  # type: ignore[arg-type]


async def test_head_and_body_leave_in_one_write() -> None:
    rec = Recording()
    t = held(rec)
    t.write(HEAD)
    assert rec.writes == []
    t.write(b"ok")
    assert rec.writes == [HEAD + b"ok"]
    await asyncio.sleep(0)  # the pending flush finds nothing left
    assert rec.writes == [HEAD + b"ok"]


async def test_a_head_alone_goes_out_on_the_next_turn_of_the_loop() -> None:
    rec = Recording()
    t = held(rec)
    t.write(HEAD)  # a stream whose first chunk is not there yet, or a 204
    await asyncio.sleep(0)
    assert rec.writes == [HEAD]
    t.write(b"data: 1\n\n")  # later chunks are written as they come
    assert rec.writes == [HEAD, b"data: 1\n\n"]


async def test_closing_sends_the_held_head_first() -> None:
    rec = Recording()
    t = held(rec)
    t.write(HEAD)
    t.close()
    assert rec.writes == [HEAD] and rec.events == ["close"]
    rec2 = Recording()
    t2 = held(rec2)
    t2.write(HEAD)
    t2.write_eof()
    assert rec2.writes == [HEAD] and rec2.events == ["eof"]


async def test_other_writes_pass_straight_through() -> None:
    rec = Recording()
    t = held(rec)
    t.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # interim answers are not held
    t.write(b"abc")
    assert rec.writes == [b"HTTP/1.1 100 Continue\r\n\r\n", b"abc"]
    assert t.get_extra_info("peername") == "info:peername"


async def test_abort_drops_the_held_head() -> None:
    rec = Recording()
    t = held(rec)
    t.write(HEAD)
    t.abort()
    await asyncio.sleep(0)
    assert rec.writes == [] and rec.events == ["abort"]
