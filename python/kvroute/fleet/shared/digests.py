"""The prefix index keyed by block digests, so that router replicas can share it.

A routing decision is shared as (worker, one 64-bit digest per whole block of the
prompt's tokens): compact (8 bytes per ``BLOCK_SIZE`` tokens), never the prompt's text or
token IDs, and the same on every router that tokenizes the same prompt.

Digest of block ``i``: its ``BLOCK_SIZE`` token IDs times fixed odd multipliers, summed
and mixed (splitmix64's finaliser). ``block_digests`` computes them with numpy and is the
reference; the index takes them from the extension (``_native.block_digest_keys``, one
pass, equal bit for bit: tested on random prompts), since on the request path numpy's
temporaries for a few hundred blocks cost tens of microseconds. The
digests are not chained: the radix tree chains them, since a node's key is its path from
the root, so block ``i`` is found only under the same blocks ``0..i-1``. Constants are
fixed, so every router, on any host, computes the same digests.

``DigestIndex`` wraps ``PrefixIndex`` with the same methods the policies call
(``match``, ``longest_match``, ``lookup``, ``insert``, ...), and keys the tree by the digest chain
(each 64-bit digest as two u32 keys). Local decisions and the peers' published ones go
into this one tree, under one per-worker budget, so every router applies the same
inserts under the same budget and evicts the same prefixes (up to the order in which
inserts arrive). Lengths come back in tokens: whole blocks only, so a match is at most
``BLOCK_SIZE - 1`` tokens shorter than the token-keyed index would say (engines cache
whole blocks too). Without ``--state-store`` the router keeps its token-keyed index.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvroute._native import PrefixIndex, block_digest_keys
from kvroute.routing.prompts import token_array

BLOCK_SIZE = 16
_U64 = np.uint64
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64 finaliser, element-wise (uint64 arithmetic wraps)."""
    x = x ^ (x >> _U64(30))
    x = x * _M1
    x = x ^ (x >> _U64(27))
    x = x * _M2
    return x ^ (x >> _U64(31))


_MULT = _mix(np.arange(1, BLOCK_SIZE + 1, dtype=_U64) * _U64(0x9E3779B97F4A7C15)) | _U64(1)


def block_digests(tokens: Sequence[int] | npt.NDArray[Any]) -> npt.NDArray[np.uint64]:
    """One 64-bit digest per whole block of ``tokens`` (a partial last block is left out)."""
    t = tokens if isinstance(tokens, np.ndarray) else token_array(tokens)
    nb = len(t) // BLOCK_SIZE
    if nb == 0:
        return np.empty(0, dtype=_U64)
    blocks = t[: nb * BLOCK_SIZE].astype(_U64, copy=False).reshape(nb, BLOCK_SIZE)
    with np.errstate(over="ignore"):
        return _mix((blocks * _MULT).sum(axis=1, dtype=_U64))


