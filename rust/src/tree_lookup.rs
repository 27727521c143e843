//! What one routing decision asks of the index, in one walk, and its insert resumed
//! from that walk.
//!
//! A cache-aware decision reads the matched length of every worker and the longest
//! match with its holders (`lookup_ids`: `match_all_ids` and `longest_match_ids` from
//! one walk), chooses a worker, then records the prompt for it (`insert`). The insert
//! walks the same tokens down the same nodes again, comparing every token with the
//! edges (a prompt of 8,000 tokens streams 32 KB of edges). `lookup_ids` therefore also
//! returns the walk itself (`Walk`: the nodes the tokens matched whole, and how many
//! tokens they cover) and `insert_after` starts below them, provided the tree has not
//! changed since: a `Walk` names its index (`PrefixIndex::id`) and the index's epoch,
//! which every change to the tree bumps (insert, rollback, removal, clear, budget). A
//! stale or foreign walk is ignored and the insert walks from the root: same result
//! either way, only the work differs.

use super::{Node, Symbol, Tree};

/// The nodes a lookup's tokens matched whole, root first, and the tokens they cover;
/// valid for `insert_after` of the same tokens while its index is unchanged.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Walk {
    pub(super) index: u64,
    pub(super) epoch: u64,
    pub(super) path: Vec<u32>,
    pub(super) pos: u32,
}

/// What [`PrefixIndex::lookup_ids`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lookup {
    /// (worker id, matched length) for every worker holding a prefix of the tokens.
    pub matches: Vec<(u32, u32)>,
    /// The longest matched length (0: nothing matched).
    pub longest: u32,
    /// How many of `matches`, from the first, are the workers holding `longest`.
    pub holders: usize,
    /// The walk, for [`PrefixIndex::insert_after`] of the same tokens.
    pub walk: Walk,
}

impl<T: Symbol> Tree<T> {
    /// What a routing decision reads, from one walk: the matched length per worker id
    /// (as [`match_all_ids`](Self::match_all_ids)), and the longest match with its
    /// holders (as [`longest_match_ids`](Self::longest_match_ids)): the deepest node's
    /// holders come first in `matches`, in the same order, and nobody else matches as
    /// deep (each node on the path ends deeper than its parent). And the walk itself.
    pub fn lookup_ids(&self, tokens: &[T]) -> Lookup {
        let mut path: Vec<(&Node<T>, u32)> = Vec::with_capacity(8);
        let mut walk = Walk {
            index: self.id,
            epoch: self.epoch,
            path: Vec::with_capacity(8),
            pos: 0,
        };
        self.walk(tokens, |id, n, depth| {
            path.push((n, depth));
            if depth == n.end_depth {
                walk.path.push(id);
                walk.pos = depth;
            }
        });
        let matches = self.holders_by_depth(&path);
        let longest = matches.first().map_or(0, |m| m.1);
        let holders = matches.iter().take_while(|m| m.1 == longest).count();
        Lookup {
            matches,
            longest,
            holders,
            walk,
        }
    }

    /// [`insert`](Self::insert) of the tokens `walk` was taken for (by `lookup_ids`),
    /// without walking again the nodes they matched whole if the tree is unchanged
    /// since; from the root otherwise. The same result as `insert` in both cases.
    pub fn insert_after(&mut self, worker: &str, tokens: &[T], walk: &Walk) -> super::Inserted {
        debug_assert!(walk.pos as usize <= tokens.len());
        self.insert_from(worker, tokens, Some(walk))
    }

    /// Whether `walk` was taken on this index as it is now.
    pub(super) fn is_current(&self, walk: &Walk) -> bool {
        walk.index == self.id && walk.epoch == self.epoch
    }
}
