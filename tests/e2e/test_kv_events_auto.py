"""``kvroute serve --kv-events auto`` in front of sim workers: each worker's KV events
followed where its engine says it publishes them (vLLM's ``/kv_event_sources``), the
static workers and one added at run time; a worker without events stays approximate;
a removed worker's subscription goes with it. Real processes and real ZMQ sockets (the
engines bind ``ipc://`` paths here; the wildcard ``tcp://*`` rewriting is unit-tested in
``tests/events/test_auto.py``, as tests bind loopback only)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import httpx

from kvroute.eval.procs import Server, free_port, start_server
from support import metric, start_router, wait_for

_seeds = itertools.count(1)


def _worker(tmp_path: Path, name: str, *events: str) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "kvroute", "sim-worker", "--port", str(port)]
    argv += ["--time-scale", "100", "--block-size", "16", *events]
    return start_server(f"sim-{name}", argv, port, log_dir=str(tmp_path))


def _events(tmp_path: Path, name: str, *extra: str) -> tuple[str, ...]:
    return ("--kv-events-endpoint", f"ipc://{tmp_path}/{name}.sock", *extra)


def _modes(router: Server) -> dict[str, str]:
    return {w["url"]: w["mode"] for w in httpx.get(router.url + "/workers", timeout=5).json()}


def _precise_after_traffic(router: Server, worker: Server) -> bool:
    """Send ``worker`` a fresh prompt directly (its events reach the router once it has
    subscribed); is the worker precise in the router now?"""
    seed = next(_seeds)
    tokens = [(seed * 1000 + i) % 30000 + 1 for i in range(64)]
    httpx.post(
        worker.url + "/v1/completions",
        json={"model": "sim", "prompt": tokens, "max_tokens": 1},
        timeout=10,
    ).raise_for_status()
    return _modes(router).get(worker.url) == "precise"


def test_router_follows_the_events_each_engine_says_it_publishes(
    tmp_path: Path, processes: list[Server]
) -> None:
    replay = f"tcp://127.0.0.1:{free_port()}"
    a = _worker(
        tmp_path,
        "a",
        *_events(tmp_path, "a", "--kv-events-topic", "kv", "--kv-events-replay-endpoint", replay),
    )
    b = _worker(tmp_path, "b", *_events(tmp_path, "b"))
    silent = _worker(tmp_path, "silent")
    processes.extend((a, b, silent))
    router = start_router(
        [a.url, b.url, silent.url], tmp_path, "--kv-events", "auto", "--token-id-prompts"
    )
    processes.append(router)
    for w in (a, b):
        wait_for(lambda w=w: _precise_after_traffic(router, w), 20, f"{w.url} precise")
    assert _modes(router)[silent.url] == "approximate"
    rows = {w["url"]: w for w in httpx.get(router.url + "/workers", timeout=5).json()}
    assert {u: w["kv_events"] for u, w in rows.items()} == {
        a.url: f"ipc://{tmp_path}/a.sock",
        b.url: f"ipc://{tmp_path}/b.sock",
        silent.url: None,
    }
    log = Path(router.log_path or "")
    wait_for(
        lambda: "publishes no KV events" in log.read_text(), 10, "the silent worker's log line"
    )
    text = log.read_text()
    assert f"following the KV events of {a.url} at ipc://{tmp_path}/a.sock" in text

    # Routed requests use what the engines report: a prompt a holds goes to a.
    held = [(77 * 1000 + i) % 30000 + 1 for i in range(64)]
    httpx.post(
        a.url + "/v1/completions", json={"model": "sim", "prompt": held, "max_tokens": 1}
    ).raise_for_status()
    wait_for(
        lambda: metric(router, "kvroute_kv_events_cached_blocks", a.url) >= 8, 10, "a's blocks"
    )
    r = httpx.post(
        router.url + "/v1/completions",
        json={"model": "sim", "prompt": held, "max_tokens": 1},
        timeout=10,
    )
    assert r.headers["x-kvroute-worker"] == a.url
    # Whole blocks short of the last token: what the engine reuses of a repeated prompt.
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (64 - 1) // 16 * 16

    # A worker added at run time is followed; removed, its subscription goes.
    # (With a replay endpoint: its first batch may go out before the subscription
    # reaches it, as for any worker followed late, and is then recovered.)
    late_replay = ("--kv-events-replay-endpoint", f"tcp://127.0.0.1:{free_port()}")
    late = _worker(tmp_path, "late", *_events(tmp_path, "late", *late_replay))
    processes.append(late)
    httpx.post(router.url + "/workers", json={"url": late.url}, timeout=10).raise_for_status()
    wait_for(lambda: _precise_after_traffic(router, late), 20, "the added worker precise")
    httpx.delete(f"{router.url}/workers/{late.url}", timeout=10).raise_for_status()
    wait_for(
        lambda: f'worker="{late.url}"' not in httpx.get(router.url + "/metrics").text,
        10,
        "the removed worker's event series gone",
    )
