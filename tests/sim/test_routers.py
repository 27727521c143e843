"""What approximate routing cannot see, in the fleet simulator (kvroute.sim.routers):
router replicas, traffic that bypasses the router, engine restarts."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import pytest

from kvroute._native import PrefixIndex
from kvroute.cli import main
from kvroute.routing.policies import create_policy
from kvroute.routing.policies.base import Decision, Policy, RouteRequest
from kvroute.sim.cost import CostModel
from kvroute.sim.fleet import FleetConfig, Prepared, prepare, simulate, worker_names
from kvroute.sim.report import ResultRow
from kvroute.sim.routers import InstantEvents, RouterTier, bypass_plan
from kvroute.sim.workloads import Request

COST = CostModel(
    max_batch=8,
    prefill_tokens_per_s=10_000,
    overhead_s=0.0,
    decode_s_per_token=0.01,
    decode_batch_slowdown=0.0,
)


def prompt(seed: int, n: int = 512) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.uint32)


def one_prompt_twice(gap_s: float, output_len: int = 4) -> list[Request]:
    """The same prompt at 0 and at ``gap_s`` (the first long done by then)."""
    p = prompt(7)
    return [Request(0.0, p, output_len, 0), Request(gap_s, p.copy(), output_len, 0)]


def cache_aware(index: PrefixIndex) -> Policy:
    return create_policy("cache_aware", index)


def test_replicas_each_keep_their_own_index_and_loads() -> None:
    names = worker_names(4)
    tier = RouterTier(cache_aware, names, replicas=2)
    tokens = RouteRequest(tokens=prompt(1).tolist())
    first = tier.route(0, tokens)  # replica 0
    second = tier.route(1, tokens)  # replica 1: has never seen this prefix
    a, b = tier.policies
    assert a.index.match(tokens.tokens) == {first: 512}  # type: ignore[attr-defined]
    assert b.index.match(tokens.tokens) == {second: 512}  # type: ignore[attr-defined]
    assert tier.loads[0] == {w: int(w == first) for w in names}
    assert tier.loads[1] == {w: int(w == second) for w in names}
    assert tier.route(2, tokens) == first  # replica 0 again: its own cache hit
    tier.done(0)
    tier.done(1)
    tier.done(2)
    assert tier.in_flight() == 0
    tier.done(2)  # idempotent
    assert tier.in_flight() == 0


def test_replicas_in_precise_mode_share_the_engines_events() -> None:
    names = worker_names(4)
    events = InstantEvents(names)
    caches = [events.cache(w, 100_000, 16) for w in names]
    tier = RouterTier(cache_aware, names, replicas=3, events=events)
    tokens = prompt(2)
    caches[3].admit(tokens.tolist())  # worker 3 caches it; no replica routed it
    for r in range(3):  # every replica in turn finds it there
        assert tier.route(r, RouteRequest(tokens=tokens.tolist())) == names[3]


def test_replicas_in_the_fleet() -> None:
    reqs = [Request(0.01 * i, prompt(i % 4), 8, i % 4) for i in range(64)]
    prep = prepare(reqs, 16)
    calls: list[int] = []

    class Counting(Policy):
        name = "counting"

        def __init__(self) -> None:
            self.me = len(calls)
            calls.append(0)

        def select(self, request: RouteRequest, loads: Mapping[str, int]) -> Decision:
            calls[self.me] += 1
            assert sum(loads.values()) <= calls[self.me]  # only this replica's requests
            return Decision(min(loads, key=lambda w: (loads[w], w)), "least_load")

    row = simulate(prep, lambda index: Counting(), FleetConfig(workers=2, router_replicas=3))
    assert calls == [22, 21, 21]  # dealt in turn
    assert row.extra["final_inflight"] == 0 and row.requests == 64
    # Each replica balances only its own requests: both land on the first worker first.
    one = simulate(prep, "cache_aware", FleetConfig(workers=4, cost=COST))
    three = simulate(prep, "cache_aware", FleetConfig(workers=4, cost=COST, router_replicas=3))
    assert three.extra["router_replicas"] == 3
    assert three.hit_rate < one.hit_rate  # each replica places the 4 prefixes anew


def test_bypass_plan() -> None:
    plan = bypass_plan(10_000, 0.2, 4, seed=3)
    assert plan == bypass_plan(10_000, 0.2, 4, seed=3)  # the same for every policy
    bypassed = [w for w in plan if w >= 0]
    assert len(bypassed) == pytest.approx(2000, rel=0.1)
    assert set(bypassed) == {0, 1, 2, 3}
    assert bypass_plan(5, 0.0, 4, seed=0) == [-1] * 5
    assert all(w >= 0 for w in bypass_plan(50, 1.0, 4, seed=0))
    with pytest.raises(ValueError):
        bypass_plan(5, 1.5, 4, seed=0)


def test_bypass_is_unseen_by_the_router_but_seen_by_events() -> None:
    # A seed whose plan sends request 0 straight to worker 3 and routes request 1.
    seed = next(s for s in range(1000) if bypass_plan(2, 0.5, 4, s)[:2] == [3, -1])
    reqs = one_prompt_twice(gap_s=100.0)
    prep = prepare(reqs, 16)
    cfg = FleetConfig(workers=4, cost=COST, bypass_fraction=0.5, seed=seed)
    approx = simulate(prep, "cache_aware", cfg, record=True)
    precise = simulate(prep, "cache_aware+events", cfg, record=True)
    assert approx.extra["bypassed"] == precise.extra["bypassed"] == 1
    assert approx.extra["assigned"][0] == precise.extra["assigned"][0] == 3
    # The router never saw request 0: approximate mode picks by load (not worker 3).
    assert approx.extra["assigned"][1] != 3 and approx.extra["cached"][1] == 0
    # Precise mode saw worker 3 store the prompt.
    assert precise.extra["assigned"][1] == 3 and precise.extra["cached"][1] == 496


def test_bypass_takes_no_router_load() -> None:
    reqs = [Request(0.0, prompt(i), 50, i) for i in range(40)]
    cfg = FleetConfig(workers=4, cost=COST, bypass_fraction=1.0)
    row = simulate(prepare(reqs, 16), "round_robin", cfg)
    assert row.extra["bypassed"] == 40 and row.requests == 40
    assert row.extra["final_inflight"] == 0 and row.decision_us == 0.0


@pytest.mark.parametrize("policy", ["cache_aware", "cache_aware+events"])
def test_restart_loses_the_cache(policy: str) -> None:
    reqs = one_prompt_twice(gap_s=100.0)
    prep = prepare(reqs, 16)
    kept = simulate(prep, policy, FleetConfig(workers=1, cost=COST), record=True)
    assert kept.extra["cached"] == [0, 496] and kept.extra["restarts"] == 0
    cold, hit = kept.extra["ttft"]
    assert hit < cold and max(cold, hit) == pytest.approx(kept.ttft_p99, rel=0.02)
    lost = simulate(
        prep, policy, FleetConfig(workers=1, cost=COST, restart_every_s=50.0), record=True
    )
    assert lost.extra["cached"] == [0, 0] and lost.extra["restarts"] == 2


def test_restart_mid_request_and_precise_sees_it() -> None:
    # Both workers restart in turn while request 0 decodes (its output blocks are then
    # not cached) and before request 1: precise mode knows its worker is empty, so the
    # prompt goes by load; approximate mode still predicts it there (a miss either way).
    reqs = one_prompt_twice(gap_s=100.0, output_len=400)
    prep = prepare(reqs, 16)
    cfg = FleetConfig(workers=2, cost=COST, restart_every_s=2.0)
    rows = {p: simulate(prep, p, cfg, record=True) for p in ("cache_aware", "cache_aware+events")}
    for row in rows.values():
        assert row.requests == 2 and row.extra["final_running"] == 0
        assert row.extra["restarts"] >= 2 and row.extra["cached"][1] == 0
    first, second = rows["cache_aware"].extra["assigned"]
    assert second == first
    first, second = rows["cache_aware+events"].extra["assigned"]
    assert second != first
    cfg.restart_every_s = None  # control: without the restart precise mode goes back
    first, second = simulate(prep, "cache_aware+events", cfg, record=True).extra["assigned"]
    assert second == first


def test_simulate_cli_divergence_flags(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", "--workload", "gsp", "--workers", "4", "--groups", "4"]
    base += ["--prompts-per-group", "4", "--system-len", "256", "--question-len", "16"]
    base += ["--output-len", "8", "--policies", "cache_aware,cache_aware+events", "--json"]
    flags = ["--router-replicas", "2", "--bypass-fraction", "0.25", "--restart-every", "0.5"]
    assert main(base + flags) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["router_replicas"] == 2 and doc["bypass_fraction"] == 0.25
    for row in doc["rows"]:
        assert row["extra"]["router_replicas"] == 2 and row["extra"]["bypassed"] > 0
    for bad in (["--router-replicas", "0"], ["--bypass-fraction", "2"], ["--restart-every", "0"]):
        assert main(base + bad) == 2


def test_guard_counts_what_the_engine_holds_beyond_this_router() -> None:
    """cache_aware's guard adds ``others`` (the engine's running + waiting beyond this
    router's own requests) to a holder's load."""
    index = PrefixIndex(None)
    pol = create_policy("cache_aware", index, worker_capacity=2, load_metric="requests")
    tokens = prompt(3).tolist()
    index.insert("a", tokens)
    loads = {"a": 1, "b": 0}
    assert pol.select(RouteRequest(tokens=tokens), loads).worker == "a"
    pol.others = {"a": 1}  # type: ignore[attr-defined]  # another replica's request
    d = pol.select(RouteRequest(tokens=tokens), loads)
    assert (d.worker, d.reason) == ("b", "overflow")


def test_replicas_guard_a_holder_the_engine_reports_full() -> None:
    """Two replicas each with one request on the holder of a prefix (capacity 2): each
    sees the holder at half its capacity until an engine poll shows both."""
    names = worker_names(2)
    make = lambda index: create_policy(  # noqa: E731
        "cache_aware", index, worker_capacity=2, load_metric="requests"
    )
    tier = RouterTier(make, names, replicas=2)
    tokens = prompt(4).tolist()
    holder, spare = names
    for k, pol in enumerate(tier.policies):
        pol.index.insert(holder, tokens)  # type: ignore[attr-defined]
        tier.loads[k][holder] = 1
    assert tier.policies[0].select(RouteRequest(tokens=tokens), tier.loads[0]).worker == holder
    tier.poll([2, 0])  # the holder's engine runs both replicas' requests
    assert tier.others == [{holder: 1, spare: 0}, {holder: 1, spare: 0}]
    for k in (0, 1):
        d = tier.policies[k].select(RouteRequest(tokens=tokens), tier.loads[k])
        assert (d.worker, d.reason) == (spare, "overflow")


def test_engine_polls_change_nothing_for_a_single_router() -> None:
    """One router, no bypass: an engine holds exactly the router's requests, so the
    guard's load is the same with polls as without."""
    reqs = [Request(0.02 * i, prompt(i % 3), 200, i % 3) for i in range(60)]
    prep = prepare(reqs, 16)

    def run(replicas: int, poll: float | None) -> tuple[list[int], float]:
        cfg = FleetConfig(
            workers=4,
            cost=COST,
            router_replicas=replicas,
            policy_settings={"worker_capacity": 4},
            engine_poll_s=poll,
        )
        row = simulate(prep, "cache_aware", cfg, record=True)
        return row.extra["assigned"], row.ttft_p99  # type: ignore[return-value]

    assert run(1, 0.1) == run(1, None)
    assert run(2, 0.1) != run(2, None)  # with two replicas the polls do change routing


