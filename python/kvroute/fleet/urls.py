"""Which worker URLs may be added at run time, and the worker URL in an admin path.

``POST /workers`` lets an admin caller point the router at any address; the router then
sends it traffic and health checks. ``--worker-url-allow`` narrows that: each pattern is
a CIDR (``10.0.0.0/8``, ``fd00::/8``), matched against a host written as an IP address,
or a host glob (``*.svc.cluster.local``, ``worker-?``), matched case-insensitively against
a host name. Names are not resolved, so a CIDR never admits a name. Without patterns
any host is accepted except link-local addresses (``169.254.0.0/16``, ``fe80::/10``):
that is where cloud metadata services answer (``169.254.169.254``), and a router made to
fetch from them could leak credentials; a pattern that covers them admits them.
Start-up URLs (``--worker-urls``) are the operator's own and are not checked.
"""

from __future__ import annotations

import fnmatch
import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))


def parse_allow_pattern(pattern: str) -> IPNetwork | str:
    """A CIDR network, or a lower-cased host glob. Raises ValueError for an empty
    pattern or one that is neither (e.g. a URL)."""
    p = pattern.strip()
    if not p:
        raise ValueError("--worker-url-allow: empty pattern")
    if "/" in p:
        try:
            return ipaddress.ip_network(p, strict=False)
        except ValueError:
            raise ValueError(
                f"--worker-url-allow {pattern!r}: not a CIDR (like 10.0.0.0/8) "
                "nor a host glob (like *.internal)"
            ) from None
    if any(c in p for c in ":@ ") and not _is_ip(p):
        raise ValueError(f"--worker-url-allow {pattern!r}: give a host glob or a CIDR, not a URL")
    return p.lower()


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def worker_url_refusal(url: str, patterns: Sequence[str]) -> str | None:
    """Why ``url`` (already a valid http(s) URL) may not be added at run time, or None
    when it may."""
    host = (urlsplit(url).hostname or "").lower()
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    for pattern in map(parse_allow_pattern, patterns):
        if isinstance(pattern, str):
            if fnmatch.fnmatchcase(host, pattern):
                return None
        elif ip is not None and ip.version == pattern.version and ip in pattern:
            return None
    if patterns:
        return f"worker URL {url!r} is not allowed by --worker-url-allow"
    if ip is not None and any(ip.version == n.version and ip in n for n in _LINK_LOCAL):
        return (
            f"worker URL {url!r} is a link-local address (where cloud metadata services "
            "answer); allow it explicitly with --worker-url-allow"
        )
    return None


def path_worker_url(scope: Mapping[str, Any]) -> str:
    """The worker URL in ``DELETE /workers/{url}``, percent-decoded exactly once from
    the raw path (so ``http%3A%2F%2Fh%3A1`` and ``http://h:1`` both name ``http://h:1``,
    and an encoded ``%25`` stays a ``%``)."""
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else str(scope.get("path", ""))
    marker = "/workers/"
    at = path.find(marker)
    tail = path[at + len(marker) :] if at >= 0 else path
    return unquote(tail).rstrip("/")
