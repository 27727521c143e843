//! Unicode character classes for the pre-tokenizer, as the `tokenizers` library's regex
//! engine (Oniguruma) defines them: `\p{L}`, `\p{N}`, `\p{M}`, `\p{P}`, `\p{S}` (general
//! categories) and `\s` (the `White_Space` property).
//!
//! The ranges come from `regex-syntax`'s Unicode tables, pinned to a release whose
//! Unicode version (16.0) is the one of the Oniguruma that `tokenizers` bundles; the
//! Python tests compare every class with `tokenizers` over every code point. They are
//! laid out once, on first use, as a two-level table (a block index per 256 code points,
//! then one byte of flags per code point in deduplicated blocks): a lookup is two loads.

use regex_syntax::hir::{Class, HirKind};
use std::collections::HashMap;
use std::sync::OnceLock;

/// `\p{L}`: letters.
pub const LETTER: u8 = 1;
/// `\p{N}`: numbers.
pub const NUMBER: u8 = 2;
/// `\s`: Unicode `White_Space` (tab to carriage return, space, NEL, NBSP, ...).
pub const SPACE: u8 = 4;
/// `\p{M}`: marks.
pub const MARK: u8 = 8;
/// `\p{P}`: punctuation.
pub const PUNCT: u8 = 16;
/// `\p{S}`: symbols.
pub const SYMBOL: u8 = 32;

const CLASSES: [(&str, u8); 6] = [
    (r"\p{L}", LETTER),
    (r"\p{N}", NUMBER),
    (r"\s", SPACE),
    (r"\p{M}", MARK),
    (r"\p{P}", PUNCT),
    (r"\p{S}", SYMBOL),
];

const BLOCK: usize = 256;
const CODE_POINTS: usize = 0x11_0000;

/// The flags of every code point.
pub struct Table {
    /// The flags of ASCII characters, the pre-tokenizer's common case.
    pub ascii: [u8; 128],
    index: Vec<u16>,
    blocks: Vec<[u8; BLOCK]>,
}

impl Table {
    fn build() -> Table {
        let mut flat = vec![0u8; CODE_POINTS];
        for (pattern, flag) in CLASSES {
            let hir = regex_syntax::ParserBuilder::new()
                .build()
                .parse(pattern)
                .expect("a Unicode class regex-syntax knows");
            let HirKind::Class(Class::Unicode(class)) = hir.kind() else {
                unreachable!("{pattern} is a Unicode class")
            };
            for range in class.ranges() {
                let span = range.start() as usize..=range.end() as usize;
                flat[span].iter_mut().for_each(|f| *f |= flag);
            }
        }
        let mut index = Vec::with_capacity(CODE_POINTS / BLOCK);
        let mut blocks: Vec<[u8; BLOCK]> = Vec::new();
        let mut seen: HashMap<[u8; BLOCK], u16> = HashMap::new();
        for chunk in flat.chunks_exact(BLOCK) {
            let block: [u8; BLOCK] = chunk.try_into().expect("a whole block");
            let at = *seen.entry(block).or_insert_with(|| {
                blocks.push(block);
                (blocks.len() - 1) as u16
            });
            index.push(at);
        }
        let mut ascii = [0u8; 128];
        ascii.copy_from_slice(&flat[..128]);
        Table {
            ascii,
            index,
            blocks,
        }
    }

    /// The table, built on first use (a few milliseconds).
    pub fn get() -> &'static Table {
        static TABLE: OnceLock<Table> = OnceLock::new();
        TABLE.get_or_init(Table::build)
    }

    /// The flags of code point `cp` (0 past the last code point).
    #[inline]
    pub fn flags(&self, cp: u32) -> u8 {
        let cp = cp as usize;
        match self.index.get(cp / BLOCK) {
            Some(&block) => self.blocks[block as usize][cp % BLOCK],
            None => 0,
        }
    }
}

/// The flags of each character of `text`, one byte per character (for tests and the
/// Python binding's code-point sweeps).
pub fn flags_of(text: &str) -> Vec<u8> {
    let table = Table::get();
    text.chars().map(|c| table.flags(c as u32)).collect()
}
