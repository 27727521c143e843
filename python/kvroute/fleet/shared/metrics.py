"""Prometheus export of the shared store's counters (``kvroute_state_store_*``).

The counters are plain ints on the store; this collector reads them when ``/metrics``
is scraped, so neither publishing nor applying touches prometheus_client.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvroute.fleet.shared.store import StateStore

P = "kvroute_state_store_"


class StoreCollector(Collector):
    def __init__(self, store: StateStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        s = self.store
        c = s.counters
        yield CounterMetricFamily(
            P + "published", "Routing decisions this router wrote to the stream", value=c.published
        )
        applied = CounterMetricFamily(
            P + "applied",
            "Other routers' decisions and changes applied here (insert, added, removed, cleared)",
            labels=["kind"],
        )
        for kind, n in c.applied.items():
            applied.add_metric([kind], n)
        yield applied
        yield CounterMetricFamily(
            P + "dropped",
            "Routing decisions never published (buffer full, or lost with the connection)",
            value=c.dropped,
        )
        yield CounterMetricFamily(
            P + "refused",
            "Other routers' decisions not applied: their index is keyed differently "
            "(another tokenizer or chat template, or bytes)",
            value=c.refused,
        )
        yield CounterMetricFamily(
            P + "malformed", "Stream entries that could not be applied", value=c.malformed
        )
        yield CounterMetricFamily(
            P + "errors", "Store sessions that failed (down, slow, refused)", value=c.errors
        )
        yield CounterMetricFamily(
            P + "gaps",
            "Reconnects that found the stream trimmed past the last entry read",
            value=c.gaps,
        )
        yield CounterMetricFamily(
            P + "pushed",
            "Other routers' entries applied as pushed to this router (pub/sub), not read by XREAD",
            value=s.pushes.received,
        )
        yield CounterMetricFamily(
            P + "push_gaps",
            "Pushed entries that came after a missing one (their stream read again by XREAD)",
            value=s.pushes.gaps,
        )
        yield GaugeMetricFamily(
            P + "pushed_streams",
            "Other routers whose entries come pushed (their streams out of the XREAD)",
            value=len(s.streams.live),
        )
        yield GaugeMetricFamily(
            P + "connected", "1 while the store is reachable", value=s.connected
        )
        yield GaugeMetricFamily(
            P + "lag_seconds",
            "Publish-to-apply delay of the last peer decision applied (wall clocks)",
            value=c.lag_s,
        )
        yield GaugeMetricFamily(
            P + "buffered", "Decisions waiting to be published", value=len(s._buf)
        )
        yield GaugeMetricFamily(
            P + "live_routers",
            "Routers with a live heartbeat, this one included",
            value=len(s.routers),
        )
        peer = GaugeMetricFamily(
            P + "peer_in_flight",
            "Requests other live routers have in flight per worker",
            labels=["worker"],
        )
        for w, n in s.peer_load.items():
            peer.add_metric([w], n)
        yield peer
