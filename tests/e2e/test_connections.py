"""Connection hygiene on a real router, with raw sockets: oversized headers get 431,
slow headers and stalled bodies 408, idle keep-alive connections are closed."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.eval.procs import Server
from support import start_fake_worker, start_router


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("connections")
    worker = start_fake_worker(logs)
    try:
        r = start_router(
            [worker.url], logs, "--max-header-bytes", "8192", "--header-timeout-secs", "0.5",
            "--body-timeout-secs", "0.5", "--keep-alive-timeout-secs", "0.5",
        )  # fmt: skip
    except BaseException:
        worker.stop()
        raise
    yield r
    r.stop()
    worker.stop()


def connect(router: Server) -> socket.socket:
    host, port = router.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def read_all(s: socket.socket) -> bytes:
    """Everything until the router closes the connection (bounded by the socket's
    10 s timeout, which fails the test if the router never closes)."""
    out = b""
    for _ in range(1000):
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk
    raise AssertionError("connection not closed")


def test_oversized_headers_get_431(router: Server) -> None:
    with connect(router) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        for _ in range(16):  # 1 MB of header lines, sent as a client would
            try:
                s.sendall(b"x-filler: " + b"a" * 65536 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break  # the router already answered and closed
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]


def test_headers_within_the_limit_pass(router: Server) -> None:
    with connect(router) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-filler: " + b"a" * 4000 + b"\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_a_request_whose_headers_never_end_gets_408(router: Server) -> None:
    with connect(router) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")  # no blank line: never complete
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]


def test_a_silent_connection_is_closed(router: Server) -> None:
    with connect(router) as s:
        assert read_all(s) == b""


def test_a_body_shorter_than_its_length_gets_408(router: Server) -> None:
    with connect(router) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"prompt": '
        )
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]


def test_a_body_that_keeps_coming_is_not_timed_out(router: Server) -> None:
    """The body deadline counts from the last byte: a body trickling in for 1.6 s, a
    chunk every 0.2 s (each within the 0.5 s limit), is answered."""
    body = b'{"prompt": "' + b"a" * 24 + b'"}'
    with connect(router) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        for i in range(0, len(body), 5):
            time.sleep(0.2)
            s.sendall(body[i : i + 5])
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


def test_a_kept_alive_connection_gets_a_fresh_header_deadline(router: Server) -> None:
    """A second request on the connection, its headers cut short, gets 408 after its
    own header timeout; the first one's answer came whole (head and body)."""
    with connect(router) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(b'{"status":"ok"}'), first
        time.sleep(0.3)
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")  # never completed
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]


def test_a_head_request_is_answered_on_a_kept_alive_connection(router: Server) -> None:
    """A HEAD answer has no body to carry its head: it goes out when the response ends."""
    with connect(router) as s:
        s.settimeout(3)
        s.sendall(b"HEAD /health HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 ") and answer.endswith(b"\r\n\r\n"), answer
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")  # the connection still serves
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_an_idle_keep_alive_connection_is_closed(router: Server) -> None:
    with connect(router) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = read_all(s)  # the answer, then the close after the keep-alive timeout
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert b"connection: close" not in answer.lower()  # it was kept alive, then closed


def test_the_router_still_serves_after_all_that(router: Server) -> None:
    with connect(router) as s:
        body = b'{"prompt": "hi", "max_tokens": 1}'
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
    assert router.log_path is not None
    log = Path(router.log_path).read_text()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def test_a_big_body_waiting_for_admission_is_not_timed_out(
    tmp_path: Path, processes: list[Server]
) -> None:
    """The body guard counts the client's pauses, not the router's: a 1 MB body queued
    behind a slow request (reading paused, as the app has not read it) still gets served."""
    import threading

    import httpx

    from support import control

    worker = start_fake_worker(tmp_path)
    processes.append(worker)
    r = start_router(
        [worker.url], tmp_path, "--max-concurrent-requests", "1", "--body-timeout-secs", "0.3",
    )  # fmt: skip
    processes.append(r)
    control(worker, delay_s=1.5)
    first = threading.Thread(
        target=lambda: httpx.post(r.url + "/v1/completions", json={"prompt": "a"}, timeout=30)
    )
    first.start()
    big = {"prompt": "b" * 1_000_000, "max_tokens": 1}
    answer = httpx.post(r.url + "/v1/completions", json=big, timeout=30)
    first.join(timeout=30)
    assert answer.status_code == 200, answer.text[:300]
