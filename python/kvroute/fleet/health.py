"""Active health checks, and the engines' load read after each one.

Every ``health_check_interval_secs`` each worker's health endpoint is asked; the
registry turns the answers into up/down (``kvroute.fleet.registry``). A new worker is
checked at once (``check_worker``; the router's own start-up waits for one round), since
it takes no traffic until its first check answers. A check that times out while a
request has waited on the worker a whole interval without an answer marks it down at
once (hung: alive enough to accept connections, answering nothing). With the
saturation guard on, a healthy worker's ``/metrics`` is read right after: its
capacity from SGLang's ``/get_server_info`` the first time (``kvroute.fleet.engine_load``;
up to three tries, vLLM has no such endpoint), its running/waiting counts, which feed the
capacity learner and the load its engine holds beyond
this router's own requests (``kvroute.fleet.engine_load``), and, with its KV cache
usage, the work model's view of the engine (``kvroute.routing.load``). The models a healthy
worker serves are read from its ``/v1/models`` after each check (``kvroute.fleet.models``).

Between checks (``EdgeReads``), a worker whose capacity is not yet learned has its
``/metrics`` read again as soon as the requests routed to it exceed the most its engine
was seen running with nothing waiting: the moment it may start queueing, which is when
a reading teaches its capacity (at that many or fewer, it teaches nothing new). A queue
that forms and drains between two checks (every 5 s by default) teaches nothing, and
until a capacity is known the work model and the guard work without it. A reading that
finds no running/waiting counts (an engine without load gauges, which will never teach
a capacity) puts the worker's next one a health check's interval away, not a quarter of
a second. Only for the work model: SGLang's rule (``--load-metric requests``) reads
engines as it always did.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import httpx

from kvroute.config import Settings
from kvroute.fleet.engine_load import (
    CapacityLearner,
    others_load,
    parse_engine_load,
    parse_kv_usage,
    parse_sglang_capacity,
)
from kvroute.fleet.models import parse_models
from kvroute.fleet.probe.report import get_body
from kvroute.fleet.registry import Registry
from kvroute.routing.load import LoadModel

log = logging.getLogger("kvroute.fleet.health")


class Checked(Protocol):
    """What the health loop reads and updates (``kvroute.service.state.RouterState``)."""

    settings: Settings
    registry: Registry
    client: httpx.AsyncClient
    capacity: CapacityLearner | None
    # Called with a worker's URL after each healthy check, and with the fleet's URLs
    # after each round (``--kv-events auto``: ``kvroute.events.auto.AutoEvents``).
    on_healthy: Callable[[str], Awaitable[None]] | None
    after_round: Callable[[list[str]], Awaitable[None]] | None
    polls_engine: bool
    others: dict[str, int]
    work: LoadModel


async def read_body(state: Checked, url: str, path: str) -> bytes | None:
    """The body of ``GET url+path`` if it answers 200 within the health check timeout."""
    return await get_body(state.client, url + path, state.settings.health_check_timeout_secs)


async def read_reported_capacity(state: Checked, url: str) -> None:
    """Ask ``url``'s engine how many requests it runs at once (SGLang's
    ``/get_server_info``), unless it told already or was asked enough times."""
    learner = state.capacity
    if learner is None or not learner.wants_report(url):
        return
    body = await read_body(state, url, "/get_server_info")
    capacity = parse_sglang_capacity(body) if body is not None else None
    if capacity is not None and url in state.registry.workers:
        learner.report(url, capacity)
        log.info("%s reports it runs %d requests at once", url, capacity)


async def poll_engine_load(state: Checked, url: str) -> bool:
    """Read ``url``'s running/waiting counts from its /metrics: the learner's capacity
    and the load its engine holds beyond this router's requests. False: no counts read
    (no answer, not 200, or no running/waiting gauges in it)."""
    before = _routed(state, url)
    body = await read_body(state, url, "/metrics")
    if body is None:
        return False
    load = parse_engine_load(body)
    if load is None:
        return False
    if state.capacity is not None:
        state.capacity.observe(url, *load)
    if url in state.registry.workers:
        # The engine counted at some moment of the read: a request of ours that ended
        # meanwhile may be in its count (an edge read starts as a request is routed,
        # and a short one is often over before the answer is parsed). Counted as the
        # engine's own, it stayed as phantom load until the next reading.
        routed = max(before, _routed(state, url))
        state.others[url] = others_load(*load, routed)
        state.work.observe_engine(url, *load, parse_kv_usage(body))
    return True


def _routed(state: Checked, url: str) -> int:
    """Requests on ``url`` this router knows of: its own in flight, and the other
    routers' when they share their load (in the loads already)."""
    worker = state.registry.workers.get(url)
    if worker is None:
        return 0
    return worker.in_flight + state.registry.peer_load.get(url, 0)


