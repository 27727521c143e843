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

Draining: service discovery (``kvroute.fleet.discovery``) ``drain``s a worker whose
address vanished: it takes no new request, its in-flight ones finish, and it is removed
when the last one is released. An address that comes back before then is ``add``ed again
and simply stops draining.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvroute.config import Settings, normalize_worker_url, parse_worker_models
from kvroute.fleet.models import ServedModel, named_models

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
    # Left the fleet (discovery): no new requests; removed once ``in_flight`` is 0.
    draining: bool = False
    # Models it serves by name (``kvroute.fleet.models``): None while unknown (it then
    # serves any model); ``models_fixed`` when the operator set them (never re-read).
    models: dict[str, ServedModel] | None = None
    models_fixed: bool = False

    def serves(self, model: str | None) -> bool:
        return model is None or self.models is None or model in self.models

    def available(self, now: float) -> bool:
        return (
            self.healthy
            and not self.draining
            and now >= self.circuit_open_until
            and now >= self.cooldown_until
        )


class Reservation:
    """One unit of load on one worker; ``release`` is idempotent."""

    __slots__ = ("_on_release", "_registry", "released", "worker")

    def __init__(
        self, registry: Registry, worker: Worker, on_release: Callable[[], None] | None = None
    ) -> None:
        # The registry removes a draining worker when its last reservation is released.
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
            if self.worker.draining and self.worker.in_flight == 0:
                self._registry.remove(self.worker.url)


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
        # --worker-models: applied when the worker joins, whenever that is.
        self.fixed_models: dict[str, list[ServedModel]] = {}
        for spec in settings.worker_models:
            url, names = parse_worker_models(spec)
            self.fixed_models[normalize_worker_url(url)] = named_models(names)

    def add(self, url: str) -> Worker:
        if url in self.workers:
            w = self.workers[url]
            if w.draining:
                w.draining = False
                log.info("worker %s is back, no longer draining", url)
            return w
        w = Worker(url)
        self.workers[url] = w
        if url in self.fixed_models:
            w.models = {m.id: m for m in self.fixed_models[url]}
            w.models_fixed = True
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

    def drain(self, url: str) -> None:
        """Take ``url`` out of rotation for good: in-flight requests finish, then it is
        removed (at once when none is in flight)."""
        w = self.workers.get(url)
        if w is None or w.draining:
            return
        w.draining = True
        log.info("worker %s draining (%d in flight)", url, w.in_flight)
        if w.in_flight == 0:
            self.remove(url)

    def loads(
        self, exclude: set[str] | frozenset[str] = frozenset(), model: str | None = None
    ) -> dict[str, int]:
        """In-flight count of every worker that can take a request for ``model`` now."""
        now = time.monotonic()
        return {
            u: w.in_flight
            for u, w in self.workers.items()
            if u not in exclude and w.available(now) and w.serves(model)
        }

    # ------------------------------------------------------------- models

    def set_models(self, url: str, models: list[ServedModel], *, fixed: bool = False) -> None:
        """What ``url`` serves, from its ``/v1/models`` or (``fixed``) from the operator;
        a read from the worker never overrides what the operator set."""
        w = self.workers.get(url)
        if w is None or (w.models_fixed and not fixed):
            return
        new = {m.id: m for m in models}
        if w.models is None or new.keys() != w.models.keys():
            log.info("worker %s serves: %s", url, ", ".join(sorted(new)) or "nothing")
        w.models = new
        w.models_fixed = w.models_fixed or fixed

    def known_models(self) -> dict[str, ServedModel]:
        """Every model some worker lists (healthy or not), by name."""
        out: dict[str, ServedModel] = {}
        for w in self.workers.values():
            if w.models:
                for name, m in w.models.items():
                    out.setdefault(name, m)
        return out

    def model_routable(self, model: str | None) -> bool:
        """False when no worker can ever serve ``model``: every worker's models are known
        and none lists it (a 404 for the client, not a 503)."""
        if model is None:
            return True
        return any(w.models is None or model in w.models for w in self.workers.values())

    def is_adapter(self, model: str | None) -> bool:
        """``model`` is a LoRA adapter on some worker (its KV is its own partition)."""
        if model is None:
            return False
        for w in self.workers.values():
            m = w.models.get(model) if w.models else None
            if m is not None:
                return m.is_adapter
        return False

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
