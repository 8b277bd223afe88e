//! Incremental stop-string matching over generated tokens.
//!
//! A request stops when one of its stop strings appears in the text of the
//! tokens it generated. Decoding the whole output after every token costs
//! O(n) per token; [`StopMatcher`] instead decodes only a small window of
//! the newest tokens, the way a streaming detokenizer does, and keeps a
//! tail of the text already seen that is just long enough for a stop string
//! to straddle it and the new text.
//!
//! The window: `prefix..read` are ids whose text is already in the tail
//! (kept as context so that decoders which treat the first token of a
//! sequence differently, such as SentencePiece's leading space, decode the
//! new ids as they would inside the full text) and `read..` are new ids.
//! The new text is `decode(prefix..) − decode(prefix..read)`. It is checked
//! on every token, but only *committed* to the tail (and the window moved
//! on) when it does not end in U+FFFD: a character split over several
//! tokens is then checked as the replacement character the full decode
//! would show at that point, and once again when its last byte arrives.
//!
//! For byte-level decoders (GPT-2-style BPE, tiktoken), the text checked at
//! each token equals the full decode's, so a stop string is found at exactly
//! the token where `decode(generated).contains(stop)` first holds (tested
//! against that rule below).

use crate::engine::Detokenize;

/// Most ids decoded per check. When a decoder keeps producing text that is
/// not a clean extension (held-back bytes), the window is committed as is
/// once it reaches this many ids, so one check never costs more than this.
const MAX_WINDOW: usize = 16;

/// Watches one request's generated ids for its stop strings.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    /// The stop strings (non-empty).
    strings: Vec<String>,
    /// Longest stop string in bytes.
    longest: usize,
    /// First id of the decode window (context whose text is in `tail`).
    prefix: usize,
    /// First id whose text is not yet committed to `tail`.
    read: usize,
    /// End of the committed text: at least `longest − 1` bytes of it.
    tail: String,
}

impl StopMatcher {
    /// A matcher for `strings`; `None` when there is nothing to match.
    pub fn new(strings: &[String]) -> Option<StopMatcher> {
        let strings: Vec<String> = strings.iter().filter(|s| !s.is_empty()).cloned().collect();
        let longest = strings.iter().map(|s| s.len()).max()?;
        Some(StopMatcher {
            strings,
            longest,
            prefix: 0,
            read: 0,
            tail: String::new(),
        })
    }

    /// Called after each new id is appended to `generated`; true when the
    /// text of `generated` now contains a stop string.
    pub fn push(&mut self, detok: &dyn Detokenize, generated: &[u32]) -> bool {
        let before = if self.read > self.prefix {
            detok.decode(&generated[self.prefix..self.read])
        } else {
            String::new()
        };
        let after = detok.decode(&generated[self.prefix..]);
        let (new, clean) = match after.strip_prefix(before.as_str()) {
            Some(new) => (new, !new.is_empty() && !new.ends_with('\u{FFFD}')),
            // Not an extension (rare decoders): check what follows the old
            // text's length, and move on only when the window is full.
            None => (after.get(before.len()..).unwrap_or(""), false),
        };
        self.tail.push_str(new);
        let hit = self.strings.iter().any(|s| self.tail.contains(s.as_str()));
        if clean || generated.len() - self.prefix >= MAX_WINDOW {
            self.prefix = self.read;
            self.read = generated.len();
        } else {
            self.tail.truncate(self.tail.len() - new.len());
        }
        self.trim();
        hit
    }

