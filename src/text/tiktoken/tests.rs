//! Tests of [`super`] (tiktoken.rs).

use super::*;
use std::path::PathBuf;

/// tiktoken-rs' cl100k_base regex, verbatim.
const CL100K_PATTERN: &str = "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}++|\\p{N}{1,3}+| ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*+|\\s++$|\\s*[\\r\\n]|\\s+(?!\\S)|\\s";

/// ~20 varied strings: prose, code, numbers, whitespace runs, CJK, emoji, accents, specials.
const SAMPLES: &[&str] = &[
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "fn main() {\n    println!(\"{}\", 42);\n}\n",
    "def f(x):\n\treturn x**2  # square\n",
    "1234567890 3.14159 -0.5e10 1,000,000",
    "   leading spaces",
    "trailing spaces   ",
    "multiple\n\n\nnewlines\r\n\r\nCRLF",
    "tabs\t\tand  spaces \t \n",
    "中文分词测试，你好世界！",
    "日本語とカタカナ、ひらがな。",
    "한국어 문장입니다.",
    "emoji 🦀🚀👍🏽 family 👨‍👩‍👧",
    "Ünïcödé àccénts naïve café façade",
    "ÉCOLE NORMALE SUPÉRIEURE",
    "I'm sure they'll've done it, won't they? DON'T!",
    "<|endoftext|> special in the middle <|endoftext|>",
    "mixed中文and English混合123abc",
    "https://example.com/path?q=1&r=2#frag",
    "    indented\n        more\n",
    "\u{00a0}nbsp and \u{2003}em space",
    "¿Qué tal? ¡Muy bien! Ελληνικά и русский",
];

/// `assets/<name>` of the tiktoken-rs 0.12 source in the cargo registry, if there.
fn tiktoken_rs_asset(name: &str) -> Option<PathBuf> {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))?;
    for index in std::fs::read_dir(home.join("registry/src")).ok()?.flatten() {
        for krate in std::fs::read_dir(index.path()).ok()?.flatten() {
            if krate
                .file_name()
                .to_string_lossy()
                .starts_with("tiktoken-rs-0.12.")
            {
                let path = krate.path().join("assets").join(name);
                if path.exists() {
                    return Some(path);
                }
            }
        }
    }
    eprintln!("note: tiktoken-rs 0.12 assets/{name} not found in the cargo registry; skipping");
    None
}

/// 256 single bytes (ranks 0..256) plus a few merges.
fn tiny_ranks() -> FxHashMap<Vec<u8>, u32> {
    let mut ranks: FxHashMap<Vec<u8>, u32> = (0..=255u8).map(|b| (vec![b], b as u32)).collect();
    for (i, t) in [
        "aa", "ab", "aab", "ba", "aaa", "bab", "abab", "aaaa", "bb", "hi",
    ]
    .iter()
    .enumerate()
    {
        ranks.insert(t.as_bytes().to_vec(), 256 + i as u32);
    }
    ranks
}

/// The plain reference: keep a list of parts, merge the leftmost
/// lowest-ranked adjacent pair, repeat.
fn naive_bpe(ranks: &FxHashMap<Vec<u8>, u32>, piece: &[u8]) -> Vec<u32> {
    let mut parts: Vec<Vec<u8>> = piece.iter().map(|&b| vec![b]).collect();
    loop {
        let mut best: Option<(u32, usize)> = None;
        for i in 0..parts.len().saturating_sub(1) {
            let cat = [parts[i].as_slice(), parts[i + 1].as_slice()].concat();
            if let Some(&r) = ranks.get(&cat) {
                if best.is_none_or(|(br, _)| r < br) {
                    best = Some((r, i));
                }
            }
        }
        let Some((_, i)) = best else { break };
        let right = parts.remove(i + 1);
        parts[i].extend(right);
    }
    parts.iter().map(|p| ranks[p]).collect()
}

