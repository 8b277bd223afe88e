//! Text ↔ token ids for a checkpoint, and streaming detokenisation.
//!
//! [`TextTokenizer`] wraps one of two backends, chosen by the files of the
//! checkpoint folder:
//!
//! - a Hugging Face `tokenizer.json` (the `tokenizers` crate), for Llama,
//!   DeepSeek and every converted checkpoint;
//! - Kimi's tiktoken format, `tiktoken.model` (a BPE rank file) plus the
//!   special tokens of `tokenizer_config.json`
//!   ([`crate::text::tiktoken::TiktokenTokenizer`]), which is what Kimi K2, K2.5,
//!   Kimi-Linear and K3 ship.
//!
//! `tokenizer.json` wins when a folder has both. Either way
//! `tokenizer_config.json` adds the chat template and the BOS/EOS strings,
//! and [`TextTokenizer::chat_format`] says how chat prompts are rendered: the
//! Jinja template if there is one, else Kimi K3's XTML format
//! ([`crate::chat::toolcall::render_k3`]) or Kimi K2's ([`crate::chat::toolcall::render_k2`]),
//! recognised by `config.json`'s `model_type` or by the specials the
//! tokenizer registers.
//!
//! [`StreamDecoder`] turns a growing list of ids into text deltas without
//! ever emitting half of a multi-byte character: on the tiktoken backend it
//! holds back the bytes of an incomplete UTF-8 sequence
//! ([`crate::text::tiktoken::ByteStreamDecoder`]); on the HF backend it re-decodes
//! a short window and holds back a trailing U+FFFD.

use std::path::Path;

use serde_json::Value;

use crate::checkpoint::config::read_json;
use crate::error::{Error, Result};
use crate::text::tiktoken::{ByteStreamDecoder, TiktokenTokenizer};

/// Special tokens whose presence marks Kimi K3's XTML chat format.
const K3_MARKERS: [&str; 3] = ["<|open|>", "<|sep|>", "<|end_of_msg|>"];

/// Special tokens whose presence marks Kimi K2's chat format.
const K2_MARKERS: [&str; 3] = ["<|im_user|>", "<|im_assistant|>", "<|im_middle|>"];

/// The tokenizer implementation behind a [`TextTokenizer`].
enum Backend {
    /// The byte-level BPE (or other) model of a `tokenizer.json`.
    Hf(Box<tokenizers::Tokenizer>),
    /// Kimi's `tiktoken.model` with its reserved special ids.
    Tiktoken(Box<TiktokenTokenizer>),
}

/// How a chat conversation becomes prompt text for this checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatFormat {
    /// Render with this Jinja template ([`crate::chat::render`]).
    Jinja(String),
    /// Kimi K3's XTML format ([`crate::chat::toolcall::render_k3`]); K3 ships no
    /// Jinja template, its renderer is Python (`encoding_k3.py`).
    KimiK3,
    /// Kimi K2's `<|im_user|>…<|im_middle|>…<|im_end|>` format
    /// ([`crate::chat::toolcall::render_k2`]), for Kimi folders without a template.
    KimiK2,
}

/// A checkpoint's tokenizer and its configuration.
pub struct TextTokenizer {
    /// The tokenizer proper.
    backend: Backend,
    /// `model_type` of the folder's `config.json`, if any: tells Kimi K3
    /// folders (no template) from the rest.
    model_type: Option<String>,
    /// Jinja chat template, if the checkpoint ships one.
    pub chat_template: Option<String>,
    /// BOS string for templates that reference `bos_token`.
    pub bos_token: Option<String>,
    /// EOS string for templates that reference `eos_token`.
    pub eos_token: Option<String>,
    /// Whether plain prompts get a BOS id prepended.
    pub add_bos: bool,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("backend", &self.backend_name())
            .field("vocab_size", &self.vocab_size())
            .field("model_type", &self.model_type)
            .field("has_chat_template", &self.chat_template.is_some())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("add_bos", &self.add_bos)
            .finish()
    }
}

fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    }
}

impl TextTokenizer {
    /// Whether `dir` holds a tokenizer this type can load (`tokenizer.json`
    /// or `tiktoken.model`).
    pub fn exists_in(dir: &Path) -> bool {
        dir.join("tokenizer.json").exists() || dir.join("tiktoken.model").exists()
    }

