"""The fleet as the router sees it: workers, their load reservations and their health.

Load: ``in_flight`` counts requests the router has sent to a worker and not yet seen
end. ``reserve`` increments it in the same synchronous step as the policy decision and
returns a ``Reservation`` whose ``release`` decrements it exactly once, whatever ends
the request (success, upstream error, timeout, client disconnect).

Health: a worker leaves the rotation when
* a request to it fails before any response byte (connection refused/reset, connect or
  first-byte timeout) — passive detection, immediate; it then sits out at least
  ``failure_cooldown_secs`` even if its health endpoint still answers;
* ``health_failure_threshold`` consecutive active checks fail;
* its circuit breaker opens: ``circuit_breaker_failures`` consecutive 5xx answers; it is
  then skipped for ``circuit_breaker_cooldown_secs`` and let back in (half-open) after.
It comes back after ``health_success_threshold`` consecutive successful checks. When a
worker goes down its prefixes are dropped from the index, so the policy spreads them over
the survivors by load instead of guessing that a dead cache still holds them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvroute.config import Settings

log = logging.getLogger("kvroute.fleet.registry")


@dataclass(slots=True)
class Worker:
    url: str
    healthy: bool = True
    in_flight: int = 0
    served: int = 0
    failed: int = 0
    check_failures: int = 0
    check_successes: int = 0
    consecutive_5xx: int = 0
    circuit_open_until: float = 0.0
    # A worker that failed a request stays out at least until then, even if its health
    # endpoint answers (a worker can answer /health and still hang on inference).
    cooldown_until: float = 0.0
    down_reason: str = ""
    extra: dict[str, object] = field(default_factory=dict)

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.circuit_open_until and now >= self.cooldown_until


class Reservation:
    """One unit of load on one worker; ``release`` is idempotent."""

    __slots__ = ("_on_release", "_registry", "released", "worker")

    def __init__(
        self, registry: Registry, worker: Worker, on_release: Callable[[], None] | None = None
    ) -> None:
        self._registry = registry
        self.worker = worker
        self.released = False
        self._on_release = on_release

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.worker.in_flight -= 1
            if self._on_release is not None:
                self._on_release()


class Registry:
    """Workers by URL. All methods run on the event loop thread (no locking needed)."""

    def __init__(
        self,
        settings: Settings,
        on_down: Callable[[str], None] | None = None,
        on_added: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.workers: dict[str, Worker] = {}
        self._on_down = on_down
        self._on_added = on_added
        # Requests other router replicas have in flight per worker (--state-store:
        # ``kvroute.fleet.shared``), added to this router's own in ``loads``.
        self.peer_load: Mapping[str, int] = {}

    def add(self, url: str) -> Worker:
        if url in self.workers:
            return self.workers[url]
        w = Worker(url)
        self.workers[url] = w
        if self._on_added is not None:
            self._on_added(url)
        log.info("worker added: %s", url)
        return w

    def remove(self, url: str) -> Worker | None:
        w = self.workers.pop(url, None)
        if w is not None:
            if self._on_down is not None:
                self._on_down(url)
            log.info("worker removed: %s", url)
        return w

    def loads(self, exclude: set[str] | frozenset[str] = frozenset()) -> dict[str, int]:
        """In-flight count of every worker that can take a request now (this router's,
        plus other routers' when they share their load)."""
        now = time.monotonic()
        peer = self.peer_load
        if peer:
            return {
                u: w.in_flight + peer.get(u, 0)
                for u, w in self.workers.items()
                if u not in exclude and w.available(now)
            }
        return {
            u: w.in_flight for u, w in self.workers.items() if u not in exclude and w.available(now)
        }

    def reserve(self, url: str, on_release: Callable[[], None] | None = None) -> Reservation:
        """One unit of load on ``url``; ``on_release`` runs once when it is released."""
        w = self.workers[url]
        w.in_flight += 1
        w.served += 1
        return Reservation(self, w, on_release)

    def healthy_count(self) -> int:
        now = time.monotonic()
        return sum(1 for w in self.workers.values() if w.available(now))

    # ------------------------------------------------------------- health events

    def mark_down(self, url: str, reason: str, *, passive: bool = False) -> None:
        """Take ``url`` out of rotation. ``passive``: a real request failed on it, so it
        also sits out ``failure_cooldown_secs`` whatever its health checks say."""
        w = self.workers.get(url)
        if w is None:
            return
        if passive:
            w.cooldown_until = time.monotonic() + self.settings.failure_cooldown_secs
        w.failed += 1
        w.check_successes = 0
        if w.healthy:
            w.healthy = False
            w.down_reason = reason
            log.warning("worker %s marked down: %s", url, reason)
            if self._on_down is not None:
                self._on_down(url)

    def record_check(self, url: str, ok: bool, detail: str = "") -> None:
        w = self.workers.get(url)
        if w is None:
            return
        s = self.settings
        if ok:
            w.check_failures = 0
            w.check_successes += 1
            if not w.healthy and w.check_successes >= s.health_success_threshold:
                w.healthy = True
                w.down_reason = ""
                w.consecutive_5xx = 0
                w.circuit_open_until = 0.0
                log.info("worker %s is back", url)
        else:
            w.check_successes = 0
            w.check_failures += 1
            if w.healthy and w.check_failures >= s.health_failure_threshold:
                self.mark_down(url, f"health check failed: {detail}")

    def record_status(self, url: str, status: int) -> None:
        """Feed the circuit breaker with an upstream answer's status."""
        w = self.workers.get(url)
        if w is None:
            return
        if status >= 500:
            w.consecutive_5xx += 1
            if w.consecutive_5xx >= self.settings.circuit_breaker_failures:
                w.circuit_open_until = (
                    time.monotonic() + self.settings.circuit_breaker_cooldown_secs
                )
                w.consecutive_5xx = 0
                log.warning(
                    "worker %s: circuit open for %.0fs after repeated 5xx",
                    url,
                    self.settings.circuit_breaker_cooldown_secs,
                )
        else:
            w.consecutive_5xx = 0
