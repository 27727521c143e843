"""Prometheus metrics of one router instance (its own CollectorRegistry).

Per-request series are counters and histograms updated on the request path; fleet
state (in-flight, health, index size, tokenizer cache) is read when ``/metrics`` is
scraped, by a collector, so it costs nothing per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class _FleetCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        in_flight = GaugeMetricFamily(
            "kvroute_worker_in_flight", "Requests in flight per worker", labels=["worker"]
        )
        healthy = GaugeMetricFamily(
            "kvroute_worker_healthy", "1 if the worker is in rotation", labels=["worker"]
        )
        cached = GaugeMetricFamily(
            "kvroute_index_cached_tokens",
            "Tokens the index predicts each worker caches",
            labels=["worker"],
        )
        capacity = GaugeMetricFamily(
            "kvroute_worker_capacity",
            "Requests a worker runs at once before it queues (fixed or learned; "
            "absent while unknown)",
            labels=["worker"],
        )
        external = GaugeMetricFamily(
            "kvroute_worker_external_load",
            "Requests a worker's engine last reported running or waiting beyond this "
            "router's own (other routers, bypassing clients; absent with the guard off)",
            labels=["worker"],
        )
        for w in snap["workers"]:
            in_flight.add_metric([w["url"]], w["in_flight"])
            healthy.add_metric([w["url"]], 1 if w["healthy"] else 0)
            cached.add_metric([w["url"]], w["cached_tokens"])
            if w.get("capacity") is not None:
                capacity.add_metric([w["url"]], w["capacity"])
            if w.get("external_load") is not None:
                external.add_metric([w["url"]], w["external_load"])
        yield in_flight
        yield healthy
        yield cached
        yield capacity
        yield external
        stats = snap["index"]
        yield GaugeMetricFamily("kvroute_index_nodes", "Radix tree nodes", value=stats["nodes"])
        yield GaugeMetricFamily(
            "kvroute_index_memory_bytes", "Estimated index heap bytes", value=stats["memory_bytes"]
        )
        yield GaugeMetricFamily(
            "kvroute_index_evicted_tokens",
            "Tokens evicted from the index by the per-worker budget",
            value=stats["evicted_tokens"],
        )
        tok = snap["tokenizer"]
        yield GaugeMetricFamily(
            "kvroute_tokenizer_cache_hits", "Segment cache hits of the tokenizer", value=tok["hits"]
        )
        yield GaugeMetricFamily(
            "kvroute_tokenizer_cache_misses",
            "Segment cache misses of the tokenizer",
            value=tok["misses"],
        )
        yield GaugeMetricFamily(
            "kvroute_tokenizer_cache_bytes",
            "Estimated memory of the tokenizer's segment cache (--tokenizer-cache-bytes bounds it)",
            value=tok["bytes"],
        )
        yield GaugeMetricFamily(
            "kvroute_asyncio_tasks",
            "asyncio tasks alive in the router's event loop (requests, health checks)",
            value=snap["asyncio_tasks"],
        )


class Children(dict[tuple[str, ...], Any]):
    """A labelled metric's children by label values, looked up in a plain dict:
    prometheus_client's ``labels()`` validates and takes a lock on every call, and the
    request path calls it for several metrics per request."""

    def __init__(self, metric: Counter | Histogram) -> None:
        super().__init__()
        self.metric = metric

    def __missing__(self, key: tuple[str, ...]) -> Any:
        child = self[key] = self.metric.labels(*key)
        return child


class RouterMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvroute_requests", "Requests by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "kvroute_request_latency_seconds",
            "Time from request to the end of the response",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfb = Histogram(
            "kvroute_time_to_first_byte_seconds",
            "Time from request to the first response byte from the worker",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "kvroute_routing_decisions",
            "Routing decisions by policy, reason and match source (precise/approximate)",
            ["policy", "reason", "source"],
            registry=r,
        )
        self.predicted_cached = Counter(
            "kvroute_predicted_cached_tokens",
            "Prompt tokens the router expected the chosen worker to hold "
            "(counted for answers that report cached_tokens)",
            ["source"],
            registry=r,
        )
        self.reported_cached = Counter(
            "kvroute_reported_cached_tokens",
            "Prompt tokens the workers reported as cached (usage.prompt_tokens_details)",
            ["source"],
            registry=r,
        )
        self.matched_ratio = Histogram(
            "kvroute_matched_token_ratio",
            "Matched prefix tokens / request tokens at routing",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "kvroute_retries", "Requests retried on another worker", ["reason"], registry=r
        )
        self.worker_failures = Counter(
            "kvroute_worker_failures",
            "Failures attributed to a worker",
            ["worker", "kind"],
            registry=r,
        )
        self.rejected = Counter(
            "kvroute_rejected", "Requests refused by admission control", ["reason"], registry=r
        )
        r.register(_FleetCollector(snapshot))
        # The request path's children (label values -> child).
        self.requests_by = Children(self.requests)
        self.latency_by = Children(self.latency)
        self.ttfb_by = Children(self.ttfb)
        self.decisions_by = Children(self.decisions)
        self.predicted_by = Children(self.predicted_cached)
        self.reported_by = Children(self.reported_cached)

    def render(self) -> bytes:
        return generate_latest(self.registry)
