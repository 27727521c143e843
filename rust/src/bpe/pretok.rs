//! A hand-written pre-tokenizer for the regexes byte-level BPE tokenizers ship, matching
//! what `tokenizers` (Oniguruma, leftmost-first alternation, greedy quantifiers with
//! backtracking) does with them, without a regex engine.
//!
//! A scheme is recognised only by the exact pattern strings the loaded pipeline
//! serializes; any other pattern keeps the general encoders. Each `Split` stage with
//! `Isolated` behaviour cuts every piece into its matches and the stretches between them
//! (kept as pieces of their own), and the next stage runs on each piece as on a whole
//! text (so `(?!\S)` sees a piece's end as the end of the text).
//!
//! * **GPT-4 family** (Qwen2/Qwen3: `\p{N}`; Llama 3: `\p{N}{1,3}`), at each position
//!   the first alternative that matches:
//!   1. `(?i:'s|'t|'re|'ve|'m|'ll|'d)`, case-insensitively as Oniguruma folds case
//!      (`'S`, and `'ſ`: U+017F folds to `s`);
//!   2. `[^\r\n\p{L}\p{N}]?\p{L}+`: one optional character that is no line break,
//!      letter or digit, then the run of letters;
//!   3. `\p{N}` or `\p{N}{1,3}`: one, or up to three, numbers;
//!   4. ` ?[^\s\p{L}\p{N}]+[\r\n]*`: an optional space, a run of characters that are
//!      no space, letter or number, then any line breaks;
//!   5. `\s*[\r\n]+`: backtracking leaves it ending just after the *last* line break
//!      of the whitespace run;
//!   6. `\s+(?!\S)`: the run, whole at the end of the text, else without its last
//!      character (left to the next piece) when it has two or more;
//!   7. `\s+`: a single whitespace character followed by a non-space.
//!
//!   Every character starts a match, so no stretch is left between matches.
//! * **DeepSeek V3**, three stages: `\p{N}{1,3}` (runs of numbers in threes from the
//!   left), `[一-龥぀-ゟ゠-ヿ]+` (runs of CJK ideographs and kana), then
//!   1. `[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+`: ASCII punctuation and ASCII
//!      letters;
//!   2. `[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+`;
//!   3. ` ?[\p{P}\p{S}]+[\r\n]*`;
//!   4. to 6. the whitespace alternatives above.
//!
//!   Characters that start no match (digits cut out by the first stage, format and
//!   control characters not before a letter, ...) stay as stretches between matches.

use super::classes::{Table, LETTER, MARK, NUMBER, PUNCT, SPACE, SYMBOL};

/// Qwen2's and Qwen3's pattern.
pub const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's pattern (GPT-4's cl100k as `tokenizers` writes it).
pub const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// DeepSeek V3's three stages (its third pattern holds raw CR and LF characters).
pub const DEEPSEEK_V3: [&str; 3] = [
    r"\p{N}{1,3}",
    "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+",
    concat!(
        r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^"##,
        "\r\n",
        r"\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[",
        "\r\n",
        r"]*|\s*[",
        "\r\n",
        r"]+|\s+(?!\S)|\s+"
    ),
];

/// A pre-tokenizer this module reproduces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// The GPT-4 family; `digits` is the most numbers one piece holds (1 or 3).
    Gpt4 { digits: usize },
    /// DeepSeek V3's three stages.
    DeepSeekV3,
}

impl Scheme {
    /// The scheme whose regexes are exactly `patterns` (in order), if any.
    pub fn recognise(patterns: &[&str]) -> Option<Scheme> {
        match patterns {
            [p] if *p == QWEN2 => Some(Scheme::Gpt4 { digits: 1 }),
            [p] if *p == LLAMA3 => Some(Scheme::Gpt4 { digits: 3 }),
            [a, b, c] if [*a, *b, *c] == DEEPSEEK_V3 => Some(Scheme::DeepSeekV3),
            _ => None,
        }
    }

