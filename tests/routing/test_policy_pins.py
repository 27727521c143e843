"""Behaviour pinned so that a change shows: SGLang's three cache_aware defaults (in the
policy, the settings and the CLI) and each threshold's boundary, ``random``'s spread,
and ``consistent_hash``'s session key from each source the router reads."""

from __future__ import annotations

import argparse
import array
from collections import Counter
from itertools import pairwise
from typing import Any

import httpx
import pytest

from kvroute import PrefixIndex
from kvroute.commands import serve
from kvroute.config import Settings
from kvroute.routing.policies import RouteRequest, create_policy
from kvroute.routing.policies.base import Policy
from kvroute.service.app import create_app
from kvroute.service.state import build_state

A, B = "http://a", "http://b"


def toks(*runs: tuple[int, int]) -> array.array[int]:
    """Tokens from (first, count) runs, e.g. ((0, 3), (1000, 7)): 0,1,2,1000..1006."""
    out = array.array("I")
    for first, count in runs:
        out.extend(range(first, first + count))
    return out


def default_policy() -> Policy:
    """cache_aware as the router builds it from default settings."""
    return build_state(Settings(worker_urls=[A, B]).validate()).policy


def test_sglang_defaults_everywhere() -> None:
    parser = argparse.ArgumentParser()
    serve.configure(parser)
    cli = serve.settings_from_args(parser.parse_args([]))
    for s in (Settings(), cli):
        assert (s.cache_threshold, s.balance_abs_threshold, s.balance_rel_threshold) == (
            0.3,
            64,
            1.5,
        )
    p: Any = default_policy()
    assert (p.cache_threshold, p.balance_abs, p.balance_rel) == (0.3, 64, 1.5)
    p = create_policy("cache_aware", PrefixIndex())
    assert (p.cache_threshold, p.balance_abs, p.balance_rel) == (0.3, 64, 1.5)


@pytest.mark.parametrize(
    ("request_tokens", "expected"),
    [
        # 3 of 10 tokens cached on A: a ratio of exactly 0.3 is not above the threshold.
        (toks((0, 3), (150, 7)), (B, "cache_miss")),
        # 31 of 100: just past it, so the busier cache holder wins.
        (toks((0, 31), (150, 69)), (A, "cache_hit")),
    ],
)
def test_cache_threshold_boundary(
    request_tokens: array.array[int], expected: tuple[str, str]
) -> None:
    p = default_policy()
    p.index.insert(A, toks((0, 100)))  # type: ignore[attr-defined]
    d = p.select(RouteRequest(request_tokens), {A: 1, B: 0})
    assert (d.worker, d.reason) == expected


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        # max - min = 64 is not above balance_abs (the relative test passes: 64 > 0).
        ({A: 64, B: 0}, (A, "cache_hit")),
        ({A: 65, B: 0}, (B, "imbalance")),
        # max - min = 100 > 64, but max = 1.5 x min exactly: not above balance_rel.
        ({A: 300, B: 200}, (A, "cache_hit")),
        ({A: 301, B: 200}, (B, "imbalance")),
    ],
)
def test_balance_thresholds_boundaries(loads: dict[str, int], expected: tuple[str, str]) -> None:
    # SGLang's rule exactly (--load-metric requests): with the default work metric the
    # imbalanced fleet's "least loaded" is the least predicted wait, which needs the work
    # model to hold these loads, not just the counts passed here.
    p = build_state(Settings(worker_urls=[A, B], load_metric="requests").validate()).policy
    prompt = toks((0, 50))
    p.index.insert(A, prompt)  # type: ignore[attr-defined]
    d = p.select(RouteRequest(prompt), loads)
    assert (d.worker, d.reason) == expected


def test_random_spreads_uniformly_and_ignores_load() -> None:
    workers = {f"http://w{i}": 10 * i for i in range(4)}  # loads differ: random ignores them
    p = create_policy("random", PrefixIndex(), seed=7)
    picks = [p.select(RouteRequest(()), workers).worker for _ in range(4000)]
    counts = Counter(picks)
    # Binomial(4000, 1/4): sd 27.4; +-6 sd holds for any fair seed, and fails for a
    # policy that prefers some workers (least load would give w0 everything).
    assert set(counts) == set(workers)
    assert all(836 <= n <= 1164 for n in counts.values()), counts
    # Not a rotation in disguise: repeats happen about a quarter of the time.
    repeats = sum(a == b for a, b in pairwise(picks))
    assert 800 <= repeats <= 1200
    # Seeded: the same seed, the same sequence.
    again = create_policy("random", PrefixIndex(), seed=7)
    assert [again.select(RouteRequest(()), workers).worker for _ in range(4000)] == picks


async def test_consistent_hash_reads_the_session_key_from_each_source() -> None:
    workers = [f"http://w{i}:8000" for i in range(8)]
    app = create_app(Settings(worker_urls=workers, policy="consistent_hash").validate())
    ctx = app.router.lifespan_context(app)
    await ctx.__aenter__()
    state = app.state.router
    await state.use_transport(httpx.MockTransport(lambda r: httpx.Response(200, json={})))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
    loads = dict.fromkeys(workers, 0)

    def home(key: str) -> str:
        return state.policy.select(RouteRequest((), session_key=key), loads).worker

    async def served(prompt: str, headers: dict[str, str], user: str | None = None) -> str:
        body: dict[str, Any] = {"prompt": prompt}
        if user is not None:
            body["user"] = user
        r = await client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200
        return r.headers["x-kvroute-worker"]

    keys = [f"session-{i}" for i in range(12)]
    homes = {k: home(k) for k in keys}
    assert len(set(homes.values())) >= 3  # the keys land on different workers
    try:
        for i, key in enumerate(keys):
            # Each source alone, with a different prompt each time: the key decides.
            assert await served(f"a {i}", {"x-session-id": key}) == homes[key]
            assert await served(f"b {i}", {"x-user-id": key}) == homes[key]
            assert await served(f"c {i}", {}, user=key) == homes[key]
            # Precedence: x-session-id, then x-user-id, then the body's user.
            other = keys[(i + 1) % len(keys)]
            both = {"x-session-id": key, "x-user-id": other}
            assert await served(f"d {i}", both, user=other) == homes[key]
            assert await served(f"e {i}", {"x-user-id": key}, user=other) == homes[key]
        # Empty values are no key: the prompt's prefix decides instead.
        by_prefix = {await served(f"prompt {i}", {"x-session-id": ""}, user="") for i in range(24)}
        assert len(by_prefix) >= 3
    finally:
        await client.aclose()
        await ctx.__aexit__(None, None, None)


def test_engines_are_read_at_high_water_marks_for_the_work_model_only() -> None:
    """Readings between health checks (``kvroute.fleet.health.EdgeReads``) feed the
    learned capacities sooner: on for the work model (the default), off for SGLang's
    rule on request counts, which stays as it was, and off with a fixed capacity."""
    assert build_state(Settings(worker_urls=[A, B]).validate()).edge is not None
    assert build_state(Settings(worker_urls=[A, B], policy="min_ttft").validate()).edge is not None
    rule = Settings(worker_urls=[A, B], load_metric="requests").validate()
    assert build_state(rule).edge is None
    fixed = Settings(worker_urls=[A, B], worker_capacity=8).validate()
    assert build_state(fixed).edge is None