/// Deterministic bytes from a small alphabet, so that merges happen.
fn pseudo_bytes(rng: &mut caracal_kernels::testing::Rng, len: usize, alphabet: &[u8]) -> Vec<u8> {
    (0..len)
        .map(|_| alphabet[((rng.next_u64() >> 33) as usize) % alphabet.len()])
        .collect()
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("caracal-tiktoken-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn write_rank_file(path: &Path, ranks: &FxHashMap<Vec<u8>, u32>) {
    let mut lines: Vec<(u32, String)> = ranks
        .iter()
        .map(|(b, &r)| (r, base64::engine::general_purpose::STANDARD.encode(b)))
        .collect();
    lines.sort();
    let text: String = lines.iter().map(|(r, b)| format!("{b} {r}\n")).collect();
    std::fs::write(path, text).expect("write rank file");
}

#[test]
fn kimi_regex_splits_like_python_regex_v1() {
    // Expected pieces from Python `regex` (VERSION1, which has `&&`) on the same pattern.
    let tok = TiktokenTokenizer::new(tiny_ranks(), vec![], KIMI_PATTERN).unwrap();
    let cases: &[(&str, &[&str])] = &[
        (
            "Hello世界123456 don't",
            &["Hello", "世界", "123", "456", " don't"],
        ),
        (
            "ÉCOLE élève HTTPServer camelCase",
            &["ÉCOLE", " élève", " HTTPServer", " camel", "Case"],
        ),
        (
            "I'M here, they'RE 'tis",
            &["I'M", " here", ",", " they'RE", " '", "tis"],
        ),
        (
            "  leading and trailing  \n\n\tend",
            &[" ", " leading", " and", " trailing", "  \n\n", "\tend"],
        ),
        (
            "foo!!!\n\nbar...\r\n",
            &["foo", "!!!\n\n", "bar", "...\r\n"],
        ),
        ("日本語のテキスト", &["日本語", "のテキスト"]),
        (
            "x = a[i]+b[12345];",
            &["x", " =", " a", "[i", "]+", "b", "[", "123", "45", "];"],
        ),
        (
            "nai\u{308}ve cafe\u{301}",
            &["nai\u{308}ve", " cafe\u{301}"],
        ),
        ("한국어 텍스트", &["한국어", " 텍스트"]),
        ("emoji 🦀🦀 ok", &["emoji", " 🦀🦀", " ok"]),
        ("中文English混合text", &["中文", "English", "混合", "text"]),
        (
            "$100.50 & 3/4",
            &["$", "100", ".", "50", " &", " ", "3", "/", "4"],
        ),
    ];
    for (text, want) in cases {
        assert_eq!(tok.split(text).unwrap(), *want, "{text:?}");
    }
}

#[test]
fn run_splitting_matches_upstream_python() {
    // Expected slices from tokenization_kimi.py's `_split_whitespaces_or_nonwhitespaces(s, 2)`.
    assert_eq!(split_long_runs("aaaaa  b", 2), ["aa", "aa", "a  b"]);
    assert_eq!(split_long_runs("abc", 2), ["ab", "c"]);
    assert_eq!(split_long_runs("", 2), [""]);
    assert_eq!(split_long_runs("     x", 2), ["  ", "  ", " x"]);
    assert_eq!(
        split_long_runs("ab\u{1c}\u{1d}\u{1e}cd", 2),
        ["ab\u{1c}\u{1d}", "\u{1e}cd"]
    );
    assert_eq!(split_long_runs("ééééé", 2), ["éé", "éé", "é"]);
}

#[test]
fn python_isspace_is_white_space_plus_information_separators() {
    // Python 3.11: [c for c in range(0x110000) if chr(c).isspace()].
    let python: &[u32] = &[
        0x9, 0xa, 0xb, 0xc, 0xd, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0, 0x1680, 0x2000, 0x2001,
        0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a, 0x2028, 0x2029,
        0x202f, 0x205f, 0x3000,
    ];
    let ours: Vec<u32> = (0..=0x10FFFFu32)
        .filter_map(char::from_u32)
        .filter(|&c| python_isspace(c))
        .map(|c| c as u32)
        .collect();
    assert_eq!(ours, python);
}

#[test]
fn char_chunks_cut_every_n_chars() {
    assert_eq!(char_chunks("abcdefg", 3), ["abc", "def", "g"]);
    assert_eq!(char_chunks("abcdef", 3), ["abc", "def"]);
    assert_eq!(char_chunks("ééé", 2), ["éé", "é"]);
    assert_eq!(char_chunks("", 2), [""]);
}

#[test]
fn scan_and_heap_merges_equal_naive_merge_on_tiny_ranks() {
    let ranks = tiny_ranks();
    let tok = TiktokenTokenizer::new(ranks.clone(), vec![], KIMI_PATTERN).unwrap();
    let mut rng = caracal_kernels::testing::Rng::seeded(7);
    for len in [2usize, 3, 5, 8, 17, 64, 127, 128, 200, 513] {
        for _ in 0..20 {
            let piece = pseudo_bytes(&mut rng, len, b"aab");
            let want = naive_bpe(&ranks, &piece);
            let scan: Vec<u32> = tok
                .merge_scan(&piece)
                .windows(2)
                .map(|w| ranks[&piece[w[0]..w[1]]])
                .collect();
            let heap: Vec<u32> = tok
                .merge_heap(&piece)
                .windows(2)
                .map(|w| ranks[&piece[w[0]..w[1]]])
                .collect();
            assert_eq!(
                scan,
                want,
                "scan, piece {:?}",
                String::from_utf8_lossy(&piece)
            );
            assert_eq!(
                heap,
                want,
                "heap, piece {:?}",
                String::from_utf8_lossy(&piece)
            );
        }
    }
}

#[test]
fn scan_and_heap_merges_equal_naive_merge_on_cl100k() {
    let Some(path) = tiktoken_rs_asset("cl100k_base.tiktoken") else {
        return;
    };
    let text = std::fs::read_to_string(&path).unwrap();
    let ranks = parse_rank_file(&text, &path).unwrap();
    let tok = TiktokenTokenizer::new(ranks.clone(), vec![], CL100K_PATTERN).unwrap();
    let mut rng = caracal_kernels::testing::Rng::seeded(11);
    for len in [2usize, 7, 33, 99, 150, 400] {
        for alphabet in [
            &b"abcde fgh"[..],
            b"     \n",
            b"0123456789",
            "éà中🦀".as_bytes(),
        ] {
            let piece = pseudo_bytes(&mut rng, len, alphabet);
            let want = naive_bpe(&ranks, &piece);
            let scan: Vec<u32> = tok
                .merge_scan(&piece)
                .windows(2)
                .map(|w| ranks[&piece[w[0]..w[1]]])
                .collect();
            let heap: Vec<u32> = tok
                .merge_heap(&piece)
                .windows(2)
                .map(|w| ranks[&piece[w[0]..w[1]]])
                .collect();
            assert_eq!(scan, want);
            assert_eq!(heap, want);
        }
    }
}

#[test]
fn cl100k_encoding_equals_tiktoken_rs() {
    let Some(path) = tiktoken_rs_asset("cl100k_base.tiktoken") else {
        return;
    };
    let specials = [
        ("<|endoftext|>", 100257),
        ("<|fim_prefix|>", 100258),
        ("<|fim_middle|>", 100259),
        ("<|fim_suffix|>", 100260),
        ("<|endofprompt|>", 100276),
    ];
    let specials =
        SpecialTokens::Explicit(specials.iter().map(|(s, i)| (s.to_string(), *i)).collect());
    let ours = TiktokenTokenizer::from_files(&path, None, CL100K_PATTERN, specials).unwrap();
    let reference = tiktoken_rs::cl100k_base().unwrap();
    for text in SAMPLES {
        let want = reference.encode_with_special_tokens(text);
        let got = ours.encode(text).unwrap();
        assert_eq!(got, want, "{text:?}");
        assert_eq!(ours.decode(&got), *text);
        assert_eq!(
            ours.encode_ordinary(text).unwrap(),
            reference.encode_ordinary(text),
            "ordinary {text:?}"
        );
    }
    assert_eq!(ours.num_ranks(), 100256);
    assert_eq!(ours.token_to_id("<|endofprompt|>"), Some(100276));
    assert_eq!(ours.token_to_id("hello"), Some(15339));
}

#[test]
fn o200k_encoding_equals_tiktoken_rs() {
    let Some(path) = tiktoken_rs_asset("o200k_base.tiktoken") else {
        return;
    };
    let specials = SpecialTokens::Explicit(vec![
        ("<|endoftext|>".into(), 199999),
        ("<|endofprompt|>".into(), 200018),
    ]);
    let ours =
        TiktokenTokenizer::from_files(&path, None, tiktoken_rs::O200K_BASE_PAT_STR, specials)
            .unwrap();
    let reference = tiktoken_rs::o200k_base().unwrap();
    for text in SAMPLES {
        let got = ours.encode(text).unwrap();
        assert_eq!(got, reference.encode_with_special_tokens(text), "{text:?}");
        assert_eq!(ours.decode(&got), *text);
    }
    assert_eq!(ours.vocab_size(), 200019);
}

#[test]
fn whitespace_runs_over_25000_chars_round_trip() {
    let Some(path) = tiktoken_rs_asset("cl100k_base.tiktoken") else {
        return;
    };
    let tok =
        TiktokenTokenizer::from_files(&path, None, CL100K_PATTERN, SpecialTokens::Explicit(vec![]))
            .unwrap();
    let text = format!("a{}b{}c", " ".repeat(30_000), "x".repeat(26_000));
    let ids = tok.encode(&text).unwrap();
    assert_eq!(tok.decode(&ids), text);
    // Both runs are cut after 25,000 chars: "a"+25,000 spaces | 5,000 spaces+"b"+24,999 "x" | the rest.
    let pieces = split_long_runs(&text, MAX_RUN_CHARS);
    assert_eq!(
        pieces.iter().map(|p| p.chars().count()).collect::<Vec<_>>(),
        [25_001, 30_000, 1_002]
    );
    let mut want = Vec::new();
    for p in pieces {
        want.extend(tok.encode(p).unwrap());
    }
    assert_eq!(ids, want);
}

#[test]
fn kimi_specials_fill_the_reserved_range_from_the_config() {
    let dir = temp_dir("specials");
    let ranks = tiny_ranks();
    let n = ranks.len() as u32;
    write_rank_file(&dir.join("tiktoken.model"), &ranks);
    let config = serde_json::json!({
        "added_tokens_decoder": {
            n.to_string(): {"content": "[BOS]", "special": true},
            (n + 2).to_string(): {"content": "<|im_end|>", "special": true},
            (n + 300).to_string(): {"content": "<|outside|>", "special": true},
        }
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let tok = TiktokenTokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.num_ranks(), n as usize);
    assert_eq!(tok.vocab_size(), (n + KIMI_NUM_SPECIAL_IDS) as usize);
    assert_eq!(tok.token_to_id("[BOS]"), Some(n));
    assert_eq!(
        tok.token_to_id(&format!("<|reserved_token_{}|>", n + 1)),
        Some(n + 1)
    );
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(n + 2));
    assert_eq!(
        tok.token_to_id(&format!("<|reserved_token_{}|>", n + 257)),
        Some(n + 257)
    );
    assert_eq!(
        tok.token_to_id("<|outside|>"),
        None,
        "config entries outside the range are ignored"
    );
    assert!(tok.is_special(n + 2) && !tok.is_special(n - 1));
    let h = b'h' as u32;
    let hi = tok.token_to_id("hi").unwrap();
    assert_eq!(tok.encode("hi<|im_end|>[BOS]h").unwrap(), [hi, n + 2, n, h]);
    assert!(!tok
        .encode_ordinary("hi<|im_end|>")
        .unwrap()
        .contains(&(n + 2)));
    assert_eq!(tok.decode(&[hi, n + 2, n]), "hi<|im_end|>[BOS]");
    assert_eq!(
        tok.decode_bytes(&[hi, 999_999]),
        b"hi",
        "unknown ids are skipped"
    );
    assert!(tok.try_decode_bytes(&[999_999]).is_err());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_rank_files_are_rejected_with_the_line() {
    let path = Path::new("x.tiktoken");
    let err = parse_rank_file("YQ== 0\n!!! 1\n", path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("line 2"), "{err}");
    let err = parse_rank_file("YQ== 0\nYQ== 1\n", path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("twice"), "{err}");
    let err = parse_rank_file("YQ== zero\n", path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("bad rank"), "{err}");
    let missing_bytes: FxHashMap<Vec<u8>, u32> = [(b"a".to_vec(), 0)].into_iter().collect();
    assert!(TiktokenTokenizer::new(missing_bytes, vec![], KIMI_PATTERN).is_err());
}

#[test]
fn streaming_byte_tokens_never_splits_a_character() {
    // With single-byte tokens every non-ASCII char spans several tokens.
    let tok = TiktokenTokenizer::new(tiny_ranks(), vec![], KIMI_PATTERN).unwrap();
    let text = "añb中文🦀é\u{301}!";
    let ids: Vec<u32> = text.bytes().map(u32::from).collect();
    let mut dec = ByteStreamDecoder::new();
    let mut out = String::new();
    let mut held = 0;
    for &id in &ids {
        let delta = dec.push(&tok, id);
        assert!(!delta.contains('\u{FFFD}'));
        held += usize::from(delta.is_empty());
        out.push_str(&delta);
    }
    assert!(
        held >= 8,
        "bytes of multi-byte chars are held back ({held})"
    );
    assert!(!dec.has_pending());
    assert_eq!(dec.finish(), "");
    assert_eq!(out, text);
}

#[test]
fn streaming_cl100k_ids_equals_full_decode() {
    let Some(path) = tiktoken_rs_asset("cl100k_base.tiktoken") else {
        return;
    };
    let tok =
        TiktokenTokenizer::from_files(&path, None, CL100K_PATTERN, SpecialTokens::Explicit(vec![]))
            .unwrap();
    let text = "emoji 🦀🚀👍🏽 family 👨‍👩‍👧 中文分词 𝔘𝔫𝔦𝔠𝔬𝔡𝔢";
    let ids = tok.encode(text).unwrap();
    let mut dec = ByteStreamDecoder::new();
    let mut out = String::new();
    let mut held = 0;
    for &id in &ids {
        let delta = dec.push(&tok, id);
        assert!(!delta.contains('\u{FFFD}'), "a half character was emitted");
        held += usize::from(delta.is_empty());
        out.push_str(&delta);
    }
    out.push_str(&dec.finish());
    assert!(held > 0, "some character spans several tokens");
    assert_eq!(out, text);
}

#[test]
fn streaming_invalid_bytes_equals_lossy_decode() {
    let mut rng = caracal_kernels::testing::Rng::seeded(3);
    let alphabet: Vec<u8> = [
        b'a', 0x80, 0xbf, 0xc3, 0xa9, 0xe4, 0xb8, 0xad, 0xf0, 0x9f, 0xa6, 0x80, 0xff,
    ]
    .to_vec();
    for len in [1usize, 2, 5, 16, 64] {
        for _ in 0..50 {
            let bytes = pseudo_bytes(&mut rng, len, &alphabet);
            let mut dec = ByteStreamDecoder::new();
            let mut out = String::new();
            let mut i = 0;
            while i < bytes.len() {
                let step = 1 + (pseudo_bytes(&mut rng, 1, &[0, 1, 2])[0] as usize);
                let end = (i + step).min(bytes.len());
                out.push_str(&dec.push_bytes(&bytes[i..end]));
                i = end;
            }
            out.push_str(&dec.finish());
            assert_eq!(out, String::from_utf8_lossy(&bytes), "{bytes:x?}");
        }
    }
}
