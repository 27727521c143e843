"""Type stubs for the Rust extension ``kvroute._native``."""

import array
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeAlias, final

from typing_extensions import Buffer

@final
class TokenIds:
    """A prompt's token IDs as ``PrefixIndex.lookup`` converted them (immutable): pass it
    wherever tokens are taken (the decision's ``insert``) to skip converting and copying
    the prompt again. It also keeps the lookup's walk: an ``insert`` into the same index,
    unchanged since, starts below the nodes the tokens matched whole (same result)."""

    def __len__(self) -> int: ...

_Tokens: TypeAlias = Iterable[int] | Buffer | TokenIds
"""Token IDs: a list/tuple/iterable of ints in [0, 2**32), or a 1-D buffer of uint32
(``array.array('I')``, ``numpy.ndarray`` of ``uint32``) which crosses without per-element
conversion; ``bytes``/``bytearray`` are one token per byte (widened in one native pass);
a ``TokenIds`` from ``lookup`` is read as it is. A byte-token index
(``PrefixIndex(byte_tokens=True)``) takes the same, refusing IDs above 255."""

@final
class PrefixIndex:
    """Approximate prefix index over token IDs for a fleet of workers.

    Semantics are one radix tree per worker; the implementation shares one tree whose
    nodes record their holders, so a lookup costs the same for 2 or 1,000 workers.
    Thread-safe; the GIL is released while the index works. A call that raises leaves
    the index unchanged.
    """

    def __new__(
        cls, max_tokens_per_worker: int | None = None, *, byte_tokens: bool = False
    ) -> PrefixIndex:
        """Create an empty index.

        ``max_tokens_per_worker``: budget of cached tokens per worker (mirroring the
        engine's KV capacity); inserts past it evict that worker's least recently used
        tokens at once. None means unbounded. Raises ValueError if negative, TypeError
        if not an int.

        ``byte_tokens``: the tokens are bytes (IDs 0-255), stored one byte each: the
        no-tokenizer mode's UTF-8 prompts, with the same answers as an index of their
        bytes as u32 IDs in a quarter of the memory. Its methods refuse IDs above 255
        (ValueError).
        """

    @property
    def max_tokens_per_worker(self) -> int | None:
        """The per-worker budget, or None when unbounded."""

    @property
    def evicted_tokens(self) -> int:
        """Tokens evicted by budget since creation (or the last ``clear``): 0 while no
        budget has bound (``stats()["evicted_tokens"]`` without its walk over the
        workers)."""

    @property
    def byte_tokens(self) -> bool:
        """Whether the tokens are bytes, stored one byte each."""

    def insert(self, worker: str, tokens: _Tokens) -> int:
        """Record that ``worker`` now holds ``tokens`` (and every prefix of it).

        Refreshes the LRU position of the whole prefix for that worker and evicts its
        least recently used tokens if it goes over budget. Registers unknown workers.
        Returns how many leading tokens of ``tokens`` the worker held before (what
        ``rollback`` needs). Raises ValueError for token IDs outside [0, 2**32) and
        TypeError for non-ints.
        """

    def rollback(self, worker: str, tokens: _Tokens, keep: int) -> int:
        """Undo an ``insert`` the worker refused: ``worker`` stops holding ``tokens``
        past their first ``keep`` tokens (``keep`` is what ``insert`` returned), except
        what another of its cached prefixes still passes through. Returns the tokens
        dropped; 0 for an unknown worker. Raises like ``insert`` for bad tokens.
        """

    def match(self, tokens: _Tokens) -> dict[str, int]:
        """Matched prefix length per worker, for every worker holding at least one token."""

    def lookup(self, tokens: _Tokens) -> tuple[dict[str, int], int, list[str], TokenIds]:
        """``(match(tokens), *longest_match(tokens), ids)`` from one walk of the tree and
        one crossing of the tokens: what a routing decision reads (the same answers, in
        the same order, as the two calls), and ``ids``, the tokens as converted, for the
        decision's ``insert``."""

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

    def set_worker_budget(self, worker: str, max_tokens: int | None) -> int:
        """Give ``worker`` its own budget (None: back to the index's), registering it
        if unknown; evicts its least recently used tokens down to it at once and
        returns how many were evicted. Raises like the constructor on a bad budget."""

    def worker_budget(self, worker: str) -> int | None:
        """The budget that applies to ``worker``: its own, else the index's (None:
        unbounded)."""

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

