"""min_ttft and cache_aware on the work metric: decisions on predicted time to first
token instead of request counts."""

from __future__ import annotations

from collections import Counter

import pytest

from kvroute._native import PrefixIndex
from kvroute.routing.load import LoadModel
from kvroute.routing.policies import RouteRequest, create_policy

WORKERS = ("a", "b", "c")


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 150_000 for i in range(n)]


def setup(name: str, **kw: object) -> tuple[object, LoadModel]:
    pol = create_policy(name, PrefixIndex(None), seed=0, **kw)
    model = LoadModel()
    model.fixed_capacity = kw.get("worker_capacity")  # type: ignore[assignment]
    pol.work = model  # type: ignore[attr-defined]
    for w in WORKERS:
        pol.on_worker_added(w)
    return pol, model


def test_min_ttft_follows_the_cache_until_its_queue_costs_more() -> None:
    pol, model = setup("min_ttft")
    prompt = tokens(1, 4000)
    pol.index.insert("a", prompt[:3800])  # type: ignore[attr-defined]
    loads = dict.fromkeys(WORKERS, 0)
    d = pol.select(RouteRequest(prompt), loads)  # type: ignore[attr-defined]
    assert (d.worker, d.reason, d.matched_tokens) == ("a", "cache_hit", 3800)
    # a now has a long prompt queued: 200 uncached tokens behind 20k is slower than 4000
    # uncached tokens on an idle worker.
    model.reserve("a", 20_000, 10, now=0.0)
    d = pol.select(RouteRequest(prompt), loads)  # type: ignore[attr-defined]
    assert d.worker in ("b", "c") and d.reason == "overflow"
    assert d.cached_tokens == 0


def test_min_ttft_ties_go_to_a_long_match_then_fewer_requests() -> None:
    pol, _model = setup("min_ttft")
    loads = {"a": 3, "b": 0, "c": 1}
    d = pol.select(RouteRequest(tokens(2, 1000)), loads)  # type: ignore[attr-defined]
    assert (d.worker, d.reason) == ("b", "cache_miss")  # all idle in work: fewest requests
    # A 4-token partial match saves less than the tie window: it does not decide (else
    # every new prefix sharing a few leading tokens would pile onto one worker).
    prompt = tokens(3, 1000)
    pol.index.insert("c", prompt[:4])  # type: ignore[attr-defined]
    d = pol.select(RouteRequest(prompt), loads)  # type: ignore[attr-defined]
    assert (d.worker, d.reason) == ("b", "cache_miss")  # no overflow: nothing was given up
    # A long one does.
    prompt = tokens(4, 1000)
    pol.index.insert("c", prompt[:600])  # type: ignore[attr-defined]
    d = pol.select(RouteRequest(prompt), loads)  # type: ignore[attr-defined]
    assert (d.worker, d.reason, d.matched_tokens) == ("c", "cache_hit", 600)


def test_min_ttft_prefers_the_faster_worker_it_learned() -> None:
    pol, _model = _learned_speeds("min_ttft", {"a": 5000.0, "b": 20_000.0, "c": 10_000.0})
    got = Counter(
        pol.select(RouteRequest(tokens(10 + i, 2000)), dict.fromkeys(WORKERS, 0)).worker  # type: ignore[attr-defined]
        for i in range(5)
    )
    assert got == {"b": 5}


def test_min_ttft_temperature_samples_near_ties() -> None:
    pol, model = setup("min_ttft", router_temperature=1.0)
    model.reserve("a", 1500, 1, now=0.0)  # a is 0.1 s worse than b and c: still chosen
    got = Counter(
        pol.select(RouteRequest(tokens(20 + i, 100)), dict.fromkeys(WORKERS, 0)).worker  # type: ignore[attr-defined]
        for i in range(300)
    )
    assert set(got) == set(WORKERS)
    assert got["a"] < got["b"] and got["a"] < got["c"]


def test_cache_aware_work_miss_goes_to_least_predicted_wait_not_fewest_requests() -> None:
    loads = {"a": 1, "b": 4, "c": 4}
    prompt = tokens(3, 500)
    pol, model = setup("cache_aware")
    model.reserve("a", 100_000, 10, now=0.0)  # one huge prompt queued on a
    for w in ("b", "c"):
        for _ in range(4):
            model.reserve(w, 200, 10, now=0.0)
    d = pol.select(RouteRequest(prompt), loads)  # type: ignore[attr-defined]
    assert d.worker in ("b", "c") and d.reason == "cache_miss"
    # The request-count rule picks a, behind 100k tokens.
    old = create_policy("cache_aware", PrefixIndex(None), load_metric="requests")
    assert old.select(RouteRequest(prompt), loads).worker == "a"


