//! Rebuilds a Hugging Face `tokenizer.json` (and `tokenizer_config.json`) from a GGUF
//! file's `tokenizer.ggml.*` keys.
//!
//! Only `tokenizer.ggml.model = gpt2` (byte-level BPE) is handled. The GGUF stores the
//! byte-level vocabulary (`tokens`, id = position), the BPE `merges` (`"a b"`, rank =
//! position) and a `token_type` per token (llama.cpp's `llama_token_type`: 1 normal,
//! 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte). The output is what the
//! checked Python converter of `shared/reference/offline-models.md` Appendix A writes:
//! - a BPE model with that vocab and merges (merges as `[left, right]` pairs);
//! - control tokens (type 3) as special added tokens, user-defined ones (type 4) as
//!   non-special added tokens (SmolLM2 has none of the latter);
//! - pre-tokenizer: for `tokenizer.ggml.pre = smollm`, `Sequence[Digits(individual),
//!   ByteLevel(add_prefix_space=false, use_regex=true)]`, which is what llama.cpp's
//!   `smollm` pre-type does; otherwise plain `ByteLevel` (the GPT-2 regex). A `pre`
//!   other than `gpt-2`/`default`/`smollm` has its own regex in llama.cpp that is not
//!   reproduced, so it is reported as a warning;
//! - ByteLevel post-processor and decoder.

use std::collections::{HashMap, HashSet};

use serde::ser::{Serialize, SerializeMap, Serializer};
use serde::Serialize as DeriveSerialize;
use serde_json::json;

use super::reader::GgufFile;
use super::{GgufError, Result};

/// llama.cpp's token type for control (special) tokens.
const TOKEN_TYPE_CONTROL: i64 = 3;
/// llama.cpp's token type for user-defined added tokens.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Token ids of the special roles, from `tokenizer.ggml.*_token_id` (ids outside the
/// vocabulary are dropped with a warning).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecialTokenIds {
    /// Beginning of sequence.
    pub bos: Option<u32>,
    /// End of sequence (ends generation).
    pub eos: Option<u32>,
    /// Unknown token.
    pub unk: Option<u32>,
    /// Padding.
    pub pad: Option<u32>,
}

/// The rebuilt tokenizer files, serialised, and what was noticed on the way.
#[derive(Debug, Clone)]
pub struct HfTokenizerFiles {
    /// Contents of `tokenizer.json`.
    pub tokenizer_json: String,
    /// Contents of `tokenizer_config.json`.
    pub tokenizer_config: String,
    /// Special token ids (also used for `config.json` / `generation_config.json`).
    pub special: SpecialTokenIds,
    /// Number of tokens in the vocabulary.
    pub vocab_size: usize,
    /// Things that could make the rebuilt tokenizer differ from llama.cpp's.
    pub warnings: Vec<String>,
}

/// Reads the special token ids, warning about any outside `0..vocab_size`.
pub fn special_token_ids(
    file: &GgufFile,
    vocab_size: usize,
    warnings: &mut Vec<String>,
) -> SpecialTokenIds {
    let mut get = |role: &str| {
        let key = format!("tokenizer.ggml.{role}_token_id");
        let id = file.get_u64(&key)?;
        if (id as usize) < vocab_size {
            Some(id as u32)
        } else {
            warnings.push(format!(
                "{key} = {id} is outside the vocabulary of {vocab_size}; dropped"
            ));
            None
        }
    };
    SpecialTokenIds {
        bos: get("bos"),
        eos: get("eos"),
        unk: get("unknown"),
        pad: get("padding"),
    }
}

