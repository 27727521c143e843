//! Unit tests of the block index, including a randomized comparison of `match_all`
//! with its first implementation.

use super::*;

fn toks(n: usize, base: u32) -> Vec<u32> {
    (0..n as u32).map(|i| base + i).collect()
}

fn sorted(mut v: Vec<(String, u32)>) -> Vec<(String, u32)> {
    v.sort();
    v
}

#[test]
fn chain_is_prefix_sensitive() {
    let a = chain_keys(&toks(8, 0), 4);
    let mut other = toks(8, 0);
    other[0] = 99;
    let b = chain_keys(&other, 4);
    assert_eq!(a.len(), 2);
    assert_ne!(a[1], b[1], "a change in block 0 changes every later key");
    assert_eq!(chain_keys(&toks(7, 0), 4), a[..1].to_vec());
}

#[test]
fn stored_then_matched_in_whole_blocks() {
    let mut idx = BlockIndex::new();
    let t = toks(12, 100);
    idx.stored("w1", None, &[11, 12], &t[..8], 4).unwrap();
    idx.stored("w1", Some(12), &[13], &t[8..12], 4).unwrap();
    idx.stored("w2", None, &[21], &t[..4], 4).unwrap();
    assert_eq!(
        sorted(idx.match_all(&toks(14, 100))),
        vec![("w1".into(), 12), ("w2".into(), 4)]
    );
    // A request that diverges inside block 1 only gets block 0.
    let mut q = toks(12, 100);
    q[5] = 0;
    assert_eq!(
        sorted(idx.match_all(&q)),
        vec![("w1".into(), 4), ("w2".into(), 4)]
    );
    assert_eq!(idx.cached_tokens("w1"), 12);
}

#[test]
fn removal_and_clear() {
    let mut idx = BlockIndex::new();
    let t = toks(8, 0);
    idx.stored("w", None, &[1, 2], &t, 4).unwrap();
    assert_eq!(idx.removed("w", &[2, 999]), 1);
    assert_eq!(idx.match_all(&t), vec![("w".into(), 4)]);
    // Removing a leading block breaks the prefix even if later blocks remain.
    idx.stored("w", Some(1), &[2], &t[4..], 4).unwrap();
    idx.removed("w", &[1]);
    assert!(idx.match_all(&t).is_empty());
    idx.clear_worker("w");
    assert_eq!(idx.cached_tokens("w"), 0);
    assert_eq!(idx.distinct_blocks(), 0);
    assert_eq!(idx.workers(), vec!["w".to_string()]);
}

#[test]
fn unknown_parent_is_an_error_and_changes_nothing() {
    let mut idx = BlockIndex::new();
    let err = idx.stored("w", Some(42), &[1], &toks(4, 0), 4);
    assert_eq!(err, Err(EventError::UnknownParent(42)));
    assert_eq!(idx.cached_tokens("w"), 0);
    assert!(idx.stored("w", None, &[1, 2], &toks(3, 0), 4).is_err());
}

#[test]
fn duplicate_and_rehashed_blocks_are_counted_once() {
    let mut idx = BlockIndex::new();
    let t = toks(4, 0);
    idx.stored("w", None, &[1], &t, 4).unwrap();
    idx.stored("w", None, &[1], &t, 4).unwrap();
    idx.stored("w", None, &[7], &t, 4).unwrap(); // same content, other engine hash
    assert_eq!(idx.cached_blocks("w"), 1);
    idx.removed("w", &[1]);
    assert_eq!(
        idx.match_all(&t),
        vec![("w".into(), 4)],
        "hash 7 still holds it"
    );
    idx.removed("w", &[7]);
    assert!(idx.match_all(&t).is_empty());
}

#[test]
fn match_all_agrees_with_the_reference_on_random_states() {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    let mut rng = SmallRng::seed_from_u64(7);
    for round in 0..200 {
        let mut idx = BlockIndex::new();
        // A few prefixes that share leading blocks, over a small alphabet.
        let bases: Vec<Vec<u32>> = (0..4)
            .map(|_| (0..48).map(|_| rng.gen_range(0..3)).collect())
            .collect();
        let mut hash = 1u64;
        for w in 0..rng.gen_range(1..12) {
            let name = format!("w{w}");
            let bs = if round % 3 == 0 && w % 2 == 1 { 8 } else { 4 };
            for _ in 0..rng.gen_range(0..4) {
                let t = &bases[rng.gen_range(0..bases.len())];
                let nb = rng.gen_range(1..=t.len() / bs);
                let hashes: Vec<u64> = (0..nb as u64).map(|i| hash + i).collect();
                hash += nb as u64;
                idx.stored(&name, None, &hashes, &t[..nb * bs], bs).unwrap();
                if rng.gen_bool(0.3) {
                    let h = hashes[rng.gen_range(0..nb)];
                    idx.removed(&name, &[h]);
                }
            }
        }
        for _ in 0..20 {
            let t = &bases[rng.gen_range(0..bases.len())];
            let mut q = t[..rng.gen_range(0..=t.len())].to_vec();
            if !q.is_empty() && rng.gen_bool(0.3) {
                let i = rng.gen_range(0..q.len());
                q[i] = 9; // diverge somewhere
            }
            assert_eq!(
                sorted(idx.match_all(&q)),
                sorted(idx.match_all_reference(&q)),
                "round {round}"
            );
        }
    }
}

#[test]
fn workers_with_different_block_sizes() {
    let mut idx = BlockIndex::new();
    let t = toks(64, 0);
    idx.stored("a", None, &[1, 2], &t[..32], 16).unwrap();
    idx.stored("b", None, &[5], &t[..32], 32).unwrap();
    assert_eq!(
        sorted(idx.match_all(&t)),
        vec![("a".into(), 32), ("b".into(), 32)]
    );
    idx.remove_worker("a");
    assert_eq!(idx.match_all(&t), vec![("b".into(), 32)]);
}

#[test]
fn holders_spill_to_the_heap_and_back_to_empty() {
    let mut h = Holders::default();
    for id in 0..6 {
        h.push(id);
    }
    assert!(matches!(h, Holders::Heap(_)));
    assert_eq!(h.as_slice(), &[0, 1, 2, 3, 4, 5]);
    assert!(!h.remove(3));
    assert_eq!(h.as_slice(), &[0, 1, 2, 4, 5]);
    let mut small = Holders::default();
    small.push(7);
    small.push(8);
    small.push(9);
    assert!(!small.remove(8) && !small.remove(42));
    assert_eq!(small.as_slice(), &[7, 9]);
    assert!(!small.remove(7));
    assert!(small.remove(9), "empty once the last holder goes");
}