def test_cache_aware_work_guard_moves_only_to_a_sooner_worker() -> None:
    pol, model = setup("cache_aware", worker_capacity=2)
    prompt = tokens(4, 3000)
    pol.index.insert("a", prompt)  # type: ignore[attr-defined]
    loads = {"a": 2, "b": 0, "c": 0}  # a is full by count
    model.reserve("a", 10, 5, now=0.0)
    model.reserve("a", 10, 5, now=0.0)
    # Its slots free soon (short outputs): waiting there beats a 3000-token prefill.
    d = pol.select(RouteRequest(prompt), loads)  # type: ignore[attr-defined]
    assert (d.worker, d.reason) == ("a", "cache_hit")
    for _ in range(4):
        model.reserve("a", 10, 5000, now=0.0)  # long decodes: a slot is far off
    d = pol.select(RouteRequest(prompt), loads)  # type: ignore[attr-defined]
    assert d.worker in ("b", "c") and d.reason == "overflow"


def test_cache_aware_work_guard_compares_predicted_ttfts_not_occupancy_prices() -> None:
    """A full holder is priced at its capacity times its prediction (the occupancy
    stretch), a worker with one request in flight at 4/3 of its own. Compared by those
    prices, a short wait for a slot on the holder lost to a cold 4,000-token prefill
    elsewhere that answers later; the guard compares the predicted TTFTs."""
    pol, model = setup("cache_aware", worker_capacity=4)
    prompt = tokens(6, 4000)
    pol.index.insert("a", prompt)  # type: ignore[attr-defined]
    loads = {"a": 4, "b": 1, "c": 1}  # a is full by count
    for _ in range(4):
        model.reserve("a", 10, 40, now=0.0)
    for w in ("b", "c"):
        model.reserve(w, 10, 40, now=0.0)
    pred = model.predict(WORKERS, len(prompt), {"a": len(prompt)})
    assert pred.ttft["a"] < pred.ttft["b"]  # a slot frees before b would have prefilled
    assert pred.price["a"] > pred.price["b"]  # what the guard compared before
    d = pol.select(RouteRequest(prompt), loads)  # type: ignore[attr-defined]
    assert (d.worker, d.reason) == ("a", "cache_hit")


def test_cache_aware_work_guard_keeps_a_hit_on_a_full_holder_that_answers_sooner() -> None:
    """The holder is full (16 of 16 slots, answers short: a slot frees soon); the others
    have one request each, a 6,000-token prefill, in flight. Stretched by occupancy
    (16x against 16/15), the hit cost more than a cold prefill behind that queue, and
    the work guard moved it there, to answer several times later (heterogeneous fleets
    at saturation: a fast full worker's hits shed onto a slow one). Full, the holder is
    compared unstretched: the hit stays."""
    pol, model = setup("cache_aware", worker_capacity=16)
    prompt = tokens(7, 4000)
    pol.index.insert("a", prompt)  # type: ignore[attr-defined]
    loads = {"a": 16, "b": 1, "c": 1}
    for _ in range(16):
        model.reserve("a", 10, 40, now=0.0).first_byte(0.0, learn=False)  # decoding
    for w in ("b", "c"):
        model.reserve(w, 6000, 40, now=0.0)
    pred = model.predict(WORKERS, len(prompt), {"a": len(prompt)})
    assert pred.slot["a"] > 0 and pred.slot["b"] == 0  # a is full: its request waits
    assert pred.ttft["a"] * 3 < pred.ttft["b"]
    behind = model.queued_per_worker(WORKERS)
    assert pred.cost("a", behind) > pred.cost("b", behind)  # what the guard compared
    d = pol.select(RouteRequest(prompt), loads)  # type: ignore[attr-defined]
    assert (d.worker, d.reason) == ("a", "cache_hit")


