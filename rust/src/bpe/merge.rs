//! Byte-level BPE merges, as `tokenizers`' BPE model applies them.
//!
//! A piece's bytes start as one symbol each (the vocabulary's byte tokens). Every
//! adjacent pair that is in the merge list goes into a min-heap ordered by (merge rank,
//! position of the left symbol); the top entry is merged unless it is stale (its left
//! symbol was merged away, has no right neighbour any more, or the pair now there does
//! not merge into the entry's token), and the new pairs on either side of the merged
//! symbol are pushed. This is `tokenizers`' own procedure, stale-entry test included, so
//! the IDs are the same by construction (not only the lowest-rank-first result tiktoken
//! computes from token ranks, which can differ where a token is not reachable by merges).
//!
//! An entry the stale test lets through is never really stale: a symbol only grows by
//! merging with its right neighbour (which consumes the entry's pair) and the pair's
//! tokens spell the merged token's bytes from the same position, so the same new token
//! means the same pair and rank. The procedure therefore always merges the adjacent pair
//! of lowest merge rank, the leftmost on a tie; pieces of up to `SCAN_BYTES` bytes do
//! exactly that with a scan over an array of the pairs' ranks (no heap, no links), the
//! rest with the heap. A test compares the two on random merge lists.
//!
//! Fast path: a piece whose bytes are a token that the merges turn into that single token
//! (checked for every token when the model is built) is that token, found with one hash
//! lookup. With `ignore_merges` (Llama 3), `tokenizers` itself takes any piece that is a
//! token as that token, and so does the fast path.

use rustc_hash::FxHashMap;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A vocabulary and its merges.
pub struct Model {
    byte_ids: [u32; 256],
    /// `pair(left, right)` -> (rank, merged token).
    merges: FxHashMap<u64, (u32, u32)>,
    /// Pieces that encode as one token: up to 7 bytes keyed by `short_key` (one integer
    /// hash and compare), longer ones by their bytes.
    short: FxHashMap<u64, u32>,
    whole: FxHashMap<Box<[u8]>, u32>,
}

/// A piece of at most 7 bytes as one integer: its bytes, and its length in the top byte.
#[inline]
fn short_key(piece: &[u8]) -> Option<u64> {
    if piece.len() > 7 {
        return None;
    }
    let mut key = [0u8; 8];
    key[..piece.len()].copy_from_slice(piece);
    key[7] = piece.len() as u8;
    Some(u64::from_le_bytes(key))
}

/// A symbol of a piece being merged: a linked list over the initial byte positions.
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: u32,
    next: u32,
    alive: bool,
}

const NONE: u32 = u32::MAX;

/// Pieces up to this long merge by scanning (module docs).
const SCAN_BYTES: usize = 48;

