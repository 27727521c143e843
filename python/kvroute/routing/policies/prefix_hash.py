"""prefix_hash: hash the first N tokens (default 256) onto a consistent-hash ring.

A cheap, stateless stand-in for cache-aware routing: requests whose first N tokens are
identical (same system prompt) share a home worker, found in O(log workers) without a
tree. Bounded load as in ``consistent_hash``. It cannot see longer shared prefixes that
start to differ before N tokens, nor reuse below N.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvroute.routing.policies._ring import Ring, hash64
from kvroute.routing.policies.base import Decision, Policy, RouteRequest
from kvroute.routing.policies.consistent_hash import prefix_key


class PrefixHash(Policy):
    name = "prefix_hash"

    def __init__(self, *, prefix_tokens: int = 256, load_factor: float = 1.25) -> None:
        self.prefix_tokens = prefix_tokens
        self._ring = Ring(load_factor)

    def select(self, request: RouteRequest, loads: Mapping[str, int]) -> Decision:
        key = prefix_key(request.tokens, self.prefix_tokens)
        worker, home = self._ring.pick(hash64(key), loads)
        return Decision(worker, "prefix_hash" if home else "overflow")
