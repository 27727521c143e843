"""The simulated worker's prefix cache (kvroute.sim.cache) and cost model (kvroute.sim.cost)."""

from __future__ import annotations

import numpy as np
import pytest

from kvroute.sim.cache import PrefixCache, block_keys, block_keys_array
from kvroute.sim.cost import CostModel

B = 4


def toks(*blocks: int, extra: int = 0) -> list[int]:
    """Prompt made of whole blocks whose tokens are all the given value, plus a tail."""
    out = [v for b in blocks for v in [b] * B]
    return out + [999] * extra


def test_block_keys_chain_and_determinism() -> None:
    a = block_keys(toks(1, 2, 3), B)
    assert len(a) == 3
    assert block_keys(toks(1, 2, 3, extra=3), B) == a  # partial block ignored
    assert block_keys(toks(1, 2), B) == a[:2]  # prefix -> same leading keys
    b = block_keys(toks(9, 2, 3), B)
    assert b[1] != a[1] and b[2] != a[2]  # chained: a different parent changes every key
    assert block_keys([], B) == []
    arr = np.asarray(toks(1, 2, 3), dtype=np.uint32)
    assert block_keys_array(arr, B).tolist() == a  # numpy and lists agree
    assert all(0 <= k < 2**64 for k in a)


def test_repeat_hits_all_but_last_token() -> None:
    c = PrefixCache(100, B)
    cached, h = c.admit(toks(1, 2, 3, extra=1))
    assert cached == 0
    c.release(h)
    # 13 tokens: 3 full blocks cached; the last token is always recomputed.
    assert c.lookup(toks(1, 2, 3, extra=1)) == 12
    # exactly 3 blocks: only 2 count (the last token of block 3 is recomputed)
    assert c.lookup(toks(1, 2, 3)) == 8
    assert c.lookup(toks(1, 2, 7, 7)) == 8  # shared prefix of two blocks
    assert c.lookup(toks(5, 2, 3, 3)) == 0  # different first block: nothing
    cached, h = c.admit(toks(1, 2, 3, extra=2))
    assert cached == 12
    assert c.queries == 13 + 14 and c.hits == 12


def test_lru_evicts_least_recently_released() -> None:
    c = PrefixCache(4 * B, B)  # 4 blocks
    for first in (1, 2):
        _, h = c.admit(toks(first, first + 10))
        c.release(h)
    assert c.num_blocks == 4
    _, h = c.admit(toks(1, 11, extra=1))  # touch prompt 1: now most recent
    c.release(h)
    _, h = c.admit(toks(3, 13))  # needs 2 blocks: evicts prompt 2's
    c.release(h)
    assert c.lookup(toks(1, 11, extra=1)) == 2 * B
    assert c.lookup(toks(2, 12, extra=1)) == 0
    assert c.lookup(toks(3, 13, extra=1)) == 2 * B
    assert c.evicted_blocks == 2


def test_tail_blocks_evicted_before_shared_head() -> None:
    c = PrefixCache(3 * B, B)
    _, h = c.admit(toks(1, 2, 3))
    c.release(h)  # released tail first: block 3 is the oldest
    _, h = c.admit(toks(9))
    c.release(h)
    assert c.lookup(toks(1, 2, 3, extra=1)) == 2 * B


def test_pinned_blocks_are_not_evicted_and_capacity_holds() -> None:
    c = PrefixCache(3 * B, B)
    cached, running = c.admit(toks(1, 2))
    assert c.pinned_blocks == 2
    # Only one block is free: the second request caches its first block only.
    cached, h2 = c.admit(toks(5, 6, 7))
    assert cached == 0
    assert c.num_blocks == 3 <= c.capacity_blocks
    assert c.lookup(toks(1, 2, extra=1)) == 2 * B  # the running request's blocks stayed
    assert c.lookup(toks(5, 6, 7, extra=1)) == B
    c.release(h2)
    c.release(running)
    assert c.pinned_blocks == 0
    for i in range(20):  # churn never exceeds capacity
        _, h = c.admit(toks(100 + i, 200 + i))
        c.release(h)
        assert c.num_blocks <= 3


