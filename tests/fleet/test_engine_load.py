"""Learned worker capacities: parsing engine metrics, the learner, the guard in the
policy and the simulator, and the router learning from a real sim worker."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from kvroute._native import PrefixIndex
from kvroute.config import ConfigError, Settings, parse_worker_capacity
from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server
from kvroute.fleet.engine_load import (
    REPORT_ATTEMPTS,
    CapacityLearner,
    parse_engine_load,
    parse_sglang_capacity,
)
from kvroute.fleet.health import EDGE_READ_GAP_S, EdgeReads
from kvroute.fleet.registry import Registry
from kvroute.routing.policies import RouteRequest, create_policy
from kvroute.sim.cost import CostModel
from kvroute.sim.fleet import FleetConfig, compare
from kvroute.sim.workloads import gsp
from support import metric, start_fake_worker, start_router

VLLM = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0"} 0.5
"""
SGLANG = b'sglang:num_running_reqs{model_name="m"} 8\nsglang:num_queue_reqs{model_name="m"} 0\n'
# SGLang's GET /get_server_info, trimmed to what matters here (the shape of SGLang's
# documented answer: server arguments, then the schedulers' states per data-parallel
# rank, then the version).
SGLANG_SERVER_INFO = (
    b'{"model_path":"Qwen/Qwen3-8B","max_running_requests":null,"dp_size":1,'
    b'"max_total_num_tokens":20480,"internal_states":[{"last_gen_throughput":357.2,'
    b'"memory_usage":{"weight":0.98,"kvcache":0.23,"token_capacity":20480,"graph":0.57},'
    b'"effective_max_running_requests_per_dp":128}],"version":"0.5.4"}'
)


def test_parse_engine_load() -> None:
    assert parse_engine_load(VLLM) == (5, 4)
    assert parse_engine_load(SGLANG) == (8, 0)
    assert parse_engine_load(b"# nothing here\nother_metric 3\n") is None
    assert parse_engine_load(b"vllm:num_requests_running NaN\n") is None
    assert parse_engine_load(b"\xff\xfe garbage") is None


def test_a_request_that_ends_while_its_engine_is_read_is_not_counted_as_someone_else_s() -> None:
    """An engine counts its requests at one moment of a /metrics read. A request of
    ours in flight when the read starts and over when the answer is parsed (an edge read
    starts as a request is routed) may be in that count: it is not the engine's own
    load, which would stay as phantom load until the next reading."""
    from types import SimpleNamespace

    from kvroute.fleet.health import poll_engine_load
    from kvroute.routing.load import LoadModel

    url = "http://127.0.0.1:1"
    worker = SimpleNamespace(in_flight=1)

    def answer(request: httpx.Request) -> httpx.Response:
        worker.in_flight = 0  # our request ends while the engine answers
        return httpx.Response(
            200, text="vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
        )

    async def read(others_running: int) -> int:
        worker.in_flight = 1
        state = SimpleNamespace(
            settings=Settings(worker_urls=[url]).validate(),
            registry=SimpleNamespace(workers={url: worker}, peer_load={}),
            client=httpx.AsyncClient(transport=httpx.MockTransport(answer)),
            capacity=None,
            others={},
            work=LoadModel(),
        )
        if others_running:
            state.client = httpx.AsyncClient(
                transport=httpx.MockTransport(
                    lambda r: httpx.Response(
                        200, text=f"vllm:num_requests_running {1 + others_running}\n"
                    )
                )
            )
        async with state.client:
            await poll_engine_load(state, url)  # type: ignore[arg-type]
        return int(state.others[url])

    assert asyncio.run(read(0)) == 0
    # Requests that are really someone else's still count.
    assert asyncio.run(read(2)) == 2


