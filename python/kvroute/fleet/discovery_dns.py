"""DNS discovery: every ``--dns-interval-secs`` the name is resolved again with
dnspython's asyncio resolver, and the answer becomes the set of workers
(``kvroute.fleet.reconcile`` adds and drains).

A plain name gives A and AAAA records, each an ``http://ADDR:PORT`` worker on
``--worker-port`` (a headless Service's name in Kubernetes). A name starting with ``_``
(``_http._tcp.vllm.ns.svc.cluster.local``) is looked up as SRV: each record's target is
resolved to addresses and the record's port is used. NXDOMAIN is an answer (the name has
no workers, e.g. scaled to zero), not a failure; timeouts, SERVFAIL and REFUSED are
failures, and a failure keeps the last known set.
"""

from __future__ import annotations

import asyncio
import logging

import dns.asyncresolver
import dns.exception
import dns.resolver

from kvroute.fleet.reconcile import DiscoveryError, Reconciler, worker_url

log = logging.getLogger("kvroute.fleet.discovery")


class DnsSource:
    """Resolves one name to the set of worker URLs (see the module docstring)."""

    def __init__(self, name: str, port: int | None, server: str | None, timeout_s: float):
        self.name = name
        self.port = port
        self.resolver = dns.asyncresolver.Resolver(configure=server is None)
        if server is not None:
            host, _, server_port = server.rpartition(":")
            self.resolver.nameservers = [host.strip("[]")]
            self.resolver.port = int(server_port)
        self.resolver.lifetime = timeout_s
        self.resolver.timeout = timeout_s
        self.last: dict[tuple[str, str], list[str]] = {}  # (name, type) -> last answer

    async def _addresses(self, name: str) -> list[str]:
        """A and AAAA addresses of ``name``. One family failing (some servers answer
        REFUSED for a type they hold nothing of) keeps that family's last answer; both
        failing raises DiscoveryError."""
        found: list[str] = []
        errors: list[str] = []
        for rdtype in ("A", "AAAA"):
            key = (name, rdtype)
            try:
                answer = await self.resolver.resolve(name, rdtype, search=False)
                got = [r.address for r in answer]
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                got = []
            except dns.exception.DNSException as e:
                errors.append(f"{rdtype} {name}: {type(e).__name__}")
                log.debug("DNS discovery: %s %s: %s", rdtype, name, e)
                got = self.last.get(key, [])
            self.last[key] = got
            found.extend(got)
        if len(errors) == 2:
            raise DiscoveryError("; ".join(errors))
        return found

    async def resolve(self) -> set[str]:
        if not self.name.startswith("_"):
            assert self.port is not None  # validated in Settings
            return {worker_url(a, self.port) for a in await self._addresses(self.name)}
        try:
            answer = await self.resolver.resolve(self.name, "SRV", search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return set()
        except dns.exception.DNSException as e:
            raise DiscoveryError(f"SRV {self.name}: {type(e).__name__}: {e}") from None
        urls: set[str] = set()
        for rec in answer:
            target = rec.target.to_text()
            urls.update(worker_url(a, rec.port) for a in await self._addresses(target))
        return urls


async def dns_loop(source: DnsSource, reconciler: Reconciler, interval_s: float) -> None:
    while True:
        try:
            reconciler.apply(await source.resolve())
        except DiscoveryError as e:
            log.warning(
                "DNS discovery: %s; keeping the last %d worker(s)", e, len(reconciler.known)
            )
        except Exception:  # never let one bad round end discovery
            log.exception("DNS discovery round failed")
        await reconciler.sweep()
        await asyncio.sleep(interval_s)
