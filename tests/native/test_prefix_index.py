"""The native PrefixIndex: API, input validation, a model-based property test against a
pure-Python reference, and a threaded stress test."""

from __future__ import annotations

import array
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvroute import PrefixIndex
from kvroute._native import BlockIndex


class ReferenceIndex:
    """Token-level model of per-worker LRU prefix caches.

    Each worker holds a set of prefixes, each stamped with the counter value of the last
    insert that covered it. Over budget, the prefix with the smallest (stamp, -length)
    goes first: the oldest, and within one insert the deepest, so a worker's cache always
    stays prefix-closed.
    """

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.clock = 0
        self.held: dict[str, dict[tuple[int, ...], int]] = {}

    def insert(self, worker: str, tokens: list[int]) -> None:
        held = self.held.setdefault(worker, {})
        if not tokens:
            return
        self.clock += 1
        for i in range(1, len(tokens) + 1):
            held[tuple(tokens[:i])] = self.clock
        if self.budget is not None:
            while len(held) > self.budget:
                victim = min(held, key=lambda k: (held[k], -len(k)))
                del held[victim]

    def match(self, tokens: list[int]) -> dict[str, int]:
        out = {}
        for worker, held in self.held.items():
            n = 0
            while n < len(tokens) and tuple(tokens[: n + 1]) in held:
                n += 1
            if n:
                out[worker] = n
        return out

    def cached_tokens(self, worker: str) -> int:
        return len(self.held.get(worker, {}))


WORKERS = st.sampled_from(["w0", "w1", "w2", "w3", "w4"])
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9], [5, 5, 5, 5, 5, 5], [2]]


@st.composite
def token_lists(draw: st.DrawFn) -> list[int]:
    """Prompts built from a few shared stems, so prefixes collide and branch often."""
    stem = draw(st.sampled_from(STEMS))
    cut = draw(st.integers(0, len(stem)))
    tail = draw(st.lists(st.integers(0, 3), max_size=5))
    return stem[:cut] + tail


class IndexMachine(RuleBasedStateMachine):
    @initialize(budget=st.one_of(st.none(), st.integers(0, 30)), byte_tokens=st.booleans())
    def setup(self, budget: int | None, byte_tokens: bool) -> None:
        # A byte-token index answers as the index of u32 IDs, for IDs 0-255.
        self.index = PrefixIndex(budget, byte_tokens=byte_tokens)
        self.ref = ReferenceIndex(budget)

    @rule(
        worker=WORKERS,
        tokens=token_lists(),
        kind=st.sampled_from(["list", "array", "numpy", "bytes", "bytearray"]),
    )
    def insert(self, worker: str, tokens: list[int], kind: str) -> None:
        arg: object = tokens
        if kind == "array":
            arg = array.array("I", tokens)
        elif kind == "numpy":
            arg = np.asarray(tokens, dtype=np.uint32)
        elif kind == "bytes":
            arg = bytes(tokens)
        elif kind == "bytearray":
            arg = bytearray(tokens)
        self.index.insert(worker, arg)  # type: ignore[arg-type]
        self.ref.insert(worker, tokens)

    @rule(tokens=token_lists())
    def match(self, tokens: list[int]) -> None:
        expected = self.ref.match(tokens)
        assert self.index.match(tokens) == expected
        best, holders = self.index.longest_match(tokens)
        assert best == max(expected.values(), default=0)
        assert sorted(holders) == sorted(w for w, n in expected.items() if n == best)
        # One walk answers both, in the same order (the policy's ties depend on it),
        # and a bytes prompt is its bytes as token IDs.
        found = self.index.lookup(tokens)
        assert found[:3] == (self.index.match(tokens), best, holders)
        assert list(found[0].items()) == list(self.index.match(tokens).items())
        assert self.index.lookup(bytes(tokens))[:3] == found[:3]
        # The converted tokens stand for the prompt in any later call.
        ids = found[3]
        assert len(ids) == len(tokens)
        assert self.index.lookup(ids)[:3] == found[:3]
        assert self.index.match(ids) == expected

    @rule(worker=WORKERS, tokens=token_lists())
    def insert_what_lookup_converted(self, worker: str, tokens: list[int]) -> None:
        """A decision's insert: the lookup's ``TokenIds`` (and walk), not the tokens."""
        *_, ids = self.index.lookup(tokens)
        self.index.insert(worker, ids)
        self.ref.insert(worker, tokens)

    @rule(worker=WORKERS, other=WORKERS, tokens=token_lists(), between=token_lists())
    def insert_after_the_tree_changed(
        self, worker: str, other: str, tokens: list[int], between: list[int]
    ) -> None:
        """The lookup's walk is stale once anything changed: the insert still records
        exactly the tokens."""
        *_, ids = self.index.lookup(tokens)
        self.index.insert(other, between)
        self.ref.insert(other, between)
        self.index.insert(worker, ids)
        self.ref.insert(worker, tokens)

    @precondition(lambda self: bool(self.ref.held))
    @rule(worker=WORKERS)
    def remove(self, worker: str) -> None:
        self.index.remove_worker(worker)
        self.ref.held.pop(worker, None)

    @rule(worker=WORKERS, bad=st.sampled_from([[-1], [2**32], [1, "x"], [1.5]]))
    def bad_insert_changes_nothing(self, worker: str, bad: list[object]) -> None:
        before = {w: self.index.cached_tokens(w) for w in self.ref.held}
        with pytest.raises((ValueError, TypeError)):
            self.index.insert(worker, bad)  # type: ignore[arg-type]
        assert {w: self.index.cached_tokens(w) for w in self.ref.held} == before

    @precondition(lambda self: self.index.byte_tokens)
    @rule(worker=WORKERS, bad=st.sampled_from([[256], [1, 2, 300], array.array("I", [2**20])]))
    def byte_index_refuses_ids_above_255(self, worker: str, bad: object) -> None:
        before = {w: self.index.cached_tokens(w) for w in self.ref.held}
        with pytest.raises(ValueError, match="outside \\[0, 255\\]"):
            self.index.insert(worker, bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="outside \\[0, 255\\]"):
            self.index.lookup(bad)  # type: ignore[arg-type]
        assert {w: self.index.cached_tokens(w) for w in self.ref.held} == before

    @invariant()
    def sizes_agree(self) -> None:
        for worker in ["w0", "w1", "w2", "w3", "w4"]:
            assert self.index.cached_tokens(worker) == self.ref.cached_tokens(worker)
        assert sorted(self.index.workers()) == sorted(self.ref.held)
        self.index.check_invariants()