def test_parse_sglang_capacity() -> None:
    assert parse_sglang_capacity(SGLANG_SERVER_INFO) == 128
    two_ranks = (
        b'{"dp_size":2,"internal_states":[{"effective_max_running_requests_per_dp":64},'
        b'{"effective_max_running_requests_per_dp":64}]}'
    )
    assert parse_sglang_capacity(two_ranks) == 128, "summed over data-parallel ranks"
    # Older versions: no derived value in the states, the server argument when set.
    assert parse_sglang_capacity(b'{"max_running_requests":48,"internal_states":[{}]}') == 48
    assert parse_sglang_capacity(b'{"max_running_requests":48}') == 48
    for unknown in (
        b'{"max_running_requests":null,"internal_states":[{}]}',  # not set, not derived
        b'{"internal_states":[{"effective_max_running_requests_per_dp":true}]}',
        b'{"max_running_requests":0}',
        b'{"max_running_requests":"64"}',
        b'{"detail":"Not Found"}',  # vLLM
        b"[1, 2]",
        b"not json",
    ):
        assert parse_sglang_capacity(unknown) is None, unknown
    # One rank without the value: the sum would be short, so the server argument.
    partial = (
        b'{"max_running_requests":96,"internal_states":'
        b'[{"effective_max_running_requests_per_dp":64},{}]}'
    )
    assert parse_sglang_capacity(partial) == 96


def test_a_reported_capacity_stands_and_is_asked_a_bounded_number_of_times() -> None:
    learner = CapacityLearner()
    asks = 0
    while learner.wants_report("vllm") and asks < 100:
        asks += 1
    assert asks == REPORT_ATTEMPTS, "an engine that never tells is asked a few times only"
    assert learner.wants_report("sglang")
    learner.report("sglang", 32)
    assert not learner.wants_report("sglang")
    assert learner.capacities == {"sglang": 32}
    learner.observe("sglang", 12, 3)  # a queue below it (KV memory short) keeps it
    learner.observe("sglang", 40, 0)
    assert learner.capacities == {"sglang": 32} and learner.floors == {"sglang": 40}
    learner.forget("sglang")  # it may come back configured otherwise: asked again
    learner.forget("vllm")
    assert learner.capacities == {} and learner.reported == {}
    assert learner.wants_report("sglang") and learner.wants_report("vllm")


def test_a_stated_capacity_stands_is_not_asked_and_outlives_a_restart() -> None:
    learner = CapacityLearner({"vllm-a": 32})
    assert learner.capacities == {"vllm-a": 32}
    assert not learner.wants_report("vllm-a"), "the operator said it: the engine is not asked"
    learner.observe("vllm-a", 16, 4)  # queueing below it (KV memory short) keeps it
    learner.observe("vllm-a", 40, 0)
    assert learner.capacities == {"vllm-a": 32} and learner.floors == {"vllm-a": 40}
    learner.forget("vllm-a")  # down and back: still what the operator stated
    assert learner.capacities == {"vllm-a": 32} and learner.floors == {}
    learner.observe("vllm-b", 8, 1)  # the others are learned as before
    assert learner.capacities == {"vllm-a": 32, "vllm-b": 8}


def test_learner_needs_queueing_and_keeps_the_largest() -> None:
    learner = CapacityLearner()
    learner.observe("a", 7, 0)  # not queueing: only a floor (it runs at least 7)
    assert learner.capacities == {} and learner.floors == {"a": 7}
    learner.observe("a", 4, 2)
    learner.observe("a", 3, 5)  # a momentary lower limit does not shrink it
    learner.observe("a", 6, 1)
    assert learner.capacities == {"a": 6}
    learner.observe("a", 5, 0)
    assert learner.capacities == {"a": 6} and learner.floors == {"a": 7}
    learner.observe("a", 7, 0)  # ran 7 with none waiting before it queued at 6: it can
    assert learner.capacities == {"a": 7} and learner.floors == {"a": 7}
    learner.observe("a", 9, 0)
    assert learner.capacities == {"a": 9} and learner.floors == {"a": 9}
    learner.observe("b", 0, 3)  # an engine running nothing teaches nothing
    assert "b" not in learner.capacities and "b" not in learner.floors
    learner.forget("a")
    assert learner.capacities == {} and learner.floors == {}


def test_parse_worker_capacity() -> None:
    assert parse_worker_capacity("auto") == (None, True)
    assert parse_worker_capacity("OFF") == (None, False)
    assert parse_worker_capacity("32") == (32, False)
    for bad in ("0", "-1", "many"):
        with pytest.raises(ConfigError):
            parse_worker_capacity(bad)


