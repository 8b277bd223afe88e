//! Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Kimi Linear's NoPE MLA).
//!
//! The cache keeps only `RMSNorm(c_kv)` and the (rotated) shared `k_pe` per
//! token: `kv_lora_rank + qk_rope_head_dim` values, shared by all heads.
//! Attention runs in the absorbed form: queries are projected into the
//! latent space with `W_UK`, and the latent output is expanded by `W_UV`.
//!
//! Kimi K3 adds an optional sigmoid output gate (`mla_use_output_gate`):
//! `out ← out ⊙ σ(g_proj(x))` on the per-head outputs `[heads·v]`, before
//! `o_proj`, where `x` is the layer's (normed) input (Moonshot's
//! `KimiMLAAttention`; reference doc §1.4).

use caracal_kernels::activation::sigmoid;
use caracal_kernels::mla::{
    mla_attention_absorbed, mla_decode_attention_batch, write_latent, MlaAbsorbed, MlaShape,
};
use caracal_kernels::paged::KvPool;
use caracal_kernels::rope::{Rope, RopePairs};
use caracal_kernels::Matrix;

use super::{BatchLayout, RmsNorm};
use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// How queries are produced.
pub enum QueryProj {
    /// `q_proj` straight from the hidden state (`q_lora_rank: null`).
    Direct(Matrix),
    /// `q_b_proj(RMSNorm(q_a_proj(x)))`.
    LowRank {
        /// `[q_lora_rank, hidden]`.
        q_a_proj: Matrix,
        /// Norm on the query latent.
        q_a_layernorm: RmsNorm,
        /// `[heads·(nope+rope), q_lora_rank]`.
        q_b_proj: Matrix,
    },
}

/// Settings that differ between MLA users.
pub struct MlaOptions {
    /// `q_lora_rank`; `None` for a direct `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// eps of `q_a_layernorm` / `kv_a_layernorm` (transformers builds them with 1e-6).
    pub latent_norm_eps: f32,
    /// Softmax scale (`qk_head_dim^-0.5`, times YaRN's mscale² where it applies).
    pub scale: f32,
    /// Rotate adjacent pairs (transformers' `rope_interleave`, DeepSeek's
    /// layout) instead of first/second halves.
    pub rope_interleave: bool,
}

/// One MLA layer.
pub struct MlaAttention {
    /// Query projection.
    pub q: QueryProj,
    /// `[kv_lora_rank + rope, hidden]`.
    pub kv_a_proj_with_mqa: Matrix,
    /// Norm on `c_kv`.
    pub kv_a_layernorm: RmsNorm,
    /// `kv_b_proj` split into `W_UK` / `W_UV` for the absorbed form.
    pub absorbed: MlaAbsorbed,
    /// `[hidden, heads·v]`.
    pub o_proj: Matrix,
    /// K3's output gate `[heads·v, hidden]` (`None`: ungated).
    pub g_proj: Option<Matrix>,
    /// Head sizes.
    pub shape: MlaShape,
    /// Softmax scale.
    pub scale: f32,
    /// Adjacent-pair RoPE (see [`MlaOptions::rope_interleave`]).
    pub rope_interleave: bool,
    /// Index among the pool's KV layers.
    pub kv_layer: usize,
}

