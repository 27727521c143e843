"""Ports for the servers tests and benchmarks start (kvroute.eval.procs.free_port)."""

from __future__ import annotations

import socket

import pytest

from kvroute.eval import procs


def test_ports_lie_below_the_ephemeral_range_and_do_not_repeat() -> None:
    floor = procs._ephemeral_floor()
    ports = [procs.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(procs._POOL_FLOOR <= p < floor for p in ports)


def test_each_xdist_worker_draws_from_its_own_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    slices = []
    for i in range(4):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{i}")
        pool = procs._port_slice()
        assert pool is not None and len(pool) > 100
        slices.append(set(pool))
    for i in range(4):
        for j in range(i + 1, 4):
            assert not slices[i] & slices[j]


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = procs._port_slice()
    assert pool is not None
    taken = procs.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind((procs.LOOPBACK, taken))
        held.listen()
        monkeypatch.setattr(procs, "_next_port", taken)
        got = procs.free_port()
    assert got != taken and got in pool
