"""The /status charts' samples: changes between two readings of the router's counters."""

from __future__ import annotations

from typing import Any

from kvroute.service.metrics import RouterMetrics
from kvroute.service.status import History, chart


def _snapshot() -> dict[str, Any]:
    return {
        "workers": [],
        "index": {"nodes": 0, "memory_bytes": 0, "evicted_tokens": 0},
        "tokenizer": {"hits": 0, "misses": 0, "bytes": 0},
        "asyncio_tasks": 0,
    }


def test_points_are_interval_changes_and_a_quiet_interval_is_a_gap() -> None:
    m = RouterMetrics(_snapshot)
    h = History(m)
    h.sample(now=0.0)  # the baseline: no point yet
    assert list(h.points) == []
    m.reported_by[("approximate",)].inc(30)
    m.reported_prompt_by[("approximate",)].inc(100)
    m.ttfb_by[("chat",)].observe(0.2)
    m.ttfb_by[("chat",)].observe(0.4)
    h.sample(now=5.0)
    m.reported_by[("approximate",)].inc(90)
    m.reported_prompt_by[("approximate",)].inc(100)
    m.ttfb_by[("chat",)].observe(0.1)
    h.sample(now=10.0)
    h.sample(now=15.0)  # nothing happened
    rates = [p.hit_rate for p in h.points]
    ttfb = [p.ttfb_s for p in h.points]
    assert rates[:2] == [0.3, 0.9] and rates[2] is None
    assert ttfb[0] is not None and abs(ttfb[0] - 0.3) < 1e-9 and ttfb[2] is None
    assert [p.requests for p in h.points] == [2, 1, 0]


def test_chart_draws_lines_between_gaps() -> None:
    svg = chart("x", [(0.0, 0.1), (5.0, 0.2), (10.0, None), (15.0, 0.3)], 15.0, ".0%", 1.0)
    assert svg.count("<polyline") == 1 and svg.count("<circle") == 1
    assert "<b>30%</b>" in svg
    assert "no data yet" in chart("x", [(0.0, None)], 0.0, ".0%", 1.0)
