//! Unit tests of the prefix index, including a randomized comparison with a
//! token-level reference model of per-worker LRU caches.

use super::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

fn sorted(mut v: Vec<(String, u32)>) -> Vec<(String, u32)> {
    v.sort();
    v
}

#[test]
fn empty_index_matches_nothing() {
    let idx = PrefixIndex::new(None);
    assert_eq!(idx.longest_match(&[1, 2, 3]), (0, vec![]));
    assert!(idx.match_all(&[1, 2, 3]).is_empty());
    assert!(idx.match_all(&[]).is_empty());
}

#[test]
fn shared_prefix_per_worker_lengths() {
    let mut idx = PrefixIndex::new(None);
    idx.insert("a", &[1, 2, 3, 4]);
    idx.insert("b", &[1, 2, 9]);
    idx.insert("c", &[7]);
    idx.check_invariants();
    assert_eq!(
        sorted(idx.match_all(&[1, 2, 3, 4, 5])),
        vec![("a".into(), 4), ("b".into(), 2)]
    );
    assert_eq!(
        sorted(idx.match_all(&[1, 2, 9])),
        vec![("a".into(), 2), ("b".into(), 3)]
    );
    assert_eq!(idx.longest_match(&[1, 2, 3]), (3, vec!["a".into()]));
    let (len, mut ws) = idx.longest_match(&[1, 2]);
    ws.sort();
    assert_eq!((len, ws), (2, vec!["a".into(), "b".into()]));
    assert_eq!(idx.cached_tokens("a"), 4);
    assert_eq!(idx.cached_tokens("b"), 3);
    assert_eq!(idx.cached_tokens("nobody"), 0);
    assert_eq!(idx.stats().stored_tokens, 6);
}

#[test]
fn partial_edge_match() {
    let mut idx = PrefixIndex::new(None);
    idx.insert("a", &[1, 2, 3, 4, 5, 6]);
    assert_eq!(idx.longest_match(&[1, 2, 3, 0]), (3, vec!["a".into()]));
    assert_eq!(idx.longest_match(&[2]), (0, vec![]));
}

#[test]
fn reinsert_is_idempotent_for_size() {
    let mut idx = PrefixIndex::new(None);
    for _ in 0..5 {
        idx.insert("a", &[1, 2, 3]);
    }
    assert_eq!(idx.cached_tokens("a"), 3);
    assert_eq!(idx.stats().nodes, 1);
    idx.check_invariants();
}

#[test]
fn budget_evicts_least_recently_used_first() {
    let mut idx = PrefixIndex::new(Some(6));
    idx.insert("a", &[1, 1, 1]);
    idx.insert("a", &[2, 2, 2]);
    idx.insert("a", &[1, 1, 1]); // refresh: [2,2,2] is now the oldest
    idx.insert("a", &[3, 3, 3]);
    idx.check_invariants();
    assert_eq!(idx.cached_tokens("a"), 6);
    assert_eq!(idx.longest_match(&[2, 2, 2]).0, 0);
    assert_eq!(idx.longest_match(&[1, 1, 1]).0, 3);
    assert_eq!(idx.longest_match(&[3, 3, 3]).0, 3);
    assert_eq!(idx.stats().evicted_tokens, 3);
}

#[test]
fn eviction_trims_the_tail_token_exact() {
    let mut idx = PrefixIndex::new(Some(5));
    idx.insert("a", &[1, 2, 3, 4]);
    idx.insert("a", &[9, 9]); // 6 > 5: trim one token of the older [1,2,3,4]
    idx.check_invariants();
    assert_eq!(idx.cached_tokens("a"), 5);
    assert_eq!(idx.longest_match(&[1, 2, 3, 4]).0, 3);
}

