"""Fault injection for ``kvroute sim-worker``: a marked request kills the worker or drops
its connection (the failure-isolation tests' query of death).

``Poisoned`` wraps the worker's ASGI app. A request whose body contains the marker
bytes is never answered: with ``crash`` the process exits at once (the engine dying on
a bad input: every connection closes), with ``drop`` only that request's connection is
closed and the worker keeps serving. Any other request goes through unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("kvroute.sim.faults")

ACTIONS = ("crash", "drop")


class Poisoned:
    def __init__(
        self,
        app: ASGIApp,
        marker: bytes,
        action: str,
        connections: Callable[[], Iterable[Any]],
    ) -> None:
        if action not in ACTIONS:
            raise ValueError(f"poison action must be one of {ACTIONS}, got {action!r}")
        if not marker:
            raise ValueError("the poison marker must not be empty")
        self.app = app
        self.marker = marker
        self.action = action
        self._connections = connections  # uvicorn's live protocol objects

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        body = b""
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if self.marker in body:
            await self._strike(scope)
            return
        replay = iter(messages)

        async def replayed() -> Message:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)

    async def _strike(self, scope: Scope) -> None:
        if self.action == "crash":
            log.warning("poisoned request: exiting")
            os._exit(1)
        for conn in list(self._connections()):
            if getattr(conn, "client", None) == scope.get("client"):
                conn.transport.close()
                log.warning("poisoned request: connection from %s dropped", scope.get("client"))
        await asyncio.sleep(0.05)  # let the protocol see the connection go first
