"""Service discovery: the fleet follows DNS or Kubernetes instead of a fixed URL list.

``--service-discovery dns`` (``kvroute.fleet.discovery_dns``) re-resolves a name;
``--service-discovery k8s`` (``kvroute.fleet.discovery_k8s``) watches EndpointSlices.
Either source hands its current set of worker URLs to a ``Reconciler``
(``kvroute.fleet.reconcile``): new workers join, vanished ones drain (their in-flight
requests finish, no new ones) and leave; a source that fails keeps the last known set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvroute.config import Settings
from kvroute.fleet.reconcile import OnLeft, Reconciler
from kvroute.fleet.registry import Registry


def start_discovery(
    settings: Settings,
    registry: Registry,
    on_left: OnLeft | None = None,
    on_joined: Callable[[str], None] | None = None,
) -> asyncio.Task[None] | None:
    """The discovery task ``--service-discovery`` asks for (None for a static fleet)."""
    mode = settings.service_discovery
    if mode == "static":
        return None
    reconciler = Reconciler(registry, on_left, on_joined)
    if mode == "dns":
        from kvroute.fleet.discovery_dns import DnsSource, dns_loop

        assert settings.dns_name is not None  # validated in Settings
        source = DnsSource(
            settings.dns_name,
            settings.worker_port,
            settings.dns_server,
            timeout_s=min(settings.dns_interval_secs, 5.0),
        )
        return asyncio.create_task(dns_loop(source, reconciler, settings.dns_interval_secs))
    from kvroute.fleet.discovery_k8s import k8s_loop  # lightkube loads only when used

    return asyncio.create_task(k8s_loop(settings, reconciler))
