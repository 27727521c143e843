"""The work model (kvroute.routing.load): reservations, prediction, learned speed."""

from __future__ import annotations

import random
from statistics import median
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.routing.load import (
    PRIOR_OUTPUT_TOKENS,
    PRIOR_OVERHEAD_S,
    PRIOR_PREFILL_TPS,
    LoadModel,
    ResistantLine,
    max_tokens_of,
)


def totals(model: LoadModel, worker: str) -> tuple[int, int, int]:
    st = model.workers[worker]
    return st.prefill_tokens, st.requests, st.decode_tokens


def test_reservations_release_exactly_once_in_two_parts() -> None:
    m = LoadModel()
    a = m.reserve("w", 1000, 50, now=0.0)
    b = m.reserve("w", 300, 20, now=0.0)
    assert totals(m, "w") == (1300, 2, 70)
    a.first_byte(0.1)
    a.first_byte(0.2)  # once only
    assert totals(m, "w") == (300, 2, 70)
    a.end(1.0)
    a.end(2.0)
    assert totals(m, "w") == (300, 1, 20)
    b.end(0.5)  # ended without a first byte (failure): its prefill part goes too
    b.first_byte(0.6)  # too late: nothing
    assert totals(m, "w") == (0, 0, 0)


def test_prediction_counts_queued_work_ahead_and_own_tokens() -> None:
    m = LoadModel()
    idle = m.ttft("w", 1500)
    assert idle == pytest.approx(PRIOR_OVERHEAD_S + 1500 / PRIOR_PREFILL_TPS)
    m.reserve("w", 30_000, 10, now=0.0)  # one long prompt queued (half done: the head)
    m.reserve("w", 15_000, 10, now=0.0)
    # 1.5 requests ahead (overheads) + 15k + 15k tokens, then its own.
    expect = 2.5 * PRIOR_OVERHEAD_S + (15_000 + 15_000 + 1500) / PRIOR_PREFILL_TPS
    assert m.ttft("w", 1500) == pytest.approx(expect)
    # Many short requests weigh what they cost, not what they count.
    for _ in range(10):
        m.reserve("v", 100, 10, now=0.0)
    assert m.ttft("v", 1500) < m.ttft("w", 1500)


def test_with_a_clock_the_prefill_in_progress_counts_what_is_left_of_it() -> None:
    """The head of a worker's queue began its prefill when it was routed (a free slot,
    nothing else waiting) or when the one ahead of it gave its first byte; with the
    caller's clock the model counts what is left of it, not half of it."""
    clock = [0.0]
    m = LoadModel()
    m.clock = lambda: clock[0]
    head = PRIOR_OVERHEAD_S + 15_000 / PRIOR_PREFILL_TPS  # 1.005 s
    a = m.reserve("w", 15_000, 10, now=0.0)
    own = PRIOR_OVERHEAD_S + 1500 / PRIOR_PREFILL_TPS
    clock[0] = 0.25
    assert m.ttft("w", 1500) == pytest.approx(head - 0.25 + own)
    clock[0] = 0.9
    assert m.ahead("w") == pytest.approx(head - 0.9)
    clock[0] = 3.0  # overdue: nothing is assumed left
    assert m.ahead("w") == 0.0
    # A second one queued behind the first starts when the first's first byte comes.
    b = m.reserve("w", 3000, 10, now=3.0)
    second = PRIOR_OVERHEAD_S + 3000 / PRIOR_PREFILL_TPS
    a.first_byte(3.2)
    clock[0] = 3.3
    assert m.ahead("w") == pytest.approx(second - 0.1)
    # Predictions for every worker at once agree with the per-worker call.
    assert m.predict(["w"], 1500, {}).ttft["w"] == pytest.approx(m.ttft("w", 1500))
    b.end(3.5)
    assert m.ahead("w") == 0.0 and not m.workers["w"].since
    # Without a clock (or for a head that found the engine busy) it counts half done.
    m.clock = None
    m.reserve("w", 15_000, 10, now=4.0)
    assert m.ahead("w") == pytest.approx(0.5 * head)
    m.clock = lambda: 4.0
    m.observe_engine("v", running=4, waiting=3)  # others' requests wait on v
    m.reserve("v", 15_000, 10, now=4.0)
    assert "v" not in {w for w, st in m.workers.items() if st.since}


def test_a_full_worker_adds_the_wait_for_a_slot() -> None:
    m = LoadModel()
    m.fixed_capacity = 2
    m.reserve("w", 10, 100, now=0.0)
    assert m.slot_wait("w") == 0.0
    m.reserve("w", 10, 100, now=0.0)
    one = m.slot_wait("w")
    assert one > 0
    m.reserve("w", 10, 100, now=0.0)
    assert m.slot_wait("w") == pytest.approx(2 * one)
    # Requests the engine holds beyond ours count too (other routers, bypass).
    m.others = {"v": 2}
    m.reserve("v", 10, 100, now=0.0)
    assert m.slot_wait("v") > 0


