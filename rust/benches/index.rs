//! Criterion benches of the prefix index (no Python involved).
//!
//! Data: 10,000 requests of ~2,000 tokens, each one of 6 template prefixes (~30 tokens)
//! plus a random tail, spread round-robin over W workers. Scenarios: INSERT into a fresh
//! index, MATCH of the same requests (100% hits; `longest_match` and the per-worker
//! `match_all`), MIXED routing of shared-prefix traffic (2,048-token system prompt +
//! 128-token question: match then insert), CONCURRENT (2 threads mixing match and
//! insert), EVICTION under a budget of 10% of the inserted tokens.
//!
//! After criterion's own output, a summary table (µs/op, ops/s, tokens/s, bytes per
//! token) is printed from one timed pass of each scenario.
//! Run: `cargo bench --bench index` (quick: `cargo bench --bench index -- --quick`).

use criterion::{criterion_group, BatchSize, Criterion, Throughput};
use kvroute::PrefixIndex;
use parking_lot::RwLock;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

const N_REQUESTS: usize = 10_000;
const WORKER_COUNTS: [usize; 4] = [10, 50, 100, 500];

fn template_requests(n: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let templates: Vec<Vec<u32>> = (0..6)
        .map(|_| {
            (0..rng.gen_range(25..36))
                .map(|_| rng.gen_range(0..150_000))
                .collect()
        })
        .collect();
    (0..n)
        .map(|_| {
            let mut t = templates[rng.gen_range(0..templates.len())].clone();
            let tail = rng.gen_range(1900..2000);
            t.extend((0..tail).map(|_| rng.gen_range(0..150_000u32)));
            t
        })
        .collect()
}

/// 64 groups × 16 questions: 2,048-token system prompt + 128-token question.
fn shared_prefix_requests(seed: u64) -> Vec<(usize, Vec<u32>)> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut out = Vec::new();
    let systems: Vec<Vec<u32>> = (0..64)
        .map(|_| (0..2048).map(|_| rng.gen_range(0..150_000)).collect())
        .collect();
    for _ in 0..16 {
        for (g, sys) in systems.iter().enumerate() {
            let mut t = sys.clone();
            t.extend((0..128).map(|_| rng.gen_range(0..150_000u32)));
            out.push((g, t));
        }
    }
    out
}

fn names(w: usize) -> Vec<String> {
    (0..w).map(|i| format!("http://10.0.0.{i}:8000")).collect()
}

fn filled(reqs: &[Vec<u32>], workers: &[String], budget: Option<u64>) -> PrefixIndex {
    let mut idx = PrefixIndex::new(budget);
    for (i, r) in reqs.iter().enumerate() {
        idx.insert(&workers[i % workers.len()], r);
    }
    idx
}

fn mixed(idx: &mut PrefixIndex, reqs: &[(usize, Vec<u32>)], workers: &[String]) {
    for (g, r) in reqs {
        let (len, holders) = idx.longest_match_ids(r);
        black_box((len, holders));
        idx.insert(&workers[g % workers.len()], r);
    }
}

fn concurrent(idx: &Arc<RwLock<PrefixIndex>>, reqs: &[Vec<u32>], workers: &[String]) {
    std::thread::scope(|s| {
        for t in 0..2 {
            let idx = Arc::clone(idx);
            s.spawn(move || {
                for (i, r) in reqs.iter().enumerate().skip(t).step_by(2) {
                    if i % 4 == 0 {
                        idx.write().insert(&workers[i % workers.len()], r);
                    } else {
                        black_box(idx.read().longest_match_ids(r));
                    }
                }
            });
        }
    });
}

