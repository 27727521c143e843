"""Graceful shutdown with real processes on loopback: SIGTERM to ``kvroute serve`` while a
request is in flight, streamed or not.

Within the grace period the request completes, new connections are refused, and the
router exits by itself. Past it the router still exits (bounded), and the client gets a
clear error (an OpenAI-style 503, or a cut stream), never a hang.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.eval.procs import Server
from support import control, start_fake_worker, start_router


def in_flight(router: Server) -> int:
    return sum(w["in_flight"] for w in httpx.get(router.url + "/workers", timeout=5).json())


class Call(threading.Thread):
    """One request in a thread: ``status``, ``body`` and ``error`` once it ends."""

    def __init__(self, url: str, stream: bool) -> None:
        super().__init__(daemon=True)
        self.url, self.stream = url, stream
        self.status: int | None = None
        self.body = b""
        self.error: BaseException | None = None

    def run(self) -> None:
        payload: dict[str, Any] = {"prompt": "shutdown test", "stream": self.stream}
        try:
            with (
                httpx.Client(timeout=60, trust_env=False) as c,
                c.stream("POST", self.url + "/v1/completions", json=payload) as r,
            ):
                self.status = r.status_code
                for chunk in r.iter_raw():
                    self.body += chunk
        except httpx.HTTPError as e:
            self.error = e


def start(tmp_path: Path, processes: list[Server], grace: str) -> tuple[Server, Server]:
    worker = start_fake_worker(tmp_path)
    processes.append(worker)
    router = start_router([worker.url], tmp_path, "--shutdown-grace-secs", grace)
    processes.append(router)
    return router, worker


def sigterm_in_flight(router: Server, call: Call) -> float:
    """Wait until ``call`` holds a worker, then SIGTERM the router; returns the time sent."""
    call.start()
    deadline = time.monotonic() + 10
    while in_flight(router) != 1:
        assert time.monotonic() < deadline, "the request never reached the worker"
        time.sleep(0.05)
    sent = time.monotonic()
    router.proc.send_signal(signal.SIGTERM)
    return sent


def refused_while(router: Server, call: Call) -> bool:
    """True once a new connection to the router is refused while ``call`` still runs."""
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and call.is_alive():
        try:
            httpx.get(router.url + "/health", timeout=0.5, trust_env=False)
        except httpx.ConnectError:
            return call.is_alive()
        except httpx.HTTPError:
            pass  # accepted just before the listener closed, then dropped: not served
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("stream", [False, True])
def test_in_flight_request_finishes_within_grace(
    tmp_path: Path, processes: list[Server], stream: bool
) -> None:
    router, worker = start(tmp_path, processes, grace="15")
    if stream:
        control(worker, chunks=12, chunk_delay_s=0.25)  # ~3 s of streaming
    else:
        control(worker, delay_s=3.0)
    call = Call(router.url, stream)
    sent = sigterm_in_flight(router, call)
    assert refused_while(router, call), "new connections must be refused during the drain"
    call.join(timeout=20)
    assert not call.is_alive()
    assert call.error is None and call.status == 200, (call.error, call.status)
    if stream:
        assert call.body.endswith(b"data: [DONE]\n\n"), call.body[-200:]
        assert b"stream_interrupted" not in call.body
    else:
        assert b'"text":"hello"' in call.body
    router.proc.wait(timeout=15)
    assert time.monotonic() - sent < 15, "exits by itself once the request is done"
    # uvicorn re-raises the signal once drained, so the exit status is "killed by SIGTERM".
    assert router.proc.returncode in (0, -signal.SIGTERM), router.log_tail()
    assert "Traceback" not in router.log_tail(200)


@pytest.mark.parametrize("stream", [False, True])
def test_grace_shorter_than_the_request(
    tmp_path: Path, processes: list[Server], stream: bool
) -> None:
    router, worker = start(tmp_path, processes, grace="1")
    if stream:
        control(worker, chunks=200, chunk_delay_s=0.2)  # 40 s of streaming
    else:
        control(worker, mode="hang")
    call = Call(router.url, stream)
    sent = sigterm_in_flight(router, call)
    router.proc.wait(timeout=10)
    exited_after = time.monotonic() - sent
    assert 1.0 <= exited_after < 10, exited_after
    call.join(timeout=10)
    assert not call.is_alive(), "the client must not hang once the router is gone"
    if stream:
        # Bytes were already sent: the stream ends early with an error event, no [DONE].
        assert call.status == 200 and b" t0" in call.body
        assert b"[DONE]" not in call.body
        assert call.body.endswith(b'"code":"shutting_down","param":null}}\n\n'), call.body[-200:]
    else:
        assert call.error is None and call.status == 503, (call.error, call.status, call.body)
        assert b'"code":"shutting_down"' in call.body
    assert "Traceback" not in router.log_tail(200)


def test_idle_router_with_kv_events_exits_within_grace(
    tmp_path: Path, processes: list[Server]
) -> None:
    """The health task and the KV event subscriber thread must not hold up the exit."""
    from kvroute.eval.procs import free_port

    worker = start_fake_worker(tmp_path)
    processes.append(worker)
    events = f"{worker.url}=tcp://127.0.0.1:{free_port()};bind"
    router = start_router(
        [worker.url],
        tmp_path,
        "--shutdown-grace-secs",
        "10",
        "--kv-events",
        events,
        "--token-id-prompts",
    )
    processes.append(router)
    assert httpx.post(router.url + "/v1/completions", json={"prompt": "x"}).status_code == 200
    sent = time.monotonic()
    router.proc.send_signal(signal.SIGTERM)
    router.proc.wait(timeout=15)
    assert time.monotonic() - sent < 10
    log = router.log_tail(200)
    assert "Traceback" not in log and "did not stop" not in log, log
