"""Attempt deadlines behind one timer (``kvroute.service.deadlines``): the contract of
``asyncio.timeout_at``, without a timer per attempt."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from kvroute.config import Settings
from kvroute.service.app import create_app
from kvroute.service.deadlines import Deadlines


async def test_past_its_time_the_body_is_cancelled_and_timeout_raised() -> None:
    loop = asyncio.get_running_loop()
    d = Deadlines(loop)
    reached = False
    with pytest.raises(TimeoutError):
        async with d.at(loop.time() + 0.05):
            await asyncio.sleep(30)
            reached = True
    assert not reached
    # Done in time: nothing raised, and the body ran to its end.
    async with d.at(loop.time() + 30):
        await asyncio.sleep(0)
        reached = True
    assert reached


async def test_reschedule_moves_the_deadline() -> None:
    loop = asyncio.get_running_loop()
    d = Deadlines(loop)
    with pytest.raises(TimeoutError):  # to now: at once
        async with d.at(loop.time() + 30) as scope:
            scope.reschedule(loop.time())
            await asyncio.sleep(30)
    async with d.at(loop.time() + 0.02) as scope:  # later: the first time passes
        scope.reschedule(loop.time() + 30)
        await asyncio.sleep(0.1)
    with pytest.raises(RuntimeError):
        scope.reschedule(loop.time() + 1)  # ended


async def test_the_callers_own_cancellation_is_not_a_timeout() -> None:
    loop = asyncio.get_running_loop()
    d = Deadlines(loop)

    async def body() -> None:
        async with d.at(loop.time() + 30):
            await asyncio.sleep(30)

    task = asyncio.create_task(body())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_many_scopes_one_timer_and_a_short_heap() -> None:
    loop = asyncio.get_running_loop()
    d = Deadlines(loop)
    for i in range(1000):
        async with d.at(loop.time() + 30 + i) as scope:
            scope.reschedule(loop.time() + 60 + i)
    assert len(d) <= 2
    # Interleaved scopes, the first still open: the others' deadlines still fire.
    outer = asyncio.create_task(asyncio.sleep(1))

    async def hold() -> None:
        async with d.at(loop.time() + 30):
            await outer

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        async with d.at(loop.time() + 0.02):
            await asyncio.sleep(30)
    outer.cancel()
    holder.cancel()
    with pytest.raises(asyncio.CancelledError):
        await holder


async def test_attempts_create_no_timer_each(monkeypatch: pytest.MonkeyPatch) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    worker = "http://w1:8000"
    app = create_app(Settings(worker_urls=[worker], policy="round_robin").validate())
    async with app.router.lifespan_context(app):
        await app.state.router.use_transport(httpx.MockTransport(answer))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
            await client.post("/v1/completions", json={"prompt": "warm"})
            loop = asyncio.get_running_loop()
            timers = 0
            call_at = loop.call_at

            def counting(*args: Any, **kwargs: Any) -> asyncio.TimerHandle:
                nonlocal timers
                timers += 1
                return call_at(*args, **kwargs)

            monkeypatch.setattr(loop, "call_at", counting)
            for i in range(50):
                r = await client.post("/v1/completions", json={"prompt": f"p{i}"})
                assert r.status_code == 200
            monkeypatch.undo()
    assert timers <= 2