def test_a_full_worker_s_slot_frees_when_its_soonest_decode_ends() -> None:
    """The queue's j-th request waits for the j-th end among the running ones: ours
    decoding end when their expected output is out at the learned decode speed, not
    after an even share of a mean decode (short answers free slots early)."""
    now = [0.0]
    m = LoadModel()
    m.clock = lambda: now[0]
    m.fixed_capacity = 4
    d = m.state("w").decode_s.value  # the prior until a decode is learned
    tickets = [m.reserve("w", 10, out, now=0.0) for out in (61, 501, 501, 501)]
    for t in tickets:
        t.first_byte(0.0)
    now[0] = 1.0
    # A fifth request waits for the 61-token answer: 60 more tokens from t=0.
    assert m.slot_wait("w") == pytest.approx(60 * d - 1.0)
    # The even spread of the mean (391 tokens) would have said 1/5 of it, 2.2x longer.
    assert (1 / 5) * 391 * d > 2 * m.slot_wait("w")
    m.reserve("w", 10, 100, now=1.0)  # queued: the next one waits for a 500-token end
    assert m.slot_wait("w") == pytest.approx(500 * d - 1.0)
    # Past its expected end, an answer still needs a token: the wait never reaches 0,
    # so a full worker always has one.
    now[0] = 60 * d + 5.0
    tickets[0].end(now[0], 70)
    assert m.slot_wait("w") == pytest.approx(500 * d - now[0])
    now[0] = 600 * d
    assert m.slot_wait("w") == pytest.approx(m.workers["w"].decode_s.value)
    # Requests the engine holds beyond ours (progress unknown) end spread over a mean
    # decode, among ours.
    m.others = {"w": 4}
    spread = m.slot_wait("w")
    assert 0 < spread < 500 * d


def test_a_full_worker_s_slot_frees_at_the_ends_other_routers_published() -> None:
    """Other router replicas' decoding requests end where their routers said they would
    (``peer_ends``, shared through the store), as ours do, not after an even share of a
    mean decode each; theirs still waiting for a first byte (``peer_pending``) are a
    whole decode away, as ours are."""
    now = [10.0]
    m = LoadModel()
    m.clock = lambda: now[0]
    m.fixed_capacity = 2
    whole = PRIOR_OUTPUT_TOKENS * m.state("w").per_token(2)  # a mean decode, full batch
    m.peer = {"w": 2}  # two other routers' requests run there: full
    assert m.slot_wait("w") == pytest.approx(whole / 3)  # the 1st of 2, spread
    m.peer_ends = {"w": [(10.05,), (15.0,)]}  # they said: one ends in 50 ms
    assert m.slot_wait("w") == pytest.approx(0.05)
    # A third waits for its first byte: the queue's second waits for the end at 15 s.
    m.peer, m.peer_pending = {"w": 3}, {"w": 1}
    assert m.slot_wait("w") == pytest.approx(5.0)
    # Ours and theirs in time order: ours decodes 20 more tokens from 10 s.
    m.peer, m.peer_pending = {"w": 2}, {"w": 0}
    t = m.reserve("w", 10, 21, now=10.0)
    t.first_byte(10.0)
    ours = t.end_at[0] - 10.0 if t.end_at is not None else 0.0
    assert 0.05 < ours < 5.0
    assert m.slot_wait("w") == pytest.approx(ours)  # the 2nd of 10.05, ours, 15
    m.peer_ends = {"w": [(16.0,), (17.0,)]}
    assert m.slot_wait("w") == pytest.approx(6.0)  # the 2nd of ours, 16, 17
    # A list newer than the count of their requests: none left of unknown progress.
    m.peer = {"w": 1}
    assert m.slot_wait("w") == pytest.approx(ours)


def test_another_router_s_prefill_in_progress_counts_what_is_left_of_it() -> None:
    """The head of the other routers' queue on a worker began its prefill when their
    waiting requests went from none to some (``peer_queue_moved``), or when the one
    ahead of it gave its first byte; counted whole, every other router saw the worker a
    whole prefill busier than it was. Ours at the head first keeps its own timing."""
    now = [0.0]
    m = LoadModel()
    m.clock = lambda: now[0]
    head = PRIOR_OVERHEAD_S + 15_000 / PRIOR_PREFILL_TPS  # 1.005 s
    m.add_worker("w")
    m.peer_pending, m.peer_prefill = {"w": 1}, {"w": 15_000}
    assert m.ahead("w") == pytest.approx(head)  # not heard when it began: whole
    m.peer_queue_moved("w", 0, 1, True, 0.0)
    now[0] = 0.4
    assert m.ahead("w") == pytest.approx(head - 0.4)
    assert m.predict(["w"], 100, {}).ttft["w"] == pytest.approx(m.ttft("w", 100))
    # A second of theirs queues behind it (more, not fewer: the head goes on) ...
    m.peer_pending, m.peer_prefill = {"w": 2}, {"w": 30_000}
    m.peer_queue_moved("w", 1, 2, True, 0.5)
    now[0] = 0.6
    assert m.ahead("w") == pytest.approx(head - 0.6 + head)  # their mean size each
    # ... and starts when the first had its first byte.
    m.peer_pending, m.peer_prefill = {"w": 1}, {"w": 15_000}
    m.peer_queue_moved("w", 2, 1, True, 1.0)
    now[0] = 1.5
    assert m.ahead("w") == pytest.approx(head - 0.5)
    # Ours, queued behind theirs, counts whole; theirs is the one in progress.
    m.reserve("w", 3000, 10, now=1.5)
    assert not m.workers["w"].since  # not at the head: no timing of its own
    ours = PRIOR_OVERHEAD_S + 3000 / PRIOR_PREFILL_TPS
    now[0] = 2.0
    assert m.ahead("w") == pytest.approx(head - 1.0 + ours)
    # None of theirs left: forgotten; a later one of theirs behind ours counts whole.
    m.peer_pending, m.peer_prefill = {"w": 0}, {"w": 0}
    m.peer_queue_moved("w", 1, 0, True, 2.0)
    assert "w" not in m.peer_head
    v = m.reserve("v", 15_000, 10, now=2.0)  # ours at v's head, timed from 2.0
    m.peer_pending, m.peer_prefill = {"v": 1}, {"v": 6000}
    m.peer_queue_moved("v", 0, 1, True, 2.1)
    now[0] = 2.5
    theirs = PRIOR_OVERHEAD_S + 6000 / PRIOR_PREFILL_TPS
    assert m.ahead("v") == pytest.approx(head - 0.5 + theirs)
    # Heard without a clock: no timing, counted whole.
    v.end(2.6)
    m.peer_queue_moved("v", 1, 1, True, None)
    assert "v" not in m.peer_head and m.ahead("v") == pytest.approx(theirs)


