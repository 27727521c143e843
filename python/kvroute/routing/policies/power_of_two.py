"""power_of_two: sample two distinct healthy workers at random, take the less loaded.

The classic "power of two choices": nearly the balance of least-load at the cost of two
lookups, and no herd on a single idle worker when loads are stale. Ties go to either.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from kvroute.routing.policies.base import Decision, NoWorkerError, Policy, RouteRequest


class PowerOfTwo(Policy):
    name = "power_of_two"
    needs_tokens = False

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, request: RouteRequest, loads: Mapping[str, int]) -> Decision:
        if not loads:
            raise NoWorkerError("no healthy worker")
        workers = list(loads)
        if len(workers) == 1:
            return Decision(workers[0], "power_of_two")
        a, b = self._rng.sample(workers, 2)
        return Decision(a if loads[a] <= loads[b] else b, "power_of_two")