def test_cache_aware_count_guard_moves_off_a_full_holder_only_when_the_move_costs_less() -> None:
    """The holder is full by count and its request waits for a slot (0.4 s); the others
    would answer sooner (0.3 s), but with a cold 4,000-token prefill that every request
    queued after it on that worker waits for too. The count guard used to move on the
    sooner TTFT alone; it now compares the same unstretched costs as the work guard
    (the request's TTFT plus the delay its prefill adds behind it), so the hit stays.
    Moves on TTFT alone stacked conversations onto a few workers while a fresh router
    had learned few capacities (module doc)."""
    pol, model = setup("cache_aware", worker_capacity=4)
    prompt = tokens(8, 4000)
    pol.index.insert("a", prompt)  # type: ignore[attr-defined]
    loads = {"a": 4, "b": 2, "c": 2}  # a is full by count
    for _ in range(4):
        model.reserve("a", 10, 100, now=0.0).first_byte(0.0, learn=False)  # decoding
    for w in ("b", "c"):
        for _ in range(2):
            model.reserve(w, 200, 40, now=0.0)  # waiting for their first byte
    pred = model.predict(WORKERS, len(prompt), {"a": len(prompt)})
    behind = model.queued_per_worker(WORKERS)
    assert pred.slot["a"] > 0 and pred.ttft["b"] < pred.ttft["a"]  # b answers sooner
    assert pred.unstretched_cost("b", behind) > pred.unstretched_cost("a", behind)
    d = pol.select(RouteRequest(prompt), loads)  # type: ignore[attr-defined]
    assert (d.worker, d.reason) == ("a", "cache_hit")
    # With a slot far off (long answers), the move costs less and is made.
    for _ in range(4):
        model.reserve("a", 10, 5000, now=0.0).first_byte(0.0, learn=False)
    d = pol.select(RouteRequest(prompt), {"a": 8, "b": 2, "c": 2})  # type: ignore[attr-defined]
    assert d.worker in ("b", "c") and d.reason == "overflow"


def test_cache_aware_work_leaves_a_holder_whose_queue_costs_more_than_its_cache_saves() -> None:
    """Not full by count (no capacity known), but 20k tokens of prefill queued ahead on
    the holder: the request goes elsewhere (``overflow``) once that costs less; the
    request-count rule follows the cache whatever is queued there."""
    prompt = tokens(5, 4000)
    loads = {"a": 1, "b": 1, "c": 1}
    pol, model = setup("cache_aware")
    pol.index.insert("a", prompt[:3800])  # type: ignore[attr-defined]
    d = pol.select(RouteRequest(prompt), loads)  # type: ignore[attr-defined]
    assert (d.worker, d.reason) == ("a", "cache_hit")  # nothing queued: the cache wins
    model.reserve("a", 20_000, 10, now=0.0)
    d = pol.select(RouteRequest(prompt), loads)  # type: ignore[attr-defined]
    assert d.worker in ("b", "c") and d.reason == "overflow" and d.matched_tokens == 0
    old = create_policy("cache_aware", PrefixIndex(None), load_metric="requests")
    for w in WORKERS:
        old.on_worker_added(w)
    old.index.insert("a", prompt[:3800])  # type: ignore[attr-defined]
    assert old.select(RouteRequest(prompt), loads).worker == "a"


@pytest.mark.parametrize("policy", ["cache_aware", "min_ttft"])
def test_a_wait_for_kv_room_is_predicted_but_does_not_move_the_request(policy: str) -> None:
    """The holder of a 12,000-token prefix runs a long answer to a 45,000-token prompt in
    its 50,000-token KV cache: a 20,000-token request sharing that prefix waits for the
    answer to end before the engine admits it (its slots are free). Its predicted TTFT
    says so (the first-byte deadline reads it); the choice leaves the wait out and
    follows the cache: sent elsewhere, the prefix starts a second copy in another cache
    (priced into choices, it cost chat 8% of its capacity in the simulator)."""
    pol, model = setup(policy)
    clock = [0.0]
    model.clock = lambda: clock[0]
    prefix = tokens(8, 12_000)
    prompt = prefix + tokens(9, 8_000)
    pol.index.insert("a", prefix)  # type: ignore[attr-defined]
    loads = {"a": 1, "b": 0, "c": 0}
    model.kv_capacity = dict.fromkeys(WORKERS, 50_000)
    model.reserve("a", 45_000, 4000, now=0.0).first_byte(0.1)
    clock[0] = 0.2
    d = pol.select(RouteRequest(prompt), loads)  # type: ignore[attr-defined]
    assert d.worker == "a"
    unwaited = model.ttft("a", 8_000, 12_000, kv=0)
    ticket = model.reserve("a", 8_000, 10, now=0.2, matched=12_000, kv=d.kv_tokens)
    assert ticket.predicted > unwaited + 10.0  # the 4,000-token answer's end
    assert model.kv_wait("b", 20_000) == 0.0