def test_replicas_sharing_a_store_place_prefixes_once() -> None:
    reqs = [Request(0.05 * i, prompt(i % 4), 8, i % 4) for i in range(64)]
    prep = prepare(reqs, 16)
    cfg = FleetConfig(workers=4, cost=COST, router_replicas=3)
    one = simulate(prep, "cache_aware", FleetConfig(workers=4, cost=COST))
    alone = simulate(prep, "cache_aware", cfg)
    shared = simulate(prep, "cache_aware", replace(cfg, state_store_delay_s=0.002))
    assert alone.hit_rate < one.hit_rate
    assert shared.hit_rate == one.hit_rate  # every prefix placed once, found by all
    assert shared.extra["final_inflight"] == 0


def test_a_store_decision_reaches_the_other_replicas_after_its_delay() -> None:
    tier = RouterTier(cache_aware, worker_names(2), replicas=2, store_delay_s=1.0, heartbeat_s=60)
    p = prompt(3)
    first = tier.route(0, RouteRequest(tokens=p), now=0.0)  # replica 0, still running
    tier.route(1, RouteRequest(tokens=prompt(4)), now=0.5)  # replica 1
    assert tier.policies[1].index.match(p) == {}  # type: ignore[attr-defined]
    assert tier.peer[1][first] == 0
    tier.route(2, RouteRequest(tokens=prompt(5)), now=1.0)  # delivered now
    assert tier.policies[1].index.match(p) == {first: 512}  # type: ignore[attr-defined]
    assert tier.peer[1][first] >= 1  # replica 0's request counts on replica 1's loads