/// Builds `tokenizer.json` and `tokenizer_config.json` for a `gpt2`-model GGUF.
///
/// `model_max_length` goes into `tokenizer_config.json` (the context length).
pub fn build_hf_tokenizer(
    file: &GgufFile,
    model_max_length: Option<u64>,
) -> Result<HfTokenizerFiles> {
    let model = file.require_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(GgufError::UnsupportedTokenizer(model.to_string()));
    }
    let tokens = file
        .get_str_array("tokenizer.ggml.tokens")
        .ok_or_else(|| GgufError::MissingKey("tokenizer.ggml.tokens (string array)".into()))?;
    let merges_raw = file
        .get_str_array("tokenizer.ggml.merges")
        .ok_or_else(|| GgufError::MissingKey("tokenizer.ggml.merges (string array)".into()))?;
    let types = match file.get_i64_array("tokenizer.ggml.token_type") {
        Some(t) if t.len() == tokens.len() => t,
        Some(t) => {
            return Err(GgufError::BadTokenizer(format!(
                "{} token types for {} tokens",
                t.len(),
                tokens.len()
            )))
        }
        None => vec![1; tokens.len()],
    };
    let merges = merges_raw
        .iter()
        .map(|m| {
            m.split_once(' ')
                .ok_or_else(|| GgufError::BadTokenizer(format!("merge {m:?} has no space")))
        })
        .collect::<Result<Vec<(&str, &str)>>>()?;

    let mut warnings = Vec::new();
    let pre = file.get_str("tokenizer.ggml.pre");
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre_tokenizer = match pre {
        Some("smollm") => json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level],
        }),
        None | Some("gpt-2") | Some("default") => byte_level,
        Some(other) => {
            warnings.push(format!(
                "tokenizer.ggml.pre = {other:?}: llama.cpp's pre-tokenizer regex for it is not reproduced; \
                 used plain ByteLevel (GPT-2 regex)"
            ));
            byte_level
        }
    };
    let mut seen = HashSet::new();
    let duplicates = tokens.iter().filter(|t| !seen.insert(**t)).count();
    if duplicates > 0 {
        warnings.push(format!(
            "{duplicates} duplicate token strings; the last id of each is kept"
        ));
    }

    let added_tokens: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, &t))| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED)
        .map(|(id, (content, &t))| AddedToken {
            id,
            content,
            single_word: false,
            lstrip: false,
            rstrip: false,
            normalized: false,
            special: t == TOKEN_TYPE_CONTROL,
        })
        .collect();

    let tj = TokenizerJson {
        version: "1.0",
        truncation: None,
        padding: None,
        added_tokens,
        normalizer: None,
        pre_tokenizer,
        post_processor: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true}),
        decoder: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        model: BpeModel {
            kind: "BPE",
            dropout: None,
            unk_token: None,
            continuing_subword_prefix: None,
            end_of_word_suffix: None,
            fuse_unk: false,
            byte_fallback: false,
            ignore_merges: false,
            vocab: OrderedVocab(&tokens),
            merges,
        },
    };
    let tokenizer_json = serde_json::to_string(&tj)?;

    let special = special_token_ids(file, tokens.len(), &mut warnings);
    let name = |id: Option<u32>| id.map(|i| tokens[i as usize].to_string());
    let cfg = TokenizerConfig {
        bos_token: name(special.bos),
        eos_token: name(special.eos),
        unk_token: name(special.unk),
        pad_token: name(special.pad),
        add_bos_token: file
            .get_bool("tokenizer.ggml.add_bos_token")
            .unwrap_or(false),
        add_eos_token: file
            .get_bool("tokenizer.ggml.add_eos_token")
            .unwrap_or(false),
        chat_template: file.get_str("tokenizer.chat_template").map(str::to_string),
        model_max_length,
        tokenizer_class: "GPT2Tokenizer",
    };
    let tokenizer_config = serde_json::to_string_pretty(&cfg)?;
    Ok(HfTokenizerFiles {
        tokenizer_json,
        tokenizer_config,
        special,
        vocab_size: tokens.len(),
        warnings,
    })
}

/// `tokenizer.json` top level, in the field order HF writes. The field names of this
/// and the following serde structs are the HF `tokenizers` JSON keys.
#[derive(DeriveSerialize)]
struct TokenizerJson<'a> {
    version: &'static str,
    truncation: Option<()>,
    padding: Option<()>,
    added_tokens: Vec<AddedToken<'a>>,
    normalizer: Option<()>,
    pre_tokenizer: serde_json::Value,
    post_processor: serde_json::Value,
    decoder: serde_json::Value,
    model: BpeModel<'a>,
}

/// One entry of `added_tokens`.
#[derive(DeriveSerialize)]
struct AddedToken<'a> {
    id: usize,
    content: &'a str,
    single_word: bool,
    lstrip: bool,
    rstrip: bool,
    normalized: bool,
    special: bool,
}

/// The `model` object of a BPE tokenizer.
#[derive(DeriveSerialize)]
struct BpeModel<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    dropout: Option<f32>,
    unk_token: Option<&'a str>,
    continuing_subword_prefix: Option<&'a str>,
    end_of_word_suffix: Option<&'a str>,
    fuse_unk: bool,
    byte_fallback: bool,
    ignore_merges: bool,
    vocab: OrderedVocab<'a>,
    merges: Vec<(&'a str, &'a str)>,
}

/// The vocab as a JSON object in id order. A token string listed twice keeps its
/// first position and its last id, as a Python dict built by `{t: i for i, t in …}`.
struct OrderedVocab<'a>(&'a [&'a str]);

impl Serialize for OrderedVocab<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let last: HashMap<&str, usize> = self.0.iter().enumerate().map(|(i, t)| (*t, i)).collect();
        let mut map = serializer.serialize_map(Some(last.len()))?;
        let mut written = HashSet::with_capacity(last.len());
        for t in self.0 {
            if written.insert(*t) {
                map.serialize_entry(t, &last[t])?;
            }
        }
        map.end()
    }
}

