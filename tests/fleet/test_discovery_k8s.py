"""Kubernetes discovery against a stand-in API server (``tests/k8s_api.py``; payload
shapes from the API reference, no real cluster): ready endpoints only, watch events,
relist after a watch error, and the last set kept while the API server fails."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from k8s_api import PATH, FakeKubeApi, endpoint_slice
from kvroute.eval.procs import Server
from kvroute.fleet.discovery_k8s import parse_selector, slice_urls
from support import start_router, worker_urls

NS = "inference"
PORT = 8000  # nothing listens there: discovery alone decides the list of workers


def urls(*hosts: int) -> set[str]:
    return {f"http://127.0.0.{h}:{PORT}" for h in hosts}


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def api() -> Iterator[FakeKubeApi]:
    a = FakeKubeApi(NS)
    yield a
    a.stop()


def kubeconfig(tmp_path: Path, server: str) -> Path:
    p = tmp_path / "kubeconfig"
    p.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: test
  cluster: {{server: "{server}"}}
users:
- name: router
  user: {{token: test-token}}
contexts:
- name: test
  context: {{cluster: test, user: router, namespace: {NS}}}
current-context: test
"""
    )
    return p


def test_router_follows_endpoint_slices(
    tmp_path: Path,
    processes: list[Server],
    api: FakeKubeApi,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api.set_slice(endpoint_slice("vllm-a", [("127.0.0.2", True), ("127.0.0.3", False)]))
    other = endpoint_slice("other", [("127.0.0.9", True)])
    other["metadata"]["labels"]["app"] = "other"
    api.set_slice(other)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path, api.url)))
    router = start_router(
        [],
        tmp_path,
        "--service-discovery",
        "k8s",
        "--selector",
        "app=vllm",
        "--worker-port",
        str(PORT),
    )
    processes.append(router)
    # Ready endpoints of matching slices only, in the kubeconfig context's namespace.
    wait_for("the first list", lambda: worker_urls(router) == urls(2))
    path, query, auth = api.requests[0]
    assert path == PATH.format(ns=NS)
    assert query["labelSelector"] == ["app=vllm"]
    assert auth == "Bearer test-token"

    # Watch events: an endpoint turns ready; another slice appears; one is deleted.
    wait_for("the watch", lambda: api.watch_count() >= 1)
    api.set_slice(endpoint_slice("vllm-a", [("127.0.0.2", True), ("127.0.0.3", True)]))
    wait_for("MODIFIED", lambda: worker_urls(router) == urls(2, 3))
    api.set_slice(endpoint_slice("vllm-b", [("127.0.0.5", None)]))  # no condition = ready
    wait_for("ADDED", lambda: worker_urls(router) == urls(2, 3, 5))
    api.delete_slice("vllm-b")
    wait_for("DELETED", lambda: worker_urls(router) == urls(2, 3))

    # Changes the watch never reports, then an expired watch: the router lists again.
    lists = api.lists()
    api.set_slice(
        endpoint_slice("vllm-a", [("127.0.0.3", True), ("127.0.0.4", True)]), notify=False
    )
    api.expire_watches()
    wait_for("the relist", lambda: worker_urls(router) == urls(3, 4))
    assert api.lists() > lists

    # The API server fails: the last known set stays while the router retries.
    wait_for("the new watch", lambda: len(api.watches) >= 1)
    api.fail_with = 500
    failed_from = len(api.requests)
    api.end_watches()
    wait_for("two failed retries", lambda: len(api.requests) >= failed_from + 2)
    assert worker_urls(router) == urls(3, 4)
    assert "keeping the last 2 worker(s)" in router.log_tail(100)
    api.fail_with = None
    api.set_slice(endpoint_slice("vllm-a", [("127.0.0.6", True)]), notify=False)
    wait_for("the recovery", lambda: worker_urls(router) == urls(6))


def _slice(address_type: str, endpoints: list[tuple[list[str], bool | None]]) -> object:
    return SimpleNamespace(
        addressType=address_type,
        endpoints=[
            SimpleNamespace(addresses=a, conditions=SimpleNamespace(ready=r)) for a, r in endpoints
        ],
    )


def test_slice_urls_take_ready_endpoints_of_every_address_family() -> None:
    v4 = _slice("IPv4", [(["10.0.0.1"], True), (["10.0.0.2"], False), (["10.0.0.3"], None)])
    assert slice_urls(v4, 8000) == {"http://10.0.0.1:8000", "http://10.0.0.3:8000"}
    v6 = _slice("IPv6", [(["fd00::1"], True)])
    assert slice_urls(v6, 8000) == {"http://[fd00::1]:8000"}
    fqdn = _slice("FQDN", [(["vllm-0.vllm.inference.svc"], True)])
    assert slice_urls(fqdn, 80) == {"http://vllm-0.vllm.inference.svc:80"}


def test_selector_parsing() -> None:
    assert parse_selector("app=vllm, tier==gpu") == {"app": "vllm", "tier": "gpu"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_selector("app")
