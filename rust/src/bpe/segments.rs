//! Rendered text -> token IDs through the segment cache, in one call: the native side of
//! `PromptTokenizer`'s segment cache (`kvroute/routing/segments.py`).
//!
//! 1. **Split at special tokens.** The text is cut at every occurrence of the
//!    tokenizer's added tokens, leftmost first and, of the ones starting there, the
//!    longest (an Aho-Corasick automaton, `MatchKind::LeftmostLongest`): what Python's
//!    `re` does with the alternation of the escaped tokens longest first, the split
//!    `tokenizers` makes before its pre-tokenizer. A special token becomes its ID.
//! 2. **Look each other piece up** in the segment cache (`segment_cache`: LRU, bounded
//!    in entries and bytes), keyed by the piece as it stands in the text.
//! 3. **Before encoding anything**, the pieces not found (each distinct one once) are
//!    checked:
//!    - *the thread rule*: their cost at the encoder's speed (ns per character of an
//!      ASCII piece, of any other piece; the caller's table) against the caller's
//!      budget; over it, nothing is encoded and the answer is `TooLong`, for the caller
//!      to call again from a thread without a budget;
//!    - *pieces for the caller*: a piece holding a code point of the `unstable` set
//!      (one the tokenizer's NFC could change, or one the encoder refuses) is handed
//!      back (`ForCaller`), to be normalized and encoded by the Python path and passed
//!      in again as `given`. A piece without one is its own NFC, so encoding it as it
//!      stands is what that path does.
//! 4. **Encode the rest** with the native BPE (`Encoder`), store them, and return the
//!    IDs in text order (the `prefix` first when asked: the tokenizer's BOS).
//!
//! Hits and misses are counted per piece occurrence (special tokens aside), on a call
//! that returns IDs only, so a call answered `TooLong` or `ForCaller` and made again
//! counts once. The cache is locked while pieces are looked up and while new ones are
//! stored, never while encoding; callers run with the GIL released, from several
//! threads.

use super::segment_cache::SegmentCache;
use super::{BuildError, Encoder};
use aho_corasick::{AhoCorasick, MatchKind};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// What `SegmentEncoder::encode` found.
#[derive(Debug, PartialEq, Eq)]
pub enum Encoded {
    Ids(Vec<u32>),
    /// Encoding the pieces not cached would cost more than the budget: nothing done.
    TooLong,
    /// These pieces (distinct, in text order) must be encoded by the caller.
    ForCaller(Vec<String>),
}

/// The bounds and speeds a `SegmentEncoder` is built with.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub max_entries: usize,
    pub max_bytes: usize,
    /// ns per character of an ASCII piece, of any other piece (the thread rule).
    pub ascii_ns: u64,
    pub other_ns: u64,
}

struct State {
    cache: SegmentCache,
    hits: u64,
    misses: u64,
}

/// Counters and sizes of the segment cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub entries: usize,
    pub bytes: usize,
}

enum Part {
    Special(u32),
    Hit(Arc<[u32]>),
    Miss(usize),
}

/// Splits, caches and encodes rendered prompts (thread-safe).
pub struct SegmentEncoder {
    encoder: Arc<Encoder>,
    specials: Option<AhoCorasick>,
    special_ids: Vec<u32>,
    prefix: Vec<u32>,
    unstable: Option<Vec<u64>>,
    settings: Settings,
    state: Mutex<State>,
}

fn bitset(cps: &[u32]) -> Vec<u64> {
    let mut bits = vec![0u64; 0x11_0000 / 64];
    for &cp in cps.iter().filter(|&&cp| cp < 0x11_0000) {
        bits[cp as usize / 64] |= 1 << (cp % 64);
    }
    bits
}

impl SegmentEncoder {
    /// `specials`: the added tokens and their IDs; `prefix`: the IDs put first when a
    /// call asks for special tokens; `unstable`: the code points whose pieces go to the
    /// caller (must hold the encoder's refused ones).
    pub fn new(
        encoder: Arc<Encoder>,
        specials: &[(String, u32)],
        prefix: Vec<u32>,
        unstable: Option<&[u32]>,
        settings: Settings,
    ) -> Result<SegmentEncoder, BuildError> {
        let specials: Vec<&(String, u32)> =
            specials.iter().filter(|(t, _)| !t.is_empty()).collect();
        let automaton = if specials.is_empty() {
            None
        } else {
            let built = AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(specials.iter().map(|(t, _)| t.as_bytes()));
            Some(built.map_err(|e| BuildError::Model(format!("special tokens: {e}")))?)
        };
        if unstable.is_some_and(|cps| cps.iter().any(|&cp| cp < 0x80)) {
            return Err(BuildError::Model(
                "an ASCII character marked unstable".into(),
            ));
        }
        Ok(SegmentEncoder {
            encoder,
            specials: automaton,
            special_ids: specials.iter().map(|(_, id)| *id).collect(),
            prefix,
            unstable: unstable.map(bitset),
            settings,
            state: Mutex::new(State {
                cache: SegmentCache::new(settings.max_entries, settings.max_bytes),
                hits: 0,
                misses: 0,
            }),
        })
    }