IndexMachine.TestCase.settings = settings(
    max_examples=2000,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexAgainstReference = IndexMachine.TestCase


def test_buffer_list_and_numpy_agree() -> None:
    idx = PrefixIndex()
    idx.insert("a", list(range(100)))
    assert idx.match(array.array("I", range(50))) == {"a": 50}
    assert idx.match(np.arange(120, dtype=np.uint32)) == {"a": 100}
    assert idx.match(np.arange(10, dtype=np.int64)) == {"a": 10}  # converted per element
    assert idx.match(tuple(range(5))) == {"a": 5}
    assert idx.match(iter(range(7))) == {"a": 7}
    assert idx.match([]) == {}
    # bytes and bytearray: one token per byte, every byte value.
    idx.insert("b", bytes(range(256)) * 2)
    assert idx.match(array.array("I", list(range(256)) * 2)) == {"b": 512, "a": 100}
    assert idx.lookup(bytearray(range(200)))[:3] == ({"b": 200, "a": 100}, 200, ["b"])
    assert idx.lookup(b"")[:3] == ({}, 0, [])


@pytest.mark.parametrize(
    ("bad", "exc", "message"),
    [
        ([-1], ValueError, "outside"),
        ([2**32], ValueError, "outside"),
        ([1, None], TypeError, "position 1"),
        ("hello", TypeError, "not str"),
        (3, TypeError, "not int"),
        (np.zeros((2, 2), dtype=np.uint32), ValueError, "1-dimensional"),
    ],
)
def test_bad_tokens_raise_clear_errors(bad: object, exc: type[Exception], message: str) -> None:
    idx = PrefixIndex()
    idx.insert("a", [1, 2, 3])
    with pytest.raises(exc, match=message):
        idx.insert("b", bad)  # type: ignore[arg-type]
    with pytest.raises(exc):
        idx.match(bad)  # type: ignore[arg-type]
    with pytest.raises(exc):
        idx.lookup(bad)  # type: ignore[arg-type]
    assert idx.workers() == ["a"]
    assert idx.cached_tokens("a") == 3


@pytest.mark.parametrize("budget", [-1, -(2**40)])
def test_negative_budget_rejected(budget: int) -> None:
    with pytest.raises(ValueError, match=">= 0"):
        PrefixIndex(budget)


@pytest.mark.parametrize("budget", ["10", 1.5, True])
def test_non_int_budget_rejected(budget: object) -> None:
    with pytest.raises(TypeError):
        PrefixIndex(budget)  # type: ignore[arg-type]


def test_budget_property_and_stats() -> None:
    idx = PrefixIndex(max_tokens_per_worker=10)
    assert idx.max_tokens_per_worker == 10
    assert PrefixIndex().max_tokens_per_worker is None
    idx.insert("a", list(range(8)))
    idx.insert("a", list(range(100, 108)))
    stats = idx.stats()
    assert idx.cached_tokens("a") == 10
    assert stats["evicted_tokens"] == 6 == idx.evicted_tokens
    assert stats["cached_tokens"] == 10
    assert stats["memory_bytes"] > 0
    assert "PrefixIndex(" in repr(idx)
    assert PrefixIndex().evicted_tokens == 0
    idx.clear()
    assert idx.evicted_tokens == 0


def test_clear_and_remove() -> None:
    idx = PrefixIndex()
    idx.insert("a", [1, 2])
    idx.add_worker("b")
    assert idx.workers() == ["a", "b"]
    idx.clear()
    assert idx.workers() == ["a", "b"]
    assert idx.match([1, 2]) == {}
    idx.remove_worker("a")
    idx.remove_worker("nobody")
    assert idx.workers() == ["b"]


def test_threads_share_one_index() -> None:
    """Several threads insert and match at once; the final state is what a serial run
    of the same per-worker inserts gives (each thread owns its worker)."""
    idx = PrefixIndex(max_tokens_per_worker=5_000)
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, 50_000, 300, dtype=np.uint32)
    batches = [
        [
            np.concatenate([prefix, rng.integers(0, 50_000, 200, dtype=np.uint32)])
            for _ in range(200)
        ]
        for _ in range(4)
    ]
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for req in batches[t]:
                idx.match(req)
                idx.insert(f"w{t}", req)
                assert idx.longest_match(req)[0] == len(req)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors
    assert not any(th.is_alive() for th in threads)
    idx.check_invariants()
    serial = PrefixIndex(max_tokens_per_worker=5_000)
    for t in range(4):
        for req in batches[t]:
            serial.insert(f"w{t}", req)
    for t in range(4):
        assert idx.cached_tokens(f"w{t}") == serial.cached_tokens(f"w{t}") <= 5_000
    probe = batches[2][-1]
    assert idx.match(probe) == serial.match(probe)