def test_shared_blocks_refcounted() -> None:
    c = PrefixCache(10 * B, B)
    _, a = c.admit(toks(1, 2))
    cached, b = c.admit(toks(1, 2, 3))
    assert cached == 2 * B
    c.release(a)
    assert c.pinned_blocks == 3  # still held by b
    c.release(b)
    assert c.pinned_blocks == 0


def test_clear_and_stale_handles() -> None:
    c = PrefixCache(10 * B, B)
    _, h = c.admit(toks(1, 2))
    c.clear()
    assert c.num_blocks == 0 and c.cached_tokens == 0
    c.release(h)  # no error, no negative counts
    assert c.pinned_blocks == 0
    assert c.lookup(toks(1, 2, extra=1)) == 0


def test_zero_capacity_caches_nothing() -> None:
    c = PrefixCache(0, B)
    cached, h = c.admit(toks(1, 2))
    c.release(h)
    assert cached == 0 and c.num_blocks == 0 and c.usage() == 0.0


def test_usage_counts_pinned_blocks_only() -> None:
    """As vLLM's kv_cache_usage_perc: blocks of running requests; a finished request's
    blocks stay cached (a later prompt hits them) but count as free."""
    c = PrefixCache(10 * B, B)
    _, h = c.admit(toks(1, 2, 3, 4, extra=1))
    assert c.usage() == 0.4
    c.release(h)
    assert c.num_blocks == 4 and c.usage() == 0.0
    cached, h = c.admit(toks(1, 2, extra=1))
    assert cached == 2 * B and c.usage() == 0.2
    c.release(h)


def test_admission_needs_room_beside_the_running_requests() -> None:
    """A request fits when its prompt's blocks that no running request pins fit into the
    blocks not pinned; cached blocks nobody pins count as free; alone it always fits."""
    c = PrefixCache(10 * B, B)
    big = toks(1, 2, 3, 4, 5, 6, extra=1)
    assert c.fits(block_keys(big, B), len(big))
    _, h = c.admit(big)  # 6 of 10 blocks pinned
    other = toks(7, 8, 9, 10, 11, extra=1)  # 5 new blocks: 4 free
    assert not c.fits(block_keys(other, B), len(other))
    sharing = toks(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, extra=1)  # 6 pinned + 4 new
    assert c.fits(block_keys(sharing, B), len(sharing))
    c.release(h)  # its 6 blocks stay cached, unpinned: free to evict
    assert c.pinned_blocks == 0 and c.num_blocks == 6
    _, h2 = c.admit(toks(12, 13, 14, 15, 16, extra=1))
    assert c.fits(block_keys(other, B), len(other))  # 5 new into 5 not pinned
    too_big = toks(*range(20, 32))  # 12 blocks, more than the cache: waits for an empty one
    assert not c.fits(block_keys(too_big, B), len(too_big))
    c.release(h2)
    assert c.fits(block_keys(too_big, B), len(too_big))
    c.check_invariants()


def test_event_callbacks() -> None:
    stored: list[tuple[list[int], int | None, list[int], int]] = []
    removed: list[list[int]] = []
    cleared: list[bool] = []
    c = PrefixCache(
        3 * B,
        B,
        on_store=lambda h, p, t, bs: stored.append((h, p, t, bs)),
        on_remove=removed.append,
        on_clear=lambda: cleared.append(True),
    )
    tokens = toks(1, 2, extra=2)
    keys = block_keys(tokens, B)
    _, h = c.admit(tokens)
    c.release(h)
    assert stored == [(keys, None, toks(1, 2), B)]
    stored.clear()
    _, h = c.admit(toks(1, 2, 3))  # only block 3 is new; its parent is block 2
    c.release(h)
    assert stored[0][0] == [block_keys(toks(1, 2, 3), B)[2]]
    assert stored[0][1] == keys[1]
    assert stored[0][2] == toks(3)
    _, h = c.admit(toks(8))  # full: evicts the oldest (block 3, released first)
    c.release(h)
    assert removed == [[block_keys(toks(1, 2, 3), B)[2]]]
    c.clear()
    assert cleared == [True]


