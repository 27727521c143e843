"""The access log: one info record per request with the fields an operator needs, and
nothing of the prompt; ``--log-format json`` turns the same record into JSON fields."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest

from kvroute.commands._logs import formatter
from kvroute.config import Settings
from kvroute.service.app import create_app

WORKER = "http://w1:8000"
SECRET_PROMPT = "the launch code is 0000"


async def _router(
    handler: Callable[[httpx.Request], httpx.Response] | None = None, **settings: Any
) -> tuple[httpx.AsyncClient, Any]:
    app = create_app(Settings(worker_urls=[WORKER], **settings).validate())
    ctx = app.router.lifespan_context(app)
    await ctx.__aenter__()

    def handle(request: httpx.Request) -> httpx.Response:
        if handler is not None:
            return handler(request)
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    await app.state.router.use_transport(httpx.MockTransport(handle))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
    return client, ctx


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvroute.access"]


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="kvroute.access")
    return caplog


async def test_one_record_per_request_with_its_fields(access: pytest.LogCaptureFixture) -> None:
    client, ctx = await _router(max_body_bytes=2048, api_key="sk-router-secret")
    auth = {"authorization": "Bearer sk-router-secret"}
    try:
        ok = await client.post(
            "/v1/completions",
            json={"prompt": SECRET_PROMPT},
            headers={**auth, "x-request-id": "req-ok"},
        )
        bad = await client.post("/v1/completions", json={"prompt": ""}, headers=auth)
        big = await client.post(
            "/v1/completions", content=b'{"prompt": "' + b"a" * 5000 + b'"}', headers=auth
        )
        await client.get("/health")  # probes are not logged
    finally:
        await client.aclose()
        await ctx.__aexit__(None, None, None)
    assert (ok.status_code, bad.status_code, big.status_code) == (200, 400, 413)
    records = _records(access)
    assert len(records) == 3
    by_status = {r.status: r for r in records}  # type: ignore[attr-defined]

    r200 = by_status[200]
    assert r200.request_id == "req-ok" and r200.route == "/v1/completions"  # type: ignore[attr-defined]
    assert r200.method == "POST" and r200.worker == WORKER  # type: ignore[attr-defined]
    # The router routed on the prompt's UTF-8 bytes (no tokenizer): one per byte.
    assert r200.prompt_tokens == len(SECRET_PROMPT)  # type: ignore[attr-defined]
    assert 0 < r200.ttft_ms <= r200.latency_ms  # type: ignore[attr-defined]

    for status, answer in ((400, bad), (413, big)):
        rec = by_status[status]
        # Rejected before any worker: no worker, no tokens; the ID is the one answered.
        assert rec.worker is None and rec.prompt_tokens is None  # type: ignore[attr-defined]
        assert rec.request_id == answer.headers["x-request-id"]  # type: ignore[attr-defined]
        assert len(rec.request_id) == 24 and rec.latency_ms > 0  # type: ignore[attr-defined]
    assert len({r.request_id for r in records}) == 3  # type: ignore[attr-defined]

    text = "\n".join(r.getMessage() for r in records)
    assert SECRET_PROMPT not in text and "sk-router-secret" not in text
    assert "req-ok POST /v1/completions 200 worker=http://w1:8000" in text


async def test_json_format_carries_the_fields(access: pytest.LogCaptureFixture) -> None:
    client, ctx = await _router()
    try:
        r = await client.post("/v1/completions", json={"prompt": "hello"})
    finally:
        await client.aclose()
        await ctx.__aexit__(None, None, None)
    (record,) = _records(access)
    line = orjson.loads(formatter("json").format(record))
    assert line["level"] == "INFO" and line["logger"] == "kvroute.access"
    assert line["request_id"] == r.headers["x-request-id"] and line["status"] == 200
    assert line["worker"] == WORKER and line["prompt_tokens"] == 5
    assert line["route"] == "/v1/completions" and line["latency_ms"] >= line["ttft_ms"] > 0
    assert "time" in line and "message" in line


async def test_off_with_no_access_log(access: pytest.LogCaptureFixture) -> None:
    client, ctx = await _router(access_log=False)
    try:
        assert (await client.post("/v1/completions", json={"prompt": "hi"})).status_code == 200
    finally:
        await client.aclose()
        await ctx.__aexit__(None, None, None)
    assert _records(access) == []


async def test_a_forged_line_break_in_the_path_stays_on_one_line(
    access: pytest.LogCaptureFixture,
) -> None:
    client, ctx = await _router()
    try:
        r = await client.get("/nope%0A2026-01-01 INFO kvroute.access: forged")
    finally:
        await client.aclose()
        await ctx.__aexit__(None, None, None)
    assert r.status_code == 404
    (record,) = _records(access)
    assert "\n" not in record.getMessage() and "\\x0a" in record.getMessage()


async def test_a_client_gone_mid_body_is_a_499_not_an_error(
    access: pytest.LogCaptureFixture,
) -> None:
    access.set_level(logging.INFO)
    app = create_app(Settings(worker_urls=[WORKER]).validate())
    sent: list[dict[str, Any]] = []
    messages = [
        {"type": "http.request", "body": b'{"prompt": "half', "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-type", b"application/json")],
        "query_string": b"",
    }
    await app(scope, receive, send)
    assert sent == []  # nothing to answer
    (record,) = _records(access)
    assert record.status == 499 and record.worker is None  # type: ignore[attr-defined]
    assert [r for r in access.records if r.levelno >= logging.WARNING] == []


async def test_a_streamed_answer_is_logged_once_and_relayed_whole(
    access: pytest.LogCaptureFixture,
) -> None:
    """The events after the first go around the log's ``send`` wrapper: the record still
    has the status, the worker and the first byte's time, and the client every event."""
    events = [b'data: {"n": %d}\n\n' % i for i in range(20)] + [b"data: [DONE]\n\n"]

    async def body() -> AsyncIterator[bytes]:
        for event in events:
            yield event

    def stream(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    client, ctx = await _router(stream)
    try:
        r = await client.post("/v1/completions", json={"prompt": "p", "stream": True})
    finally:
        await client.aclose()
        await ctx.__aexit__(None, None, None)
    assert r.status_code == 200 and r.content == b"".join(events)
    (record,) = _records(access)
    assert record.status == 200 and record.worker == WORKER  # type: ignore[attr-defined]
    assert 0 < record.ttft_ms <= record.latency_ms  # type: ignore[attr-defined]
    assert record.request_id == r.headers["x-request-id"]  # type: ignore[attr-defined]


def test_the_text_formatter_writes_what_logging_writes() -> None:
    """The once-a-second timestamp cache changes no line: records within a second, across
    seconds and with any milliseconds format as ``logging.Formatter`` formats them."""
    from kvroute.commands._logs import TEXT_FORMAT, TextFormatter

    ours, stock = TextFormatter(TEXT_FORMAT), logging.Formatter(TEXT_FORMAT)
    record = logging.LogRecord("kvroute.access", logging.INFO, "", 0, "a %s", ("b",), None)
    for created in (1_700_000_000.0, 1_700_000_000.999, 1_700_000_001.0005, 1_700_000_000.5):
        record.created, record.msecs = created, (created - int(created)) * 1000
        assert ours.format(record) == stock.format(record)
    assert ours.formatTime(record, "%H") == stock.formatTime(record, "%H")


def test_setup_logging_gives_records_their_fields_for_json_only() -> None:
    from kvroute.commands._logs import setup_logging
    from kvroute.service import accesslog

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        setup_logging("info", "text")
        assert accesslog.FIELDS is False
        setup_logging("info", "json")
        assert accesslog.FIELDS is True
    finally:
        accesslog.FIELDS = True
        logging.captureWarnings(False)
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
