"""Exact byte-level BPE at tiktoken's speed, built from a Hugging Face tokenizer's JSON.

Most chat models' tokenizers (Qwen2/3, Llama 3, DeepSeek, GPT-style) are byte-level BPE:
the text is normalized (nothing, or NFC), split into pieces by one or more regular
expressions, each piece's UTF-8 bytes are mapped to printable symbols, and BPE merges the
symbols pairwise in the order of the merge list. ``tokenizers`` runs this through a
general pipeline (offsets, alignment tracking, a regex engine per stage); tiktoken's core
does the same split-and-merge in Rust without the bookkeeping, several times faster on
chat prompts (``bench/tokenize_micro.py``). This module builds a tiktoken ``Encoding``
from the tokenizer's own vocabulary, merges and pre-tokenizer patterns, and accepts it
only where it is identical:

* **Shape**: a ``BPE`` model without byte fallback, dropout or subword affixes; a
  normalizer that is absent or NFC; a pre-tokenizer that is GPT-2's ``ByteLevel`` (its
  own regex) or a sequence of isolating ``Split`` regexes followed by ``ByteLevel`` without
  regex. Every one of the 256 byte symbols is in the vocabulary.
* **Merge order = rank order**: tiktoken merges the adjacent pair whose concatenation has
  the lowest rank (= token ID); ``tokenizers`` merges the pair earliest in the merge list.
  The two agree when the IDs of the merge results increase along the merge list (true of
  tokenizers that came from tiktoken, as Qwen's and Llama 3's did), which is checked.
* **Pre-tokenization**: tiktoken applies one regex. With several ``Split`` stages (e.g.
  DeepSeek: digits, then CJK runs, then the word regex) the earlier stages run here with
  the ``regex`` module, each isolating its matches, and tiktoken applies the last.
* **Unicode versions**: ``tokenizers`` (Oniguruma), tiktoken (fancy-regex) and the
  ``regex`` module each carry their own Unicode tables, so a character assigned in a
  recent Unicode version may be a letter to one and unassigned to another (found by the
  property test: U+323B0, new in Unicode 17, split differently for DeepSeek). A text
  holding any character Python's own Unicode database does not know is encoded by the
  reference encoder instead.
* **Whitespace lookahead**: the GPT-4-style patterns (Qwen, Llama 3, DeepSeek) end in
  ``\\s+(?!\\S)|\\s+``, and that one lookahead sends every match through fancy-regex's
  backtracking engine instead of the ``regex`` crate's automata: 1.7x slower on chat text.
  Dropping the lookahead alternative changes a match only at a whitespace run of two or
  more characters followed by a non-space (the lookahead leaves the run's last character
  to the next piece; ``\\s+`` takes it all), and with ``\\s*[\\r\\n]+`` just before it only
  where that run holds no line break (else that alternative matches first). So a text
  with no two whitespace characters in a row (no two non-line-break ones, with
  ``\\s*[\\r\\n]+``) splits identically under both patterns and is encoded with the
  lookahead-free one; any other text with the pattern itself. Python's ``\\s`` used for
  that test covers the ``regex`` crate's ``\\s`` (Unicode ``White_Space``), and more.
* **A sample check** at load time: a fixed set of texts chosen to stress the differences
  (whitespace runs, digits, emoji and joiners, CJK, combining marks, RTL scripts,
  special-token lookalikes, code) must encode identically to the reference encoder.

Anything else, or any mismatch, returns no encoder and the reason; the caller then keeps
``tokenizers`` (and logs why). Special and added tokens are not handled here: the caller
splits them out first, as ``tokenizers`` does before BPE.
"""

from __future__ import annotations

import array
import json
import re
import unicodedata
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute._native import BpeEncoder

# GPT-2's pre-tokenizer regex: what ByteLevel(use_regex=True) applies.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Regex syntax that looks at text before a match's start (or at its start): lookbehind,
# word boundaries, anchors. A pattern with any of them cannot be resumed mid-text.
_LOOKS_BEHIND = re.compile(r"\(\?<[=!]|\\[bBAGZz]|(?<![\[\\])\^")