class UnknownParentError(LookupError):
    """A BlockStored event names a parent block the index does not know: an earlier
    event was lost, so the worker's state cannot be continued from this event."""

@final
class BlockIndex:
    """What each worker really caches, from the engines' KV cache events (precise mode).

    Blocks are keyed by a chain hash of their token IDs computed by kvroute (never the
    engine's own hash, which is not reproducible); a per-worker map from the engine's
    hash to that key lets ``removed`` apply. Matches count whole leading blocks.
    """

    def __new__(cls) -> BlockIndex: ...
    def stored(
        self,
        worker: str,
        parent_hash: int | None,
        block_hashes: Iterable[int],
        token_ids: _Tokens,
        block_size: int,
    ) -> None:
        """Apply ``BlockStored``: ``token_ids`` holds every block's tokens in order.

        Hashes are ints (u64, or i64 as SGLang sends them). Raises UnknownParentError
        when ``parent_hash`` is unknown for this worker and ValueError when the tokens
        do not fit the blocks; the index is unchanged then.
        """

    def removed(self, worker: str, block_hashes: Iterable[int]) -> int:
        """Apply ``BlockRemoved``; returns how many of the hashes were known."""

    def clear_worker(self, worker: str) -> None:
        """Apply ``AllBlocksCleared``, or drop a worker's state after a restart."""

    def remove_worker(self, worker: str) -> None:
        """Forget the worker entirely."""

    def match(self, tokens: _Tokens) -> dict[str, int]:
        """Tokens in whole leading blocks held, per worker holding at least one block."""

    def cached_tokens(self, worker: str) -> int:
        """Tokens held by the worker (blocks x block size)."""

    def cached_blocks(self, worker: str) -> int:
        """Distinct blocks held by the worker."""

    def block_size(self, worker: str) -> int | None:
        """The worker's block size as reported by its events, None before any."""

    def workers(self) -> list[str]:
        """Workers that have sent events."""

    def distinct_blocks(self) -> int:
        """Distinct blocks over the whole fleet."""

def block_digest_keys(tokens: _Tokens) -> array.array[int]:
    """The state store's tree keys for ``tokens``: two u32 per whole block of 16 tokens
    (the block's 64-bit digest, low half first), as an ``array.array('I')``; equal to
    ``kvroute.fleet.shared.digests.block_digests(tokens).view(numpy.uint32)``."""

# Exact byte-level BPE (rust/src/bpe/; built and checked by kvroute.routing.native_bpe).

@final
class BpeEncoder:
    """Exact byte-level BPE for the pre-tokenizers of Qwen2/3, Llama 3 and DeepSeek V3:
    a hand-written pre-tokenizer for their exact regexes, Unicode classes as the
    ``tokenizers`` regex engine has them, and ``tokenizers``' merge procedure over the
    merge list. Immutable and thread-safe; the GIL is released while it works.
    """

    def __new__(
        cls,
        vocab: Mapping[bytes, int],
        merges: Iterable[tuple[bytes, bytes]],
        patterns: Sequence[str],
        ignore_merges: bool = False,
        refused: _Tokens | None = None,
    ) -> BpeEncoder:
        """Build from the vocabulary (each token's bytes and ID, special tokens left
        out), the merge list in order (each pair's bytes), the pre-tokenizer's regexes in
        order and the model's ``ignore_merges``. ``refused``: code points whose texts
        ``encode`` declines. Raises ValueError when the patterns are not a scheme it
        reproduces (exact strings), or the merges name tokens the vocabulary lacks, or a
        byte has no token.
        """

    def encode(self, text: str) -> array.array[int] | None:
        """The token IDs of ``text`` (normalized, special tokens split out) as an
        ``array('I')``, or None when ``text`` holds a refused code point or a lone
        surrogate (encode it the reference way)."""

    def split(self, text: str) -> list[str]:
        """The pre-tokenizer's pieces of ``text``, in order (they join to ``text``)."""

    @property
    def scheme(self) -> str:
        """The pre-tokenizer: ``"qwen2"``, ``"llama3"`` or ``"deepseek-v3"``."""

    @property
    def whole_tokens(self) -> int:
        """Tokens found by one lookup when a piece is exactly one (every token its own
        bytes merge into, with ``ignore_merges`` every token)."""