def test_replicas_sharing_a_store_hear_when_each_other_s_decodes_end() -> None:
    """A decoding request's expected end reaches the other replicas with its load, the
    store's delay late (as serve reads them, on arrival), and leaves when it ends."""
    tier = RouterTier(cache_aware, worker_names(2), replicas=2, store_delay_s=1.0, heartbeat_s=60)
    w = tier.route(0, RouteRequest(tokens=prompt(3)), now=0.0, output_len=101)  # replica 0
    tier.first_byte(0, 0.1)
    ticket = tier.ticket(0)
    assert ticket is not None and ticket.end_at is not None
    tier.route(1, RouteRequest(tokens=prompt(4)), now=0.5)  # replica 1: not yet heard
    assert tier.work[1].peer_ends == {}
    tier.route(2, RouteRequest(tokens=prompt(5)), now=1.2)  # replica 0 routes; 1 hears
    ((end,),) = tier.work[1].peer_ends[w]
    assert end == pytest.approx(ticket.end_at[0] + 1.0)  # the store's delay late
    tier.done(0, 1.3)
    tier.route(3, RouteRequest(tokens=prompt(6)), now=2.4)
    assert w not in tier.work[1].peer_ends


def test_a_load_change_alone_waits_for_a_later_change_or_the_heartbeat() -> None:
    """As serve's publisher: a first byte or an end waits for company. A decision of the
    same replica writes what waits at once, with its own reservation; so does the first
    change made the linger or more after the oldest waiting; with no change after it,
    the replica's next heartbeat writes it, as of then."""
    tier = RouterTier(
        cache_aware,
        worker_names(2),
        replicas=2,
        store_delay_s=0.1,
        store_linger_s=1.0,
        heartbeat_s=4.0,  # replica 0 beats at 4, 8, ...; replica 1 at 2, 6, ...
    )
    written: list[tuple[float, int, str, tuple[int, int, int]]] = []
    send = tier._send_load

    def recorded(k: int, worker: str, now: float) -> None:
        st = tier.work[k].state(worker)
        written.append((now, k, worker, (st.requests, len(st.pending), st.prefill_tokens)))
        send(k, worker, now)

    tier._send_load = recorded  # type: ignore[method-assign]
    w = tier.route(0, RouteRequest(tokens=prompt(3)), now=0.0, output_len=50)  # replica 0
    assert written == [(0.0, 0, w, (1, 1, 512))]  # with its decision, at once
    tier.first_byte(0, 0.3)  # alone: waits
    v = tier.route(1, RouteRequest(tokens=prompt(4)), now=0.5)  # replica 1 decides
    assert written[1:] == [(0.5, 1, v, (1, 1, 512))]
    tier.first_byte(1, 0.9)  # replica 1's, alone: waits
    tier.done(0, 1.1)  # replica 0: 0.8 after its first byte, not yet the linger
    assert len(written) == 2
    # Replica 0 decides: its first byte and end ride along (absolute values: one
    # record of the worker, with the new request, which went to the idle w again).
    assert tier.route(2, RouteRequest(tokens=prompt(5)), now=1.2) == w
    assert written[2:] == [(1.2, 0, w, (1, 1, 512))]
    n = len(written)
    tier.first_byte(2, 1.5)  # alone
    # At 2.6: replica 1's first byte (0.9, nothing after it) went out with its
    # heartbeat at 2.0; replica 0's end came 1.1 after its first byte: written at once.
    tier.done(2, 2.6)
    assert written[n:] == [(2.0, 1, v, (1, 0, 0)), (2.6, 0, w, (0, 0, 0))]
    tier.done(1, 3.0)
    assert len(written) == n + 2 and tier._dirty[1] == {v}  # the end waits, for beat 6.0
    tier.route(3, RouteRequest(tokens=prompt(6)), now=3.2)  # replica 1: takes it along
    ones = [e for e in written if e[1] == 1]
    assert any(e[2] == v and e[0] == 3.2 and e[3] == (0, 0, 0) for e in ones)
    assert tier._dirty == [set(), set()]