def test_slot_waits_follow_the_decode_speed_learned_for_the_batch() -> None:
    """A request decodes at the seconds per token learned for the batch it joined at its
    first byte (engines step slower with more requests running), and the ends already
    expected are re-timed when that line learns."""
    now = [0.0]
    m = LoadModel()
    m.clock = lambda: now[0]
    m.fixed_capacity = 2
    a = m.reserve("w", 10, 101, now=0.0)
    b = m.reserve("w", 10, 201, now=0.0)
    a.first_byte(0.0)
    b.first_byte(0.0)
    assert (a.batch, b.batch) == (2, 2)
    m.reserve("w", 10, 50, now=0.0)  # waits for a's slot; the next one for b's
    st = m.workers["w"]
    assert m.slot_wait("w") == pytest.approx(200 * st.decode_s.value)  # the prior
    for batch, per in [(1, 0.02), (4, 0.05)] * 3:  # 10 ms per token + 10 per request
        st.decode.observe(batch, per)
    assert st.per_token(2) == pytest.approx(0.03)
    assert m.slot_wait("w") == pytest.approx(200 * 0.03)
    a.end(1.0, 101)  # removed whatever order it was kept in
    b.end(1.0, 201)
    assert st.ends == []


def test_choices_stretch_a_worker_s_times_by_its_occupied_decode_slots() -> None:
    """1 / (1 - n / capacity): 1 while no capacity is known, growing as slots fill
    (others' requests count), the capacity itself once full (the slot wait prices the
    rest). The prediction itself (``ttft``) is not stretched: only the price a choice
    compares."""
    m = LoadModel()
    for _ in range(3):
        m.reserve("w", 10, 100, now=0.0)
    assert m.stretch("w") == 1.0  # no capacity known: nothing to be occupied
    assert m.stretch("unknown") == 1.0
    m.fixed_capacity = 4
    assert m.stretch("w") == pytest.approx(4.0)  # 3 of 4 slots taken
    m.reserve("v", 10, 100, now=0.0)
    assert m.stretch("v") == pytest.approx(4 / 3)
    m.others = {"v": 1}  # one the engine holds beyond ours
    assert m.stretch("v") == pytest.approx(2.0)
    for _ in range(5):
        m.reserve("w", 10, 100, now=0.0)
    assert m.stretch("w") == 4.0  # full: capped, the slot wait grows instead
    pred = m.predict(["w", "v"], 500, {})
    assert pred.ttft["w"] == m.ttft("w", 500)
    assert pred.price["w"] == pred.ttft["w"] * 4.0
    assert m.snapshot("v")["occupancy_stretch"] == 2.0  # shown in /workers and /metrics


def test_cold_work_goes_to_free_slots_and_hits_stay_home() -> None:
    """A fast worker with 3 of its 4 decode slots taken against an idle worker half as
    fast: the request-blind prediction sends a cold 3,000-token prompt to the fast one
    (0.2 s against 0.4 s of prefill), where the later requests of its prefix, which
    follow it, find the slots taken. Priced by occupancy it goes to the idle worker
    (0.8 against 0.4); a hit on the fast worker (a few ms there) still stays."""
    from kvroute._native import PrefixIndex
    from kvroute.routing.policies.base import RouteRequest
    from kvroute.routing.policies.cache_aware import CacheAware

    def fleet(capacity: int | None) -> CacheAware:
        """Fast and slow lines known, 3 requests in flight on the fast worker."""
        policy = CacheAware(PrefixIndex(None), worker_capacity=capacity)
        assert policy.work is not None
        policy.work.know("fast", 0.005, 15_000.0)
        policy.work.know("slow", 0.005, 7_500.0)
        for _ in range(3):
            policy.work.reserve("fast", 100, 200, now=0.0).first_byte(0.1)
        return policy

    policy = fleet(4)
    busy = list(range(1_000_000, 1_004_000))
    policy.index.insert("fast", busy)
    loads = {"fast": 3, "slow": 0}
    cold = RouteRequest(tokens=list(range(3000)))
    assert policy.select(cold, loads).worker == "slow"
    hit = RouteRequest(tokens=[*busy, 7, 8, 9])
    decision = policy.select(hit, loads)
    assert (decision.worker, decision.reason) == ("fast", "cache_hit")
    # Without the occupancy (capacity unknown) the cold prompt goes to the fast one.
    blind = fleet(None)
    assert blind.select(cold, loads).worker == "fast"