    /// Loads `tokenizer.json` or else `tiktoken.model`, plus
    /// `tokenizer_config.json` and `chat_template.jinja` if present.
    pub fn from_dir(dir: &Path) -> Result<TextTokenizer> {
        let hf_path = dir.join("tokenizer.json");
        let tiktoken_path = dir.join("tiktoken.model");
        let backend = if hf_path.exists() {
            let inner = tokenizers::Tokenizer::from_file(&hf_path)
                .map_err(|e| Error::Tokenizer(format!("{}: {e}", hf_path.display())))?;
            Backend::Hf(Box::new(inner))
        } else if tiktoken_path.exists() {
            Backend::Tiktoken(Box::new(TiktokenTokenizer::from_dir(dir)?))
        } else {
            return Err(Error::io(
                &hf_path,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "neither tokenizer.json nor tiktoken.model is present",
                ),
            ));
        };
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = if cfg_path.exists() {
            read_json(&cfg_path, "tokenizer_config.json")?
        } else {
            Value::Null
        };
        let mut chat_template = match cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: take "default".
            Some(Value::Array(a)) => a
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template").and_then(|s| s.as_str()).map(String::from)),
            _ => None,
        };
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            chat_template =
                Some(std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?);
        }
        let model_cfg = dir.join("config.json");
        let model_type = if model_cfg.exists() {
            read_json(&model_cfg, "config.json")?
                .get("model_type")
                .and_then(|v| v.as_str())
                .map(String::from)
        } else {
            None
        };
        Ok(TextTokenizer {
            backend,
            model_type,
            chat_template,
            bos_token: token_string(cfg.get("bos_token")),
            eos_token: token_string(cfg.get("eos_token")),
            add_bos: cfg
                .get("add_bos_token")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
        })
    }

    /// `"tokenizer.json"` or `"tiktoken"`: which backend is in use.
    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            Backend::Hf(_) => "tokenizer.json",
            Backend::Tiktoken(_) => "tiktoken",
        }
    }

    /// The Kimi tiktoken tokenizer, when that is the backend.
    pub fn as_tiktoken(&self) -> Option<&TiktokenTokenizer> {
        match &self.backend {
            Backend::Tiktoken(t) => Some(t.as_ref()),
            Backend::Hf(_) => None,
        }
    }

    /// Encodes without BOS handling; special tokens in the text are recognised.
    fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        match &self.backend {
            Backend::Hf(t) => Ok(t
                .encode(text, false)
                .map_err(|e| Error::Tokenizer(e.to_string()))?
                .get_ids()
                .to_vec()),
            Backend::Tiktoken(t) => t.encode(text),
        }
    }

    /// Encodes text; special tokens written in the text are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode_raw(text)?;
        if self.add_bos {
            if let Some(bos) = self.bos_token.as_deref().and_then(|b| self.token_to_id(b)) {
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
            }
        }
        Ok(ids)
    }

    /// Encodes a rendered chat prompt (the template already placed BOS).
    pub fn encode_chat(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_raw(text)
    }

    /// Decodes ids to text, keeping special tokens unless `skip_special`.
    /// Invalid UTF-8 (a character cut at the end) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        match &self.backend {
            Backend::Hf(t) => t
                .decode(ids, skip_special)
                .map_err(|e| Error::Tokenizer(e.to_string())),
            Backend::Tiktoken(t) => {
                if skip_special {
                    let kept: Vec<u32> = ids
                        .iter()
                        .copied()
                        .filter(|&id| !t.is_special(id))
                        .collect();
                    Ok(t.decode(&kept))
                } else {
                    Ok(t.decode(ids))
                }
            }
        }
    }

    /// The id of a token string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.backend {
            Backend::Hf(t) => t.token_to_id(token),
            Backend::Tiktoken(t) => t.token_to_id(token),
        }
    }

    /// The bytes of one token as the model emits it: tiktoken ranks
    /// directly; for `tokenizer.json`, byte-level BPE pieces mapped back
    /// through GPT-2's byte↔unicode table, `<0xNN>` byte-fallback pieces as
    /// their byte, SentencePiece `▁` as a space, added tokens as their text.
    /// `None` for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        match &self.backend {
            Backend::Tiktoken(t) => t.token_bytes(id).map(<[u8]>::to_vec),
            Backend::Hf(t) => {
                let piece = t.id_to_token(id)?;
                let added = t.get_added_vocabulary().get_vocab().contains_key(&piece);
                let byte_level = matches!(
                    t.get_decoder(),
                    Some(tokenizers::DecoderWrapper::ByteLevel(_))
                );
                Some(piece_bytes(&piece, added, byte_level))
            }
        }
    }

    /// Whether `id` is a special (control) token of the tiktoken backend or
    /// an added special token of `tokenizer.json`.
    pub fn is_special(&self, id: u32) -> bool {
        match &self.backend {
            Backend::Hf(t) => t
                .get_added_vocabulary()
                .is_special_token(&t.id_to_token(id).unwrap_or_default()),
            Backend::Tiktoken(t) => t.is_special(id),
        }
    }

    /// Vocabulary size including added/special tokens (Kimi's tiktoken:
    /// 163,842, two more than the model's `vocab_size`).
    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::Hf(t) => t.get_vocab_size(true),
            Backend::Tiktoken(t) => t.vocab_size(),
        }
    }

    /// How chat prompts are rendered: the Jinja template when the folder has
    /// one; else Kimi K3's format for a `kimi_k3` folder or a tokenizer with
    /// K3's specials (`<|open|>`, `<|sep|>`, `<|end_of_msg|>`); else Kimi
    /// K2's for a `kimi_k2`/`kimi_k25` folder or a tokenizer with K2's
    /// specials; `None` when none applies.
    pub fn chat_format(&self) -> Option<ChatFormat> {
        if let Some(t) = &self.chat_template {
            return Some(ChatFormat::Jinja(t.clone()));
        }
        let has_all = |names: &[&str]| {
            names
                .iter()
                .all(|n| self.token_to_id(n).is_some_and(|id| self.is_special(id)))
        };
        match self.model_type.as_deref() {
            Some("kimi_k3") => return Some(ChatFormat::KimiK3),
            Some("kimi_k2" | "kimi_k25") => return Some(ChatFormat::KimiK2),
            _ => {}
        }
        if has_all(&K3_MARKERS) {
            Some(ChatFormat::KimiK3)
        } else if has_all(&K2_MARKERS) {
            Some(ChatFormat::KimiK2)
        } else {
            None
        }
    }
}