#[test]
fn eviction_only_touches_the_inserting_worker() {
    let mut idx = PrefixIndex::new(Some(4));
    idx.insert("a", &[1, 2, 3, 4]);
    idx.insert("b", &[1, 2, 3, 4]);
    idx.insert("b", &[5, 6]);
    idx.check_invariants();
    assert_eq!(idx.cached_tokens("a"), 4);
    assert_eq!(idx.cached_tokens("b"), 4);
    assert_eq!(
        sorted(idx.match_all(&[1, 2, 3, 4])),
        vec![("a".into(), 4), ("b".into(), 2)]
    );
}

#[test]
fn zero_budget_holds_nothing() {
    let mut idx = PrefixIndex::new(Some(0));
    idx.insert("a", &[1, 2, 3]);
    assert_eq!(idx.cached_tokens("a"), 0);
    assert_eq!(idx.stats().nodes, 0);
    assert_eq!(idx.workers(), vec!["a".to_string()]);
    idx.check_invariants();
}

#[test]
fn remove_worker_frees_its_nodes_only() {
    let mut idx = PrefixIndex::new(None);
    idx.insert("a", &[1, 2, 3]);
    idx.insert("b", &[1, 2, 4]);
    idx.remove_worker("a");
    idx.check_invariants();
    assert_eq!(idx.workers(), vec!["b".to_string()]);
    assert_eq!(idx.stats().stored_tokens, 3);
    assert_eq!(idx.longest_match(&[1, 2, 3]), (2, vec!["b".into()]));
    idx.remove_worker("a"); // unknown now: no-op
    idx.remove_worker("b");
    assert_eq!(idx.stats().nodes, 0);
    idx.insert("a", &[5]);
    idx.check_invariants();
    assert_eq!(idx.workers(), vec!["a".to_string()]);
}

#[test]
fn clear_keeps_workers() {
    let mut idx = PrefixIndex::new(Some(100));
    idx.insert("a", &[1, 2, 3]);
    idx.insert("b", &[4]);
    idx.clear();
    idx.check_invariants();
    assert_eq!(idx.workers(), vec!["a".to_string(), "b".to_string()]);
    assert_eq!(idx.cached_tokens("a"), 0);
    assert_eq!(idx.longest_match(&[1, 2, 3]).0, 0);
    idx.insert("a", &[1, 2]);
    assert_eq!(idx.longest_match(&[1, 2, 3]).0, 2);
}

#[test]
fn lru_queue_stays_bounded_under_repeated_touches() {
    let mut idx = PrefixIndex::new(None);
    for i in 0..10_000u32 {
        idx.insert("a", &[1, 2, 3, i % 4]);
    }
    let w = idx.workers[0].as_ref().unwrap();
    assert!(w.lru.len() as u64 <= 2 * w.held_nodes + 64 + 8);
}

/// Token-level reference: each worker holds a set of prefixes with the stamp of the
/// last insert that touched them; eviction removes the prefix with the smallest
/// (stamp, -length) until the worker is within budget.
#[derive(Default)]
struct Reference {
    budget: Option<usize>,
    clock: u64,
    held: HashMap<String, HashMap<Vec<u32>, u64>>,
}

impl Reference {
    fn insert(&mut self, w: &str, tokens: &[u32]) {
        let set = self.held.entry(w.to_owned()).or_default();
        if tokens.is_empty() {
            return;
        }
        self.clock += 1;
        for i in 1..=tokens.len() {
            set.insert(tokens[..i].to_vec(), self.clock);
        }
        if let Some(b) = self.budget {
            while set.len() > b {
                let victim = set
                    .iter()
                    .min_by_key(|(k, &s)| (s, std::cmp::Reverse(k.len())))
                    .map(|(k, _)| k.clone())
                    .unwrap();
                set.remove(&victim);
            }
        }
    }

    fn match_all(&self, tokens: &[u32]) -> Vec<(String, u32)> {
        let mut out = Vec::new();
        for (w, set) in &self.held {
            let mut best = 0;
            for i in 1..=tokens.len() {
                if set.contains_key(&tokens[..i]) {
                    best = i;
                } else {
                    break;
                }
            }
            if best > 0 {
                out.push((w.clone(), best as u32));
            }
        }
        out.sort();
        out
    }
}

