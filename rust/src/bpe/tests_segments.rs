//! The segment encoder: the split at special tokens, the cache's bounds and order, the
//! thread rule's answer and pieces handed to the caller. Identity with `tokenizers` on
//! real tokenizers is tested in Python (`tests/routing/test_segments.py`).

use super::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

/// Bytes as tokens (ID = byte) plus merges of "ab" (256) and "abc" (257).
fn encoder() -> Arc<Encoder> {
    let mut vocab: Vec<(Vec<u8>, u32)> = (0..=255u8).map(|b| (vec![b], b as u32)).collect();
    vocab.push((b"ab".to_vec(), 256));
    vocab.push((b"abc".to_vec(), 257));
    let merges = [
        (b"a".to_vec(), b"b".to_vec()),
        (b"ab".to_vec(), b"c".to_vec()),
    ];
    Arc::new(Encoder::new(vocab, &merges, &[QWEN2], false, Some(&[0x323B0])).unwrap())
}

const SETTINGS: Settings = Settings {
    max_entries: 100,
    max_bytes: 1 << 20,
    ascii_ns: 10,
    other_ns: 100,
};

fn specials() -> Vec<(String, u32)> {
    [
        ("<s>", 1000),
        ("<s>x", 1001),
        ("<|end|>", 1002),
        ("é", 1003),
    ]
    .iter()
    .map(|(t, i)| (t.to_string(), *i))
    .collect()
}

fn segments(settings: Settings, unstable: Option<&[u32]>) -> SegmentEncoder {
    let unstable = unstable.or(Some(&[0x323B0]));
    SegmentEncoder::new(encoder(), &specials(), vec![7], unstable, settings).unwrap()
}

fn ids(s: &SegmentEncoder, text: &str) -> Vec<u32> {
    match s.encode(text, false, None, &HashMap::new()) {
        Encoded::Ids(ids) => ids,
        other => panic!("{other:?}"),
    }
}

/// The reference: split as Python's `re` does with the alternation longest first, then
/// encode each piece whole.
fn reference(text: &str) -> Vec<u32> {
    let enc = encoder();
    let mut tokens = specials();
    tokens.sort_by_key(|(t, _)| std::cmp::Reverse(t.len()));
    let (mut out, mut piece, mut at) = (Vec::new(), String::new(), 0);
    'scan: while at < text.len() {
        for (t, id) in &tokens {
            if text[at..].starts_with(t.as_str()) {
                out.extend(enc.encode(&piece).unwrap());
                piece.clear();
                out.push(*id);
                at += t.len();
                continue 'scan;
            }
        }
        let c = text[at..].chars().next().unwrap();
        piece.push(c);
        at += c.len_utf8();
    }
    out.extend(enc.encode(&piece).unwrap());
    out
}

#[test]
fn splits_leftmost_longest_like_the_regex() {
    let s = segments(SETTINGS, None);
    let mut pieces = Vec::new();
    s.split("ab<s>xy<s><|end|>é <s", &mut |p, id| pieces.push((p, id)));
    assert_eq!(
        pieces,
        [
            ("ab", None),
            ("<s>x", Some(1001)),
            ("y", None),
            ("<s>", Some(1000)),
            ("<|end|>", Some(1002)),
            ("é", Some(1003)),
            (" <s", None),
        ]
    );
    let mut rng = SmallRng::seed_from_u64(3);
    let alphabet = [
        "a", "b", "c", "<", "s", ">", "x", "|", "end", "é", "e\u{301}", " ",
    ];
    for _ in 0..2000 {
        let n = rng.gen_range(0..24);
        let text: String = (0..n)
            .map(|_| alphabet[rng.gen_range(0..alphabet.len())])
            .collect();
        assert_eq!(ids(&s, &text), reference(&text), "{text:?}");
        assert_eq!(ids(&s, &text), reference(&text), "{text:?} (cached)");
    }
}

#[test]
fn counts_hits_and_misses_per_piece() {
    let s = segments(SETTINGS, None);
    assert_eq!(ids(&s, "abc<s>abc<|end|>ab"), [257, 1000, 257, 1002, 256]);
    let stats = s.stats();
    assert_eq!((stats.hits, stats.misses, stats.entries), (0, 3, 2));
    assert_eq!(ids(&s, "ab<|end|>abc"), [256, 1002, 257]);
    assert_eq!((s.stats().hits, s.stats().misses), (2, 3));
    let prefixed = s.encode("ab", true, None, &HashMap::new());
    assert_eq!(prefixed, Encoded::Ids(vec![7, 256]));
    assert_eq!(ids(&s, ""), Vec::<u32>::new());
}