/// Incremental detokenizer: emits text only once its bytes are complete.
///
/// Tiktoken backend: token bytes are appended and complete UTF-8 is emitted,
/// an incomplete trailing sequence is held back. HF backend: it decodes a
/// short window of ids (from `prefix` to the end) and emits the part beyond
/// what the window already produced, the way vLLM's incremental detokenizer
/// does; a trailing U+FFFD (an incomplete UTF-8 sequence) is held back until
/// the next id completes it. Use one decoder with one tokenizer.
#[derive(Default)]
pub struct StreamDecoder {
    /// Every id seen so far (HF backend).
    ids: Vec<u32>,
    /// Start of the window whose text was already emitted up to `read` (HF backend).
    prefix: usize,
    /// End of the emitted part of the window (HF backend).
    read: usize,
    /// Bytes of an incomplete character (tiktoken backend).
    bytes: ByteStreamDecoder,
}

impl StreamDecoder {
    /// A decoder with no ids yet.
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Adds one id; returns the new complete text, if any.
    pub fn push(&mut self, tok: &TextTokenizer, id: u32, skip_special: bool) -> Result<String> {
        if let Backend::Tiktoken(t) = &tok.backend {
            if skip_special && t.is_special(id) {
                return Ok(String::new());
            }
            return Ok(self.bytes.push(t, id));
        }
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read], skip_special)?;
        let after = tok.decode(&self.ids[self.prefix..], skip_special)?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') && after.starts_with(&before)
        {
            let delta = after[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Text still held back (an incomplete character at the end of a stream),
    /// with U+FFFD for bytes that never formed a character.
    pub fn flush(&mut self, tok: &TextTokenizer, skip_special: bool) -> Result<String> {
        if let Backend::Tiktoken(_) = &tok.backend {
            return Ok(self.bytes.finish());
        }
        let before = tok.decode(&self.ids[self.prefix..self.read], skip_special)?;
        let after = tok.decode(&self.ids[self.prefix..], skip_special)?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(after.get(before.len()..).unwrap_or("").to_string())
    }
}

impl caracal_actors::engine::Detokenize for TextTokenizer {
    fn decode(&self, ids: &[u32]) -> String {
        TextTokenizer::decode(self, ids, true).unwrap_or_default()
    }
}

/// The bytes of a `tokenizer.json` piece (see [`TextTokenizer::token_bytes`]).
fn piece_bytes(piece: &str, added: bool, byte_level: bool) -> Vec<u8> {
    if added {
        return piece.as_bytes().to_vec();
    }
    if let Some(hex) = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
        if let Ok(b) = u8::from_str_radix(hex, 16) {
            if hex.len() == 2 {
                return vec![b];
            }
        }
    }
    if byte_level {
        let mapped: Option<Vec<u8>> = piece.chars().map(byte_of_unicode).collect();
        if let Some(b) = mapped {
            return b;
        }
    }
    piece.replace('\u{2581}', " ").into_bytes()
}

