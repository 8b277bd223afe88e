//! Kimi's tokenizer: tiktoken byte-level BPE from a `tiktoken.model` rank file.
//!
//! Kimi checkpoints (K2, K2.5, Kimi-Linear, K3) ship no `tokenizer.json`; their
//! `tokenization_kimi.py` builds a `tiktoken.Encoding` from:
//!
//! - `tiktoken.model`: one line per mergeable token, `base64(bytes) rank`
//!   (163,584 lines for Kimi);
//! - a pre-tokenisation regex ([`KIMI_PATTERN`]): text is cut into pieces
//!   before BPE, and no token ever spans two pieces;
//! - special tokens with ids from `num_ranks` to `num_ranks + 257`
//!   (`num_reserved_special_tokens + 2` = 258 ids), named by
//!   `tokenizer_config.json`'s `added_tokens_decoder` and otherwise
//!   `<|reserved_token_{id}|>`.
//!
//! Encoding (= `TikTokenTokenizer.encode` with `allowed_special="all"`):
//! the text is cut into 400,000-char chunks, each chunk is cut so that no
//! slice holds more than 25,000 consecutive whitespace or non-whitespace
//! chars (a tiktoken stack-depth workaround), then in each slice special
//! tokens written literally are recognised, and the text between them is
//! split by the regex and BPE-merged: starting from single bytes, the
//! adjacent pair whose concatenation has the lowest rank is merged, the
//! leftmost on ties, until no adjacent pair is a token.
//!
//! The regex runs on `fancy-regex`, the engine tiktoken itself uses; it
//! accepts the `&&` class intersections of Kimi's pattern as written.
//!
//! [`ByteStreamDecoder`] turns ids into text deltas while generating, holding
//! back the bytes of a character split across tokens.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::Path;

use base64::Engine as _;
use fancy_regex::Regex;
use rustc_hash::FxHashMap;
use serde_json::Value;

use crate::config::read_json;
use crate::error::{Error, Result};

/// Kimi's pre-tokenisation regex (`TikTokenTokenizer.pat_str`), verbatim.
///
/// Eight alternatives: Han runs; words with an optional leading
/// non-letter, a (Han-free) cased body and an English contraction suffix;
/// the same with an upper-case-led body; 1–3 digits; punctuation runs with
/// trailing newlines; whitespace ending in newlines; whitespace not followed
/// by a non-space; any whitespace.
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"\p{N}{1,3}",
    "|",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    "|",
    r"\s*[\r\n]+",
    "|",
    r"\s+(?!\S)",
    "|",
    r"\s+",
);

/// Kimi's `num_reserved_special_tokens + 2`: ids `num_ranks ..
/// num_ranks + 258` are special tokens.
pub const KIMI_NUM_SPECIAL_IDS: u32 = 258;

/// Texts are encoded in chunks of at most this many chars
/// (`TIKTOKEN_MAX_ENCODE_CHARS`); a special token spanning two chunks is
/// not recognised, exactly as upstream.
pub const MAX_ENCODE_CHARS: usize = 400_000;

/// Longest run of consecutive whitespace or non-whitespace chars encoded in
/// one piece (`MAX_NO_WHITESPACES_CHARS`).
pub const MAX_RUN_CHARS: usize = 25_000;

/// Pieces shorter than this are merged by the quadratic scan (cache
/// friendly); longer ones by the heap, which is `O(n log n)`.
const HEAP_MERGE_MIN_BYTES: usize = 128;

/// How special tokens get their ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpecialTokens {
    /// Kimi's rule: ids `num_ranks .. num_ranks + count` are all special;
    /// each is named by the config's `added_tokens_decoder` if listed there,
    /// else `<|reserved_token_{id}|>`. Config entries outside the range are
    /// ignored, as upstream.
    ReservedRange {
        /// How many ids; [`KIMI_NUM_SPECIAL_IDS`] for Kimi.
        count: u32,
    },
    /// Exactly these `(text, id)` pairs (tiktoken's OpenAI encodings), plus
    /// every `added_tokens_decoder` entry of the config, if one is given.
    Explicit(Vec<(String, u32)>),
}