# The lookahead ending of GPT-4-style patterns, and the line-break alternative that
# usually precedes it (module docstring, "Whitespace lookahead").
LOOKAHEAD_TAIL = r"|\s+(?!\S)|\s+"
LINE_BREAKS = r"|\s*[\r\n]+"
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
# Whitespace as ``str.isspace`` sees it (Unicode White_Space, the regex crate's ``\s``,
# plus U+001C-U+001F), line breaks apart.
SPACES = "\t\x0b\x0c\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"

# Texts that must encode identically before the fast encoder is trusted.
SAMPLES = (
    "Hello, world! How are you doing today?",
    "  leading spaces,\ttabs\t\tand  double  spaces   \n\n\n  trailing   ",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "1234567890 3.14159 -42 1e-9 0x1F 12,345,678",
    "I'm you're we've they'll she'd IT'S DON'T",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 keycap 1️⃣",
    "中文测试：你好，世界。日本語のテキスト、カタカナ。한국어 텍스트",
    "combining: e\u0301 a\u0300 n\u0303; precomposed: é à ñ; Å Å",
    "مرحبا بالعالم שלום עולם Ελληνικά Кириллица",
    "<|im_start |> <| endoftext|> <|im_end| > |> <| <｜begin sentence｜> < s> </ s> [INST ]",
    "\r\n\r\nwindows\r\nlines\n\r mixed \u00a0nbsp\u2003em\u3000ideographic",
    "zero\u200bwidth\u200djoiner\ufeffbom \U0001f9d1\u200d\U0001f4bb",
    "a" * 300 + " " + "ab" * 100 + "\n" * 40 + "-" * 80,
    "Ünïcödé ŁÓDŹ straße ﬁ ligature ½ ² ⁿ ℕ",
    # Case folding in contractions, format characters before letters, numbers in runs.
    "it'\u017fs THEY'LL 'twas '\u212a x\u200dy \u2066rtl\u2069 ١٢٣٤٥ ⅻ 12345678",
    # Letters from Unicode 15, 15.1 and 16: the classes must be the engine's version's.
    "\U0001e030\U00011f04 \U00031350\U0002ebf0 \U00010d50a ok",
)


@lru_cache(maxsize=1)
def unassigned() -> Any:
    """A table over all code points: True where Python's Unicode database (14.0 for
    Python 3.11) has no character. Characters assigned in later Unicode versions are
    where the regex engines involved (Oniguruma in ``tokenizers``, fancy-regex in
    tiktoken, the ``regex`` module) may disagree on ``\\p{L}`` and the like, since each
    carries its own tables; a text with any of them goes to the reference encoder."""
    import numpy

    table = numpy.zeros(0x110000, dtype=bool)
    for cp in range(0x110000):
        if unicodedata.category(chr(cp)) == "Cn":
            table[cp] = True
    return table


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's printable symbol for each byte, inverted (symbol -> byte)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            symbols.append(256 + extra)
            extra += 1
    return {chr(s): b for b, s in zip(printable, symbols, strict=True)}


class Unsupported(ValueError):
    """The tokenizer is not one this encoder reproduces exactly; the message says why."""


def _normalizer(spec: Any) -> bool:
    """True when the text must be NFC-normalized; raises for any other normalizer."""
    if spec is None:
        return False
    kind = spec.get("type")
    if kind == "NFC":
        return True
    if kind == "Sequence":
        inner = spec.get("normalizers") or []
        if not inner:
            return False
        if len(inner) == 1:
            return _normalizer(inner[0])
    raise Unsupported(f"normalizer {kind!r} is not NFC")


def _patterns(spec: Any) -> list[str]:
    """The regexes of the pre-tokenizer, in order (the last one goes to tiktoken)."""
    if spec is None:
        raise Unsupported("no pre-tokenizer")
    stages = spec["pretokenizers"] if spec.get("type") == "Sequence" else [spec]
    *splits, last = stages
    if last.get("type") != "ByteLevel" or last.get("add_prefix_space"):
        raise Unsupported("pre-tokenizer does not end in ByteLevel without a prefix space")
    patterns = []
    for stage in splits:
        regex = (stage.get("pattern") or {}).get("Regex")
        if (
            stage.get("type") != "Split"
            or regex is None
            or stage.get("behavior") != "Isolated"
            or stage.get("invert")
        ):
            raise Unsupported(
                f"pre-tokenizer stage {stage.get('type')!r} is not an isolating Split"
            )
        patterns.append(regex)
    if last.get("use_regex", True):
        patterns.append(GPT2_PATTERN)
    if not patterns:
        raise Unsupported("pre-tokenizer has no regex")
    return patterns