def test_engine_readings_add_others_waiting_work_and_a_full_kv_cache() -> None:
    m = LoadModel()
    for _ in range(4):
        m.reserve("w", 1000, 10, now=0.0).end(0.1)  # mean uncached size learned
    before = m.ttft("w", 100)
    m.observe_engine("w", running=3, waiting=5)  # 5 waiting, none of them ours
    assert m.ttft("w", 100) > before
    m.observe_engine("v", running=4, waiting=0, kv_usage=0.99)
    m.reserve("v", 10, 100, now=0.0)
    assert m.slot_wait("v") == 0.0  # 1 of ours, the engine says its cache admits 4
    for _ in range(4):
        m.reserve("v", 10, 100, now=0.0)
    assert m.slot_wait("v") > 0


def test_a_request_waits_for_room_in_the_kv_cache_until_requests_in_flight_end() -> None:
    """Engines admit a waiting request only when its prompt's blocks fit beside the
    running requests' (first come, first served): a worker whose KV cache the requests
    in flight fill has a wait for room, until enough of them end, whatever its slots."""
    now = [0.0]
    m = LoadModel()
    m.clock = lambda: now[0]
    m.kv_capacity = {"w": 50_000}
    d = m.state("w").decode_s.value
    short = m.reserve("w", 20_000, 101, now=0.0)
    long = m.reserve("w", 20_000, 1001, now=0.0)
    for t in (short, long):
        t.first_byte(0.0)
    assert m.kv_pinned("w") == 40_000
    assert m.kv_wait("w", 10_000) == 0.0  # fits beside them
    assert m.slot_wait("w") == 0.0  # no capacity known: no slot wait
    # 15,000 more: the short answer's end frees enough (100 more tokens from t=0).
    assert m.kv_wait("w", 15_000) == pytest.approx(100 * d)
    # 40,000 more: both must end.
    assert m.kv_wait("w", 40_000) == pytest.approx(1000 * d)
    # A prompt larger than the cache runs alone: after every request in flight.
    assert m.kv_wait("w", 60_000) == pytest.approx(1000 * d)
    # The wait is part of a routed request's predicted TTFT (with the slot wait, the
    # longer of the two), the one its first byte is checked against and the first-byte
    # deadline reads; the per-decision predictions leave it out.
    assert m.ttft("w", 40_000, kv=40_000) == pytest.approx(m.ttft("w", 40_000, kv=0) + 1000 * d)
    alone = m.ttft("w", 40_000, kv=0)
    ticket = m.reserve("w", 40_000, 10, now=0.0, kv=40_000)
    assert ticket.predicted == pytest.approx(alone + 1000 * d)
    assert not ticket.clean  # its first byte will not time its own prefill alone
    ticket.end(0.0)
    pred = m.predict(["w"], 40_000, {})
    assert pred.slot["w"] == 0.0
    assert pred.ttft["w"] == pytest.approx(alone)
    # Released exactly once, with the rest of the ticket.
    short.end(1.0, 101)
    short.end(2.0, 101)
    assert m.kv_pinned("w") == 20_000
    long.end(3.0)
    assert m.kv_pinned("w") == 0 and m.workers["w"].kv == {}
    # No capacity reported: no wait for room predicted.
    m.kv_capacity = {}
    m.reserve("w", 60_000, 10, now=3.0)
    assert m.kv_wait("w", 60_000) == 0.0


def test_kv_room_others_hold_is_read_from_the_engine_only_where_others_run() -> None:
    """An engine's KV cache usage beyond what ours keep counts as others' (bypassing
    clients, other routers) only where requests not ours run there: our own count
    leaves out blocks a request shares with one that ended, so a reading above it alone
    is nobody else's."""
    m = LoadModel()
    m.kv_capacity = {"w": 100_000}
    m.reserve("w", 10_000, 10, now=0.0, kv=10_000)
    m.observe_engine("w", running=1, waiting=0, kv_usage=0.6)
    assert m.kv_pinned("w") == 10_000
    m.others = {"w": 3}
    assert m.kv_pinned("w") == 60_000
    assert m.kv_wait("w", 30_000) == 0.0
    assert m.kv_wait("w", 50_000) > 0.0


def test_a_worker_not_seen_queueing_is_assumed_to_run_as_many_as_the_largest_learned() -> None:
    """Capacities are learned only when an engine reading catches a worker queueing
    (every few seconds). Until then a worker had no slot wait at all, so a hot prefix's
    holder drew requests far past its decode slots; now it is assumed to run as many at
    once as the largest capacity learned on any worker, until its own is learned."""
    m = LoadModel()
    m.capacities = {"a": 4}  # "a" was seen queueing with 4 running; "b" never was
    for _ in range(6):
        m.reserve("b", 10, 100, now=0.0)
    assert m.slot_wait("b") > 0
    assert m.predict(["a", "b"], 10, {}).ttft["b"] == m.ttft("b", 10)
    m.capacities = {"a": 4, "b": 8}  # its own, once learned, is what counts
    assert m.slot_wait("b") == 0.0
    m.capacities = {}  # nothing learned anywhere: no slot wait, as before
    assert m.slot_wait("b") == 0.0