fn random_tokens(rng: &mut SmallRng, stems: &[Vec<u32>]) -> Vec<u32> {
    let mut t = stems[rng.gen_range(0..stems.len())].clone();
    let cut = rng.gen_range(0..=t.len());
    t.truncate(cut);
    for _ in 0..rng.gen_range(0..6) {
        t.push(rng.gen_range(0..4));
    }
    t
}

#[test]
fn randomized_against_reference() {
    for seed in 0..300u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let budget = if seed % 3 == 0 {
            None
        } else {
            Some(rng.gen_range(0..24usize))
        };
        let mut idx = PrefixIndex::new(budget.map(|b| b as u64));
        let mut reference = Reference {
            budget,
            ..Default::default()
        };
        let stems: Vec<Vec<u32>> = (0..3)
            .map(|_| {
                (0..rng.gen_range(1..10))
                    .map(|_| rng.gen_range(0..3))
                    .collect()
            })
            .collect();
        let workers = ["w0", "w1", "w2", "w3"];
        for _step in 0..60 {
            let w = workers[rng.gen_range(0..workers.len())];
            match rng.gen_range(0..10) {
                0 => {
                    idx.remove_worker(w);
                    reference.held.remove(w);
                }
                1..=5 => {
                    let t = random_tokens(&mut rng, &stems);
                    idx.insert(w, &t);
                    reference.insert(w, &t);
                }
                _ => {
                    let t = random_tokens(&mut rng, &stems);
                    assert_eq!(
                        sorted(idx.match_all(&t)),
                        reference.match_all(&t),
                        "seed {seed}"
                    );
                    let expect_best = reference.match_all(&t).iter().map(|x| x.1).max();
                    assert_eq!(idx.longest_match(&t).0, expect_best.unwrap_or(0));
                    // One walk answers both, in the same order as the two calls.
                    let found = idx.lookup_ids(&t);
                    let (longest, holders) = idx.longest_match_ids(&t);
                    assert_eq!(found.matches, idx.match_all_ids(&t), "seed {seed}");
                    assert_eq!(found.longest, longest, "seed {seed}");
                    let first: Vec<u32> =
                        found.matches[..found.holders].iter().map(|m| m.0).collect();
                    assert_eq!(first, holders, "seed {seed}");
                }
            }
            idx.check_invariants();
            for w in workers {
                let expect = reference.held.get(w).map_or(0, |s| s.len() as u64);
                assert_eq!(idx.cached_tokens(w), expect, "seed {seed} worker {w}");
            }
        }
    }
}

#[test]
fn insert_reports_what_was_held_before() {
    let mut idx = PrefixIndex::new(None);
    assert_eq!(idx.insert("a", &[1, 2, 3]).held_before, 0);
    assert_eq!(idx.insert("a", &[1, 2, 3, 4, 5]).held_before, 3);
    assert_eq!(idx.insert("a", &[1, 2, 9]).held_before, 2);
    assert_eq!(idx.insert("a", &[1, 2]).held_before, 2);
    assert_eq!(idx.insert("b", &[1, 2, 3]).held_before, 0);
}

#[test]
fn rollback_undoes_an_insert_exactly() {
    let mut idx = PrefixIndex::new(None);
    idx.insert("a", &[1, 2, 3]);
    idx.insert("b", &[1, 2, 3, 4, 5, 6]);
    let keep = idx.insert("a", &[1, 2, 3, 4, 5, 6, 7]).held_before;
    assert_eq!(keep, 3);
    assert_eq!(idx.rollback("a", &[1, 2, 3, 4, 5, 6, 7], keep), 4);
    idx.check_invariants();
    assert_eq!(idx.cached_tokens("a"), 3);
    assert_eq!(
        sorted(idx.match_all(&[1, 2, 3, 4, 5, 6, 7])),
        vec![("a".into(), 3), ("b".into(), 6)]
    );
    // A fresh prompt rolled back leaves nothing; the tree frees what nobody holds.
    let keep = idx.insert("c", &[8, 8, 8]).held_before;
    assert_eq!(idx.rollback("c", &[8, 8, 8], keep), 3);
    assert_eq!(idx.longest_match(&[8, 8, 8]), (0, vec![]));
    idx.check_invariants();
}