    /// Calls `f` on each piece of `text`, in order; the pieces cover `text`.
    pub fn split<'t>(&self, text: &'t str, f: &mut impl FnMut(&'t str)) {
        let t = Table::get();
        match *self {
            Scheme::Gpt4 { digits } => isolate(t, text, |x, i| Some(x.gpt4(i, digits)), f),
            Scheme::DeepSeekV3 => isolate(t, text, |x, i| x.numbers3(i), &mut |p| {
                isolate(t, p, |x, i| x.kana_han(i), &mut |q| {
                    isolate(t, q, |x, i| x.deepseek(i), &mut *f)
                })
            }),
        }
    }
}

/// `Split` with `Isolated` behaviour: the matches `find` reports (the end of the match
/// starting at a position, if one does) and the stretches between them, in order.
fn isolate<'t>(
    table: &'static Table,
    text: &'t str,
    find: impl Fn(&Text<'_>, usize) -> Option<usize>,
    f: &mut impl FnMut(&'t str),
) {
    let x = Text {
        b: text.as_bytes(),
        t: table,
    };
    let (mut i, mut gap) = (0, 0);
    while i < x.b.len() {
        match find(&x, i) {
            Some(end) => {
                if gap < i {
                    f(&text[gap..i]);
                }
                f(&text[i..end]);
                i = end;
                gap = end;
            }
            None => i += x.at(i).2,
        }
    }
    if gap < x.b.len() {
        f(&text[gap..]);
    }
}

const CR: u32 = b'\r' as u32;
const LF: u32 = b'\n' as u32;

/// A text (one piece of the previous stage) and the class table; positions are byte
/// offsets at character boundaries.
struct Text<'a> {
    b: &'a [u8],
    t: &'static Table,
}

