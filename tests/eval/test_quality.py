"""The routing-quality harness (``kvroute.eval.quality``): router specs, the precise-mode
wiring (workers publishing events, the router subscribed and trusting every stream
before the timed run), the router counters it reports; and an HTTP run on two simulated
workers: the row counts every request on the worker that served it, carries the
workers' own TTFTs, and with a time scale reports client times in model seconds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.eval.procs import Server
from kvroute.eval.quality import (
    RouterSpec,
    kvroute_spec,
    routing_counters,
    run_router,
    start_sim_workers,
)
from kvroute.sim import workloads as wl
from kvroute.sim.workloads import gsp

ROOT = Path(__file__).resolve().parents[2]
SCALE = 4.0


METRICS = """\
# HELP kvroute_routing_decisions_total Routing decisions
kvroute_routing_decisions_total{policy="cache_aware",reason="cache_hit",source="precise"} 7.0
kvroute_routing_decisions_total{policy="cache_aware",reason="cache_miss",source="precise"} 3.0
kvroute_routing_decisions_created{policy="cache_aware",reason="cache_hit",source="precise"} 1.7e9
kvroute_predicted_cached_tokens_total{source="precise"} 4096.0
kvroute_reported_cached_tokens_total{source="precise"} 4080.0
kvroute_requests_total{route="completions",status="200"} 10.0
"""


def test_specs() -> None:
    plain = kvroute_spec("cache_aware", ["--max-tree-size", "100"])
    assert (plain.policy, plain.kv_events, plain.args) == (
        "cache_aware",
        False,
        ("--max-tree-size", "100"),
    )
    precise = kvroute_spec("cache_aware+events")
    assert (precise.policy, precise.kv_events) == ("cache_aware", True)
    assert precise.name == "kvroute cache_aware (precise)"


def test_routing_counters() -> None:
    assert routing_counters(METRICS) == {
        "cache_hit/precise": 7.0,
        "cache_miss/precise": 3.0,
        "predicted/precise": 4096.0,
        "reported/precise": 4080.0,
    }


@pytest.mark.parametrize("replicas", [1, 2])
def test_precise_run_over_http(tmp_path: Path, replicas: int) -> None:
    """Every worker trusted before the replay, every decision made on events, and the
    router's predicted reuse is what the workers reported. With two routers in front of
    the same workers, each subscribes to every worker's own PUB socket."""
    reqs = wl.gsp(3, 3, 256, 16, 2, seed=0, arrivals="poisson", rate=5.0)
    logs = str(tmp_path)
    workers = start_sim_workers(
        2, logs, ["--time-scale", "4"], kv_events=True, publishers_bind=replicas > 1
    )
    if replicas > 1:
        assert all(";connect;" in str(w.extra["kv_events"]) for w in workers)
    try:
        row = run_router(
            kvroute_spec("cache_aware+events"),
            workers,
            reqs,
            log_dir=logs,
            root=tmp_path,
            time_scale=4.0,
            replicas=replicas,
        )
    finally:
        for w in workers:
            w.stop()
    counters = row.extra["routing"]
    assert row.errors == 0 and row.requests == len(reqs)
    if replicas > 1:
        assert row.extra["router_replicas"] == replicas
    assert counters["mode/precise"] == 2 * replicas  # every router trusts both workers
    decided = {k: v for k, v in counters.items() if k.split("/")[0] in ("cache_hit", "cache_miss")}
    assert sum(decided.values()) == len(reqs)
    assert all(k.endswith("/precise") for k in decided)
    if replicas == 1:
        assert row.hit_rate > 0
    assert counters["reported/precise"] == row.cached_tokens


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    logs = str(tmp_path_factory.mktemp("quality"))
    # 1,000 prefill tokens/s: a 300-token cold prompt costs 0.3 model s, a hit ~0.01 s.
    args = ["--prefill-tokens-per-s", "1000", "--time-scale", str(SCALE)]
    ws = start_sim_workers(2, logs, args)
    yield ws
    for w in ws:
        w.stop()


def test_row_from_workers_accounting(workers: list[Server], tmp_path: Path) -> None:
    requests = gsp(2, 4, 256, 32, 2, seed=3, arrivals="poisson", rate=4.0)
    spec = RouterSpec("kvroute cache_aware", "kvroute", "cache_aware")
    row = run_router(spec, workers, requests, log_dir=str(tmp_path), root=ROOT, time_scale=SCALE)
    assert row.errors == 0 and row.requests == len(requests)
    assert sum(row.extra["per_worker"]) == len(requests)
    # Two groups, first request of each cold: 3 of 4 find the 256-token system prompt.
    assert row.cached_tokens == 2 * 3 * 256
    # Workers time model seconds; clients' wall times are scaled back to model seconds,
    # so they can only be longer (router and HTTP come on top).
    assert 0 < row.extra["worker_ttft_p50"] <= row.extra["worker_ttft_p99"]
    assert row.ttft_p99 >= row.extra["worker_ttft_p99"] * 0.95
    assert row.extra["worker_ttft_p99"] > 0.25  # a cold 288-token prefill at 1,000 tok/s
