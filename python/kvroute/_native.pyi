"""Type stubs for the Rust extension ``kvroute._native``."""

from collections.abc import Iterable
from typing import TypeAlias, final

from typing_extensions import Buffer

_Tokens: TypeAlias = Iterable[int] | Buffer
"""Token IDs: a list/tuple/iterable of ints in [0, 2**32), or a 1-D buffer of uint32
(``array.array('I')``, ``numpy.ndarray`` of ``uint32``) which crosses without per-element
conversion."""

@final
class PrefixIndex:
    """Approximate prefix index over token IDs for a fleet of workers.

    Semantics are one radix tree per worker; the implementation shares one tree whose
    nodes record their holders, so a lookup costs the same for 2 or 1,000 workers.
    Thread-safe; the GIL is released while the index works. A call that raises leaves
    the index unchanged.
    """

    def __new__(cls, max_tokens_per_worker: int | None = None) -> PrefixIndex:
        """Create an empty index.

        ``max_tokens_per_worker``: budget of cached tokens per worker (mirroring the
        engine's KV capacity); inserts past it evict that worker's least recently used
        tokens at once. None means unbounded. Raises ValueError if negative, TypeError
        if not an int.
        """

    @property
    def max_tokens_per_worker(self) -> int | None:
        """The per-worker budget, or None when unbounded."""

    def insert(self, worker: str, tokens: _Tokens) -> None:
        """Record that ``worker`` now holds ``tokens`` (and every prefix of it).

        Refreshes the LRU position of the whole prefix for that worker and evicts its
        least recently used tokens if it goes over budget. Registers unknown workers.
        Raises ValueError for token IDs outside [0, 2**32) and TypeError for non-ints.
        """

    def match(self, tokens: _Tokens) -> dict[str, int]:
        """Matched prefix length per worker, for every worker holding at least one token."""

    def longest_match(self, tokens: _Tokens) -> tuple[int, list[str]]:
        """The longest prefix of ``tokens`` any worker holds, and all workers holding it.

        ``(0, [])`` when nothing matches. Its cost does not grow with the fleet size
        (beyond the returned list); this is what routing policies call.
        """

    def remove_worker(self, worker: str) -> None:
        """Forget ``worker`` and everything it holds. No-op for an unknown worker."""

    def add_worker(self, worker: str) -> None:
        """Register ``worker`` with nothing cached. No-op if it is known."""

    def cached_tokens(self, worker: str) -> int:
        """Tokens ``worker`` is predicted to hold (0 for an unknown worker)."""

    def workers(self) -> list[str]:
        """Known workers, in registration order."""

    def clear(self) -> None:
        """Forget every cached prefix; workers stay registered with 0 tokens."""

    def stats(self) -> dict[str, int]:
        """Counters: ``nodes``, ``stored_tokens`` (each shared prefix once),
        ``cached_tokens`` (sum over workers), ``memory_bytes`` (estimated heap bytes),
        ``evicted_tokens`` (by budget, since creation or the last ``clear``)."""

    def check_invariants(self) -> None:
        """Raise AssertionError if an internal invariant is broken (for tests)."""

__all__ = ["PrefixIndex"]
