"""``ProxyStream``: a streamed answer relayed chunk by chunk; a client that leaves ends
it at once (the body's generator is closed: the upstream request with it), cleanup runs
exactly once however it ends, and a cancellation from outside is not swallowed unless
the router is draining."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvroute.service.proxy import ProxyStream


class Body:
    """A body that yields ``n`` chunks (forever when None), a short pause before each,
    and records whether it was closed."""

    def __init__(self, n: int | None) -> None:
        self.n = n
        self.closed = False
        self.yielded = 0

    async def __call__(self) -> AsyncIterator[bytes]:
        try:
            while self.n is None or self.yielded < self.n:
                await asyncio.sleep(0.01)
                self.yielded += 1
                yield b"data: %d\n\n" % self.yielded
        finally:
            self.closed = True


def _stream(body: Body, cleaned: list[int], draining: bool = False) -> ProxyStream:
    async def cleanup() -> None:
        cleaned.append(1)

    headers = [(b"content-type", b"text/event-stream")]
    return ProxyStream(body(), 200, headers, cleanup, lambda: draining)


async def test_chunks_go_out_in_order_and_cleanup_runs_once() -> None:
    body, cleaned, sent = Body(3), [], []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await _stream(body, cleaned)({"type": "http"}, receive, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert [m["body"] for m in sent[1:]] == [b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n", b""]
    assert [m["more_body"] for m in sent[1:]] == [True, True, True, False]
    assert cleaned == [1] and body.closed


async def test_a_client_that_leaves_ends_an_endless_stream() -> None:
    body, cleaned, sent = Body(None), [], []
    left = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if len(sent) == 3:  # the head and two chunks reached the client, then it left
            left.set()

    # Bounded: without the disconnect ending it, this stream never ends.
    await asyncio.wait_for(_stream(body, cleaned)({"type": "http"}, receive, send), 10)
    assert body.closed and cleaned == [1]
    assert body.yielded <= 4
    assert not any(m.get("more_body") is False for m in sent)  # no end was sent
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the cancellation was absorbed


async def test_a_disconnect_message_after_other_messages_is_still_seen() -> None:
    body, cleaned = Body(None), []
    messages = [{"type": "http.request", "body": b"", "more_body": False}] * 2
    messages.append({"type": "http.disconnect"})

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0.05)
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        pass

    await asyncio.wait_for(_stream(body, cleaned)({"type": "http"}, receive, send), 10)
    assert body.closed and cleaned == [1]


@pytest.mark.parametrize("draining", [False, True])
async def test_a_cancellation_from_outside(draining: bool) -> None:
    """Not draining: it propagates. Draining (the shutdown grace period ran out): the
    client gets an error event instead of a bare cut."""
    body, cleaned, sent = Body(None), [], []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    task = asyncio.ensure_future(_stream(body, cleaned, draining)({"type": "http"}, receive, send))
    for _ in range(1000):  # the head and two chunks sent
        if len(sent) >= 3:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    if draining:
        await task
        assert b'"code":"shutting_down"' in sent[-1]["body"]
    else:
        with pytest.raises(asyncio.CancelledError):
            await task
    assert body.closed and cleaned == [1]