/// Two token IDs as one hash key.
#[inline]
fn pair(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

/// Buffers reused across the pieces of one text.
#[derive(Default)]
pub struct Scratch {
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Reverse<(u32, u32, u32)>>,
    ids: Vec<u32>,
    ranks: Vec<(u32, u32)>,
}

impl Model {
    /// `vocab`: each token's bytes and ID (special tokens left out); `merges`: the merge
    /// list in order, as the two tokens' bytes. A pair listed twice keeps its later rank,
    /// as in `tokenizers`.
    pub fn new(
        vocab: Vec<(Vec<u8>, u32)>,
        merges: &[(Vec<u8>, Vec<u8>)],
        ignore_merges: bool,
    ) -> Result<Model, String> {
        let mut ids: FxHashMap<Box<[u8]>, u32> = FxHashMap::default();
        ids.reserve(vocab.len());
        for (bytes, id) in vocab {
            if ids.insert(bytes.into_boxed_slice(), id).is_some() {
                return Err("the vocabulary lists a token twice".into());
            }
        }
        let mut byte_ids = [0u32; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = *ids
                .get(&[b as u8][..])
                .ok_or_else(|| format!("no token for the byte {b:#04x}"))?;
        }
        let mut merge_map = FxHashMap::default();
        merge_map.reserve(merges.len());
        let mut joined = Vec::new();
        for (rank, (left, right)) in merges.iter().enumerate() {
            let id = |t: &[u8]| {
                ids.get(t)
                    .copied()
                    .ok_or_else(|| format!("merge {rank} names a token not in the vocabulary"))
            };
            joined.clear();
            joined.extend_from_slice(left);
            joined.extend_from_slice(right);
            let key = pair(id(left)?, id(right)?);
            merge_map.insert(key, (rank as u32, id(&joined)?));
        }
        let mut model = Model {
            byte_ids,
            merges: merge_map,
            short: FxHashMap::default(),
            whole: FxHashMap::default(),
        };
        let mut scratch = Scratch::default();
        let mut out = Vec::new();
        let (mut short, mut whole) = (FxHashMap::default(), FxHashMap::default());
        for (bytes, id) in ids {
            if bytes.len() < 2 {
                continue;
            }
            if !ignore_merges {
                out.clear();
                model.merge(&bytes, &mut out, &mut scratch);
                if out != [id] {
                    continue; // this token is not what its own bytes merge into
                }
            }
            match short_key(&bytes) {
                Some(key) => short.insert(key, id),
                None => whole.insert(bytes, id),
            };
        }
        model.short = short;
        model.whole = whole;
        Ok(model)
    }

    /// Appends the IDs of one pre-tokenizer piece to `out`.
    #[inline]
    pub fn encode_piece(&self, piece: &[u8], out: &mut Vec<u32>, scratch: &mut Scratch) {
        match piece {
            [] => {}
            [b] => out.push(self.byte_ids[*b as usize]),
            _ => {
                let found = match short_key(piece) {
                    Some(key) => self.short.get(&key),
                    None => self.whole.get(piece),
                };
                match found {
                    Some(&id) => out.push(id),
                    None => self.merge(piece, out, scratch),
                }
            }
        }
    }

    /// The rank and result of merging `left` and `right`, if the merge list has them.
    #[inline]
    fn rule(&self, left: u32, right: u32) -> Option<(u32, u32)> {
        self.merges.get(&pair(left, right)).copied()
    }

    /// The merge procedure of the module docs.
    fn merge(&self, piece: &[u8], out: &mut Vec<u32>, scratch: &mut Scratch) {
        if piece.len() <= SCAN_BYTES {
            self.merge_scan(piece, out, scratch)
        } else {
            self.merge_heap(piece, out, scratch)
        }
    }

    /// Lowest rank first, leftmost on a tie, by scanning the pairs' ranks.
    fn merge_scan(&self, piece: &[u8], out: &mut Vec<u32>, scratch: &mut Scratch) {
        let Scratch { ids, ranks, .. } = scratch;
        ids.clear();
        ids.extend(piece.iter().map(|&b| self.byte_ids[b as usize]));
        ranks.clear();
        ranks.extend(
            ids.windows(2)
                .map(|w| self.rule(w[0], w[1]).unwrap_or((NONE, 0))),
        );
        loop {
            let (mut best, mut at) = (NONE, 0);
            for (i, &(rank, _)) in ranks.iter().enumerate() {
                if rank < best {
                    (best, at) = (rank, i);
                }
            }
            if best == NONE {
                break;
            }
            ids[at] = ranks[at].1;
            ids.remove(at + 1);
            ranks.remove(at);
            if at + 1 < ids.len() {
                ranks[at] = self.rule(ids[at], ids[at + 1]).unwrap_or((NONE, 0));
            }
            if at > 0 {
                ranks[at - 1] = self.rule(ids[at - 1], ids[at]).unwrap_or((NONE, 0));
            }
        }
        out.extend_from_slice(ids);
    }

    /// `tokenizers`' heap procedure (module docs).
    fn merge_heap(&self, piece: &[u8], out: &mut Vec<u32>, scratch: &mut Scratch) {
        let Scratch { symbols, heap, .. } = scratch;
        symbols.clear();
        heap.clear();
        let n = piece.len() as u32;
        symbols.extend(piece.iter().enumerate().map(|(i, &b)| Symbol {
            id: self.byte_ids[b as usize],
            prev: if i == 0 { NONE } else { i as u32 - 1 },
            next: if i as u32 + 1 == n {
                NONE
            } else {
                i as u32 + 1
            },
            alive: true,
        }));
        for i in 0..symbols.len() - 1 {
            if let Some((rank, id)) = self.rule(symbols[i].id, symbols[i + 1].id) {
                heap.push(Reverse((rank, i as u32, id)));
            }
        }
        while let Some(Reverse((_, at, id))) = heap.pop() {
            let left = symbols[at as usize];
            if !left.alive || left.next == NONE {
                continue;
            }
            let right = symbols[left.next as usize];
            match self.rule(left.id, right.id) {
                Some((_, merged)) if merged == id => {}
                _ => continue, // stale
            }
            symbols[at as usize].id = id;
            symbols[at as usize].next = right.next;
            symbols[left.next as usize].alive = false;
            if right.next != NONE {
                symbols[right.next as usize].prev = at;
            }
            if left.prev != NONE {
                let prev = symbols[left.prev as usize];
                if let Some((rank, new)) = self.rule(prev.id, id) {
                    heap.push(Reverse((rank, left.prev, new)));
                }
            }
            if right.next != NONE {
                let next = symbols[right.next as usize];
                if let Some((rank, new)) = self.rule(id, next.id) {
                    heap.push(Reverse((rank, at, new)));
                }
            }
        }
        out.extend(symbols.iter().filter(|s| s.alive).map(|s| s.id));
    }

    /// How many tokens the fast path knows (every token but those the merges do not
    /// reach, with `ignore_merges` all of them).
    pub fn whole_tokens(&self) -> usize {
        self.short.len() + self.whole.len()
    }
}

#[cfg(test)]
impl Model {
    /// Both merge procedures' results for `piece` (for the equivalence test).
    pub(super) fn both(&self, piece: &[u8]) -> (Vec<u32>, Vec<u32>) {
        let (mut scan, mut heap) = (Vec::new(), Vec::new());
        let mut scratch = Scratch::default();
        self.merge_scan(piece, &mut scan, &mut scratch);
        self.merge_heap(piece, &mut heap, &mut scratch);
        (scan, heap)
    }
}