def test_a_worker_seen_running_more_than_the_learned_ones_is_not_assumed_their_size() -> None:
    """In a fleet of unequal engines the one learned first may be the smallest (it
    queues first). A worker seen running more than it with nothing waiting is larger:
    taken for the small one's size, it was priced as full (slot wait, the largest
    stretch) while it had slots free, and the small worker drew the requests it should
    have shed. Its capacity is unknown until it queues in turn."""
    m = LoadModel()
    m.capacities = {"small": 4}
    for _ in range(6):
        m.reserve("big", 10, 100, now=0.0)
    assert m.slot_wait("big") > 0  # taken for the small one's size: 6 in flight, 4 slots
    m.capacity_floors = {"big": 6}  # an engine reading: 6 running, none waiting
    assert m.slot_wait("big") == 0.0
    assert m.stretch("big") == 1.0
    pred = m.predict(["small", "big"], 10, {})
    assert pred.stretch["big"] == 1.0 and pred.ttft["big"] == m.ttft("big", 10)
    m.capacity_floors = {"big": 4}  # no more than the learned one ran: alike, as before
    assert m.slot_wait("big") > 0
    m.capacity_floors = {"big": 6}
    m.capacities = {"small": 4, "big": 8}  # learned at last: its own counts
    assert m.stretch("big") == pytest.approx(8 / 2)


def test_once_a_worker_outgrows_the_learned_size_no_unlearned_worker_is_assumed_it() -> None:
    """Two large workers, neither seen queueing, and a small one whose capacity (4) was
    learned first. Both large ones run 3; one of them was once seen running 5 with
    nothing waiting, so the fleet is not alike. Were only that one unstretched, the
    other (assumed 4 slots, 3 taken: stretched 4x) would price four times as high for
    the same predicted time, and the one seen larger would draw every request until its
    queue was four times as long. Neither large one's capacity is known: both unstretched,
    alike. The small one keeps its own."""
    m = LoadModel()
    m.capacities = {"small": 4}
    for w in ("seen", "unseen", "small"):
        for _ in range(3):
            m.reserve(w, 10, 100, now=0.0)
    assert m.stretch("unseen") == pytest.approx(4.0)  # assumed the small one's size
    m.capacity_floors = {"seen": 5, "small": 3, "unseen": 3}
    pred = m.predict(["seen", "unseen", "small"], 10, {})
    assert pred.stretch["seen"] == pred.stretch["unseen"] == 1.0
    assert pred.price["seen"] == pytest.approx(pred.price["unseen"])
    assert pred.stretch["small"] == pytest.approx(4.0)
    assert m.slot_wait("unseen") == 0.0
    m.capacities = {"small": 4, "seen": 8}  # the larger one queued: its size is typical
    assert m.stretch("unseen") == pytest.approx(8 / 5)


def synthetic_worker(m: LoadModel, worker: str, tps: float, overhead: float, n: int) -> None:
    """Requests one at a time on a worker with TTFT = overhead + tokens / tps, a tenth
    of them delayed by a second (a stall the estimator must shrug off)."""
    rng = random.Random(1)
    t = 0.0
    for i in range(n):
        tokens = rng.randint(100, 8000)
        ticket = m.reserve(worker, tokens, 10, now=t)
        ttft = overhead + tokens / tps + (1.0 if i % 10 == 3 else 0.0)
        ticket.first_byte(t + ttft)
        ticket.end(t + ttft + 0.2, output_tokens=11)
        t += 5.0


def test_a_whole_answer_teaches_no_decode_speed() -> None:
    """A non-streamed answer's first byte comes with its last token: the time from it
    to the end is the body's read, not a decode (it taught microseconds per token)."""
    m = LoadModel()
    prior = m.snapshot("w")["decode_ms_per_token"]
    for i in range(5):
        whole = m.reserve("w", 100, 200, now=float(i))
        whole.first_byte(i + 4.0, learn=False)
        whole.end(i + 4.001, output_tokens=200)
    assert m.snapshot("w")["decode_ms_per_token"] == prior
    assert m.workers["w"].decode_s.samples == 0
    for i in range(5):
        streamed = m.reserve("w", 100, 200, now=10.0 + i)
        streamed.first_byte(10.1 + i)
        streamed.end(10.1 + i + 199 * 0.03, output_tokens=200)
    assert m.snapshot("w")["decode_ms_per_token"] == pytest.approx(30.0)


def test_learned_prefill_speed_converges_on_a_synthetic_worker() -> None:
    m = LoadModel()
    synthetic_worker(m, "w", tps=4000.0, overhead=0.05, n=60)
    snap = m.snapshot("w")
    assert snap["prefill_tokens_per_s"] == pytest.approx(4000.0, rel=0.02)
    assert snap["prefill_overhead_ms"] == pytest.approx(50.0, rel=0.05)
    assert snap["decode_ms_per_token"] == pytest.approx(20.0, rel=0.01)
    assert m.ttft("w", 2000) == pytest.approx(0.05 + 0.5, rel=0.03)


