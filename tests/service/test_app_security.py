"""Secrets and run-time input that reaches the fleet: keys never reach the router's log,
worker URLs added through the admin API are validated."""

from __future__ import annotations

import secrets
import signal
from pathlib import Path
from typing import Any

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
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] and err["message"]
        assert list(app.state.router.registry.workers) == ["http://w1:8000"]
