"""Kubernetes discovery: the workers are the ready endpoints of the EndpointSlices that
match ``--selector`` in ``--namespace`` (through lightkube's asyncio client).

List, then watch from the list's resourceVersion (the Kubernetes list+watch pattern):

1. ``list`` the matching slices; the set of worker URLs is rebuilt from scratch.
2. ``watch`` from the list's resourceVersion: ADDED/MODIFIED replace one slice's
   endpoints, DELETED drops them; every event re-applies the union of all slices.
   lightkube reopens a watch the server closed normally, from the last version seen.
3. Any error (API error event, 410 Gone, connection lost, 5xx) ends the watch: after a
   backoff (0.5 s doubling to 30 s, reset by a successful list) go back to 1. The last
   known set stays in force meanwhile, so a flaky API server drains nobody.

An endpoint counts when its ``conditions.ready`` is not false (the API says a missing
value means ready) and its worker URL is ``http://ADDRESS:--worker-port``. Vanished
endpoints drain as in DNS mode (``kvroute.fleet.reconcile``). Configuration comes from
the pod's service account in a cluster, else from ``KUBECONFIG`` / ``~/.kube/config``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from lightkube import AsyncClient, KubeConfig
from lightkube.core.exceptions import NotReadyError
from lightkube.resources.discovery_v1 import EndpointSlice

from kvroute.config import Settings
from kvroute.fleet.reconcile import Reconciler, worker_url

log = logging.getLogger("kvroute.fleet.discovery")

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
WATCH_SERVER_TIMEOUT_S = 300  # the server ends each watch by then; lightkube reopens it


def parse_selector(selector: str) -> dict[str, Any]:
    """``app=vllm,tier=gpu`` -> ``{"app": "vllm", "tier": "gpu"}`` (equality only)."""
    labels: dict[str, Any] = {}
    for part in selector.split(","):
        key, sep, value = part.strip().replace("==", "=").partition("=")
        if not sep or not key:
            raise ValueError(f"label selector term {part!r} is not KEY=VALUE")
        labels[key.strip()] = value.strip()
    return labels


def slice_urls(obj: Any, port: int) -> set[str]:
    """Worker URLs of one EndpointSlice's ready endpoints."""
    urls: set[str] = set()
    family = getattr(obj, "addressType", "IPv4")
    for ep in obj.endpoints or ():
        ready = ep.conditions.ready if ep.conditions is not None else None
        if ready is False:
            continue
        for address in ep.addresses or ():
            if family == "FQDN":
                urls.add(f"http://{address}:{port}")
            else:
                urls.add(worker_url(address, port))
    return urls


class SliceSet:
    """The slices seen so far, by namespace/name; ``urls`` is their union."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.slices: dict[str, set[str]] = {}
        self.lists = 0  # successful lists so far

    @staticmethod
    def key(obj: Any) -> str:
        return f"{obj.metadata.namespace}/{obj.metadata.name}"

    def reset(self, objs: Iterable[Any]) -> None:
        self.slices = {self.key(o): slice_urls(o, self.port) for o in objs}
        self.lists += 1

    def event(self, kind: str, obj: Any) -> None:
        if kind in ("ADDED", "MODIFIED"):
            self.slices[self.key(obj)] = slice_urls(obj, self.port)
        elif kind == "DELETED":
            self.slices.pop(self.key(obj), None)

    def urls(self) -> set[str]:
        return set().union(*self.slices.values()) if self.slices else set()


def make_client(namespace: str | None) -> AsyncClient:
    """In-cluster configuration (service account) first, then the kubeconfig."""
    config = KubeConfig.from_env()
    return AsyncClient(config=config, namespace=namespace, trust_env=False)


async def watch_once(
    client: AsyncClient, labels: dict[str, Any], seen: SliceSet, rec: Reconciler
) -> None:
    """One list followed by one watch, until the watch fails (it raises)."""
    listing = client.list(EndpointSlice, namespace=client.namespace, labels=labels)
    objs = [o async for o in listing]
    seen.reset(objs)
    rec.apply(seen.urls())
    await rec.sweep()
    try:
        version: str | None = listing.resourceVersion
    except NotReadyError:  # the server sent none: watch from now
        version = None
    async for kind, obj in client.watch(
        EndpointSlice,
        namespace=client.namespace,
        labels=labels,
        resource_version=version,
        server_timeout=WATCH_SERVER_TIMEOUT_S,
    ):
        seen.event(kind, obj)
        rec.apply(seen.urls())
        await rec.sweep()


async def k8s_loop(settings: Settings, rec: Reconciler) -> None:
    assert settings.selector is not None and settings.worker_port is not None  # validated
    labels = parse_selector(settings.selector)
    seen = SliceSet(settings.worker_port)
    backoff = BACKOFF_START_S
    client: AsyncClient | None = None
    try:
        while True:
            lists = seen.lists
            try:
                if client is None:
                    client = make_client(settings.namespace)
                await watch_once(client, labels, seen, rec)
            except Exception as e:  # API, network or configuration: retried after a backoff
                log.warning(
                    "Kubernetes discovery: %s: %s; keeping the last %d worker(s), "
                    "relisting in %.1fs",
                    type(e).__name__,
                    e,
                    len(rec.known),
                    backoff,
                )
            if seen.lists != lists:
                backoff = BACKOFF_START_S
            await rec.sweep()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)
    finally:
        if client is not None:
            await client.close()