# At most one edge read per worker this often (seconds): a worker at its high-water
# mark is read again a quarter of a second later, not at every request. Readings happen
# only until the worker's capacity is learned, each at a new high-water mark: a queue
# of a burst is short-lived, and read a second apart it was missed for seconds (on
# random fleets with capacities learned this way, TTFT p90, p99 and mean 0-6% lower at
# 0.8x and 1.0x load than with 1 s; docs/studies/work-aware.md).
EDGE_READ_GAP_S = 0.25
# After a reading that found no running/waiting counts (no /metrics, or not an engine's),
# the worker's next one between checks waits this long (``EdgeReads``): by default a
# health check's interval, whose own reading comes meanwhile.
EDGE_READ_BLIND_S = Settings.health_check_interval_secs


class EdgeReads:
    """Engine readings between health checks, at each worker's high-water mark (module
    doc). ``after_reserve`` runs on the request path (a few dictionary lookups); the
    reading itself is a background task, one at a time per worker, never awaited by a
    request."""

    def __init__(
        self,
        state: Checked,
        gap_s: float = EDGE_READ_GAP_S,
        on_read: Callable[[], object] | None = None,
        blind_s: float = EDGE_READ_BLIND_S,
    ) -> None:
        self.state = state
        self.gap_s = gap_s
        # After a reading that found no counts, the next waits this long, not ``gap_s``:
        # an engine without load gauges (SGLang without --enable-metrics, a proxy, a
        # server of another kind) never teaches a capacity, so its requests stay above
        # the floor, and it was read four times a second for as long as traffic lasted.
        self.blind_s = max(gap_s, blind_s)
        self.on_read = on_read  # called at each reading started (a metric)
        self._next: dict[str, float] = {}  # per worker: no reading before this time
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def after_reserve(self, url: str) -> None:
        """A request was just routed to ``url``: read its engine now if its capacity is
        unknown, it holds more of the routers' requests than it was ever seen running
        with none waiting, and it was not read within ``gap_s``."""
        state = self.state
        learner = state.capacity
        if learner is None or url in learner.capacities or url in self._tasks:
            return
        registry = state.registry
        w = registry.workers.get(url)
        if w is None or w.in_flight + registry.peer_load.get(url, 0) <= learner.floors.get(url, 0):
            return
        now = time.monotonic()
        if now < self._next.get(url, now):
            return
        if len(self._next) > 2 * len(registry.workers) + 16:  # workers that left
            self._next = {u: t for u, t in self._next.items() if u in registry.workers}
        self._next[url] = now + self.gap_s
        if self.on_read is not None:
            self.on_read()
        task = asyncio.get_running_loop().create_task(self._read(url))
        self._tasks[url] = task

    async def _read(self, url: str) -> None:
        read = False
        try:
            read = await poll_engine_load(self.state, url)
        except Exception:  # a reading must never take anything down with it
            log.exception("reading %s's engine load failed", url)
        finally:
            self._tasks.pop(url, None)
            if not read and url in self._next:
                # Nothing learned: the next reading after ``blind_s``, not ``gap_s``.
                self._next[url] = time.monotonic() + self.blind_s

    async def close(self) -> None:
        """Cancel the readings in progress (shutdown)."""
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t


async def refresh_models(state: Checked, url: str) -> None:
    """Read what ``url`` serves from its ``GET /v1/models`` (unless the operator set it).
    An answer that is not a model list leaves what was known unchanged."""
    w = state.registry.workers.get(url)
    if w is None or w.models_fixed:
        return
    try:
        r = await state.client.get(
            url + "/v1/models", timeout=state.settings.health_check_timeout_secs
        )
        models = parse_models(r.json()) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return
    if models is not None:
        state.registry.set_models(url, models)


async def check_worker(state: Checked, url: str) -> None:
    """One health check of ``url``, its result recorded."""
    s = state.settings
    registry = state.registry
    try:
        r = await state.client.get(
            url + s.health_check_endpoint, timeout=s.health_check_timeout_secs
        )
    except httpx.TimeoutException as e:
        w = registry.workers.get(url)
        quiet = w is not None and time.monotonic() - w.last_answer >= s.health_check_interval_secs
        if quiet and registry.waiting(url):
            registry.record_hung(url, type(e).__name__)
        else:
            registry.record_check(url, False, type(e).__name__)
        return
    except httpx.HTTPError as e:
        registry.record_check(url, False, type(e).__name__)
        return
    if r.status_code == 200:
        # What it serves is known before it takes traffic (a new worker's first check).
        await refresh_models(state, url)
    registry.record_check(url, r.status_code == 200, f"HTTP {r.status_code}")
    if state.on_healthy is not None and r.status_code == 200:
        await state.on_healthy(url)
    if state.polls_engine and r.status_code == 200:
        await read_reported_capacity(state, url)
        await poll_engine_load(state, url)


async def check_all(state: Checked) -> None:
    """One round: every worker checked at once."""
    try:
        await asyncio.gather(*(check_worker(state, u) for u in list(state.registry.workers)))
        if state.after_round is not None:
            await state.after_round(list(state.registry.workers))
    except Exception:  # never let one bad check end health checking
        log.exception("health check round failed")


async def health_loop(state: Checked) -> None:
    """A round every ``health_check_interval_secs``, the first one interval after the
    start-up's (``check_all``, awaited before the router serves)."""
    while True:
        await asyncio.sleep(state.settings.health_check_interval_secs)
        await check_all(state)
