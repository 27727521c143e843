"""DNS discovery against a real dnsmasq on loopback: the router follows the answers as
the hosts file changes (SIGHUP reload), drains the worker that vanished without a client
error under load, and keeps its fleet while the DNS server is gone."""

from __future__ import annotations

import getpass
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvroute.eval.procs import Server, free_port, stop_process
from load import Load
from support import start_router, start_sim_worker_at, worker_urls

NAME = "workers.kvroute.test"

pytestmark = pytest.mark.skipif(
    shutil.which("dnsmasq") is None and not Path("/usr/sbin/dnsmasq").exists(),
    reason="dnsmasq is not installed (.ci/run installs it)",
)


class Dnsmasq:
    """dnsmasq answering from one hosts file only, on 127.0.0.1:port."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.hosts = tmp / "hosts"
        self.port = free_port()
        self.set_addresses([])
        binary = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
        self.log = open(tmp / "dnsmasq.log", "wb")
        self.proc = subprocess.Popen(
            [
                binary,
                "--keep-in-foreground",
                "--no-resolv",
                "--no-hosts",
                # Authoritative for the test domain, as cluster DNS is for its zone:
                # NODATA for AAAA rather than REFUSED (no upstream to forward to).
                "--local=/kvroute.test/",
                f"--addn-hosts={self.hosts}",
                f"--port={self.port}",
                "--listen-address=127.0.0.1",
                "--bind-interfaces",
                "--conf-file=/dev/null",
                "--pid-file=",
                f"--user={getpass.getuser()}",
                "--log-facility=-",
                *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            self.wait_answering()
        except BaseException:
            self.stop()
            raise

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_addresses(self, addresses: list[str]) -> None:
        lines = [f"{a} {NAME}\n" for a in addresses]
        self.hosts.write_text("127.0.0.9 probe.kvroute.test\n" + "".join(lines))

    def reload(self) -> None:
        self.proc.send_signal(signal.SIGHUP)

    def wait_answering(self) -> None:
        import dns.resolver

        r = dns.resolver.Resolver(configure=False)
        r.nameservers, r.port, r.lifetime = ["127.0.0.1"], self.port, 0.5
        for _ in range(100):
            if self.proc.poll() is not None:
                raise RuntimeError(f"dnsmasq exited with {self.proc.returncode}")
            try:
                r.resolve("probe.kvroute.test", "A")
            except dns.exception.DNSException:
                time.sleep(0.1)
                continue
            return
        raise TimeoutError("dnsmasq does not answer")

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


@pytest.fixture
def dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    d = Dnsmasq(tmp_path)
    yield d
    d.stop()


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def received(worker: Server) -> int:
    """Requests a sim worker has taken in (finished, cancelled or still running)."""
    s = httpx.get(worker.url + "/sim/stats", timeout=5).json()
    return int(s["requests_served"] + s["requests_cancelled"] + s["running"] + s["waiting"])


def workers_by_url(router: Server) -> dict[str, dict[str, object]]:
    return {w["url"]: w for w in httpx.get(router.url + "/workers", timeout=5).json()}


def in_flight(router: Server) -> dict[str, int]:
    return {u: int(w["in_flight"]) for u, w in workers_by_url(router).items()}  # type: ignore[call-overload]


def long_stream(router: Server, n: int, done: list[bool]) -> None:
    """One streamed completion of 300 tokens (~4.5 s on these workers)."""
    # Prompts that differ from the first byte: no cache match, so they spread by load.
    prompt = f"{n}{n}{n} a long answer, please"
    body = {"model": "sim", "prompt": prompt, "max_tokens": 300, "stream": True}
    with httpx.Client(timeout=60, trust_env=False) as client:
        with client.stream("POST", router.url + "/v1/completions", json=body) as r:
            text = b"".join(r.iter_bytes())
    done.append(r.status_code == 200 and text.rstrip().endswith(b"data: [DONE]"))


def test_router_follows_dns_answers_and_drains_without_client_errors(
    tmp_path: Path, processes: list[Server], dnsmasq: Dnsmasq
) -> None:
    port = free_port()
    a, b, c = (
        start_sim_worker_at(f"127.0.0.{i}", port, tmp_path, "--decode-ms-per-token", "15")
        for i in (2, 3, 4)
    )
    processes.extend([a, b, c])
    dnsmasq.set_addresses(["127.0.0.2", "127.0.0.3"])
    dnsmasq.reload()
    router = start_router(
        [],
        tmp_path,
        "--service-discovery",
        "dns",
        "--dns-name",
        NAME,
        "--worker-port",
        str(port),
        "--dns-server",
        dnsmasq.server,
        "--dns-interval-secs",
        "0.2",
    )
    processes.append(router)
    wait_for("the first answer", lambda: worker_urls(router) == {a.url, b.url})

    # Long streams, one at a time, until one runs on a: a then has a request in flight
    # when it leaves the answer (nothing else is running yet, so in_flight says it).
    streams: list[threading.Thread] = []
    finished: list[bool] = []
    for n in range(8):
        t = threading.Thread(target=long_stream, args=(router, n, finished))
        t.start()
        streams.append(t)
        wait_for("the stream to start", lambda: sum(in_flight(router).values()) == len(streams))
        if in_flight(router)[a.url] > 0:
            break
    assert in_flight(router)[a.url] > 0

    with Load(router.url, clients=6) as load:
        wait_for("load on both workers", lambda: received(a) > 5 and received(b) > 5)
        # a leaves the answer, c joins it: a drains (listed, no new requests) while its
        # stream runs on, then leaves.
        dnsmasq.set_addresses(["127.0.0.3", "127.0.0.4"])
        dnsmasq.reload()
        wait_for("a draining", lambda: workers_by_url(router).get(a.url, {}).get("draining"))
        wait_for("a drained and c added", lambda: worker_urls(router) == {b.url, c.url})
        for t in streams:
            t.join(timeout=60)
        assert finished == [True] * len(streams), "a long stream was cut"
        a_total = received(a)
        wait_for("load on c", lambda: received(c) > 5)
        # The DNS server goes away: resolution fails, the last known set stays.
        dnsmasq.stop()
        wait_for(
            "a failed resolution",
            lambda: "keeping the last 2 worker(s)" in router.log_tail(200),
        )
        b_before, c_before = received(b), received(c)
        wait_for("traffic after the failure", lambda: received(b) > b_before + 3)
        wait_for("traffic after the failure", lambda: received(c) > c_before + 3)
        assert worker_urls(router) == {b.url, c.url}
    assert received(a) == a_total, "a drained worker got new requests"
    assert load.errors == [], load.errors[:5]
    assert load.ok > 50


def test_srv_name_gives_targets_and_ports(tmp_path: Path, processes: list[Server]) -> None:
    """SRV: each record's target resolved to addresses, on the record's port (no
    --worker-port); a target's address change is followed."""
    srv = "_http._tcp.workers.kvroute.test"
    d = Dnsmasq(
        tmp_path,
        f"--srv-host={srv},w1.kvroute.test,8001",
        f"--srv-host={srv},w2.kvroute.test,8002",
    )
    try:
        d.hosts.write_text(
            "127.0.0.9 probe.kvroute.test\n127.0.0.2 w1.kvroute.test\n127.0.0.3 w2.kvroute.test\n"
        )
        d.reload()
        router = start_router(
            [],
            tmp_path,
            "--service-discovery",
            "dns",
            "--dns-name",
            srv,
            "--dns-server",
            d.server,
            "--dns-interval-secs",
            "0.2",
        )
        processes.append(router)
        wait_for(
            "the SRV answer",
            lambda: worker_urls(router) == {"http://127.0.0.2:8001", "http://127.0.0.3:8002"},
        )
        d.hosts.write_text(
            "127.0.0.9 probe.kvroute.test\n127.0.0.2 w1.kvroute.test\n127.0.0.4 w2.kvroute.test\n"
        )
        d.reload()
        wait_for(
            "the new target address",
            lambda: worker_urls(router) == {"http://127.0.0.2:8001", "http://127.0.0.4:8002"},
        )
    finally:
        d.stop()
