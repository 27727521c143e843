"""The registry's health rules: unknown until checked, marked down by failures of
different requests (not one request failing everywhere), the half-open breaker, and
waiting requests told when their worker leaves."""

from __future__ import annotations

import asyncio
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.config import Settings
from kvroute.fleet.models import ServedModel
from kvroute.fleet.registry import Registry

W = "http://w1:8000"


def registry(**kw: object) -> Registry:
    r = Registry(Settings(worker_urls=[W], **kw).validate())  # type: ignore[arg-type]
    r.add(W)
    return r


def test_new_worker_takes_no_traffic_until_its_first_check() -> None:
    r = registry()
    assert r.workers[W].healthy is None and r.loads() == {}
    r.record_check(W, True)
    assert r.loads() == {W: 0}
    fresh = registry()
    fresh.record_check(W, False, "ConnectError")  # one failure decides for a new worker
    assert fresh.workers[W].healthy is False and "ConnectError" in fresh.workers[W].down_reason


def test_one_request_failing_marks_no_worker_down_two_different_do() -> None:
    r = registry()
    r.record_check(W, True)
    assert not r.record_request_failure(W, 111, "ReadError")
    assert not r.record_request_failure(W, 111, "ReadError"), "the same request again"
    assert r.loads() == {W: 0}
    assert r.record_request_failure(W, 222, "ReadError")
    assert r.loads() == {} and "2 different requests" in r.workers[W].down_reason


def test_half_open_breaker_lets_one_probe_through_per_cooldown() -> None:
    r = registry(circuit_breaker_failures=2, circuit_breaker_cooldown_secs=0.05)
    r.record_check(W, True)
    for _ in range(2):
        r.reserve(W).release()
        r.record_status(W, 503)
    assert r.loads() == {}, "open"
    time.sleep(0.06)
    assert r.loads() == {W: 0}, "half-open after the cooldown"
    probe = r.reserve(W)
    assert r.loads() == {}, "one probe at a time"
    r.record_status(W, 503)
    probe.release()
    assert r.loads() == {}, "the probe failed: open again"
    time.sleep(0.06)
    undecided = r.reserve(W)
    undecided.release()  # ended without an answer (client left): the next one probes
    probe = r.reserve(W)
    r.record_status(W, 200)
    probe.release()
    assert r.loads() == {W: 0} and not r.workers[W].half_open, "closed"
    r.reserve(W).release()
    assert r.loads() == {W: 0}


def test_waiting_requests_are_told_when_their_worker_leaves() -> None:
    r = registry()
    r.record_check(W, True)
    told: list[str] = []
    r.watch(W, told.append)
    other: list[str] = []
    r.watch(W, other.append)
    r.unwatch(W, other.append)
    r.mark_down(W, "health check failed: ReadTimeout")
    assert told == ["health check failed: ReadTimeout"] and other == []
    assert r.waiting(W) == 0


async def test_a_check_timing_out_with_a_request_waiting_marks_the_worker_hung() -> None:
    """Passive detection of a hung worker: one timed-out check is enough while a request
    has waited on it a whole interval for a first byte; without one, the threshold."""
    from types import SimpleNamespace

    import httpx

    from kvroute.fleet.health import check_worker

    def hang(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    settings = Settings(worker_urls=[W], health_check_interval_secs=0.01).validate()
    for waiting in (False, True):
        r = Registry(settings)
        r.add(W)
        r.record_check(W, True)
        if waiting:
            r.watch(W, lambda reason: None)
        await asyncio.sleep(0.02)  # no first byte from it for a whole interval
        async with httpx.AsyncClient(transport=httpx.MockTransport(hang)) as client:
            state = SimpleNamespace(
                settings=settings, registry=r, client=client, capacity=None,
                polls_engine=False, others={},
            )  # fmt: skip
            await check_worker(state, W)  # type: ignore[arg-type]
        if waiting:
            assert r.workers[W].healthy is False and "hung" in r.workers[W].down_reason
        else:
            assert r.workers[W].healthy is True, "one failed check of two"


@settings(max_examples=300, deadline=None)
@given(
    states=st.lists(
        st.tuples(
            st.sampled_from([True, False, None]),  # healthy
            st.booleans(),  # draining
            st.floats(-5, 5),  # circuit open until, from now
            st.floats(-5, 5),  # cooldown until, from now
            st.booleans(),  # probing
            st.sampled_from([None, (), ("m",), ("m", "n")]),  # models served
            st.integers(0, 9),  # in flight
            st.integers(0, 3),  # other routers' load
        ),
        min_size=1,
        max_size=6,
    ),
    model=st.sampled_from([None, "m", "n", "x"]),
    excluded=st.sets(st.integers(0, 5)),
)
def test_the_rotation_is_the_workers_available_and_serving_the_model(
    states: list[tuple[bool | None, bool, float, float, bool, tuple[str, ...] | None, int, int]],
    model: str | None,
    excluded: set[int],
) -> None:
    """``loads`` tests each worker's state in place (it runs over the whole fleet at
    every decision): the same workers as ``available`` and ``serves`` allow."""
    urls = [f"http://w{i}:8000" for i in range(len(states))]
    r = Registry(Settings(worker_urls=urls).validate())
    now = time.monotonic()
    peer = {}
    for url, (healthy, draining, circuit, cool, probing, models, n, theirs) in zip(
        urls, states, strict=True
    ):
        r.add(url)
        w = r.workers[url]
        w.healthy, w.draining, w.probing, w.in_flight = healthy, draining, probing, n
        w.circuit_open_until, w.cooldown_until = now + circuit, now + cool
        w.models = None if models is None else {m: ServedModel(m) for m in models}
        peer[url] = theirs
    r.peer_load = peer
    exclude = {urls[i] for i in excluded if i < len(urls)}
    got = r.loads(exclude=exclude, model=model)
    later = time.monotonic()  # ``loads`` read the clock in between
    # A worker's availability only comes with time (every test is "now >= ..."): one
    # in the rotation is available by ``later``, one left out was not yet at ``now``.
    for url, w in r.workers.items():
        if url in got:
            assert w.available(later) and w.serves(model) and url not in exclude
            assert got[url] == w.in_flight + peer[url]
        else:
            assert not (w.available(now) and w.serves(model)) or url in exclude
