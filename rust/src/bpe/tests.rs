//! Hand-checked splits and merges. The exhaustive checks against `tokenizers` itself
//! (every code point, generated texts, chat templates) are Python tests
//! (`tests/routing/test_native_bpe.py`).

use super::classes::{Table, LETTER, MARK, NUMBER, PUNCT, SPACE, SYMBOL};
use super::*;

fn split(scheme: Scheme, text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    scheme.split(text, &mut |p| pieces.push(p));
    assert_eq!(pieces.concat(), text, "the pieces cover the text");
    pieces
}

const QWEN: Scheme = Scheme::Gpt4 { digits: 1 };
const LLAMA: Scheme = Scheme::Gpt4 { digits: 3 };

#[test]
fn recognises_only_the_exact_patterns() {
    assert_eq!(Scheme::recognise(&[QWEN2]), Some(QWEN));
    assert_eq!(Scheme::recognise(&[LLAMA3]), Some(LLAMA));
    assert_eq!(Scheme::recognise(&DEEPSEEK_V3), Some(Scheme::DeepSeekV3));
    assert_eq!(Scheme::recognise(&[&QWEN2[1..]]), None);
    assert_eq!(Scheme::recognise(&[QWEN2, QWEN2]), None);
    assert_eq!(Scheme::recognise(&DEEPSEEK_V3[1..]), None);
    assert!(DEEPSEEK_V3[2].contains("[^\r\n\\p{L}"));
}

#[test]
fn gpt4_words_contractions_and_punctuation() {
    assert_eq!(split(QWEN, "Hello world"), ["Hello", " world"]);
    assert_eq!(
        split(QWEN, "I'm you're DON'T"),
        ["I", "'m", " you", "'re", " DON", "'T"]
    );
    // Case folding: U+017F (long s) folds to s; other apostrophes are punctuation.
    assert_eq!(split(QWEN, "it'\u{17f}"), ["it", "'\u{17f}"]);
    assert_eq!(split(QWEN, "'hello 'sello"), ["'hello", " '", "sello"]);
    assert_eq!(split(QWEN, "'sello"), ["'s", "ello"]);
    assert_eq!(
        split(QWEN, "(word) x!?\n\ny"),
        ["(word", ")", " x", "!?\n\n", "y"]
    );
    assert_eq!(split(QWEN, " ?!"), [" ?!"]);
    assert_eq!(split(QWEN, "é東京 😀👍"), ["é東京", " 😀👍"]);
}

#[test]
fn gpt4_numbers() {
    assert_eq!(split(QWEN, "x12345"), ["x", "1", "2", "3", "4", "5"]);
    assert_eq!(split(LLAMA, "x12345"), ["x", "123", "45"]);
    assert_eq!(split(LLAMA, "½²3"), ["½²3"]);
    assert_eq!(split(QWEN, " 42"), [" ", "4", "2"]);
}

#[test]
fn gpt4_whitespace_runs() {
    // The lookahead leaves a run's last character to the word after it.
    assert_eq!(split(QWEN, "a  b"), ["a", " ", " b"]);
    assert_eq!(split(QWEN, "a   b"), ["a", "  ", " b"]);
    // A run with line breaks ends just after its last one.
    assert_eq!(split(QWEN, "a   \n\n  b"), ["a", "   \n\n", " ", " b"]);
    assert_eq!(split(QWEN, "a \n b"), ["a", " \n", " b"]);
    // At the end of the text, the whole run.
    assert_eq!(split(QWEN, "x  "), ["x", "  "]);
    assert_eq!(split(QWEN, "\t\tfoo"), ["\t", "\tfoo"]);
    // One space before a non-letter: `\s+`.
    assert_eq!(split(QWEN, "a \t1"), ["a", " ", "\t", "1"]);
    assert_eq!(
        split(QWEN, "a\u{3000}\u{2003}b"),
        ["a", "\u{3000}", "\u{2003}b"]
    );
    assert_eq!(split(QWEN, "\r\n\r\nx"), ["\r\n\r\n", "x"]);
    assert_eq!(split(QWEN, ""), Vec::<&str>::new());
}

#[test]
fn deepseek_stages() {
    let ds = Scheme::DeepSeekV3;
    assert_eq!(
        split(ds, "abc1234567def"),
        ["abc", "123", "456", "7", "def"]
    );
    assert_eq!(split(ds, "你好world"), ["你好", "world"]);
    assert_eq!(split(ds, "한국어 텍스트"), ["한국어", " 텍스트"]);
    assert_eq!(split(ds, "'sam don't"), ["'sam", " don", "'t"]);
    assert_eq!(split(ds, " hello, world!"), [" hello", ",", " world", "!"]);
    // A format character before a letter starts a word; elsewhere it is left over.
    assert_eq!(
        split(ds, "a\u{200d}b x\u{200d}"),
        ["a", "\u{200d}b", " x", "\u{200d}"]
    );
    assert_eq!(
        split(ds, "e\u{301}\u{301} ..\n"),
        ["e\u{301}\u{301}", " ..\n"]
    );
    assert_eq!(split(ds, "a  b\n\n"), ["a", " ", " b", "\n\n"]);
}

#[test]
fn classes_of_some_characters() {
    let t = Table::get();
    let f = |c: char| t.flags(c as u32);
    assert_eq!(f('a'), LETTER);
    assert_eq!(f('東'), LETTER);
    assert_eq!(f('7'), NUMBER);
    assert_eq!(f('½'), NUMBER);
    assert_eq!(f('\u{301}'), MARK);
    assert_eq!(f('!'), PUNCT);
    assert_eq!(f('+'), SYMBOL);
    assert_eq!(f('😀'), SYMBOL);
    for c in [
        '\t', '\n', '\x0b', '\x0c', '\r', ' ', '\u{85}', '\u{a0}', '\u{3000}',
    ] {
        assert_eq!(f(c), SPACE, "{c:?}");
    }
    assert_eq!(f('\u{1c}'), 0); // str.isspace's, not White_Space
    assert_eq!(f('\u{200b}'), 0);
    assert_eq!(f('\u{10d50}'), LETTER); // new in Unicode 16
    assert_eq!(flags_of("a1 "), [LETTER, NUMBER, SPACE]);
}