def _ranks(model: dict[str, Any], added: set[str]) -> dict[bytes, int]:
    if model.get("type") != "BPE":
        raise Unsupported(f"model {model.get('type')!r} is not BPE")
    if model.get("byte_fallback") or model.get("dropout"):
        raise Unsupported("BPE with byte fallback or dropout")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise Unsupported("BPE with subword affixes")
    decoder = byte_decoder()
    vocab: dict[str, int] = model["vocab"]
    try:
        # Added tokens (specials) may sit in the vocabulary unmapped: the caller splits
        # them out before BPE, so they need no rank.
        ranks = {
            bytes(decoder[c] for c in token): i for token, i in vocab.items() if token not in added
        }
    except KeyError:
        raise Unsupported("vocabulary is not byte-level") from None
    if len(ranks) != len(vocab.keys() - added) or len(set(ranks.values())) != len(ranks):
        raise Unsupported("vocabulary maps two tokens to the same bytes or ID")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise Unsupported(f"{len(missing)} of the 256 byte tokens are missing")
    previous = -1
    for merge in model.get("merges", []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged = vocab.get(left + right)
        if merged is None:
            raise Unsupported(f"merge {left!r} + {right!r} makes no token")
        if merged <= previous:
            raise Unsupported("merge order differs from token ID order")
        previous = merged
    return ranks


class FastBPE:
    """``encode(text)`` -> token IDs, identical to the tokenizer it was built from (on
    text without special tokens). The GIL is released while tiktoken works.

    tiktoken encodes only what its regex matches and drops the rest, where
    ``tokenizers`` keeps an unmatched stretch as a piece of its own. Every piece's output
    is therefore checked to cover the piece's bytes (the length of the tokens' bytes
    joined); a piece with stretches the regex does not match is split here instead,
    keeping them, and each part is merged as one unit.
    """

    def __init__(
        self,
        ranks: dict[bytes, int],
        patterns: Sequence[str],
        nfc: bool,
        fallback: Callable[[str], list[int]] | None = None,
    ) -> None:
        import regex
        import tiktoken

        # Texts with characters newer than Python's Unicode database go to ``fallback``
        # (the reference encoder), when there is one (see ``unassigned``); with NFC, so
        # do those Python normalizes unlike ``tokenizers`` (``refused``).
        self._fallback = fallback
        self._unassigned = unassigned() if fallback is not None else None
        if self._unassigned is not None and nfc:
            from kvroute.routing.native_bpe import nfc_disagreements

            self._unassigned = self._unassigned.copy()
            self._unassigned[list(nfc_disagreements())] = True
        # The native encoder, when ``load`` found it identical (it then encodes).
        self.native: BpeEncoder | None = None

        def encoding(name: str, pattern: str) -> tiktoken.Encoding:
            return tiktoken.Encoding(
                name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
            )

        self._encoding = encoding("kvroute-bpe", patterns[-1])
        # The same split without the whitespace lookahead, for texts where that cannot
        # differ (``_runs`` finds the texts where it could), or None.
        self._plain: tiktoken.Encoding | None = None
        self._runs = re.compile("(?!)")
        self._ascii_runs = b""
        last = patterns[-1]
        if last.endswith(LOOKAHEAD_TAIL):
            rest = last[: -len(LOOKAHEAD_TAIL)]
            if not _LOOKAROUND.search(rest):
                self._plain = encoding("kvroute-bpe-plain", rest + r"|\s+")
                spaces = SPACES if rest.endswith(LINE_BREAKS) else SPACES + "\r\n"
                self._runs = re.compile(f"[{spaces}][{spaces}]")
                # For ASCII texts, a faster test (2 µs for 1,500 characters, against 7
                # for the regex): those spaces made plain spaces, then two in a row.
                space = re.compile(f"[{spaces}]")
                self._ascii_runs = bytes(
                    32 if space.match(chr(b)) else b for b in range(128)
                ) + bytes(range(128, 256))
        self._whole = encoding("kvroute-bpe-piece", r"[\s\S]+")  # one piece, merged as a unit
        self._last = regex.compile(patterns[-1])
        self._presplit = [regex.compile(p) for p in patterns[:-1]]
        self._nfc = nfc
        # The longest token in bytes: a text of B bytes has at least ceil(B / this) tokens.
        self.max_token_bytes = max(map(len, ranks))
        # The head of a text can be cut off at a piece boundary only when the last regex
        # alone pre-tokenizes and never looks behind a match's start (see ``split_head``).
        self._splittable = not self._presplit and not _LOOKS_BEHIND.search(patterns[-1])

    @property
    def nfc(self) -> bool:
        """Whether the tokenizer normalizes with NFC."""
        return self._nfc

    def normalize(self, text: str) -> str:
        """``text`` as the tokenizer's normalizer leaves it (NFC, or unchanged)."""
        if self._nfc and not unicodedata.is_normalized("NFC", text):
            return unicodedata.normalize("NFC", text)
        return text

    def token_bounds(self, text: str) -> tuple[int, int]:
        """Provable bounds on ``len(encode(text))`` without encoding: every token covers
        at least one and at most ``max_token_bytes`` bytes of the normalized text."""
        size = len(self.normalize(text).encode("utf-8", "surrogatepass"))
        return -(-size // self.max_token_bytes), size

    def _recent(self, text: str) -> bool:
        """True when ``text`` holds a character the regex engines may classify
        differently (see ``unassigned``)."""
        if self._unassigned is None or text.isascii():
            return False
        import numpy

        cps = numpy.frombuffer(text.encode("utf-32-le", "surrogatepass"), numpy.uint32)
        return bool(self._unassigned[cps].any())

    def split_head(self, text: str, min_chars: int) -> tuple[list[int], str] | None:
        """The IDs of the first pre-tokenizer pieces of ``text`` covering at least
        ``min_chars`` characters, and the rest of the (normalized) text, such that
        ``head + encode(rest) == encode(text)``; None where that cannot be guaranteed
        (several regex stages, a pattern that looks behind).

        Exact because BPE never merges across pieces, and the regex, scanning on from
        a piece boundary, finds the same pieces in ``rest`` as in ``text`` when nothing
        before the boundary can influence a match (no lookbehind, ``\b`` or anchors).
        The pieces of the head are merged one by one (``_whole``), as ``tokenizers``
        merges each piece, including stretches the regex does not match."""
        if not self._splittable:
            return None
        text = self.normalize(text)
        if self._recent(text):
            return None
        whole = self._whole.encode_ordinary
        head: list[int] = []
        at = 0
        for m in self._last.finditer(text):
            if at >= min_chars:
                break
            if m.start() > at:
                head += whole(text[at : m.start()])
            if m.end() > m.start():
                head += whole(m.group())
            at = m.end()
        else:
            if at < len(text) and at < min_chars:  # an unmatched stretch at the end
                head += whole(text[at:])
                at = len(text)
        return head, text[at:]

    @property
    def lookahead_free(self) -> bool:
        """Whether texts without whitespace runs skip the whitespace lookahead (module
        docstring, "Whitespace lookahead")."""
        return self._plain is not None

    def _no_runs(self, text: str) -> bool:
        """True when ``text`` has no two whitespace characters in a row that could make
        the lookahead-free split differ (module docstring)."""
        if text.isascii():
            return b"  " not in text.encode("ascii").translate(self._ascii_runs)
        return self._runs.search(text) is None

    def refused(self) -> Any:
        """The code points whose texts go to the reference encoder (a ``uint32`` array),
        or None."""
        import numpy

        if self._unassigned is None:
            return None
        return numpy.flatnonzero(self._unassigned).astype(numpy.uint32)

    def encode_ids(self, text: str) -> array.array[int]:
        """``encode`` as an ``array('I')``; the native encoder's when there is one."""
        native = self.native
        if native is None:
            return array.array("I", self.encode_tiktoken(text))
        ids = native.encode(self.normalize(text))
        if ids is None:
            # A refused character (the same set sends the text on to the reference
            # encoder there), or a lone surrogate (tiktoken's replacement, as before).
            return array.array("I", self.encode_tiktoken(text))
        return ids

    def encode(self, text: str) -> list[int]:
        """The token IDs of ``text`` (without special tokens)."""
        return self.encode_ids(text).tolist()

    def encode_tiktoken(self, text: str) -> list[int]:
        """``encode`` through tiktoken, whether or not the native encoder is there."""
        if self._fallback is not None and self._recent(text):
            return self._fallback(text)
        text = self.normalize(text)
        if not self._presplit:
            return self._encode_piece(text)
        out: list[int] = []
        for piece in _isolate(self._presplit, text):
            out += self._encode_piece(piece)
        return out

    def _encode_piece(self, piece: str) -> list[int]:
        plain = self._plain
        encoding = plain if plain is not None and self._no_runs(piece) else self._encoding
        ids = encoding.encode_ordinary(piece)
        # Did the regex cover the whole piece? (tiktoken joining the tokens' bytes: 5 µs
        # for 500 tokens, against 7.5 for summing a table of lengths in Python.)
        if len(encoding.decode_bytes(ids)) != len(piece.encode("utf-8", "surrogatepass")):
            whole = self._whole.encode_ordinary
            ids = [i for part in _isolate([self._last], piece) for i in whole(part)]
        return ids


def _isolate(patterns: Sequence[Any], text: str) -> Sequence[str]:
    """``text`` split by each pattern in turn, matches and the stretches between them
    kept as pieces (``tokenizers``' ``Split`` with ``Isolated`` behaviour)."""
    pieces = [text]
    for pattern in patterns:
        split: list[str] = []
        for piece in pieces:
            at = 0
            for m in pattern.finditer(piece):
                if m.start() > at:
                    split.append(piece[at : m.start()])
                if m.end() > m.start():
                    split.append(m.group())
                at = m.end()
            if at < len(piece):
                split.append(piece[at:])
        pieces = split
    return pieces


def load(
    tokenizer_json: str | Path,
    reference: Callable[[list[str]], list[list[int]]],
    native: bool = True,
) -> tuple[FastBPE | None, str]:
    """The fast encoder for ``tokenizer_json`` (a path, or the JSON text itself as
    ``tokenizers.Tokenizer.to_str()`` gives it), or None and the reason it was refused.
    ``reference`` encodes a batch of texts without special tokens the trusted way.

    The chain: the native encoder (``kvroute.routing.native_bpe``) where it reproduces
    the tokenizer, else tiktoken's, else None (the caller keeps ``tokenizers``); the
    reason says which, and why the native one is not used (its patterns, its model, or
    the sample). ``native=False`` stops at tiktoken's."""
    try:
        if isinstance(tokenizer_json, str) and tokenizer_json.lstrip().startswith("{"):
            spec = json.loads(tokenizer_json)
        else:
            spec = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
        nfc = _normalizer(spec.get("normalizer"))
        patterns = _patterns(spec.get("pre_tokenizer"))
        added = {t["content"] for t in spec.get("added_tokens") or []}
        ranks = _ranks(spec["model"], added)
        fast = FastBPE(ranks, patterns, nfc, lambda text: reference([text])[0])
    except Unsupported as e:
        return None, str(e)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as e:
        return None, f"cannot build it: {type(e).__name__}: {e}"
    expected = reference(list(SAMPLES))
    for text, ids in zip(SAMPLES, expected, strict=True):
        if fast.encode_tiktoken(text) != ids:
            return None, f"differs from the tokenizer on the sample {text[:40]!r}"
    if not native:
        return fast, "tiktoken, identical on the load-time sample"
    from kvroute.routing import native_bpe

    # Its classes are the regex engine's own (tested over every code point), so only
    # normalization needs texts sent on: with NFC, those ``refused`` lists.
    refused = fast.refused() if nfc else None
    encoder, why = native_bpe.build(ranks, spec["model"], byte_decoder(), patterns, refused)
    if encoder is not None:
        fast.native = encoder
        for text, ids in zip(SAMPLES, expected, strict=True):
            if fast.encode(text) != ids:
                fast.native, why = None, f"differs from the tokenizer on the sample {text[:40]!r}"
                break
    if fast.native is None:
        return fast, f"tiktoken, identical on the load-time sample; native encoder not used ({why})"
    return fast, f"native, {why}, identical on the load-time sample"
