"""``--kv-events`` values: which worker publishes its KV events where.

Syntax (one flag per worker, repeatable)::

    --kv-events 'WORKER_URL=ENDPOINT[;topic=TOPIC][;replay=REPLAY_ENDPOINT][;bind|;connect]'

* ``WORKER_URL``: the worker as given to ``--worker-urls`` (``http://host:port``).
* ``ENDPOINT``: a ZMQ endpoint (``tcp://host:port``, ``ipc://path``).
* ``bind``: kvroute binds a SUB socket at ENDPOINT and the engine connects to it (vLLM
  with ``"endpoint": "tcp://<router host>:N"``). Several workers can share one bound
  endpoint; they must then each give a distinct ``topic``.
  ``connect`` (the default): kvroute connects to an engine that binds (vLLM with
  ``"endpoint": "tcp://*:N"``). An ENDPOINT whose host is ``*``, ``0.0.0.0`` or ``::``
  can only be bound, so it implies ``bind``.
* ``topic``: the engine's ``"topic"``; messages are routed to the worker by exact topic.
  Without it the worker takes every message on its socket (only if it is alone there).
* ``replay``: the engine's ``"replay_endpoint"`` as reachable from kvroute (kvroute
  connects a DEALER there to recover lost batches). Without it, a loss makes the worker
  stale until rebuilt (see ``kvroute.events.tracker``).

Quote the value in a shell: ``;`` separates commands there.

One stream per worker: a vLLM engine run with data parallelism publishes one stream
per rank (port + rank, each with its own seq) behind one URL; that is not supported yet.

Example (two local vLLM replicas connecting to one socket kvroute binds)::

    --kv-events 'http://127.0.0.1:8001=tcp://127.0.0.1:5557;bind;topic=kv@8001'
    --kv-events 'http://127.0.0.1:8002=tcp://127.0.0.1:5557;bind;topic=kv@8002'
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

_BIND_ONLY_HOSTS = ("*", "0.0.0.0", "::", "[::]")
_SCHEMES = ("tcp://", "ipc://", "inproc://")


class KvEventsSpecError(ValueError):
    """A ``--kv-events`` value is invalid; the message says which part and why."""


@dataclass(frozen=True, slots=True)
class KvEventSource:
    """Where one worker's KV events come from."""

    worker: str
    endpoint: str
    topic: str | None = None  # None: every message on the socket
    replay_endpoint: str | None = None
    bind: bool = False

    @property
    def socket_key(self) -> tuple[str, bool]:
        """Sources with the same key share one SUB socket."""
        return (self.endpoint, self.bind)


def parse_kv_events_spec(spec: str) -> KvEventSource:
    """Parse one ``--kv-events`` value (syntax in the module docstring)."""
    head, _, opts = spec.strip().partition(";")
    url, sep, endpoint = head.partition("=")
    if not sep:
        raise KvEventsSpecError(f"--kv-events {spec!r}: expected WORKER_URL=ENDPOINT")
    worker = _worker_url(url.strip(), spec)
    endpoint = _endpoint(endpoint.strip(), spec)
    topic: str | None = None
    replay: str | None = None
    direction: bool | None = None
    for opt in filter(None, (o.strip() for o in opts.split(";"))):
        key, has_value, value = opt.partition("=")
        key = key.strip().lower()
        if key == "topic" and has_value:
            topic = value
        elif key == "replay" and has_value:
            replay = _endpoint(value.strip(), spec)
        elif key in ("bind", "connect") and not has_value:
            if direction is not None:
                raise KvEventsSpecError(f"--kv-events {spec!r}: give bind or connect once")
            direction = key == "bind"
        else:
            raise KvEventsSpecError(
                f"--kv-events {spec!r}: unknown option {opt!r} "
                "(expected topic=..., replay=..., bind or connect)"
            )
    bind_only = _host(endpoint) in _BIND_ONLY_HOSTS
    if direction is False and bind_only:
        raise KvEventsSpecError(f"--kv-events {spec!r}: cannot connect to a wildcard host")
    bind = bool(direction) or bind_only
    if replay is not None and _host(replay) in _BIND_ONLY_HOSTS:
        raise KvEventsSpecError(f"--kv-events {spec!r}: replay endpoint needs a real host")
    return KvEventSource(worker, endpoint, topic, replay, bind)


def parse_kv_events(
    specs: Iterable[str], worker_urls: Iterable[str] | None = None
) -> list[KvEventSource]:
    """Parse every ``--kv-events`` value and check that they fit together.

    One source per worker; workers sharing a socket need distinct topics; with
    ``worker_urls``, every source must name one of them.
    """
    sources = [parse_kv_events_spec(s) for s in specs]
    check_sources(sources, worker_urls)
    return sources


def check_sources(
    sources: Iterable[KvEventSource], worker_urls: Iterable[str] | None = None
) -> None:
    known = None if worker_urls is None else {u.strip().rstrip("/") for u in worker_urls}
    seen: set[str] = set()
    by_socket: dict[tuple[str, bool], list[KvEventSource]] = {}
    for s in sources:
        if s.worker in seen:
            raise KvEventsSpecError(f"--kv-events: two sources for worker {s.worker}")
        seen.add(s.worker)
        if known is not None and s.worker not in known:
            raise KvEventsSpecError(f"--kv-events: {s.worker} is not in --worker-urls")
        by_socket.setdefault(s.socket_key, []).append(s)
    for (endpoint, _), group in by_socket.items():
        if len(group) == 1:
            continue
        topics = [s.topic for s in group]
        if None in topics or len(set(topics)) != len(topics):
            raise KvEventsSpecError(
                f"--kv-events: workers sharing {endpoint} need distinct topics "
                f"({', '.join(s.worker for s in group)})"
            )


def _worker_url(url: str, spec: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise KvEventsSpecError(f"--kv-events {spec!r}: {url!r} is not an http(s) worker URL")
    return url.rstrip("/")


def _endpoint(endpoint: str, spec: str) -> str:
    if not endpoint.startswith(_SCHEMES):
        raise KvEventsSpecError(
            f"--kv-events {spec!r}: endpoint {endpoint!r} must start with tcp://, ipc:// "
            "or inproc://"
        )
    if endpoint.startswith("tcp://"):
        host, colon, port = endpoint[len("tcp://") :].rpartition(":")
        if not colon or not host or not (port.isdigit() or port == "*"):
            raise KvEventsSpecError(f"--kv-events {spec!r}: {endpoint!r} needs host:port")
    return endpoint


def _host(endpoint: str) -> str:
    if not endpoint.startswith("tcp://"):
        return ""
    return endpoint[len("tcp://") :].rpartition(":")[0]
