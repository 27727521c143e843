"""One proxied request as the inference handlers see it: the ASGI scope, its body
channel and its headers, without Starlette's ``Request``.

Starlette's ``Request.headers`` answers each ``get`` by walking the header list and
lowercasing names; the forwarding path asks for six or seven headers per request.
Here the list becomes one dict (bytes names, lowercased by the server as ASGI
requires; the first of repeated names wins, as with ``Headers.get``) and values are
decoded only when asked for.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Receive, Scope


class Incoming:
    __slots__ = ("headers", "receive", "scope")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self.receive = receive
        self.headers: dict[bytes, bytes] = dict(reversed(scope["headers"]))

    def header(self, name: bytes) -> str | None:
        """The header's value (``name`` lowercase), None when absent."""
        value = self.headers.get(name)
        return None if value is None else value.decode("latin-1")

    def note(self, key: str, value: Any) -> None:
        """Tell the access log something about the request (``scope["state"]``, where
        Starlette's ``request.state`` keeps it too)."""
        self.scope.setdefault("state", {})[key] = value