@pytest.mark.parametrize("policy", ["cache_aware", "min_ttft"])
def test_a_long_match_is_kept_after_many_short_matches_an_engine_cannot_cache(policy: str) -> None:
    """Prompts that share only their first few tokens with earlier ones (text whose
    opening repeats) are predicted a few cached tokens that no engine caches (whole
    blocks only). The index is right about its long matches all along, so a holder of
    3,800 tokens with one prompt queued keeps the request: the saving is real.
    (When each such prompt counted as a failed prediction, three in four took trust to
    a quarter, and the match was taken for three quarters cold.)"""
    pol, model = setup(policy)
    loads = dict.fromkeys(WORKERS, 1)
    for i in range(100):
        matched, real = (3800, 3792) if i % 4 == 0 else (3, 0)  # the engine: 16-token blocks
        t = model.reserve("a", 4000 - matched, 10, now=float(i), matched=matched)
        t.reported_uncached = 4000 - real
        t.end(float(i) + 0.5)
    prompt = tokens(5, 4000)
    pol.index.insert("a", prompt[:3800])  # type: ignore[attr-defined]
    model.reserve("a", 3000, 10, now=200.0)
    d = pol.select(RouteRequest(prompt), loads)  # type: ignore[attr-defined]
    assert (d.worker, d.reason, d.matched_tokens) == ("a", "cache_hit", 3800)


def budgeted(budget: int, *, byte_tokens: bool = False, policy: str = "cache_aware") -> object:
    pol = create_policy(
        policy, PrefixIndex(budget, byte_tokens=byte_tokens), seed=0, load_metric="work"
    )
    for w in WORKERS:
        pol.on_worker_added(w)
    return pol


@pytest.mark.parametrize("policy", ["cache_aware", "min_ttft"])
def test_a_prompt_in_flight_is_matched_where_the_budget_evicted_it(policy: str) -> None:
    """The index's budget forgets prompts in the order they were routed; an engine never
    evicts a running request's blocks. A long prompt still in flight on ``a``, pushed out
    of the index by the prompts routed to ``a`` after it, is still held there: the next
    request extending it goes to ``a`` as a hit (pending prompts), not cold elsewhere."""
    pol = budgeted(3000, policy=policy)
    loads = dict.fromkeys(WORKERS, 0)
    first = tokens(1, 2000)
    pol.index.insert("c", tokens(9, 3500))  # type: ignore[attr-defined]  # the budget has bound
    assert pol.index.evicted_tokens > 0  # type: ignore[attr-defined]
    d1 = pol.select(RouteRequest(first), loads)  # type: ignore[attr-defined]
    home = d1.worker  # wherever it went, it is in flight there
    assert d1.ticket is not None
    loads[home] += 1
    # Prompts routed to the same worker after it push it out of the index.
    for i in range(2):
        pol.index.insert(home, tokens(20 + i, 1500))  # type: ignore[attr-defined]
    assert pol.index.match(first).get(home, 0) == 0  # type: ignore[attr-defined]
    follow = first + tokens(2, 300)
    d2 = pol.select(RouteRequest(follow), loads)  # type: ignore[attr-defined]
    assert (d2.worker, d2.reason, d2.matched_tokens) == (home, "cache_hit", 2000)
    assert d2.cached_tokens == 2000  # the prediction reads it too
    # What it needs of the KV cache beyond the prompt in flight there: its 300 new tokens.
    assert d1.kv_tokens == 2000 and d2.kv_tokens == 300
    assert pol.prompts_in_flight == 2  # type: ignore[attr-defined]
    # Ended, the first prompt is no longer pending: the index alone decides again.
    pol.on_done(d1)  # type: ignore[attr-defined]
    pol.on_done(d2)  # type: ignore[attr-defined]
    assert pol.prompts_in_flight == 0  # type: ignore[attr-defined]
    for i in range(2):
        pol.index.insert(home, tokens(30 + i, 1500))  # type: ignore[attr-defined]
    d3 = pol.select(RouteRequest(first + tokens(3, 300)), loads)  # type: ignore[attr-defined]
    assert d3.reason == "cache_miss"


def test_without_pending_prompts_the_evicted_prompt_in_flight_is_a_miss() -> None:
    """The same as above with ``pending_prompts`` off: the request is taken for a miss
    (the test above fails without the pending prompts)."""
    pol = budgeted(3000)
    pol.pending_prompts = False  # type: ignore[attr-defined]
    loads = dict.fromkeys(WORKERS, 0)
    first = tokens(1, 2000)
    pol.index.insert("c", tokens(9, 3500))  # type: ignore[attr-defined]
    home = pol.select(RouteRequest(first), loads).worker  # type: ignore[attr-defined]
    loads[home] += 1
    for i in range(2):
        pol.index.insert(home, tokens(20 + i, 1500))  # type: ignore[attr-defined]
    d2 = pol.select(RouteRequest(first + tokens(2, 300)), loads)  # type: ignore[attr-defined]
    assert d2.reason == "cache_miss" and d2.ticket is None


