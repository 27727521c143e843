"""Secrets and run-time input that reaches the fleet: keys never reach the router's log,
worker URLs added through the admin API are validated."""

from __future__ import annotations

import asyncio
import secrets
import signal
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from kvroute.eval.procs import Server
from support import control, records, start_fake_worker, start_router


def test_keys_never_reach_the_log(tmp_path: Path, processes: list[Server]) -> None:
    """Debug logging, every path that logs (auth failures, admin changes, a worker
    refusing, a worker killed and retried, a 5xx answer, a stream): no key in the log."""
    keys = {name: f"{name}-{secrets.token_hex(12)}" for name in ("client", "admin", "worker")}
    wrong = f"wrong-{secrets.token_hex(12)}"
    workers = [start_fake_worker(tmp_path) for _ in range(2)]
    processes.extend(workers)
    router = start_router(
        [w.url for w in workers],
        tmp_path,
        "--log-level",
        "debug",
        "--api-key",
        keys["client"],
        "--admin-api-key",
        keys["admin"],
        "--worker-api-key",
        keys["worker"],
        "--policy",
        "round_robin",
    )
    processes.append(router)
    auth = {"authorization": f"Bearer {keys['client']}"}
    admin = {"authorization": f"Bearer {keys['admin']}"}
    with httpx.Client(base_url=router.url, timeout=20, trust_env=False) as c:
        body: dict[str, Any] = {"prompt": "hello"}
        assert c.post("/v1/completions", json=body).status_code == 401
        bad = {"authorization": f"Bearer {wrong}"}
        assert c.post("/v1/completions", json=body, headers=bad).status_code == 401
        assert (
            c.post("/workers", json={"url": "http://127.0.0.1:1"}, headers=auth).status_code == 401
        )
        r = c.post("/workers", json={"url": "http://127.0.0.1:1"}, headers=admin)
        assert r.status_code == 201
        for i in range(4):  # round robin meets the refusing worker: marked down, retried
            assert (
                c.post("/v1/completions", json={"prompt": f"p{i}"}, headers=auth).status_code == 200
            )
        stream = {"prompt": "s", "stream": True}
        assert b"[DONE]" in c.post("/v1/completions", json=stream, headers=auth).content
        control(workers[0], mode="error", status=500)
        control(workers[1], mode="error", status=500)
        assert c.post("/v1/completions", json=body, headers=auth).status_code == 500
        control(workers[0], mode="ok")
        workers[1].kill()
        for i in range(3):
            assert (
                c.post("/v1/completions", json={"prompt": f"k{i}"}, headers=auth).status_code == 200
            )
        assert c.post("/flush_cache", headers=admin).status_code == 200
        assert c.get("/metrics").status_code == 200
    sent = [r["headers"].get("authorization") for r in records(workers[0])]  # type: ignore[union-attr]
    assert sent and set(sent) == {f"Bearer {keys['worker']}"}, "the worker key was in use"
    router.proc.send_signal(signal.SIGTERM)
    router.proc.wait(timeout=15)
    assert router.log_path is not None
    log = Path(router.log_path).read_text(errors="replace")
    assert " DEBUG " in log and "marked down" in log, "debug logging was on and exercised"
    for secret in (*keys.values(), wrong):
        assert secret not in log


BAD_URLS = [
    "ftp://example.com",
    "file:///etc/passwd",
    "javascript:alert(1)",
    "gopher://127.0.0.1:70",
    "http://",
    "http://user:pw@127.0.0.1:8000",
    "http://127.0.0.1:99999",
    "http://127.0.0.1:8000/?next=x",
    "127.0.0.1:8000",
    "http://[::1]x:80",  # garbage after the IPv6 brackets
    "http://[::1:80",
    "http://[zz]:80",
    "http://[::1]:0",
    "http://127.0.0.1:-1",
    "http://127.0.0.1:+80",
    "http://999.0.0.1:80",
    "http://ho st:80",
    "http://h_st:80",
    "http://127.0.0.1:8000#frag",
    "",
    123,
    None,
    ["http://127.0.0.1:8000"],
]


@pytest.mark.parametrize("url", BAD_URLS)
async def test_workers_added_at_run_time_are_validated(url: object) -> None:
    from kvroute.config import Settings
    from kvroute.service.app import create_app

    app = create_app(Settings(worker_urls=["http://w1:8000"]).validate())
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as c,
    ):
        r = await c.post("/workers", json={"url": url})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] and err["message"]
        assert list(app.state.router.registry.workers) == ["http://w1:8000"]


ODD_PATHS = [
    "http%3A%2F%2F%5B%3A%3A1%5Dx%3A80",  # the bad URL, encoded
    "http://[::1]x:80",
    "%",
    "%ZZ",
    "%00",
    "%C3%28",  # invalid UTF-8
    "[",
    "x" * 5000,
    "http://127.0.0.1:99999",
    "http://w1:8000/extra/../..",
]


async def test_delete_of_any_string_is_404_or_200_never_500() -> None:
    from kvroute.config import Settings
    from kvroute.service.app import create_app

    app = create_app(Settings(worker_urls=["http://w1:8000", "http://[::1]:8001"]).validate())
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as c,
    ):
        for path in ODD_PATHS:
            r = await c.delete("/workers/" + path)
            assert r.status_code == 404, (path, r.status_code, r.text)
            assert r.json()["error"]["code"] == "not_found"
        # Spelled differently (upper-case host, trailing slash), percent-encoded: found.
        r = await c.delete("/workers/" + quote("HTTP://[::1]:8001/", safe=""))
        assert r.status_code == 200, r.text
        assert list(app.state.router.registry.workers) == ["http://w1:8000"]


async def test_ipv6_workers_are_accepted_and_probed_before_traffic() -> None:
    from kvroute.config import Settings
    from kvroute.service.app import create_app

    app = create_app(Settings(worker_urls=["http://w1:8000"]).validate())
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as c,
    ):
        r = await c.post("/workers", json={"url": "http://[::1]:1/"})
        assert r.status_code == 201, r.text
        assert r.json() == {"url": "http://[::1]:1", "added": True, "healthy": None}
        state = app.state.router
        assert "http://[::1]:1" not in state.registry.loads(), "no traffic before its check"
        for _ in range(200):  # the probe: nothing listens on port 1
            if state.registry.workers["http://[::1]:1"].healthy is not None:
                break
            await asyncio.sleep(0.01)
        listed = {w["url"]: w for w in (await c.get("/workers")).json()}
        assert listed["http://[::1]:1"]["healthy"] is False
        assert "ConnectError" in listed["http://[::1]:1"]["down_reason"]