def test_worker_max_running_setting() -> None:
    s = Settings(worker_max_running=["HTTP://A:8000/=32", "http://b:8000=16"]).validate()
    assert s.worker_max_running == ["http://a:8000=32", "http://b:8000=16"]
    for bad in (["http://a:8000"], ["http://a:8000=0"], ["http://a:8000=x"], ["=4"]):
        with pytest.raises(ConfigError, match="URL=N"):
            Settings(worker_max_running=bad).validate()
    with pytest.raises(ConfigError, match="scheme"):
        Settings(worker_max_running=["ftp://a:1=4"]).validate()
    for fixed, learn in ((8, False), (None, False)):  # --worker-capacity 8 / off
        with pytest.raises(ConfigError, match="--worker-capacity auto"):
            Settings(
                worker_max_running=["http://a:8000=32"],
                worker_capacity=fixed,
                learn_capacity=learn,
            ).validate()


def test_guard_uses_learned_capacities_per_worker() -> None:
    policy = create_policy("cache_aware", PrefixIndex(), load_metric="requests")
    for w in ("a", "b", "c"):
        policy.on_worker_added(w)
    prompt = RouteRequest(tokens=list(range(100)))
    loads = {"a": 0, "b": 0, "c": 0}
    holder = policy.select(prompt, loads).worker
    loads[holder] = 3
    # Unknown capacity: the holder is never passed over (SGLang's rule).
    assert policy.select(prompt, loads).worker == holder
    policy.capacities = {holder: 3}  # type: ignore[attr-defined]
    d = policy.select(prompt, loads)
    assert d.worker != holder and d.reason == "overflow"
    loads = dict.fromkeys(loads, 3)  # everyone full: the rule applies unchanged
    policy.capacities = dict.fromkeys(loads, 3)  # type: ignore[attr-defined]
    assert policy.select(prompt, loads).reason == "cache_hit"


def test_simulated_hot_spots_go_away_when_capacity_is_learned() -> None:
    # Two popular prefixes, each arriving faster than one worker's batch of 8 can take,
    # on a fleet with room to spare (4 x 8 slots).
    reqs = gsp(2, 96, 1024, 64, 64, seed=3, arrivals="poisson", rate=16.0)
    rows = {}
    for learn in (False, True):
        cfg = FleetConfig(workers=4, cost=CostModel(max_batch=8), learn_capacity=learn)
        (row, rr), _ = compare(reqs, ["cache_aware", "round_robin"], cfg)
        rows[learn] = row
    off, auto = rows[False], rows[True]
    assert auto.ttft_p99 < 0.5 * off.ttft_p99
    assert auto.hit_rate >= rr.hit_rate
    assert auto.max_load / auto.mean_load < off.max_load / off.mean_load


def _sim_worker(tmp_path: Path, max_batch: int = 2, *, reports: bool = False) -> Server:
    """A sim worker running ``max_batch`` requests at once; ``reports``: its
    /get_server_info tells that number (as SGLang's), else not (as vLLM's)."""
    port = free_port()
    argv = kvroute_argv(
        "sim-worker",
        "--port",
        str(port),
        "--max-batch",
        str(max_batch),
        "--decode-ms-per-token",
        "100",
        *(() if reports else ("--hide-max-running",)),
    )
    return start_server(f"sim-{port}", argv, port, log_dir=str(tmp_path))


async def _learned_capacities(
    c: httpx.AsyncClient, within_s: float, every_s: float
) -> dict[str, object]:
    """The capacities ``/workers`` shows once any is learned (polled every ``every_s``,
    at most ``within_s``); empty if none was."""
    learned: dict[str, object] = {}
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not learned:
        await asyncio.sleep(every_s)
        rows = (await c.get("/workers")).json()
        learned = {w["url"]: w["capacity"] for w in rows if w["capacity"]}
    return learned