def test_a_heterogeneous_fleet_is_told_apart() -> None:
    m = LoadModel()
    synthetic_worker(m, "fast", tps=20_000.0, overhead=0.01, n=40)
    synthetic_worker(m, "slow", tps=10_000.0, overhead=0.01, n=40)
    fast, slow = m.prefill_rate("fast"), m.prefill_rate("slow")
    assert fast == pytest.approx(20_000, rel=0.03)
    assert slow == pytest.approx(10_000, rel=0.03)
    assert m.ttft("slow", 10_000) > 1.8 * m.ttft("fast", 10_000)


def test_before_enough_samples_the_prior_holds_and_memory_is_bounded() -> None:
    line = ResistantLine(1 / 15_000, window=8)
    line.observe(1100, 0.5)
    assert line.slope == 1 / 15_000
    for i in range(100):
        line.observe(1100 + i, 0.5)
    assert line.samples == 8  # per size class
    # Samples of one size cannot split slope from intercept: the prior line is scaled.
    assert line.intercept + 1195 * line.slope == pytest.approx(0.5, rel=0.01)
    line.observe(3000, 1.0)
    line.observe(300, 0.2)
    assert line.samples == 10
    assert line.intercept + 3000 * line.slope == pytest.approx(1.0, rel=0.2)


def test_prefill_is_learned_from_its_own_prefill_not_the_queue_ahead() -> None:
    """A request queued behind ours gives a sample from the first byte ahead of it to
    its own (1 s), not its whole wait (2 s); one queued behind a full batch gives none."""
    m = LoadModel()
    first = m.reserve("w", 5000, 10, now=0.0)
    second = m.reserve("w", 5000, 10, now=0.0)  # queued behind the first
    assert first.alone and not second.alone
    first.first_byte(1.0)
    second.first_byte(2.0)
    assert (first.sample, second.sample) == (1.0, 1.0)
    first.end(3.0)
    second.end(3.0)
    assert m.workers["w"].prefill.samples == 2
    m.fixed_capacity = 1
    blocked = [m.reserve("v", 5000, 10, now=0.0), m.reserve("v", 5000, 10, now=0.0)]
    blocked[0].first_byte(1.0)
    blocked[1].first_byte(7.0)  # waited for the slot too
    assert blocked[1].sample is None


def test_a_worker_not_yet_measured_is_assumed_as_fast_as_the_fleet_not_the_prior() -> None:
    """The prior (15,000 tokens/s) is 5x too fast for these workers: a worker still on it
    would look idle however long its queue, draw every request and, always busy, never
    give a sample to correct itself."""
    m = LoadModel()
    synthetic_worker(m, "a", tps=3000.0, overhead=0.005, n=12)
    synthetic_worker(m, "b", tps=3000.0, overhead=0.005, n=12)
    m.add_worker("new")
    assert m.prefill_rate("new") == pytest.approx(3000, rel=0.03)
    assert m.ttft("new", 3000) == pytest.approx(m.ttft("a", 3000), rel=0.03)
    assert m.snapshot("new")["prefill_samples"] == 0
    alone = LoadModel()
    alone.add_worker("new")
    assert alone.prefill_rate("new") == PRIOR_PREFILL_TPS


def test_the_fleet_line_is_of_the_workers_present() -> None:
    """A worker that left no longer counts in the line assumed for an unmeasured one,
    even when the line was read (and kept) before it left."""
    m = LoadModel()
    synthetic_worker(m, "fast", tps=9000.0, overhead=0.005, n=12)
    synthetic_worker(m, "slow", tps=1000.0, overhead=0.005, n=12)
    m.add_worker("new")
    both = m.prefill_rate("new")
    assert 1000 * 1.03 < both < 9000 / 1.03
    m.remove_worker("fast")
    assert m.prefill_rate("new") == pytest.approx(1000, rel=0.03)
    assert m.fleet_line == m.workers["slow"].prefill.learned


def test_a_known_line_stands_for_a_worker_until_it_learns_its_own() -> None:
    """``know`` (the simulator's known speeds): the worker's line from outside is used
    in place of the fleet's, by ``predict`` as by ``ttft``, until the worker has samples
    of its own."""
    m = LoadModel()
    synthetic_worker(m, "a", tps=3000.0, overhead=0.005, n=12)
    m.know("slow", 0.005, 1500.0)
    m.add_worker("other")
    assert m.prefill_rate("slow") == pytest.approx(1500.0)
    assert m.prefill_rate("other") == pytest.approx(3000.0, rel=0.03)  # the fleet's
    pred = m.predict(["slow", "other"], 3000, {})
    assert pred.own["slow"] == pytest.approx(0.005 + 3000 / 1500.0)
    assert pred.ttft["slow"] == pytest.approx(m.ttft("slow", 3000))
    synthetic_worker(m, "slow", tps=6000.0, overhead=0.005, n=12)
    assert m.prefill_rate("slow") == pytest.approx(6000.0, rel=0.03)  # its own now


