"""Token IDs as text, one Unicode character per token, for routers that only take text.

The SGLang router (0.3.x) rejects ``/v1/completions`` whose ``prompt`` is a list of
token IDs (422), and its tree matches characters anyway. To give every router the same
requests, a benchmark can send each workload prompt as text where token ``t`` is the
character ``U+10000 + t`` (planes 1-3: valid scalar values, never surrogates, for
``t < 0xF0000``). A sim worker started with ``--text-codec codepoints`` maps text back
one character per token (``ord(c) - 0x10000`` for astral characters, ``ord(c)`` for the
rest, e.g. the ASCII of a rendered chat), so its cache and costs see exactly the
workload's token IDs; character-level routers see one character per token; kvroute
without a tokenizer sees 4 UTF-8 bytes per token (same prefix structure).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvroute.routing.tokenization import PromptTokenizer

OFFSET = 0x10000
MAX_TOKEN = 0x10FFFF - OFFSET


def tokens_to_text(tokens: Sequence[int] | Any) -> str:
    """``U+10000 + t`` for every token ``t`` (raises ValueError past ``MAX_TOKEN``)."""
    t = np.asarray(tokens, dtype=np.int64)
    if t.size and (t.min() < 0 or t.max() > MAX_TOKEN):
        raise ValueError(f"token IDs must be in [0, {MAX_TOKEN}] to be sent as text")
    return (t + OFFSET).astype("<u4").tobytes().decode("utf-32-le")


def text_to_tokens(text: str) -> array.array[int]:
    """One token per character: astral characters back to ``ord - 0x10000``."""
    cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    ids = np.where(cps >= OFFSET, cps - OFFSET, cps).astype(np.uint32)
    return array.array("I", ids.tobytes())


class CodepointTokenizer(PromptTokenizer):
    """``PromptTokenizer`` without a tokenizer, but one token per character of text
    (chat is rendered as the router renders it without a tokenizer)."""

    def __init__(self) -> None:
        super().__init__(None)

    def encode_text(self, text: str, *, add_special_tokens: bool = False) -> array.array[int]:
        return text_to_tokens(text)

    async def encode_text_async(
        self, text: str, *, add_special_tokens: bool = False
    ) -> array.array[int]:
        return text_to_tokens(text)
