"""The tokenizer side of decide first (``kvroute.routing.decide_first``): a prompt's
known start, a bound on the rest, a longer start on request, and the whole prompt.

The known start is the prompt up to its first piece not in the segment cache, plus that
piece's first pre-tokenizer pieces (``HEAD_CHARS``), split off exactly by the fast BPE
(``FastBPE.split_head``: head + the rest's IDs are the piece's IDs). The rest is bounded
without encoding it: at most one token per UTF-8 byte. ``finish`` encodes only what is
left (the head is not encoded again) and caches the piece whole, so the next turn of the
conversation finds it. These functions work on ``PromptTokenizer``'s segment cache.
"""

from __future__ import annotations

import array
from typing import Any

from kvroute.routing.decide_first import Prompt

# ``tok`` below is a ``kvroute.routing.tokenization.PromptTokenizer`` (not imported:
# that module imports this one).

# How much of the first uncached text is encoded before deciding (whole pre-tokenizer
# pieces, at least this many characters): a role header and a word or two, where a new
# message usually parts from what the index holds. ``lengthen`` asks for more when the
# rule needs a longer start.
HEAD_CHARS = 16


def partial_text(tok: Any, text: str, add_special_tokens: bool, head_chars: int) -> Prompt:
    """``text``'s IDs up to its first piece not in the segment cache, plus that
    piece's first pre-tokenizer pieces (``head_chars``); the rest pending, with a
    bound on its token count. Complete when nothing is missing."""
    prefix = tok._prefix_specials if add_special_tokens else []
    parts, missing = tok.segments.lookup(tok.segments.pieces(text))
    if not missing or tok._bpe is None:
        found = tok._encode_missing(missing) if missing else {}
        return Prompt(tok.segments.assemble(parts, found, prefix))
    first = next(i for i, p in enumerate(parts) if isinstance(p, str))
    after = 0
    for part in parts[first + 1 :]:
        after += tok._bpe.token_bounds(part)[1] if isinstance(part, str) else len(part)
    known = tok.segments.assemble(parts[:first], {}, prefix)
    prompt = Prompt(known, missing, 0, parts, first, 0, None, after)
    split = _split(tok, prompt, known, head_chars)
    if split is not None:
        return split
    prompt.hi = tok._bpe.token_bounds(str(parts[first]))[1] + after
    return prompt


def _split(tok: Any, prompt: Prompt, base: array.array[int], head_chars: int) -> Prompt | None:
    """``prompt`` with the first piece's head of ``head_chars`` characters after
    ``base`` (the IDs before that piece); None where the piece cannot be split."""
    if tok._bpe is None:
        return None
    head = tok._bpe.split_head(str(prompt.parts[prompt.first]), head_chars)
    if head is None:
        return None
    known = array.array("I", base)
    known.extend(head[0])
    hi = len(head[1].encode("utf-8", "surrogatepass")) + prompt.after
    return Prompt(
        known, prompt.pending, hi, prompt.parts, prompt.first, len(head[0]), head[1],
        prompt.after,
    )  # fmt: skip


def lengthen(tok: Any, prompt: Prompt, tokens: int) -> Prompt | None:
    """``prompt`` with a known start of at least ``tokens`` IDs (a longer head of its
    first piece to encode), or None when the piece is too short or cannot be split."""
    if prompt.complete or prompt.rest is None:
        return None
    base = prompt.known[: len(prompt.known) - prompt.head]
    longer = _split(tok, prompt, base, 4 * max(tokens - len(base), 0) + HEAD_CHARS)
    return longer if longer is not None and len(longer.known) >= tokens else None


def finish(tok: Any, prompt: Prompt) -> array.array[int]:
    """The whole prompt's IDs: encodes what ``prompt`` left pending (and caches it).
    The first piece's head is not encoded again: head + the rest's IDs are exactly
    the piece's (``FastBPE.split_head``)."""
    if prompt.complete:
        return prompt.known
    known, parts = prompt.known, prompt.parts
    piece = str(parts[prompt.first])
    others = [t for t in prompt.pending if t != piece]
    found = tok._encode_missing(others) if others else {}
    out = array.array("I", known)
    if prompt.rest is not None and tok._bpe is not None:
        rest_ids = tok._bpe.encode_ids(prompt.rest)
        ids = known[len(known) - prompt.head :]
        ids.extend(rest_ids)
        tok.segments.store({piece: ids})
        out.extend(rest_ids)
    else:
        found.update(tok._encode_missing([piece]))
        out.extend(found[piece])
    for part in parts[prompt.first + 1 :]:
        out.extend(found[part] if isinstance(part, str) else part)
    return out
