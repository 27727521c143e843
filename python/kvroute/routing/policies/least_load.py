"""least_load: the healthy worker with the fewest in-flight requests; ties rotate."""

from __future__ import annotations

from collections.abc import Mapping

from kvroute.routing.policies._common import TieBreaker
from kvroute.routing.policies.base import Decision, Policy, RouteRequest


class LeastLoad(Policy):
    name = "least_load"
    needs_tokens = False

    def __init__(self) -> None:
        self._ties = TieBreaker()

    def select(self, request: RouteRequest, loads: Mapping[str, int]) -> Decision:
        return Decision(self._ties.least_loaded(loads), "least_load")
