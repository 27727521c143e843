"""Helpers shared by policies."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvroute.routing.policies.base import NoWorkerError


class TieBreaker:
    """Least-loaded choice whose ties rotate instead of always naming the first worker.

    With an idle fleet every worker ties at load 0; picking the first one would send
    every new prefix to the same worker (a weakness seen in other routers). Among tied
    workers the one chosen longest ago wins, so successive new prefixes land on
    different workers. The rotation is per worker, not a shared cursor: requests for
    different models tie over different sets of workers, and a cursor advanced by one
    set would fall into step with the other's order (every request of one model on one
    worker of its set).
    """

    __slots__ = ("_last", "_turn")

    def __init__(self) -> None:
        self._turn = 0
        self._last: dict[str, int] = {}

    def least_loaded(self, loads: Mapping[str, int], among: Iterable[str] | None = None) -> str:
        candidates = list(loads) if among is None else [w for w in among if w in loads]
        if not candidates:
            raise NoWorkerError("no healthy worker")
        best = min(loads[w] for w in candidates)
        last = self._last
        choice = min((w for w in candidates if loads[w] == best), key=lambda w: last.get(w, -1))
        self._turn += 1
        last[choice] = self._turn
        if len(last) > 4096:  # workers that left long ago
            self._last = {w: t for w, t in last.items() if w in loads}
        return choice
