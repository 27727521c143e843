"""Block-granular prefix cache of a simulated worker, like vLLM's automatic prefix caching.

* A prompt is cut into full blocks of ``block_size`` tokens (a trailing partial block is
  never cached). Each block is keyed by a chain hash of (parent key, block tokens), so a
  key names the whole prefix up to and including its block; two prompts share a block
  only if they share everything before it.
* Capacity is ``capacity_tokens // block_size`` blocks. A block used by a running
  request is pinned (reference count > 0) and never evicted; unpinned blocks are evicted
  least recently released first. As in vLLM, a request's blocks are released tail first,
  so the end of a prompt goes before its shared beginning.
* A lookup counts leading blocks present, over the first ``n - 1`` tokens: like vLLM,
  the last prompt token is always recomputed to produce logits, so a fully cached prompt
  of 32 tokens in blocks of 16 reports 16 cached tokens.
* Generated tokens take blocks too, as in vLLM: a request's sequence is its prompt
  followed by its output, cut into blocks over the whole sequence (the first output block
  holds the prompt's partial tail). ``admit`` stores and pins the prompt's full blocks;
  as decoding proceeds, ``grow`` stores and pins each block the sequence fills, evicting
  as admission does, and reports it like a prompt block (``BlockStored``). When the
  request ends its output blocks stay cached and evictable like any other. The KV of the
  last sampled token is never computed, so a finished request leaves the blocks of its
  prompt + output minus one token (``sequence``). Output blocks are what a router that
  only sees prompts cannot predict: they take capacity from cached prompts. A partial
  last block (at most one per running request) takes no capacity here.
* Admission (``fits``): an engine starts a request only when the blocks its prompt
  needs beyond those running requests already pin fit into what they leave free
  (cached blocks nobody pins count as free: they are evicted to make room). A request
  that does not fit waits, and the ones behind it too (first come, first served), as
  vLLM's scheduler does when it cannot allocate a waiting request's blocks, and as
  SGLang's does when its token budget is spent. Alone on its engine a request is always
  admitted. vLLM admits a long prompt chunk by chunk and preempts the newest request
  when a running one cannot grow; here a request needs its whole prompt's room at once
  and a decode block that does not fit is just not cached, which is what a preempted
  and recomputed request costs on average, without its churn.

One ``OrderedDict`` holds every block in eviction order; reference counts are kept as
two ``Counter``s (acquired, released) so that admission and release are whole-list
``update``/``map`` calls whose loops run in C. Eviction pops the head and skips pinned
blocks by moving them to the tail; releasing moves a request's blocks to the tail, tail
block first. The order of the unpinned blocks is therefore vLLM's free-block queue.

Keys are 64-bit ints from ``block_keys`` (vectorised with numpy; deterministic across
processes). They double as the "engine hashes" of KV events. Key ``i`` depends only on
blocks ``0..i``, so the keys of a request's whole sequence, computed once at admission,
start with its prompt's keys.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import eq, not_

import numpy as np
import numpy.typing as npt

from kvroute.routing.prompts import token_array

U64 = np.uint64
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MULT_SEED = 0x5EED_B10C

StoreCallback = Callable[[list[int], int | None, list[int], int], None]
"""``(block_hashes, parent_block_hash, token_ids of all those blocks, block_size)``."""
RemoveCallback = Callable[[list[int]], None]
"""``(block_hashes)`` of evicted blocks."""

# What every simulated request generates, repeated (greedy decoding of one fixed answer):
# ``sim.engine`` renders these IDs as text.
OUTPUT_TOKEN_IDS = (279, 3974, 13876, 38835, 34208, 916, 264, 15678, 5679, 1549)
_OUTPUT_ARRAY = np.array(OUTPUT_TOKEN_IDS, dtype=np.uint32)

_mult_cache: dict[int, npt.NDArray[np.uint64]] = {}
_drain = deque[object](maxlen=0).extend  # consume an iterator at C speed


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64 finaliser, element-wise (uint64 arrays wrap silently)."""
    x = x ^ (x >> U64(30))
    x = x * U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> U64(27))
    x = x * U64(0x94D049BB133111EB)
    return x ^ (x >> U64(31))


def _multipliers(block_size: int) -> npt.NDArray[np.uint64]:
    m = _mult_cache.get(block_size)
    if m is None:
        m = _mix(np.arange(block_size, dtype=U64) + U64(_MULT_SEED)) | U64(1)
        _mult_cache[block_size] = m
    return m


