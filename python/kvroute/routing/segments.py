"""The segment cache: rendered text -> token IDs, each piece between special tokens
encoded once.

A rendered prompt is split at the tokenizer's special tokens (as the tokenizer itself
splits before BPE), each piece is looked up in an LRU map keyed by its text (bounded in
entries and in bytes), the pieces not found are encoded, and the IDs are concatenated.
System prompts and earlier turns repeat across requests, so most pieces hit the cache
and only the new text is tokenized.

Two implementations, for two paths:

* ``NativeSegments``, where the extension's exact BPE encodes (``PromptTokenizer``'s
  ``native-bpe``): the split, the cache, the encoding and the concatenation in one
  native call with the GIL released (``kvroute._native.SegmentEncoder``,
  ``rust/src/bpe/segments.rs``). It answers "too long for the event loop" before
  encoding anything, so the caller makes the call again from a thread, and hands back
  the pieces it must not encode as they stand (a character NFC could change, or one
  the encoder refuses), which ``FastBPE.encode_ids`` encodes as before.
* ``PySegments``, everywhere else (tiktoken's BPE, ``tokenizers``) and for decide first
  (``kvroute.routing.partial``), which works piece by piece.
"""

from __future__ import annotations

import array
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeAlias

from kvroute._native import SegmentEncoder
from kvroute.routing.bpe import FastBPE

# A segment's IDs in the cache: an array('I'), so assembling a prompt copies memory
# (a 1,500-ID segment: 0.2 µs, against 15 µs from a tuple of ints).
IDs: TypeAlias = "array.array[int]"


def entry_bytes(text: str, ids: IDs) -> int:
    """What a Python segment-cache entry costs, estimated on the safe side: the key, the
    IDs (an ``array('I')``: 4 bytes an ID and its header, over-allocation included) and
    the dict slot."""
    return sys.getsizeof(text) + 80 + 5 * len(ids) + 100


class PySegments:
    """The segment cache in Python: pieces are looked up and stored here, encoded by
    the caller. Thread-safe (long texts are encoded in a worker thread)."""

    def __init__(self, specials: dict[str, int], cache_size: int, cache_bytes: int) -> None:
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.used = 0
        self.hits = 0
        self.misses = 0
        self._cache: OrderedDict[str, IDs] = OrderedDict()
        self._lock = threading.Lock()
        self._special_arrays = {t: array.array("I", (i,)) for t, i in specials.items()}
        self._special: re.Pattern[str] | None = None
        if specials:
            alternation = "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))
            self._special = re.compile(f"({alternation})")

    @property
    def entries(self) -> int:
        return len(self._cache)

    def pieces(self, text: str) -> list[str]:
        """``text`` split at special tokens (kept as their own pieces), as the tokenizer
        itself splits before BPE: leftmost, and the longest token starting there."""
        return self._special.split(text) if self._special is not None else [text]

    def lookup(self, pieces: list[str]) -> tuple[list[str | IDs], list[str]]:
        """Each piece as its cached IDs (or itself when not cached), and the distinct
        pieces still to encode. Special tokens map to their IDs."""
        parts: list[str | IDs] = []
        missing: dict[str, None] = {}
        with self._lock:
            for piece in pieces:
                if not piece:
                    continue
                sid = self._special_arrays.get(piece)
                if sid is not None:
                    parts.append(sid)
                    continue
                cached = self._cache.get(piece)
                if cached is not None:
                    self._cache.move_to_end(piece)
                    self.hits += 1
                    parts.append(cached)
                else:
                    self.misses += 1
                    parts.append(piece)
                    missing[piece] = None
        return parts, list(missing)

    def store(self, found: dict[str, IDs]) -> None:
        """Put encoded pieces in the cache, within its bounds."""
        with self._lock:
            for text, ids in found.items():
                size = entry_bytes(text, ids)
                if size > self.cache_bytes // 4:
                    continue  # one huge piece would flush everything else
                old = self._cache.pop(text, None)
                if old is not None:
                    self.used -= entry_bytes(text, old)
                self._cache[text] = ids
                self.used += size
            while self._cache and (
                len(self._cache) > self.cache_size or self.used > self.cache_bytes
            ):
                text, ids = self._cache.popitem(last=False)
                self.used -= entry_bytes(text, ids)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self.used = 0

    @staticmethod
    def assemble(parts: list[str | IDs], found: dict[str, IDs], prefix: list[int]) -> IDs:
        out = array.array("I", prefix)
        for part in parts:
            out.extend(found[part] if isinstance(part, str) else part)
        return out

    def encode(self, text: str, prefix: list[int], encode: Callable[[list[str]], list[IDs]]) -> IDs:
        """``text``'s IDs, the pieces not cached encoded with ``encode`` and stored."""
        parts, missing = self.lookup(self.pieces(text))
        found = dict(zip(missing, encode(missing), strict=True)) if missing else {}
        self.store(found)
        return self.assemble(parts, found, prefix)


class NativeSegments:
    """The segment cache in the extension, for the native BPE (module docstring)."""

    def __init__(
        self,
        fast: FastBPE,
        specials: dict[str, int],
        prefix: list[int],
        speed: tuple[int, int],
        cache_size: int,
        cache_bytes: int,
    ) -> None:
        assert fast.native is not None
        self._fast = fast
        self.encoder = SegmentEncoder(
            fast.native,
            specials,
            prefix,
            _unstable(fast),
            speed=speed,
            cache_size=cache_size,
            cache_bytes=cache_bytes,
        )

    def encode(self, text: str, add_special_tokens: bool, budget_ns: int | None) -> IDs | None:
        """``text``'s IDs; None when the pieces not cached would cost more than
        ``budget_ns`` to encode (nothing is done: call again without a budget from a
        thread). Raises ``UnicodeEncodeError`` for a text that is not valid UTF-8 (a
        lone surrogate): the caller encodes it through ``PySegments``."""
        out = self.encoder.encode(text, add_special_tokens, budget_ns)
        given: dict[str, IDs] = {}
        while isinstance(out, list):  # pieces to normalize first, or refused ones
            given.update((piece, self._fast.encode_ids(piece)) for piece in out)
            out = self.encoder.encode(text, add_special_tokens, None, given)
        return out


def _unstable(fast: FastBPE) -> Any:
    """The code points whose pieces go back to Python: with NFC, those NFC may change
    and the ones the native encoder refuses; without, none (the encoder refuses none)."""
    if not fast.nfc:
        return None
    import numpy

    from kvroute.routing.native_bpe import nfc_unstable

    cps = numpy.asarray(nfc_unstable(), dtype=numpy.uint32)
    refused = fast.refused()
    return cps if refused is None else numpy.union1d(cps, refused).astype(numpy.uint32)