def test_router_learns_capacity_and_overflows(tmp_path: Path, processes: list[Server]) -> None:
    workers = [_sim_worker(tmp_path) for _ in range(2)]
    processes.extend(workers)
    router = start_router([w.url for w in workers], tmp_path)
    processes.append(router)
    body = {"model": "sim", "prompt": list(range(1, 257)), "max_tokens": 30}

    async def run() -> tuple[list[str], dict[str, object]]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            holders = asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(4)))
            # The holder runs 2 and queues 2: the next health round reads that.
            learned = await _learned_capacities(c, 10, 0.1)
            late = await c.post("/v1/completions", json=body)
            first = await holders
        return [r.headers["x-kvroute-worker"] for r in first] + [
            late.headers["x-kvroute-worker"]
        ], learned

    chosen, learned = asyncio.run(run())
    holder = chosen[0]
    assert chosen[:4] == [holder] * 4, "a shared prefix sticks to its holder"
    assert learned == {holder: 2}, "capacity learned from the engine's running/waiting"
    assert chosen[4] != holder, "the full holder is passed over"
    metrics = httpx.get(router.url + "/metrics").text
    assert f'kvroute_worker_capacity{{worker="{holder}"}} 2.0' in metrics
    assert 'reason="overflow"' in metrics
    workers_json = httpx.get(router.url + "/workers").json()
    assert all(w["in_flight"] == 0 for w in workers_json)
    # Engine readings with nothing waiting: at most the 2 it can run, or none seen yet.
    assert all(w["capacity_floor"] in (None, 1, 2) for w in workers_json)


def test_router_reads_the_capacity_each_engine_reports_before_any_request(
    tmp_path: Path, processes: list[Server]
) -> None:
    """Engines that tell how many requests they run at once (SGLang's /get_server_info)
    have that capacity from the start, each its own; one that does not (vLLM) has none
    until it is seen queueing, unless the operator states it (--worker-max-running).
    The guard passes over a full holder at once: nothing had to queue first."""
    small, large = _sim_worker(tmp_path, 2, reports=True), _sim_worker(tmp_path, 3, reports=True)
    silent, stated = _sim_worker(tmp_path, 2), _sim_worker(tmp_path, 2)
    processes.extend((small, large, silent, stated))
    router = start_router(
        [small.url, large.url, silent.url, stated.url],
        tmp_path,
        "--worker-max-running",
        f"{stated.url}/=2",  # as the operator writes it: normalized
    )
    processes.append(router)
    rows = {w["url"]: w for w in httpx.get(router.url + "/workers").json()}
    assert {u: (w["capacity"], w["capacity_source"]) for u, w in rows.items()} == {
        small.url: (2, "reported"),
        large.url: (3, "reported"),
        silent.url: (None, None),
        stated.url: (2, "stated"),
    }
    page = httpx.get(router.url + "/status").text
    assert "2 (reported)" in page and "2 (stated)" in page

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            # New prefixes go to the idle workers in turn: take the first whose holder
            # reported its capacity.
            for k in range(3):
                body = {"model": "sim", "prompt": list(range(k * 1000 + 1, k * 1000 + 257))}
                first = await c.post("/v1/completions", json={**body, "max_tokens": 1})
                holder = first.headers["x-kvroute-worker"]
                if holder != silent.url:
                    break
            # Fill the holder to its capacity with the same prefix, then one more.
            held = [
                asyncio.ensure_future(c.post("/v1/completions", json={**body, "max_tokens": 30}))
                for _ in range(rows[holder]["capacity"])
            ]
            await asyncio.sleep(0.5)
            late = await c.post("/v1/completions", json={**body, "max_tokens": 1})
            answers = await asyncio.gather(*held)
        return (
            [holder]
            + [r.headers["x-kvroute-worker"] for r in answers]
            + [late.headers["x-kvroute-worker"]]
        )

    chosen = asyncio.run(run())
    holder = chosen[0]
    assert holder != silent.url
    assert chosen[:-1] == [holder] * (len(chosen) - 1), "the prefix sticks to its holder"
    assert chosen[-1] != holder, "the holder, full by its own report, is passed over"
    assert 'reason="overflow"' in httpx.get(router.url + "/metrics").text
    rows = {w["url"]: w for w in httpx.get(router.url + "/workers").json()}
    assert all(w["in_flight"] == 0 for w in rows.values())


