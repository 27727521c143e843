"""The rest of the OpenAI/vLLM surface: pass-through routes by least load with bodies
untouched, the Responses API routed like chat, unknown paths still 404 (in-process,
against mocked workers)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from fake_worker import PASSTHROUGH_PATHS as PASSTHROUGH  # every one the fake serves
from kvroute.config import Settings
from kvroute.fleet.health import refresh_models
from kvroute.service.app import create_app

W1, W2 = "http://w1:8000", "http://w2:8000"

Handler = Callable[[httpx.Request], httpx.Response]


# What the router reads from workers on its own (health checks, models, KV capacity).
CHECKS = ("/health", "/metrics", "/v1/models", "/get_server_info")


def echo(calls: list[httpx.Request]) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path in CHECKS:
            return httpx.Response(404)  # nothing known: every worker serves any model
        calls.append(request)
        worker = f"{request.url.scheme}://{request.url.netloc.decode()}"
        if request.url.path == "/v1/responses":
            return httpx.Response(200, json={"object": "response", "worker": worker})
        return httpx.Response(
            200, content=b'{"object":"list","data":[]}', headers={"content-type": "x/answer"}
        )

    return handle


async def make(handler: Handler, workers: list[str], **settings: Any) -> tuple[Any, Any, Any]:
    app = create_app(Settings(worker_urls=workers, **settings).validate())
    ctx = app.router.lifespan_context(app)
    await ctx.__aenter__()
    await app.state.router.use_transport(httpx.MockTransport(handler))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
    return client, ctx, app.state.router


@pytest.mark.parametrize("path", PASSTHROUGH)
async def test_passthrough_routes_forward_bodies_untouched(path: str) -> None:
    calls: list[httpx.Request] = []
    client, ctx, state = await make(echo(calls), [W1])
    # Not JSON the router could parse, and an odd content type: passed as they are.
    body = b"\x00\x01 not json \xff" * 100
    try:
        r = await client.post(path, content=body, headers={"content-type": "x/odd; q=1"})
    finally:
        await client.aclose()
        await ctx.__aexit__(None, None, None)
    assert r.status_code == 200 and r.content == b'{"object":"list","data":[]}'
    assert r.headers["content-type"] == "x/answer" and r.headers["x-kvroute-worker"] == W1
    (sent,) = calls
    assert sent.url.path == path and sent.content == body
    assert sent.headers["content-type"] == "x/odd; q=1"
    assert sent.headers["x-request-id"] == r.headers["x-request-id"]
    assert state.registry.workers[W1].in_flight == 0
    assert state.index.cached_tokens(W1) == 0  # nothing learned from a pass-through body


async def test_multipart_audio_upload_keeps_its_boundary() -> None:
    calls: list[httpx.Request] = []
    client, ctx, _ = await make(echo(calls), [W1])
    audio = bytes(range(256)) * 64
    try:
        r = await client.post(
            "/v1/audio/transcriptions",
            files={"file": ("a.wav", audio, "audio/wav")},
            data={"model": "whisper"},
        )
    finally:
        await client.aclose()
        await ctx.__aexit__(None, None, None)
    assert r.status_code == 200
    (sent,) = calls
    ctype = sent.headers["content-type"]
    assert ctype.startswith("multipart/form-data; boundary=")
    assert ctype.split("boundary=")[1].encode() in sent.content and audio in sent.content


async def test_least_load_among_healthy_workers() -> None:
    calls: list[httpx.Request] = []
    client, ctx, state = await make(echo(calls), [W1, W2])
    try:
        # W1 busy: every pass-through request goes to W2, whatever the policy is.
        state.registry.workers[W1].in_flight = 3
        for _ in range(6):
            r = await client.post("/v1/embeddings", json={"input": "same text"})
            assert r.headers["x-kvroute-worker"] == W2
        # Equal loads: ties are spread (random), not always the first worker.
        state.registry.workers[W1].in_flight = 0
        seen = set()
        for _ in range(40):
            r = await client.post("/v1/embeddings", json={"input": "same text"})
            seen.add(r.headers["x-kvroute-worker"])
        # A worker that is down takes nothing.
        state.registry.mark_down(W2, "test")
        for _ in range(6):
            r = await client.post("/tokenize", json={"prompt": "x"})
            assert r.headers["x-kvroute-worker"] == W1
    finally:
        await client.aclose()
        await ctx.__aexit__(None, None, None)
    assert seen == {W1, W2}


async def test_a_connect_failure_is_retried_on_another_worker() -> None:
    calls: list[httpx.Request] = []
    ok = echo(calls)

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "w1":
            raise httpx.ConnectError("refused", request=request)
        return ok(request)

    client, ctx, state = await make(handle, [W1, W2])
    state.registry.workers[W2].in_flight = 5  # least load picks W1 first
    try:
        r = await client.post("/v1/rerank", json={"query": "q", "documents": ["a"]})
    finally:
        await client.aclose()
        await ctx.__aexit__(None, None, None)
    assert r.status_code == 200 and r.headers["x-kvroute-worker"] == W2
    assert not state.registry.workers[W1].healthy
    assert state.registry.workers[W1].in_flight == 0


async def test_unknown_paths_keep_their_404() -> None:
    client, ctx, _ = await make(echo([]), [W1])
    try:
        for path in ("/v1/nope", "/v1/embeddings/x", "/v1/audio/speechify"):
            r = await client.post(path, json={})
            assert r.status_code == 404, path
        assert (await client.get("/v1/embeddings")).status_code == 405
    finally:
        await client.aclose()
        await ctx.__aexit__(None, None, None)


async def test_responses_api_is_routed_like_chat(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvroute.access")
    calls: list[httpx.Request] = []
    client, ctx, state = await make(echo(calls), [W1, W2])
    as_chat = {
        "messages": [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "A long question about the weather " * 20},
        ]
    }
    expected = len(await state.tokenizer.tokens_for("chat", as_chat))
    bodies = [
        # instructions + a string input, and the same as input items: one prompt.
        {"instructions": "Answer in French.", "input": as_chat["messages"][1]["content"]},
        {
            "input": [
                {"type": "message", "role": "system", "content": "Answer in French."},
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": as_chat["messages"][1]["content"]}],
                },
            ]
        },
    ]
    try:
        answers = [await client.post("/v1/responses", json=b) for b in bodies]
        bad = await client.post("/v1/responses", json={"model": "m"})
    finally:
        await client.aclose()
        await ctx.__aexit__(None, None, None)
    assert [a.status_code for a in answers] == [200, 200]
    assert bad.status_code == 400 and "'input'" in bad.json()["error"]["message"]
    # The worker got each body as sent, at its own /v1/responses.
    assert [c.url.path for c in calls] == ["/v1/responses"] * 2
    # The index learned the chat rendering, and the second request followed it.
    first, second = (a.headers["x-kvroute-worker"] for a in answers)
    assert first == second and state.index.cached_tokens(first) == expected
    logged = [r for r in caplog.records if r.name == "kvroute.access" and r.status == 200]  # type: ignore[attr-defined]
    assert [r.prompt_tokens for r in logged] == [expected, expected]  # type: ignore[attr-defined]
    text = state.metrics.render().decode()
    assert (
        'kvroute_routing_decisions_total{policy="cache_aware",reason="cache_hit",'
        'source="approximate"} 1.0'
    ) in text


async def test_a_named_model_goes_to_the_workers_that_serve_it() -> None:
    """A mixed fleet: W1 serves an embedding model, W2 a chat model. Requests naming a
    model go to its workers even when they are busier; a model no worker lists is a 404;
    a body without one goes by least load over all."""
    served = {"w1": ["embedder"], "w2": ["chat-model"]}
    listed: list[str] = []
    calls: list[httpx.Request] = []
    ok = echo(calls)

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            listed.append(request.url.host)
            data = [{"id": m, "object": "model"} for m in served[request.url.host]]
            return httpx.Response(200, json={"object": "list", "data": data})
        return ok(request)

    client, ctx, state = await make(handle, [W1, W2])
    for url in (W1, W2):  # what the health loop does after each check
        await refresh_models(state, url)
    state.registry.workers[W1].in_flight = 5
    try:
        for _ in range(5):
            r = await client.post("/v1/embeddings", json={"model": "embedder", "input": "x"})
            assert r.headers["x-kvroute-worker"] == W1
        r = await client.post("/tokenize", json={"model": "chat-model", "prompt": "x"})
        assert r.headers["x-kvroute-worker"] == W2
        r = await client.post("/v1/embeddings", json={"model": "nobody-has-it", "input": "x"})
        assert r.status_code == 404 and "embedder" in r.json()["error"]["message"]
        r = await client.post("/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF")})
        assert r.headers["x-kvroute-worker"] == W2
    finally:
        await client.aclose()
        await ctx.__aexit__(None, None, None)
    assert sorted(set(listed)) == ["w1", "w2"]  # read with the health checks, not per request
