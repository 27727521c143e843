"""The fleet as the router sees it: workers, their load reservations and their health.

Load: ``in_flight`` counts requests the router has sent to a worker and not yet seen
end. ``reserve`` increments it in the same synchronous step as the policy decision and
returns a ``Reservation`` whose ``release`` decrements it exactly once, whatever ends
the request (success, upstream error, timeout, client disconnect).

Health: a new worker's health is unknown (``healthy is None``) and it takes no traffic
until its first check answers (``kvroute.fleet.health`` probes it at once). A worker
leaves the rotation when
* the router cannot reach it (connection refused, connect timeout) or it does not send a
  first byte within the request's deadline — passive detection, immediate; it then sits
  out at least ``failure_cooldown_secs`` even if its health endpoint still answers;
* requests fail on it before any answer (connection reset or closed) for
  ``REQUEST_FAILURES_TO_MARK_DOWN`` *different* requests within
  ``REQUEST_FAILURE_WINDOW_SECS``: one request failing everywhere (a query of death)
  proves nothing about the workers, only about the request (``record_request_failure``);
* ``health_failure_threshold`` consecutive active checks fail, or one check times out
  while a request on it has waited a whole health interval for its first byte (hung);
* its circuit breaker opens: ``circuit_breaker_failures`` consecutive 5xx answers. It
  is then skipped for ``circuit_breaker_cooldown_secs`` and goes half-open: one request
  is let through (``available`` is false while it is out) and decides: an answer below
  500 closes the circuit, a 5xx or a failure opens it for another cooldown. A worker
  still broken costs at most one request per cooldown.
It comes back after ``health_success_threshold`` consecutive successful checks. When a
worker goes down its prefixes are dropped from the index, so the policy spreads them over
the survivors by load instead of guessing that a dead cache still holds them; requests
waiting on it for a first byte are told at once (``watch``) so they move elsewhere.

Draining: service discovery (``kvroute.fleet.discovery``) ``drain``s a worker whose
address vanished: it takes no new request, its in-flight ones finish, and it is removed
when the last one is released. An address that comes back before then is ``add``ed again
and simply stops draining.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvroute.config import Settings, normalize_worker_url, parse_worker_models
from kvroute.fleet.models import ServedModel, named_models

log = logging.getLogger("kvroute.fleet.registry")

# A worker on which this many different requests failed before any answer (connection
# reset or closed), within the window, is marked down.
REQUEST_FAILURES_TO_MARK_DOWN = 2
REQUEST_FAILURE_WINDOW_SECS = 30.0

Watcher = Callable[[str], None]


@dataclass(slots=True)
class Worker:
    url: str
    # None: not checked yet (no traffic until the first check answers).
    healthy: bool | None = None
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

    # When the worker last sent a first byte (passive hung detection).
    last_answer: float = 0.0
    # Circuit breaker: half-open once the cooldown is over; a probe request is out.
    half_open: bool = False
    probing: bool = False
    # Request fingerprint -> when it last failed here before any answer.
    request_failures: dict[int, float] = field(default_factory=dict)
    # Requests waiting on this worker for a first byte: told when it leaves rotation.
    watchers: set[Watcher] = field(default_factory=set)

    def serves(self, model: str | None) -> bool:
        return model is None or self.models is None or model in self.models

    def available(self, now: float) -> bool:
        # ``Registry.loads`` tests the same in place (and ``serves``'s test).
        return (
            self.healthy is True
            and not self.draining
            and now >= self.circuit_open_until
            and now >= self.cooldown_until
            and not self.probing
        )


class Reservation:
    """One unit of load on one worker; ``release`` is idempotent."""

    __slots__ = ("_on_release", "_registry", "probe", "released", "worker")

    def __init__(
        self, registry: Registry, worker: Worker, on_release: Callable[[], None] | None = None
    ) -> None:
        # The registry removes a draining worker when its last reservation is released.
        self._registry = registry
        self.worker = worker
        self.released = False
        self._on_release = on_release
        # The half-open circuit's probe: if it ends undecided (the client left, the
        # attempt was moved), the next request probes.
        self.probe = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.worker.in_flight -= 1
            if self.probe:
                self.worker.probing = False
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
        # Requests other router replicas have in flight per worker (--state-store:
        # ``kvroute.fleet.shared``), added to this router's own in ``loads``.
        self.peer_load: Mapping[str, int] = {}
        # Every model some worker lists, and whether some worker's models are unknown:
        # read on every request, rebuilt only when a worker or its models change.
        self._catalog: tuple[dict[str, ServedModel], bool] | None = None

    def add(self, url: str) -> Worker:
        if url in self.workers:
            w = self.workers[url]
            if w.draining:
                w.draining = False
                log.info("worker %s is back, no longer draining", url)
            return w
        w = Worker(url)
        self.workers[url] = w
        self._catalog = None
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
            self._catalog = None
            if self._on_down is not None:
                self._on_down(url)
            self._evict_waiters(w, "worker removed")
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
        """In-flight count of every worker that can take a request for ``model`` now (this
        router's, plus other routers' when they share their load)."""
        now = time.monotonic()
        # ``available`` and ``serves``, inlined (keep the three in step): this runs over
        # every worker at every decision, where two method calls per worker showed in
        # profiles of a 64-worker fleet.
        loads = {
            u: w.in_flight
            for u, w in self.workers.items()
            if w.healthy is True
            and not w.draining
            and now >= w.circuit_open_until
            and now >= w.cooldown_until
            and not w.probing
            and (model is None or w.models is None or model in w.models)
            and u not in exclude
        }
        peer = self.peer_load
        if peer:
            for u, n in peer.items():
                if n and u in loads:
                    loads[u] += n
        return loads

    # ------------------------------------------------------------- models

    def set_models(self, url: str, models: list[ServedModel], *, fixed: bool = False) -> None:
        """What ``url`` serves, from its ``/v1/models`` or (``fixed``) from the operator;
        a read from the worker never overrides what the operator set."""
        w = self.workers.get(url)
        if w is None or (w.models_fixed and not fixed):
            return
        new = {m.id: m for m in models}
        w.models_fixed = w.models_fixed or fixed
        if new == w.models:
            return  # the usual answer to a health check's read: nothing changed
        if w.models is None or new.keys() != w.models.keys():
            log.info("worker %s serves: %s", url, ", ".join(sorted(new)) or "nothing")
        w.models = new
        self._catalog = None

    def _models(self) -> tuple[dict[str, ServedModel], bool]:
        if self._catalog is None:
            known: dict[str, ServedModel] = {}
            unknown = False
            for w in self.workers.values():
                if w.models is None:
                    unknown = True
                else:
                    for name, m in w.models.items():
                        known.setdefault(name, m)
            self._catalog = (known, unknown)
        return self._catalog

    def known_models(self) -> dict[str, ServedModel]:
        """Every model some worker lists (healthy or not), by name."""
        return self._models()[0]

    def model_routable(self, model: str | None) -> bool:
        """False when no worker can ever serve ``model``: every worker's models are known
        and none lists it (a 404 for the client, not a 503)."""
        if model is None:
            return True
        known, unknown = self._models()
        return unknown or model in known

    def is_adapter(self, model: str | None) -> bool:
        """``model`` is a LoRA adapter on some worker (its KV is its own partition)."""
        m = self._models()[0].get(model) if model is not None else None
        return m is not None and m.is_adapter

    def reserve(self, url: str, on_release: Callable[[], None] | None = None) -> Reservation:
        """One unit of load on ``url``; ``on_release`` runs once when it is released.
        The first request after an open circuit's cooldown is its half-open probe."""
        w = self.workers[url]
        w.in_flight += 1
        w.served += 1
        res = Reservation(self, w, on_release)
        if w.half_open and time.monotonic() >= w.circuit_open_until:
            w.probing = res.probe = True
        return res

    def unserve(self, url: str) -> None:
        """The request counted in ``reserve`` was refused or failed: not served."""
        w = self.workers.get(url)
        if w is not None and w.served > 0:
            w.served -= 1

    def watch(self, url: str, watcher: Watcher) -> None:
        """Call ``watcher(reason)`` once if ``url`` leaves rotation before ``unwatch``."""
        w = self.workers.get(url)
        if w is not None:
            w.watchers.add(watcher)

    def unwatch(self, url: str, watcher: Watcher) -> None:
        w = self.workers.get(url)
        if w is not None:
            w.watchers.discard(watcher)

    def answered(self, url: str) -> None:
        """``url`` just sent a first byte: it is not hung."""
        w = self.workers.get(url)
        if w is not None:
            w.last_answer = time.monotonic()

    def waiting(self, url: str) -> int:
        """Requests waiting on ``url`` for a first byte."""
        w = self.workers.get(url)
        return len(w.watchers) if w is not None else 0

    def _evict_waiters(self, w: Worker, reason: str) -> None:
        watchers, w.watchers = w.watchers, set()
        for watcher in watchers:
            watcher(reason)

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
        if w.probing:  # a half-open probe failed: open again
            self._open_circuit(w)
        if w.healthy is not False:
            w.healthy = False
            w.down_reason = reason
            w.request_failures.clear()
            log.warning("worker %s marked down: %s", url, reason)
            if self._on_down is not None:
                self._on_down(url)
        self._evict_waiters(w, reason)

    def record_request_failure(self, url: str, fingerprint: int, what: str) -> bool:
        """A request failed on ``url`` before any answer (reset, closed): the request or
        the worker may be to blame. Marks the worker down (passively) once different
        requests failed on it within the window; True if it did."""
        w = self.workers.get(url)
        if w is None:
            return False
        now = time.monotonic()
        recent = w.request_failures
        for fp, t in list(recent.items()):
            if now - t > REQUEST_FAILURE_WINDOW_SECS:
                del recent[fp]
        recent[fingerprint] = now
        if w.probing:
            self._open_circuit(w)
        if len(recent) >= REQUEST_FAILURES_TO_MARK_DOWN:
            self.mark_down(url, f"{what} on {len(recent)} different requests", passive=True)
            return True
        return False

    def record_check(self, url: str, ok: bool, detail: str = "") -> None:
        w = self.workers.get(url)
        if w is None:
            return
        s = self.settings
        if ok:
            w.check_failures = 0
            w.check_successes += 1
            if w.healthy is None:
                w.healthy = True
                log.info("worker %s answered its first health check", url)
            elif not w.healthy and w.check_successes >= s.health_success_threshold:
                w.healthy = True
                w.down_reason = ""
                w.consecutive_5xx = 0
                w.circuit_open_until = 0.0
                w.half_open = w.probing = False
                log.info("worker %s is back", url)
        else:
            w.check_successes = 0
            w.check_failures += 1
            if w.healthy is None or w.check_failures >= s.health_failure_threshold:
                self.mark_down(url, f"health check failed: {detail}")

    def record_hung(self, url: str, detail: str) -> None:
        """A health check timed out while a request has waited on the worker a whole
        health interval for its first byte: it is hung, not slow; out at once."""
        self.mark_down(url, f"hung ({detail} with requests waiting)", passive=True)

    def record_status(self, url: str, status: int) -> None:
        """Feed the circuit breaker with an upstream answer's status."""
        w = self.workers.get(url)
        if w is None:
            return
        if status >= 500:
            w.consecutive_5xx += 1
            if w.probing or w.consecutive_5xx >= self.settings.circuit_breaker_failures:
                self._open_circuit(w)
        else:
            w.consecutive_5xx = 0
            if w.half_open:
                w.half_open = w.probing = False
                w.circuit_open_until = 0.0
                log.info("worker %s: half-open probe answered, circuit closed", url)

    def _open_circuit(self, w: Worker) -> None:
        cooldown = self.settings.circuit_breaker_cooldown_secs
        w.circuit_open_until = time.monotonic() + cooldown
        w.consecutive_5xx = 0
        w.half_open = True
        w.probing = False
        log.warning("worker %s: circuit open for %gs", w.url, cooldown)
        self._evict_waiters(w, "circuit open")