def test_cost_model_arithmetic() -> None:
    m = CostModel()
    assert m.prefill_tokens_per_s == 15_000 and m.overhead_s == 0.005 and m.max_batch == 32
    assert m.prefill_s(15_000) == pytest.approx(1.005)
    assert m.prefill_s(0) == pytest.approx(0.005)
    assert m.decode_interval_s(1) == pytest.approx(0.020)
    assert m.decode_interval_s(11) == pytest.approx(0.020 * 1.2)
    assert m.decode_s(1, 4) == 0.0  # the first token comes with the prefill
    assert m.decode_s(101, 1) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        CostModel(max_batch=0)
    with pytest.raises(ValueError):
        CostModel(prefill_tokens_per_s=0)


def test_block_keys_batch_matches_single() -> None:
    from kvroute.sim.cache import block_keys_batch

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150_000, int(n), dtype=np.uint32) for n in rng.integers(0, 90, 60)]
    batch = block_keys_batch(prompts, B, chunk_tokens=200)
    assert len(batch) == len(prompts)
    for p, keys in zip(prompts, batch, strict=True):
        assert keys.tolist() == block_keys(p, B)


def test_random_workload_against_reference_model() -> None:
    """Bounded random admits/releases against a plain-list model of the same rules."""
    rng = np.random.default_rng(5)
    cap = 12
    c = PrefixCache(cap * B, B)
    order: list[int] = []  # reference: LRU order, oldest first
    refs: dict[int, int] = {}
    live: list[tuple[object, list[int]]] = []
    for _ in range(400):
        if live and rng.random() < 0.45:
            h, keys = live.pop(int(rng.integers(len(live))))
            c.release(h)  # type: ignore[arg-type]
            for k in reversed(keys):
                refs[k] -= 1
                order.remove(k)
                order.append(k)
        else:
            prompt = toks(*[int(x) for x in rng.integers(0, 4, int(rng.integers(1, 6)))], extra=1)
            keys = block_keys(prompt, B)
            lead = next((i for i, k in enumerate(keys) if k not in refs), len(keys))
            pinned = sum(1 for n in refs.values() if n)
            need = sum(1 for k in keys if not refs.get(k))
            assert c.fits(keys, len(prompt)) == (not live or need <= cap - pinned)
            cached, h = c.admit(prompt)
            assert cached == lead * B
            for k in keys:
                if k in refs:
                    refs[k] += 1
                    order.remove(k)
                    order.append(k)
            missing = [k for k in keys if k not in refs]
            need = len(refs) + len(missing) - cap
            for k in list(order):
                if need <= 0:
                    break
                if refs[k] == 0:
                    order.remove(k)
                    del refs[k]
                    need -= 1
            missing = missing[: cap - len(refs)]
            for k in missing:
                refs[k] = 1
                order.append(k)
            live.append((h, [k for k in keys if k in refs]))
        c.check_invariants()
        counts = c.ref_counts()
        assert refs == counts
        assert [k for k in order if refs[k] == 0] == [k for k in c._lru if counts[k] == 0]