fn benches(c: &mut Criterion) {
    let reqs = template_requests(N_REQUESTS, 1);
    let tokens: usize = reqs.iter().map(Vec::len).sum();
    let mut g = c.benchmark_group("index");
    g.sample_size(10);
    g.throughput(Throughput::Elements(N_REQUESTS as u64));
    for &w in &WORKER_COUNTS {
        let workers = names(w);
        g.bench_function(format!("insert_10k/{w}w"), |b| {
            b.iter_batched(
                || (),
                |_| black_box(filled(&reqs, &workers, None)),
                BatchSize::PerIteration,
            )
        });
        let idx = filled(&reqs, &workers, None);
        g.bench_function(format!("longest_match_10k/{w}w"), |b| {
            b.iter(|| {
                for r in &reqs {
                    black_box(idx.longest_match_ids(r));
                }
            })
        });
        g.bench_function(format!("match_all_10k/{w}w"), |b| {
            b.iter(|| {
                for r in &reqs {
                    black_box(idx.match_all_ids(r));
                }
            })
        });
    }
    let shared = shared_prefix_requests(2);
    let workers = names(8);
    g.throughput(Throughput::Elements(shared.len() as u64));
    g.bench_function("mixed_shared_prefix/8w", |b| {
        b.iter_batched(
            || PrefixIndex::new(None),
            |mut idx| mixed(&mut idx, &shared, &workers),
            BatchSize::PerIteration,
        )
    });
    let workers = names(10);
    g.throughput(Throughput::Elements(N_REQUESTS as u64));
    g.bench_function("concurrent_2_threads/10w", |b| {
        b.iter_batched(
            || Arc::new(RwLock::new(filled(&reqs[..N_REQUESTS / 2], &workers, None))),
            |idx| concurrent(&idx, &reqs, &workers),
            BatchSize::PerIteration,
        )
    });
    let budget = (tokens / workers.len() / 10) as u64;
    g.bench_function("insert_10k_evicting_10pct/10w", |b| {
        b.iter_batched(
            || (),
            |_| black_box(filled(&reqs, &workers, Some(budget))),
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

fn row(name: &str, ops: usize, tokens: usize, secs: f64) {
    println!(
        "| {name} | {:.3} | {:.0} | {:.2e} |",
        secs * 1e6 / ops as f64,
        ops as f64 / secs,
        tokens as f64 / secs
    );
}

fn summary() {
    let reqs = template_requests(N_REQUESTS, 1);
    let tokens: usize = reqs.iter().map(Vec::len).sum();
    println!("\n## Summary (one timed pass each, {N_REQUESTS} requests, {tokens} tokens)\n");
    println!("| scenario | µs/op | ops/s | tokens/s |\n|---|---:|---:|---:|");
    let mut memory_line = String::new();
    for &w in &WORKER_COUNTS {
        let workers = names(w);
        let t = Instant::now();
        let idx = filled(&reqs, &workers, None);
        row(
            &format!("insert ({w} workers)"),
            N_REQUESTS,
            tokens,
            t.elapsed().as_secs_f64(),
        );
        let t = Instant::now();
        for r in &reqs {
            black_box(idx.longest_match_ids(r));
        }
        row(
            &format!("longest_match ({w} workers)"),
            N_REQUESTS,
            tokens,
            t.elapsed().as_secs_f64(),
        );
        let t = Instant::now();
        for r in &reqs {
            black_box(idx.match_all_ids(r));
        }
        row(
            &format!("match, all workers ({w} workers)"),
            N_REQUESTS,
            tokens,
            t.elapsed().as_secs_f64(),
        );
        let mut fresh = PrefixIndex::new(None);
        let t = Instant::now();
        for (i, r) in reqs.iter().enumerate() {
            black_box(fresh.longest_match_ids(r));
            fresh.insert(&workers[i % w], r);
        }
        row(
            &format!("route: longest_match + insert ({w} workers)"),
            N_REQUESTS,
            tokens,
            t.elapsed().as_secs_f64(),
        );
        if w == 500 {
            let s = idx.stats();
            memory_line = format!(
                "memory: {} bytes for {} stored tokens = {:.2} bytes/token ({:.2} per cached token)",
                s.memory_bytes,
                s.stored_tokens,
                s.memory_bytes as f64 / s.stored_tokens as f64,
                s.memory_bytes as f64 / s.cached_tokens as f64
            );
        }
    }
    let shared = shared_prefix_requests(2);
    let shared_tokens: usize = shared.iter().map(|x| x.1.len()).sum();
    let mut idx = PrefixIndex::new(None);
    let t = Instant::now();
    mixed(&mut idx, &shared, &names(8));
    row(
        "mixed: match+insert, shared 2048+128 (8 workers)",
        shared.len(),
        shared_tokens,
        t.elapsed().as_secs_f64(),
    );
    let workers = names(10);
    let idx = Arc::new(RwLock::new(filled(&reqs[..N_REQUESTS / 2], &workers, None)));
    let t = Instant::now();
    concurrent(&idx, &reqs, &workers);
    row(
        "concurrent: 2 threads, 3 match : 1 insert (10 workers)",
        N_REQUESTS,
        tokens,
        t.elapsed().as_secs_f64(),
    );
    let budget = (tokens / workers.len() / 10) as u64;
    let t = Instant::now();
    let idx = filled(&reqs, &workers, Some(budget));
    row(
        "insert with eviction, budget 10% (10 workers)",
        N_REQUESTS,
        tokens,
        t.elapsed().as_secs_f64(),
    );
    println!(
        "\nevicted tokens: {}; {memory_line}",
        idx.stats().evicted_tokens
    );
}

criterion_group!(index_benches, benches);

fn main() {
    index_benches();
    Criterion::default().configure_from_args().final_summary();
    summary();
}