def test_prefill_is_learned_from_what_the_engine_reports_it_had_cached() -> None:
    """The index predicted all but 100 tokens cached but the engine had evicted them:
    the samples count the tokens really prefilled, so the worker is not seen as slow."""
    m = LoadModel()
    for i in range(12):
        real = 2000 + 500 * i
        t = m.reserve("w", 100, 10, now=10.0 * i)
        t.first_byte(10.0 * i + real / 10_000)
        t.reported_uncached = real
        t.end(10.0 * i + 1)
    assert m.prefill_rate("w") == pytest.approx(10_000, rel=0.01)


def reuse(m: LoadModel, worker: str, n: int, predicted: int, real: int, at: float) -> None:
    """One request of ``n`` tokens whose engine reported ``real`` cached tokens where the
    index predicted ``predicted``."""
    t = m.reserve(worker, n - predicted, 10, now=at, matched=predicted)
    t.reported_uncached = n - real
    t.end(at + 1.0)


def test_index_trust_is_not_worn_down_by_short_matches_no_engine_caches() -> None:
    """Most prompts share a few leading tokens with something routed before (a template's
    opening, a common first word); the index reports them matched, but an engine caches
    whole blocks (here 16 tokens), so it reports none of them cached. They say nothing
    about the index: the long matches it predicted were all there."""
    m = LoadModel()
    for i in range(200):
        if i % 8 == 0:  # a real hit: 12,000 tokens predicted, 749 blocks of 16 cached
            reuse(m, "w", 12_500, 12_000, 11_984, at=float(i))
        elif i % 8 == 4:  # 9,000 predicted, 562 blocks
            reuse(m, "w", 9_500, 9_000, 8_992, at=float(i))
        else:  # a miss that happened to share its first 3 tokens
            reuse(m, "w", 8_000, 3, 0, at=float(i))
    assert m.workers["w"].trust > 0.99
    assert m.workers["w"].grain == 16
    assert m.own_prefill("w", 500, 12_000) == pytest.approx(m.own_prefill("w", 500), rel=0.05)
    # A worker that has reported nothing yet is checked in the fleet's unit.
    for i in range(50):
        reuse(m, "new", 8_000, 10, 0, at=300.0 + i)
    assert m.workers["new"].trust == 1.0


def test_index_trust_falls_where_long_predicted_matches_were_evicted() -> None:
    m = LoadModel()
    for i in range(60):
        reuse(m, "w", 12_500, 12_000, 0, at=float(i))  # the engine had evicted them
    assert m.workers["w"].trust < 0.1
    assert m.own_prefill("w", 500, 12_000) > 0.9 * m.own_prefill("w", 12_500)
    for i in range(60, 120):  # and recovers once the matches are real again
        reuse(m, "w", 12_500, 12_000, 11_984, at=float(i))
    assert m.workers["w"].trust > 0.9
    # Half of a 4,000-token match evicted: trust goes to one half.
    for i in range(120, 300):
        reuse(m, "w", 4_500, 4_000, 2_000, at=float(i))
    assert m.workers["w"].trust == pytest.approx(0.5, abs=0.01)


def test_max_tokens_of_request_bodies() -> None:
    assert max_tokens_of({"max_tokens": 40}) == 40
    assert max_tokens_of({"max_completion_tokens": 7, "max_tokens": 40}) == 7
    assert max_tokens_of({"sampling_params": {"max_new_tokens": 9}}) == 9
    assert max_tokens_of({"max_tokens": True}) is None
    assert max_tokens_of({"max_tokens": -3}) is None
    assert max_tokens_of({}) is None
    m = LoadModel()
    assert m.expected_output(None) == 256  # the prior mean
    for _ in range(200):
        m.observe_output(50)
    assert m.expected_output(None) == pytest.approx(50, abs=1)


def test_a_request_overtaken_by_a_later_one_gives_no_queued_sample() -> None:
    """An engine that interleaves prefills lets a short later prompt out first: the time
    from its first byte to the earlier one's is not the earlier one's own prefill."""
    m = LoadModel()
    first = m.reserve("w", 5000, 10, now=0.0)
    second = m.reserve("w", 8000, 10, now=0.0)
    third = m.reserve("w", 100, 10, now=0.1)
    first.first_byte(0.5)
    third.first_byte(0.6)  # overtook the second
    second.first_byte(1.5)
    assert second.sample is None
    assert third.sample is None  # not the oldest waiting when it came back


