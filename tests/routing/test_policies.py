"""Routing policies as pure decision functions (no HTTP)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute import PrefixIndex
from kvroute.routing.policies import POLICY_NAMES, NoWorkerError, RouteRequest, create_policy
from kvroute.routing.policies._common import TieBreaker, tie_window

W = ["http://a", "http://b", "http://c", "http://d"]


def req(group: int, q: int, n: int = 100) -> RouteRequest:
    rng = np.random.default_rng(group)
    prefix = rng.integers(0, 50_000, n, dtype=np.uint32)
    tail = np.random.default_rng(10_000 + q).integers(0, 50_000, 20, dtype=np.uint32)
    return RouteRequest(np.concatenate([prefix, tail]))


def idle() -> dict[str, int]:
    return dict.fromkeys(W, 0)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_rejects_an_empty_fleet_and_picks_healthy(name: str) -> None:
    p = create_policy(name, PrefixIndex(), seed=1)
    with pytest.raises(NoWorkerError):
        p.select(req(0, 0), {})
    for i in range(20):
        assert p.select(req(i, i), {"http://b": 0, "http://c": 3}).worker in (
            "http://b",
            "http://c",
        )


def test_cache_aware_sticks_to_the_prefix_holder() -> None:
    p = create_policy("cache_aware", PrefixIndex())
    first = p.select(req(1, 0), idle())
    assert first.reason == "cache_miss"
    for q in range(1, 6):
        d = p.select(req(1, q), idle())
        assert d.worker == first.worker
        assert d.reason == "cache_hit"
        assert d.matched_tokens >= 100


def test_cache_aware_spreads_new_prefixes_over_idle_workers() -> None:
    p = create_policy("cache_aware", PrefixIndex())
    chosen = [p.select(req(g, 0), idle()).worker for g in range(8)]
    assert Counter(chosen) == dict.fromkeys(W, 2)


def test_cache_aware_reservations_spread_a_burst() -> None:
    """A burst of new prefixes, each reserving load, lands one per worker."""
    p = create_policy("cache_aware", PrefixIndex())
    loads = idle()
    for g in range(4):
        d = p.select(req(g, 0), loads)
        loads[d.worker] += 1
    assert set(loads.values()) == {1}


def test_cache_aware_ties_between_holders_go_to_least_loaded() -> None:
    idx = PrefixIndex()
    p = create_policy("cache_aware", idx)
    r = req(3, 0)
    idx.insert("http://a", r.tokens)
    idx.insert("http://c", r.tokens)
    d = p.select(req(3, 1), {"http://a": 5, "http://b": 0, "http://c": 1, "http://d": 0})
    assert (d.worker, d.reason) == ("http://c", "cache_hit")


def test_cache_aware_below_threshold_goes_least_loaded() -> None:
    idx = PrefixIndex()
    p = create_policy("cache_aware", idx, cache_threshold=0.9, load_metric="requests")
    idx.insert("http://a", req(4, 0).tokens)
    d = p.select(req(4, 1), {"http://a": 1, "http://b": 0, "http://c": 2, "http://d": 2})
    assert (d.worker, d.reason) == ("http://b", "cache_miss")


def test_cache_aware_imbalance_overrides_cache() -> None:
    idx = PrefixIndex()
    p = create_policy("cache_aware", idx, load_metric="requests")
    idx.insert("http://a", req(5, 0).tokens)
    loads = {"http://a": 200, "http://b": 10, "http://c": 50, "http://d": 60}
    d = p.select(req(5, 1), loads)
    assert (d.worker, d.reason) == ("http://b", "imbalance")
    # Not imbalanced when the relative test fails (max <= 1.5 * min).
    # a and b now hold the prefix (b got it on the imbalance decision); c is idlest.
    loads = {"http://a": 180, "http://b": 170, "http://c": 120, "http://d": 150}
    d = p.select(req(5, 2), loads)
    assert (d.worker, d.reason) == ("http://b", "cache_hit")


def test_cache_aware_ignores_unhealthy_holders_and_falls_back() -> None:
    idx = PrefixIndex()
    p = create_policy("cache_aware", idx)
    r = req(6, 0)
    idx.insert("http://a", r.tokens)  # deepest holder, but it is down
    idx.insert("http://b", r.tokens[:90])
    d = p.select(req(6, 1), {"http://b": 3, "http://c": 0})
    assert (d.worker, d.reason) == ("http://b", "cache_hit")
    assert d.matched_tokens == 90


def test_cache_aware_inserts_for_the_chosen_worker() -> None:
    idx = PrefixIndex()
    p = create_policy("cache_aware", idx)
    d = p.select(req(7, 0), idle())
    assert idx.cached_tokens(d.worker) == 120
    p.on_worker_removed(d.worker)
    assert idx.cached_tokens(d.worker) == 0


def test_round_robin_cycles() -> None:
    p = create_policy("round_robin", PrefixIndex())
    assert [p.select(req(1, 0), idle()).worker for _ in range(8)] == W * 2


def test_least_load_and_power_of_two_prefer_lighter_workers() -> None:
    loads = {"http://a": 9, "http://b": 1, "http://c": 9, "http://d": 9}
    assert create_policy("least_load", PrefixIndex()).select(req(1, 0), loads).worker == "http://b"
    p2 = create_policy("power_of_two", PrefixIndex(), seed=3)
    picks = Counter(p2.select(req(1, 0), loads).worker for _ in range(200))
    # b wins every draw it is part of (half of them); never a loaded worker over b.
    assert 70 < picks["http://b"] < 130


def test_consistent_hash_is_sticky_per_session_and_bounded() -> None:
    p = create_policy("consistent_hash", PrefixIndex())
    home = p.select(RouteRequest([1, 2, 3], "user-42"), idle()).worker
    assert all(p.select(RouteRequest([9], "user-42"), idle()).worker == home for _ in range(5))
    homes = {p.select(RouteRequest([1], f"s{i}"), idle()).worker for i in range(200)}
    assert homes == set(W), "sessions spread over the ring"
    # Bounded load: the home worker far above the mean is passed over.
    loads = idle()
    loads[home] = 40
    d = p.select(RouteRequest([1, 2, 3], "user-42"), loads)
    assert d.worker != home and d.reason == "overflow"


def test_consistent_hash_moves_only_the_removed_workers_keys() -> None:
    p = create_policy("consistent_hash", PrefixIndex())
    before = {i: p.select(RouteRequest([0], f"s{i}"), idle()).worker for i in range(300)}
    three = {w: 0 for w in W if w != "http://d"}
    after = {i: p.select(RouteRequest([0], f"s{i}"), three).worker for i in range(300)}
    moved = [i for i in before if before[i] != after[i]]
    assert all(before[i] == "http://d" for i in moved)


def test_prefix_hash_groups_by_leading_tokens() -> None:
    p = create_policy("prefix_hash", PrefixIndex(), prefix_hash_tokens=50)
    homes = {p.select(req(9, q), idle()).worker for q in range(10)}
    assert len(homes) == 1
    spread = {p.select(req(g, 0), idle()).worker for g in range(40)}
    assert len(spread) == 4


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        create_policy("nope", PrefixIndex())


class _Reports:
    """A precise source whose engines have reported nothing yet (all trusted)."""

    def __init__(self, workers: list[str]) -> None:
        self.trusted = set(workers)
        self.held: dict[str, int] = {}

    def match(self, tokens: object) -> tuple[dict[str, int], set[str]]:
        return dict(self.held), self.trusted


def test_precise_counts_prompts_routed_but_not_yet_reported() -> None:
    """An engine reports a prompt's blocks only once it admits the request: until the
    request ends, what was routed to a trusted worker still counts as held there."""
    workers = ["a", "b", "c"]
    policy = create_policy("cache_aware", PrefixIndex())
    for w in workers:
        policy.on_worker_added(w)
    reports = _Reports(workers)
    policy.precise = reports  # type: ignore[attr-defined]
    loads = dict.fromkeys(workers, 0)
    prompt = list(range(1000))
    first = policy.select(RouteRequest(tokens=prompt), loads)
    assert first.reason == "cache_miss" and first.ticket is not None
    loads[first.worker] += 1
    second = policy.select(RouteRequest(tokens=[*prompt, 7]), loads)
    assert (second.worker, second.reason) == (first.worker, "cache_hit")
    assert second.matched_tokens == 1000
    loads[first.worker] += 1
    # Both ended and the engine never reported the blocks (say it evicted them at once):
    # precise mode no longer counts them, unlike the approximate index.
    policy.on_done(first)
    policy.on_done(second)
    third = policy.select(RouteRequest(tokens=[*prompt, 8]), dict.fromkeys(workers, 0))
    assert third.reason == "cache_miss"
    # What the engine reports still counts after the request ended.
    policy.on_done(third)
    reports.held = {"b": 900}
    fourth = policy.select(RouteRequest(tokens=[*prompt, 9]), dict.fromkeys(workers, 0))
    assert (fourth.worker, fourth.reason, fourth.matched_tokens) == ("b", "cache_hit", 900)


def test_no_ticket_without_precise_mode() -> None:
    policy = create_policy("cache_aware", PrefixIndex())
    policy.on_worker_added("a")
    assert policy.select(RouteRequest(tokens=[1, 2, 3]), {"a": 0}).ticket is None


def _least_by_in_two_steps(
    ties: TieBreaker, scores: dict[str, float], loads: dict[str, int]
) -> str:
    """``TieBreaker.least_by`` as it was written: the tied workers, then ``least_loaded``."""
    best = min(scores.values())
    tie = tie_window(best)
    return ties.least_loaded({w: loads.get(w, 0) for w, t in scores.items() if t - best <= tie})


@settings(max_examples=300, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.dictionaries(
                st.sampled_from("abcdef"),
                st.sampled_from(
                    [0.0, 0.0005, 0.001, 0.0011, 0.05, 0.0505, 0.051, 0.2, 1.0, float("inf")]
                ),
                min_size=1,
            ),
            st.dictionaries(st.sampled_from("abcdefg"), st.integers(0, 3)),
        ),
        max_size=40,
    )
)
def test_least_by_chooses_as_least_loaded_over_the_tied_workers(
    calls: list[tuple[dict[str, float], dict[str, int]]],
) -> None:
    """The one-pass ``least_by`` picks what ``least_loaded`` over the workers within the
    tie window picks (fewest in flight, then chosen longest ago, then first), call after
    call, leaving the same rotation state."""
    fast, slow = TieBreaker(), TieBreaker()
    for scores, loads in calls:
        assert _outcome(partial(fast.least_by, scores, loads)) == _outcome(
            partial(_least_by_in_two_steps, slow, scores, loads)
        )
        assert (fast._turn, fast._last) == (slow._turn, slow._last)


def _outcome(choose: Callable[[], str]) -> str:
    try:
        return choose()
    except NoWorkerError:  # nothing within the window (only infinite predictions)
        return "no worker"


def test_least_by_forgets_departed_workers_as_least_loaded_does() -> None:
    fast, slow = TieBreaker(), TieBreaker()
    for i in range(4200):
        scores = {f"w{i}": 0.0, "x": 0.0005, "y": 0.5}
        assert fast.least_by(scores, {"x": 1}) == _least_by_in_two_steps(slow, scores, {"x": 1})
        assert fast._last == slow._last
    assert len(fast._last) <= 4097
