//! The precise index: what each worker really caches, from the engines' KV events.
//!
//! vLLM and SGLang publish `BlockStored` (block hashes, parent hash, the blocks' token
//! IDs), `BlockRemoved` (hashes) and `AllBlocksCleared`. The engines' own hashes are not
//! reproducible by a router (they depend on a per-process seed and hash settings), so
//! every stored block gets a key of ours, chained from its token IDs:
//!
//! ```text
//! key(block i) = mix(key(block i-1), tokens of block i)      key(before block 0) = SEED
//! ```
//!
//! and a per-worker map from the engine's hash to our key lets `BlockRemoved` apply. To
//! match a request, its tokens are cut into blocks of the worker's block size, the same
//! chain is computed, and a worker's match is the number of leading blocks it holds,
//! times the block size: whole blocks only, as the engine reuses them.
//!
//! Cost: one pass of hashing over the request per distinct block size in the fleet,
//! then one hash-map probe per block while any worker still matches (probed several
//! at a time, see `match_all`; `cargo bench --bench blocks` times it).

use rustc_hash::{FxHashMap, FxHashSet};

const SEED: u64 = 0x6b76_726f_7574_6521; // "kvroute!"

/// The final mixer of MurmurHash3 (fmix64): full avalanche on 64 bits.
#[inline]
fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

const MUL: u64 = 0x9e37_79b9_7f4a_7c15;
const LANE_SEEDS: [u64; 4] = [
    0x243f_6a88_85a3_08d3,
    0x1319_8a2e_0370_7344,
    0xa409_3822_299f_31d0,
    0x082e_fa98_ec4e_6c89,
];

/// Our key for a block whose predecessor has key `parent`.
///
/// The block's tokens are hashed apart from the parent, eight at a time in four
/// independent lanes (each step `(lane ^ two tokens) * MUL`, rotated: a bijection of the
/// lane, so blocks differing in one position always differ in that lane), and the
/// parent enters only at the end through one `fmix64`. The serial chain from one key to
/// the next is then that one mix, and the multiplications of a block and of the blocks
/// after it overlap in the CPU instead of queueing behind each other.
#[inline]
pub fn block_key(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = (tokens.len() as u64).wrapping_mul(MUL);
    let mut chunks = tokens.chunks_exact(8);
    if tokens.len() >= 8 {
        let mut lanes = LANE_SEEDS;
        for c in &mut chunks {
            for (j, lane) in lanes.iter_mut().enumerate() {
                let w = (c[2 * j] as u64) | ((c[2 * j + 1] as u64) << 32);
                *lane = (*lane ^ w).wrapping_mul(MUL).rotate_left(31);
            }
        }
        h ^= fmix64(lanes[0])
            ^ fmix64(lanes[1]).rotate_left(16)
            ^ fmix64(lanes[2]).rotate_left(32)
            ^ fmix64(lanes[3]).rotate_left(48);
    }
    for &t in chunks.remainder() {
        h = (h.rotate_left(23) ^ t as u64).wrapping_mul(MUL);
    }
    fmix64(parent.wrapping_mul(MUL) ^ h)
}

/// Keys of the full blocks of `tokens` at `block_size`.
pub fn chain_keys(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut parent = SEED;
    for block in tokens.chunks_exact(block_size.max(1)) {
        parent = block_key(parent, block);
        out.push(parent);
    }
    out
}

/// Why an event could not be applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventError {
    /// `BlockStored` names a parent block this worker's state does not know: an
    /// earlier event was lost, so the chain cannot be continued.
    UnknownParent(u64),
    /// The event's shape is inconsistent (e.g. fewer tokens than blocks).
    Malformed(String),
}

impl std::fmt::Display for EventError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EventError::UnknownParent(h) => write!(f, "unknown parent block hash {h}"),
            EventError::Malformed(m) => write!(f, "malformed event: {m}"),
        }
    }
}

impl std::error::Error for EventError {}