WORKERS = ("a", "b", "c", "d")
_op = st.one_of(
    st.tuples(
        st.just("reserve"),
        st.sampled_from(WORKERS),
        st.integers(0, 50_000),
        st.integers(0, 20_000),
        st.integers(1, 500),
    ),
    st.tuples(st.just("first_byte"), st.integers(0, 63), st.floats(0.001, 5.0)),
    st.tuples(st.just("end"), st.integers(0, 63), st.floats(0.001, 5.0), st.integers(0, 400)),
    st.tuples(
        st.just("engine"),
        st.sampled_from(WORKERS),
        st.integers(0, 12),
        st.integers(0, 12),
        st.one_of(st.none(), st.floats(0.0, 1.0)),
    ),
    st.tuples(st.just("remove"), st.sampled_from(WORKERS)),
)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(_op, max_size=60),
    fixed=st.one_of(st.none(), st.integers(1, 6)),
    capacities=st.dictionaries(st.sampled_from(WORKERS), st.integers(0, 6)),
    others=st.dictionaries(st.sampled_from(WORKERS), st.integers(0, 5)),
    peer=st.dictionaries(st.sampled_from(WORKERS), st.integers(0, 5)),
    shared=st.booleans(),
    tokens=st.integers(0, 60_000),
    matches=st.dictionaries(st.sampled_from((*WORKERS, "new")), st.integers(0, 60_000)),
)
def test_predictions_per_decision_are_the_per_worker_calls_exactly(
    ops: list[tuple[Any, ...]],
    fixed: int | None,
    capacities: dict[str, int],
    others: dict[str, int],
    peer: dict[str, int],
    shared: bool,
    tokens: int,
    matches: dict[str, int],
) -> None:
    """``LoadModel.predict`` (what cache_aware computes once per decision) gives, bit
    for bit, what ``ttft``, ``own_prefill`` and ``cost`` give worker by worker, over
    model states built from random reservations, first bytes, ends (learning speed,
    output length and trust), engine readings and workers removed, and for a worker it
    never saw; ``predict`` takes its shortcut for idle workers, the per-worker calls
    never do."""
    m = LoadModel()
    m.fixed_capacity, m.capacities, m.others, m.peer = fixed, capacities, others, peer
    if shared:
        m.peer_pending = {w: n % 3 for w, n in peer.items()}
        m.peer_prefill = {w: 1000 * n for w, n in peer.items()}
    tickets = []
    now = 0.0
    for op in ops:
        now += 0.01
        if op[0] == "reserve":
            _, w, uncached, matched, out = op
            tickets.append(m.reserve(w, uncached, out, now, matched))
        elif op[0] == "first_byte" and tickets:
            tickets[op[1] % len(tickets)].first_byte(now + op[2])
        elif op[0] == "end" and tickets:
            t = tickets[op[1] % len(tickets)]
            t.reported_uncached = op[3] * 10
            t.end(now + op[2], output_tokens=op[3])
        elif op[0] == "engine":
            m.observe_engine(op[1], op[2], op[3], op[4])
        elif op[0] == "remove":
            m.remove_worker(op[1])
    workers = (*WORKERS, "new")
    pred = m.predict(workers, tokens, matches)
    behind = m.queued_per_worker(workers)
    queued = [len(m.workers[w].pending) if w in m.workers else 0 for w in workers]
    if shared:
        theirs = m.peer_pending or {}
        queued = [n + theirs.get(w, 0) for n, w in zip(queued, workers, strict=True)]
    assert behind == sum(queued) / len(workers)
    # The fleet line, computed when read: the median of the lines learned by the
    # workers present (a removed worker's no longer counts).
    lines = [s.prefill.learned for s in m.workers.values() if s.prefill.learned is not None]
    assert m.fleet_line == (
        (median(p[0] for p in lines), median(p[1] for p in lines)) if lines else None
    )
    for w in workers:
        held = matches.get(w, 0)
        assert pred.ttft[w] == m.ttft(w, tokens - held, held)
        assert pred.own[w] == m.own_prefill(w, tokens - held, held)
        assert pred.stretch[w] == m.stretch(w)
        assert pred.price[w] == pred.ttft[w] * m.stretch(w)
        assert pred.cost(w, behind) == m.cost(w, tokens, held, behind)
    for s in m.workers.values():
        assert s.prefill.samples == sum(n for _, n in s.prefill.class_counts())


@settings(max_examples=300, deadline=None)
@given(
    outs=st.lists(st.integers(1, 2000), min_size=1, max_size=12),
    started=st.data(),
    waiting=st.integers(0, 14),
    others=st.integers(0, 6),
    cap=st.integers(1, 16),
    now=st.floats(0.0, 50.0),
)
def test_slot_wait_is_the_queue_s_end_among_the_running(
    outs: list[int], started: Any, waiting: int, others: int, cap: int, now: float
) -> None:
    """Against a plain reading of the rule: the running requests' expected ends (ours
    decoding; the unknown ones spread over a mean decode; ours in prefill a whole
    decode away), sorted; a request queued j deep waits for the j-th."""
    m = LoadModel()
    m.clock = lambda: now
    m.fixed_capacity = cap
    firsts = [started.draw(st.one_of(st.none(), st.floats(0.0, 50.0))) for _ in outs]
    decoding = []
    for out, first in zip(outs, firsts, strict=True):
        t = m.reserve("w", 10, out, now=0.0)
        if first is not None and first <= now:
            t.first_byte(first)
            decoding.append((first, out))
    for _ in range(waiting):
        m.reserve("w", 10, 100, now=0.0)
    m.others = {"w": others}
    st_ = m.workers["w"]
    n = st_.requests + others
    if n < cap:
        assert m.slot_wait("w") == 0.0
        return
    d = st_.decode_s.value
    whole = st_.decode_tokens / st_.requests * d
    j = n - cap
    spread = (j + 1) / (cap + 1) * whole
    ends = [max(d, f + (out - 1) * d - now) for f, out in decoding]
    ends += [(b + 1) / (others + 1) * whole for b in range(others)]
    ends += [whole] * max(0, cap - len(decoding) - others)
    ends.sort()
    if not decoding or j >= cap:
        expected = spread
    elif j < len(ends):
        expected = ends[j]
    else:
        expected = max(ends[-1], spread)
    assert m.slot_wait("w") == pytest.approx(expected)