def test_router_reads_an_engine_at_its_high_water_mark_between_checks(
    tmp_path: Path, processes: list[Server]
) -> None:
    """Health checks (and the /metrics reading after each) a minute apart: a worker
    that starts queueing between two of them still has its capacity learned within
    seconds, by a reading taken when the requests routed to it exceed the most its
    engine was seen running with nothing waiting (``kvroute.fleet.health.EdgeReads``);
    once learned, it is read no more. One worker, so that every request goes to it."""
    worker = _sim_worker(tmp_path)
    processes.append(worker)
    router = start_router([worker.url], tmp_path, "--health-check-interval-secs", "60")
    processes.append(router)
    body = {"model": "sim", "prompt": list(range(1, 257)), "max_tokens": 30}

    async def run() -> tuple[dict[str, object], float, float]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            # 4 requests of about 3 s of decode each: the worker runs 2 and queues 2.
            held = [asyncio.ensure_future(c.post("/v1/completions", json=body))]
            await asyncio.sleep(0.3)
            held += [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(3)]
            await asyncio.sleep(2 * EDGE_READ_GAP_S)  # past the gap: a reading sees the queue
            held.append(asyncio.ensure_future(c.post("/v1/completions", json=body)))
            learned = await _learned_capacities(c, 5, 0.05)
            reads = metric(router, "kvroute_engine_reads_between_checks_total")
            # Past the gap again, above the high-water mark: no reading once learned.
            await asyncio.sleep(2 * EDGE_READ_GAP_S)
            held += [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(2)]
            await asyncio.sleep(2 * EDGE_READ_GAP_S)
            after = metric(router, "kvroute_engine_reads_between_checks_total")
            for r in await asyncio.gather(*held):
                assert r.status_code == 200
        return learned, reads, after

    learned, reads, after = asyncio.run(run())
    assert learned == {worker.url: 2}, "learned from a reading between two checks"
    assert 1 <= reads <= 3  # at high-water marks only, a gap apart: not one per request
    assert after == reads, "read no more once the capacity is learned"
    rows = httpx.get(router.url + "/workers").json()
    assert all(w["in_flight"] == 0 for w in rows)


class _Fleet:
    """What ``EdgeReads`` reads of the router's state (``kvroute.fleet.health.Checked``)."""

    def __init__(self, url: str) -> None:
        self.capacity = CapacityLearner()
        self.registry = Registry(Settings(worker_urls=[url]).validate())
        self.registry.add(url)


def test_edge_reads_a_worker_at_most_once_a_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests routed above a worker's high-water mark start a reading of its engine at
    most once per ``EDGE_READ_GAP_S``, one at a time, and none once its capacity is
    known."""
    url = "http://w1:8000"
    state = _Fleet(url)
    started: list[str] = []
    now = [100.0]
    monkeypatch.setattr("kvroute.fleet.health.time.monotonic", lambda: now[0])

    async def read(_: object, worker: str) -> bool:
        started.append(worker)
        return True  # the engine's counts were read

    monkeypatch.setattr("kvroute.fleet.health.poll_engine_load", read)

    async def run() -> None:
        edge = EdgeReads(state)  # type: ignore[arg-type]
        w = state.registry.workers[url]
        w.in_flight = 3  # above the floor (none seen yet)
        edge.after_reserve(url)
        await asyncio.sleep(0)  # the reading runs and ends
        assert started == [url]
        now[0] += EDGE_READ_GAP_S / 2
        edge.after_reserve(url)  # within the gap: no reading
        await asyncio.sleep(0)
        assert started == [url]
        now[0] += EDGE_READ_GAP_S
        state.capacity.floors[url] = 3  # seen running 3, nothing waiting
        edge.after_reserve(url)  # not above what it was seen running: no reading
        w.in_flight = 4
        edge.after_reserve(url)  # a new high-water mark, past the gap: read
        await asyncio.sleep(0)
        assert started == [url, url]
        now[0] += 2 * EDGE_READ_GAP_S
        state.capacity.capacities[url] = 3  # learned: read no more
        w.in_flight = 9
        edge.after_reserve(url)
        await asyncio.sleep(0)
        assert started == [url, url]
        await edge.close()

    asyncio.run(run())


def test_edge_reads_wait_longer_after_a_reading_that_found_no_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine whose /metrics has no running/waiting counts (absent, an error, another
    kind of server) never teaches a capacity, so its requests stay above the floor: after
    such a reading the next one between checks waits ``blind_s``, not the gap, and once
    a reading finds counts again the gap applies again."""
    url = "http://w1:8000"
    state = _Fleet(url)
    started: list[str] = []
    answers = [False, True, True]
    now = [100.0]
    monkeypatch.setattr("kvroute.fleet.health.time.monotonic", lambda: now[0])

    async def read(_: object, worker: str) -> bool:
        started.append(worker)
        return answers[len(started) - 1]

    monkeypatch.setattr("kvroute.fleet.health.poll_engine_load", read)

    async def run() -> None:
        edge = EdgeReads(state, blind_s=4.0)  # type: ignore[arg-type]
        state.registry.workers[url].in_flight = 3  # above the floor (none seen yet)
        edge.after_reserve(url)
        await asyncio.sleep(0)
        assert len(started) == 1  # found nothing
        for _ in range(15):  # a gap apart, up to 3.75 s: within blind_s of that reading
            now[0] += EDGE_READ_GAP_S
            edge.after_reserve(url)
            await asyncio.sleep(0)
            assert len(started) == 1
        now[0] = 104.0  # blind_s after the reading: read again, this time counts found
        edge.after_reserve(url)
        await asyncio.sleep(0)
        assert len(started) == 2
        now[0] += EDGE_READ_GAP_S  # a gap after a reading that found counts: read again
        edge.after_reserve(url)
        await asyncio.sleep(0)
        assert len(started) == 3
        await edge.close()

    asyncio.run(run())


