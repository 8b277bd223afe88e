//! Offline conversion: checkpoints in, checkpoints out. Nothing here runs
//! while serving. (GGUF import lives with the GGUF reader in
//! [`crate::checkpoint::gguf`].)
//!
//! - [`quantize`]: rewrite a checkpoint's weights to MXFP4 (and Q8_0 token tables).
//! - [`moeify`]: turn a dense checkpoint into an MoE one (for tests and timing).
//! - [`synth`]: synthesize random-weight checkpoints in a published layout
//!   (the embedded default model).
//! - [`export`]: the safetensors-writing helpers the three writers share.

pub mod export;
pub mod moeify;
pub mod quantize;
pub mod synth;
