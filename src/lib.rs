//! # caracal
//!
//! The model side of Caracal: checkpoints, model architectures, tokenizers,
//! chat templates and tool-call formats, single-sequence generation, offline
//! converters and the memory planner. Kernels live in `caracal-kernels`, the
//! actor runtime in `caracal-actors`, media in `caracal-media`; the `caracal`
//! binary (`src/main.rs`, `src/cli/`) drives these modules.
//!
//! Modules, grouped by role:
//! - [`checkpoint`]: model files on disk: memory-mapped safetensors (single or
//!   sharded), typed tensor access, `config.json` reading ([`checkpoint::config`]),
//!   GGUF reading and import ([`checkpoint::gguf`]) and `caracal inspect`
//!   ([`checkpoint::inspect`]).
//! - [`models`]: one file per architecture, shared blocks in [`models::layers`],
//!   and [`models::load`].
//! - [`text`]: tokenizers (`tokenizer.json`, Kimi tiktoken) and the streaming
//!   detokenizer.
//! - [`chat`]: Jinja chat templates and each model's tool-call format
//!   ([`chat::toolcall`]).
//! - [`constrain`]: constrained decoding (llguidance grammars for JSON
//!   schemas and each model's tool-call format) behind a tokenizer-free
//!   `Constraint` trait.
//! - [`gateway`]: the OpenAI-compatible HTTP and WebSocket server (`caracal
//!   serve`): Chat Completions, Completions, Responses (HTTP, SSE and the
//!   WebSocket mode), Realtime, one session task per connection.
//! - [`request`]: validation of generation settings at the edge into a
//!   [`caracal_actors::messages::ValidRequest`].
//! - [`generate`]: prefill + decode of one sequence with timing.
//! - [`eval`]: perplexity on a text file.
//! - [`convert`]: offline converters (MXFP4 quantization, moeify, synthesized
//!   checkpoints, the shared safetensors writer).
//! - [`plan`]: memory plans of a model on given devices.
//! - [`units`]: sizes as written on command lines (`512MiB`, `1.5TB`).
//! - [`paths`]: Caracal's own cache folder.
//! - [`malloc`]: the `caracal` binary's allocator settings (freed activations kept).
//! - [`error`]: the crate's error enum and `Result` alias.

#![recursion_limit = "256"]

pub mod chat;
pub mod checkpoint;
pub mod constrain;
pub mod convert;
pub mod error;
pub mod eval;
pub mod gateway;
pub mod generate;
pub mod malloc;
pub mod models;
pub mod paths;
pub mod plan;
pub mod request;
pub mod text;
pub mod units;

pub use error::{Error, Result};