def test_router_reads_a_worker_without_load_gauges_once_per_health_interval(
    tmp_path: Path, processes: list[Server]
) -> None:
    """A worker whose /metrics answers 404 (the test worker's, as an engine without
    load gauges) never teaches a capacity, so every request routed to it is above its
    floor. With requests in flight for several read gaps, the router reads it between
    checks once, not once per gap, and every request is answered."""
    worker = start_fake_worker(tmp_path)
    processes.append(worker)
    httpx.post(worker.url + "/control", json={"mode": "ok", "delay_s": 0.2}, timeout=5)
    router = start_router([worker.url], tmp_path, "--health-check-interval-secs", "60")
    processes.append(router)
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            codes: list[int] = []
            for _ in range(12):  # 12 rounds of 0.2 s: about 10 read gaps with requests in flight
                answers = await asyncio.gather(
                    *(c.post("/v1/completions", json=body) for _ in range(2))
                )
                codes += [r.status_code for r in answers]
            return codes

    codes = asyncio.run(run())
    assert codes == [200] * 24
    reads = metric(router, "kvroute_engine_reads_between_checks_total")
    assert reads == 1, f"{reads} readings between checks of an engine that has no gauges"


def test_router_counts_load_that_bypassed_it(tmp_path: Path, processes: list[Server]) -> None:
    """Requests sent to a worker past the router (another router replica, a client
    pinned to the worker) show in its engine's running/waiting counts: the guard adds
    them to the router's own load and passes over the full holder."""
    workers = [_sim_worker(tmp_path) for _ in range(2)]
    processes.extend(workers)
    router = start_router([w.url for w in workers], tmp_path, "--worker-capacity", "2")
    processes.append(router)
    body = {"model": "sim", "prompt": list(range(1, 257)), "max_tokens": 30}
    quick = {**body, "max_tokens": 1}

    async def run() -> tuple[str, dict[str, object], str]:
        async with httpx.AsyncClient(timeout=30) as c:
            first = await c.post(router.url + "/v1/completions", json=quick)
            holder = first.headers["x-kvroute-worker"]
            # Two long requests straight to the holder, unseen by the router.
            direct = asyncio.gather(
                *(c.post(holder + "/v1/completions", json=body) for _ in range(2))
            )
            external: dict[str, object] = {}
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not external.get(holder):
                await asyncio.sleep(0.1)
                rows = (await c.get(router.url + "/workers")).json()
                external = {w["url"]: w["external_load"] for w in rows}
            late = await c.post(router.url + "/v1/completions", json=quick)
            await direct
        return holder, external, late.headers["x-kvroute-worker"]

    holder, external, late = asyncio.run(run())
    assert external[holder] == 2, "the engine's load beyond the router's own requests"
    assert late != holder, "the holder, full with requests the router did not send, is passed over"
    metrics = httpx.get(router.url + "/metrics").text
    assert 'reason="overflow"' in metrics
    assert f'kvroute_worker_external_load{{worker="{holder}"}}' in metrics
