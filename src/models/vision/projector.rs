//! The projector from merged tower patches to LM input rows (reference
//! `kimi-architecture.md` §3.2):
//! - K2.5 `patchmerger`: `pre_norm` LayerNorm(d) on each of the `k²` patch
//!   vectors of a merged cell, concat → `proj.0` Linear(k²d → k²d) → GELU →
//!   `proj.2` Linear(k²d → text), with biases (transformers
//!   `Kimi_K25MultimodalProjection`: `pre_norm`, `in_proj`, `out_proj`);
//! - K3 `patchmergerv2`: no pre-norm, both linears without biases, then
//!   RMSNorm(text) `post_norm`.

use caracal_kernels::activation;

use super::{pick, Linear, Norm};
use crate::checkpoint::arch::vision::{Gelu, ProjectorKind, VisionConfig};
use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// A loaded projector.
pub struct Projector {
    /// LayerNorm over the tower width before the concat (patchmerger).
    pre_norm: Option<Norm>,
    /// `proj.0`: merged width → merged width.
    proj0: Linear,
    /// `proj.2`: merged width → text width.
    proj2: Linear,
    /// RMSNorm over the text width (patchmergerv2).
    post_norm: Option<Norm>,
    /// Between the two linears.
    act: Gelu,
    /// Tower width (the pre-norm's).
    dim: usize,
}

impl Projector {
    /// Loads `mm_projector.*` (or transformers' `model.mm_projector.pre_norm`).
    pub fn load(ckpt: &Checkpoint, cfg: &VisionConfig) -> Result<Projector> {
        let (d, t) = (cfg.hidden, cfg.text_hidden);
        let merged = d * cfg.merge * cfg.merge;
        let v2 = cfg.projector == ProjectorKind::PatchMergerV2;
        let pre_norm = if v2 {
            None
        } else {
            let p = pick(
                ckpt,
                &["mm_projector.pre_norm", "model.mm_projector.pre_norm"],
            );
            Some(Norm::layer(ckpt, &p, d, cfg.projector_eps)?)
        };
        let post_norm = if v2 {
            let p = pick(
                ckpt,
                &["mm_projector.post_norm", "model.mm_projector.post_norm"],
            );
            Some(Norm::rms(ckpt, &p, t, cfg.projector_eps)?)
        } else {
            None
        };
        Ok(Projector {
            pre_norm,
            proj0: Linear::load(ckpt, "mm_projector.proj.0", merged, merged, !v2)?,
            proj2: Linear::load(ckpt, "mm_projector.proj.2", t, merged, !v2)?,
            post_norm,
            act: cfg.projector_act,
            dim: d,
        })
    }

    /// `[cells, k²·d]` merged patches → `[cells, text]` rows.
    pub fn forward(&self, merged: &[f32]) -> Vec<f32> {
        debug_assert!(merged.len().is_multiple_of(self.dim));
        let x = match &self.pre_norm {
            Some(n) => n.forward(merged),
            None => merged.to_vec(),
        };
        let mut h = self.proj0.forward(&x);
        match self.act {
            Gelu::Erf => activation::gelu_erf_inplace(&mut h),
            Gelu::Tanh => activation::gelu_tanh_inplace(&mut h),
        }
        let y = self.proj2.forward(&h);
        match &self.post_norm {
            Some(n) => n.forward(&y),
            None => y,
        }
    }
}