def test_capacity_is_learned_only_at_engine_polls_as_serve_learns_it() -> None:
    """``learn_at_polls``: a worker's capacity (what the saturation guard and the work
    model's slot wait need) is learned only when an engine poll finds it queueing, as
    serve reads /metrics; by default, the moment it queues. A hot prefix in a burst
    between two polls then piles onto its holder."""
    reqs = [Request(0.001 * i, prompt(7), 200, 0) for i in range(12)]
    prep = prepare(reqs, 16)

    def overflows(
        at_polls: bool, poll_s: float, edge_s: float | None = None, metric: str = "requests"
    ) -> int:
        cfg = FleetConfig(
            workers=2,
            cost=CostModel(max_batch=2),
            learn_capacity=True,
            learn_at_polls=at_polls,
            engine_poll_s=poll_s,
            edge_read_gap_s=edge_s,
            policy_settings={"seed": 0, "load_metric": metric},
        )
        return int(simulate(prep, "cache_aware", cfg).extra["decisions"].get("overflow", 0))

    assert overflows(False, 100.0) > 0  # learned when the holder first queued
    assert overflows(True, 100.0) == 0  # no poll during the burst: nothing learned
    assert overflows(True, 0.001) > 0  # a poll finds the holder queueing
    # serve's reading at a worker's high-water mark (kvroute.fleet.health.EdgeReads),
    # for the work model only: SGLang's rule on request counts stays as it was
    assert overflows(True, 100.0, edge_s=0.002) == 0
    assert overflows(True, 100.0, metric="work") == 0
    assert overflows(True, 100.0, edge_s=0.002, metric="work") > 0