/// The workers holding one block. Up to `INLINE` ids live in the map's entry itself,
/// so matching reads them without following a pointer (one cache miss fewer per
/// block); a block held by more workers spills to the heap.
#[derive(Debug)]
enum Holders {
    Inline { len: u8, ids: [u32; INLINE] },
    Heap(Vec<u32>),
}

const INLINE: usize = 4;

impl Default for Holders {
    fn default() -> Self {
        Holders::Inline {
            len: 0,
            ids: [0; INLINE],
        }
    }
}

impl Holders {
    fn as_slice(&self) -> &[u32] {
        match self {
            Holders::Inline { len, ids } => &ids[..*len as usize],
            Holders::Heap(v) => v,
        }
    }

    fn push(&mut self, id: u32) {
        match self {
            Holders::Inline { len, ids } if (*len as usize) < INLINE => {
                ids[*len as usize] = id;
                *len += 1;
            }
            Holders::Inline { ids, .. } => {
                let mut v = ids.to_vec();
                v.push(id);
                *self = Holders::Heap(v);
            }
            Holders::Heap(v) => v.push(id),
        }
    }

    /// Drop `id`; true if no holder is left.
    fn remove(&mut self, id: u32) -> bool {
        match self {
            Holders::Inline { len, ids } => {
                let n = *len as usize;
                if let Some(i) = ids[..n].iter().position(|&x| x == id) {
                    ids.copy_within(i + 1..n, i);
                    *len -= 1;
                }
                *len == 0
            }
            Holders::Heap(v) => {
                v.retain(|&x| x != id);
                v.is_empty()
            }
        }
    }
}

#[derive(Debug, Default)]
struct WorkerBlocks {
    name: String,
    block_size: usize,
    /// Engine hash -> our key.
    engine_to_key: FxHashMap<u64, u64>,
    /// Our key -> how many engine blocks of this worker map to it.
    keys: FxHashMap<u64, u32>,
}

/// Block-level index fed by KV events.
#[derive(Debug, Default)]
pub struct BlockIndex {
    workers: Vec<Option<WorkerBlocks>>,
    ids: FxHashMap<String, u32>,
    free_ids: Vec<u32>,
    /// Our key -> workers holding that block.
    holders: FxHashMap<u64, Holders>,
}

impl BlockIndex {
    pub fn new() -> Self {
        Self::default()
    }

    fn intern(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let w = WorkerBlocks {
            name: name.to_owned(),
            ..Default::default()
        };
        let id = if let Some(id) = self.free_ids.pop() {
            self.workers[id as usize] = Some(w);
            id
        } else {
            self.workers.push(Some(w));
            (self.workers.len() - 1) as u32
        };
        self.ids.insert(name.to_owned(), id);
        id
    }

    fn worker(&self, name: &str) -> Option<&WorkerBlocks> {
        self.ids
            .get(name)
            .and_then(|&id| self.workers[id as usize].as_ref())
    }

    /// Apply `BlockStored`. `parent` is the engine hash of the block before the first
    /// one (None at the start of a sequence). `token_ids` holds all the blocks' tokens.
    /// On error nothing changes.
    pub fn stored(
        &mut self,
        worker: &str,
        parent: Option<u64>,
        engine_hashes: &[u64],
        token_ids: &[u32],
        block_size: usize,
    ) -> Result<(), EventError> {
        if engine_hashes.is_empty() {
            return Ok(());
        }
        if block_size == 0 {
            return Err(EventError::Malformed("block_size 0".into()));
        }
        let n = engine_hashes.len();
        if token_ids.len() <= (n - 1) * block_size || token_ids.len() > n * block_size {
            return Err(EventError::Malformed(format!(
                "{} tokens for {n} blocks of {block_size}",
                token_ids.len()
            )));
        }
        let wid = self.intern(worker);
        let w = self.workers[wid as usize].as_mut().expect("live");
        let mut key = match parent {
            None => SEED,
            Some(p) => match w.engine_to_key.get(&p) {
                Some(&k) => k,
                None => return Err(EventError::UnknownParent(p)),
            },
        };
        w.block_size = block_size;
        for (i, &h) in engine_hashes.iter().enumerate() {
            let start = i * block_size;
            let end = ((i + 1) * block_size).min(token_ids.len());
            key = block_key(key, &token_ids[start..end]);
            if let Some(old) = w.engine_to_key.insert(h, key) {
                if old == key {
                    continue; // the same block reported twice
                }
                Self::release(&mut self.holders, w, wid, old);
            }
            let count = w.keys.entry(key).or_insert(0);
            *count += 1;
            if *count == 1 {
                self.holders.entry(key).or_default().push(wid);
            }
        }
        Ok(())
    }

