"""The native BlockIndex (precise mode): events in, whole-block matches out."""

from __future__ import annotations

import numpy as np
import pytest

from kvroute import BlockIndex, UnknownParentError


def toks(n: int, base: int = 0) -> list[int]:
    return list(range(base, base + n))


def test_store_match_remove() -> None:
    idx = BlockIndex()
    t = toks(48, 1000)
    idx.stored("w1", None, [11, 12], t[:32], 16)
    idx.stored("w1", 12, [13], t[32:48], 16)
    idx.stored("w2", None, [2**64 - 1], t[:16], 16)  # u64 max is a valid vLLM hash
    assert idx.match([*t, 1, 2, 3]) == {"w1": 48, "w2": 16}
    assert idx.match(np.asarray(t[:40], dtype=np.uint32)) == {"w1": 32, "w2": 16}
    assert idx.cached_tokens("w1") == 48 and idx.cached_blocks("w1") == 3
    assert idx.block_size("w1") == 16 and idx.block_size("nobody") is None
    assert idx.removed("w1", [12, 999]) == 1
    assert idx.match(t) == {"w1": 16, "w2": 16}, "a hole ends the prefix"
    idx.clear_worker("w1")
    assert idx.match(t) == {"w2": 16}
    assert sorted(idx.workers()) == ["w1", "w2"]
    idx.remove_worker("w2")
    assert idx.match(t) == {}
    assert idx.distinct_blocks() == 0


def test_signed_hashes_as_sglang_sends_them() -> None:
    idx = BlockIndex()
    idx.stored("w", None, [-5], toks(4), 4)
    idx.stored("w", -5, [-6], toks(4, 4), 4)
    assert idx.match(toks(8)) == {"w": 8}
    assert idx.removed("w", [-6]) == 1


def test_lost_parent_raises_and_changes_nothing() -> None:
    idx = BlockIndex()
    with pytest.raises(UnknownParentError, match="unknown parent"):
        idx.stored("w", 77, [1], toks(4), 4)
    assert idx.cached_tokens("w") == 0
    with pytest.raises(ValueError, match="tokens"):
        idx.stored("w", None, [1, 2], toks(3), 4)
    with pytest.raises(ValueError, match="block hash"):
        idx.stored("w", None, ["x"], toks(4), 4)  # type: ignore[list-item]


def test_partial_blocks_never_match() -> None:
    """The engine reports only full blocks; a request shorter than a block matches 0."""
    idx = BlockIndex()
    idx.stored("w", None, [1], toks(16), 16)
    assert idx.match(toks(15)) == {}
    assert idx.match(toks(16)) == {"w": 16}