def test_nothing_is_kept_pending_while_the_budget_has_not_evicted() -> None:
    """Before any eviction every routed prompt is in the index: no ticket, no
    ``on_done`` work (serve calls it only for decisions that carry a ticket). The
    decision whose insert first evicts is kept, and every one after it."""
    pol = budgeted(3000)
    loads = dict.fromkeys(WORKERS, 0)
    d = pol.select(RouteRequest(tokens(1, 2000)), loads)  # type: ignore[attr-defined]
    assert d.ticket is None and pol.index.evicted_tokens == 0  # type: ignore[attr-defined]
    d = pol.select(RouteRequest(tokens(1, 2000) + tokens(2, 1500)), loads)  # type: ignore[attr-defined]
    assert pol.index.evicted_tokens > 0  # type: ignore[attr-defined]
    assert d.ticket is not None
    d = pol.select(RouteRequest(tokens(4, 100)), loads)  # type: ignore[attr-defined]
    assert d.ticket is not None


def test_pending_prompts_in_bytes_mode() -> None:
    """Without a tokenizer the index and the pending prompts are byte indexes alike."""
    pol = budgeted(3000, byte_tokens=True)
    loads = dict.fromkeys(WORKERS, 0)
    first = bytes(range(32, 127)) * 21  # 1,995 bytes
    pol.index.insert("c", b"x" * 3500)  # type: ignore[attr-defined]
    d1 = pol.select(RouteRequest(first), loads)  # type: ignore[attr-defined]
    home = d1.worker
    loads[home] += 1
    for i in range(2):
        pol.index.insert(home, bytes([65 + i]) * 1500)  # type: ignore[attr-defined]
    d2 = pol.select(RouteRequest(first + b"next turn"), loads)  # type: ignore[attr-defined]
    assert (d2.worker, d2.reason, d2.matched_tokens) == (home, "cache_hit", len(first))


@pytest.mark.parametrize("policy", ["cache_aware", "min_ttft"])
def test_a_prompt_is_recorded_again_when_its_request_ends(policy: str) -> None:
    """An engine keeps a running request's blocks and, when it ends, puts them last in
    its eviction order. A prompt pushed out of the index while its request ran is
    recorded again at ``on_done``: the conversation's next turn, sent then, is a hit
    where it ran (before: a miss, placed cold wherever the prediction was least)."""
    pol = budgeted(3000, policy=policy)
    loads = dict.fromkeys(WORKERS, 0)
    first = tokens(1, 2000)
    pol.index.insert("c", tokens(9, 3500))  # type: ignore[attr-defined]  # the budget has bound
    d1 = pol.select(RouteRequest(first), loads)  # type: ignore[attr-defined]
    home = d1.worker
    loads[home] += 1
    for i in range(2):  # routed to the same worker while it runs
        pol.index.insert(home, tokens(20 + i, 1500))  # type: ignore[attr-defined]
    assert pol.index.match(first).get(home, 0) == 0  # type: ignore[attr-defined]
    pol.on_done(d1)  # type: ignore[attr-defined]
    loads[home] -= 1
    assert pol.index.match(first).get(home, 0) == 2000  # type: ignore[attr-defined]
    assert pol.prompts_in_flight == 0  # type: ignore[attr-defined]
    # What it displaced is what the engine evicted: the least recently used prompt.
    assert pol.index.match(tokens(20, 1500)).get(home, 0) == 0  # type: ignore[attr-defined]
    d2 = pol.select(RouteRequest(first + tokens(2, 300)), loads)  # type: ignore[attr-defined]
    assert (d2.worker, d2.reason, d2.matched_tokens) == (home, "cache_hit", 2000)