#[test]
fn rollback_keeps_what_other_prefixes_of_the_worker_need() {
    let mut idx = PrefixIndex::new(None);
    let keep = idx.insert("a", &[1, 2, 3, 4]).held_before;
    idx.insert("a", &[1, 2, 3, 9, 9]); // accepted meanwhile, shares [1, 2, 3]
    assert_eq!(idx.rollback("a", &[1, 2, 3, 4], keep), 1);
    idx.check_invariants();
    assert_eq!(
        sorted(idx.match_all(&[1, 2, 3, 9, 9])),
        vec![("a".into(), 5)]
    );
    assert_eq!(sorted(idx.match_all(&[1, 2, 3, 4])), vec![("a".into(), 3)]);
    assert_eq!(idx.rollback("nobody", &[1, 2], 0), 0);
}

#[test]
fn rollback_of_random_inserts_keeps_invariants() {
    let mut rng = SmallRng::seed_from_u64(7);
    let mut idx = PrefixIndex::new(Some(200));
    for _ in 0..2000 {
        let w = ["a", "b", "c"][rng.gen_range(0..3)];
        let n = rng.gen_range(1..40);
        let tokens: Vec<u32> = (0..n).map(|_| rng.gen_range(0..4)).collect();
        let before = idx.cached_tokens(w);
        let ins = idx.insert(w, &tokens);
        if rng.gen_bool(0.5) && ins.evicted == 0 {
            idx.rollback(w, &tokens, ins.held_before);
            // Exactly what the worker held before the insert.
            assert_eq!(idx.cached_tokens(w), before);
            let held = idx.match_all(&tokens).into_iter().find(|(x, _)| x == w);
            assert_eq!(held.map_or(0, |(_, m)| u64::from(m)), ins.held_before);
        }
        idx.check_invariants();
    }
}

#[test]
fn a_worker_budget_overrides_the_index_budget() {
    let mut idx = PrefixIndex::new(Some(100));
    let long: Vec<u32> = (0..80).collect();
    idx.insert("a", &long);
    idx.insert("b", &long);
    // Shrinking one worker's budget evicts at once, and only from that worker.
    assert_eq!(idx.set_worker_budget("a", Some(30)), 50);
    assert_eq!(idx.cached_tokens("a"), 30);
    assert_eq!(idx.cached_tokens("b"), 80);
    assert_eq!(idx.worker_budget("a"), Some(30));
    assert_eq!(idx.worker_budget("b"), Some(100));
    let longer: Vec<u32> = (1000..1090).collect();
    idx.insert("a", &longer);
    assert!(idx.cached_tokens("a") <= 30);
    // A larger own budget lifts the index's for that worker.
    idx.set_worker_budget("b", Some(500));
    idx.insert("b", &longer);
    assert_eq!(idx.cached_tokens("b"), 170);
    idx.check_invariants();
    // Back to the index's budget.
    assert_eq!(idx.set_worker_budget("b", None), 70);
    assert_eq!(idx.worker_budget("unknown"), Some(100));
    idx.check_invariants();
}

