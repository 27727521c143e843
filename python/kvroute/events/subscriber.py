"""The background thread that receives KV events over ZMQ and feeds the tracker.

One SUB socket per distinct (endpoint, bind/connect): a bound socket can serve many
engines, told apart by topic. Messages are ``[topic, seq, payload]``; a message whose
topic no source claims, or that is not three frames, is counted in ``unrouted`` /
``malformed`` and dropped. The thread polls with a short timeout so ``stop`` returns
promptly, and never touches the asyncio loop: the router only reads the tracker.

Sockets are created, used and closed on the subscriber thread only (ZMQ sockets are
not thread-safe); ``add_source`` / ``remove_source`` hand work to that thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import zmq

from kvroute.events.decode import KvEventDecodeError, parse_seq
from kvroute.events.replay import ZmqReplayer
from kvroute.events.spec import KvEventSource, check_sources
from kvroute.events.tracker import EventTracker

log = logging.getLogger("kvroute.events")

_DRAIN = 1000  # messages read from one socket before looking at the others


@dataclass
class _Sub:
    sock: zmq.Socket[bytes]
    endpoint: str  # as bound (a tcp port of * resolved) or as connected
    routes: dict[str, str] = field(default_factory=dict)  # topic -> worker
    catch_all: str | None = None


class KvEventSubscriber:
    """Receives every configured worker's events on one thread.

    ``start()`` binds/connects every socket and raises if one fails; ``stop()`` asks
    the thread to end and joins it.
    """

    def __init__(
        self,
        sources: Iterable[KvEventSource],
        tracker: EventTracker,
        *,
        poll_interval_s: float = 0.1,
        replay_timeout_s: float = 2.0,
        rcvhwm: int = 100_000,
    ) -> None:
        self.sources: dict[str, KvEventSource] = {}
        for s in sources:
            self.sources[s.worker] = s
        check_sources(self.sources.values())
        self.tracker = tracker
        self.poll_ms = max(1, int(poll_interval_s * 1000))
        self.rcvhwm = rcvhwm
        self.unrouted = 0  # messages whose topic no source claims
        self.malformed = 0  # messages that are not [topic, seq(8 bytes), payload]
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._stop = threading.Event()
        if tracker.replayer is None:
            tracker.replayer = ZmqReplayer(
                self._ctx, timeout_s=replay_timeout_s, should_stop=self._stop.is_set
            )
        for s in self.sources.values():
            tracker.add_worker(s.worker, s.replay_endpoint)
        self._subs: dict[tuple[str, bool], _Sub] = {}
        self._poller = zmq.Poller()
        self._commands: queue.SimpleQueue[tuple[Callable[[], object], Future[object]]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> None:
        """Open every socket on a new thread; raise the first bind/connect error."""
        if self._thread is not None or self._closed:
            raise RuntimeError("a subscriber starts once")
        ready: Future[object] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="kvroute-kv-events", daemon=True
        )
        self._thread.start()
        try:
            ready.result(timeout=timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread and close the sockets; True if the thread ended in time."""
        self._stop.set()
        t = self._thread
        if t is None:  # never started: no socket exists, only the context
            if not self._closed:
                self._closed = True
                self._ctx.term()
            return True
        t.join(timeout_s)
        if t.is_alive():
            log.error("kv events subscriber did not stop within %.1fs", timeout_s)
            return False
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def endpoints(self) -> dict[str, str]:
        """Worker -> the endpoint its socket is bound or connected to."""
        with self._lock:
            return {
                w: sub.endpoint
                for sub in self._subs.values()
                for w in (*sub.routes.values(), *filter(None, [sub.catch_all]))
            }

    # -- run-time changes (admin API) ------------------------------------------------

    def add_source(self, source: KvEventSource, timeout_s: float = 10.0) -> None:
        """Start receiving events for one more worker (raises if its socket fails)."""
        self.tracker.add_worker(source.worker, source.replay_endpoint)
        if self._thread is None:  # not started: start() opens it with the others
            check_sources([*self.sources.values(), source])
            self.sources[source.worker] = source
            return

        def reopen() -> None:
            self._close(source.worker)
            self._open(source)

        self._call(reopen, timeout_s)

    def remove_source(self, worker: str, timeout_s: float = 10.0) -> None:
        """Stop receiving ``worker``'s events and forget its blocks."""
        if self._thread is None:
            self.sources.pop(worker, None)
        else:
            self._call(lambda: self._close(worker), timeout_s)
        self.tracker.remove_worker(worker)

    def _call(self, fn: Callable[[], object], timeout_s: float) -> None:
        if not self.running:
            raise RuntimeError("kv events subscriber is stopped")
        fut: Future[object] = Future()
        self._commands.put((fn, fut))
        fut.result(timeout=timeout_s)

    # -- the thread ------------------------------------------------------------------

    def _run(self, ready: Future[object]) -> None:
        try:
            for s in list(self.sources.values()):
                self._open(s)
        except BaseException as e:
            ready.set_exception(e)
            self._close_all()
            return
        ready.set_result(None)
        try:
            while not self._stop.is_set():
                self._run_commands()
                for sock, _ in self._poller.poll(self.poll_ms):
                    self._drain(sock)
        except Exception:
            log.exception("kv events subscriber crashed")
        finally:
            self._close_all()

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def _drain(self, sock: zmq.Socket[bytes]) -> None:
        sub = next((s for s in self._subs.values() if s.sock is sock), None)
        if sub is None:
            return
        for _ in range(_DRAIN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(sub, frames)

    def _handle(self, sub: _Sub, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.malformed += 1
            return
        topic = frames[0].decode("utf-8", errors="replace")
        worker = sub.routes.get(topic, sub.catch_all)
        if worker is None:
            self.unrouted += 1
            return
        try:
            seq = parse_seq(frames[1])
        except KvEventDecodeError:
            self.malformed += 1
            return
        try:
            self.tracker.feed(worker, seq, frames[2])
        except Exception:  # a bug must not kill the thread that feeds every worker
            log.exception("kv events from %s: failed to apply batch %d", worker, seq)

    def _open(self, source: KvEventSource) -> None:
        with self._lock:
            key = source.socket_key
            sub = self._subs.get(key)
            if sub is not None:
                others = [self.sources[w] for w in self._workers(sub) if w != source.worker]
                check_sources([*others, source])
            else:
                sock = self._ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
                if "[" in source.endpoint:  # tcp://[v6 address]:port
                    sock.setsockopt(zmq.IPV6, 1)
                try:
                    if source.bind:
                        sock.bind(source.endpoint)
                        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
                    else:
                        sock.connect(source.endpoint)
                        endpoint = source.endpoint
                except zmq.ZMQError as e:
                    sock.close(linger=0)
                    verb = "bind" if source.bind else "connect"
                    raise OSError(f"kv events: cannot {verb} {source.endpoint}: {e}") from e
                sub = self._subs[key] = _Sub(sock, endpoint)
                self._poller.register(sock, zmq.POLLIN)
            if source.topic is None:
                sub.catch_all = source.worker
                sub.sock.setsockopt(zmq.SUBSCRIBE, b"")
            else:
                sub.routes[source.topic] = source.worker
                sub.sock.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            self.sources[source.worker] = source

    def _close(self, worker: str) -> None:
        with self._lock:
            source = self.sources.pop(worker, None)
            if source is None:
                return
            sub = self._subs.get(source.socket_key)
            if sub is None:
                return
            if source.topic is None:
                sub.catch_all = None
                sub.sock.setsockopt(zmq.UNSUBSCRIBE, b"")
            else:
                sub.routes.pop(source.topic, None)
                sub.sock.setsockopt(zmq.UNSUBSCRIBE, source.topic.encode())
            if not self._workers(sub):
                self._poller.unregister(sub.sock)
                sub.sock.close(linger=0)
                del self._subs[source.socket_key]

    @staticmethod
    def _workers(sub: _Sub) -> list[str]:
        return [*sub.routes.values(), *([sub.catch_all] if sub.catch_all else [])]

    def _close_all(self) -> None:
        with self._lock:
            for sub in self._subs.values():
                sub.sock.close(linger=0)
            self._subs.clear()
            self._poller = zmq.Poller()
        self._ctx.term()
