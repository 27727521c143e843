"""consistent_hash: session affinity on a consistent-hash ring, with bounded load.

The key is the request's session key (``x-session-id`` or ``x-user-id`` header, or the
body's ``user`` field, extracted by the router); without one, the first
``prefix_tokens`` tokens of the prompt. The key's home worker is its successor on the
ring (see ``_ring``); a home worker above ``bounded_load_factor`` times the mean load is
passed over for the next one on the ring, so one busy session cannot sink a worker.
"""

from __future__ import annotations

import array
from collections.abc import Mapping

from kvroute.routing.policies._ring import Ring, hash64
from kvroute.routing.policies.base import Decision, Policy, RouteRequest
from kvroute.routing.prompts import token_array


def prefix_key(tokens: object, n: int) -> bytes:
    head = tokens[:n]  # type: ignore[index]
    if isinstance(head, bytes):  # no tokenizer: the key of the bytes as u32 IDs
        return token_array(head).tobytes()
    try:
        return memoryview(head).cast("B").tobytes()
    except TypeError:
        return array.array("I", head).tobytes()


class ConsistentHash(Policy):
    name = "consistent_hash"
    needs_session = True

    def __init__(self, *, prefix_tokens: int = 256, load_factor: float = 1.25) -> None:
        self.prefix_tokens = prefix_tokens
        self._ring = Ring(load_factor)

    def select(self, request: RouteRequest, loads: Mapping[str, int]) -> Decision:
        if request.session_key is not None:
            key = b"s:" + request.session_key.encode()
        else:
            key = b"p:" + prefix_key(request.tokens, self.prefix_tokens)
        worker, home = self._ring.pick(hash64(key), loads)
        return Decision(worker, "session" if home else "overflow")
