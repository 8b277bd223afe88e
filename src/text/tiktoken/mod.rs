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

use crate::checkpoint::config::read_json;
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
mod tests;
