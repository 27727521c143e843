"""round_robin: each request to the next healthy worker in turn, ignoring cache and load.

The baseline cache-aware routing is measured against: requests sharing a prefix are
spread over every worker, so each one recomputes it.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvroute.routing.policies.base import Decision, NoWorkerError, Policy, RouteRequest


class RoundRobin(Policy):
    name = "round_robin"
    needs_tokens = False

    def __init__(self) -> None:
        self._next = 0

    def select(self, request: RouteRequest, loads: Mapping[str, int]) -> Decision:
        if not loads:
            raise NoWorkerError("no healthy worker")
        workers = list(loads)
        worker = workers[self._next % len(workers)]
        self._next += 1
        return Decision(worker, "round_robin")
