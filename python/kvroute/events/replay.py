"""Ask an engine to resend the event batches kvroute missed.

vLLM's replay socket is a ROUTER. A DEALER sends ``[b"", start_seq (8 bytes BE)]``;
the engine answers with one message per buffered batch whose seq is >= start, then an
end marker whose seq frame is ``0xFF`` × 8. After the empty delimiter, a batch is
``[seq, payload]`` (older vLLM, docs/kv-events.md) or ``[topic, seq, payload]`` (vLLM 0.32);
both are accepted. A batch older than the engine's buffer is simply not sent; the
caller checks that every seq it needs came back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

END_SEQ = b"\xff" * 8


class ReplayError(RuntimeError):
    """The engine did not finish answering a replay request in time."""


class ZmqReplayer:
    """Callable ``(endpoint, start_seq) -> [(seq, payload), ...]`` over a fresh DEALER.

    Sockets are created and closed inside the call, so it runs on whatever thread calls
    it (the subscriber's). ``should_stop`` lets a stopping subscriber abandon a replay.
    """

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        *,
        timeout_s: float = 2.0,
        max_batches: int = 100_000,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.context = context if context is not None else zmq.Context.instance()
        self.timeout_s = timeout_s
        self.max_batches = max_batches
        self.should_stop = should_stop

    def __call__(self, endpoint: str, start_seq: int) -> list[tuple[int, bytes]]:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
            return self._receive(sock, endpoint)
        finally:
            sock.close(linger=0)

    def _receive(self, sock: zmq.Socket[bytes], endpoint: str) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (self.should_stop is not None and self.should_stop()):
                raise ReplayError(f"replay from {endpoint}: no end marker in {self.timeout_s}s")
            if not sock.poll(int(min(left, 0.1) * 1000) + 1):
                continue
            frames = sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:
                frames = frames[1:]  # drop the topic
            if len(frames) != 2 or len(frames[0]) != 8:
                raise ReplayError(f"replay from {endpoint}: unexpected reply of {len(frames)}")
            if frames[0] == END_SEQ:
                return out
            out.append((int.from_bytes(frames[0], "big"), frames[1]))
            if len(out) > self.max_batches:
                raise ReplayError(f"replay from {endpoint}: more than {self.max_batches}")