def output_ids(n: int) -> npt.NDArray[np.uint32]:
    """The first ``n`` tokens every simulated request generates."""
    return np.resize(_OUTPUT_ARRAY, max(n, 0))


def sequence(
    prompt: Sequence[int] | npt.NDArray[np.uint32], output_len: int
) -> npt.NDArray[np.uint32]:
    """The tokens whose KV a request of ``output_len`` generated tokens leaves cached:
    the prompt and every output token but the last (its KV is never computed)."""
    return np.concatenate((np.asarray(prompt, dtype=np.uint32), output_ids(output_len - 1)))


def block_keys_array(tokens: Sequence[int] | npt.NDArray[np.uint32], block_size: int) -> np.ndarray:
    """Chain keys of the full blocks of ``tokens`` as a uint64 array (one per block).

    Key ``i`` depends on every token of blocks ``0..i`` and on ``i`` itself: each block's
    tokens are hashed (random odd multipliers per position, then a mix), the block hashes
    are weighted by a per-position odd multiplier and summed as a prefix sum, and the
    prefix sums are mixed again with the block count.
    """
    t = np.asarray(tokens)
    nb = t.shape[0] // block_size
    if nb == 0:
        return np.empty(0, dtype=U64)
    blocks = t[: nb * block_size].astype(U64).reshape(nb, block_size)
    h = _mix((blocks * _multipliers(block_size)).sum(axis=1, dtype=U64))
    idx = np.arange(1, nb + 1, dtype=U64)
    pos = _mix(idx * _GOLDEN) | U64(1)
    prefix = np.cumsum(h * pos, dtype=U64)
    return _mix(prefix ^ (idx * _GOLDEN))


