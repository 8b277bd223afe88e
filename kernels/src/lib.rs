//! # caracal-kernels
//!
//! The numeric floor of Caracal: weight storage and dtypes, and every tensor
//! operation the models use. Nothing here knows about checkpoints, tokenizers
//! or actors; model files in `caracal::models` call these functions top-down.
//!
//! Conventions shared by every kernel:
//! - Activations are `f32`, row-major, one token per row (`[tokens, width]`).
//! - A linear layer's weight is a [`Matrix`] of shape `[out, in]` exactly as
//!   checkpoints store it, and [`Matrix::matmul`] computes `y = x · Wᵀ`.
//! - Weights stay in their stored dtype (f32, bf16, MXFP4 blocks); kernels
//!   convert on the fly and never expand a whole matrix.
//! - Work is spread over the rayon pool (both cores here); SIMD paths are
//!   chosen at run time from the features [`cpu`] detects once, and always
//!   have a portable fallback that is also their test oracle.
//!
//! Modules:
//! - [`cpu`]: CPU feature detection and the [`cpu::Isa`] builds of kernels.
//! - [`amx`]: Intel AMX tiles (detection, permission, configuration) for the
//!   int8 panel GEMMs.
//! - [`dtype`]: bf16 conversion helpers and the [`DType`] tag.
//! - [`matrix`]: [`Matrix`], a weight in its stored dtype, and its matmul.
//! - [`gemm`]: f32 / bf16 GEMV and GEMM.
//! - [`norm`], [`rope`], [`activation`], [`softmax`]: elementwise and row ops.
//! - [`attention`]: causal GQA attention over a paged KV layout.
//! - [`mla`]: multi-head latent attention with the compressed latent cache.
//! - [`kda`]: Kimi Delta Attention (recurrent and chunked) and short convs.
//! - [`moe`]: MoE routing (softmax/sigmoid scores, bias, grouped top-k).
//! - [`mxfp4`]: OCP MXFP4 encode/decode and fused matmuls on packed blocks.
//! - [`paged`]: the page pool that backs KV caches.
//! - [`sampling`]: next-token sampling (penalties, temperature, top-k/p, min-p).
//! - [`testing`]: the deterministic generator of test and bench data.

pub mod activation;
pub mod amx;
pub mod attention;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dtype;
pub mod error;
pub mod flash;
pub mod gemm;
mod int8_rows;
pub mod kda;
pub mod matrix;
pub mod mla;
pub mod moe;
pub mod mxfp4;
pub mod norm;
pub mod paged;
pub mod q8;
pub mod rope;
pub mod sampling;
mod simd;
pub mod softmax;
mod split;
pub mod testing;
pub mod threads;

pub use dtype::DType;
pub use error::{Error, Result};
pub use matrix::{Matrix, Storage};
pub use q8::Activations;