impl Text<'_> {
    /// The character at `i`: code point, class flags, length in bytes.
    #[inline(always)]
    fn at(&self, i: usize) -> (u32, u8, usize) {
        let x = self.b[i];
        if x < 0x80 {
            return (x as u32, self.t.ascii[x as usize], 1);
        }
        self.at_wide(i, x)
    }

    /// `at` for a character of two to four bytes, starting with `x`.
    #[inline(never)]
    fn at_wide(&self, i: usize, x: u8) -> (u32, u8, usize) {
        let b = self.b;
        let (cp, len) = if x < 0xE0 {
            (((x as u32 & 0x1F) << 6) | (b[i + 1] as u32 & 0x3F), 2)
        } else if x < 0xF0 {
            let c = ((x as u32 & 0x0F) << 12) | ((b[i + 1] as u32 & 0x3F) << 6);
            (c | (b[i + 2] as u32 & 0x3F), 3)
        } else {
            let c = ((x as u32 & 0x07) << 18) | ((b[i + 1] as u32 & 0x3F) << 12);
            let c = c | ((b[i + 2] as u32 & 0x3F) << 6);
            (c | (b[i + 3] as u32 & 0x3F), 4)
        };
        (cp, self.t.flags(cp), len)
    }

    /// The flags of the character at `i`, 0 at the end.
    #[inline]
    fn flags(&self, i: usize) -> u8 {
        if i < self.b.len() {
            self.at(i).1
        } else {
            0
        }
    }

    /// The end of the run from `i` of characters with any of `mask`'s flags.
    #[inline]
    fn run(&self, mut i: usize, mask: u8) -> usize {
        while i < self.b.len() {
            let (_, f, len) = self.at(i);
            if f & mask == 0 {
                break;
            }
            i += len;
        }
        i
    }

    /// The end of the run from `i` of characters with none of `mask`'s flags.
    #[inline]
    fn run_none(&self, mut i: usize, mask: u8) -> usize {
        while i < self.b.len() {
            let (_, f, len) = self.at(i);
            if f & mask != 0 {
                break;
            }
            i += len;
        }
        i
    }

    /// `[\r\n]*` from `i`.
    #[inline]
    fn line_breaks(&self, mut i: usize) -> usize {
        while i < self.b.len() && matches!(self.b[i], b'\r' | b'\n') {
            i += 1;
        }
        i
    }

    /// `\s*[\r\n]+|\s+(?!\S)|\s+` at `i`, a whitespace character (module docs, 5 to 7).
    fn spaces(&self, i: usize) -> usize {
        let (mut k, mut last, mut line_break) = (i, i, None);
        while k < self.b.len() {
            let (c, f, len) = self.at(k);
            if f & SPACE == 0 {
                break;
            }
            if c == CR || c == LF {
                line_break = Some(k);
            }
            last = k;
            k += len;
        }
        match line_break {
            Some(at) => at + 1,
            None if k == self.b.len() || last == i => k,
            None => last,
        }
    }

    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)` after the apostrophe at `i - 1`: its end.
    fn contraction(&self, i: usize) -> Option<usize> {
        if i >= self.b.len() {
            return None;
        }
        let (c, _, len) = self.at(i);
        let second = |want: u32| {
            let j = i + len;
            (j < self.b.len() && fold(self.at(j).0) == want).then(|| j + self.at(j).2)
        };
        match fold(c) {
            0x73 | 0x74 | 0x6D | 0x64 => Some(i + len), // s t m d
            0x72 | 0x76 => second(0x65),                // re ve
            0x6C => second(0x6C),                       // ll
            _ => None,
        }
    }

    /// The GPT-4 family's match at `i` (module docs); every position has one.
    fn gpt4(&self, i: usize, digits: usize) -> usize {
        let (c, f, len) = self.at(i);
        let j = i + len;
        if c == u32::from(b'\'') {
            if let Some(end) = self.contraction(j) {
                return end;
            }
        }
        if f & LETTER != 0 {
            return self.run(j, LETTER);
        }
        if c != CR && c != LF && f & NUMBER == 0 && self.flags(j) & LETTER != 0 {
            return self.run(j, LETTER);
        }
        if f & NUMBER != 0 {
            let (mut k, mut n) = (j, 1);
            while n < digits && self.flags(k) & NUMBER != 0 {
                k += self.at(k).2;
                n += 1;
            }
            return k;
        }
        const WORDY: u8 = LETTER | NUMBER | SPACE;
        if f & WORDY == 0 {
            return self.line_breaks(self.run_none(j, WORDY));
        }
        if c == u32::from(b' ') && j < self.b.len() && self.flags(j) & WORDY == 0 {
            return self.line_breaks(self.run_none(j, WORDY));
        }
        self.spaces(i)
    }

    /// DeepSeek V3's first stage: `\p{N}{1,3}`.
    fn numbers3(&self, i: usize) -> Option<usize> {
        let mut k = i;
        for _ in 0..3 {
            if self.flags(k) & NUMBER == 0 {
                break;
            }
            k += self.at(k).2;
        }
        (k > i).then_some(k)
    }

    /// DeepSeek V3's second stage: `[一-龥぀-ゟ゠-ヿ]+`.
    fn kana_han(&self, i: usize) -> Option<usize> {
        let mut k = i;
        while k < self.b.len() {
            let (c, _, len) = self.at(k);
            if !matches!(c, 0x4E00..=0x9FA5 | 0x3040..=0x30FF) {
                break;
            }
            k += len;
        }
        (k > i).then_some(k)
    }

    /// DeepSeek V3's third stage (module docs).
    fn deepseek(&self, i: usize) -> Option<usize> {
        let (c, f, len) = self.at(i);
        let j = i + len;
        let b = self.b;
        if c < 0x80 && (c as u8).is_ascii_punctuation() && j < b.len() && b[j].is_ascii_alphabetic()
        {
            let mut k = j;
            while k < b.len() && b[k].is_ascii_alphabetic() {
                k += 1;
            }
            return Some(k);
        }
        const WORD: u8 = LETTER | MARK;
        if f & WORD != 0 {
            return Some(self.run(j, WORD));
        }
        if c != CR && c != LF && f & (LETTER | PUNCT | SYMBOL) == 0 && self.flags(j) & WORD != 0 {
            return Some(self.run(j, WORD));
        }
        const MARKS: u8 = PUNCT | SYMBOL;
        if f & MARKS != 0 {
            return Some(self.line_breaks(self.run(j, MARKS)));
        }
        if c == u32::from(b' ') && self.flags(j) & MARKS != 0 {
            return Some(self.line_breaks(self.run(j, MARKS)));
        }
        (f & SPACE != 0).then(|| self.spaces(i))
    }
}

/// Simple case folding for the contraction's letters: ASCII capitals, and U+017F (long
/// s, which folds to `s`).
#[inline]
fn fold(c: u32) -> u32 {
    match c {
        0x41..=0x5A => c + 0x20,
        0x17F => 0x73,
        _ => c,
    }
}