@final
class SegmentEncoder:
    """Rendered text -> token IDs through a segment cache, in one call with the GIL
    released (``kvroute.routing.segments``): the text is split at the special tokens
    (leftmost, longest), each other piece looked up in an LRU bounded in entries and
    bytes, the pieces not found encoded with the ``BpeEncoder`` and stored. Thread-safe.
    """

    def __new__(
        cls,
        encoder: BpeEncoder,
        specials: Mapping[str, int],
        prefix: Sequence[int],
        unstable: _Tokens | None,
        *,
        speed: tuple[int, int],
        cache_size: int,
        cache_bytes: int,
    ) -> SegmentEncoder:
        """``specials``: the added tokens and their IDs; ``prefix``: the IDs put first
        when special tokens are asked for; ``unstable``: code points whose pieces go back
        to the caller (must hold the encoder's refused ones; none ASCII); ``speed``: the
        encoder's ns per character of an ASCII piece and of any other (the thread rule);
        ``cache_size``/``cache_bytes``: the cache's bounds. Raises ValueError on an
        ASCII code point in ``unstable``."""

    def encode(
        self,
        text: str,
        add_special_tokens: bool = False,
        budget_ns: int | None = None,
        given: Mapping[str, _Tokens] | None = None,
    ) -> array.array[int] | list[str] | None:
        """The IDs of ``text`` as an ``array('I')``; None when encoding the pieces not
        cached would cost more than ``budget_ns`` (nothing done); or the distinct pieces
        holding an ``unstable`` code point, for the caller to encode and pass back in
        ``given``. Raises UnicodeEncodeError on a lone surrogate."""

    @property
    def hits(self) -> int:
        """Pieces found in the cache (per occurrence, special tokens aside)."""

    @property
    def misses(self) -> int:
        """Pieces encoded."""

    @property
    def entries(self) -> int:
        """Entries in the cache."""

    @property
    def bytes(self) -> int:
        """What the entries are counted as, in bytes."""

    def cached(self) -> list[str]:
        """The cached pieces, most recent first."""

    def clear(self) -> None:
        """Empties the cache (the counters stay)."""

@final
class ResistantLine:
    """``y = intercept + slope * x`` fitted robustly to (size, seconds) samples: the work
    model's learned prefill line and decode step per worker (algorithm:
    ``kvroute.routing.load.estimators``). Refitted at each sample; ``prior`` (intercept,
    slope) holds until ``min_samples`` samples came. Not thread-safe (the work model's
    state lives on the event loop)."""

    def __new__(
        cls, slope: float, intercept: float = 0.0, window: int = 16, min_samples: int = 3
    ) -> ResistantLine:
        """``window`` (samples kept per size class) and ``min_samples``: at least 1
        (ValueError otherwise)."""

    def observe(self, x: float, y: float) -> None:
        """Add the sample (``x`` a size, ``y`` seconds) and refit; a sample that is not
        positive and finite is ignored."""

    @property
    def slope(self) -> float: ...
    @property
    def intercept(self) -> float: ...
    @property
    def samples(self) -> int:
        """Samples held (at most ``window`` per size class)."""

    @property
    def learned(self) -> tuple[float, float] | None:
        """(intercept, slope) once ``min_samples`` samples came, else None."""

    @property
    def prior(self) -> tuple[float, float]:
        """(intercept, slope) before any sample."""

    @property
    def window(self) -> int: ...
    @property
    def min_samples(self) -> int: ...
    def class_counts(self) -> list[tuple[int, int]]:
        """(size class, samples held) per class, by class: the class of ``x`` is the bit
        length of its integer part."""

def bpe_char_classes(text: str) -> bytes:
    """One byte of flags per character of ``text`` as ``BpeEncoder`` classifies it: 1
    letter (``\\p{L}``), 2 number (``\\p{N}``), 4 whitespace (``\\s``), 8 mark, 16
    punctuation, 32 symbol."""

__all__ = [
    "BlockIndex",
    "BpeEncoder",
    "PrefixIndex",
    "ResistantLine",
    "SegmentEncoder",
    "TokenIds",
    "UnknownParentError",
    "block_digest_keys",
    "bpe_char_classes",
]
