"""Prometheus metrics of one router instance (its own CollectorRegistry).

Per-request series are counters and histograms updated on the request path; fleet
state (in-flight, health, index size, tokenizer cache) is read when ``/metrics`` is
scraped, by a collector, so it costs nothing per request.

The request path does not call prometheus_client itself: its children are plain
numbers moved in when a metric is read (``kvroute.service.fastmetrics``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvroute.fleet.models import ModelLabels
from kvroute.service.fastmetrics import FlushingCounter, FlushingHistogram, fast_child

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
# Observed / predicted TTFT: 1 is a perfect prediction.
PREDICTION_BUCKETS = (0.125, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4, 8)


# Index gauges shown only where they apply: (snapshot key, name, help).
OPTIONAL_INDEX_GAUGES = (
    (
        "prompts_in_flight",
        "kvroute_index_prompts_in_flight",
        "Prompts of requests in flight kept beside the index once its budget has "
        "evicted (matched where the budget forgot them; precise mode's pending)",
    ),
    (
        "bytes_per_token",
        "kvroute_index_bytes_per_token",
        "Routing on bytes: the bytes per engine token the index budgets count "
        "(learned from the answers' usage)",
    ),
)


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
            "Requests a worker runs at once before it queues (fixed, reported or learned; "
            "absent while unknown)",
            labels=["worker"],
        )
        external = GaugeMetricFamily(
            "kvroute_worker_external_load",
            "Requests a worker's engine last reported running or waiting beyond this "
            "router's own (other routers, bypassing clients; absent with the guard off)",
            labels=["worker"],
        )
        work = {
            key: GaugeMetricFamily(f"kvroute_worker_{key}", text, labels=["worker"])
            for key, text in (
                (
                    "prefill_tokens_queued",
                    "Predicted uncached prompt tokens routed to a "
                    "worker whose first byte has not come back (work model)",
                ),
                ("decode_tokens", "Expected output tokens of the requests in flight"),
                (
                    "predicted_wait_s",
                    "Predicted wait before a request routed now starts "
                    "its own prefill: queued prefill and the wait for a slot",
                ),
                (
                    "occupancy_stretch",
                    "How much routing choices stretch a worker's predicted times for its "
                    "occupied decode slots: 1 / (1 - in flight / capacity), 1 while its "
                    "capacity is unknown",
                ),
                ("prefill_tokens_per_s", "Learned prefill speed (prior until observed)"),
                (
                    "prefill_overhead_ms",
                    "Learned per-request time to first byte apart from the prefill tokens",
                ),
                ("decode_ms_per_token", "Learned time per output token"),
                (
                    "decode_ms_per_token_alone",
                    "Learned time per output token with no other request running (the "
                    "line that times decoding requests' ends)",
                ),
                (
                    "decode_ms_per_token_per_request",
                    "Learned time per output token added by each request running beside it",
                ),
            )
        }
        for w in snap["workers"]:
            for key, fam in work.items():
                if w.get("work") is not None:
                    fam.add_metric([w["url"]], w["work"][key])
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
        yield from work.values()
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
        for key, name, doc in OPTIONAL_INDEX_GAUGES:
            if stats.get(key) is not None:
                yield GaugeMetricFamily(name, doc, value=stats[key])
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
            "kvroute_template_cache_hits",
            "Chat renders of the model's template built from a cached shape",
            value=tok.get("template_hits", 0),
        )
        yield GaugeMetricFamily(
            "kvroute_template_cache_misses",
            "Chat renders of the model's template rendered in full",
            value=tok.get("template_misses", 0),
        )
        decide = GaugeMetricFamily(
            "kvroute_decide_first",
            "--decide-first: prompts routed on their known start (early) or encoded first",
            labels=["outcome"],
        )
        decide.add_metric(["early"], tok.get("decided_early", 0))
        decide.add_metric(["encoded_first"], tok.get("encoded_first", 0))
        yield decide
        yield GaugeMetricFamily(
            "kvroute_asyncio_tasks",
            "asyncio tasks alive in the router's event loop (requests, health checks)",
            value=snap["asyncio_tasks"],
        )


class Children(dict[tuple[str, ...], Any]):
    """A labelled metric's children by label values, looked up in a plain dict:
    prometheus_client's ``labels()`` validates and takes a lock on every call, and the
    request path calls it for several metrics per request. The children are
    ``FastCounter`` / ``FastHistogram`` handles (see the module docstring)."""

    def __init__(self, metric: FlushingCounter | FlushingHistogram) -> None:
        super().__init__()
        self.metric = metric

    def __missing__(self, key: tuple[str, ...]) -> Any:
        child = self[key] = fast_child(self.metric, self.metric.labels(*key))
        return child


class RouterMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = FlushingCounter(
            "kvroute_requests", "Requests by route and status", ["route", "status"], registry=r
        )
        self.latency = FlushingHistogram(
            "kvroute_request_latency_seconds",
            "Time from request to the end of the response",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfb = FlushingHistogram(
            "kvroute_time_to_first_byte_seconds",
            "Time from request to the first response byte from the worker",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decisions = FlushingCounter(
            "kvroute_routing_decisions",
            "Routing decisions by policy, reason and match source (precise/approximate)",
            ["policy", "reason", "source"],
            registry=r,
        )
        self.predicted_cached = FlushingCounter(
            "kvroute_predicted_cached_tokens",
            "Prompt tokens the router expected the chosen worker to hold "
            "(counted for answers that report cached_tokens)",
            ["source"],
            registry=r,
        )
        self.reported_cached = FlushingCounter(
            "kvroute_reported_cached_tokens",
            "Prompt tokens the workers reported as cached (usage.prompt_tokens_details)",
            ["source"],
            registry=r,
        )
        self.reported_prompt = FlushingCounter(
            "kvroute_reported_prompt_tokens",
            "Prompt tokens of the answers that reported cached_tokens (the denominator "
            "of the workers' hit rate)",
            ["source"],
            registry=r,
        )
        self.matched_ratio = FlushingHistogram(
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
        self.quarantined = Counter(
            "kvroute_quarantined",
            "Requests that broke the connection to two workers (502; fingerprint quarantined)",
            registry=r,
        )
        self.quarantine_refused = Counter(
            "kvroute_quarantine_refused",
            "Copies of a quarantined request refused at once (502)",
            registry=r,
        )
        self.rejected = Counter(
            "kvroute_rejected", "Requests refused by admission control", ["reason"], registry=r
        )
        self.edge_reads = Counter(
            "kvroute_engine_reads_between_checks",
            "Engine /metrics readings between health checks: a worker whose capacity is not "
            "learned, with more requests routed to it than it was seen running with none waiting; "
            "at most every 0.25 s, and a health check's interval after a reading that found no "
            "running/waiting counts",
            registry=r,
        )
        self.model_requests = FlushingCounter(
            "kvroute_model_requests",
            "Requests routed by the model they ask for ('default' when they name none; "
            "past 32 names, 'other')",
            ["model"],
            registry=r,
        )
        self.model_label = ModelLabels(32)
        self.prediction_ratio = Histogram(
            "kvroute_ttft_prediction_ratio",
            "Observed / predicted time to first token of streamed answers (work model; 1 = exact)",
            buckets=PREDICTION_BUCKETS,
            registry=r,
        )
        self.prediction_error = Histogram(
            "kvroute_ttft_prediction_abs_error_seconds",
            "|observed - predicted| time to first token of streamed answers; "
            "_sum / _count is the mean absolute error",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_FleetCollector(snapshot))
        # The request path's children (label values -> child).
        self.requests_by = Children(self.requests)
        self.latency_by = Children(self.latency)
        self.ttfb_by = Children(self.ttfb)
        self.decisions_by = Children(self.decisions)
        self.predicted_by = Children(self.predicted_cached)
        self.reported_by = Children(self.reported_cached)
        self.reported_prompt_by = Children(self.reported_prompt)
        self.model_requests_by = Children(self.model_requests)
        self.matched_ratio_fast = fast_child(self.matched_ratio, self.matched_ratio)

    def observe_prediction(self, worker: str, predicted: float, observed: float) -> None:
        """A first byte came back: how good was the work model's TTFT prediction?"""
        if predicted > 0:
            self.prediction_ratio.observe(observed / predicted)
        self.prediction_error.observe(abs(observed - predicted))

    def prediction_stats(self) -> dict[str, float]:
        """Predictions checked so far and their mean absolute error (seconds)."""
        count = total = 0.0
        for metric in self.prediction_error.collect():
            for sample in metric.samples:
                if sample.name.endswith("_count"):
                    count = sample.value
                elif sample.name.endswith("_sum"):
                    total = sample.value
        return {"count": count, "mae_s": total / count if count else 0.0}

    def render(self) -> bytes:
        return generate_latest(self.registry)
