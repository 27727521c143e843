"""Active health checks, and the engines' load read after each one.

Every ``health_check_interval_secs`` each worker's health endpoint is asked; the
registry turns the answers into up/down (``kvroute.fleet.registry``). With the
saturation guard on, a healthy worker's ``/metrics`` is read right after: its
running/waiting counts feed the capacity learner and the load its engine holds beyond
this router's own requests (``kvroute.fleet.engine_load``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import httpx

from kvroute.config import Settings
from kvroute.fleet.engine_load import CapacityLearner, others_load, parse_engine_load
from kvroute.fleet.registry import Registry

log = logging.getLogger("kvroute.fleet.health")


class Checked(Protocol):
    """What the health loop reads and updates (``kvroute.service.state.RouterState``)."""

    settings: Settings
    registry: Registry
    client: httpx.AsyncClient
    capacity: CapacityLearner | None
    polls_engine: bool
    others: dict[str, int]


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


async def health_loop(state: Checked) -> None:
    s = state.settings
    while True:
        urls = list(state.registry.workers)

        async def check(url: str) -> None:
            try:
                r = await state.client.get(
                    url + s.health_check_endpoint, timeout=s.health_check_timeout_secs
                )
                state.registry.record_check(url, r.status_code == 200, f"HTTP {r.status_code}")
            except httpx.HTTPError as e:
                state.registry.record_check(url, False, type(e).__name__)
                return
            if state.polls_engine and r.status_code == 200:
                await poll_engine_load(state, url)

        try:
            await asyncio.gather(*(check(u) for u in urls))
        except Exception:  # never let one bad check end health checking
            log.exception("health check round failed")
        await asyncio.sleep(s.health_check_interval_secs)