/// A tiktoken-format byte-level BPE tokenizer.
pub struct TiktokenTokenizer {
    /// Token bytes → rank; the rank is the token id.
    encoder: FxHashMap<Vec<u8>, u32>,
    /// Id → bytes for ranks and special tokens; empty for unused ids.
    decoder: Vec<Vec<u8>>,
    /// Number of mergeable ranks (163,584 for Kimi).
    num_ranks: usize,
    /// Special token text → id.
    specials: FxHashMap<String, u32>,
    /// Which ids are special tokens (indexed by id, same length as `decoder`).
    is_special: Vec<bool>,
    /// The pre-tokenisation regex.
    pattern: Regex,
    /// Alternation of all special token texts, longest first; `None` if there
    /// are no specials.
    special_pattern: Option<Regex>,
}

impl std::fmt::Debug for TiktokenTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TiktokenTokenizer")
            .field("num_ranks", &self.num_ranks)
            .field("num_specials", &self.specials.len())
            .field("pattern", &self.pattern.as_str())
            .finish()
    }
}

/// Parses a tiktoken rank file (`base64 rank` per line; blank lines skipped).
pub fn parse_rank_file(text: &str, path: &Path) -> Result<FxHashMap<Vec<u8>, u32>> {
    let bad = |line: usize, detail: String| Error::BadFile {
        what: "tiktoken rank file",
        path: path.into(),
        detail: format!("line {line}: {detail}"),
    };
    let mut ranks = FxHashMap::default();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let mut parts = line.split_whitespace();
        let (Some(token), Some(rank), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad(i + 1, "expected `base64 rank`".into()));
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(token)
            .map_err(|e| bad(i + 1, format!("bad base64 `{token}`: {e}")))?;
        let rank: u32 = rank
            .parse()
            .map_err(|e| bad(i + 1, format!("bad rank `{rank}`: {e}")))?;
        if ranks.insert(bytes, rank).is_some() {
            return Err(bad(i + 1, format!("token `{token}` listed twice")));
        }
    }
    Ok(ranks)
}

/// `added_tokens_decoder` of a `tokenizer_config.json`: `(id, content)` pairs.
fn added_tokens(config: &Value, path: &Path) -> Result<Vec<(u32, String)>> {
    let bad = |detail: String| Error::BadFile {
        what: "tokenizer_config.json",
        path: path.into(),
        detail,
    };
    let Some(map) = config.get("added_tokens_decoder") else {
        return Ok(Vec::new());
    };
    let map = map
        .as_object()
        .ok_or_else(|| bad("`added_tokens_decoder` is not an object".into()))?;
    let mut out = Vec::with_capacity(map.len());
    for (id, entry) in map {
        let id: u32 = id
            .parse()
            .map_err(|_| bad(format!("added token id `{id}` is not an integer")))?;
        let content = entry
            .get("content")
            .and_then(|c| c.as_str())
            .ok_or_else(|| bad(format!("added token {id} has no string `content`")))?;
        out.push((id, content.to_string()));
    }
    Ok(out)
}

/// Python's `str.isspace`: Unicode `White_Space` plus the separators
/// U+001C..U+001F (bidi class B/S), which Rust's `char::is_whitespace` lacks.
pub fn python_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Kimi's `_split_whitespaces_or_nonwhitespaces`: cuts `s` so that no slice
/// holds more than `max_run` consecutive whitespace or non-whitespace chars.
pub fn split_long_runs(s: &str, max_run: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut run_len = 0usize;
    let mut run_is_space = s.chars().next().is_some_and(python_isspace);
    let mut slice_start = 0usize;
    for (i, c) in s.char_indices() {
        let is_space = python_isspace(c);
        if run_is_space != is_space {
            run_len = 1;
            run_is_space = is_space;
        } else {
            run_len += 1;
            if run_len > max_run {
                out.push(&s[slice_start..i]);
                slice_start = i;
                run_len = 1;
            }
        }
    }
    out.push(&s[slice_start..]);
    out
}