def _default_and_rule(prep: Prepared, costs: tuple[CostModel, ...]) -> dict[str, ResultRow]:
    """cache_aware on the work model (the default) and on request counts (SGLang's
    rule), capacities learned, on a fleet of ``costs``: the rows by load metric."""
    row = {}
    for metric in ("work", "requests"):
        cfg = FleetConfig(
            workers=len(costs),
            worker_costs=costs,
            learn_capacity=True,
            policy_settings={"seed": 0, "load_metric": metric},
        )
        row[metric] = simulate(prep, "cache_aware", cfg)
    return row


def test_a_small_worker_learned_first_does_not_make_the_larger_ones_look_full() -> None:
    """One worker of four runs 8 requests at once, the others 32. The small one queues
    first, so its capacity is the first learned, and workers not yet seen queueing are
    assumed to be alike (``LoadModel.typical_capacity``). Were the larger ones taken for
    8-slot workers even after running far more than 8 with nothing waiting, every
    worker would look full; the small one, holding its prefixes, would keep drawing
    their requests and queue them behind its slots (63 of them here), where SGLang's
    rule on request counts sheds them."""
    from kvroute.sim.workloads import gsp

    costs = (CostModel(max_batch=8),) + (CostModel(),) * 3
    prep = prepare(gsp(8, 50, 1000, 64, 150, seed=1, arrivals="poisson", rate=10.0), 16)
    row = _default_and_rule(prep, costs)
    assert row["requests"].extra["slot_queued"][0] <= 5
    assert row["work"].extra["slot_queued"][0] <= 5
    assert row["work"].ttft_p99 <= 1.1 * row["requests"].ttft_p99


def test_one_larger_worker_seen_running_more_does_not_become_a_sink() -> None:
    """Eight workers, two with 8 decode slots and six with 32; multi-turn chat with
    heavy-tailed answers. The small workers queue first (capacity 8 learned), so the
    large ones are assumed 8 and priced up to 8x their predicted time as they fill. One
    of them then runs more than 8 with nothing waiting: it is larger. Unstretched
    alone, it drew every conversation the others could shed, each a cold prefill on its
    growing queue (p99 1.48 s against the rule's 0.36 s). With its capacity and the other large
    workers' taken as unknown alike, the default is within the rule's p99."""
    from kvroute.sim.workloads import multiturn

    reqs = multiturn(32, 10, 500, 400, 400, sigma=0.3, seed=1, arrivals="poisson", rate=8.0)
    rng = np.random.default_rng(1)
    for r in reqs:  # log-normal answers around 400 tokens
        r.output_len = int(min(3200, max(4, rng.lognormal(np.log(400), 1.2))))
    prep = prepare(reqs, 16)
    row = _default_and_rule(prep, (CostModel(max_batch=8),) * 2 + (CostModel(),) * 6)
    assert row["work"].ttft_p99 <= 1.1 * row["requests"].ttft_p99
    assert row["work"].hit_rate >= row["requests"].hit_rate - 0.03


