"""The HTTP routing-quality run (``kvroute.quality``) on two simulated workers: the row
counts every request on the worker that served it, carries the workers' own TTFTs, and
with a time scale reports client times in model seconds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.procs import Server
from kvroute.quality import RouterSpec, run_router, start_sim_workers
from kvroute.sim.workloads import gsp

ROOT = Path(__file__).resolve().parents[1]
SCALE = 4.0


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