/// Cuts `text` into chunks of at most `max_chars` chars (the last may be shorter).
fn char_chunks(text: &str, max_chars: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0usize;
    let mut count = 0usize;
    for (i, _) in text.char_indices() {
        if count == max_chars {
            out.push(&text[start..i]);
            start = i;
            count = 0;
        }
        count += 1;
    }
    if start < text.len() || out.is_empty() {
        out.push(&text[start..]);
    }
    out
}

impl TiktokenTokenizer {
    /// A tokenizer from ranks, `(text, id)` specials and a regex.
    ///
    /// Every single byte must be a rank (byte-level BPE can then encode any
    /// text); specials must not reuse a rank's id.
    pub fn new(
        ranks: FxHashMap<Vec<u8>, u32>,
        specials: Vec<(String, u32)>,
        pattern: &str,
    ) -> Result<TiktokenTokenizer> {
        if let Some(b) = (0..=255u8).find(|b| !ranks.contains_key(&[*b][..])) {
            return Err(Error::Tokenizer(format!(
                "byte 0x{b:02x} is not a rank; a byte-level BPE needs all 256"
            )));
        }
        let num_ranks = ranks.len();
        let max_id = ranks
            .values()
            .chain(specials.iter().map(|(_, id)| id))
            .copied()
            .max()
            .unwrap_or(0) as usize;
        let mut decoder = vec![Vec::new(); max_id + 1];
        for (bytes, &rank) in &ranks {
            if !decoder[rank as usize].is_empty() {
                return Err(Error::Tokenizer(format!(
                    "rank {rank} is given to two tokens"
                )));
            }
            decoder[rank as usize] = bytes.clone();
        }
        let mut is_special = vec![false; max_id + 1];
        let mut special_map = FxHashMap::default();
        for (text, id) in specials {
            let slot = id as usize;
            if !decoder[slot].is_empty() && !is_special[slot] {
                return Err(Error::Tokenizer(format!(
                    "special token `{text}` reuses rank id {id}"
                )));
            }
            if text.is_empty() {
                return Err(Error::Tokenizer(format!(
                    "special token {id} has empty text"
                )));
            }
            decoder[slot] = text.as_bytes().to_vec();
            is_special[slot] = true;
            special_map.insert(text, id);
        }
        let pattern = Regex::new(pattern)
            .map_err(|e| Error::Tokenizer(format!("bad pre-tokenisation regex: {e}")))?;
        let special_pattern = if special_map.is_empty() {
            None
        } else {
            let mut names: Vec<&str> = special_map.keys().map(String::as_str).collect();
            // Longest first, so that of two specials starting at one place the
            // longer wins (the regex takes the first alternative that matches).
            names.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
            let alternation = names
                .iter()
                .map(|n| fancy_regex::escape(n))
                .collect::<Vec<_>>()
                .join("|");
            Some(
                Regex::new(&alternation)
                    .map_err(|e| Error::Tokenizer(format!("special token regex: {e}")))?,
            )
        };
        Ok(TiktokenTokenizer {
            encoder: ranks,
            decoder,
            num_ranks,
            specials: special_map,
            is_special,
            pattern,
            special_pattern,
        })
    }

    /// Loads a rank file, an optional `tokenizer_config.json`, a regex and
    /// the special-token rule.
    pub fn from_files(
        model: &Path,
        config: Option<&Path>,
        pattern: &str,
        specials: SpecialTokens,
    ) -> Result<TiktokenTokenizer> {
        let text = std::fs::read_to_string(model).map_err(|e| Error::io(model, e))?;
        let ranks = parse_rank_file(&text, model)?;
        let added = match config {
            Some(path) => added_tokens(&read_json(path, "tokenizer_config.json")?, path)?,
            None => Vec::new(),
        };
        let specials = match specials {
            SpecialTokens::ReservedRange { count } => {
                let first = ranks.len() as u32;
                let names: FxHashMap<u32, String> = added.into_iter().collect();
                (first..first + count)
                    .map(|id| {
                        (
                            names
                                .get(&id)
                                .cloned()
                                .unwrap_or_else(|| format!("<|reserved_token_{id}|>")),
                            id,
                        )
                    })
                    .collect()
            }
            SpecialTokens::Explicit(mut list) => {
                for (id, content) in added {
                    list.retain(|(_, i)| *i != id);
                    list.push((content, id));
                }
                list
            }
        };
        TiktokenTokenizer::new(ranks, specials, pattern)
    }