def test_recycled_worker_ids_report_the_new_name() -> None:
    """Worker ids are reused after removal; answers must name the current worker."""
    idx = PrefixIndex()
    idx.insert("old", [1, 2, 3])
    assert idx.longest_match([1, 2, 3]) == (3, ["old"])
    assert idx.match([1, 2]) == {"old": 2}
    idx.remove_worker("old")
    idx.insert("new", [1, 2, 3])
    assert idx.longest_match([1, 2, 3]) == (3, ["new"])
    assert idx.match([1, 2]) == {"new": 2}


def test_token_ids_from_a_lookup_stand_for_the_prompt_everywhere() -> None:
    idx = PrefixIndex()
    idx.insert("a", [1, 2, 3])
    matches, longest, holders, ids = idx.lookup(array.array("I", [1, 2, 3, 4, 5]))
    assert (matches, longest, holders, len(ids)) == ({"a": 3}, 3, ["a"], 5)
    assert "5 tokens" in repr(ids)
    assert idx.insert("b", ids) == 0
    assert idx.longest_match([1, 2, 3, 4, 5]) == (5, ["b"])
    assert idx.rollback("b", ids, 0) == 5  # the insert undone from the same handle
    assert idx.match([1, 2, 3, 4, 5]) == {"a": 3}
    blocks = BlockIndex()
    blocks.stored("w", None, [7], ids, 5)  # any call that takes tokens
    assert blocks.match([1, 2, 3, 4, 5]) == {"w": 5}
    idx.check_invariants()


def test_token_ids_cross_between_byte_and_u32_indexes() -> None:
    """A ``TokenIds`` of either kind of index is read by the other: widened, or
    narrowed (refused above 255); its walk only serves the index that made it."""
    wide, narrow = PrefixIndex(), PrefixIndex(byte_tokens=True)
    assert (wide.byte_tokens, narrow.byte_tokens) == (False, True)
    assert "byte_tokens=True" in repr(narrow) and "byte_tokens" not in repr(wide)
    *_, from_bytes = narrow.lookup(b"hello world")
    *_, from_wide = wide.lookup(array.array("I", iter(b"hello there")))
    assert (len(from_bytes), len(from_wide)) == (11, 11)
    assert wide.insert("a", from_bytes) == 0 and narrow.insert("a", from_wide) == 0
    assert wide.match(b"hello world") == {"a": 11} and narrow.match(b"hello there") == {"a": 11}
    *_, too_wide = wide.lookup([1, 2, 999])
    with pytest.raises(ValueError, match="position 2 is 999"):
        narrow.insert("a", too_wide)
    narrow.check_invariants()


def test_a_byte_index_stores_a_byte_per_token() -> None:
    text = ("a shared system prompt, " * 200).encode()
    stats = []
    for byte_tokens in (False, True):
        idx = PrefixIndex(byte_tokens=byte_tokens)
        for i in range(50):
            idx.insert(f"w{i % 4}", text + b"question %d" % i)
        stats.append(idx.stats())
    wide, narrow = stats
    assert {k: v for k, v in wide.items() if k != "memory_bytes"} == {
        k: v for k, v in narrow.items() if k != "memory_bytes"
    }
    # The same tree, with edges of one byte per token instead of four.
    assert wide["memory_bytes"] - narrow["memory_bytes"] >= 3 * wide["stored_tokens"]
