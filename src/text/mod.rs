//! Text ↔ token ids: the tokenizer a checkpoint ships and the streaming
//! detokenizer.
//!
//! - [`tokenizer`]: [`tokenizer::TextTokenizer`] over a Hugging Face
//!   `tokenizer.json` or Kimi's tiktoken files, and the streaming detokenizer.
//! - [`tiktoken`]: Kimi's `tiktoken.model` BPE with the special tokens of
//!   `tokenizer_config.json`.

pub mod tiktoken;
pub mod tokenizer;