    /// Keeps the last `longest − 1` bytes of the tail (more if that cuts a
    /// character): a stop string that ends in new text starts no earlier.
    fn trim(&mut self) {
        let keep = self.longest.saturating_sub(1);
        if self.tail.len() > keep {
            let mut cut = self.tail.len() - keep;
            while !self.tail.is_char_boundary(cut) {
                cut -= 1;
            }
            self.tail.drain(..cut);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A byte-level vocabulary: id `i` is the byte string `pieces[i]`,
    /// decoded as lossy UTF-8 of the concatenation (as GPT-2 BPE does).
    struct Bytes(Vec<Vec<u8>>);

    impl Detokenize for Bytes {
        fn decode(&self, ids: &[u32]) -> String {
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&i| self.0[i as usize].iter().copied())
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
    }

    /// A SentencePiece-like vocabulary: `▁` marks a word start and the
    /// first one of a sequence decodes without its space.
    struct Pieces(Vec<&'static str>);

    impl Detokenize for Pieces {
        fn decode(&self, ids: &[u32]) -> String {
            let s: String = ids
                .iter()
                .map(|&i| self.0[i as usize].replace('▁', " "))
                .collect();
            s.strip_prefix(' ').map(str::to_string).unwrap_or(s)
        }
    }

    fn vocab() -> Bytes {
        let mut v: Vec<Vec<u8>> = ["a", "b", "ab", "ba", " ", "END", "E", "ND", "x\n"]
            .iter()
            .map(|s| s.as_bytes().to_vec())
            .collect();
        let e = "é".as_bytes(); // 2 bytes
        let snow = "☃".as_bytes(); // 3 bytes
        v.extend([
            e[..1].to_vec(),
            e[1..].to_vec(),
            snow[..2].to_vec(),
            snow[2..].to_vec(),
        ]);
        v.push(vec![0xFF]); // never valid
        Bytes(v)
    }

    /// Index of the first token at which `rule` says stop, if any.
    fn first_stop(ids: &[u32], mut rule: impl FnMut(&[u32]) -> bool) -> Option<usize> {
        (1..=ids.len()).find(|&n| rule(&ids[..n])).map(|n| n - 1)
    }

    fn full_decode_rule<'a>(
        d: &'a dyn Detokenize,
        stops: &'a [String],
    ) -> impl FnMut(&[u32]) -> bool + 'a {
        move |ids| {
            let text = d.decode(ids);
            stops.iter().any(|s| text.contains(s.as_str()))
        }
    }

    fn incremental_rule<'a>(
        d: &'a dyn Detokenize,
        stops: &[String],
    ) -> impl FnMut(&[u32]) -> bool + 'a {
        let mut m = StopMatcher::new(stops).expect("non-empty stop strings");
        move |ids| m.push(d, ids)
    }

    #[test]
    fn stop_string_split_over_tokens_is_found_on_its_last_token() {
        let v = vocab();
        let stops = vec!["END".to_string()];
        let ids = [0, 4, 6, 7, 0]; // "a", " ", "E", "ND", "a"
        assert_eq!(first_stop(&ids, incremental_rule(&v, &stops)), Some(3));
    }

    #[test]
    fn multibyte_character_split_over_tokens_matches_once_whole() {
        let v = vocab();
        let stops = vec!["a☃".to_string()];
        let ids = [0, 11, 12, 1]; // "a", snowman's first two bytes, its last byte, "b"
        assert_eq!(first_stop(&ids, incremental_rule(&v, &stops)), Some(2));
        assert_eq!(first_stop(&ids, full_decode_rule(&v, &stops)), Some(2));
    }

    #[test]
    fn text_before_the_tail_window_is_not_matched_twice() {
        let v = vocab();
        let stops = vec!["ab".to_string(), "xyz".to_string()];
        let ids = [1, 1, 1, 1, 1, 0, 1]; // "bbbbbab"
        assert_eq!(first_stop(&ids, incremental_rule(&v, &stops)), Some(6));
    }

    #[test]
    fn sentencepiece_leading_space_is_decoded_in_context() {
        let v = Pieces(vec!["▁Hello", "▁world", "!"]);
        let stops = vec!["o w".to_string()];
        let ids = [0, 1, 2];
        assert_eq!(first_stop(&ids, incremental_rule(&v, &stops)), Some(1));
        assert_eq!(first_stop(&ids, full_decode_rule(&v, &stops)), Some(1));
    }

    #[test]
    fn no_stop_strings_means_no_matcher() {
        assert!(StopMatcher::new(&[]).is_none());
    }

    #[test]
    fn each_check_decodes_a_bounded_window() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        /// Decodes every id as "a" and remembers the longest slice it saw.
        struct Counting(AtomicUsize);
        impl Detokenize for Counting {
            fn decode(&self, ids: &[u32]) -> String {
                self.0.fetch_max(ids.len(), Ordering::Relaxed);
                ids.iter().map(|_| 'a').collect()
            }
        }
        let d = Counting(AtomicUsize::new(0));
        let mut m = StopMatcher::new(&["zz".to_string()]).expect("one stop string");
        let ids = vec![0u32; 500];
        for n in 1..=ids.len() {
            assert!(!m.push(&d, &ids[..n]));
        }
        let widest = d.0.load(Ordering::Relaxed);
        assert!(widest <= 2, "decoded {widest} ids at once");
    }

    proptest! {
        /// The matcher stops at the same token as decoding the whole output
        /// after every token would.
        #[test]
        fn incremental_matching_equals_full_decode(
            ids in proptest::collection::vec(0u32..14, 1..60),
            picks in proptest::collection::vec((0usize..200, 1usize..6), 1..3),
        ) {
            let v = vocab();
            let text = v.decode(&ids);
            let chars: Vec<char> = text.chars().collect();
            // Stop strings cut from the text itself (so they often hit), or absent ones.
            let stops: Vec<String> = picks
                .iter()
                .map(|&(start, len)| {
                    let start = start % (chars.len() + 1);
                    let s: String = chars[start..(start + len).min(chars.len())].iter().collect();
                    if s.is_empty() { "zz".to_string() } else { s }
                })
                .collect();
            prop_assert_eq!(
                first_stop(&ids, incremental_rule(&v, &stops)),
                first_stop(&ids, full_decode_rule(&v, &stops)),
                "stops {:?} in {:?}", stops, text
            );
        }
    }
}