/// `tokenizer_config.json`.
#[derive(DeriveSerialize)]
struct TokenizerConfig {
    bos_token: Option<String>,
    eos_token: Option<String>,
    unk_token: Option<String>,
    pad_token: Option<String>,
    add_bos_token: bool,
    add_eos_token: bool,
    chat_template: Option<String>,
    model_max_length: Option<u64>,
    tokenizer_class: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::gguf::reader::GgufValue;
    use crate::checkpoint::gguf::test_writer::{temp_path, tiny_tokenizer, GgufWriter};

    fn build(pre: &str) -> (HfTokenizerFiles, tokenizers::Tokenizer) {
        let mut w = GgufWriter::new(3);
        tiny_tokenizer(&mut w, pre);
        let path = temp_path(&format!("tok-{pre}.gguf"));
        w.write(&path);
        let f = GgufFile::open(&path).expect("opens");
        let files = build_hf_tokenizer(&f, Some(128)).expect("builds");
        std::fs::remove_file(&path).ok();
        let tok = tokenizers::Tokenizer::from_bytes(files.tokenizer_json.as_bytes())
            .expect("tokenizers loads it");
        (files, tok)
    }

    fn ids(tok: &tokenizers::Tokenizer, s: &str) -> Vec<u32> {
        tok.encode(s, false).expect("encodes").get_ids().to_vec()
    }

    #[test]
    fn rebuilt_bpe_applies_merges_by_rank_and_keeps_specials_whole() {
        let (files, tok) = build("gpt-2");
        assert!(files.warnings.is_empty(), "{:?}", files.warnings);
        // "ab" merges; " ab" -> [Ġ, a, b]: rank 0 (a b) wins over rank 1 (Ġ a)
        assert_eq!(ids(&tok, "ab"), vec![8]);
        assert_eq!(ids(&tok, " ab"), vec![5, 8]);
        assert_eq!(ids(&tok, " a"), vec![9]);
        // without the Digits split, "12" merges
        assert_eq!(ids(&tok, "12"), vec![10]);
        assert_eq!(ids(&tok, "<|im_start|>ab<|im_end|>"), vec![1, 8, 2]);
        assert_eq!(
            tok.decode(&[1, 8, 5, 8], false).expect("decodes"),
            "<|im_start|>ab ab"
        );
        assert_eq!(tok.decode(&[1, 8, 5, 8], true).expect("decodes"), "ab ab");
    }

    #[test]
    fn smollm_pre_tokenizer_splits_digits_individually() {
        let (files, tok) = build("smollm");
        assert!(files.warnings.is_empty(), "{:?}", files.warnings);
        assert_eq!(ids(&tok, "12"), vec![6, 7]);
        assert_eq!(ids(&tok, "ab12"), vec![8, 6, 7]);
    }

    #[test]
    fn unknown_pre_type_falls_back_to_byte_level_with_warning() {
        let (files, tok) = build("llama-bpe");
        assert_eq!(files.warnings.len(), 1, "{:?}", files.warnings);
        assert!(files.warnings[0].contains("llama-bpe"));
        assert_eq!(ids(&tok, "ab"), vec![8]);
    }

    #[test]
    fn tokenizer_config_names_special_tokens_and_template() {
        let (files, _) = build("smollm");
        assert_eq!(
            files.special,
            SpecialTokenIds {
                bos: Some(1),
                eos: Some(2),
                unk: Some(0),
                pad: Some(2)
            }
        );
        let cfg: serde_json::Value = serde_json::from_str(&files.tokenizer_config).expect("json");
        assert_eq!(cfg["bos_token"], "<|im_start|>");
        assert_eq!(cfg["eos_token"], "<|im_end|>");
        assert_eq!(cfg["pad_token"], "<|im_end|>");
        assert_eq!(cfg["unk_token"], "<|endoftext|>");
        assert_eq!(cfg["add_bos_token"], false);
        assert_eq!(cfg["chat_template"], "{{ messages }}");
        assert_eq!(cfg["model_max_length"], 128);
        let tj: serde_json::Value = serde_json::from_str(&files.tokenizer_json).expect("json");
        assert_eq!(tj["added_tokens"].as_array().expect("array").len(), 3);
        assert_eq!(tj["model"]["merges"][1], json!(["Ġ", "a"]));
        assert_eq!(tj["model"]["vocab"]["Ġa"], 9);
    }

    #[test]
    fn non_gpt2_tokenizers_are_refused() {
        let mut w = GgufWriter::new(3);
        w.kv("tokenizer.ggml.model", GgufValue::String("llama".into()));
        let path = temp_path("tok-spm.gguf");
        w.write(&path);
        let f = GgufFile::open(&path).expect("opens");
        assert!(
            matches!(build_hf_tokenizer(&f, None), Err(GgufError::UnsupportedTokenizer(m)) if m == "llama")
        );
        std::fs::remove_file(&path).ok();
    }
}
