"""Active health checks, and the engines' load read after each one.

Every ``health_check_interval_secs`` each worker's health endpoint is asked; the
registry turns the answers into up/down (``kvroute.fleet.registry``). A new worker is
checked at once (``check_worker``; the router's own start-up waits for one round), since
it takes no traffic until its first check answers. A check that times out while a
request has waited on the worker a whole interval without an answer marks it down at
once (hung: alive enough to accept connections, answering nothing). With the
saturation guard on, a healthy worker's ``/metrics`` is read right after: its
running/waiting counts feed the capacity learner and the load its engine holds beyond
this router's own requests (``kvroute.fleet.engine_load``), and, with its KV cache
usage, the work model's view of the engine (``kvroute.routing.load``). The models a healthy
worker serves are read from its ``/v1/models`` after each check (``kvroute.fleet.models``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import httpx

from kvroute.config import Settings
from kvroute.fleet.engine_load import (
    CapacityLearner,
    others_load,
    parse_engine_load,
    parse_kv_usage,
)
from kvroute.fleet.models import parse_models
from kvroute.fleet.registry import Registry
from kvroute.routing.load import LoadModel

log = logging.getLogger("kvroute.fleet.health")


class Checked(Protocol):
    """What the health loop reads and updates (``kvroute.service.state.RouterState``)."""

    settings: Settings
    registry: Registry
    client: httpx.AsyncClient
    capacity: CapacityLearner | None
    polls_engine: bool
    others: dict[str, int]
    work: LoadModel


async def poll_engine_load(state: Checked, url: str) -> None:
    """Read ``url``'s running/waiting counts from its /metrics: the learner's capacity
    and the load its engine holds beyond this router's requests."""
    try:
        r = await state.client.get(
            url + "/metrics", timeout=state.settings.health_check_timeout_secs
        )
    except httpx.HTTPError:
        return
    load = parse_engine_load(r.content) if r.status_code == 200 else None
    if load is None:
        return
    if state.capacity is not None:
        state.capacity.observe(url, *load)
    worker = state.registry.workers.get(url)
    if worker is not None:
        # Other routers' requests sharing their load are in the loads already.
        routed = worker.in_flight + state.registry.peer_load.get(url, 0)
        state.others[url] = others_load(*load, routed)
        state.work.observe_engine(url, *load, parse_kv_usage(r.content))


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
    if state.polls_engine and r.status_code == 200:
        await poll_engine_load(state, url)


async def check_all(state: Checked) -> None:
    """One round: every worker checked at once."""
    try:
        await asyncio.gather(*(check_worker(state, u) for u in list(state.registry.workers)))
    except Exception:  # never let one bad check end health checking
        log.exception("health check round failed")


async def health_loop(state: Checked) -> None:
    while True:
        await check_all(state)
        await asyncio.sleep(state.settings.health_check_interval_secs)
