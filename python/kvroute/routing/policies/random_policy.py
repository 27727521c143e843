"""random: a uniformly random healthy worker (seedable for reproducible simulations)."""

from __future__ import annotations

import random
from collections.abc import Mapping

from kvroute.routing.policies.base import Decision, NoWorkerError, Policy, RouteRequest


class RandomPolicy(Policy):
    name = "random"
    needs_tokens = False

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, request: RouteRequest, loads: Mapping[str, int]) -> Decision:
        if not loads:
            raise NoWorkerError("no healthy worker")
        return Decision(self._rng.choice(list(loads)), "random")
