//! Text ↔ token ids for a checkpoint, and streaming detokenisation.
//!
//! [`TextTokenizer`] wraps a Hugging Face `tokenizer.json` (the `tokenizers`
//! crate) together with what `tokenizer_config.json` adds: the chat template
//! and the BOS/EOS strings. [`StreamDecoder`] turns a growing list of ids into
//! text deltas without ever emitting half of a multi-byte character.

use std::path::Path;

use serde_json::Value;

use crate::config::read_json;
use crate::error::{Error, Result};

/// A checkpoint's tokenizer and its configuration.
pub struct TextTokenizer {
    /// The byte-level BPE (or other) model from `tokenizer.json`.
    inner: tokenizers::Tokenizer,
    /// Jinja chat template, if the checkpoint ships one.
    pub chat_template: Option<String>,
    /// BOS string for templates that reference `bos_token`.
    pub bos_token: Option<String>,
    /// EOS string for templates that reference `eos_token`.
    pub eos_token: Option<String>,
    /// Whether plain prompts get a BOS id prepended.
    pub add_bos: bool,
}

fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    }
}

impl TextTokenizer {
    /// Loads `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja` if present).
    pub fn from_dir(dir: &Path) -> Result<TextTokenizer> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(Error::io(&path, std::io::Error::new(std::io::ErrorKind::NotFound, "tokenizer.json is missing")));
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = if cfg_path.exists() { read_json(&cfg_path, "tokenizer_config.json")? } else { Value::Null };
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
            chat_template = Some(std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?);
        }
        Ok(TextTokenizer {
            inner,
            chat_template,
            bos_token: token_string(cfg.get("bos_token")),
            eos_token: token_string(cfg.get("eos_token")),
            add_bos: cfg.get("add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false),
        })
    }

    /// Encodes text; special tokens written in the text are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        if self.add_bos {
            if let Some(bos) = self.bos_token.as_deref().and_then(|b| self.inner.token_to_id(b)) {
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
            }
        }
        Ok(ids)
    }

    /// Encodes a rendered chat prompt (the template already placed BOS).
    pub fn encode_chat(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text, keeping special tokens unless `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// The id of a token string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// Incremental detokenizer: emits text only once its bytes are complete.
///
/// It decodes a short window of ids (from `prefix` to the end) and emits the
/// part beyond what the window already produced, the way vLLM's incremental
/// detokenizer does; a trailing U+FFFD (an incomplete UTF-8 sequence) is held
/// back until the next id completes it.
#[derive(Default)]
pub struct StreamDecoder {
    /// Every id seen so far.
    ids: Vec<u32>,
    /// Start of the window whose text was already emitted up to `read`.
    prefix: usize,
    /// End of the emitted part of the window.
    read: usize,
}

impl StreamDecoder {
    /// A decoder with no ids yet.
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Adds one id; returns the new complete text, if any.
    pub fn push(&mut self, tok: &TextTokenizer, id: u32, skip_special: bool) -> Result<String> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read], skip_special)?;
        let after = tok.decode(&self.ids[self.prefix..], skip_special)?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') && after.starts_with(&before) {
            let delta = after[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Text still held back (an incomplete character at the end of a stream).
    pub fn flush(&mut self, tok: &TextTokenizer, skip_special: bool) -> Result<String> {
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
