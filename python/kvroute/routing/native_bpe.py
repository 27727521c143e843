"""The native exact BPE encoder (``kvroute._native.BpeEncoder``, ``rust/src/bpe/``):
built from the same serialized pipeline as ``kvroute.routing.bpe``, used in its place
where it reproduces the tokenizer.

The Rust side splits with a hand-written pre-tokenizer for the exact regexes of Qwen2/3,
Llama 3 and DeepSeek V3 (any other pattern is refused), with Unicode classes as the
``tokenizers`` regex engine defines them, and merges with ``tokenizers``' own procedure
over the merge list, so it needs neither the merge-order condition tiktoken has nor the
Unicode-version guard on its classes. What stays on the Python side is normalization:
NFC is applied with Python's ``unicodedata``, whose tables differ from the ones
``tokenizers`` normalizes with (``nfc_disagreements``); a text holding such a character,
or one Python's database does not know, goes to the reference encoder (the encoder's
*refused* set).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from kvroute._native import BpeEncoder

# Marks placed next to each candidate character: a starter, U+0334 (combining class 1)
# and U+0301 (230), so a different class or decomposition changes the order or result.
_CONTEXTS = ("{c}", "a{c}\u0334", "a\u0301{c}", "{c}\u0301", "{c}\u0334", "{c}\u0300\u0301")


@lru_cache(maxsize=1)
def nfc_disagreements() -> tuple[int, ...]:
    """Code points NFC treats differently in Python's ``unicodedata`` and in the
    ``tokenizers`` normalizer (their Unicode versions differ: marks assigned since the
    older one reorder in one and not the other). Only characters Python gives a
    combining class or a canonical decomposition, or that are part of one, can differ
    (the other assigned characters are inert in both, by Unicode's stability policy);
    each is tried next to marks of both sides' classes, and each composite from its
    decomposed form. A test checks the result over every code point."""
    from tokenizers import normalizers

    nfc = normalizers.NFC()
    candidates: set[int] = set()
    composed: list[str] = []
    for cp in range(0x110000):
        c = chr(cp)
        if 0xD800 <= cp <= 0xDFFF or unicodedata.category(c) == "Cn":
            continue
        decomposition = unicodedata.decomposition(c)
        if unicodedata.combining(c) or (decomposition and not decomposition.startswith("<")):
            candidates.add(cp)
            if decomposition and not decomposition.startswith("<"):
                candidates.update(int(part, 16) for part in decomposition.split())
                composed.append(unicodedata.normalize("NFD", c))
    found: set[int] = set()

    def differs(text: str) -> bool:
        return nfc.normalize_str(text) != unicodedata.normalize("NFC", text)

    for context in _CONTEXTS:
        for cp in sorted(candidates):
            if differs(context.format(c=chr(cp))):
                found.add(cp)
    for text in composed:
        if differs(text):
            found.update(map(ord, text))
    return tuple(sorted(found))


def merges_of(model: dict[str, Any], decoder: dict[str, int]) -> list[tuple[bytes, bytes]]:
    """The model's merge list as pairs of byte strings."""
    pairs = []
    for merge in model.get("merges", []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        pairs.append((bytes(decoder[c] for c in left), bytes(decoder[c] for c in right)))
    return pairs


def build(
    ranks: dict[bytes, int],
    model: dict[str, Any],
    decoder: dict[str, int],
    patterns: Sequence[str],
    refused: Any,
) -> tuple[BpeEncoder | None, str]:
    """The native encoder, or None and the reason it cannot be built. ``ranks``: the
    vocabulary (special tokens left out) as bytes; ``refused``: a 1-D ``uint32`` array
    of code points whose texts go to the reference encoder, or None."""
    try:
        merges = merges_of(model, decoder)
        encoder = BpeEncoder(
            ranks, merges, list(patterns), bool(model.get("ignore_merges")), refused
        )
    except (ValueError, KeyError, TypeError) as e:
        return None, str(e) or type(e).__name__
    return encoder, f"{encoder.scheme} pre-tokenizer"


@lru_cache(maxsize=1)
def nfc_unstable() -> tuple[int, ...]:
    """Code points a text must not hold to be its own NFC (Python's tables): a text
    without any is unchanged by NFC. Each character is either one of these or a starter
    (combining class 0) that NFC neither decomposes nor composes with what comes before
    it (NFC_Quick_Check Yes). These are: the characters with a nonzero combining class,
    those NFC changes alone (singletons, composition exclusions), every second character
    of a canonical pair (what can compose with the character before it), and the Hangul
    vowel and trailing jamo (composed by rule, not by the table)."""
    found: set[int] = set(range(0x1161, 0x1176)) | set(range(0x11A8, 0x11C3))
    for cp in range(0x80, 0x110000):
        c = chr(cp)
        if 0xD800 <= cp <= 0xDFFF:
            continue
        if unicodedata.combining(c):
            found.add(cp)
        decomposition = unicodedata.decomposition(c)
        if decomposition and not decomposition.startswith("<"):
            parts = decomposition.split()
            if len(parts) == 2:
                found.add(int(parts[1], 16))
            if unicodedata.normalize("NFC", c) != c:
                found.add(cp)
    return tuple(sorted(found))
