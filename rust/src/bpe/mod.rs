//! Exact byte-level BPE for the tokenizers chat models ship (Qwen2/3, Llama 3,
//! DeepSeek V3), without a regex engine: a hand-written pre-tokenizer for their exact
//! patterns (`pretok`), Unicode classes as `tokenizers`' Oniguruma defines them
//! (`classes`), and `tokenizers`' own merge procedure (`merge`).
//!
//! The caller normalizes the text (NFC, where the tokenizer does) and splits out special
//! tokens first, as `tokenizers` does before its pre-tokenizer. Each piece's UTF-8 bytes
//! are the BPE symbols: byte-level BPE maps every byte to one printable character and
//! back, so working on the bytes directly gives the same IDs.
//!
//! Texts with a character in the encoder's *refused* set (given at build time; the
//! Python side passes the code points its own NFC tables do not know) are not encoded:
//! `encode` returns None and the caller uses the reference encoder.

mod classes;
mod merge;
mod pretok;
mod segment_cache;
mod segments;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_segments;

pub use classes::flags_of;
pub use merge::Model;
pub use pretok::{Scheme, DEEPSEEK_V3, LLAMA3, QWEN2};
pub use segment_cache::{entry_bytes, SegmentCache};
pub use segments::{CacheStats, Encoded, SegmentEncoder, Settings};

/// Why an encoder cannot be built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildError {
    /// The pre-tokenizer's regexes are not a scheme `pretok` reproduces.
    Pattern,
    /// The vocabulary or merges are inconsistent (the message says how).
    Model(String),
}

impl std::fmt::Display for BuildError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BuildError::Pattern => write!(f, "pre-tokenizer regex is not one it reproduces"),
            BuildError::Model(why) => f.write_str(why),
        }
    }
}

/// A byte-level BPE encoder (thread-safe, immutable once built).
pub struct Encoder {
    model: Model,
    scheme: Scheme,
    /// Bit per code point: texts holding one are refused.
    refused: Option<Vec<u64>>,
}

impl Encoder {
    /// `patterns`: the pre-tokenizer's regexes in order; `refused`: code points whose
    /// texts must go to the reference encoder.
    pub fn new(
        vocab: Vec<(Vec<u8>, u32)>,
        merges: &[(Vec<u8>, Vec<u8>)],
        patterns: &[&str],
        ignore_merges: bool,
        refused: Option<&[u32]>,
    ) -> Result<Encoder, BuildError> {
        let scheme = Scheme::recognise(patterns).ok_or(BuildError::Pattern)?;
        let model = Model::new(vocab, merges, ignore_merges).map_err(BuildError::Model)?;
        let refused = refused.map(|cps| {
            let mut bits = vec![0u64; 0x11_0000 / 64];
            for &cp in cps.iter().filter(|&&cp| cp < 0x11_0000) {
                bits[cp as usize / 64] |= 1 << (cp % 64);
            }
            bits
        });
        Ok(Encoder {
            model,
            scheme,
            refused,
        })
    }

    /// The token IDs of `text` (normalized, without special tokens), or None when the
    /// text holds a refused character.
    pub fn encode(&self, text: &str) -> Option<Vec<u32>> {
        if let Some(bits) = &self.refused {
            if !text.is_ascii()
                && text
                    .chars()
                    .any(|c| bits[c as usize / 64] & (1 << (c as u32 % 64)) != 0)
            {
                return None;
            }
        }
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut scratch = merge::Scratch::default();
        self.scheme.split(text, &mut |piece| {
            self.model
                .encode_piece(piece.as_bytes(), &mut out, &mut scratch)
        });
        Some(out)
    }

    /// The pre-tokenizer's pieces of `text`.
    pub fn split<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut pieces = Vec::new();
        self.scheme.split(text, &mut |p| pieces.push(p));
        pieces
    }

    /// The pre-tokenizer scheme in use.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// Tokens the whole-piece fast path knows.
    pub fn whole_tokens(&self) -> usize {
        self.model.whole_tokens()
    }
}
