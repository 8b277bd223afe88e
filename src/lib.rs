//! # caracal
//!
//! The model side of Caracal: checkpoint loading, model architectures,
//! tokenizers and chat templates, single-sequence generation, and the CLI.
//! Kernels live in `caracal-kernels`, actors in `caracal-actors`, media in
//! `caracal-media`.
//!
//! Modules:
//! - [`checkpoint`]: memory-mapped safetensors (single or sharded) and typed tensor access.
//! - [`config`]: `config.json` / `generation_config.json` reading, RoPE settings.
//! - [`models`]: one file per architecture and the [`models::CausalLm`] trait.
//! - [`tokenizer`]: `tokenizer.json` wrapper and streaming detokenizer.
//! - [`chat`]: Jinja chat templates.
//! - [`generate`]: prefill + decode of one sequence with timing.
//! - [`gguf`]: GGUF reading, dequantisation and import to a checkpoint folder.
//! - [`gateway`]: the OpenAI-compatible HTTP and WebSocket server (`caracal serve`).
//!
//! The `caracal` binary (`src/main.rs`, `src/cli/`) drives these modules.

#![recursion_limit = "256"]

pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod export;
pub mod gateway;
pub mod generate;
pub mod gguf;
pub mod models;
pub mod request;
pub mod tokenizer;

pub use error::{Error, Result};
pub mod eval;
pub mod inspect;
pub mod moeify;
pub mod plan;
pub mod quantize;
pub mod synth;
pub mod tiktoken;
pub mod toolcall;
