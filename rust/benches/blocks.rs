//! Criterion benches of `BlockIndex::match_all` (precise mode's lookup), against the
//! first implementation kept as `match_all_reference`, in the same run.
//!
//! Data, the llm-d shape: 150 system prompts of 6,000 tokens, each stored (blocks of
//! 16) with 8 of its questions of 1,200 tokens, through `stored` events as an engine
//! reports them. Queries are new 7,200-token requests (a system prompt + an unseen
//! question): 375 blocks match, then the request diverges. `4w`: 4 workers, each group
//! on one of them; `64w_8copies`: 64 workers, each group on 8 of them (several workers
//! stay in the running over the whole prefix).
//!
//! After criterion's output, a summary table (µs per match, the reference's, the ratio)
//! from one timed pass of each, and the time to compute a query's block keys with the
//! current key function and with the first one (the reference matcher uses the current
//! keys: the index stores those). Run: `cargo bench --bench blocks` (`-- --quick`).

use criterion::{criterion_group, Criterion, Throughput};
use kvroute::BlockIndex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use std::time::Instant;

const BS: usize = 16;
const GROUPS: usize = 150;

fn random(rng: &mut SmallRng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.gen_range(0..150_000)).collect()
}

/// An index fed with `GROUPS` system prompts (and questions) over `workers` workers,
/// `copies` workers per group; and 300 queries.
fn setup(workers: usize, copies: usize) -> (BlockIndex, Vec<Vec<u32>>) {
    let mut rng = SmallRng::seed_from_u64(3);
    let systems: Vec<Vec<u32>> = (0..GROUPS).map(|_| random(&mut rng, 6000)).collect();
    let mut idx = BlockIndex::new();
    let mut hash = 0u64;
    for (g, sys) in systems.iter().enumerate() {
        for c in 0..copies {
            let name = format!("http://10.0.0.{}:8000", (g * copies + c) % workers);
            for _ in 0..8 {
                let mut t = sys.clone();
                t.extend(random(&mut rng, 1200));
                let n = t.len() / BS;
                let hashes: Vec<u64> = (hash..hash + n as u64).collect();
                hash += n as u64;
                idx.stored(&name, None, &hashes, &t[..n * BS], BS).unwrap();
            }
        }
    }
    let queries = (0..300)
        .map(|i| {
            let mut t = systems[i % GROUPS].clone();
            t.extend(random(&mut rng, 1200));
            t
        })
        .collect();
    (idx, queries)
}

const CASES: [(&str, usize, usize); 2] = [("4w", 4, 1), ("64w_8copies", 64, 8)];

fn benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("block_match");
    g.sample_size(10);
    for (name, workers, copies) in CASES {
        let (idx, queries) = setup(workers, copies);
        g.throughput(Throughput::Elements(queries.len() as u64));
        g.bench_function(format!("match_all/{name}"), |b| {
            b.iter(|| {
                queries
                    .iter()
                    .for_each(|q| drop(black_box(idx.match_all(q))))
            })
        });
        g.bench_function(format!("reference/{name}"), |b| {
            b.iter(|| {
                queries
                    .iter()
                    .for_each(|q| drop(black_box(idx.match_all_reference(q))))
            })
        });
    }
    g.finish();
}

/// The first version of `blocks::block_key` (every token a step of one serial chain
/// seeded by the parent), kept here to time it against the current one.
fn serial_block_key(parent: u64, tokens: &[u32]) -> u64 {
    fn fmix64(mut k: u64) -> u64 {
        k ^= k >> 33;
        k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
        k ^= k >> 33;
        k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        k ^ (k >> 33)
    }
    let mut h = fmix64(parent ^ (tokens.len() as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    for c in tokens.chunks_exact(2) {
        let w = (c[0] as u64) | ((c[1] as u64) << 32);
        h = (h.rotate_left(23) ^ w).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fmix64(h)
}

fn time_per_query(queries: &[Vec<u32>], f: impl Fn(&[u32]) -> Vec<(String, u32)>) -> f64 {
    let t = Instant::now();
    for _ in 0..5 {
        for q in queries {
            black_box(f(q));
        }
    }
    t.elapsed().as_secs_f64() * 1e6 / (5 * queries.len()) as f64
}

fn summary() {
    println!("\n## Summary (one timed pass each, 7,200-token queries, blocks of {BS})\n");
    println!("| case | match_all µs | reference µs | speed-up |\n|---|---:|---:|---:|");
    for (name, workers, copies) in CASES {
        let (idx, queries) = setup(workers, copies);
        for q in &queries {
            assert_eq!(idx.match_all(q), idx.match_all_reference(q));
        }
        let reference = time_per_query(&queries, |q| idx.match_all_reference(q));
        let new = time_per_query(&queries, |q| idx.match_all(q));
        println!(
            "| {name} | {new:.2} | {reference:.2} | {:.1}x |",
            reference / new
        );
    }
    let (_, queries) = setup(4, 1);
    let keys_only = time_per_query(&queries, |q| {
        black_box(kvroute::blocks::chain_keys(q, BS));
        Vec::new()
    });
    let serial_keys = time_per_query(&queries, |q| {
        let mut parent = 0x6b76_726f_7574_6521;
        for block in q.chunks_exact(BS) {
            parent = serial_block_key(parent, block);
            black_box(parent);
        }
        Vec::new()
    });
    println!(
        "\nblock keys of a query: {keys_only:.2} µs; with the first key function (one serial \
         chain of multiplications): {serial_keys:.2} µs ({:.1}x)",
        serial_keys / keys_only
    );
}

criterion_group!(block_benches, benches);

fn main() {
    block_benches();
    Criterion::default().configure_from_args().final_summary();
    summary();
}
