"""Router replicas sharing their state through Redis (``--state-store``).

Three things are shared, each so that losing Redis only degrades routing to what one
router knows alone:

* **Routing state** (``digests``, ``store``): every decision is published as (worker,
  the prompt's 64-bit block digests) to a bounded Redis Stream and applied by the other
  routers to their own index. With the store on, the index is keyed by those digests
  (``DigestIndex``), so a peer's decision lands in the very tree a local one does, under
  the same per-worker budget: a prefix routed by router A is matched by router B, and
  every router evicts the same way. No prompt text or token ID leaves the router.
* **Load** (``store.StateStore.peer_load``): each router rewrites its in-flight count
  per worker into a hash with a TTL every heartbeat, and sums the other live routers';
  between heartbeats each decision read off the stream counts one more on its worker.
  The registry adds it to its own counts (``Registry.peer_load``), so balance decisions
  and the saturation guard see the fleet's load; a crashed router's load expires with
  its hash. The work model reads the same mapping (each peer request takes a slot),
  and also the others' **queued prefill** (``prefill``): how many of their requests wait
  for a first byte on each worker and their uncached tokens, published as they change,
  so each router predicts a request's time to first token on the fleet's whole queue.
* **Membership**: workers added or removed through the admin API are written to a
  shared hash and announced on the stream; every router applies them. Routers announce
  themselves with the same heartbeat, and ``/status``, ``/routers`` and ``/workers``
  (a header; ``?include=routers``) show the live ones.

``wire`` documents the keys; ``store`` the failure semantics and why a stream;
``applying`` what a peer's entry does here; ``members`` how the worker list is kept in
step; ``heartbeat`` the load and live-router records; ``prefill`` the queued prefill.
"""

from kvroute.fleet.shared.applying import StoreCounters
from kvroute.fleet.shared.digests import BLOCK_SIZE, DigestIndex, block_digests
from kvroute.fleet.shared.store import StateStore
from kvroute.fleet.shared.wire import StoreURL

__all__ = [
    "BLOCK_SIZE",
    "DigestIndex",
    "StateStore",
    "StoreCounters",
    "StoreURL",
    "block_digests",
]
