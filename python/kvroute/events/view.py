"""What the routing policy asks in precise mode: matches it can trust, per worker.

Precise matches count whole blocks the engine reported (``BlockIndex``); they are
returned only for workers whose stream is ``precise``. Every other worker (no events
configured, none received yet, or stale after a loss) is matched on the approximate
``PrefixIndex``, which the policy keeps inserting into for every worker either way,
so it is warm whenever a worker falls back to it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.events.tracker import EventTracker, Mode


class PreciseView:
    """What the routing policy asks in precise mode.

    ``match(tokens)`` returns the matched tokens (whole blocks) per worker that is in
    ``precise`` mode, and the set of those workers; every other worker should be
    matched on the approximate index (the policy does that merge).
    """

    def __init__(self, tracker: EventTracker) -> None:
        self.tracker = tracker

    def match(self, tokens: Sequence[int]) -> tuple[dict[str, int], set[str]]:
        precise = self.tracker.precise_workers()
        if not precise:
            return {}, precise
        partition = self.tracker.partitions.get(tokens[0]) if len(tokens) else None
        if partition is not None:
            # A LoRA adapter's request: its tokens behind the partition token, which
            # counts as matched wherever the adapter's blocks match (as in PrefixIndex).
            got = {w: n + 1 for w, n in partition.match(tokens[1:]).items() if n}
        else:
            got = self.tracker.index.match(tokens)
        return {w: n for w, n in got.items() if w in precise}, precise

    def mode(self, worker: str) -> Mode:
        return self.tracker.mode(worker)
