"""Draining in the registry and the reconciler: a worker that left the fleet takes no
new request, keeps its in-flight ones, and is removed when the last one is released;
workers a discovery source did not add are never drained."""

from __future__ import annotations

import asyncio

from kvroute.config import Settings
from kvroute.fleet.reconcile import Reconciler
from kvroute.fleet.registry import Registry

A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def up(reg: Registry, *urls: str) -> None:
    """What each worker's first good health check does (no traffic before it)."""
    for url in urls:
        reg.record_check(url, True)


def test_a_draining_worker_finishes_its_requests_then_leaves() -> None:
    removed: list[str] = []
    reg = Registry(Settings(), on_down=removed.append)
    reg.add(A)
    reg.add(B)
    up(reg, A, B)
    first, second = reg.reserve(A), reg.reserve(A)
    reg.drain(A)
    assert set(reg.loads()) == {B}  # no new requests
    assert A in reg.workers and reg.workers[A].draining  # still listed
    first.release()
    assert A in reg.workers and removed == []
    second.release()
    assert A not in reg.workers and removed == [A]


def test_an_idle_worker_leaves_at_once_and_a_returning_one_stops_draining() -> None:
    reg = Registry(Settings())
    reg.add(A)
    reg.drain(A)
    assert A not in reg.workers
    reg.add(B)
    up(reg, B)
    res = reg.reserve(B)
    reg.drain(B)
    reg.add(B)  # back in the answer before its request ended
    assert not reg.workers[B].draining and set(reg.loads()) == {B}
    res.release()
    assert B in reg.workers


def test_reconciler_adds_drains_and_leaves_static_workers_alone() -> None:
    closed: list[str] = []

    async def on_left(url: str) -> None:
        closed.append(url)

    reg = Registry(Settings())
    reg.add(C)  # from --worker-urls
    rec = Reconciler(reg, on_left)
    rec.apply({A, B})
    up(reg, A, B, C)
    assert set(reg.workers) == {A, B, C}
    held = reg.reserve(B)
    rec.apply({A})
    assert reg.workers[B].draining and set(reg.loads()) == {A, C}
    asyncio.run(rec.sweep())
    assert closed == []  # B still has a request in flight
    held.release()
    asyncio.run(rec.sweep())
    assert closed == [B] and set(reg.workers) == {A, C}
    rec.apply(set())
    assert set(reg.workers) == {C}