    fn release(holders: &mut FxHashMap<u64, Holders>, w: &mut WorkerBlocks, wid: u32, key: u64) {
        if let Some(c) = w.keys.get_mut(&key) {
            *c -= 1;
            if *c == 0 {
                w.keys.remove(&key);
                if let Some(hs) = holders.get_mut(&key) {
                    if hs.remove(wid) {
                        holders.remove(&key);
                    }
                }
            }
        }
    }

    /// Apply `BlockRemoved`. Unknown hashes are ignored; returns how many were known.
    pub fn removed(&mut self, worker: &str, engine_hashes: &[u64]) -> usize {
        let Some(&wid) = self.ids.get(worker) else {
            return 0;
        };
        let w = self.workers[wid as usize].as_mut().expect("live");
        let mut known = 0;
        for h in engine_hashes {
            if let Some(key) = w.engine_to_key.remove(h) {
                Self::release(&mut self.holders, w, wid, key);
                known += 1;
            }
        }
        known
    }

    /// Apply `AllBlocksCleared` (or drop a worker's state after a restart or a gap):
    /// the worker stays known with nothing cached.
    pub fn clear_worker(&mut self, worker: &str) {
        let Some(&wid) = self.ids.get(worker) else {
            return;
        };
        let w = self.workers[wid as usize].as_mut().expect("live");
        for key in w.keys.keys() {
            if let Some(hs) = self.holders.get_mut(key) {
                if hs.remove(wid) {
                    self.holders.remove(key);
                }
            }
        }
        w.keys = FxHashMap::default();
        w.engine_to_key = FxHashMap::default();
    }

    /// Forget a worker entirely.
    pub fn remove_worker(&mut self, worker: &str) {
        self.clear_worker(worker);
        if let Some(id) = self.ids.remove(worker) {
            self.workers[id as usize] = None;
            self.free_ids.push(id);
        }
    }

    /// Tokens the worker holds in whole blocks.
    pub fn cached_tokens(&self, worker: &str) -> u64 {
        self.worker(worker)
            .map_or(0, |w| (w.keys.len() * w.block_size) as u64)
    }

    /// Blocks the worker holds (distinct keys).
    pub fn cached_blocks(&self, worker: &str) -> u64 {
        self.worker(worker).map_or(0, |w| w.keys.len() as u64)
    }

    pub fn block_size(&self, worker: &str) -> Option<usize> {
        self.worker(worker).map(|w| w.block_size).filter(|&b| b > 0)
    }

    pub fn workers(&self) -> Vec<String> {
        self.workers
            .iter()
            .flatten()
            .map(|w| w.name.clone())
            .collect()
    }

    /// Distinct block sizes of the workers holding anything, ascending.
    fn block_sizes(&self) -> Vec<usize> {
        let mut sizes: Vec<usize> = self
            .workers
            .iter()
            .flatten()
            .filter(|w| w.block_size > 0 && !w.keys.is_empty())
            .map(|w| w.block_size)
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        sizes
    }