    /// Loads a Kimi checkpoint's `tiktoken.model` and `tokenizer_config.json`
    /// (if present) with Kimi's regex and 258 special ids.
    pub fn from_dir(dir: &Path) -> Result<TiktokenTokenizer> {
        let model = dir.join("tiktoken.model");
        let config = dir.join("tokenizer_config.json");
        let config = config.exists().then_some(config.as_path());
        TiktokenTokenizer::from_files(
            &model,
            config,
            KIMI_PATTERN,
            SpecialTokens::ReservedRange {
                count: KIMI_NUM_SPECIAL_IDS,
            },
        )
    }

    /// Encodes text; special tokens written in it become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        for chunk in char_chunks(text, MAX_ENCODE_CHARS) {
            for slice in split_long_runs(chunk, MAX_RUN_CHARS) {
                self.encode_slice(slice, true, &mut ids)?;
            }
        }
        Ok(ids)
    }

    /// Encodes text with special-token texts treated as plain text.
    pub fn encode_ordinary(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        for chunk in char_chunks(text, MAX_ENCODE_CHARS) {
            for slice in split_long_runs(chunk, MAX_RUN_CHARS) {
                self.encode_slice(slice, false, &mut ids)?;
            }
        }
        Ok(ids)
    }

    /// The regex pieces of `text` (no special-token handling, no run splitting).
    pub fn split(&self, text: &str) -> Result<Vec<String>> {
        self.pattern
            .find_iter(text)
            .map(|m| {
                m.map(|m| m.as_str().to_string())
                    .map_err(|e| Error::Tokenizer(format!("regex failed: {e}")))
            })
            .collect()
    }

    fn encode_slice(&self, text: &str, with_specials: bool, ids: &mut Vec<u32>) -> Result<()> {
        let special_pattern = if with_specials {
            self.special_pattern.as_ref()
        } else {
            None
        };
        let Some(special_pattern) = special_pattern else {
            return self.encode_plain(text, ids);
        };
        let mut start = 0usize;
        for m in special_pattern.find_iter(text) {
            let m = m.map_err(|e| Error::Tokenizer(format!("special token regex failed: {e}")))?;
            self.encode_plain(&text[start..m.start()], ids)?;
            ids.push(self.specials[m.as_str()]);
            start = m.end();
        }
        self.encode_plain(&text[start..], ids)
    }

    fn encode_plain(&self, text: &str, ids: &mut Vec<u32>) -> Result<()> {
        for m in self.pattern.find_iter(text) {
            let piece = m
                .map_err(|e| Error::Tokenizer(format!("pre-tokenisation regex failed: {e}")))?
                .as_str()
                .as_bytes();
            match self.encoder.get(piece) {
                Some(&id) => ids.push(id),
                None => self.bpe(piece, ids),
            }
        }
        Ok(())
    }

    /// The rank of a byte string, if it is a token.
    fn rank(&self, bytes: &[u8]) -> Option<u32> {
        self.encoder.get(bytes).copied()
    }

    /// BPE-merges one piece and appends its ids.
    fn bpe(&self, piece: &[u8], ids: &mut Vec<u32>) {
        let bounds = if piece.len() < HEAP_MERGE_MIN_BYTES {
            self.merge_scan(piece)
        } else {
            self.merge_heap(piece)
        };
        ids.extend(bounds.windows(2).map(|w| {
            self.rank(&piece[w[0]..w[1]])
                .expect("merging only ever forms spans that are ranks")
        }));
    }

    /// Token boundaries of `piece` (`[0, .., len]`) by repeatedly merging the
    /// lowest-ranked adjacent pair, rescanning all pairs each time (tiktoken's
    /// `_byte_pair_merge`): `O(n·merges)`, fast for short pieces.
    fn merge_scan(&self, piece: &[u8]) -> Vec<usize> {
        let mut starts: Vec<usize> = (0..=piece.len()).collect();
        // pair_rank[i]: rank of the span starts[i]..starts[i + 2].
        let pair = |starts: &[usize], i: usize| -> u32 {
            if i + 2 < starts.len() {
                self.rank(&piece[starts[i]..starts[i + 2]])
                    .unwrap_or(u32::MAX)
            } else {
                u32::MAX
            }
        };
        let mut pair_rank: Vec<u32> = (0..starts.len()).map(|i| pair(&starts, i)).collect();
        loop {
            let (best, &rank) = pair_rank
                .iter()
                .enumerate()
                .min_by_key(|&(i, r)| (*r, i))
                .expect("there is always the end boundary");
            if rank == u32::MAX {
                break;
            }
            starts.remove(best + 1);
            pair_rank.remove(best + 1);
            pair_rank[best] = pair(&starts, best);
            if best > 0 {
                pair_rank[best - 1] = pair(&starts, best - 1);
            }
        }
        starts
    }

    /// The same merge order as [`Self::merge_scan`] with a min-heap of
    /// candidate pairs keyed `(rank, start)` and a linked list of parts:
    /// `O(n log n)`, for long pieces.
    fn merge_heap(&self, piece: &[u8]) -> Vec<usize> {
        let n = piece.len();
        // Part starting at byte i (if alive) ends at end[i]; prev[i] is the previous part's start.
        let mut end: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::new();
        for i in 0..n.saturating_sub(1) {
            if let Some(r) = self.rank(&piece[i..i + 2]) {
                heap.push(Reverse((r, i, i + 2)));
            }
        }
        while let Some(Reverse((_, s, pair_end))) = heap.pop() {
            // Stale unless s is alive and its pair with the next part still spans s..pair_end.
            if !alive[s] || end[s] >= n || end[end[s]] != pair_end {
                continue;
            }
            let mid = end[s];
            alive[mid] = false;
            end[s] = pair_end;
            if pair_end < n {
                prev[pair_end] = s;
                if let Some(r) = self.rank(&piece[s..end[pair_end]]) {
                    heap.push(Reverse((r, s, end[pair_end])));
                }
            }
            if s > 0 {
                let p = prev[s];
                if let Some(r) = self.rank(&piece[p..pair_end]) {
                    heap.push(Reverse((r, p, pair_end)));
                }
            }
        }
        let mut bounds = vec![0];
        let mut i = 0;
        while i < n {
            i = end[i];
            bounds.push(i);
        }
        bounds
    }

    /// The bytes of `ids` concatenated; special tokens give their text, ids
    /// that are neither a rank nor a special are skipped.
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            if let Some(bytes) = self.decoder.get(id as usize) {
                out.extend_from_slice(bytes);
            }
        }
        out
    }

    /// Like [`Self::decode_bytes`], but an unknown id is an error naming it.
    pub fn try_decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        if let Some(&bad) = ids.iter().find(|&&id| self.token_bytes(id).is_none()) {
            return Err(Error::Tokenizer(format!(
                "id {bad} is not in the vocabulary (size {})",
                self.vocab_size()
            )));
        }
        Ok(self.decode_bytes(ids))
    }

    /// Decodes to text; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids)).into_owned()
    }

    /// The bytes of one id (`None` if unused).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.decoder
            .get(id as usize)
            .filter(|b| !b.is_empty())
            .map(Vec::as_slice)
    }

    /// The id of a special token's text, or of a string that is exactly one rank.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.specials
            .get(token)
            .copied()
            .or_else(|| self.rank(token.as_bytes()))
    }

    /// Whether `id` is a special token.
    pub fn is_special(&self, id: u32) -> bool {
        self.is_special.get(id as usize).copied().unwrap_or(false)
    }

    /// Special token texts and their ids, in no particular order.
    pub fn special_tokens(&self) -> impl Iterator<Item = (&str, u32)> {
        self.specials.iter().map(|(k, &v)| (k.as_str(), v))
    }

    /// Number of mergeable ranks (the base vocabulary).
    pub fn num_ranks(&self) -> usize {
        self.num_ranks
    }

    /// One past the highest id (ranks + specials; 163,842 for Kimi, whose
    /// model `vocab_size` of 163,840 leaves the last two specials unused).
    pub fn vocab_size(&self) -> usize {
        self.decoder.len()
    }
}

