"""The metrics reference (``docs/metrics.md``), generated from the router's own metrics
registry (``kvroute.service.metrics``) and the KV event collector
(``kvroute.events.metrics``), so the page cannot drift from what ``/metrics`` serves.

Regenerate with ``python -m kvroute.commands._metrics_reference > docs/metrics.md``; a
test fails when the committed page differs from what this prints, or when a series a
live router exposes is missing from it.

How: a registry is built exactly as ``kvroute serve`` builds it (one worker, precise mode
on, so every per-worker family and every ``kvroute_kv_events_*`` family is registered),
and each collector is asked for its families. Name, type, labels and help text come from
the metric definitions themselves.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.registry import CollectorRegistry

from kvroute.routing.policies.base import Reason

HEADER = """# Metrics reference

Every series `kvroute serve` exposes on `GET /metrics` (Prometheus text format),
generated from the metrics registry itself
(`python -m kvroute.commands._metrics_reference > docs/metrics.md`). Counters are
exposed with the `_total` suffix (and a `_created` timestamp); histograms as `_bucket`,
`_sum` and `_count`.
Per-worker series carry the worker's URL in the `worker` label.

Routing decisions are labelled by `reason`: {reasons}.
The `kvroute_kv_events_*` series appear in precise mode only (`--kv-events`, see
[Precise mode](precise-mode.md)); the `kvroute_record_*` series with `--record` only;
the `kvroute_state_store_*` series with `--state-store` only (see
[Running several routers](several-routers.md)).
"""


@dataclass(frozen=True)
class MetricDoc:
    name: str  # as exposed (counters with _total)
    kind: str
    labels: tuple[str, ...]
    help: str


def _snapshot() -> dict[str, Any]:
    """A one-worker fleet, with every optional per-worker reading present."""
    worker = {
        "url": "http://worker:8000",
        "in_flight": 0,
        "healthy": True,
        "cached_tokens": 0,
        "capacity": 1,
        "external_load": 0,
    }
    return {
        "workers": [worker],
        "index": {
            "nodes": 0,
            "memory_bytes": 0,
            "evicted_tokens": 0,
            "bytes_per_token": 4.0,
            "prompts_in_flight": 0,
        },
        "tokenizer": {"hits": 0, "misses": 0, "bytes": 0},
        "asyncio_tasks": 0,
    }


class _Subscriber:
    unrouted = 0
    malformed = 0


class _Recorder:
    written = dropped = failed = 0


def registry() -> CollectorRegistry:
    """The registry of a router in precise mode, recording and sharing state through a
    store (never connected), with one worker."""
    from kvroute._native import BlockIndex
    from kvroute.config import Settings, StoreURL
    from kvroute.events.metrics import register_kv_event_metrics
    from kvroute.events.tracker import EventTracker
    from kvroute.fleet.registry import Registry
    from kvroute.fleet.shared import StateStore
    from kvroute.fleet.shared.metrics import StoreCollector
    from kvroute.service.metrics import RouterMetrics
    from kvroute.service.recorder import RecorderCollector

    metrics = RouterMetrics(_snapshot)
    register_kv_event_metrics(
        metrics.registry,
        EventTracker(BlockIndex()),
        _Subscriber(),  # type: ignore[arg-type]
    )
    metrics.registry.register(RecorderCollector(_Recorder()))  # type: ignore[arg-type]
    worker = _snapshot()["workers"][0]["url"]
    store = StateStore(
        StoreURL("redis://store:6379/0"),
        Registry(Settings(worker_urls=[worker]).validate()),
        None,
        router_url="http://router:30000",
        version="reference",
    )
    store.peer_load[worker] = 0  # the per-worker family has a sample
    metrics.registry.register(StoreCollector(store))
    return metrics.registry


def metrics() -> list[MetricDoc]:
    reg = registry()
    out: dict[str, MetricDoc] = {}
    for collector in list(reg._collector_to_names):
        if isinstance(collector, Counter | Histogram):
            kind = "counter" if isinstance(collector, Counter) else "histogram"
            name = collector._name + ("_total" if kind == "counter" else "")
            labels = tuple(collector._labelnames)
            out[name] = MetricDoc(name, kind, labels, collector._documentation)
            continue
        for family in collector.collect():
            kind = family.type
            name = family.name + ("_total" if kind == "counter" else "")
            labels = tuple(getattr(family, "_labelnames", ()))
            out[name] = MetricDoc(name, kind, labels, family.documentation)
    return sorted(out.values(), key=lambda m: m.name)


def markdown() -> str:
    reasons = ", ".join(f"`{r}`" for r in typing.get_args(Reason))
    lines = [HEADER.format(reasons=reasons)]
    lines.append("| series | type | labels | meaning |\n|---|---|---|---|")
    for m in metrics():
        labels = ", ".join(f"`{label}`" for label in m.labels)
        text = " ".join(m.help.split()).replace("|", "\\|")
        lines.append(f"| `{m.name}` | {m.kind} | {labels} | {text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
