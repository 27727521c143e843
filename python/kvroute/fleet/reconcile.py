"""Turns a discovery source's successive sets of worker URLs into registry changes.

* a URL that appears is ``add``ed (it takes requests at once and is health-checked like
  any worker);
* a URL that disappears is ``drain``ed: no new requests, its in-flight requests finish,
  and the registry removes it when the last one ends; ``on_left`` then closes its
  connection pool (``sweep``);
* a URL that comes back while draining simply stops draining.

Only URLs a source added are ever drained: workers from ``--worker-urls`` or
``POST /workers`` are left alone.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable

from kvroute.fleet.registry import Registry

log = logging.getLogger("kvroute.fleet.discovery")

OnLeft = Callable[[str], Awaitable[None]]


class DiscoveryError(Exception):
    """A source could not say which workers exist right now (the last set is kept)."""


def worker_url(address: str, port: int) -> str:
    """``http://ADDR:PORT``, with IPv6 addresses in brackets."""
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}"


class Reconciler:
    """Applies a source's successive URL sets to the registry."""

    def __init__(
        self,
        registry: Registry,
        on_left: OnLeft | None = None,
        on_joined: Callable[[str], None] | None = None,
    ) -> None:
        self.registry = registry
        self.on_left = on_left
        # Called for each new worker (the app probes it at once: no traffic until then).
        self.on_joined = on_joined
        self.known: set[str] = set()
        self.leaving: set[str] = set()  # drained, waiting for their in-flight to end

    def apply(self, urls: set[str]) -> None:
        for url in sorted(urls - self.known):
            self.registry.add(url)
            if self.on_joined is not None:
                self.on_joined(url)
        for url in sorted(self.known - urls):
            self.registry.drain(url)
            self.leaving.add(url)
        self.leaving -= urls
        if urls != self.known:
            log.info("discovered %d worker(s): %s", len(urls), " ".join(sorted(urls)))
        self.known = set(urls)

    async def sweep(self) -> None:
        """Close the pools of drained workers the registry has since removed."""
        gone = {u for u in self.leaving if u not in self.registry.workers}
        self.leaving -= gone
        for url in gone:
            if self.on_left is not None:
                try:
                    await self.on_left(url)
                except Exception:  # a pool that fails to close must not stop discovery
                    log.exception("closing the pool of %s failed", url)
