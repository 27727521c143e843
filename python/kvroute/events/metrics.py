"""Prometheus export of the KV event counters (one call: ``register_kv_event_metrics``).

Every series is named ``kvroute_kv_events_*``: per worker the counters of
``WorkerCounters`` (``..._received_total``, ``..._applied_total``, ``..._gaps_total``,
``..._replays_total``, ``..._restarts_total``, ...), ``kvroute_kv_events_worker_mode``
(1 for the current mode) and ``kvroute_kv_events_cached_blocks``; fleet-wide
``kvroute_kv_events_unrouted_messages_total`` and ``..._malformed_messages_total``.

The counters live in the tracker (plain ints under its lock); a custom collector reads
a snapshot at scrape time, so the event path never touches prometheus_client.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvroute.events.subscriber import KvEventSubscriber
from kvroute.events.tracker import COUNTER_NAMES, MODES, EventTracker

PREFIX = "kvroute_kv_events_"
_HELP = {
    "batches": "KV event batches received (live and replayed)",
    "batches_dropped": "KV event batches whose payload did not decode",
    "events_received": "KV events received",
    "events_applied": "KV events applied to the precise index",
    "events_ignored": "KV events ignored (unknown type, LoRA/extra keys, other medium/group)",
    "events_dropped": "KV events that could not be applied (unknown parent, bad shape)",
    "gaps": "Sequence gaps detected (lost batches)",
    "replays": "Gaps fully recovered by replay",
    "replay_failures": "Replays that failed or came back incomplete",
    "restarts": "Engine restarts detected (sequence went backwards)",
    "unknown_parents": "BlockStored events with an unknown parent while precise",
    "stale_transitions": "Times a worker's precise state was dropped as stale",
}


class KvEventsCollector(Collector):
    def __init__(self, tracker: EventTracker, subscriber: KvEventSubscriber | None = None):
        self.tracker = tracker
        self.subscriber = subscriber

    def collect(self) -> Iterator[Metric]:
        snap = self.tracker.snapshot()
        for name in COUNTER_NAMES:
            metric = PREFIX + name.removeprefix("events_")
            fam = CounterMetricFamily(metric, _HELP[name], labels=["worker"])
            for worker, row in snap.items():
                fam.add_metric([worker], float(row[name]))
            yield fam
        mode = GaugeMetricFamily(
            PREFIX + "worker_mode",
            "1 for the worker's current routing mode (approximate, precise, stale)",
            labels=["worker", "mode"],
        )
        blocks = GaugeMetricFamily(
            PREFIX + "cached_blocks", "Blocks each worker holds per its events", labels=["worker"]
        )
        for worker, row in snap.items():
            for m in MODES:
                mode.add_metric([worker, m], 1.0 if row["mode"] == m else 0.0)
            blocks.add_metric([worker], float(row["cached_blocks"]))
        yield mode
        yield blocks
        if self.subscriber is not None:
            yield CounterMetricFamily(
                PREFIX + "unrouted_messages",
                "KV event messages whose topic matched no configured worker",
                value=float(self.subscriber.unrouted),
            )
            yield CounterMetricFamily(
                PREFIX + "malformed_messages",
                "KV event messages that were not [topic, seq, payload]",
                value=float(self.subscriber.malformed),
            )


def register_kv_event_metrics(
    registry: CollectorRegistry,
    tracker: EventTracker,
    subscriber: KvEventSubscriber | None = None,
) -> KvEventsCollector:
    """Export the tracker's per-worker counters and modes on ``registry``."""
    collector = KvEventsCollector(tracker, subscriber)
    registry.register(collector)
    return collector
