"""Routing quality against real vLLM (CPU build, tiny random model): the slow suite.

Run with ``.venv/bin/pytest -m slow tests/e2e/test_engine_quality.py`` after installing the
engine (docs/real-engine.md) and building the model (``bench/engine/make_tiny_model.py``).

Three replicas, a small shared-prefix chat workload, kvroute round_robin then
cache_aware, both judged by vLLM's own ``/metrics`` prefix-cache counters
(``bench/engine/quality.py`` does the work): cache_aware must find more of the prompt in
cache than round-robin, with every replica doing some of the work.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    path = ROOT / "bench" / "engine" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


quality = _load("quality")
_missing = quality.serve.engine_available()
if _missing:
    pytest.skip(f"real vLLM engine not installed: {_missing}", allow_module_level=True)


def test_cache_aware_beats_round_robin_on_vllm_counters(tmp_path: Path) -> None:
    # 4 groups x 4 requests of ~800-token system prompts: small enough for a few
    # minutes on two cores, large enough that a miss costs a visible prefill.
    requests = quality.workload(4, 4, 800, 20, 2.0, seed=1)
    replicas = quality.start_replicas(3, 32, str(tmp_path))
    try:
        rr = quality.run_router("kvroute-round_robin", replicas, requests, 4, str(tmp_path))
        ca = quality.run_router("kvroute-cache_aware", replicas, requests, 4, str(tmp_path))
    finally:
        for r in replicas:
            r.stop()
    for row in (rr, ca):
        assert row["errors"] == [], row
        assert row["requests"] == len(requests)
        assert sum(row["per_replica"]) == len(requests)
        assert min(row["per_replica"]) > 0, row  # every replica got work
    # 4 groups over 3 replicas: round-robin misses each group's prefix on every replica
    # it lands on, cache_aware only on the one it picks (the first request of a group).
    assert ca["hit_rate_metrics"] > rr["hit_rate_metrics"] + 0.1, (rr, ca)
    assert ca["hit_rate_usage"] > rr["hit_rate_usage"] + 0.1, (rr, ca)


def test_two_precise_routers_route_on_what_vllm_reports() -> None:
    """Two kvroute routers in precise mode (an HA pair, requests dealt in turn) in front of
    replicas that publish KV events, each on its own socket with a replay endpoint: both
    routers trust every replica's stream, every decision is made on the events, and the
    reuse they predicted is close to what vLLM reported. Not exact: a router does not see
    the other's prompts that still wait in an engine's queue (no events yet), so under
    queueing a prompt can find more cached than its router predicted, or less; at 0.5
    requests/s the two routers predicted 8,380 tokens where vLLM reported 11,136. A
    broken event path predicts next to nothing (a stream not applied, keys that do not
    match) or decides on the approximate index, and fails here."""
    # Short socket paths (ipc:// is limited to ~100 characters); removed by the test.
    scratch = tempfile.mkdtemp(prefix="kvroute-eq-")
    requests = quality.workload(4, 4, 800, 20, 0.25, seed=2)
    replicas = quality.start_replicas(3, 32, scratch, events=True)
    try:
        row = quality.run_router(
            "kvroute-cache_aware+events", replicas, requests, 4, scratch, router_replicas=2
        )
    finally:
        for r in replicas:
            r.stop()
    shutil.rmtree(scratch, ignore_errors=True)
    assert row["failed"] == 0, row["errors"]
    assert sum(row["per_replica"]) == len(requests)
    routing = row["routing"]
    # Decision counters are "reason/source"; reuse counters "predicted|reported/source".
    reuse = ("predicted/", "reported/")
    sources = {k.split("/")[1] for k in routing if "/" in k and not k.startswith(reuse)}
    assert sources == {"precise"}, routing
    predicted, reported = routing["predicted/precise"], routing["reported/precise"]
    assert reported > 0 and abs(predicted - reported) <= 0.3 * reported, routing
    assert row["hit_rate_usage"] == pytest.approx(row["hit_rate_metrics"], abs=0.01)
