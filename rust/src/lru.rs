//! Per-worker least-recently-used order over the tree nodes a worker holds.
//!
//! Every insert stamps the nodes on its path with one value of a monotonic counter (never
//! the clock). A worker's eviction candidates are kept in a min-heap keyed by
//! `(stamp, deeper first)`. Because an insert always stamps a node's ancestors too, an
//! ancestor's stamp is never older than its descendants', and among equal stamps the
//! deeper node comes out first: the minimum of the heap is therefore always a leaf of
//! that worker's own tree, which is what LRU eviction must remove.
//!
//! Entries are never updated in place. A re-stamped node gets a new entry and the old
//! one turns stale; stale entries are recognised on pop (stamp or node generation no
//! longer matches) and skipped, and the heap is compacted when stale entries outnumber
//! live ones, so its size stays proportional to what the worker holds.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LruEntry {
    pub stamp: u64,
    /// `u32::MAX - end_depth`: among equal stamps the deeper node sorts first.
    pub shallowness: u32,
    pub node: u32,
    pub generation: u32,
}

impl LruEntry {
    pub fn new(stamp: u64, end_depth: u32, node: u32, generation: u32) -> Self {
        LruEntry {
            stamp,
            shallowness: u32::MAX - end_depth,
            node,
            generation,
        }
    }
}

#[derive(Debug, Default)]
pub struct LruQueue {
    heap: BinaryHeap<Reverse<LruEntry>>,
}

impl LruQueue {
    #[inline]
    pub fn push(&mut self, e: LruEntry) {
        self.heap.push(Reverse(e));
    }

    #[inline]
    pub fn pop(&mut self) -> Option<LruEntry> {
        self.heap.pop().map(|Reverse(e)| e)
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Keep only the entries for which `live` is true.
    pub fn retain(&mut self, mut live: impl FnMut(&LruEntry) -> bool) {
        self.heap.retain(|Reverse(e)| live(e));
    }

    pub fn drain(&mut self) -> impl Iterator<Item = LruEntry> + '_ {
        self.heap.drain().map(|Reverse(e)| e)
    }

    pub fn heap_bytes(&self) -> usize {
        self.heap.capacity() * std::mem::size_of::<LruEntry>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oldest_then_deepest_first() {
        let mut q = LruQueue::default();
        q.push(LruEntry::new(5, 10, 1, 0));
        q.push(LruEntry::new(3, 10, 2, 0));
        q.push(LruEntry::new(3, 40, 3, 0));
        q.push(LruEntry::new(9, 1, 4, 0));
        let order: Vec<u32> = std::iter::from_fn(|| q.pop()).map(|e| e.node).collect();
        assert_eq!(order, vec![3, 2, 1, 4]);
    }
}
