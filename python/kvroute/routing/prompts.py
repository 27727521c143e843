"""Validation of prompts given as token IDs, and of prompt batches.

Token IDs come from clients as JSON: they must be exact integers (JSON ``true`` would
pass Python's ``int`` check), within ``[0, 2^32)`` (the index stores u32), and within
the tokenizer's vocabulary when one is loaded (``max_id``). A batch (a list of prompts)
routes on its first prompt, but every prompt is checked.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvroute.errors import BadRequestError

MAX_TOKEN_ID = 2**32 - 1


def token_array(tokens: Sequence[int] | npt.NDArray[Any]) -> npt.NDArray[np.uint32]:
    """A prompt's token IDs as a u32 array; a ``bytes`` prompt (no tokenizer: its UTF-8
    bytes) as one ID per byte. An ``array('I')`` or u32 array is not copied."""
    if isinstance(tokens, bytes):
        return np.frombuffer(tokens, dtype=np.uint8).astype(np.uint32)
    if isinstance(tokens, array.array) and tokens.typecode == "I":
        return np.frombuffer(tokens, dtype=np.uint32)
    return np.asarray(tokens, dtype=np.uint32)


def token_list(value: Any, field: str, max_id: int = MAX_TOKEN_ID) -> array.array[int]:
    """``value`` as token IDs: a non-empty list of ints (booleans refused) in
    [0, max_id]. Raises BadRequestError naming the first bad one."""
    if not isinstance(value, list) or not value:
        raise BadRequestError(f"'{field}' must be a non-empty list of token IDs")
    # One C-speed pass over the element types: bool is an int subclass that array()
    # would take as 0/1, so only exact ints pass, and floats with an integral value
    # (JSON does not tell 7 from 7.0; JSON Schema's "integer" and the engines' pydantic
    # models take both).
    types = set(map(type, value))
    if types != {int}:
        if types <= {int, float} and all(type(v) is int or v.is_integer() for v in value):
            value = [int(v) for v in value]
        else:
            bad = next(v for v in value if type(v) is not int and not _whole(v))
            raise BadRequestError(f"'{field}' must contain integer token IDs, got {bad!r}")
    try:
        ids = array.array("I", value)
    except OverflowError:
        bad = next(v for v in value if not 0 <= v <= MAX_TOKEN_ID)
        raise BadRequestError(
            f"'{field}' must contain token IDs in [0, {max_id}], got {bad}"
        ) from None
    if max_id < MAX_TOKEN_ID and max(ids) > max_id:
        raise BadRequestError(
            f"'{field}' holds token ID {max(ids)}, outside the tokenizer's vocabulary "
            f"[0, {max_id}]",
            code="token_id_out_of_vocabulary",
        )
    return ids


def _whole(v: Any) -> bool:
    return type(v) is float and v.is_integer()


def prompt_batch(value: Any, field: str) -> list[Any]:
    """The prompts of ``value``: itself, or its items when it is a batch (a list of
    strings or of token-ID lists); every item must be of one kind."""
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        kind = str if isinstance(value[0], str) else list
        for i, item in enumerate(value):
            if not isinstance(item, kind):
                raise BadRequestError(
                    f"'{field}'[{i}]: a batch must be all strings or all token-ID lists"
                )
        return list(value)
    return [value]
