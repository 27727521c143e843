"""``--kv-events auto``: follow each worker's KV events where its engine says it publishes them.

Precise mode otherwise needs one ``--kv-events URL=ENDPOINT`` per worker, which a fleet
found by DNS or Kubernetes cannot give. The engines tell:

* vLLM answers ``GET /kv_event_sources`` with its publisher's resolved configuration
  per data-parallel rank: ``{"0": {"enable_kv_cache_events": true, "publisher": "zmq",
  "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv", ...}}``
  (``{}`` with events off).
* SGLang's ``GET /get_server_info`` carries its ``--kv-events-config`` argument, a JSON
  string of the same fields (null with events off).

From that configuration, ``source_for`` builds the ``KvEventSource`` an operator would
have written, by the engines' own rule for which side binds (vLLM's
``ZmqEventPublisher``): an endpoint whose host is ``*`` or contains ``::``, or an
``ipc://`` path, is bound by the engine, and kvroute connects to it, the wildcard
replaced by the worker's host. An engine whose endpoint names a host connects *out*, to
a socket someone else binds: that is a deployment choice kvroute cannot guess (give that
worker ``--kv-events URL=ENDPOINT;bind``), so the worker stays approximate, with the
reason logged once. The replay endpoint (always bound by the engine) is rewritten
alike. One stream per worker: an engine with several data-parallel ranks publishes one
per rank behind one URL, which precise mode does not follow (approximate, logged).

``AutoEvents`` asks each worker after a healthy check (``kvroute.fleet.health``), a
bounded number of times per appearance, and drops the subscription of a worker that
left the fleet. Explicit ``--kv-events`` values win over what an engine tells.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson

from kvroute.events.spec import KvEventSource, KvEventsSpecError

if TYPE_CHECKING:
    from kvroute.events.subscriber import KvEventSubscriber

log = logging.getLogger("kvroute.events.auto")

AUTO = "auto"
# Readings tried per worker appearance before it is left approximate (an engine that
# answers neither endpoint: an older vLLM, events off).
ASK_ATTEMPTS = 3


def is_auto(values: Collection[str]) -> bool:
    """Is ``auto`` among the ``--kv-events`` values?"""
    return any(v.strip().lower() == AUTO for v in values)


def explicit(values: Collection[str]) -> list[str]:
    """The ``--kv-events`` values other than ``auto``."""
    return [v for v in values if v.strip().lower() != AUTO]


def vllm_config(body: bytes) -> Mapping[str, Any] | None:
    """The publisher configuration in vLLM's ``/kv_event_sources`` answer: None when it
    publishes nothing; KvEventsSpecError when the answer is not one rank's config."""
    try:
        ranks = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise KvEventsSpecError("its /kv_event_sources answer is not JSON") from None
    if not isinstance(ranks, dict):
        raise KvEventsSpecError("its /kv_event_sources answer is not a JSON object")
    configs = [c for c in ranks.values() if isinstance(c, dict)]
    if not configs:
        return None
    if len(ranks) > 1:
        raise KvEventsSpecError(
            f"it publishes one stream per data-parallel rank ({len(ranks)} ranks behind one "
            "URL), which precise mode does not follow"
        )
    return configs[0]


def sglang_config(body: bytes) -> Mapping[str, Any] | None:
    """The ``kv_events_config`` in SGLang's ``/get_server_info`` answer: None when absent
    (events off, or not SGLang); KvEventsSpecError when it cannot be read."""
    try:
        info = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(info, dict):
        return None
    raw = info.get("kv_events_config")
    if not raw:
        return None
    if isinstance(raw, str):
        try:
            raw = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise KvEventsSpecError("its kv_events_config is not JSON") from None
    if not isinstance(raw, dict):
        raise KvEventsSpecError("its kv_events_config is not a JSON object")
    for key in ("dp_size", "data_parallel_size"):
        n = info.get(key)
        if isinstance(n, int) and n > 1 and info.get("enable_dp_attention"):
            raise KvEventsSpecError(
                f"it publishes one stream per data-parallel rank ({key}={n}), which "
                "precise mode does not follow"
            )
    return raw


def _bound_by_engine(endpoint: str) -> bool:
    """vLLM's rule (``ZmqEventPublisher._is_bind_endpoint``)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _reachable(endpoint: str, host: str) -> str:
    """``endpoint`` as reachable from the router: a wildcard host becomes ``host``."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    rest = endpoint[len("tcp://") :]
    addr, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise KvEventsSpecError(f"endpoint {endpoint!r} has no port")
    if addr in ("*", "0.0.0.0", "::", "[::]", ""):
        return f"tcp://{host}:{port}"
    return endpoint


