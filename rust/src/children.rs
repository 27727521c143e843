//! Child tables of radix-tree nodes, keyed by the first token of the child's edge
//! (a `u32` token ID, or a byte in the byte-keyed index).
//!
//! Most nodes have a handful of children, where a short vector scanned linearly beats a
//! hash map in both speed and memory; a node under a popular prefix (a shared system
//! prompt) can have thousands, so past `SMALL_MAX` the table becomes a hash map.

use rustc_hash::FxHashMap;
use std::hash::Hash;

const SMALL_MAX: usize = 8;

#[derive(Debug)]
pub enum Children<T = u32> {
    Small(Vec<(T, u32)>),
    Map(FxHashMap<T, u32>),
}

impl<T> Default for Children<T> {
    fn default() -> Self {
        Children::Small(Vec::new())
    }
}

impl<T: Copy + Eq + Hash> Children<T> {
    #[inline]
    pub fn get(&self, token: T) -> Option<u32> {
        match self {
            Children::Small(v) => v.iter().find(|(t, _)| *t == token).map(|&(_, n)| n),
            Children::Map(m) => m.get(&token).copied(),
        }
    }

    /// Insert or replace the child for `token`.
    pub fn set(&mut self, token: T, node: u32) {
        match self {
            Children::Small(v) => {
                if let Some(slot) = v.iter_mut().find(|(t, _)| *t == token) {
                    slot.1 = node;
                } else if v.len() < SMALL_MAX {
                    v.push((token, node));
                } else {
                    let mut m: FxHashMap<T, u32> = v.drain(..).collect();
                    m.insert(token, node);
                    *self = Children::Map(m);
                }
            }
            Children::Map(m) => {
                m.insert(token, node);
            }
        }
    }

    pub fn remove(&mut self, token: T) {
        match self {
            Children::Small(v) => {
                if let Some(i) = v.iter().position(|(t, _)| *t == token) {
                    v.swap_remove(i);
                }
            }
            Children::Map(m) => {
                m.remove(&token);
                if m.len() <= SMALL_MAX / 2 {
                    *self = Children::Small(m.drain().collect());
                }
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Children::Small(v) => v.len(),
            Children::Map(m) => m.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clear(&mut self) {
        *self = Children::Small(Vec::new());
    }

    /// Heap bytes owned by the table (for memory accounting).
    pub fn heap_bytes(&self) -> usize {
        match self {
            Children::Small(v) => v.capacity() * std::mem::size_of::<(T, u32)>(),
            // hashbrown: one control byte per bucket plus the entries.
            Children::Map(m) => m.capacity() * (std::mem::size_of::<(T, u32)>() + 1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_into_map_and_back() {
        let mut c: Children = Children::default();
        for t in 0..20u32 {
            c.set(t, t + 100);
        }
        assert!(matches!(c, Children::Map(_)));
        assert_eq!(c.len(), 20);
        assert_eq!(c.get(7), Some(107));
        c.set(7, 1);
        assert_eq!(c.get(7), Some(1));
        for t in 0..18u32 {
            c.remove(t);
        }
        assert!(matches!(c, Children::Small(_)));
        assert_eq!(c.get(19), Some(119));
        assert_eq!(c.get(3), None);
    }
}
