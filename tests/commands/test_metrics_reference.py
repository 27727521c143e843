"""The metrics reference in docs/ is generated from the metrics registry and covers every
series a live router exposes."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvroute.commands import _metrics_reference
from kvroute.config import Settings
from kvroute.routing.policies.base import RouteRequest
from kvroute.service.state import RouterState, build_state

DOCS = Path(__file__).resolve().parents[2] / "docs"
WORKER = "http://127.0.0.1:9"


def test_metrics_page_is_what_the_registry_defines() -> None:
    page = (DOCS / "metrics.md").read_text()
    assert page == _metrics_reference.markdown(), (
        "docs/metrics.md is out of date: "
        "python -m kvroute.commands._metrics_reference > docs/metrics.md"
    )


def _exposed_series(tmp_path: Path) -> set[str]:
    """Every family a router in precise mode, recording and sharing state through a
    store (never started) exposes after it routed one request, read from its own
    /metrics text."""
    settings = Settings(
        worker_urls=[WORKER],
        worker_capacity=4,
        kv_events=[f"{WORKER}=tcp://127.0.0.1:9"],
        record=str(tmp_path / "trace.jsonl"),
        token_id_prompts=True,
        state_store="redis://127.0.0.1:9/0",
    ).validate()
    state = build_state(settings)
    state.subscriber.start()
    try:
        return _scrape(state)
    finally:
        state.subscriber.stop()
        state.recorder.close()


def _scrape(state: RouterState) -> set[str]:
    state.registry.record_check(WORKER, True)  # its first health check: in rotation
    decision = state.policy.select(RouteRequest(tokens=[1, 2, 3]), state.registry.loads())
    m = state.metrics
    m.decisions_by[state.policy.name, decision.reason, "approximate"].inc()
    m.requests_by["chat", "200"].inc()
    m.latency_by[("chat",)].observe(0.1)
    m.ttfb_by[("chat",)].observe(0.1)
    m.predicted_by[("approximate",)].inc(1)
    m.reported_by[("approximate",)].inc(1)
    m.reported_prompt_by[("approximate",)].inc(2)
    m.matched_ratio.observe(0.5)
    m.retries.labels("ConnectError").inc()
    m.worker_failures.labels(WORKER, "ConnectError").inc()
    m.rejected.labels("queue_full").inc()
    m.model_requests_by[(m.model_label("m"),)].inc()
    state.events.add_worker(WORKER)  # the worker appears in the event counters
    text = m.render().decode()
    names = set()
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):  # a counter's or histogram's creation time
            continue
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_every_exposed_series_is_on_the_page(tmp_path: Path) -> None:
    page = (DOCS / "metrics.md").read_text()
    exposed = _exposed_series(tmp_path)
    # precise mode's, the recorder's and the shared store's series are read
    assert {
        "kvroute_kv_events_received_total",
        "kvroute_record_dropped_total",
        "kvroute_state_store_published_total",
        "kvroute_state_store_connected",
    } <= exposed
    missing = sorted(n for n in exposed if f"`{n}`" not in page)
    assert missing == []
