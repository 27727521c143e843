"""The retry rules in-process (mocked workers): which answers are retried, what a
refused request leaves in the index, and the first-byte deadline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvroute.config import Settings
from kvroute.service.app import create_app
from kvroute.service.attempts import first_byte_deadline, usage_fields
from kvroute.service.quarantine import Quarantine, fingerprint, first_byte_secs, output_tokens

URLS = ["http://w1:8000", "http://w2:8000", "http://w3:8000"]
Answer = Callable[[str, httpx.Request], httpx.Response]


async def run(
    answer: Answer, n: int = 1, **settings: Any
) -> tuple[list[httpx.Response], Any, list[str]]:
    """``n`` requests through a router whose workers answer with ``answer(worker, req)``."""
    hits: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        base = f"http://{request.url.host}:{request.url.port}"
        if request.url.path in ("/health", "/metrics", "/v1/models", "/get_server_info"):
            return httpx.Response(200)
        hits.append(base)
        return answer(base, request)

    kw = {"worker_urls": URLS, "policy": "round_robin", **settings}
    app = create_app(Settings(**kw).validate())
    out = []
    async with app.router.lifespan_context(app):
        state = app.state.router
        await state.use_transport(httpx.MockTransport(handle))
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://r"
        ) as c:
            for i in range(n):
                out.append(await c.post("/v1/completions", json={"prompt": f"question {i}"}))
    return out, state, hits


def ok() -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"text": "ok"}]})


def err(status: int, **headers: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": f"said {status}"}}, headers=headers)


@pytest.mark.parametrize("status", [502, 503, 504])
async def test_gateway_5xx_is_retried_on_another_worker(status: int) -> None:
    (r,), state, hits = await run(lambda w, _: err(status) if w == URLS[0] else ok())
    assert r.status_code == 200 and len(hits) == 2 and hits[0] == URLS[0]
    assert r.headers["x-kvroute-worker"] == hits[1] != URLS[0]
    assert state.registry.workers[URLS[0]].served == 0, "a refused request is not served"


async def test_500_is_retried_only_when_marked_retryable() -> None:
    (r,), _, hits = await run(lambda w, _: err(500) if w == URLS[0] else ok())
    assert r.status_code == 500 and r.json()["error"]["message"] == "said 500"
    assert hits == URLS[:1]
    (r,), _, hits = await run(
        lambda w, _: err(500, **{"retry-after": "1"}) if w == URLS[0] else ok()
    )
    assert r.status_code == 200 and len(hits) == 2 and hits[0] == URLS[0]


@pytest.mark.parametrize("status", [400, 404, 413, 422, 429])
async def test_4xx_passes_through_unchanged(status: int) -> None:
    (r,), _, hits = await run(lambda w, _: err(status))
    assert r.status_code == status and r.json() == {"error": {"message": f"said {status}"}}
    assert len(hits) == 1


async def test_retries_bounded_and_last_5xx_passed_through() -> None:
    (r,), _, hits = await run(lambda w, _: err(503), max_retries=1)
    assert len(hits) == 2
    assert r.status_code == 503 and r.json()["error"]["message"] == "said 503"
    (r,), _, hits = await run(lambda w, _: err(503))
    assert sorted(hits) == URLS, "each worker once"
    assert r.status_code == 503


async def test_refused_prompt_is_rolled_back_from_the_index() -> None:
    """A worker refusing the request (4xx/5xx before any output) holds none of it; an
    accepted one does."""

    def answer(w: str, req: httpx.Request) -> httpx.Response:
        return err(400) if b"too long" in req.content else ok()

    hits: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/health", "/metrics", "/v1/models", "/get_server_info"):
            return httpx.Response(200)
        hits.append(str(request.url))
        return answer("", request)

    app = create_app(Settings(worker_urls=URLS[:1]).validate())
    async with app.router.lifespan_context(app):
        state = app.state.router
        await state.use_transport(httpx.MockTransport(handle))
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://r"
        ) as c:
            shared = "a shared system prompt. " * 20
            assert (await c.post("/v1/completions", json={"prompt": shared})).status_code == 200
            held = state.index.cached_tokens(URLS[0])
            assert held == len(shared.encode())
            for _ in range(2):
                r = await c.post("/v1/completions", json={"prompt": shared + "too long " * 50})
                assert r.status_code == 400
            assert state.index.cached_tokens(URLS[0]) == held, "the refused tail is gone"
            listed = (await c.get("/workers")).json()[0]
            assert listed["requests_served"] == 1 and listed["cached_tokens"] == held


def test_first_byte_deadline_grows_with_the_prompt_between_floor_and_cap() -> None:
    floor, cap = 60.0, 600.0
    small = first_byte_secs(100, floor_s=floor, cap_s=cap)
    big = first_byte_secs(20_000, floor_s=floor, cap_s=cap)
    assert floor < small < big < cap
    assert first_byte_secs(10_000_000, floor_s=floor, cap_s=cap) == cap
    assert first_byte_secs(0, floor_s=floor, cap_s=cap) == floor
    assert first_byte_secs(100, floor_s=floor, cap_s=1.0) == 1.0, "the cap wins"
    # A known fast worker is still given a conservative deadline; a slow one more time.
    assert first_byte_secs(20_000, floor_s=floor, cap_s=cap, prefill_tokens_per_s=1e6) == big
    assert first_byte_secs(20_000, floor_s=floor, cap_s=cap, prefill_tokens_per_s=100) > big
    # Non-streamed: the whole completion comes first; unbounded output waits the cap.
    assert first_byte_secs(100, floor_s=floor, cap_s=cap, streaming=False) == cap
    longer = first_byte_secs(100, floor_s=floor, cap_s=cap, streaming=False, output_tokens=100)
    assert small < longer < cap
    assert output_tokens({"max_tokens": 7}) == 7
    assert output_tokens({"sampling_params": {"max_new_tokens": 9}}) == 9
    assert output_tokens({"max_tokens": True}) is None and output_tokens({}) is None


def test_quarantine_expires_and_is_bounded() -> None:
    fp = fingerprint([1, 2, 3], b"")
    assert fp == fingerprint((1, 2, 3), b"ignored") != fingerprint([1, 2, 4], b"")
    assert fingerprint([], b"body") == fingerprint([], b"body")
    q = Quarantine(ttl_s=60, max_size=2)
    q.add(1)
    q.add(2)
    q.add(3)
    assert not q.holds(1) and q.holds(2) and q.holds(3) and len(q) == 2
    off = Quarantine(ttl_s=0)
    off.add(1)
    assert not off.holds(1)
    expired = Quarantine(ttl_s=1e-9)
    expired.add(5)
    assert not expired.holds(5)


def test_a_streams_deadline_follows_its_predicted_time_to_first_token() -> None:
    """A 100k-token prompt: at the conservative rate its deadline is the cap; the work
    model predicts ~7 s on a worker prefilling 15k tokens/s, so the stream gives up after
    the floor plus 8x that instead. Never longer than the size-based deadline, and a
    non-streamed answer keeps it (its first byte is its last)."""
    floor, cap = 60.0, 600.0
    size_based = first_byte_secs(100_000, floor_s=floor, cap_s=cap)
    assert size_based == cap
    predicted = 100_000 / 15_000
    learned = first_byte_deadline(size_based, predicted, True, floor)
    assert learned == floor + 8 * predicted < cap
    assert first_byte_deadline(size_based, predicted, False, floor) == cap
    short = first_byte_secs(100, floor_s=floor, cap_s=cap)
    assert first_byte_deadline(short, 1000.0, True, floor) == short
    assert first_byte_deadline(short, 0.0, True, floor) == short


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        # OpenAI's shape, cached tokens among the prompt's details, reasoning among the output's
        (
            b'{"choices":[{"message":{"content":"a \\"usage\\": {\\"prompt_tokens\\": 7}"}}],'
            b'"usage":{"prompt_tokens":2000,"completion_tokens":12,"total_tokens":2012,'
            b'"prompt_tokens_details":{"cached_tokens":1536},'
            b'"completion_tokens_details":{"reasoning_tokens":5}}}',
            (2000, 12, 1536),
        ),
        # SGLang's /generate: no usage key, the counts in meta_info
        (
            b'{"text":"hi","meta_info":{"id":"x","prompt_tokens":300,"completion_tokens":4,'
            b'"cached_tokens":256}}',
            (300, 4, 256),
        ),
        # a stream's last events: a content event with a null usage, then the usage event
        (
            b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n'
            b'data: {"choices":[],"usage":{"prompt_tokens": 50, "completion_tokens" : 3}}\n\n'
            b"data: [DONE]\n\n",
            (50, 3, None),
        ),
        # nothing reported, or not as numbers
        (b'{"choices":[]}', (None, None, None)),
        (b'{"usage":{"prompt_tokens":null,"completion_tokens":"3"}}', (None, None, None)),
    ],
)
def test_usage_fields_read_what_the_answer_reports(
    answer: bytes, expected: tuple[int | None, int | None, int | None]
) -> None:
    assert usage_fields(answer) == expected
