//! The segment cache: a piece of rendered text (between special tokens) -> its IDs, in
//! an LRU bounded in entries and in bytes.
//!
//! Entries live in a slab (`slots`) threaded on a doubly-linked list in recency order
//! (head: most recent), so a hit, an insert and an eviction are O(1). The order is the
//! order of the calls that touched them, never the clock. The map is keyed by the
//! piece's text (shared with its slot) and hashed with aHash keyed from the OS random
//! source (keys drawn per cache), so request texts chosen to collide cannot be computed
//! in advance; std's SipHash did the same at several times the cost on the long pieces
//! a prompt repeats (a 6 KB system prompt hashed on every request).
//!
//! Settings: `max_entries` bounds the entries, `max_bytes` what they cost (`entry_bytes`:
//! the text, 4 bytes an ID, and a fixed overhead for the map slot, the list links and
//! the allocations). A piece costing more than a quarter of `max_bytes` is not kept:
//! it would flush everything else.

use ahash::RandomState;
use std::collections::HashMap;
use std::sync::Arc;

/// What an entry costs beyond its text and IDs (map slot, links, two allocations).
const ENTRY_OVERHEAD: usize = 128;
const NIL: u32 = u32::MAX;

/// The bytes an entry of `text` with `ids` is counted as.
pub fn entry_bytes(text: &str, ids: usize) -> usize {
    text.len() + 4 * ids + ENTRY_OVERHEAD
}

struct Slot {
    key: Arc<str>,
    ids: Arc<[u32]>,
    prev: u32,
    next: u32,
}

/// An LRU map from text to IDs (not thread-safe: the encoder holds it in a mutex).
pub struct SegmentCache {
    map: HashMap<Arc<str>, u32, RandomState>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
    bytes: usize,
    max_entries: usize,
    max_bytes: usize,
}

impl SegmentCache {
    pub fn new(max_entries: usize, max_bytes: usize) -> SegmentCache {
        SegmentCache {
            map: HashMap::with_hasher(RandomState::new()),
            slots: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            bytes: 0,
            max_entries,
            max_bytes,
        }
    }

    /// The IDs of `text`, made the most recent entry; None when not cached.
    pub fn get(&mut self, text: &str) -> Option<Arc<[u32]>> {
        let at = *self.map.get(text)?;
        self.unlink(at);
        self.push_front(at);
        Some(self.slots[at as usize].ids.clone())
    }

    /// Keeps `text` -> `ids` as the most recent entry (replacing an older one), then
    /// evicts the least recent entries until both bounds hold.
    pub fn insert(&mut self, text: &str, ids: Arc<[u32]>) {
        let size = entry_bytes(text, ids.len());
        if size > self.max_bytes / 4 || self.max_entries == 0 {
            return;
        }
        if let Some(at) = self.map.get(text).copied() {
            self.remove(at);
        }
        let key: Arc<str> = Arc::from(text);
        let slot = Slot {
            key: key.clone(),
            ids,
            prev: NIL,
            next: NIL,
        };
        let at = match self.free.pop() {
            Some(at) => {
                self.slots[at as usize] = slot;
                at
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        self.map.insert(key, at);
        self.push_front(at);
        self.bytes += size;
        while self.map.len() > self.max_entries || self.bytes > self.max_bytes {
            self.remove(self.tail);
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// What the entries are counted as (`entry_bytes`).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The cached texts, most recent first (for tests).
    pub fn keys(&self) -> Vec<Arc<str>> {
        let mut out = Vec::with_capacity(self.map.len());
        let mut at = self.head;
        while at != NIL {
            let slot = &self.slots[at as usize];
            out.push(slot.key.clone());
            at = slot.next;
        }
        out
    }

    pub fn clear(&mut self) {
        *self = SegmentCache::new(self.max_entries, self.max_bytes);
    }

    fn remove(&mut self, at: u32) {
        self.unlink(at);
        let empty: Arc<str> = Arc::from("");
        let slot = &mut self.slots[at as usize];
        let key = std::mem::replace(&mut slot.key, empty);
        let ids = std::mem::replace(&mut slot.ids, Arc::from([]));
        self.map.remove(&*key);
        self.bytes -= entry_bytes(&key, ids.len());
        self.free.push(at);
    }

    fn unlink(&mut self, at: u32) {
        let (prev, next) = {
            let slot = &self.slots[at as usize];
            (slot.prev, slot.next)
        };
        match prev {
            NIL => self.head = next,
            p => self.slots[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.slots[n as usize].prev = prev,
        }
    }

    fn push_front(&mut self, at: u32) {
        let old = self.head;
        {
            let slot = &mut self.slots[at as usize];
            slot.prev = NIL;
            slot.next = old;
        }
        match old {
            NIL => self.tail = at,
            o => self.slots[o as usize].prev = at,
        }
        self.head = at;
    }
}
