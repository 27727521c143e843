"""Precise mode end to end: kvroute serve --kv-events in front of sim workers that publish
vLLM-format KV events. After a worker drops its cache, the router stops counting on it."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx

from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server


def decisions(router: Server) -> dict[tuple[str, str], float]:
    text = httpx.get(router.url + "/metrics").text
    out = {}
    pat = (
        r'kvroute_routing_decisions_total\{policy="cache_aware",reason="(\w+)",'
        r'source="(\w+)"\} (\S+)'
    )
    for reason, source, value in re.findall(pat, text):
        out[(reason, source)] = float(value)
    return out


def wait_until(cond: object, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_router_follows_engine_events(tmp_path: Path, processes: list[Server]) -> None:
    events_port = free_port()
    endpoint = f"tcp://127.0.0.1:{events_port}"
    workers = []
    for i in range(2):
        port = free_port()
        w = start_server(
            f"sim-{port}",
            kvroute_argv(
                "sim-worker",
                "--port",
                str(port),
                "--block-size",
                "16",
                "--kv-events-endpoint",
                endpoint,
                "--kv-events-topic",
                f"kv@{i}",
            ),
            port,
            log_dir=str(tmp_path),
        )
        processes.append(w)
        workers.append(w)
    rport = free_port()
    flags = ["--token-id-prompts"]  # the sim workers' tokens are UTF-8 bytes
    for i, w in enumerate(workers):
        flags += ["--kv-events", f"{w.url}={endpoint};bind;topic=kv@{i}"]
    router = start_server(
        "router",
        kvroute_argv(
            "serve", "--port", str(rport), "--worker-urls", *[w.url for w in workers], *flags
        ),
        rport,
        log_dir=str(tmp_path),
    )
    processes.append(router)

    def mode(url: str) -> str:
        ws = {w["url"]: w for w in httpx.get(router.url + "/workers").json()}
        return str(ws[url]["mode"])

    # ZMQ drops what a publisher sends before the subscription reaches it ("slow
    # joiner"), so bring each stream up deterministically: a cache reset publishes
    # AllBlocksCleared, which a fresh (or stale) stream accepts as a full state.
    def primed() -> bool:
        for w in workers:
            if mode(w.url) != "precise":
                httpx.post(w.url + "/flush_cache").raise_for_status()
        time.sleep(0.2)
        return all(mode(w.url) == "precise" for w in workers)

    assert wait_until(primed, 15.0), [mode(w.url) for w in workers]

    prompt = list(range(1000, 1320))  # 20 blocks of 16
    body = {"model": "sim", "prompt": prompt, "max_tokens": 2}
    first = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
    assert first.status_code == 200
    home = first.headers["x-kvroute-worker"]
    time.sleep(0.5)  # let the stored blocks' batch land
    second = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
    assert second.headers["x-kvroute-worker"] == home
    assert decisions(router).get(("cache_hit", "precise"), 0) == 1

    # The worker drops its cache behind the router's back: AllBlocksCleared.
    httpx.post(home + "/flush_cache").raise_for_status()
    time.sleep(0.5)
    third = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
    assert third.status_code == 200
    d = decisions(router)
    assert d.get(("cache_hit", "precise"), 0) == 1, "no hit counted on a flushed cache"
    assert d.get(("cache_miss", "precise"), 0) == 2
    assert "kvroute_kv_events" in httpx.get(router.url + "/metrics").text