def test_output_blocks_take_capacity_from_cached_prompts() -> None:
    """vLLM caches the blocks a request's output fills: they evict other prompts' blocks,
    and stay cached (evictable, tail first) once the request ends."""
    from kvroute.sim.cache import output_ids, sequence

    c = PrefixCache(5 * B, B)  # 5 blocks
    _, h = c.admit(toks(1, 2))
    c.release(h)
    prompt = toks(3, extra=2)  # 1 full block + 2 tokens that share a block with the output
    cached, h = c.admit(prompt, output_len=11)
    assert cached == 0 and c.num_blocks == 3
    seq = sequence(prompt, 11)  # the prompt and 10 of the 11 output tokens (KV computed)
    assert len(seq) == 6 + 10 and seq[6:].tolist() == output_ids(10).tolist()
    keys = block_keys(seq, B)
    assert c.next_fill(h) == 2 * B
    c.grow(h, 7)  # block 1 not full yet
    assert c.num_blocks == 3
    c.grow(h, 2 * B)  # block 1 = prompt tail + 2 output tokens: stored and pinned
    assert keys[1] in c and c.num_blocks == 4
    c.grow(h, len(seq))  # blocks 2 and 3: the cache is full, prompt 1's tail goes
    assert c.next_fill(h) is None and c.num_blocks == 5
    assert c.lookup(toks(1, 2, extra=1)) == B, "prompt 1's last block evicted"
    assert c.pinned_blocks == 4
    c.release(h)
    c.check_invariants()
    assert all(k in c for k in keys), "output blocks stay cached after the request"
    # Released tail first: after prompt 1's first block, the output's last blocks go.
    _, h2 = c.admit(toks(7, 8, 9))
    c.release(h2)
    assert keys[0] in c and keys[1] in c and keys[2] not in c and keys[3] not in c
    assert c.lookup(toks(1, extra=1)) == 0


def test_output_blocks_stop_when_nothing_can_be_evicted() -> None:
    c = PrefixCache(3 * B, B)
    _, other = c.admit(toks(5))  # pinned by a running request
    _, h = c.admit(toks(1), output_len=4 * B)
    c.grow(h, 4 * B)  # only block 1 fits next to the pinned ones
    assert h.stalled and c.num_blocks == 3 and c.pinned_blocks == 3
    c.release(other)
    c.grow(h, 5 * B)  # the chain is broken: nothing more is cached for this request
    assert c.num_blocks == 3
    c.release(h)
    c.check_invariants()
    assert c.pinned_blocks == 0


def test_output_block_events_feed_a_block_index() -> None:
    """Output blocks are reported like prompt blocks (parent = the block before, token IDs
    across the prompt/output boundary), so a BlockIndex fed by them agrees with the cache."""
    from kvroute import BlockIndex
    from kvroute.sim.cache import sequence

    index = BlockIndex()
    stored: list[tuple[list[int], int | None, list[int]]] = []
    removed: list[list[int]] = []

    def on_store(hashes: list[int], parent: int | None, ids: list[int], bs: int) -> None:
        stored.append((hashes, parent, ids))
        index.stored("w", parent, hashes, ids, bs)

    def on_remove(hashes: list[int]) -> None:
        removed.append(hashes)
        index.removed("w", hashes)

    c = PrefixCache(4 * B, B, on_store=on_store, on_remove=on_remove)
    _, h = c.admit(toks(1, 2, extra=1))
    c.release(h)
    prompt = toks(3, extra=3)
    seq = sequence(prompt, 2 * B + 2)
    keys = block_keys(seq, B)
    _, h = c.admit(prompt, output_len=2 * B + 2)
    assert stored[-1] == ([keys[0]], None, toks(3))
    c.grow(h, 2 * B)
    assert stored[-1] == ([keys[1]], keys[0], seq[B : 2 * B].tolist())
    assert seq[B : B + 3].tolist() == [999] * 3, "the prompt's tail starts the block"
    c.grow(h, len(seq))  # blocks 2 and 3 together: one event, prompt 1's blocks removed
    assert stored[-1] == (keys[2:4], keys[1], seq[2 * B : 4 * B].tolist())
    assert sorted(k for r in removed for k in r) == sorted(block_keys(toks(1, 2), B))
    c.release(h)
    assert index.cached_tokens("w") == c.cached_tokens == 4 * B
    assert index.match(seq.tolist()) == {"w": 4 * B}
    assert index.match(toks(1, 2, extra=1)) == {}
