//! The approximate prefix index: one radix tree over token IDs shared by all workers.
//!
//! Generic over the token type (`Symbol`): `PrefixIndex` keys u32 token IDs, `ByteIndex`
//! single bytes (the no-tokenizer mode's UTF-8 prompts: the same answers as a
//! `PrefixIndex` of the bytes widened to u32, in a quarter of the memory a walk reads).
//!
//! Semantics are those of one radix tree per worker: `insert(w, tokens)` records that
//! worker `w` now holds every prefix of `tokens`, and `match_all(tokens)` answers, for
//! each worker, the length of the longest prefix of `tokens` it holds. The trees are
//! stored as one shared tree whose nodes list their holders, so a lookup walks the
//! tokens once whatever the number of workers (`longest_match` costs O(path), and
//! `match_all` adds only the size of its answer).
//!
//! Invariants:
//! * every node except the root has a non-empty edge and at least one holder (a node
//!   that loses its last holder is freed at once);
//! * a worker that holds a node holds all of its ancestors (each holder entry counts
//!   the node's children held by the same worker, so "leaf of worker w" is O(1));
//! * a worker's `cached` equals the sum of the edge lengths of the nodes it holds.
//!
//! Budget: with `max_tokens_per_worker = B`, an insert that leaves its worker above B
//! evicts that worker's least recently used tokens right away, leaf first, until it is
//! back at B (see `lru`). Eviction is token-exact: the last node is trimmed if removing
//! it whole would overshoot. Only the inserting worker's own entries are touched, so the
//! cost is proportional to what is evicted, never a walk of the whole tree.

use crate::children::Children;
use crate::lru::{LruEntry, LruQueue};
use rustc_hash::FxHashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const ROOT: u32 = 0;
const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Holder {
    worker: u32,
    /// Children of this node that the same worker holds.
    children: u32,
    stamp: u64,
}

#[derive(Debug, Default)]
struct Node<T> {
    parent: u32,
    generation: u32,
    /// Tokens from the root to the end of this node's edge.
    end_depth: u32,
    edge: Vec<T>,
    children: Children<T>,
    /// Sorted by worker id.
    holders: Vec<Holder>,
}

impl<T> Node<T> {
    #[inline]
    fn holder_pos(&self, worker: u32) -> Result<usize, usize> {
        if self.holders.len() <= 8 {
            // Linear scan wins for the common one-or-two-holder case.
            for (i, h) in self.holders.iter().enumerate() {
                if h.worker == worker {
                    return Ok(i);
                }
                if h.worker > worker {
                    return Err(i);
                }
            }
            Err(self.holders.len())
        } else {
            self.holders.binary_search_by_key(&worker, |h| h.worker)
        }
    }
}

#[derive(Debug)]
struct WorkerState {
    name: Arc<str>,
    cached: u64,
    held_nodes: u64,
    lru: LruQueue,
    /// This worker's own budget (from what its engine reports); overrides the index's.
    budget: Option<u64>,
}

/// Counters reported by [`PrefixIndex::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Live tree nodes, root excluded.
    pub nodes: u64,
    /// Tokens stored in the tree (each shared prefix once).
    pub stored_tokens: u64,
    /// Sum over workers of their cached tokens (a prefix held by k workers counts k times).
    pub cached_tokens: u64,
    /// Estimated heap bytes of the whole index.
    pub memory_bytes: u64,
    /// Tokens evicted by budget since creation (or the last `clear`).
    pub evicted_tokens: u64,
}

/// What [`PrefixIndex::insert`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Inserted {
    /// Leading tokens of the insert the worker already held.
    pub held_before: u64,
    /// Tokens evicted by the worker's budget.
    pub evicted: u64,
}

/// A token of the index: what its edges hold and its child tables are keyed by.
pub trait Symbol: Copy + Eq + Hash + Debug + Default + Send + Sync + 'static {
    /// Length of the common prefix of `a` and `b`.
    fn common_prefix(a: &[Self], b: &[Self]) -> usize;
}

