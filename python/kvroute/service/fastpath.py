"""The ASGI entry point: proxied requests go straight to the proxy, the rest to FastAPI.

Every proxied request used to cross FastAPI's request wrapper, Starlette's router, its
exception middleware and its error middleware (each wrapping ``send``): about a sixth
of the router's CPU per request in py-spy profiles. ``RouterApp`` is the FastAPI app
with one shortcut in front: a ``POST`` to one of the proxied paths (``routes.ROUTES``)
is handed to the inference handler directly, as an ``Incoming`` (scope, ``receive``
and a header dict; no Starlette ``Request``), and its errors are rendered here in the
same OpenAI shape the app's exception handlers use. Everything else (admin API, metrics, health, the
OpenAPI schema, lifespan) goes through FastAPI unchanged, and the proxied routes stay
registered there too, so the schema still lists them. Every HTTP request, either way,
passes the access log (``accesslog``) once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvroute.errors import RouterError, error_response
from kvroute.service import accesslog
from kvroute.service.incoming import Incoming
from kvroute.service.routes import ROUTES

log = logging.getLogger("kvroute.service.app")

Handler = Callable[[Incoming, str, str], Awaitable[Response]]


class RouterApp(FastAPI):
    """FastAPI with a direct path for inference requests (set ``inference`` to enable)."""

    inference: Handler | None = None
    access_log = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.access_log and scope["type"] == "http" and accesslog.wanted(scope):
            await accesslog.record(self._dispatch, scope, receive, send)
        else:
            await self._dispatch(scope, receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.inference is not None
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and (route := ROUTES.get(scope["path"])) is not None
        ):
            scope["app"] = self
            try:
                response = await self.inference(
                    Incoming(scope, receive), route.kind, route.worker_path
                )
            except RouterError as e:
                response = e.response()
            except ClientDisconnect:
                return  # gone before its body arrived (or timed out sending it): no one to answer
            except Exception:
                # What FastAPI's error middleware would do, in the API's error shape.
                log.exception("unhandled error on %s", scope["path"])
                response = error_response(
                    500, "internal router error", "internal_error", "internal_error"
                )
            await response(scope, receive, send)
            return
        await super().__call__(scope, receive, send)
