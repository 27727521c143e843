"""The router as a real process in front of real (fake) worker processes on loopback."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from kvroute.eval.procs import Server
from support import control, records

Fleet = Callable[..., tuple[Server, list[Server]]]


def prompt(group: int, q: int) -> str:
    return f"group {group} shared system prompt. " * 40 + f"question {q}?"


def served_by(resp: httpx.Response) -> str:
    return resp.headers["x-kvroute-worker"]


def in_flight(router: Server) -> dict[str, int]:
    return {w["url"]: w["in_flight"] for w in httpx.get(router.url + "/workers").json()}


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_cache_aware_keeps_groups_together_and_spreads_groups(fleet: Fleet) -> None:
    router, _workers = fleet(2)
    by_group: dict[int, set[str]] = {}
    with httpx.Client(base_url=router.url, timeout=10) as c:
        for q in range(4):
            for g in range(4):
                r = c.post("/v1/completions", json={"prompt": prompt(g, q), "max_tokens": 2})
                assert r.status_code == 200
                by_group.setdefault(g, set()).add(served_by(r))
    assert all(len(ws) == 1 for ws in by_group.values()), by_group
    homes = Counter(next(iter(ws)) for ws in by_group.values())
    assert sorted(homes.values()) == [2, 2], "new prefixes spread over idle workers"
    assert all(v == 0 for v in in_flight(router).values())


def test_round_robin_spreads_a_shared_prefix(fleet: Fleet) -> None:
    router, _workers = fleet(2, "--policy", "round_robin")
    with httpx.Client(base_url=router.url, timeout=10) as c:
        got = Counter(
            served_by(c.post("/v1/completions", json={"prompt": prompt(0, 0)})) for _ in range(6)
        )
    assert sorted(got.values()) == [3, 3]


def test_body_reaches_the_worker_unchanged(fleet: Fleet) -> None:
    router, workers = fleet(1)
    raw = b'{"prompt":  "x y z", "max_tokens":3, "extra_field": {"keep": [1, 2.50]}}'
    r = httpx.post(
        router.url + "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 200
    assert records(workers[0])[-1]["body"] == raw.decode()


def test_streaming_is_passed_through_byte_for_byte(fleet: Fleet) -> None:
    router, workers = fleet(1)
    body = {"prompt": "stream me", "stream": True}
    direct = httpx.post(workers[0].url + "/v1/completions", json=body).content
    via: list[bytes] = []
    with httpx.stream("POST", router.url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        via.extend(r.iter_raw())
    assert b"".join(via) == direct
    assert len(via) > 1, "chunks arrive as the worker sends them"


def test_client_disconnect_mid_stream_releases_load(fleet: Fleet) -> None:
    router, workers = fleet(1)
    control(workers[0], chunk_delay_s=0.5, chunks=20)
    with httpx.stream(
        "POST", router.url + "/v1/completions", json={"prompt": "slow", "stream": True}
    ) as r:
        it = r.iter_raw()
        next(it)
        assert in_flight(router)[workers[0].url] == 1
    # The client went away after one chunk: the reservation must come back.
    assert wait_for(lambda: in_flight(router)[workers[0].url] == 0)


def test_worker_errors_pass_through(fleet: Fleet) -> None:
    router, workers = fleet(1)
    for status in (400, 422, 500):
        control(workers[0], mode="error", status=status)
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == status
        assert r.json()["error"]["message"] == "worker says no"
    control(workers[0], mode="ok")
    assert in_flight(router)[workers[0].url] == 0


def test_workers_added_and_removed_at_run_time(
    fleet: Fleet, processes: list[Server], tmp_path: Any
) -> None:
    from support import start_fake_worker

    router, workers = fleet(1)
    extra = start_fake_worker(tmp_path)
    processes.append(extra)
    r = httpx.post(router.url + "/workers", json={"url": extra.url})
    assert r.status_code == 201
    assert {w["url"] for w in httpx.get(router.url + "/workers").json()} == {
        workers[0].url,
        extra.url,
    }
    with httpx.Client(base_url=router.url) as c:
        seen = {
            served_by(c.post("/v1/completions", json={"prompt": prompt(g, 0)})) for g in range(4)
        }
    assert extra.url in seen
    r = httpx.delete(router.url + "/workers/" + extra.url.replace(":", "%3A").replace("/", "%2F"))
    assert r.status_code == 200
    assert [w["url"] for w in httpx.get(router.url + "/workers").json()] == [workers[0].url]
    assert httpx.delete(router.url + "/workers/http%3A%2F%2Fnope").status_code == 404
    bad = httpx.post(router.url + "/workers", json={"url": "ftp://x"})
    assert bad.status_code == 422 and "scheme" in bad.json()["error"]["message"]


def test_flush_cache_reaches_workers_and_clears_index(fleet: Fleet) -> None:
    router, _workers = fleet(2)
    httpx.post(router.url + "/v1/completions", json={"prompt": prompt(1, 1)})
    assert sum(w["cached_tokens"] for w in httpx.get(router.url + "/workers").json()) > 0
    r = httpx.post(router.url + "/flush_cache")
    assert r.status_code == 200
    assert set(r.json()["workers"].values()) == {200}
    assert sum(w["cached_tokens"] for w in httpx.get(router.url + "/workers").json()) == 0


def test_models_health_readiness_metrics(fleet: Fleet) -> None:
    router, _workers = fleet(2)
    assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == "fake-model"
    assert httpx.get(router.url + "/readiness").status_code == 200
    httpx.post(router.url + "/v1/completions", json={"prompt": prompt(0, 0)})
    text = httpx.get(router.url + "/metrics").text
    for name in (
        "kvroute_requests_total",
        "kvroute_routing_decisions_total",
        "kvroute_worker_in_flight",
        "kvroute_index_cached_tokens",
        "kvroute_time_to_first_byte_seconds",
        "kvroute_matched_token_ratio",
    ):
        assert name in text
    tasks = [ln for ln in text.splitlines() if ln.startswith("kvroute_asyncio_tasks ")]
    assert len(tasks) == 1 and float(tasks[0].split()[1]) >= 2, "the scrape and the health loop"


def test_dead_worker_request_is_retried_elsewhere(fleet: Fleet) -> None:
    router, workers = fleet(2)
    with httpx.Client(base_url=router.url, timeout=10) as c:
        home = served_by(c.post("/v1/completions", json={"prompt": prompt(7, 0)}))
        victim = next(w for w in workers if w.url == home)
        victim.kill()
        r = c.post("/v1/completions", json={"prompt": prompt(7, 1)})
        assert r.status_code == 200
        assert served_by(r) != home
        ws = {w["url"]: w for w in c.get("/workers").json()}
        assert ws[home]["healthy"] is False
        assert all(w["in_flight"] == 0 for w in ws.values())


def test_all_workers_down_is_a_clear_503(fleet: Fleet) -> None:
    router, workers = fleet(1)
    workers[0].kill()
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_healthy_worker"
    assert httpx.get(router.url + "/readiness").status_code == 503
    assert in_flight(router) == {workers[0].url: 0}


@pytest.mark.parametrize("stream", [False, True])
def test_openai_sdk_through_the_router(fleet: Fleet, stream: bool) -> None:
    import openai

    router, workers = fleet(1)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    msgs: Any = [{"role": "user", "content": "hello"}]
    if stream:
        chunks = list(client.completions.create(model="fake-model", prompt="hi", stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == " t0 t1 t2 t3 t4"
        chat = client.chat.completions.create(model="fake-model", messages=msgs, stream=True)
        assert len(list(chat)) > 1
    else:
        out = client.completions.create(model="fake-model", prompt="hi")
        assert out.choices[0].text == "hello"
        chat_out = client.chat.completions.create(model="fake-model", messages=msgs)
        assert chat_out.usage is not None
    paths = [r["path"] for r in records(workers[0])]
    assert paths == ["/v1/completions", "/v1/chat/completions"]
    bodies = [orjson.loads(str(r["body"])) for r in records(workers[0])]
    assert bodies[0]["prompt"] == "hi"
