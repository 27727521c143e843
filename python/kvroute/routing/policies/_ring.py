"""A consistent-hash ring with bounded loads (shared by consistent_hash and prefix_hash).

Each worker owns ``VNODES`` points on a 64-bit ring (BLAKE2b of "url#i"). A key goes to
the first point clockwise from its hash, so adding or removing a worker moves only the
keys of that worker. Bounded load (Mirrokni et al., "Consistent Hashing with Bounded
Loads"): a worker whose load would exceed ``ceil(load_factor * (total + 1) / n)`` is
skipped and the walk continues clockwise, so one hot key cannot sink a worker.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Mapping

from kvroute.routing.policies.base import NoWorkerError

VNODES = 64


def hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Ring:
    def __init__(self, load_factor: float) -> None:
        self.load_factor = load_factor
        self._members: frozenset[str] = frozenset()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _rebuild(self, workers: frozenset[str]) -> None:
        pts = sorted((hash64(f"{w}#{i}".encode()), w) for w in workers for i in range(VNODES))
        self._points = [p for p, _ in pts]
        self._owners = [w for _, w in pts]
        self._members = workers

    def pick(self, key_hash: int, loads: Mapping[str, int]) -> tuple[str, bool]:
        """(worker, True if it is the key's home worker, False if the walk overflowed)."""
        if not loads:
            raise NoWorkerError("no healthy worker")
        members = frozenset(loads)
        if members != self._members:
            self._rebuild(members)
        bound = math.ceil(self.load_factor * (sum(loads.values()) + 1) / len(loads))
        start = bisect.bisect_left(self._points, key_hash) % len(self._points)
        seen: set[str] = set()
        for i in range(len(self._points)):
            w = self._owners[(start + i) % len(self._points)]
            if w in seen:
                continue
            if loads[w] + 1 <= bound:
                return w, not seen
            seen.add(w)
            if len(seen) == len(loads):
                break
        # Every worker is at the bound: take the least loaded.
        return min(loads, key=lambda w: loads[w]), False