impl MlaAttention {
    /// Loads `{prefix}.*` (DeepSeek names).
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        hidden: usize,
        shape: MlaShape,
        opts: &MlaOptions,
        kv_layer: usize,
    ) -> Result<MlaAttention> {
        let h = shape.heads;
        let qk = shape.nope_dim + shape.rope_dim;
        let r = shape.kv_lora_rank;
        let q = match opts.q_lora_rank {
            None => QueryProj::Direct(ckpt.matrix(
                &format!("{prefix}.q_proj.weight"),
                h * qk,
                hidden,
            )?),
            Some(rank) => QueryProj::LowRank {
                q_a_proj: ckpt.matrix(&format!("{prefix}.q_a_proj.weight"), rank, hidden)?,
                q_a_layernorm: RmsNorm::load(
                    ckpt,
                    &format!("{prefix}.q_a_layernorm.weight"),
                    rank,
                    opts.latent_norm_eps,
                )?,
                q_b_proj: ckpt.matrix(&format!("{prefix}.q_b_proj.weight"), h * qk, rank)?,
            },
        };
        let kv_b = ckpt.tensor_f32(
            &format!("{prefix}.kv_b_proj.weight"),
            &[h * (shape.nope_dim + shape.v_dim), r],
        )?;
        Ok(MlaAttention {
            q,
            kv_a_proj_with_mqa: ckpt.matrix(
                &format!("{prefix}.kv_a_proj_with_mqa.weight"),
                r + shape.rope_dim,
                hidden,
            )?,
            kv_a_layernorm: RmsNorm::load(
                ckpt,
                &format!("{prefix}.kv_a_layernorm.weight"),
                r,
                opts.latent_norm_eps,
            )?,
            absorbed: MlaAbsorbed::from_kv_b(&kv_b, &shape)?,
            o_proj: ckpt.matrix(&format!("{prefix}.o_proj.weight"), hidden, h * shape.v_dim)?,
            g_proj: None,
            shape,
            scale: opts.scale,
            rope_interleave: opts.rope_interleave,
            kv_layer,
        })
    }

    /// Attention over `x`; `rope` is `None` for NoPE models. Returns the
    /// per-head outputs `[rows, heads·v]` before `o_proj`, so that callers
    /// can gate them.
    pub fn attend(
        &self,
        x: &[f32],
        layout: &BatchLayout,
        rope: Option<&Rope>,
        cache: &mut KvPool,
    ) -> Vec<f32> {
        let s = &self.shape;
        let (h, nope, dr, r) = (s.heads, s.nope_dim, s.rope_dim, s.kv_lora_rank);
        let qk = nope + dr;
        let n = layout.rows;
        let q = match &self.q {
            QueryProj::Direct(m) => m.forward(x),
            QueryProj::LowRank {
                q_a_proj,
                q_a_layernorm,
                q_b_proj,
            } => q_b_proj.forward(&q_a_layernorm.forward(&q_a_proj.forward(x))),
        };
        // Split queries into the no-position part and the rotary part.
        let mut q_nope = vec![0.0; n * h * nope];
        let mut q_pe = vec![0.0; n * h * dr];
        for t in 0..n {
            for hh in 0..h {
                let src = &q[(t * h + hh) * qk..(t * h + hh + 1) * qk];
                q_nope[(t * h + hh) * nope..(t * h + hh + 1) * nope].copy_from_slice(&src[..nope]);
                q_pe[(t * h + hh) * dr..(t * h + hh + 1) * dr].copy_from_slice(&src[nope..]);
            }
        }
        let ckv = self.kv_a_proj_with_mqa.forward(x);
        let mut c = vec![0.0; n * r];
        let mut k_pe = vec![0.0; n * dr];
        for t in 0..n {
            c[t * r..(t + 1) * r].copy_from_slice(&ckv[t * (r + dr)..t * (r + dr) + r]);
            k_pe[t * dr..(t + 1) * dr].copy_from_slice(&ckv[t * (r + dr) + r..(t + 1) * (r + dr)]);
        }
        let c = self.kv_a_layernorm.forward(&c);
        if let Some(rope) = rope {
            let table = layout.rope_table(rope);
            let pairs = if self.rope_interleave {
                RopePairs::Adjacent
            } else {
                RopePairs::Half
            };
            rope.rotate_with(&mut q_pe, table, pairs, h, dr, 0);
            rope.rotate_with(&mut k_pe, table, pairs, 1, dr, 0);
        }
        let ow = h * s.v_dim;
        let mut out = vec![0.0; n * ow];
        for sl in &layout.seqs {
            let rr = sl.row..sl.row + sl.len;
            write_latent(
                cache,
                self.kv_layer,
                &sl.block_table,
                sl.start_pos,
                &c[rr.start * r..rr.end * r],
                &k_pe[rr.start * dr..rr.end * dr],
                s,
            );
        }
        // Every decoding sequence (one new token) in one call; prefill
        // chunks one sequence at a time.
        let decode = layout.decode_seqs();
        if !decode.is_empty() {
            mla_decode_attention_batch(
                &q_nope,
                &q_pe,
                cache,
                self.kv_layer,
                &decode,
                &self.absorbed,
                s,
                self.scale,
                &mut out,
            );
        }
        for sl in layout.seqs.iter().filter(|sl| sl.len > 1) {
            let rr = sl.row..sl.row + sl.len;
            mla_attention_absorbed(
                &q_nope[rr.start * h * nope..rr.end * h * nope],
                &q_pe[rr.start * h * dr..rr.end * h * dr],
                cache,
                self.kv_layer,
                &sl.block_table,
                sl.start_pos,
                &self.absorbed,
                s,
                self.scale,
                &mut out[rr.start * ow..rr.end * ow],
            );
        }
        out
    }

    /// Adds K3's sigmoid output gate, loading `{prefix}.g_proj.weight`
    /// `[heads·v, hidden]`.
    pub fn with_output_gate(
        mut self,
        ckpt: &Checkpoint,
        prefix: &str,
        hidden: usize,
    ) -> Result<MlaAttention> {
        self.g_proj = Some(ckpt.matrix(
            &format!("{prefix}.g_proj.weight"),
            self.shape.heads * self.shape.v_dim,
            hidden,
        )?);
        Ok(self)
    }

    /// Attention, the output gate if any, then `o_proj`.
    pub fn forward(
        &self,
        x: &[f32],
        layout: &BatchLayout,
        rope: Option<&Rope>,
        cache: &mut KvPool,
    ) -> Vec<f32> {
        let mut out = self.attend(x, layout, rope, cache);
        if let Some(g_proj) = &self.g_proj {
            let gate = g_proj.forward(x);
            for (o, g) in out.iter_mut().zip(&gate) {
                *o *= sigmoid(*g);
            }
        }
        self.o_proj.forward(&out)
    }
}