def source_for(worker: str, config: Mapping[str, Any]) -> KvEventSource | None:
    """The source to follow for ``worker`` from its engine's publisher ``config``; None
    when events are off; KvEventsSpecError (the reason) when it cannot be followed."""
    publisher = config.get("publisher")
    if config.get("enable_kv_cache_events") is False or publisher == "null":
        return None
    if publisher not in (None, "zmq"):
        raise KvEventsSpecError(f"its publisher is {publisher!r}, not zmq")
    endpoint = config.get("endpoint") or "tcp://*:5557"
    if not isinstance(endpoint, str):
        raise KvEventsSpecError("its endpoint is not a string")
    if endpoint.startswith("inproc://"):
        raise KvEventsSpecError(f"it publishes in-process ({endpoint})")
    if not _bound_by_engine(endpoint):
        raise KvEventsSpecError(
            f"it connects out to {endpoint} (a socket someone else binds): give it "
            f"--kv-events '{worker}={endpoint};bind' if that is this router"
        )
    parts = urlsplit(worker)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    replay = config.get("replay_endpoint")
    topic = config.get("topic")
    return KvEventSource(
        worker,
        _reachable(endpoint, host),
        topic if isinstance(topic, str) and topic else None,
        _reachable(replay, host) if isinstance(replay, str) and replay else None,
        bind=False,
    )


def source_from_answers(
    worker: str, event_sources: bytes | None, server_info: bytes | None
) -> KvEventSource | None:
    """What to follow for ``worker`` from the bodies of its engine's 200 answers to
    ``GET /kv_event_sources`` (vLLM) and ``GET /get_server_info`` (SGLang), None for an
    endpoint not served: None when it publishes nothing; KvEventsSpecError (the reason)
    when it publishes where kvroute cannot follow."""
    config = vllm_config(event_sources) if event_sources is not None else None
    if config is None and server_info is not None:
        config = sglang_config(server_info)
    return source_for(worker, config) if config is not None else None


Reader = Callable[[str, str], Awaitable[bytes | None]]


class AutoEvents:
    """Which workers' KV events this router follows because their engines said where."""

    def __init__(self, subscriber: KvEventSubscriber) -> None:
        self.subscriber = subscriber
        self.followed: dict[str, KvEventSource] = {}
        self._asked: dict[str, int] = {}
        self._said: dict[str, str] = {}  # the last reason logged per worker
        self._asking: set[str] = set()  # a health check and a new worker's probe overlap

    async def follow(self, worker: str, read: Reader) -> None:
        """Ask ``worker``'s engine where it publishes (``read(worker, path)``: the body of
        a 200 answer, else None) and subscribe, unless known or asked enough."""
        if worker in self.subscriber.sources or worker in self._asking:
            return  # given explicitly (flag, POST /workers), followed, or being asked
        asked = self._asked.get(worker, 0)
        if asked >= ASK_ATTEMPTS:
            return
        self._asked[worker] = asked + 1
        self._asking.add(worker)
        try:
            await self._follow(worker, read)
        finally:
            self._asking.discard(worker)

    async def _follow(self, worker: str, read: Reader) -> None:
        sources = await read(worker, "/kv_event_sources")
        info = None
        try:
            if sources is None or vllm_config(sources) is None:  # not vLLM, or events off
                info = await read(worker, "/get_server_info")
            source = source_from_answers(worker, sources, info)
        except KvEventsSpecError as e:
            self._asked[worker] = ASK_ATTEMPTS  # an answer, not a failure: do not ask again
            self._say(worker, f"KV events of {worker} not followed: {e}; routing it approximately")
            return
        if source is None:
            if self._asked[worker] >= ASK_ATTEMPTS:
                self._say(worker, f"{worker} publishes no KV events; routing it approximately")
            return
        try:
            await asyncio.to_thread(self.subscriber.add_source, source)
        except Exception as e:  # e.g. two engines naming one socket without topics
            self._say(worker, f"KV events of {worker} at {source.endpoint} not followed: {e}")
            return
        self.followed[worker] = source
        log.info(
            "following the KV events of %s at %s (as its engine reports)", worker, source.endpoint
        )

    async def prune(self, current: Collection[str]) -> None:
        """Unsubscribe the workers that left the fleet (and forget what was asked)."""
        for worker in [w for w in self.followed if w not in current]:
            source = self.followed.pop(worker)
            if self.subscriber.sources.get(worker) != source:
                continue  # removed already (DELETE /workers), or given otherwise since
            try:
                await asyncio.to_thread(self.subscriber.remove_source, worker)
            except Exception:  # gone either way
                log.exception("unsubscribing the KV events of %s failed", worker)
        for worker in [w for w in self._asked if w not in current]:
            del self._asked[worker]
            self._said.pop(worker, None)

    def forget(self, worker: str) -> None:
        """``worker`` went down: ask again when it is back (it may come back configured
        otherwise); a subscription stays (ZMQ reconnects by itself)."""
        self._asked.pop(worker, None)
        self._said.pop(worker, None)

    def _say(self, worker: str, message: str) -> None:
        if self._said.get(worker) != message:
            self._said[worker] = message
            log.warning("%s", message)