#[test]
fn common_prefix_finds_the_first_difference_at_every_position() {
    for len in [0usize, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 130] {
        let a: Vec<u32> = (0..len as u32).map(|x| x * 7 + 1).collect();
        let a8: Vec<u8> = a.iter().map(|&x| x as u8).collect();
        assert_eq!(u32::common_prefix(&a, &a), len);
        assert_eq!(u32::common_prefix(&a, &a[..len / 2]), len / 2);
        assert_eq!(u8::common_prefix(&a8, &a8), len);
        assert_eq!(u8::common_prefix(&a8, &a8[..len / 2]), len / 2);
        for at in 0..len {
            for flip in [1u32, 1 << 31] {
                let mut b = a.clone();
                b[at] ^= flip;
                assert_eq!(u32::common_prefix(&a, &b), at, "len {len} at {at}");
                assert_eq!(u32::common_prefix(&b, &a), at, "len {len} at {at}");
            }
            for flip in [1u8, 1 << 7] {
                let mut b = a8.clone();
                b[at] ^= flip;
                assert_eq!(u8::common_prefix(&a8, &b), at, "len {len} at {at}");
                assert_eq!(u8::common_prefix(&b, &a8), at, "len {len} at {at}");
            }
        }
    }
}

#[test]
fn a_byte_index_answers_as_the_index_of_its_bytes_widened() {
    // The same operations on bytes, and on the same bytes as u32 token IDs: every
    // answer (matches, lookups, inserts, rollbacks, evictions, counters) is the same;
    // only the memory differs.
    for seed in 0..200u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let budget = if seed % 3 == 0 {
            None
        } else {
            Some(rng.gen_range(0..200u64))
        };
        let mut wide = PrefixIndex::new(budget);
        let mut bytes = ByteIndex::new(budget);
        // Long stems, so edges are compared in whole chunks as well as token by token.
        let stems: Vec<Vec<u32>> = (0..3)
            .map(|_| {
                (0..rng.gen_range(1..150))
                    .map(|_| rng.gen_range(0..3))
                    .collect()
            })
            .collect();
        let workers = ["w0", "w1", "w2"];
        let mut done: Vec<(&str, Vec<u32>, u64)> = Vec::new();
        for step in 0..80 {
            let w = workers[rng.gen_range(0..workers.len())];
            let t = random_tokens(&mut rng, &stems);
            let t8: Vec<u8> = t.iter().map(|&x| x as u8).collect();
            let at = format!("seed {seed} step {step}");
            match rng.gen_range(0..12) {
                0 => {
                    wide.remove_worker(w);
                    bytes.remove_worker(w);
                }
                1 => {
                    let b = rng.gen_range(0..100u64);
                    assert_eq!(
                        wide.set_worker_budget(w, Some(b)),
                        bytes.set_worker_budget(w, Some(b)),
                        "{at}"
                    );
                }
                2 if !done.is_empty() => {
                    let (w, t, keep) = done.swap_remove(rng.gen_range(0..done.len()));
                    let t8: Vec<u8> = t.iter().map(|&x| x as u8).collect();
                    assert_eq!(
                        wide.rollback(w, &t, keep),
                        bytes.rollback(w, &t8, keep),
                        "{at}"
                    );
                }
                3..=7 => {
                    let a = wide.insert(w, &t);
                    let b = bytes.insert(w, &t8);
                    assert_eq!(a, b, "{at}");
                    done.push((w, t, a.held_before));
                }
                8 => {
                    // Insert through the lookup's walk, as a routing decision does.
                    let (fa, fb) = (wide.lookup_ids(&t), bytes.lookup_ids(&t8));
                    assert_eq!(fa.matches, fb.matches, "{at}");
                    let a = wide.insert_after(w, &t, &fa.walk);
                    assert_eq!(a, bytes.insert_after(w, &t8, &fb.walk), "{at}");
                    done.push((w, t, a.held_before));
                }
                _ => {
                    let (fa, fb) = (wide.lookup_ids(&t), bytes.lookup_ids(&t8));
                    assert_eq!(
                        (fa.matches, fa.longest, fa.holders),
                        (fb.matches, fb.longest, fb.holders),
                        "{at}"
                    );
                    assert_eq!(
                        sorted(wide.match_all(&t)),
                        sorted(bytes.match_all(&t8)),
                        "{at}"
                    );
                }
            }
            bytes.check_invariants();
            let (sa, sb) = (wide.stats(), bytes.stats());
            assert_eq!(
                (
                    sa.nodes,
                    sa.stored_tokens,
                    sa.cached_tokens,
                    sa.evicted_tokens
                ),
                (
                    sb.nodes,
                    sb.stored_tokens,
                    sb.cached_tokens,
                    sb.evicted_tokens
                ),
                "{at}"
            );
            assert!(sb.memory_bytes <= sa.memory_bytes, "{at}");
            for w in workers {
                assert_eq!(wide.cached_tokens(w), bytes.cached_tokens(w), "{at} {w}");
            }
        }
    }
}