/// Compare `$chunk`-token chunks first, each folded to one word (compiled to a few vector
/// instructions; a slice comparison called memcmp once per chunk), then token by token.
macro_rules! symbol {
    ($t:ty, $chunk:literal) => {
        impl Symbol for $t {
            #[inline]
            fn common_prefix(a: &[$t], b: &[$t]) -> usize {
                let n = a.len().min(b.len());
                let (a, b) = (&a[..n], &b[..n]);
                let mut i = 0;
                for (x, y) in a.chunks_exact($chunk).zip(b.chunks_exact($chunk)) {
                    if x.iter().zip(y).fold(0, |d, (p, q)| d | (p ^ q)) != 0 {
                        break;
                    }
                    i += $chunk;
                }
                while i < n && a[i] == b[i] {
                    i += 1;
                }
                i
            }
        }
    };
}
symbol!(u32, 16);
symbol!(u8, 64);

/// The prefix index over u32 token IDs.
pub type PrefixIndex = Tree<u32>;
/// The prefix index over bytes (token "IDs" 0-255).
pub type ByteIndex = Tree<u8>;

/// Prefix index over tokens of type `T` with per-worker token budgets.
#[derive(Debug)]
pub struct Tree<T> {
    nodes: Vec<Node<T>>,
    free_nodes: Vec<u32>,
    workers: Vec<Option<WorkerState>>,
    worker_ids: FxHashMap<String, u32>,
    free_workers: Vec<u32>,
    /// Registration order of live workers (ids), for `workers()`.
    order: Vec<u32>,
    budget: Option<u64>,
    clock: u64,
    stored_tokens: u64,
    evicted_tokens: u64,
    live_nodes: u64,
    /// This index among all (a `Walk` names the index it walked).
    id: u64,
    /// Bumped by every change to the tree: a `Walk` taken at another epoch is stale.
    epoch: u64,
}

/// Source of `PrefixIndex::id`.
static NEXT_INDEX_ID: AtomicU64 = AtomicU64::new(1);

impl<T: Symbol> Default for Tree<T> {
    fn default() -> Self {
        Self::new(None)
    }
}

impl<T: Symbol> Tree<T> {
    /// A new, empty index. `max_tokens_per_worker = None` means unbounded.
    pub fn new(max_tokens_per_worker: Option<u64>) -> Self {
        Tree {
            nodes: vec![Node {
                parent: NIL,
                ..Node::default()
            }],
            free_nodes: Vec::new(),
            workers: Vec::new(),
            worker_ids: FxHashMap::default(),
            free_workers: Vec::new(),
            order: Vec::new(),
            budget: max_tokens_per_worker,
            clock: 0,
            stored_tokens: 0,
            evicted_tokens: 0,
            live_nodes: 0,
            id: NEXT_INDEX_ID.fetch_add(1, Ordering::Relaxed),
            epoch: 0,
        }
    }

    pub fn max_tokens_per_worker(&self) -> Option<u64> {
        self.budget
    }

    /// Tokens evicted by budget since creation (or the last `clear`); `stats` without
    /// its walk over the workers.
    pub fn evicted_tokens(&self) -> u64 {
        self.evicted_tokens
    }

    // ----------------------------------------------------------------- workers

    fn worker_id(&self, name: &str) -> Option<u32> {
        self.worker_ids.get(name).copied()
    }

    fn intern(&mut self, name: &str) -> u32 {
        if let Some(id) = self.worker_id(name) {
            return id;
        }
        let state = WorkerState {
            name: Arc::from(name),
            cached: 0,
            held_nodes: 0,
            lru: LruQueue::default(),
            budget: None,
        };
        let id = match self.free_workers.pop() {
            Some(id) => {
                self.workers[id as usize] = Some(state);
                id
            }
            None => {
                self.workers.push(Some(state));
                (self.workers.len() - 1) as u32
            }
        };
        self.worker_ids.insert(name.to_owned(), id);
        self.order.push(id);
        id
    }

