"""KV cache events in vLLM's format over ZMQ, published by ``kvroute sim-worker``.

Wire format (docs/kv-events.md): a PUB socket sends ``[topic, seq (8-byte big-endian), payload]``
where ``payload = msgpack([ts, [event, ...], data_parallel_rank])`` and each event is a
map as current vLLM sends it (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``).
The socket binds when the endpoint has ``*``, ``::``, ``ipc://`` or ``inproc://`` and
connects otherwise, like vLLM. ``seq`` starts at 0 and counts batches.

Replay: with a replay endpoint, a ROUTER socket answers a request ``[start seq]`` (from a
DEALER: ``[b"", start seq]``) with ``[seq, payload]`` for every buffered batch from
``start`` on (the last ``buffer_size``), then ``[0xFF * 8, b""]``. It runs in its own
thread; the buffer is shared under a lock.

Fault injection for tests (``POST /sim/fault``): ``drop_next(n)`` consumes the next ``n``
sequence numbers without sending (a subscriber sees a gap; the batches stay in the replay
buffer, so replay can recover them), ``reset_seq()`` restarts numbering at 0 as an engine
restart would.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

END_OF_REPLAY = b"\xff" * 8


def _binds(endpoint: str) -> bool:
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        *,
        dp_rank: int = 0,
        buffer_size: int = 10_000,
    ) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        if _binds(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = endpoint
        self._topic = topic.encode()
        self.dp_rank = dp_rank
        self.seq = 0
        self.sent = 0
        self.dropped = 0
        self._drop_next = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if replay_endpoint:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(replay_endpoint)
            self._replay_thread = threading.Thread(
                target=self._serve_replay, args=(router,), name="kv-replay", daemon=True
            )
            self._replay_thread.start()

    def publish(self, events: list[dict[str, Any]]) -> None:
        """Send one batch (one sequence number)."""
        payload: bytes = msgpack.packb([time.time(), events, self.dp_rank], use_bin_type=True)
        seq = self.seq
        self.seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        if self._drop_next > 0:
            self._drop_next -= 1
            self.dropped += 1
            return
        self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        self.sent += 1

    def drop_next(self, n: int) -> None:
        self._drop_next += max(n, 0)

    def reset_seq(self) -> None:
        self.seq = 0
        with self._lock:
            self._buffer.clear()

    def _serve_replay(self, router: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                frames = router.recv_multipart()
                ident, rest = frames[0], [f for f in frames[1:] if f]
                start = int.from_bytes(rest[0], "big") if rest else 0
                with self._lock:
                    batches = [(s, p) for s, p in self._buffer if s >= start]
                for s, p in batches:
                    router.send_multipart([ident, b"", s.to_bytes(8, "big"), p])
                router.send_multipart([ident, b"", END_OF_REPLAY, b""])
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
        with contextlib.suppress(zmq.ZMQError):
            self._pub.close(linger=0)
        self._ctx.term()

    # ------------------------------------------------------------------ events

    @staticmethod
    def block_stored(
        hashes: list[int],
        parent: int | None,
        token_ids: list[int],
        block_size: int,
        lora: tuple[int, str] | None = None,
    ) -> dict[str, Any]:
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": token_ids,
            "block_size": block_size,
            "lora_id": lora[0] if lora else None,
            "medium": "GPU",
            "lora_name": lora[1] if lora else None,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }

    @staticmethod
    def block_removed(hashes: list[int]) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}

    @staticmethod
    def all_cleared() -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}