    /// `text`'s pieces in order: `(piece, None)`, or `(token, Some(id))` for a special.
    pub fn split<'t>(&self, text: &'t str, f: &mut impl FnMut(&'t str, Option<u32>)) {
        let mut at = 0;
        if let Some(ac) = &self.specials {
            for m in ac.find_iter(text) {
                if m.start() > at {
                    f(&text[at..m.start()], None);
                }
                f(
                    &text[m.start()..m.end()],
                    Some(self.special_ids[m.pattern().as_usize()]),
                );
                at = m.end();
            }
        }
        if at < text.len() {
            f(&text[at..], None);
        }
    }

    /// The IDs of `text` (see the module comment). `budget_ns`: the most encoding the
    /// pieces not cached may cost, None for no bound; `given`: IDs of pieces the caller
    /// encoded (after a `ForCaller` answer).
    pub fn encode(
        &self,
        text: &str,
        add_prefix: bool,
        budget_ns: Option<u64>,
        given: &HashMap<String, Vec<u32>>,
    ) -> Encoded {
        let mut spans: Vec<(&str, Option<u32>)> = Vec::new();
        self.split(text, &mut |piece, id| spans.push((piece, id)));
        let mut parts = Vec::with_capacity(spans.len());
        let mut distinct = Distinct::default();
        {
            let mut state = self.state.lock();
            for &(piece, id) in &spans {
                parts.push(match id {
                    Some(id) => Part::Special(id),
                    None => match state.cache.get(piece) {
                        Some(ids) => Part::Hit(ids),
                        None => Part::Miss(distinct.add(piece)),
                    },
                });
            }
        }
        let misses = distinct.pieces;
        let mut cost = 0u64;
        let mut for_caller = Vec::new();
        for &piece in misses.iter().filter(|p| !given.contains_key(**p)) {
            if budget_ns.is_some() {
                cost = cost.saturating_add(self.cost(piece));
            }
            if self.is_unstable(piece) {
                for_caller.push(piece.to_owned());
            }
        }
        if budget_ns.is_some_and(|budget| cost > budget) {
            return Encoded::TooLong;
        }
        if !for_caller.is_empty() {
            return Encoded::ForCaller(for_caller);
        }
        let mut encoded: Vec<Arc<[u32]>> = Vec::with_capacity(misses.len());
        for &piece in &misses {
            let ids = match given.get(piece) {
                Some(ids) => ids.clone(),
                None => match self.encoder.encode(piece) {
                    Some(ids) => ids,
                    None => return Encoded::ForCaller(vec![piece.to_owned()]),
                },
            };
            encoded.push(Arc::from(ids));
        }
        let mut out = Vec::with_capacity(self.prefix.len() + text.len() / 3 + 1);
        if add_prefix {
            out.extend_from_slice(&self.prefix);
        }
        let (mut hits, mut missed) = (0, 0);
        for part in &parts {
            match part {
                Part::Special(id) => out.push(*id),
                Part::Hit(ids) => {
                    hits += 1;
                    out.extend_from_slice(ids);
                }
                Part::Miss(i) => {
                    missed += 1;
                    out.extend_from_slice(&encoded[*i]);
                }
            }
        }
        drop(parts);
        let mut state = self.state.lock();
        for (piece, ids) in misses.iter().zip(encoded) {
            state.cache.insert(piece, ids);
        }
        state.hits += hits;
        state.misses += missed;
        Encoded::Ids(out)
    }

    /// What encoding `piece` is taken to cost, in ns (the thread rule's estimate).
    fn cost(&self, piece: &str) -> u64 {
        if piece.is_ascii() {
            piece.len() as u64 * self.settings.ascii_ns
        } else {
            piece.chars().count() as u64 * self.settings.other_ns
        }
    }

    fn is_unstable(&self, piece: &str) -> bool {
        match &self.unstable {
            Some(bits) if !piece.is_ascii() => piece
                .chars()
                .any(|c| bits[c as usize / 64] & (1 << (c as u32 % 64)) != 0),
            _ => false,
        }
    }

    pub fn stats(&self) -> CacheStats {
        let state = self.state.lock();
        CacheStats {
            hits: state.hits,
            misses: state.misses,
            entries: state.cache.len(),
            bytes: state.cache.bytes(),
        }
    }

    /// The cached pieces, most recent first.
    pub fn cached(&self) -> Vec<Arc<str>> {
        self.state.lock().cache.keys()
    }

    /// Empties the cache (the counters stay).
    pub fn clear(&self) {
        self.state.lock().cache.clear();
    }
}

/// The distinct pieces a call did not find, in order of first occurrence: a linear
/// scan while they are few (a prompt has one or two new pieces), a map past 32.
#[derive(Default)]
struct Distinct<'t> {
    pieces: Vec<&'t str>,
    index: HashMap<&'t str, usize>,
}

impl<'t> Distinct<'t> {
    /// The index of `piece`, added if new.
    fn add(&mut self, piece: &'t str) -> usize {
        let found = if self.pieces.len() <= 32 {
            self.pieces
                .iter()
                .position(|s| s.len() == piece.len() && *s == piece)
        } else {
            if self.index.is_empty() {
                self.index = self
                    .pieces
                    .iter()
                    .enumerate()
                    .map(|(i, s)| (*s, i))
                    .collect();
            }
            self.index.get(piece).copied()
        };
        found.unwrap_or_else(|| {
            self.pieces.push(piece);
            if !self.index.is_empty() {
                self.index.insert(piece, self.pieces.len() - 1);
            }
            self.pieces.len() - 1
        })
    }
}
