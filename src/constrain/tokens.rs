//! [`TokenEnv`]: the token trie llguidance walks to compute masks, built
//! once per model from either tokenizer kind Caracal loads.
//!
//! - `tokenizer.json`: toktrie_hf_tokenizers' byte entry point
//!   (`ByteTokenizer::from_json_bytes`) recovers each token's bytes from the
//!   byte-level or byte-fallback vocabulary; added special tokens become
//!   llguidance special tokens.
//! - Kimi tiktoken ranks: each rank's bytes as stored, each special token as
//!   llguidance's special-token entry (the `0xFF` marker byte followed by
//!   its text, so grammar text can never match it and `<|open|>` in a
//!   grammar names it).
//!
//! Either way the vocabulary can be padded to the model's logits width
//! (`n_vocab`); padded ids are never allowed. The end-of-sequence set is
//! what ends a grammar: the chat turn's end token(s).

use std::path::Path;
use std::sync::Arc;

use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

use super::CompileError;
use crate::text::tokenizer::TextTokenizer;

/// The token trie of one model's vocabulary, shared by all its requests.
#[derive(Clone)]
pub struct TokenEnv {
    /// llguidance's view of the tokenizer.
    env: TokEnv,
    /// Tokens that end the sequence (the first is the trie's primary EOS).
    eos: Vec<u32>,
}

impl std::fmt::Debug for TokenEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenEnv")
            .field("vocab_size", &self.vocab_size())
            .field("eos", &self.eos)
            .finish()
    }
}

/// Kimi's tiktoken vocabulary as a llguidance tokenizer environment.
struct TiktokenEnv {
    /// Trie over each id's bytes.
    trie: TokTrie,
    /// The tokenizer, for canonical BPE of forced text.
    tokenizer: Arc<TextTokenizer>,
}

impl TokenizerEnv for TiktokenEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            match self
                .tokenizer
                .as_tiktoken()
                .map(|t| t.encode_ordinary(text))
            {
                Some(Ok(ids)) => ids,
                // Text the BPE refuses is tokenised greedily over the trie.
                _ => self.trie.greedy_tokenize(text.as_bytes()),
            }
        })
    }
}

/// Pads `words` with never-matching special entries up to `n_vocab`.
fn pad_vocab(words: &mut Vec<Vec<u8>>, n_vocab: Option<usize>) {
    let Some(n) = n_vocab else { return };
    if n < words.len() {
        // A model narrower than its tokenizer (Kimi: 163,840 logits, 163,842
        // ids): the ids past the logits can never be sampled, so cut them.
        words.truncate(n);
    }
    while words.len() < n {
        let mut name = format!(".<[{}]>", words.len()).into_bytes();
        name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
        words.push(name);
    }
}

impl TokenEnv {
    /// From a `tokenizer.json`'s bytes. `eos` are the tokens that end a
    /// sequence (non-empty); `n_vocab` pads or cuts the vocabulary to the
    /// model's logits width.
    pub fn from_hf_json(
        json: &[u8],
        eos: &[u32],
        n_vocab: Option<usize>,
    ) -> Result<TokenEnv, CompileError> {
        let mut bt = toktrie_hf_tokenizers::ByteTokenizer::from_json_bytes(json)
            .map_err(|e| CompileError::Tokenizer(e.to_string()))?;
        let size = bt.tokrx_info().vocab_size as usize;
        let padded = match n_vocab {
            Some(n) if n < size => {
                return Err(CompileError::Tokenizer(format!(
                    "the model's vocabulary of {n} is narrower than the tokenizer's {size}"
                )))
            }
            other => other,
        };
        check_eos(eos, size)?;
        bt.set_eos_tokens(eos);
        // The HF tokenizer stays inside toktrie_hf_tokenizers' env, which
        // tokenises forced text with it.
        let env = toktrie_hf_tokenizers::ByteTokenizerEnv::new(bt, padded)
            .map_err(|e| CompileError::Tokenizer(e.to_string()))?;
        Ok(TokenEnv {
            env: env.to_env(),
            eos: eos.to_vec(),
        })
    }

