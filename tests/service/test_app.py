"""The router app in-process (ASGI transport) against mocked workers: input validation,
auth, admission and body limits, where no real wire is needed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from kvroute.config import ConfigError, Settings
from kvroute.service.app import create_app

WORKER = "http://w1:8000"


def mock_worker(calls: list[httpx.Request]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if request.url.path == "/health":
            return httpx.Response(200, json={"ok": True})
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    return httpx.MockTransport(handle)


async def make_client(
    calls: list[httpx.Request], **settings: Any
) -> tuple[httpx.AsyncClient, Callable[[], Any], Any]:
    app = create_app(Settings(worker_urls=[WORKER], **settings).validate())
    ctx = app.router.lifespan_context(app)
    await ctx.__aenter__()
    state = app.state.router
    await state.use_transport(mock_worker(calls))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
    return client, lambda: ctx.__aexit__(None, None, None), state


@pytest.fixture
async def router() -> AsyncIterator[tuple[httpx.AsyncClient, list[httpx.Request], Any]]:
    calls: list[httpx.Request] = []
    client, close, state = await make_client(calls)
    yield client, calls, state
    await client.aclose()
    await close()


BAD = [
    ("/v1/completions", b"{not json", "valid JSON"),
    ("/v1/completions", b"[1, 2]", "JSON object"),
    ("/v1/completions", b"", "empty"),
    ("/v1/completions", b'{"prompt": ""}', "empty"),
    ("/v1/completions", b'{"prompt": [1, -5]}', "token IDs"),
    ("/v1/completions", b'{"prompt": [99999999999]}', "token IDs"),
    ("/v1/completions", b'{"max_tokens": 3}', "'prompt' is required"),
    ("/v1/completions", b'{"prompt": {"a": 1}}', "must be a string"),
    ("/v1/chat/completions", b'{"messages": "hi"}', "non-empty list"),
    ("/v1/chat/completions", b'{"messages": [{"role": 1}]}', "role"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', "valid JSON"),
    ("/generate", b'{"sampling_params": {}}', "'text' or 'input_ids'"),
]


@pytest.mark.parametrize(("path", "body", "message"), BAD)
async def test_bad_input_gets_openai_4xx(router: Any, path: str, body: bytes, message: str) -> None:
    client, calls, state = router
    r = await client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert message in err["message"]
    assert err["type"] == "invalid_request_error" and err["code"]
    inference = [
        c
        for c in calls
        if c.url.path not in ("/health", "/metrics", "/v1/models", "/get_server_info")
    ]
    assert not inference, "nothing reached a worker"
    assert state.registry.workers[WORKER].in_flight == 0


async def test_unknown_route_and_method(router: Any) -> None:
    client, _, _ = router
    r = await client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = await client.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


async def test_body_size_limit() -> None:
    calls: list[httpx.Request] = []
    client, close, _ = await make_client(calls, max_body_bytes=2048)
    try:
        r = await client.post("/v1/completions", content=b'{"prompt": "' + b"a" * 5000 + b'"}')
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "payload_too_large"
    finally:
        await client.aclose()
        await close()


async def test_api_keys() -> None:
    calls: list[httpx.Request] = []
    client, close, _ = await make_client(
        calls, api_key="sekret", admin_api_key="admin", worker_api_key="wk"
    )
    try:
        body = {"prompt": "hi"}
        assert (await client.post("/v1/completions", json=body)).status_code == 401
        bad = {"authorization": "Bearer nope"}
        assert (await client.post("/v1/completions", json=body, headers=bad)).status_code == 401
        ok = {"authorization": "Bearer sekret"}
        r = await client.post("/v1/completions", json=body, headers=ok)
        assert r.status_code == 200
        sent = [c for c in calls if c.url.path == "/v1/completions"][-1]
        assert sent.headers["authorization"] == "Bearer wk", "replaced towards workers"
        assert (await client.get("/health")).status_code == 200, "health stays open"
        r = await client.post("/workers", json={"url": "http://w2:1"}, headers=ok)
        assert r.status_code == 401, "the client key is not the admin key"
        r = await client.post(
            "/workers", json={"url": "http://w2:1"}, headers={"authorization": "Bearer admin"}
        )
        assert r.status_code == 201
    finally:
        await client.aclose()
        await close()


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, "Bearer client-token"),  # no router key: the client's key is for the workers
        ({"api_key": "client-token"}, None),  # the router's own key never leaves it
        ({"api_key": "client-token", "worker_api_key": "wk"}, "Bearer wk"),
    ],
)
async def test_authorization_towards_workers(settings: dict[str, Any], expected: str) -> None:
    calls: list[httpx.Request] = []
    client, close, _ = await make_client(calls, **settings)
    try:
        auth = {"authorization": "Bearer client-token"}
        r = await client.post("/v1/completions", json={"prompt": "hi"}, headers=auth)
        assert r.status_code == 200
        sent = [c for c in calls if c.url.path == "/v1/completions"][-1]
        assert sent.headers.get("authorization") == expected
    finally:
        await client.aclose()
        await close()


async def test_admin_disabled_beyond_loopback_without_key() -> None:
    calls: list[httpx.Request] = []
    client, close, _ = await make_client(calls, host="0.0.0.0")
    try:
        r = await client.post("/flush_cache")
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
    finally:
        await client.aclose()
        await close()


async def test_admission_queue_overflow_is_429() -> None:
    gate = asyncio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        await gate.wait()
        return httpx.Response(200, json={"ok": 1})

    app = create_app(
        Settings(
            worker_urls=[WORKER],
            max_concurrent_requests=1,
            max_queued_requests=1,
            queue_timeout_secs=5,
        ).validate()
    )
    async with app.router.lifespan_context(app):
        state = app.state.router
        await state.use_transport(httpx.MockTransport(slow))
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://r"
        ) as c:
            first = asyncio.create_task(c.post("/v1/completions", json={"prompt": "a"}))
            second = asyncio.create_task(c.post("/v1/completions", json={"prompt": "b"}))
            for _ in range(100):
                if state.admission.waiting == 1:
                    break
                await asyncio.sleep(0.01)
            third = await c.post("/v1/completions", json={"prompt": "c"})
            assert third.status_code == 429 and third.headers["retry-after"] == "1"
            gate.set()
            assert (await first).status_code == 200
            assert (await second).status_code == 200
        assert state.admission.active == 0
        assert state.registry.workers[WORKER].in_flight == 0
        text = state.metrics.render().decode()
        assert 'kvroute_rejected_total{reason="queue_full"} 1.0' in text
        assert 'kvroute_requests_total{route="completions",status="429"} 1.0' in text


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"worker_urls": ["ftp://x"]}, "scheme"),
        ({"worker_urls": ["http://"]}, "host"),
        ({"cache_threshold": 1.5}, "cache-threshold"),
        ({"policy": "fastest"}, "unknown policy"),
        ({"tokenizer": "/no/such/dir"}, "no such directory"),
        ({"balance_rel_threshold": 0.5}, "balance-rel"),
        ({"worker_urls": ["http://a:1", "http://a:1/"]}, "twice"),
    ],
)
def test_settings_are_validated(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Settings(**kw).validate()


@pytest.mark.parametrize(("path", "body", "message"), BAD)
async def test_bad_input_rejected_without_tokenizing(path: str, body: bytes, message: str) -> None:
    """round_robin skips tokenization but validates the body the same way."""
    calls: list[httpx.Request] = []
    client, close, _ = await make_client(calls, policy="round_robin")
    try:
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert message in r.json()["error"]["message"]
    finally:
        await client.aclose()
        await close()


async def test_adding_a_worker_with_kv_events_needs_precise_mode(router: Any) -> None:
    client, _, _ = router
    r = await client.post("/workers", json={"url": "http://w9:1", "kv_events": "tcp://x:1"})
    assert r.status_code == 400
    assert "precise mode is off" in r.json()["error"]["message"]


@pytest.mark.parametrize("failing", [2, 3])
async def test_a_request_never_retries_a_worker_that_failed_it(failing: int) -> None:
    """Failed workers are revived by a racing health check during the retry backoff (a
    worker can answer /health and still refuse inference): the request still never goes
    back to one that failed it; with every worker failing, each is tried once, then 503."""
    urls = ["http://w1:8000", "http://w2:8000", "http://w3:8000"]
    attempts: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        base = f"http://{request.url.host}:{request.url.port}"
        if request.url.path in (
            "/health",
            "/metrics",
            "/v1/models",
            "/get_server_info",
        ):  # health round
            return httpx.Response(200)
        attempts.append(base)
        if urls.index(base) < failing:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    app = create_app(
        Settings(
            worker_urls=urls,
            max_retries=5,
            retry_backoff_secs=0.01,
            failure_cooldown_secs=0,
            health_success_threshold=1,
        ).validate()
    )
    async with app.router.lifespan_context(app):
        state = app.state.router
        await state.use_transport(httpx.MockTransport(handle))

        async def revive() -> None:
            while True:
                for u in urls:
                    state.registry.record_check(u, True)
                await asyncio.sleep(0.001)

        reviver = asyncio.create_task(revive())
        try:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://r"
            ) as c:
                for i in range(8):
                    attempts.clear()
                    r = await c.post("/v1/completions", json={"prompt": f"question {i}"})
                    assert len(attempts) == len(set(attempts)), attempts
                    if failing < len(urls):
                        assert r.status_code == 200 and attempts[-1] == urls[-1], attempts
                    else:
                        assert r.status_code == 503, r.text
                        assert r.json()["error"]["code"] == "no_healthy_worker"
                        assert sorted(attempts) == urls
        finally:
            reviver.cancel()
        assert all(w.in_flight == 0 for w in state.registry.workers.values())


async def test_request_id_reaches_worker_and_answer(router: Any) -> None:
    client, calls, _ = router
    body = {"prompt": "hello"}
    r = await client.post("/v1/completions", json=body, headers={"x-request-id": "req-42"})
    assert r.headers["x-request-id"] == "req-42"
    assert calls[-1].headers["x-request-id"] == "req-42"
    # None given, or one that is not a sane token: a fresh ID, the same on both sides.
    seen = set()
    for given in ({}, {"x-request-id": "bad id\twith spaces"}, {"x-request-id": "x" * 200}):
        r = await client.post("/v1/completions", json=body, headers=given)
        rid = r.headers["x-request-id"]
        assert len(rid) == 24 and rid == calls[-1].headers["x-request-id"]
        seen.add(rid)
    assert len(seen) == 3


async def test_status_page(router: Any) -> None:
    client, _, _ = router
    for _ in range(3):
        assert (await client.post("/v1/completions", json={"prompt": "hi there"})).is_success
    r = await client.get("/status")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert WORKER in page and "1 of 1 workers up" in page
    # Three decisions, spread over the reasons the policy gave.
    assert "<td>cache_miss</td><td>1</td>" in page and "<td>cache_hit</td><td>2</td>" in page
    assert "tokenizer segment cache" in page


async def test_status_page_needs_the_api_key() -> None:
    calls: list[httpx.Request] = []
    client, close, _ = await make_client(calls, api_key="sekret")
    try:
        assert (await client.get("/status")).status_code == 401
        ok = await client.get("/status", headers={"authorization": "Bearer sekret"})
        assert ok.status_code == 200
    finally:
        await client.aclose()
        await close()


def test_reservation_release_hook_runs_once() -> None:
    from kvroute.fleet.registry import Registry

    registry = Registry(Settings(worker_urls=[WORKER]).validate())
    registry.add(WORKER)
    ended: list[int] = []
    res = registry.reserve(WORKER, on_release=lambda: ended.append(1))
    assert registry.workers[WORKER].in_flight == 1
    res.release()
    res.release()
    assert ended == [1] and registry.workers[WORKER].in_flight == 0


def compressing_worker(payload: bytes, headers: dict[str, str]) -> httpx.MockTransport:
    """A worker answering ``payload`` with ``headers``, gzip-compressed (and saying so)
    on /v1/completions, as it is elsewhere."""
    import gzip

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"ok": True})
        if request.url.path == "/v1/completions":
            gz = {**headers, "content-encoding": "gzip"}
            return httpx.Response(200, content=gzip.compress(payload), headers=gz)
        return httpx.Response(200, content=payload, headers=headers)

    return httpx.MockTransport(handle)


@contextlib.asynccontextmanager
async def router_in_front_of(worker: httpx.MockTransport) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(Settings(worker_urls=[WORKER]).validate())
    async with app.router.lifespan_context(app):
        await app.state.router.use_transport(worker)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://router"
        ) as c:
            yield c


BOTH_ROUTES = (("/v1/completions", {"prompt": "a"}), ("/generate", {"text": "a"}))


async def test_complete_answers_pass_decoded_with_their_headers() -> None:
    """A worker's compressed answer reaches the client decoded, with a matching length;
    content-type and cache-control pass, the worker's other headers do not."""
    payload = b'{"choices":[{"text":"' + b"z" * 5000 + b'"}]}'
    headers = {
        "content-type": "application/json",
        "cache-control": "no-store",
        "x-worker-secret": "internal",
    }
    async with router_in_front_of(compressing_worker(payload, headers)) as c:
        for path, body in BOTH_ROUTES:
            r = await c.post(path, json=body)
            assert r.status_code == 200 and r.content == payload
            assert r.headers["content-length"] == str(len(payload))
            assert r.headers["content-type"] == "application/json"
            assert r.headers["cache-control"] == "no-store"
            assert r.headers["x-kvroute-worker"] == WORKER
            assert "content-encoding" not in r.headers and "x-worker-secret" not in r.headers


