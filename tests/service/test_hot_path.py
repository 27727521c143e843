"""The proxied routes' hot path: what it must do without (Starlette's request object,
a system call for request IDs, an await for a free admission slot), in-process against
a mocked worker."""

from __future__ import annotations

import asyncio
import gc
import os
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import starlette.requests

from kvroute.config import Settings
from kvroute.service.admission import Admission
from kvroute.service.app import create_app

WORKER = "http://w1:8000"


@pytest.fixture
async def router() -> AsyncIterator[tuple[httpx.AsyncClient, list[httpx.Request]]]:
    calls: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    app = create_app(Settings(worker_urls=[WORKER], policy="round_robin").validate())
    async with app.router.lifespan_context(app):
        await app.state.router.use_transport(httpx.MockTransport(handle))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
            yield client, calls


async def test_proxied_request_builds_no_starlette_request(
    router: tuple[httpx.AsyncClient, list[httpx.Request]], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, calls = router

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a Starlette Request was built on the proxied path")

    monkeypatch.setattr(starlette.requests.Request, "__init__", refuse)
    r = await client.post(
        "/v1/completions",
        json={"prompt": "hello"},
        headers={"x-request-id": "abc-1", "accept": "application/json"},
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "abc-1"
    sent = calls[-1].headers
    assert sent["x-request-id"] == "abc-1" and sent["accept"] == "application/json"
    # The admin API still goes through FastAPI (and so still builds one).
    monkeypatch.undo()
    assert (await client.get("/health")).status_code == 200


async def test_fresh_request_id_takes_no_system_call(
    router: tuple[httpx.AsyncClient, list[httpx.Request]], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, calls = router

    def refuse(n: int) -> bytes:
        raise AssertionError("os.urandom on the request path")

    monkeypatch.setattr(os, "urandom", refuse)
    ids = set()
    for bad in (None, "has space", "x" * 200):
        headers = {} if bad is None else {"x-request-id": bad}
        r = await client.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        assert re.fullmatch("[0-9a-f]{24}", rid)
        assert calls[-1].headers["x-request-id"] == rid
        ids.add(rid)
    assert len(ids) == 3


async def test_repeated_header_first_value_wins(
    router: tuple[httpx.AsyncClient, list[httpx.Request]],
) -> None:
    client, calls = router
    headers = [("x-request-id", "first"), ("x-request-id", "second")]
    r = await client.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
    assert r.headers["x-request-id"] == "first"
    assert calls[-1].headers["x-request-id"] == "first"


async def test_admission_slot_taken_and_given_back_without_await() -> None:
    unlimited = Admission(0, 0, 1.0)
    assert unlimited.try_acquire() and unlimited.active == 1
    assert unlimited.try_release() and unlimited.active == 0

    adm = Admission(1, 1, 5.0)
    assert adm.try_acquire()
    assert not adm.try_acquire()  # full: the caller queues with acquire()
    waiter = asyncio.create_task(adm.acquire())
    for _ in range(100):
        if adm.waiting:
            break
        await asyncio.sleep(0)
    assert adm.waiting == 1
    # Someone waits: the slot must go back through release(), which wakes them.
    assert not adm.try_release() and adm.active == 1
    await adm.release()
    await asyncio.wait_for(waiter, 5)
    assert adm.active == 1 and adm.waiting == 0
    assert adm.try_release() and adm.active == 0


async def test_reported_reuse_counted_once_per_whole_answer() -> None:
    """A whole answer's usage is read once (for the work model) and counted in the
    predicted-against-reported reuse metrics from that reading."""
    usage = {
        "prompt_tokens": 7,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 3},
    }

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"text": "ok"}], "usage": usage})

    app = create_app(Settings(worker_urls=[WORKER], policy="round_robin").validate())
    async with app.router.lifespan_context(app):
        state = app.state.router
        await state.use_transport(httpx.MockTransport(handle))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
            for _ in range(2):
                r = await client.post("/v1/completions", json={"prompt": "hi"})
                assert r.status_code == 200
        text = state.metrics.render().decode()
    assert 'kvroute_reported_cached_tokens_total{source="approximate"} 6.0' in text
    assert 'kvroute_reported_prompt_tokens_total{source="approximate"} 14.0' in text
    assert 'kvroute_predicted_cached_tokens_total{source="approximate"} 0.0' in text


async def test_whole_answers_reserve_work_without_a_prediction(
    router: tuple[httpx.AsyncClient, list[httpx.Request]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-streamed request's work is reserved (and released) without predicting its
    time to first token: nothing reads that prediction for a whole answer."""
    from kvroute.routing.load.model import LoadModel

    client, _ = router
    predicted: list[str] = []
    ttft = LoadModel.ttft

    def counting(self: LoadModel, worker: str, *args: Any, **kwargs: Any) -> float:
        predicted.append(worker)
        return ttft(self, worker, *args, **kwargs)

    monkeypatch.setattr(LoadModel, "ttft", counting)
    r = await client.post("/v1/completions", json={"prompt": "hello"})
    assert r.status_code == 200 and predicted == []
    r = await client.post("/v1/completions", json={"prompt": "hello", "stream": True})
    assert r.status_code == 200 and predicted == [WORKER]
    work = client._transport.app.state.router.work  # type: ignore[attr-defined]
    assert work.workers[WORKER].requests == 0  # both released


async def test_what_start_up_built_is_kept_out_of_the_collectors_walks() -> None:
    """A full collection would walk every object start-up made (a tokenizer's tables:
    ~116k objects, tens of ms of event loop held); they are frozen while serving and
    handed back to the collector at shutdown."""
    gc.unfreeze()
    app = create_app(Settings(worker_urls=[WORKER], policy="round_robin").validate())
    async with app.router.lifespan_context(app):
        assert gc.get_freeze_count() > 1000
    assert gc.get_freeze_count() == 0