class DigestIndex:
    """``PrefixIndex`` keyed by block digests; see the module doc.

    ``on_insert(worker, digests)`` is called after every local ``insert`` (the shared
    store publishes it); ``insert_digests`` applies a peer's decision without calling it.
    """

    def __init__(self, max_tokens_per_worker: int | None = None) -> None:
        self.tree = PrefixIndex(self._keys(max_tokens_per_worker))
        self.on_insert: Callable[[str, bytes], None] | None = None
        # The policy matches, then inserts, the same tokens object: digest it once.
        self._last: object = None
        self._last_keys: array.array[int] = array.array("I")

    def keys(self, tokens: Sequence[int] | npt.NDArray[Any]) -> array.array[int]:
        """The tree keys of ``tokens``: each block digest as two u32."""
        if tokens is self._last:
            return self._last_keys
        keys = block_digest_keys(tokens)
        self._last, self._last_keys = tokens, keys
        return keys

    @staticmethod
    def _tokens(keys: int) -> int:
        return (keys // 2) * BLOCK_SIZE

    @staticmethod
    def _keys(tokens: int | None) -> int | None:
        """A budget in tokens as tree keys: two per whole block (at least one block)."""
        return None if tokens is None else 2 * max(1, tokens // BLOCK_SIZE)

    @property
    def max_tokens_per_worker(self) -> int | None:
        keys = self.tree.max_tokens_per_worker
        return None if keys is None else self._tokens(keys)

    @property
    def evicted_tokens(self) -> int:
        """Tokens evicted by budget (whole blocks), as ``PrefixIndex.evicted_tokens``."""
        return self._tokens(self.tree.evicted_tokens)

    def worker_budget(self, worker: str) -> int | None:
        """The budget that applies to ``worker`` in tokens: its own, else the index's."""
        keys = self.tree.worker_budget(worker)
        return None if keys is None else self._tokens(keys)

    def set_worker_budget(self, worker: str, max_tokens: int | None) -> int:
        """Give ``worker`` its own budget in tokens (None: the index's); evicts at once.
        Every replica reads the same engines, so they set the same budgets and, applying
        the same inserts, evict alike."""
        return self._tokens(self.tree.set_worker_budget(worker, self._keys(max_tokens)))

    def insert(self, worker: str, tokens: Sequence[int]) -> None:
        keys = self.keys(tokens)
        if len(keys):
            self.tree.insert(worker, keys)
            if self.on_insert is not None:
                self.on_insert(worker, keys.tobytes())

    def insert_digests(self, worker: str, digests: bytes) -> None:
        """Apply a decision published by another router (``len(digests) % 8 == 0``)."""
        keys = np.frombuffer(digests, dtype=np.uint32)
        if len(keys):
            self.tree.insert(worker, keys)

    def match(self, tokens: Sequence[int]) -> dict[str, int]:
        keys = self.keys(tokens)
        if not len(keys):
            return {}
        return {w: self._tokens(n) for w, n in self.tree.match(keys).items() if n >= 2}

    def longest_match(self, tokens: Sequence[int]) -> tuple[int, list[str]]:
        keys = self.keys(tokens)
        if not len(keys):
            return 0, []
        n, holders = self.tree.longest_match(keys)
        if n % 2:  # a digest's first half matched, its second did not
            per = self.match(tokens)
            best = max(per.values(), default=0)
            return (best, [w for w, m in per.items() if m == best]) if best else (0, [])
        return self._tokens(n), holders

    def lookup(self, tokens: Sequence[int]) -> tuple[dict[str, int], int, list[str], Sequence[int]]:
        """``(match(tokens), *longest_match(tokens), tokens)`` from one walk of the tree
        (``tokens`` for the decision's ``insert``: its digests are kept for it)."""
        keys = self.keys(tokens)
        if not len(keys):
            return {}, 0, [], tokens
        got, n, holders, _ = self.tree.lookup(keys)
        per = {w: self._tokens(m) for w, m in got.items() if m >= 2}
        if n % 2:  # as longest_match: a digest's first half matched, its second did not
            best = max(per.values(), default=0)
            return per, best, [w for w, m in per.items() if m == best] if best else [], tokens
        return per, self._tokens(n), holders, tokens

    def remove_worker(self, worker: str) -> None:
        self.tree.remove_worker(worker)

    def add_worker(self, worker: str) -> None:
        self.tree.add_worker(worker)

    def cached_tokens(self, worker: str) -> int:
        return self._tokens(self.tree.cached_tokens(worker))

    def workers(self) -> list[str]:
        return self.tree.workers()

    def clear(self) -> None:
        self._last = None
        self.tree.clear()

    def stats(self) -> dict[str, int]:
        s = dict(self.tree.stats())
        for k in ("stored_tokens", "cached_tokens", "evicted_tokens"):
            if k in s:
                s[k] = self._tokens(s[k])
        return s

    def check_invariants(self) -> None:
        self.tree.check_invariants()