async def test_streams_pass_decoded() -> None:
    """A streamed answer is relayed as the worker sent it, decoded if it was compressed
    (the router never forwards Content-Encoding)."""
    events = b"".join(b'data: {"n": %d}\n\n' % i for i in range(50)) + b"data: [DONE]\n\n"
    worker = compressing_worker(events, {"content-type": "text/event-stream"})
    async with router_in_front_of(worker) as c:
        for path, body in BOTH_ROUTES:
            r = await c.post(path, json={**body, "stream": True})
            assert r.status_code == 200 and r.content == events
            assert r.headers["content-type"].startswith("text/event-stream")
            assert "content-encoding" not in r.headers


@pytest.mark.parametrize(
    ("settings", "byte_tokens"),
    [
        ({}, True),  # no tokenizer: UTF-8 bytes, a byte each
        ({"token_id_prompts": True}, False),  # clients send the engines' token IDs
    ],
)
def test_the_index_keeps_bytes_only_when_prompts_are_utf8_bytes(
    settings: dict[str, Any], byte_tokens: bool
) -> None:
    from kvroute.service.state import build_state

    state = build_state(Settings(worker_urls=["http://a:1"], **settings).validate())
    assert state.byte_tokens is byte_tokens
    assert state.index.byte_tokens is byte_tokens