#[test]
fn bounded_in_entries_and_bytes_least_recent_out() {
    let s = segments(
        Settings {
            max_entries: 3,
            ..SETTINGS
        },
        None,
    );
    for t in ["a", "b", "c", "a", "d"] {
        ids(&s, t);
    }
    let keys: Vec<String> = s.cached().iter().map(|k| k.to_string()).collect();
    assert_eq!(keys, ["d", "a", "c"]);
    // Bytes: room for four one-character entries of one ID, not five.
    let four = 4 * entry_bytes("a", 1) + 2;
    let s = segments(
        Settings {
            max_bytes: four,
            ..SETTINGS
        },
        None,
    );
    for t in ["a", "b", "c", "d", "e", "a"] {
        ids(&s, t);
    }
    let keys: Vec<String> = s.cached().iter().map(|k| k.to_string()).collect();
    assert_eq!(keys, ["a", "e", "d", "c"]);
    assert_eq!(s.stats().bytes, 4 * entry_bytes("a", 1));
    // A piece over a quarter of the bytes is encoded, not kept.
    let long = "q".repeat(four / 4);
    assert_eq!(ids(&s, &long).len(), long.len());
    assert!(s.cached().iter().all(|k| k.len() < long.len()));
    s.clear();
    assert_eq!((s.stats().entries, s.stats().bytes), (0, 0));
}

#[test]
fn random_use_keeps_the_cache_consistent() {
    let mut rng = SmallRng::seed_from_u64(9);
    let s = segments(
        Settings {
            max_entries: 8,
            max_bytes: 8 * entry_bytes("abcd", 4),
            ..SETTINGS
        },
        None,
    );
    let mut model: Vec<String> = Vec::new(); // most recent first
    for _ in 0..3000 {
        let text: String = (0..rng.gen_range(1..6))
            .map(|_| ['a', 'b', 'c'][rng.gen_range(0..3)])
            .collect();
        let before = s.stats();
        ids(&s, &text);
        let hit = model.contains(&text);
        assert_eq!(s.stats().hits - before.hits, hit as u64);
        model.retain(|k| *k != text);
        model.insert(0, text);
        let cached: Vec<String> = s.cached().iter().map(|k| k.to_string()).collect();
        assert_eq!(
            cached[..],
            model[..cached.len()],
            "most recent first, least recent out"
        );
        assert!(s.stats().bytes <= 8 * entry_bytes("abcd", 4) && cached.len() <= 8);
        model.truncate(cached.len());
    }
}

#[test]
fn too_long_before_encoding_anything() {
    let s = segments(SETTINGS, None);
    let text = format!("{}<s>{}", "a".repeat(30), "é".repeat(3));
    // 30 ASCII characters at 10 ns (the é are special tokens here).
    assert_eq!(
        s.encode(&text, false, Some(299), &HashMap::new()),
        Encoded::TooLong
    );
    assert_eq!((s.stats().misses, s.stats().entries), (0, 0));
    let text = format!("{}<s>{}", "a".repeat(30), "\u{4e00}".repeat(3));
    assert_eq!(
        s.encode(&text, false, Some(599), &HashMap::new()),
        Encoded::TooLong
    );
    assert!(matches!(
        s.encode(&text, false, Some(600), &HashMap::new()),
        Encoded::Ids(_)
    ));
    // Cached pieces cost nothing.
    assert!(matches!(
        s.encode(&text, false, Some(0), &HashMap::new()),
        Encoded::Ids(_)
    ));
    assert_eq!((s.stats().hits, s.stats().misses), (2, 2));
}

#[test]
fn unstable_pieces_go_to_the_caller() {
    let s = segments(SETTINGS, Some(&[0x301, 0x323B0]));
    let text = "ab<s>e\u{301}<s>abc<s>\u{323B0}";
    let answer = s.encode(text, false, None, &HashMap::new());
    let expected = vec!["e\u{301}".to_string(), "\u{323B0}".to_string()];
    assert_eq!(answer, Encoded::ForCaller(expected));
    assert_eq!(s.stats().misses, 0);
    let given = HashMap::from([
        ("e\u{301}".to_string(), vec![5]),
        ("\u{323B0}".to_string(), vec![6, 6]),
    ]);
    let answer = s.encode(text, false, None, &given);
    assert_eq!(
        answer,
        Encoded::Ids(vec![256, 1000, 5, 1000, 257, 1000, 6, 6])
    );
    // Stored: the next call finds them.
    let answer = s.encode(text, false, None, &HashMap::new());
    assert_eq!(
        answer,
        Encoded::Ids(vec![256, 1000, 5, 1000, 257, 1000, 6, 6])
    );
    assert_eq!((s.stats().hits, s.stats().misses), (4, 4));
    let e = SegmentEncoder::new(encoder(), &[], vec![], Some(&[0x41]), SETTINGS).err();
    assert!(e.is_some(), "ASCII is never unstable");
}
