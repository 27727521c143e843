"""Precise mode: keep the ``BlockIndex`` in step with the engines' KV cache events.

vLLM and SGLang publish every block they cache or evict over ZMQ (docs/kv-events.md).
This package turns those messages into ``BlockIndex`` updates and tells the routing
policy which workers it can trust:

* ``decode``: msgpack batches, both event encodings, into small dataclasses.
* ``spec``: the ``--kv-events 'URL=ENDPOINT[;topic=T][;replay=ENDPOINT][;bind|;connect]'``
  syntax (documented there).
* ``keyable``: which reported blocks can be keyed by token IDs (no LoRA, multimodal...).
* ``tracker``: per-worker sequence tracking and recovery; modes ``approximate`` /
  ``precise`` / ``stale``.
* ``view``: ``PreciseView``, the policy's entry point.
* ``replay``: the DEALER client for the engine's replay socket.
* ``subscriber``: the background thread with the SUB sockets.
* ``metrics``: the prometheus collector.

Wiring, in the app's lifespan::

    tracker = EventTracker(BlockIndex())
    subscriber = KvEventSubscriber(parse_kv_events(settings.kv_events), tracker)
    subscriber.start()            # raises if a socket cannot bind/connect
    view = PreciseView(tracker)   # the policy calls view.match(tokens)
    ...
    subscriber.stop()
"""

from kvroute.events.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvEventDecodeError,
    decode_batch,
    decode_event,
    normalize_hash,
    parse_seq,
)
from kvroute.events.metrics import KvEventsCollector, register_kv_event_metrics
from kvroute.events.replay import ReplayError, ZmqReplayer
from kvroute.events.spec import (
    KvEventSource,
    KvEventsSpecError,
    parse_kv_events,
    parse_kv_events_spec,
)
from kvroute.events.subscriber import KvEventSubscriber
from kvroute.events.tracker import (
    COUNTER_NAMES,
    MODES,
    EventTracker,
    Mode,
    WorkerCounters,
)
from kvroute.events.view import PreciseView

__all__ = [
    "COUNTER_NAMES",
    "MODES",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventTracker",
    "KvEvent",
    "KvEventBatch",
    "KvEventDecodeError",
    "KvEventSource",
    "KvEventSubscriber",
    "KvEventsCollector",
    "KvEventsSpecError",
    "Mode",
    "PreciseView",
    "ReplayError",
    "WorkerCounters",
    "ZmqReplayer",
    "decode_batch",
    "decode_event",
    "normalize_hash",
    "parse_kv_events",
    "parse_kv_events_spec",
    "parse_seq",
    "register_kv_event_metrics",
]