def block_keys_batch(
    prompts: Sequence[npt.NDArray[np.uint32]], block_size: int, chunk_tokens: int = 1 << 22
) -> list[np.ndarray]:
    """``block_keys_array`` of many prompts at once (same keys; vectorised per chunk)."""
    out: list[np.ndarray] = []
    i = 0
    mult = _multipliers(block_size)
    while i < len(prompts):
        j, total = i, 0
        while j < len(prompts) and (j == i or total + len(prompts[j]) <= chunk_tokens):
            total += len(prompts[j])
            j += 1
        nbs = np.array([len(p) // block_size for p in prompts[i:j]], dtype=np.int64)
        nb_all = int(nbs.sum())
        if nb_all == 0:
            out.extend(np.empty(0, dtype=U64) for _ in range(j - i))
            i = j
            continue
        flat = np.concatenate(
            [
                np.asarray(p[: n * block_size])
                for p, n in zip(prompts[i:j], nbs.tolist(), strict=True)
            ]
        )
        blocks = flat.astype(U64).reshape(nb_all, block_size)
        h = _mix((blocks * mult).sum(axis=1, dtype=U64))
        starts = np.cumsum(nbs) - nbs
        owner = np.repeat(np.arange(len(nbs)), nbs)
        idx = (np.arange(nb_all, dtype=np.int64) - starts[owner] + 1).astype(U64)
        pos = _mix(idx * _GOLDEN) | U64(1)
        run = np.cumsum(h * pos, dtype=U64)
        # Segment prefix sums: subtract the running total before each prompt (wraps mod 2**64).
        before = np.concatenate((np.zeros(1, dtype=U64), run))[starts]
        prefix = run - before[owner]
        keys = _mix(prefix ^ (idx * _GOLDEN))
        out.extend(np.split(keys, np.cumsum(nbs)[:-1]))
        i = j
    return out


def namespace_of(adapter: str | None, salt: str | None) -> int:
    """The key namespace of requests under LoRA ``adapter`` with ``cache_salt`` ``salt``:
    0 for the base model unsalted, else a non-zero 64-bit value."""
    if not adapter and not salt:
        return 0
    digest = hashlib.blake2b(f"{adapter or ''}\0{salt or ''}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") | 1


def block_keys(tokens: Sequence[int] | npt.NDArray[np.uint32], block_size: int) -> list[int]:
    """``block_keys_array`` as a list of Python ints."""
    keys: list[int] = block_keys_array(tokens, block_size).tolist()
    return keys


@dataclass(slots=True)
class Handle:
    """The blocks a running request pins; give it back to ``PrefixCache.release``.

    ``seq_keys`` are the keys of every full block its sequence will have (prompt, then
    output), ``filled`` how many of them the sequence has reached so far; ``tokens`` is
    the sequence (only kept for store events); ``stalled`` once a block did not fit (no
    later block can be cached: its chain is broken)."""

    keys: list[int]
    generation: int
    seq_keys: list[int] = field(default_factory=list)
    filled: int = 0
    tokens: npt.NDArray[np.uint32] | None = None
    stalled: bool = False


class PrefixCache:
    """Bounded block cache with LRU eviction of unpinned blocks (see module docstring)."""

    def __init__(
        self,
        capacity_tokens: int,
        block_size: int = 16,
        *,
        on_store: StoreCallback | None = None,
        on_remove: RemoveCallback | None = None,
        on_clear: Callable[[], None] | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if capacity_tokens < 0:
            raise ValueError("capacity_tokens must be >= 0")
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self.on_store = on_store
        self.on_remove = on_remove
        self.on_clear = on_clear
        # Every cached block, in eviction order (head = next victim unless pinned).
        self._lru: OrderedDict[int, None] = OrderedDict()
        # Reference counts as two monotone counters (acquired - released), so that both
        # sides are C-speed ``Counter.update`` calls; reset whenever nothing runs.
        self._acq: Counter[int] = Counter()
        self._rel: Counter[int] = Counter()
        self._running = 0
        self._pinned = 0  # blocks with a reference count above 0
        self._generation = 0
        self.queries = 0  # prompt tokens looked up (vLLM prefix_cache_queries)
        self.hits = 0  # of which found cached (vLLM prefix_cache_hits)
        self.evicted_blocks = 0

    # ------------------------------------------------------------------ queries

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size

    @property
    def cached_tokens(self) -> int:
        """Tokens held in cache now (blocks x block size)."""
        return len(self._lru) * self.block_size

    @property
    def num_blocks(self) -> int:
        return len(self._lru)

    @property
    def pinned_blocks(self) -> int:
        """Blocks some running request uses (kept as a count; ``check_invariants``
        recounts it)."""
        return self._pinned

    def fits(self, keys: list[int] | npt.NDArray[np.uint64], n_tokens: int) -> bool:
        """Can a request with these sequence keys (``prepare``'s, or the simulator's
        array) and a prompt of ``n_tokens`` start now (module doc, admission)? Its
        prompt's full blocks that no running request pins must fit into the blocks not
        pinned; alone it always fits."""
        if self._running == 0:
            return True
        n = min(n_tokens // self.block_size, len(keys))
        free = self.capacity_blocks - self._pinned
        if n <= free:
            return True
        acq_get, rel_get = self._acq.get, self._rel.get
        prompt = keys[:n]
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        unpinned: int = sum(
            map(eq, map(acq_get, prompt, repeat(0)), map(rel_get, prompt, repeat(0)))
        )
        return unpinned <= free

    def usage(self) -> float:
        """Fraction of the capacity in use by running requests (vLLM
        ``kv_cache_usage_perc``, 0..1): pinned blocks only. As in vLLM (a cached block no
        request holds sits in its free-block queue and counts as free) and SGLang (its
        ``token_usage`` leaves out the evictable radix cache), a cache full of reusable
        prefixes is not a full engine: it admits the next request by evicting."""
        return self.pinned_blocks / self.capacity_blocks if self.capacity_blocks else 0.0

    def __contains__(self, key: int) -> bool:
        return key in self._lru

    def lookup(self, tokens: Sequence[int] | npt.NDArray[np.uint32]) -> int:
        """Cached tokens for ``tokens`` (leading blocks present), without changing anything."""
        return self.lookup_keys(block_keys(tokens, self.block_size), len(tokens))

    def lookup_keys(self, keys: list[int], n_tokens: int) -> int:
        limit = max(n_tokens - 1, 0) // self.block_size
        blocks = self._lru
        hit = 0
        for k in keys:
            if hit >= limit or k not in blocks:
                break
            hit += 1
        return hit * self.block_size

    # ------------------------------------------------------------------ updates

    def admit(
        self,
        tokens: Sequence[int] | npt.NDArray[np.uint32],
        output_len: int = 1,
        namespace: int = 0,
    ) -> tuple[int, Handle]:
        """Start a request: count its cached prefix, store its missing prompt blocks, pin
        them all; the blocks its ``output_len`` generated tokens fill come with ``grow``.

        ``namespace`` (non-zero: a LoRA adapter and/or cache salt, see ``namespace_of``)
        changes every block's key, as vLLM's extra hash keys do: the same tokens in
        another namespace share no block.

        Returns ``(cached_tokens, handle)``. If not every block fits (everything else
        pinned), as many leading blocks as fit are cached and pinned.
        """
        keys, n_tokens, seq = self.prepare(tokens, output_len, namespace)
        return self.admit_keys(keys, n_tokens, seq)

    def prepare(
        self,
        tokens: Sequence[int] | npt.NDArray[np.uint32],
        output_len: int = 1,
        namespace: int = 0,
    ) -> tuple[list[int], int, npt.NDArray[np.uint32]]:
        """``(keys, n_tokens, sequence)`` of a request, as ``admit`` computes them: for
        ``fits`` then ``admit_keys``."""
        if isinstance(tokens, bytes):  # no tokenizer: the prompt's UTF-8 bytes as IDs
            tokens = token_array(tokens)
        seq = sequence(tokens, output_len)
        keys = block_keys(seq, self.block_size)
        if namespace:
            keys = [k ^ namespace for k in keys]
        return keys, len(tokens), seq

    def admit_keys(
        self,
        keys: list[int],
        n_tokens: int,
        tokens: Sequence[int] | npt.NDArray[np.uint32] | None = None,
    ) -> tuple[int, Handle]:
        """``admit`` with precomputed keys (the simulator's fast path): ``keys`` of the
        full blocks of the whole sequence (``block_keys(sequence(prompt, output_len))``),
        or of the prompt alone for a request whose output takes no blocks; ``n_tokens``
        is the prompt's length. ``tokens`` (the sequence) is needed only for store events.
        """
        lru = self._lru
        n_prompt = min(n_tokens // self.block_size, len(keys))
        seq_keys = keys
        keys = seq_keys[:n_prompt] if n_prompt < len(seq_keys) else seq_keys
        # Bulk operations (map/update run their loops in C): this is the simulator's hot path.
        flags = list(map(lru.__contains__, keys))
        if all(flags):
            lead = len(keys)
            present, missing = keys, []
        else:
            lead = flags.index(False)
            present = list(compress(keys, flags))
            missing = list(compress(keys, map(not_, flags)))
        cached = min(lead, max(n_tokens - 1, 0) // self.block_size) * self.block_size
        self.queries += n_tokens
        self.hits += cached
        # Pin what is present first, so that making room cannot evict it.
        acq_get, rel_get = self._acq.get, self._rel.get
        self._pinned += sum(
            map(eq, map(acq_get, present, repeat(0)), map(rel_get, present, repeat(0)))
        )
        self._acq.update(present)
        self._running += 1
        removed: list[int] = []
        if missing:
            over = len(lru) + len(missing) - self.capacity_blocks
            if over > 0:
                self._evict(over, removed)
            room = self.capacity_blocks - len(lru)
            if room < len(missing):
                missing = missing[: max(room, 0)]  # the leading blocks that fit
            _drain(map(lru.__setitem__, missing, repeat(None)))
            self._acq.update(missing)
            self._pinned += len(missing)
        complete = len(present) + len(missing) == len(keys)
        pinned = list(keys) if complete else [k for k in keys if k in lru]
        if removed and self.on_remove is not None:
            self.on_remove(removed)
        if missing and self.on_store is not None and tokens is not None:
            stored = set(missing)
            self._emit_stored(keys, [i for i, k in enumerate(keys) if k in stored], tokens)
        handle = Handle(pinned, self._generation)
        if len(seq_keys) > n_prompt:
            handle.seq_keys = seq_keys
            handle.filled = n_prompt
            handle.stalled = not complete
            if self.on_store is not None and tokens is not None:
                handle.tokens = np.asarray(tokens)
        return cached, handle

    def next_fill(self, handle: Handle) -> int | None:
        """Sequence length (prompt + output tokens whose KV is computed) at which the
        request fills its next block, or None if none is left to fill."""
        if handle.filled >= len(handle.seq_keys):
            return None
        return (handle.filled + 1) * self.block_size

    def grow(self, handle: Handle, n_tokens: int) -> None:
        """The request's KV now covers ``n_tokens`` of its sequence: store and pin the
        blocks it filled since the last call, evicting unpinned blocks as needed.

        A block already cached (the same sequence ran before) is pinned, not stored
        again. A block that does not fit is not cached, nor is any after it."""
        upto = min(n_tokens // self.block_size, len(handle.seq_keys))
        first = handle.filled
        if upto <= first:
            return
        handle.filled = upto  # also when stale: its next fill must move on (fleet sim)
        if handle.stalled or handle.generation != self._generation:
            return
        lru = self._lru
        acq, rel = self._acq, self._rel
        removed: list[int] = []
        stored: list[int] = []
        for i in range(first, upto):
            k = handle.seq_keys[i]
            if k not in lru:
                if len(lru) >= self.capacity_blocks:
                    self._evict(len(lru) - self.capacity_blocks + 1, removed)
                if len(lru) >= self.capacity_blocks:
                    handle.stalled = True
                    break
                lru[k] = None
                stored.append(i)
            if acq[k] == rel[k]:
                self._pinned += 1
            acq[k] += 1  # pinned at once: making room for the next block must not evict it
            handle.keys.append(k)
        if removed and self.on_remove is not None:
            self.on_remove(removed)
        if stored and self.on_store is not None and handle.tokens is not None:
            self._emit_stored(handle.seq_keys, stored, handle.tokens)

    def _evict(self, n: int, removed: list[int]) -> None:
        """Evict up to ``n`` unpinned blocks from the head of the LRU order.

        Pinned blocks met at the head go to the tail (their release puts them there
        anyway); each block is looked at most once per call.
        """
        lru = self._lru
        acq_get, rel_get = self._acq.get, self._rel.get  # dict.get: no Counter.__missing__
        acq_pop, rel_pop = self._acq.pop, self._rel.pop
        popitem = lru.popitem
        for _ in range(len(lru)):
            if n <= 0:
                break
            k, _ = popitem(last=False)
            if acq_get(k, 0) != rel_get(k, 0):
                lru[k] = None
                continue
            acq_pop(k, None)
            rel_pop(k, None)
            removed.append(k)
            n -= 1
        self.evicted_blocks += len(removed)

    def release(self, handle: Handle) -> None:
        """A request finished: unpin its blocks, tail first (they become evictable)."""
        if handle.generation != self._generation:
            return  # the cache was cleared since; its blocks are gone
        keys = handle.keys
        acq, rel = self._acq, self._rel
        rel.update(keys)
        self._pinned -= sum(map(eq, map(acq.__getitem__, keys), map(rel.__getitem__, keys)))
        # Pinned blocks cannot have been evicted: all are present. Tail first to the end
        # of the order, so the end of a prompt is evicted before its shared beginning.
        _drain(map(self._lru.move_to_end, reversed(keys)))
        self._running -= 1
        if self._running == 0:
            self._acq.clear()  # nothing pinned: forget the counts
            self._rel.clear()
            self._pinned = 0
        handle.keys = []
        handle.seq_keys = []
        handle.tokens = None

    def clear(self) -> None:
        """Drop every block (a prefix-cache reset); outstanding handles become no-ops."""
        self._lru.clear()
        self._acq.clear()
        self._rel.clear()
        self._running = 0
        self._pinned = 0
        self._generation += 1
        if self.on_clear is not None:
            self.on_clear()

    def reset_counters(self) -> None:
        self.queries = 0
        self.hits = 0
        self.evicted_blocks = 0

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests)."""
        assert len(self._lru) <= self.capacity_blocks, "over capacity"
        assert all(self._acq[k] >= self._rel[k] for k in self._rel), "released more than pinned"
        assert set(self._acq) <= set(self._lru), "counts for a block not cached"
        assert self._running >= 0
        rel = self._rel
        assert self._pinned == sum(1 for k, n in self._acq.items() if n != rel[k]), "pinned count"

    def ref_counts(self) -> dict[int, int]:
        """Block -> number of running requests using it (for tests)."""
        return {k: self._acq[k] - self._rel[k] for k in self._lru}

    def _emit_stored(
        self, keys: list[int], stored: list[int], tokens: Sequence[int] | npt.NDArray[np.uint32]
    ) -> None:
        assert self.on_store is not None
        tok = np.asarray(tokens)
        bs = self.block_size
        # One event per run of consecutive new blocks; parent = the block before the run.
        start = 0
        while start < len(stored):
            end = start
            while end + 1 < len(stored) and stored[end + 1] == stored[end] + 1:
                end += 1
            first, last = stored[start], stored[end]
            parent = keys[first - 1] if first > 0 else None
            ids: list[int] = tok[first * bs : (last + 1) * bs].tolist()
            self.on_store(keys[first : last + 1], parent, ids, bs)
            start = end + 1
