"""Router replicas sharing their state through Redis (``--state-store``).

Three things are shared, each so that losing Redis only degrades routing to what one
router knows alone:

* **Routing state** (``digests``, ``store``): every decision is published as (worker,
  the prompt's 64-bit block digests) to the router's own bounded Redis Stream and
  applied by the other routers to their own index. With the store on, the index is
  keyed by those digests (``DigestIndex``), so a peer's decision lands in the very tree
  a local one does, under the same per-worker budget: a prefix routed by router A is
  matched by router B, and every router evicts the same way. No prompt text or token
  ID leaves the router.
* **Load** (``loads``, ``store.StateStore.peer_load``): each router publishes its
  load per worker on the stream whenever it changes (requests in flight, those waiting
  for a first byte, their uncached tokens, when its decoding ones should end) and adds
  the others' to its own: the registry's counts (``Registry.peer_load``: balance
  decisions, saturation guard) and the work model's queue and slots (``LoadModel.peer``,
  ``peer_pending``, ``peer_prefill``, ``peer_ends``), so each router balances and
  predicts on the fleet's load. Heartbeats (a hash with a TTL
  per router) expire a crashed router's load.
* **Membership**: workers added or removed through the admin API are written to a
  shared hash and announced on the stream; every router applies them. Routers announce
  themselves with the same heartbeat, and ``/status``, ``/routers`` and ``/workers``
  (a header; ``?include=routers``) show the live ones.

``wire`` documents the keys; ``store`` the failure semantics and why streams;
``publishing`` how a router writes without waiting; ``streams`` why one stream per
router and which ones a router reads; ``applying`` what a peer's entry does here;
``members`` how the worker list is kept in step; ``heartbeat`` the load and live-router
records (and the registry that finds them without scanning); ``loads`` the load shared
as it changes; ``server`` the client for a store URL (Sentinel included), the servers the
store refuses, and ``kvroute doctor``'s checks of one.
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
