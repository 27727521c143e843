"""Helpers shared by policies."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvroute.routing.policies.base import NoWorkerError

# Predicted times closer than this are a tie: the model is not that precise, and a
# few-token partial match (``"group 1..."`` vs ``"group 2..."``) must not send every
# new prefix to the same worker.
TIE_ABS_S = 0.001
TIE_REL = 0.02


def tie_window(best: float) -> float:
    """How far above the best predicted time a worker still ties with it."""
    return max(TIE_ABS_S, TIE_REL * best)


class TieBreaker:
    """Least-loaded choice whose ties rotate instead of always naming the first worker.

    With an idle fleet every worker ties at load 0; picking the first one would send
    every new prefix to the same worker (a weakness seen in other routers). A counter
    walks the tied set instead, so successive new prefixes land on different workers.
    """

    __slots__ = ("_turn",)

    def __init__(self) -> None:
        self._turn = 0

    def least_loaded(
        self, loads: Mapping[str, int] | Mapping[str, float], among: Iterable[str] | None = None
    ) -> str:
        candidates = list(loads) if among is None else [w for w in among if w in loads]
        if not candidates:
            raise NoWorkerError("no healthy worker")
        best = min(loads[w] for w in candidates)
        tied = [w for w in candidates if loads[w] == best]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def least_by(self, scores: Mapping[str, float], loads: Mapping[str, int]) -> str:
        """The worker of lowest score (a predicted time); among scores within the tie
        window of the best (``tie_window``), the fewest requests in flight (their
        decode will compete for slots later), then rotation."""
        if not scores:
            raise NoWorkerError("no healthy worker")
        best = min(scores.values())
        tie = tie_window(best)
        tied = {w: loads.get(w, 0) for w, t in scores.items() if t - best <= tie}
        return self.least_loaded(tied)
