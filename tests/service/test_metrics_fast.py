"""The request path's counters and histograms (``kvroute.service.metrics``): plain
numbers on the request path, the same exposition as prometheus_client's own when read."""

from __future__ import annotations

from typing import Any

import prometheus_client.values
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvroute.service.metrics import LATENCY_BUCKETS, RouterMetrics
from kvroute.service.status import counter_totals


def _snapshot() -> dict[str, Any]:
    return {
        "workers": [],
        "index": {"nodes": 0, "memory_bytes": 0, "evicted_tokens": 0},
        "tokenizer": {"hits": 0, "misses": 0, "bytes": 0},
        "asyncio_tasks": 0,
    }


def _lines(text: bytes, prefix: str) -> list[str]:
    """The samples of one family, without their creation times."""
    lines = text.decode().splitlines()
    return [line for line in lines if line.startswith(prefix) and "_created" not in line]


VALUES = [0.0004, 0.001, 0.0011, 0.003, 0.25, 0.2500001, 7.0, 299.0, 301.0, 1e6]


def test_fast_histogram_renders_as_prometheus_would() -> None:
    m = RouterMetrics(_snapshot)
    reference_registry = CollectorRegistry()
    reference = Histogram(
        "kvroute_request_latency_seconds",
        "x",
        ["route"],
        buckets=LATENCY_BUCKETS,
        registry=reference_registry,
    )
    for v in VALUES:
        m.latency_by[("chat",)].observe(v)
        reference.labels("chat").observe(v)
    prefix = "kvroute_request_latency_seconds_"
    want = _lines(generate_latest(reference_registry), prefix)
    assert _lines(m.render(), prefix) == want
    # Read twice, observed again: nothing counted twice, nothing lost.
    m.render()
    m.latency_by[("chat",)].observe(0.002)
    reference.labels("chat").observe(0.002)
    assert _lines(m.render(), prefix) == _lines(generate_latest(reference_registry), prefix)


def test_fast_counters_are_read_by_render_and_by_the_status_page() -> None:
    m = RouterMetrics(_snapshot)
    reference_registry = CollectorRegistry()
    reference = Counter("kvroute_requests", "x", ["route", "status"], registry=reference_registry)
    for _ in range(3):
        m.requests_by[("chat", "200")].inc()
        reference.labels("chat", "200").inc()
    m.requests.labels("chat", "429").inc()  # prometheus_client's own API still counts
    reference.labels("chat", "429").inc()
    m.decisions_by[("round_robin", "round_robin", "approximate")].inc()
    assert counter_totals(m.decisions, "reason") == {"round_robin": 1.0}
    m.reported_by[("approximate",)].inc(30)
    assert counter_totals(m.reported_cached, "source") == {"approximate": 30.0}
    prefix = "kvroute_requests_total"
    assert _lines(m.render(), prefix) == _lines(generate_latest(reference_registry), prefix)


def test_request_path_takes_no_prometheus_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    m = RouterMetrics(_snapshot)
    m.requests_by[("chat", "200")].inc()  # children exist (created once, then reused)
    m.latency_by[("chat",)].observe(0.1)
    m.render()

    def locked(*args: Any) -> None:
        raise AssertionError("prometheus_client's locked value updated on the request path")

    monkeypatch.setattr(prometheus_client.values.MutexValue, "inc", locked)
    m.requests_by[("chat", "200")].inc()
    m.latency_by[("chat",)].observe(0.1)
    m.matched_ratio_fast.observe(0.5)
    monkeypatch.undo()
    text = m.render().decode()
    assert 'kvroute_requests_total{route="chat",status="200"} 2.0' in text
    assert 'kvroute_request_latency_seconds_count{route="chat"} 2.0' in text
    assert "kvroute_matched_token_ratio_count 1.0" in text