@pytest.mark.parametrize("policy", ["cache_aware", "min_ttft"])
def test_a_refused_or_departed_prompt_is_not_recorded_again(policy: str) -> None:
    """A worker that refused the prompt holds nothing of it (``on_rejected`` rolls the
    insert back), and one removed from the fleet, or whose cache was flushed, has
    nothing to refresh: ``on_done`` records nothing then."""
    pol = budgeted(3000, policy=policy)
    loads = dict.fromkeys(WORKERS, 0)
    pol.index.insert("c", tokens(9, 3500))  # type: ignore[attr-defined]
    first = tokens(1, 2000)
    d = pol.select(RouteRequest(first), loads)  # type: ignore[attr-defined]
    pol.on_rejected(d, first)  # type: ignore[attr-defined]
    assert pol.index.match(first).get(d.worker, 0) == 0  # type: ignore[attr-defined]
    pol.on_done(d)  # type: ignore[attr-defined]
    assert pol.index.match(first).get(d.worker, 0) == 0  # type: ignore[attr-defined]

    d = pol.select(RouteRequest(first), loads)  # type: ignore[attr-defined]
    pol.on_worker_removed(d.worker)  # type: ignore[attr-defined]
    pol.on_done(d)  # type: ignore[attr-defined]
    assert d.worker not in pol.index.workers()  # type: ignore[attr-defined]
    assert pol.prompts_in_flight == 0  # type: ignore[attr-defined]

    second = tokens(3, 2000)
    d = pol.select(RouteRequest(second), loads)  # type: ignore[attr-defined]
    pol.clear()  # type: ignore[attr-defined]
    pol.on_done(d)  # type: ignore[attr-defined]
    assert pol.index.match(second) == {}  # type: ignore[attr-defined]


def test_cache_aware_work_guard_leaves_a_hit_on_a_holder_with_nothing_queued() -> None:
    """The holder is slow (5,000 tokens/s learned) and idle, the others fast (20,000) and
    idle: the hit's 1,600 uncached tokens there take longer than the whole 4,000-token
    prompt cold on a fast worker. The request stays: with nothing queued on the holder
    there is no queue to spare it, and a move takes the prefix's later requests along
    to a worker that has streams of its own while the holder idles. Once a prefill is
    queued ahead of it on the holder, the guard compares costs and moves it."""
    pol, model = _learned_speeds("cache_aware", {"a": 5000.0, "b": 20_000.0, "c": 20_000.0})
    prompt = tokens(30, 4000)
    pol.index.insert("a", prompt[:2400])  # type: ignore[attr-defined]
    loads = dict.fromkeys(WORKERS, 0)
    pred = model.predict(WORKERS, len(prompt), {"a": 2400})
    assert pred.ttft["a"] > 1.3 * pred.ttft["b"]  # the fast worker answers sooner cold
    d = pol.select(RouteRequest(prompt), loads)  # type: ignore[attr-defined]
    assert (d.worker, d.reason, d.matched_tokens) == ("a", "cache_hit", 2400)
    model.reserve("a", 3000, 10, now=0.0)  # a prefill queued on the holder
    d = pol.select(RouteRequest(prompt), {"a": 1, "b": 0, "c": 0})  # type: ignore[attr-defined]
    assert d.worker in ("b", "c") and d.reason == "overflow"


def test_cache_aware_work_guard_still_moves_a_hit_off_a_busier_holder() -> None:
    """Nothing queued on the holder either, but three of its four decode slots are taken
    and the other workers run nothing: the occupancy the price stretches for (the
    prefix's later requests would queue for those slots) is the holder's, so the guard
    compares costs as before and moves the request."""
    pol, model = _learned_speeds(
        "cache_aware", {"a": 5000.0, "b": 20_000.0, "c": 20_000.0}, worker_capacity=4
    )
    prompt = tokens(31, 4000)
    pol.index.insert("a", prompt[:2400])  # type: ignore[attr-defined]
    for _ in range(3):
        model.reserve("a", 10, 400, now=0.0).first_byte(0.0, learn=False)  # decoding
    pred = model.predict(WORKERS, len(prompt), {"a": 2400})
    assert pred.slot["a"] == 0 and pred.stretch["a"] > pred.stretch["b"] == 1.0
    d = pol.select(RouteRequest(prompt), {"a": 3, "b": 0, "c": 0})  # type: ignore[attr-defined]
    assert d.worker in ("b", "c") and d.reason == "overflow"


def _learned_speeds(name: str, speeds: dict[str, float], **kw: object) -> tuple[object, LoadModel]:
    """Policy ``name`` on work, each worker's prefill rate learned from 12 requests
    answered at ``speeds`` (prompt tokens per second)."""
    pol, model = setup(name, **kw)
    for w, tps in speeds.items():
        for i in range(12):
            n = 500 + 400 * i
            t = model.reserve(w, n, 1, now=0.0)
            t.first_byte(n / tps)
            t.end(n / tps)
    return pol, model