/// Every observable answer of an index, for comparing two that should be equal.
fn snapshot(idx: &PrefixIndex, probes: &[Vec<u32>]) -> (Vec<Vec<(String, u32)>>, IndexStats) {
    let matches = probes.iter().map(|p| sorted(idx.match_all(p))).collect();
    (matches, idx.stats())
}

#[test]
fn insert_after_a_lookup_is_insert() {
    // Two indexes see the same operations; one inserts through the lookup's walk
    // (current, stale after another change, or taken on the other index), the other
    // from the root. Same answers, same reports, same state.
    for seed in 0..300u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let budget = if seed % 2 == 0 {
            None
        } else {
            Some(rng.gen_range(1..30u64))
        };
        let mut plain = PrefixIndex::new(budget);
        let mut walked = PrefixIndex::new(budget);
        let other = PrefixIndex::new(budget);
        let stems: Vec<Vec<u32>> = (0..3)
            .map(|_| {
                (0..rng.gen_range(1..40))
                    .map(|_| rng.gen_range(0..3))
                    .collect()
            })
            .collect();
        let workers = ["w0", "w1", "w2"];
        let mut probes = Vec::new();
        for _step in 0..50 {
            let w = workers[rng.gen_range(0..workers.len())];
            let t = random_tokens(&mut rng, &stems);
            match rng.gen_range(0..8) {
                0 => {
                    plain.remove_worker(w);
                    walked.remove_worker(w);
                }
                1 => {
                    // A walk made stale by another change in between.
                    let found = walked.lookup_ids(&t);
                    let u = random_tokens(&mut rng, &stems);
                    let v = workers[rng.gen_range(0..workers.len())];
                    match rng.gen_range(0..5) {
                        0 => {
                            plain.insert(v, &u);
                            walked.insert(v, &u);
                        }
                        1 => {
                            plain.rollback(v, &t, 0);
                            walked.rollback(v, &t, 0);
                        }
                        2 => {
                            plain.remove_worker(v);
                            walked.remove_worker(v);
                        }
                        3 => {
                            plain.set_worker_budget(v, Some(3));
                            walked.set_worker_budget(v, Some(3));
                        }
                        _ => {
                            plain.clear();
                            walked.clear();
                        }
                    }
                    assert_eq!(
                        plain.insert(w, &t),
                        walked.insert_after(w, &t, &found.walk),
                        "seed {seed}"
                    );
                }
                2 => {
                    // A walk of another index is not this one's.
                    let found = other.lookup_ids(&t);
                    assert_eq!(
                        plain.insert(w, &t),
                        walked.insert_after(w, &t, &found.walk),
                        "seed {seed}"
                    );
                }
                _ => {
                    let found = walked.lookup_ids(&t);
                    assert_eq!(found.matches, walked.match_all_ids(&t));
                    assert_eq!(
                        plain.insert(w, &t),
                        walked.insert_after(w, &t, &found.walk),
                        "seed {seed}"
                    );
                }
            }
            probes.push(t);
            walked.check_invariants();
            assert_eq!(
                snapshot(&plain, &probes),
                snapshot(&walked, &probes),
                "seed {seed}"
            );
            for w in workers {
                assert_eq!(
                    plain.cached_tokens(w),
                    walked.cached_tokens(w),
                    "seed {seed}"
                );
            }
        }
    }
}
