"""Connection limits: the open-file limit raised at start, and a clean 503 past the cap.

Every client connection and every connection to a worker holds a file descriptor. With
the usual soft limit (1,024) a burst of idle client connections exhausts them and new
clients see connection resets. At start the soft ``RLIMIT_NOFILE`` is raised to the
hard limit, and client connections are capped (``--max-connections``, by default half
of that limit, leaving the other half for worker connections, logs and sockets) with
uvicorn's ``limit_concurrency``: past it a request is answered 503 with an OpenAI-style
body and ``Retry-After``, and the connection closed, instead of a reset.
"""

from __future__ import annotations

import logging
import resource

from starlette.types import Receive, Scope, Send

from kvroute.errors import error_body

log = logging.getLogger("kvroute.service.limits")

# When the hard limit is unlimited, raise the soft one this far.
UNLIMITED_TARGET = 1 << 20
# Descriptors kept out of the default connection cap (listening socket, logs, tokenizer).
RESERVED_FDS = 64
BUSY_BODY = error_body(
    "the router is at its connection limit (--max-connections); retry shortly",
    "service_unavailable",
    "too_many_connections",
)


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard one; returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    return UNLIMITED_TARGET if soft == resource.RLIM_INFINITY else soft


def default_max_connections(open_files: int) -> int:
    """Half the descriptors left after the reserve: the other half is for workers."""
    return max(16, (open_files - RESERVED_FDS) // 2)


async def too_many_connections(scope: Scope, receive: Receive, send: Send) -> None:
    """What uvicorn answers past ``limit_concurrency``, in the API's error shape."""
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(BUSY_BODY)).encode()),
                (b"retry-after", b"1"),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": BUSY_BODY, "more_body": False})


def install_busy_answer() -> None:
    """Make uvicorn's protocols answer ``too_many_connections`` past the cap (they look
    the function up by name at each rejection)."""
    from uvicorn.protocols.http import h11_impl, httptools_impl

    httptools_impl.service_unavailable = too_many_connections  # type: ignore[assignment,attr-defined]
    h11_impl.service_unavailable = too_many_connections  # type: ignore[assignment,attr-defined]
    # uvicorn logs a warning per refused request: a flood of lines under the very
    # overload the cap is for. The start-up line states the cap; clients see the 503.
    logging.getLogger("uvicorn.error").addFilter(
        lambda record: record.getMessage() != "Exceeded concurrency limit."
    )