    /// From Kimi's tiktoken tokenizer (`tokenizer.as_tiktoken()` must be
    /// `Some`): every id's bytes, special tokens included.
    pub fn from_tiktoken(
        tokenizer: Arc<TextTokenizer>,
        eos: &[u32],
        n_vocab: Option<usize>,
    ) -> Result<TokenEnv, CompileError> {
        let tik = tokenizer.as_tiktoken().ok_or_else(|| {
            CompileError::Tokenizer(format!(
                "a tiktoken token trie needs the tiktoken backend, not {}",
                tokenizer.backend_name()
            ))
        })?;
        let mut words: Vec<Vec<u8>> = (0..tik.vocab_size() as u32)
            .map(|id| match tik.token_bytes(id) {
                Some(b) if tik.is_special(id) => {
                    let mut w = Vec::with_capacity(b.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(b);
                    w
                }
                Some(b) => b.to_vec(),
                // An unused id: a special entry no grammar names.
                None => {
                    let mut name = format!(".<[{id}]>").into_bytes();
                    name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
                    name
                }
            })
            .collect();
        pad_vocab(&mut words, n_vocab);
        check_eos(eos, words.len())?;
        let info = TokRxInfo {
            vocab_size: words.len() as u32,
            tok_eos: eos[0],
            tok_bos: None,
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(eos);
        }
        Ok(TokenEnv {
            env: Arc::new(TiktokenEnv { trie, tokenizer }),
            eos: eos.to_vec(),
        })
    }

    /// From a checkpoint folder: its `tokenizer.json` or tiktoken files,
    /// ending sequences with the tokenizer config's `eos_token`.
    pub fn load(
        dir: &Path,
        tokenizer: Arc<TextTokenizer>,
        n_vocab: Option<usize>,
    ) -> Result<TokenEnv, CompileError> {
        let eos = tokenizer
            .eos_token
            .as_deref()
            .and_then(|t| tokenizer.token_to_id(t))
            .ok_or_else(|| {
                CompileError::Tokenizer(format!(
                    "{}: tokenizer_config.json names no eos_token the vocabulary has",
                    dir.display()
                ))
            })?;
        if tokenizer.as_tiktoken().is_some() {
            return TokenEnv::from_tiktoken(tokenizer, &[eos], n_vocab);
        }
        let path = dir.join("tokenizer.json");
        let json = std::fs::read(&path)
            .map_err(|e| CompileError::Tokenizer(format!("{}: {e}", path.display())))?;
        TokenEnv::from_hf_json(&json, &[eos], n_vocab)
    }

    /// llguidance's environment.
    pub fn tok_env(&self) -> &TokEnv {
        &self.env
    }

    /// The token trie.
    pub fn trie(&self) -> &TokTrie {
        self.env.tok_trie()
    }

    /// Number of token ids masks cover.
    pub fn vocab_size(&self) -> usize {
        self.trie().vocab_size()
    }

    /// Tokens that end a sequence.
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    /// The id of a special token by its text (`<|open|>`), if the
    /// vocabulary has it as a special token.
    pub fn special_token(&self, text: &str) -> Option<u32> {
        self.trie().get_special_token(text)
    }

    /// The bytes of `tokens` as text bytes, special tokens as their text.
    pub fn decode(&self, tokens: &[u32]) -> Vec<u8> {
        self.trie().decode_ext(tokens, true)
    }

    /// Tokenises text the way the model's tokenizer does.
    pub fn tokenize(&self, text: &str) -> Vec<u32> {
        self.env.tokenize_bytes(text.as_bytes())
    }
}

fn check_eos(eos: &[u32], size: usize) -> Result<(), CompileError> {
    if eos.is_empty() {
        return Err(CompileError::Tokenizer(
            "at least one end-of-sequence token is needed".into(),
        ));
    }
    if let Some(bad) = eos.iter().find(|&&t| t as usize >= size) {
        return Err(CompileError::Tokenizer(format!(
            "end-of-sequence token {bad} is outside the vocabulary of {size}"
        )));
    }
    Ok(())
}
