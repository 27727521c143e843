"""Precise mode end to end with ``kvroute sim-worker`` processes publishing KV events.

Two simulated workers connect to one SUB socket kvroute binds (a topic each); A also
serves replays. Real processes, real ZMQ, the publisher code the sim worker ships:
stores, evictions, a dropped batch (recovered by replay on A, stale on B), a cache
flush (AllBlocksCleared: B rebuilt at once) and a sequence restart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from kvroute import BlockIndex
from kvroute.eval.procs import Server, free_port, kvroute_argv, running, start_server
from kvroute.events import EventTracker, KvEventSubscriber, PreciseView, parse_kv_events
from support import wait_for

BLOCK = 16


def prompt(seed: int, n: int = 100) -> list[int]:
    return [(seed * 1000 + i) % 30000 + 1 for i in range(n)]


@dataclass
class Fleet:
    a: Server
    b: Server
    tracker: EventTracker
    client: httpx.Client

    def complete(self, server: Server, tokens: list[int]) -> int:
        r = self.client.post(
            server.url + "/v1/completions",
            json={"model": "sim", "prompt": tokens, "max_tokens": 1},
        )
        r.raise_for_status()
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    def held(self, server: Server, tokens: list[int]) -> int:
        return self.tracker.index.match(tokens).get(server.url, 0)

    def row(self, server: Server) -> dict[str, int | str]:
        return self.tracker.snapshot()[server.url]

    def fault(self, server: Server, **body: object) -> None:
        self.client.post(server.url + "/sim/fault", json=body).raise_for_status()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    ev = f"tcp://127.0.0.1:{free_port()}"
    ports = [free_port(), free_port()]
    replay = f"tcp://127.0.0.1:{free_port()}"
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    tracker = EventTracker(BlockIndex(), rebuild_batches=1000)
    sources = parse_kv_events(
        [f"{urls[0]}={ev};bind;topic=kv@a;replay={replay}", f"{urls[1]}={ev};bind;topic=kv@b"]
    )
    sub = KvEventSubscriber(sources, tracker, poll_interval_s=0.05)
    sub.start()  # bound before the workers connect: no batch is published unheard
    servers: list[Server] = []
    try:
        with running(servers), httpx.Client(timeout=30, trust_env=False) as client:
            for port, topic, rep in ((ports[0], "kv@a", replay), (ports[1], "kv@b", None)):
                argv = kvroute_argv(
                    "sim-worker",
                    "--port",
                    str(port),
                    "--capacity-tokens",
                    str(16 * BLOCK),
                    "--block-size",
                    str(BLOCK),
                    "--time-scale",
                    "100",
                    "--kv-events-endpoint",
                    ev,
                    "--kv-events-topic",
                    topic,
                )
                if rep:
                    argv += ["--kv-events-replay-endpoint", rep]
                servers.append(start_server(f"sim-{topic}", argv, port))
            time.sleep(0.3)  # the workers' PUB sockets learn our subscription
            yield Fleet(servers[0], servers[1], tracker, client)
    finally:
        assert sub.stop(timeout_s=2)


def test_sim_workers_stores_evictions_loss_flush_restart(fleet: Fleet) -> None:
    a, b = fleet.a, fleet.b
    p = prompt(1)  # 100 tokens: 6 full blocks
    assert fleet.complete(a, p) == 0
    wait_for(lambda: fleet.held(a, p) == 96, what="stored")
    assert fleet.row(a)["mode"] == "precise" and fleet.held(b, p) == 0
    assert fleet.complete(a, p) == 96, "index == what the worker reports"
    assert PreciseView(fleet.tracker).match(p) == ({a.url: 96}, {a.url})

    # Evictions: the cache holds 16 blocks; three more prompts push p out.
    for seed in (2, 3, 4):
        fleet.complete(a, prompt(seed))
    wait_for(lambda: fleet.held(a, p) < 96, what="removed")
    time.sleep(0.2)
    predicted = fleet.held(a, p)
    assert fleet.complete(a, p) == predicted, "the worker reuses what the index still has"

    # A lost batch: A recovers it by replay, B (no replay) goes stale.
    for w in (a, b):
        fleet.complete(w, prompt(5))
        wait_for(lambda w=w: fleet.held(w, prompt(5)) == 96, what="prompt 5")  # type: ignore[misc]
        fleet.fault(w, drop_next_events=1)
        fleet.complete(w, prompt(6))  # its events are lost
        fleet.complete(w, prompt(7))
    wait_for(lambda: fleet.row(a)["replays"] == 1, what="replay on A")
    wait_for(lambda: fleet.row(b)["gaps"] == 1, what="gap on B")
    wait_for(lambda: fleet.held(a, prompt(7)) == 96, what="A caught up")
    assert fleet.row(a)["mode"] == "precise" and fleet.held(a, prompt(6)) == 96
    assert fleet.row(b)["mode"] == "stale" and fleet.held(b, prompt(6)) == 0
    assert b.url not in PreciseView(fleet.tracker).match(prompt(7))[1]

    # A cache flush tells B's subscriber the whole state (empty): precise again.
    fleet.client.post(b.url + "/flush_cache").raise_for_status()
    fleet.complete(b, prompt(8))
    wait_for(lambda: fleet.row(b)["mode"] == "precise", what="B rebuilt")
    wait_for(lambda: fleet.held(b, prompt(8)) == 96, what="B holds prompt 8")
    assert fleet.held(b, prompt(7)) == 0

    # A restart (seq back to 0) drops A's state.
    fleet.fault(a, reset_seq=True)
    fleet.complete(a, prompt(9))
    wait_for(lambda: fleet.row(a)["restarts"] == 1, what="restart")
    assert fleet.held(a, prompt(7)) == 0
    assert fleet.row(a)["last_seq"] == 0