    fn ws(&mut self, id: u32) -> &mut WorkerState {
        self.workers[id as usize].as_mut().expect("live worker id")
    }

    /// Names of the known workers, in registration order.
    pub fn workers(&self) -> Vec<String> {
        self.order
            .iter()
            .filter_map(|&id| {
                self.workers[id as usize]
                    .as_ref()
                    .map(|w| w.name.to_string())
            })
            .collect()
    }

    /// Tokens the worker is predicted to hold (0 for an unknown worker).
    pub fn cached_tokens(&self, worker: &str) -> u64 {
        self.worker_id(worker)
            .and_then(|id| self.workers[id as usize].as_ref())
            .map_or(0, |w| w.cached)
    }

    /// Register a worker with nothing cached (no-op if known).
    pub fn add_worker(&mut self, worker: &str) {
        self.intern(worker);
    }

    /// Give `worker` its own budget (None: back to the index's), registering it if
    /// unknown, and evict at once down to it. Returns the tokens evicted.
    pub fn set_worker_budget(&mut self, worker: &str, budget: Option<u64>) -> u64 {
        self.epoch += 1;
        let wid = self.intern(worker);
        self.ws(wid).budget = budget;
        self.enforce_budget(wid)
    }

    /// The budget that applies to `worker`: its own, else the index's.
    pub fn worker_budget(&self, worker: &str) -> Option<u64> {
        self.worker_id(worker)
            .and_then(|id| self.workers[id as usize].as_ref())
            .and_then(|w| w.budget)
            .or(self.budget)
    }

    // ------------------------------------------------------------------- nodes