/// Byte tokens are their byte value; then the listed tokens in order.
fn model(tokens: &[&str], merges: &[(&str, &str)], ignore_merges: bool) -> Model {
    let mut vocab: Vec<(Vec<u8>, u32)> = (0..=255u8).map(|b| (vec![b], b as u32)).collect();
    for (i, t) in tokens.iter().enumerate() {
        vocab.push((t.as_bytes().to_vec(), 256 + i as u32));
    }
    let merges: Vec<_> = merges
        .iter()
        .map(|(a, b)| (a.as_bytes().to_vec(), b.as_bytes().to_vec()))
        .collect();
    Model::new(vocab, &merges, ignore_merges).unwrap()
}

fn ids(m: &Model, piece: &str) -> Vec<u32> {
    let mut out = Vec::new();
    m.encode_piece(piece.as_bytes(), &mut out, &mut merge::Scratch::default());
    out
}

#[test]
fn merges_by_rank_then_leftmost() {
    let m = model(
        &["ab", "bc", "abc", "aa", "xy"],
        &[("b", "c"), ("a", "bc"), ("a", "b"), ("a", "a")],
        false,
    );
    assert_eq!(ids(&m, "abc"), [258]); // bc first, then a+bc
    assert_eq!(ids(&m, "abab"), [256, 256]);
    assert_eq!(ids(&m, "aaa"), [259, b'a' as u32]); // the leftmost pair first
    assert_eq!(ids(&m, "abcd"), [258, b'd' as u32]);
    // "xy" is a token no merge reaches: tokenizers keeps its bytes, as here.
    assert_eq!(ids(&m, "xy"), [b'x' as u32, b'y' as u32]);
    assert_eq!(m.whole_tokens(), 4);
    // With ignore_merges, a piece that is a token is that token.
    let m = model(&["ab", "xy"], &[("a", "b")], true);
    assert_eq!(ids(&m, "xy"), [257]);
    assert_eq!(ids(&m, "xyab"), [b'x' as u32, b'y' as u32, 256]);
}

#[test]
fn a_pair_listed_twice_keeps_its_later_rank() {
    let m = model(&["ab", "bc"], &[("a", "b"), ("b", "c"), ("a", "b")], false);
    assert_eq!(ids(&m, "abc"), [b'a' as u32, 257]);
}

#[test]
fn inconsistent_models_are_refused() {
    let vocab: Vec<(Vec<u8>, u32)> = (1..=255u8).map(|b| (vec![b], b as u32)).collect();
    let err = Model::new(vocab, &[], false).err().unwrap();
    assert!(err.contains("byte 0x00"), "{err}");
    let vocab: Vec<(Vec<u8>, u32)> = (0..=255u8).map(|b| (vec![b], b as u32)).collect();
    let err = Model::new(vocab, &[(b"a".to_vec(), b"b".to_vec())], false)
        .err()
        .unwrap();
    assert!(err.contains("not in the vocabulary"), "{err}");
    let patterns = ["\\s+"];
    let e = Encoder::new(Vec::new(), &[], &patterns, false, None).err();
    assert_eq!(e, Some(BuildError::Pattern));
}

#[test]
fn refused_characters_send_the_text_back() {
    let vocab: Vec<(Vec<u8>, u32)> = (0..=255u8).map(|b| (vec![b], b as u32)).collect();
    let refused = [0x323B0];
    let e = Encoder::new(vocab, &[], &[QWEN2], false, Some(&refused)).unwrap();
    assert_eq!(e.encode("ab"), Some(vec![97, 98]));
    assert_eq!(e.encode("é"), Some(vec![0xC3, 0xA9]));
    assert_eq!(e.encode("a \u{323B0}"), None);
}

#[test]
fn the_scan_and_the_heap_merge_alike() {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    let mut rng = SmallRng::seed_from_u64(7);
    for _ in 0..40 {
        // A random merge list over a 4-letter alphabet: each merge joins two existing
        // tokens into a new one (some results reachable two ways, some pairs listed twice).
        let mut tokens: Vec<Vec<u8>> = (b'a'..=b'd').map(|b| vec![b]).collect();
        let mut merges = Vec::new();
        for _ in 0..60 {
            let left = tokens[rng.gen_range(0..tokens.len())].clone();
            let right = tokens[rng.gen_range(0..tokens.len())].clone();
            let joined = [left.clone(), right.clone()].concat();
            if !tokens.contains(&joined) {
                tokens.push(joined);
            }
            merges.push((left, right));
        }
        let mut vocab: Vec<(Vec<u8>, u32)> = (0..=255u8).map(|b| (vec![b], b as u32)).collect();
        for t in tokens.iter().filter(|t| t.len() > 1) {
            vocab.push((t.clone(), vocab.len() as u32));
        }
        let model = Model::new(vocab, &merges, false).unwrap();
        for _ in 0..50 {
            let len = rng.gen_range(2..80);
            let piece: Vec<u8> = (0..len).map(|_| b'a' + rng.gen_range(0..4)).collect();
            let (scan, heap) = model.both(&piece);
            assert_eq!(scan, heap, "{:?}", String::from_utf8_lossy(&piece));
        }
    }
}