/// The byte GPT-2's byte-level BPE writes as `c`: printable Latin-1 bytes
/// stand for themselves, the other 68 bytes for U+0100 onwards in order.
fn byte_of_unicode(c: char) -> Option<u8> {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let cp = c as u32;
    if printable(cp) {
        return Some(cp as u8);
    }
    let n = cp.checked_sub(0x100)?;
    (0u32..=255)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .map(|b| b as u8)
}

#[cfg(test)]
mod tests {

    #[test]
    fn byte_level_pieces_map_back_to_their_bytes() {
        assert_eq!(piece_bytes("\u{120}hello", false, true), b" hello");
        assert_eq!(piece_bytes("\u{10A}", false, true), b"\n");
        assert_eq!(piece_bytes("<0xE2>", false, false), vec![0xE2]);
        assert_eq!(piece_bytes("\u{2581}the", false, false), b" the");
        assert_eq!(piece_bytes("<|im_end|>", true, true), b"<|im_end|>");
        // Every byte has exactly one character.
        let all: Vec<u8> = (0u32..=255)
            .map(|b| {
                let printable = (0x21..=0x7E).contains(&b)
                    || (0xA1..=0xAC).contains(&b)
                    || (0xAE..=0xFF).contains(&b);
                let n = (0..b)
                    .filter(|&x| {
                        !((0x21..=0x7E).contains(&x)
                            || (0xA1..=0xAC).contains(&x)
                            || (0xAE..=0xFF).contains(&x))
                    })
                    .count() as u32;
                let c = if printable {
                    char::from_u32(b).unwrap()
                } else {
                    char::from_u32(0x100 + n).unwrap()
                };
                byte_of_unicode(c).unwrap()
            })
            .collect();
        assert_eq!(all, (0u8..=255).collect::<Vec<_>>());
    }
    use super::*;
    use std::path::PathBuf;

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    }

    /// A tiktoken folder with 256 byte ranks, a few merges and Kimi K3's
    /// named specials at 163584 + k (ids beyond the ranks are sparse).
    fn tiny_tiktoken_dir(tag: &str) -> PathBuf {
        use base64::Engine;
        let dir = std::env::temp_dir().join(format!("caracal-tok-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir is writable");
        let mut lines = String::new();
        let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for extra in [
            "he", "ll", "hell", "hello", " w", "or", " wor", "ld", " world",
        ] {
            tokens.push(extra.as_bytes().to_vec());
        }
        for (rank, t) in tokens.iter().enumerate() {
            lines.push_str(&format!(
                "{} {rank}\n",
                base64::engine::general_purpose::STANDARD.encode(t)
            ));
        }
        std::fs::write(dir.join("tiktoken.model"), lines).expect("write rank file");
        let first = tokens.len() as u32;
        let cfg = serde_json::json!({
            "added_tokens_decoder": {
                (first + 2).to_string(): {"content": "<|end_of_msg|>", "special": true},
                (first + 3).to_string(): {"content": "<|open|>", "special": true},
                (first + 4).to_string(): {"content": "<|close|>", "special": true},
                (first + 5).to_string(): {"content": "<|sep|>", "special": true},
            },
            "eos_token": "<|end_of_msg|>",
        });
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).expect("write config");
        dir
    }

    #[test]
    fn hf_backend_round_trips_and_streams_split_characters() {
        let tok = TextTokenizer::from_dir(&fixture("tiny-llama")).expect("fixture loads");
        assert_eq!(tok.backend_name(), "tokenizer.json");
        let text = "héllo 世界 🦀!";
        let ids = tok.encode(text).expect("encode");
        assert_eq!(tok.decode(&ids, true).expect("decode"), text);
        let mut dec = StreamDecoder::new();
        let mut out = String::new();
        for &id in &ids {
            let delta = dec.push(&tok, id, true).expect("push");
            assert!(
                !delta.contains('\u{FFFD}'),
                "delta {delta:?} holds a replacement char"
            );
            out.push_str(&delta);
        }
        out.push_str(&dec.flush(&tok, true).expect("flush"));
        assert_eq!(out, text);
    }

    #[test]
    fn tiktoken_backend_is_chosen_without_tokenizer_json() {
        let dir = tiny_tiktoken_dir("choose");
        let tok = TextTokenizer::from_dir(&dir).expect("loads");
        assert_eq!(tok.backend_name(), "tiktoken");
        assert!(tok.as_tiktoken().is_some());
        // 265 ranks + Kimi's 258 reserved special ids.
        assert_eq!(tok.vocab_size(), 265 + 258);
        let ids = tok.encode("hello world").expect("encode");
        assert_eq!(ids, vec![259, 264]);
        assert_eq!(tok.token_to_id("<|end_of_msg|>"), Some(267));
        assert_eq!(tok.eos_token.as_deref(), Some("<|end_of_msg|>"));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn tiktoken_decode_skips_specials_only_when_asked() {
        let dir = tiny_tiktoken_dir("skip");
        let tok = TextTokenizer::from_dir(&dir).expect("loads");
        let ids = tok.encode("<|open|>hello<|end_of_msg|>").expect("encode");
        assert_eq!(ids, vec![268, 259, 267]);
        assert_eq!(
            tok.decode(&ids, false).expect("decode"),
            "<|open|>hello<|end_of_msg|>"
        );
        assert_eq!(tok.decode(&ids, true).expect("decode"), "hello");
        assert!(tok.is_special(267) && !tok.is_special(259));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn tiktoken_stream_never_emits_half_a_character() {
        let dir = tiny_tiktoken_dir("stream");
        let tok = TextTokenizer::from_dir(&dir).expect("loads");
        // Every non-ASCII char here is split into single-byte tokens.
        let text = "hello wörld 世界 🦀<|end_of_msg|>";
        let ids = tok.encode(text).expect("encode");
        let mut dec = StreamDecoder::new();
        let mut out = String::new();
        let mut held_back = 0;
        for &id in &ids {
            let delta = dec.push(&tok, id, false).expect("push");
            assert!(
                !delta.contains('\u{FFFD}'),
                "delta {delta:?} holds a replacement char"
            );
            held_back += usize::from(delta.is_empty());
            out.push_str(&delta);
        }
        out.push_str(&dec.flush(&tok, false).expect("flush"));
        assert_eq!(out, text);
        assert!(
            held_back >= 6,
            "split characters were held back ({held_back} empty deltas)"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn chat_format_prefers_template_then_kimi_specials() {
        let dir = tiny_tiktoken_dir("format");
        let tok = TextTokenizer::from_dir(&dir).expect("loads");
        assert_eq!(tok.chat_format(), Some(ChatFormat::KimiK3));
        std::fs::write(dir.join("chat_template.jinja"), "{{ messages }}").expect("write template");
        let tok = TextTokenizer::from_dir(&dir).expect("loads");
        assert_eq!(
            tok.chat_format(),
            Some(ChatFormat::Jinja("{{ messages }}".into()))
        );
        std::fs::remove_dir_all(&dir).ok();
        // A tokenizer.json folder with a template keeps it.
        let llama = TextTokenizer::from_dir(&fixture("tiny-llama")).expect("fixture loads");
        assert!(matches!(llama.chat_format(), Some(ChatFormat::Jinja(_))));
    }

    #[test]
    fn k3_model_type_selects_k3_format_without_specials() {
        let dir = tiny_tiktoken_dir("mtype");
        std::fs::write(dir.join("tokenizer_config.json"), "{}").expect("write config");
        let tok = TextTokenizer::from_dir(&dir).expect("loads");
        assert_eq!(tok.chat_format(), None);
        std::fs::write(dir.join("config.json"), r#"{"model_type": "kimi_k3"}"#)
            .expect("write config");
        let tok = TextTokenizer::from_dir(&dir).expect("loads");
        assert_eq!(tok.chat_format(), Some(ChatFormat::KimiK3));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn missing_tokenizer_names_both_files() {
        let dir = std::env::temp_dir().join(format!("caracal-tok-none-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        assert!(!TextTokenizer::exists_in(&dir));
        let err = TextTokenizer::from_dir(&dir)
            .expect_err("no tokenizer")
            .to_string();
        assert!(
            err.contains("tiktoken.model") && err.contains("tokenizer.json"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