    /// Matched tokens (whole leading blocks) per worker holding at least one block.
    ///
    /// The workers still matching (`active`) start as the holders of the first block
    /// (those of this block size); at each later block, the ones that do not hold it drop
    /// out with the length so far. The cost is one map probe per block, and each probe is
    /// a cache miss or two in a map of every cached block: so the keys are computed
    /// first and probed `PROBE_AHEAD` at a time, independent loads the CPU overlaps,
    /// before the blocks are checked in order (a few probes past the end of the match
    /// are wasted). Membership is tested against a per-call stamp array indexed by
    /// worker id, or directly once one worker is left: no allocation per block.
    pub fn match_all(&self, tokens: &[u32]) -> Vec<(String, u32)> {
        const PROBE_AHEAD: usize = 8;
        let mut out = Vec::new();
        let mut stamp: Vec<u32> = Vec::new();
        for bs in self.block_sizes() {
            let keys = chain_keys(tokens, bs);
            let Some(hs) = keys.first().and_then(|k| self.holders.get(k)) else {
                continue;
            };
            let mut active: Vec<u32> = hs
                .as_slice()
                .iter()
                .copied()
                .filter(|&id| {
                    self.workers[id as usize]
                        .as_ref()
                        .is_some_and(|w| w.block_size == bs)
                })
                .collect();
            let mut matched = 1usize; // blocks every active worker holds
            'blocks: for chunk in keys[1..].chunks(PROBE_AHEAD) {
                let mut found: [&[u32]; PROBE_AHEAD] = [&[]; PROBE_AHEAD];
                for (slot, key) in found.iter_mut().zip(chunk) {
                    *slot = self.holders.get(key).map_or(&[], |v| v.as_slice());
                }
                for hs in &found[..chunk.len()] {
                    let len = (matched * bs) as u32;
                    if let [only] = active[..] {
                        if !hs.contains(&only) {
                            out.push((self.name(only), len));
                            active.clear();
                        }
                    } else {
                        if stamp.is_empty() {
                            stamp = vec![0; self.workers.len()];
                        }
                        for &id in *hs {
                            stamp[id as usize] = matched as u32; // distinct per block
                        }
                        active.retain(|&id| {
                            let keep = stamp[id as usize] == matched as u32;
                            if !keep {
                                out.push((self.name(id), len));
                            }
                            keep
                        });
                    }
                    if active.is_empty() {
                        break 'blocks;
                    }
                    matched += 1;
                }
            }
            let full = (keys.len() * bs) as u32;
            out.extend(active.into_iter().map(|id| (self.name(id), full)));
            stamp.fill(0); // the next block size counts its blocks from 1 again
        }
        out.retain(|&(_, n)| n > 0);
        out
    }

    /// `match_all` as first written (a hash set per block): the reference the tests
    /// compare it with, and the baseline of `cargo bench --bench blocks`.
    #[doc(hidden)]
    pub fn match_all_reference(&self, tokens: &[u32]) -> Vec<(String, u32)> {
        let mut out = Vec::new();
        for bs in self.block_sizes() {
            let mut active: Vec<u32> = Vec::new();
            let mut first = true;
            let mut parent = SEED;
            for (i, block) in tokens.chunks_exact(bs).enumerate() {
                parent = block_key(parent, block);
                let holders: &[u32] = self.holders.get(&parent).map_or(&[], |v| v.as_slice());
                let holders_here = holders.iter().copied().filter(|&id| {
                    self.workers[id as usize]
                        .as_ref()
                        .is_some_and(|w| w.block_size == bs)
                });
                if first {
                    active = holders_here.collect();
                    first = false;
                } else {
                    let next: FxHashSet<u32> = holders_here.collect();
                    active.retain(|id| {
                        let keep = next.contains(id);
                        if !keep {
                            out.push((self.name(*id), (i * bs) as u32));
                        }
                        keep
                    });
                }
                if active.is_empty() {
                    break;
                }
            }
            let full = (tokens.len() / bs * bs) as u32;
            out.extend(active.into_iter().map(|id| (self.name(id), full)));
        }
        out.retain(|&(_, n)| n > 0);
        out
    }

    fn name(&self, id: u32) -> String {
        self.workers[id as usize]
            .as_ref()
            .map_or_else(String::new, |w| w.name.clone())
    }

    /// Distinct blocks stored over all workers.
    pub fn distinct_blocks(&self) -> u64 {
        self.holders.len() as u64
    }
}

#[cfg(test)]
#[path = "blocks_tests.rs"]
mod tests;