/// Incremental ids → text that never emits part of a multi-byte character.
///
/// Bytes of an incomplete UTF-8 sequence at the end are held back until the
/// next token completes them; invalid bytes are replaced by U+FFFD as soon as
/// they are known to be invalid. The concatenated output equals
/// `String::from_utf8_lossy` of all the bytes.
#[derive(Debug, Default, Clone)]
pub struct ByteStreamDecoder {
    /// Bytes received but not yet emitted (at most an incomplete character).
    pending: Vec<u8>,
}

impl ByteStreamDecoder {
    /// A decoder with nothing pending.
    pub fn new() -> ByteStreamDecoder {
        ByteStreamDecoder::default()
    }

    /// Adds the bytes of `id`; returns the text that is now complete.
    pub fn push(&mut self, tokenizer: &TiktokenTokenizer, id: u32) -> String {
        self.push_bytes(tokenizer.token_bytes(id).unwrap_or(&[]))
    }

    /// Adds raw bytes; returns the text that is now complete.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    out.push_str(
                        std::str::from_utf8(valid).expect("valid_up_to marks a valid prefix"),
                    );
                    match e.error_len() {
                        // Invalid sequence: replace it, as from_utf8_lossy does, and go on.
                        Some(len) => {
                            out.push('\u{FFFD}');
                            rest = &after[len..];
                        }
                        // Incomplete sequence at the end: hold it back.
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// Whether bytes are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Ends the stream: held-back bytes come out lossily (U+FFFD).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
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

    /// A deterministic byte generator (64-bit LCG), biased to a few letters so merges happen.
    fn pseudo_bytes(seed: &mut u64, len: usize, alphabet: &[u8]) -> Vec<u8> {
        (0..len)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                alphabet[((*seed >> 33) as usize) % alphabet.len()]
            })
            .collect()
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("caracal-tiktoken-{tag}-{}", std::process::id()));
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
            0x9, 0xa, 0xb, 0xc, 0xd, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0, 0x1680, 0x2000,
            0x2001, 0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a, 0x2028,
            0x2029, 0x202f, 0x205f, 0x3000,
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
        let mut seed = 7u64;
        for len in [2usize, 3, 5, 8, 17, 64, 127, 128, 200, 513] {
            for _ in 0..20 {
                let piece = pseudo_bytes(&mut seed, len, b"aab");
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
        let mut seed = 11u64;
        for len in [2usize, 7, 33, 99, 150, 400] {
            for alphabet in [
                &b"abcde fgh"[..],
                b"     \n",
                b"0123456789",
                "éà中🦀".as_bytes(),
            ] {
                let piece = pseudo_bytes(&mut seed, len, alphabet);
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
        let tok = TiktokenTokenizer::from_files(
            &path,
            None,
            CL100K_PATTERN,
            SpecialTokens::Explicit(vec![]),
        )
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
        let tok = TiktokenTokenizer::from_files(
            &path,
            None,
            CL100K_PATTERN,
            SpecialTokens::Explicit(vec![]),
        )
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
        let mut seed = 3u64;
        let alphabet: Vec<u8> = [
            b'a', 0x80, 0xbf, 0xc3, 0xa9, 0xe4, 0xb8, 0xad, 0xf0, 0x9f, 0xa6, 0x80, 0xff,
        ]
        .to_vec();
        for len in [1usize, 2, 5, 16, 64] {
            for _ in 0..50 {
                let bytes = pseudo_bytes(&mut seed, len, &alphabet);
                let mut dec = ByteStreamDecoder::new();
                let mut out = String::new();
                let mut i = 0;
                while i < bytes.len() {
                    let step = 1 + (pseudo_bytes(&mut seed, 1, &[0, 1, 2])[0] as usize);
                    let end = (i + step).min(bytes.len());
                    out.push_str(&dec.push_bytes(&bytes[i..end]));
                    i = end;
                }
                out.push_str(&dec.finish());
                assert_eq!(out, String::from_utf8_lossy(&bytes), "{bytes:x?}");
            }
        }
    }
}