def test_capacities_the_engines_report_keep_larger_workers_from_looking_full() -> None:
    """Sixteen workers, four with 16 decode slots and twelve with 32; multi-turn chat
    with log-normal answers, at a rate where the large ones never run more than 16.
    Learned at the router's polls, the small ones queue first and the large ones, never
    seen running more, are taken for their size: at 15 of an assumed 16 their hits are
    stretched 16x and go cold elsewhere (p99 several times the rule's). Reported by the
    engines from the start (SGLang's /get_server_info, as ``serve`` reads it), each
    worker is its own size."""
    from kvroute.sim.workloads import multiturn

    reqs = multiturn(64, 14, 500, 100, 400, sigma=0.3, seed=1, arrivals="poisson", rate=19.0)
    rng = np.random.default_rng(1)
    for r in reqs:  # log-normal answers around 400 tokens
        r.output_len = int(min(3200, max(4, rng.lognormal(np.log(400), 0.8))))
    prep = prepare(reqs, 16)
    costs = (CostModel(max_batch=16),) * 4 + (CostModel(),) * 12

    def row(reported: bool, metric: str) -> ResultRow:
        cfg = FleetConfig(
            workers=16,
            worker_costs=costs,
            learn_capacity=True,
            learn_at_polls=True,
            capacity_reported=reported,
            policy_settings={"seed": 0, "load_metric": metric},
        )
        return simulate(prep, "cache_aware", cfg)

    learned, reported, rule = row(False, "work"), row(True, "work"), row(True, "requests")
    assert reported.ttft_p99 < 0.5 * learned.ttft_p99
    assert reported.ttft_p99 <= 1.1 * rule.ttft_p99
    assert reported.hit_rate >= learned.hit_rate
    assert reported.extra["decisions"].get("overflow", 0) < learned.extra["decisions"]["overflow"]


def test_the_simulated_routers_work_model_reads_virtual_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The simulator gives every work model its virtual clock: the prefill in progress at
    the head of a queue counts as what is left of it, so on workers that follow the cost
    model (the default one, the model's priors) a queue of cold prompts is predicted to
    the microsecond. Counted half done (no clock), the predictions are off."""
    reqs = [Request(0.02 * i, prompt(100 + i, 1000), 4, i) for i in range(40)]
    prep = prepare(reqs, 16)
    cfg = FleetConfig(workers=1, cost=CostModel())
    row = simulate(prep, "cache_aware", cfg)
    assert row.extra["ttft_mae_s"] < 1e-6

    monkeypatch.setattr(RouterTier, "_clock", None)  # the work models get no clock
    without = simulate(prep, "cache_aware", cfg)
    assert without.extra["ttft_mae_s"] > 0.01


def test_replicas_predict_waits_for_kv_room_in_the_caches_the_engines_report() -> None:
    """Each replica's work model knows the KV capacity its index is budgeted by, as
    serve reads it from the engines; not where the simulated engines never wait for
    room (``FleetConfig.kv_admission`` off), nor without engine budgets."""
    names = worker_names(2)
    tier = RouterTier(cache_aware, names, replicas=2, worker_budgets=[50_000, 30_000])
    for model in tier.work:
        assert dict(model.kv_capacity) == {names[0]: 50_000, names[1]: 30_000}
    never = RouterTier(cache_aware, names, worker_budgets=[50_000] * 2, kv_waits=False)
    assert not never.work[0].kv_capacity
    assert not RouterTier(cache_aware, names).work[0].kv_capacity
    # Through the fleet: a request's prompt is kept in its worker's KV cache while in
    # flight, and released at its end.
    r = simulate(
        prepare([Request(0.0, np.arange(3000, dtype=np.uint32), 8, 0)]),
        "cache_aware",
        FleetConfig(workers=2, capacity_tokens=50_000, policy_settings={"seed": 0}),
    )
    assert r.extra["final_work"] == 0