    fn alloc(&mut self, parent: u32, edge: Vec<T>) -> u32 {
        let end_depth = self.nodes[parent as usize].end_depth + edge.len() as u32;
        self.stored_tokens += edge.len() as u64;
        self.live_nodes += 1;
        match self.free_nodes.pop() {
            Some(id) => {
                let n = &mut self.nodes[id as usize];
                n.parent = parent;
                n.end_depth = end_depth;
                n.edge = edge;
                debug_assert!(n.children.is_empty() && n.holders.is_empty());
                id
            }
            None => {
                self.nodes.push(Node {
                    parent,
                    generation: 0,
                    end_depth,
                    edge,
                    children: Children::default(),
                    holders: Vec::new(),
                });
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// Free a node that has no holders (hence no children) and unlink it.
    fn free(&mut self, id: u32) {
        let (parent, first) = {
            let n = &mut self.nodes[id as usize];
            debug_assert!(n.holders.is_empty() && n.children.is_empty());
            let first = n.edge[0];
            self.stored_tokens -= n.edge.len() as u64;
            n.edge = Vec::new();
            n.holders = Vec::new();
            n.children.clear();
            n.generation = n.generation.wrapping_add(1);
            (n.parent, first)
        };
        self.nodes[parent as usize].children.remove(first);
        self.nodes[id as usize].parent = NIL;
        self.live_nodes -= 1;
        self.free_nodes.push(id);
    }

    /// Split `id` after `k` edge tokens (0 < k < edge length). A new node takes the first
    /// `k` tokens and becomes `id`'s parent with the same holders and stamps; `id` keeps
    /// its identity (so its LRU entries stay valid) and the rest of its edge.
    fn split(&mut self, id: u32, k: usize) -> u32 {
        let (parent, upper_edge, holders) = {
            let n = &mut self.nodes[id as usize];
            debug_assert!(k > 0 && k < n.edge.len());
            let lower = n.edge.split_off(k);
            let upper = std::mem::replace(&mut n.edge, lower);
            (n.parent, upper, n.holders.clone())
        };
        let first = upper_edge[0];
        let lower_first = self.nodes[id as usize].edge[0];
        // alloc() counts the upper edge as new storage; the lower one shrank by as much.
        self.stored_tokens -= k as u64;
        let up = self.alloc(parent, upper_edge);
        let up_gen = self.nodes[up as usize].generation;
        let up_depth = self.nodes[up as usize].end_depth;
        {
            let u = &mut self.nodes[up as usize];
            u.holders = holders
                .iter()
                .map(|h| Holder {
                    worker: h.worker,
                    children: 1,
                    stamp: h.stamp,
                })
                .collect();
            u.children.set(lower_first, id);
        }
        self.nodes[parent as usize].children.set(first, up);
        self.nodes[id as usize].parent = up;
        for h in &holders {
            let w = self.ws(h.worker);
            w.held_nodes += 1;
            w.lru.push(LruEntry::new(h.stamp, up_depth, up, up_gen));
        }
        up
    }

    // ------------------------------------------------------------------ insert

    /// Record that `worker` holds `tokens` (and so every prefix of it); refresh its LRU
    /// position; evict the worker's least recently used tokens if it is over budget.
    /// Returns how much of `tokens` the worker held before, and how much was evicted
    /// (what [`rollback`](Self::rollback) needs to undo the insert).
    pub fn insert(&mut self, worker: &str, tokens: &[T]) -> Inserted {
        self.insert_from(worker, tokens, None)
    }

    /// `insert`, starting below the nodes `start` already walked (when it is still
    /// current: see `insert_after`); from the root otherwise.
    fn insert_from(&mut self, worker: &str, tokens: &[T], start: Option<&Walk>) -> Inserted {
        let wid = self.intern(worker);
        if tokens.is_empty() {
            return Inserted::default();
        }
        self.clock += 1;
        let stamp = self.clock;

        // Walk down, splitting and extending as needed, collecting the path.
        let (mut path, mut cur, mut pos) = match start {
            Some(w) if self.is_current(w) => {
                let path = w.path.clone();
                let cur = path.last().copied().unwrap_or(ROOT);
                (path, cur, w.pos as usize)
            }
            _ => (Vec::with_capacity(8), ROOT, 0usize),
        };
        while pos < tokens.len() {
            match self.nodes[cur as usize].children.get(tokens[pos]) {
                None => {
                    let leaf = self.alloc(cur, tokens[pos..].to_vec());
                    self.nodes[cur as usize].children.set(tokens[pos], leaf);
                    path.push(leaf);
                    break;
                }
                Some(child) => {
                    let edge_len = self.nodes[child as usize].edge.len();
                    let k = T::common_prefix(&self.nodes[child as usize].edge, &tokens[pos..]);
                    let node = if k < edge_len {
                        self.split(child, k)
                    } else {
                        child
                    };
                    path.push(node);
                    cur = node;
                    pos += k;
                }
            }
        }

        // Stamp the path root-first, so parents already hold the worker when a child
        // is added and the child can be counted.
        let mut prev = NIL;
        let mut held_before = tokens.len() as u64;
        for &id in &path {
            let (generation, end_depth, edge_len) = {
                let n = &self.nodes[id as usize];
                (n.generation, n.end_depth, n.edge.len() as u64)
            };
            let added = {
                let n = &mut self.nodes[id as usize];
                match n.holder_pos(wid) {
                    Ok(i) => {
                        n.holders[i].stamp = stamp;
                        false
                    }
                    Err(i) => {
                        n.holders.insert(
                            i,
                            Holder {
                                worker: wid,
                                children: 0,
                                stamp,
                            },
                        );
                        true
                    }
                }
            };
            if added {
                held_before = held_before.min(u64::from(end_depth) - edge_len);
                if prev != NIL {
                    let p = &mut self.nodes[prev as usize];
                    let i = p.holder_pos(wid).expect("parent held by worker");
                    p.holders[i].children += 1;
                }
                let w = self.ws(wid);
                w.cached += edge_len;
                w.held_nodes += 1;
            }
            self.ws(wid)
                .lru
                .push(LruEntry::new(stamp, end_depth, id, generation));
            prev = id;
        }
        let evicted = self.enforce_budget(wid);
        self.maybe_compact(wid);
        self.epoch += 1;
        Inserted {
            held_before,
            evicted,
        }
    }

    // ---------------------------------------------------------------- eviction

    fn entry_is_live(&self, wid: u32, e: &LruEntry) -> bool {
        let n = &self.nodes[e.node as usize];
        n.generation == e.generation
            && n.parent != NIL
            && matches!(n.holder_pos(wid), Ok(i) if n.holders[i].stamp == e.stamp)
    }

    fn maybe_compact(&mut self, wid: u32) {
        let (len, held) = {
            let w = self.workers[wid as usize].as_ref().expect("live worker");
            (w.lru.len() as u64, w.held_nodes)
        };
        if len > 2 * held + 64 {
            let mut lru = std::mem::take(&mut self.ws(wid).lru);
            lru.retain(|e| self.entry_is_live(wid, e));
            self.ws(wid).lru = lru;
        }
    }

    /// Remove `wid` from node `id`, which must be one of its leaves; free the node if
    /// that was its last holder.
    fn drop_holder(&mut self, wid: u32, id: u32) {
        let (parent, edge_len) = {
            let n = &mut self.nodes[id as usize];
            let i = n.holder_pos(wid).expect("held");
            debug_assert_eq!(n.holders[i].children, 0);
            n.holders.remove(i);
            (n.parent, n.edge.len() as u64)
        };
        if parent != ROOT {
            let p = &mut self.nodes[parent as usize];
            if let Ok(i) = p.holder_pos(wid) {
                p.holders[i].children -= 1;
            }
        }
        let w = self.ws(wid);
        w.cached -= edge_len;
        w.held_nodes -= 1;
        if self.nodes[id as usize].holders.is_empty() {
            self.free(id);
        }
    }

    fn enforce_budget(&mut self, wid: u32) -> u64 {
        let own = self.workers[wid as usize].as_ref().expect("live").budget;
        let Some(budget) = own.or(self.budget) else {
            return 0;
        };
        let mut evicted = 0u64;
        loop {
            let cached = self.workers[wid as usize].as_ref().expect("live").cached;
            if cached <= budget {
                break;
            }
            let excess = cached - budget;
            let Some(e) = self.ws(wid).lru.pop() else {
                debug_assert!(false, "over budget with an empty LRU queue");
                break;
            };
            if !self.entry_is_live(wid, &e) {
                continue;
            }
            let edge_len = self.nodes[e.node as usize].edge.len() as u64;
            if edge_len <= excess {
                self.drop_holder(wid, e.node);
                evicted += edge_len;
            } else {
                // Trim only the last `excess` tokens: split, drop the lower part. The
                // upper part inherits the stamp and gets its own LRU entry from split().
                self.split(e.node, (edge_len - excess) as usize);
                self.drop_holder(wid, e.node);
                evicted += excess;
            }
        }
        self.evicted_tokens += evicted;
        evicted
    }

    // ------------------------------------------------------------------- match

    /// Walk `tokens` down the tree; for each node reached, the matched depth at its end
    /// (the last one may be matched only partly). Deepest last.
    #[inline]
    fn walk<'a>(&'a self, tokens: &[T], mut visit: impl FnMut(u32, &'a Node<T>, u32)) {
        let mut cur = ROOT;
        let mut pos = 0usize;
        while pos < tokens.len() {
            let Some(child) = self.nodes[cur as usize].children.get(tokens[pos]) else {
                break;
            };
            let n = &self.nodes[child as usize];
            let k = T::common_prefix(&n.edge, &tokens[pos..]);
            pos += k;
            visit(child, n, pos as u32);
            if k < n.edge.len() {
                break;
            }
            cur = child;
        }
    }

    /// The longest prefix of `tokens` held by any worker, and the ids of all the
    /// workers that hold that much. Cost: O(path), independent of the fleet size
    /// except for the answer itself.
    pub fn longest_match_ids(&self, tokens: &[T]) -> (u32, Vec<u32>) {
        let mut best: Option<(&Node<T>, u32)> = None;
        self.walk(tokens, |_, n, depth| best = Some((n, depth)));
        match best {
            None => (0, Vec::new()),
            Some((n, depth)) => (depth, n.holders.iter().map(|h| h.worker).collect()),
        }
    }

    /// Like [`longest_match_ids`](Self::longest_match_ids) with worker names.
    pub fn longest_match(&self, tokens: &[T]) -> (u32, Vec<String>) {
        let (len, ids) = self.longest_match_ids(tokens);
        (
            len,
            ids.into_iter().map(|id| self.name(id).to_owned()).collect(),
        )
    }

    /// Matched prefix length per worker id, for every worker that holds at least one
    /// token of `tokens`.
    pub fn match_all_ids(&self, tokens: &[T]) -> Vec<(u32, u32)> {
        let mut path: Vec<(&Node<T>, u32)> = Vec::with_capacity(8);
        self.walk(tokens, |_, n, depth| path.push((n, depth)));
        self.holders_by_depth(&path)
    }

    /// Each holder of a node on `path` (root first, with the matched depth at each
    /// node) with the deepest depth it holds, deepest first.
    fn holders_by_depth(&self, path: &[(&Node<T>, u32)]) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        match path.len() {
            0 => {}
            1 => out.extend(path[0].0.holders.iter().map(|h| (h.worker, path[0].1))),
            _ => {
                // Holders of a node are a subset of its parent's: go deepest first and
                // give each worker the first (deepest) depth it appears at.
                let mut seen = vec![false; self.workers.len()];
                for &(n, depth) in path.iter().rev() {
                    for h in &n.holders {
                        let s = &mut seen[h.worker as usize];
                        if !*s {
                            *s = true;
                            out.push((h.worker, depth));
                        }
                    }
                }
            }
        }
        out
    }

    /// Matched prefix length per worker name.
    pub fn match_all(&self, tokens: &[T]) -> Vec<(String, u32)> {
        self.match_all_ids(tokens)
            .into_iter()
            .map(|(id, len)| (self.name(id).to_owned(), len))
            .collect()
    }

    /// Name of a live worker id.
    pub fn name(&self, id: u32) -> &str {
        &self.workers[id as usize]
            .as_ref()
            .expect("live worker")
            .name
    }

    /// Shared handle to a live worker's name (cheap to clone; bindings cache on it).
    pub fn name_handle(&self, id: u32) -> Arc<str> {
        Arc::clone(
            &self.workers[id as usize]
                .as_ref()
                .expect("live worker")
                .name,
        )
    }

    // ----------------------------------------------------------------- removal

    /// Forget a worker and everything it holds. Unknown workers are ignored.
    pub fn remove_worker(&mut self, worker: &str) {
        let Some(wid) = self.worker_id(worker) else {
            return;
        };
        self.epoch += 1;
        let mut lru = std::mem::take(&mut self.ws(wid).lru);
        let mut held: Vec<LruEntry> = lru.drain().filter(|e| self.entry_is_live(wid, e)).collect();
        // Deepest first, so a node is only freed after its children.
        held.sort_unstable_by_key(|e| e.shallowness);
        for e in held {
            let n = &mut self.nodes[e.node as usize];
            if let Ok(i) = n.holder_pos(wid) {
                n.holders.remove(i);
                if n.holders.is_empty() {
                    self.free(e.node);
                }
            }
        }
        self.worker_ids.remove(worker);
        self.order.retain(|&id| id != wid);
        self.workers[wid as usize] = None;
        self.free_workers.push(wid);
    }

    /// Forget every cached prefix; workers stay registered with nothing cached.
    pub fn clear(&mut self) {
        self.epoch += 1;
        self.nodes.truncate(1);
        self.nodes[0].children.clear();
        self.free_nodes.clear();
        for w in self.workers.iter_mut().flatten() {
            w.cached = 0;
            w.held_nodes = 0;
            w.lru = LruQueue::default();
        }
        self.stored_tokens = 0;
        self.evicted_tokens = 0;
        self.live_nodes = 0;
    }

    // ------------------------------------------------------------------- stats

    pub fn stats(&self) -> IndexStats {
        let mut bytes = self.nodes.capacity() * std::mem::size_of::<Node<T>>()
            + self.free_nodes.capacity() * 4
            + self.workers.capacity() * std::mem::size_of::<Option<WorkerState>>();
        for n in &self.nodes {
            bytes += n.edge.capacity() * std::mem::size_of::<T>()
                + n.holders.capacity() * std::mem::size_of::<Holder>()
                + n.children.heap_bytes();
        }
        let mut cached = 0;
        for w in self.workers.iter().flatten() {
            bytes += w.lru.heap_bytes() + 2 * w.name.len();
            cached += w.cached;
        }
        bytes += self.worker_ids.capacity() * (std::mem::size_of::<(String, u32)>() + 1);
        IndexStats {
            nodes: self.live_nodes,
            stored_tokens: self.stored_tokens,
            cached_tokens: cached,
            memory_bytes: bytes as u64,
            evicted_tokens: self.evicted_tokens,
        }
    }

    /// Check every structural invariant; for tests. Panics with a message on failure.
    pub fn check_invariants(&self) {
        let mut cached = vec![0u64; self.workers.len()];
        let mut stored = 0u64;
        let mut live = 0u64;
        for (id, n) in self.nodes.iter().enumerate().skip(1) {
            if n.parent == NIL {
                continue;
            }
            live += 1;
            stored += n.edge.len() as u64;
            assert!(!n.edge.is_empty(), "node {id} has an empty edge");
            assert!(!n.holders.is_empty(), "node {id} has no holder");
            let p = &self.nodes[n.parent as usize];
            assert_eq!(
                p.children.get(n.edge[0]),
                Some(id as u32),
                "node {id} unlinked"
            );
            assert_eq!(
                p.end_depth + n.edge.len() as u32,
                n.end_depth,
                "depth of {id}"
            );
            for w in n.holders.windows(2) {
                assert!(w[0].worker < w[1].worker, "holders of {id} unsorted");
            }
            for h in &n.holders {
                cached[h.worker as usize] += n.edge.len() as u64;
                if n.parent != ROOT {
                    let i = p.holder_pos(h.worker);
                    assert!(
                        i.is_ok(),
                        "worker {} holds {id} but not its parent",
                        h.worker
                    );
                    assert!(p.holders[i.unwrap()].stamp >= h.stamp, "parent stamp older");
                }
                let held_children = self
                    .children_of(id as u32)
                    .filter(|&c| self.nodes[c as usize].holder_pos(h.worker).is_ok())
                    .count() as u32;
                assert_eq!(held_children, h.children, "child count of {id}");
            }
        }
        assert_eq!(stored, self.stored_tokens, "stored tokens");
        assert_eq!(live, self.live_nodes, "live nodes");
        for (id, w) in self.workers.iter().enumerate() {
            if let Some(w) = w {
                assert_eq!(w.cached, cached[id], "cached tokens of {}", w.name);
                if let Some(b) = w.budget.or(self.budget) {
                    assert!(w.cached <= b, "{} over budget", w.name);
                }
            }
        }
    }

    fn children_of(&self, id: u32) -> impl Iterator<Item = u32> + '_ {
        self.nodes
            .iter()
            .enumerate()
            .filter(move |(_, n)| n.parent == id)
            .map(|(i, _)| i as u32)
    }
}

#[path = "tree_rollback.rs"]
mod rollback;

#[path = "tree_lookup.rs"]
mod lookup;
pub use lookup::{Lookup, Walk};

#[cfg(test)]
#[path = "tree_tests.rs"]
mod tests;
