//! Vision towers: MoonViT3d (Kimi K2.5 / K2.6 / K3) with its patch merger
//! and projector, from preprocessed patches to rows of LM input embeddings.
//!
//! | file | block |
//! |---|---|
//! | [`moonvit3d`] | the tower: patch embedding, blocks with packed per-item attention, `sd2_tpool` merge; implements [`crate::models::VisionTower`] |
//! | [`pos_emb`] | learnable spatial grid resampled like `F.interpolate`, fixed sin/cos time embedding |
//! | [`rope2d`] | 2D rotary embedding on adjacent pairs (column, row) |
//! | [`projector`] | `patchmerger` (K2.5) and `patchmergerv2` (K3) |
//!
//! Reference implementation: transformers 5.23 `models/kimi_k25/modeling_kimi_k25.py`
//! (numbers checked in `tests/kimi_k25.rs` against it, and for K3's switches
//! against a plain reference written from the spec in
//! `tools/make_vision_fixtures.py`); the architecture in
//! `kimi-architecture.md` §3.2.

pub mod moonvit3d;
pub mod pos_emb;
pub mod projector;
pub mod rope2d;

pub use moonvit3d::MoonVit3d;

use caracal_kernels::norm;
use caracal_kernels::Matrix;

use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// The first of `names` the checkpoint has a `.weight` for, else the first
/// (so a missing tensor is reported under its published name).
pub(crate) fn pick(ckpt: &Checkpoint, names: &[&str]) -> String {
    names
        .iter()
        .find(|n| ckpt.has(&format!("{n}.weight")))
        .unwrap_or(&names[0])
        .to_string()
}

/// A linear layer with an optional bias.
pub struct Linear {
    /// `[out, in]`, as stored.
    weight: Matrix,
    /// `[out]`.
    bias: Option<Vec<f32>>,
}

impl Linear {
    /// Loads `{prefix}.weight` `[out, inp]` and, when `bias`, `{prefix}.bias`.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Linear> {
        Ok(Linear {
            weight: ckpt.matrix(&format!("{prefix}.weight"), out, inp)?,
            bias: match bias {
                true => Some(ckpt.vector(&format!("{prefix}.bias"), out)?),
                false => None,
            },
        })
    }

    /// A linear layer from f32 values.
    pub fn from_parts(weight: Matrix, bias: Option<Vec<f32>>) -> Linear {
        Linear { weight, bias }
    }

    /// `x [n, in] → [n, out]`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let mut y = self.weight.forward(x);
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(b.len()) {
                for (v, &bb) in row.iter_mut().zip(b) {
                    *v += bb;
                }
            }
        }
        y
    }
}

/// LayerNorm (weight + bias) or RMSNorm (weight), per row.
pub struct Norm {
    /// Per-channel scale.
    weight: Vec<f32>,
    /// LayerNorm's shift; `None` for RMSNorm.
    bias: Option<Vec<f32>>,
    /// RMSNorm instead of LayerNorm.
    rms: bool,
    /// Added to the variance / mean square.
    eps: f32,
}

impl Norm {
    /// `{prefix}.weight` and `{prefix}.bias` of width `dim`.
    pub fn layer(ckpt: &Checkpoint, prefix: &str, dim: usize, eps: f32) -> Result<Norm> {
        Ok(Norm {
            weight: ckpt.vector(&format!("{prefix}.weight"), dim)?,
            bias: Some(ckpt.vector(&format!("{prefix}.bias"), dim)?),
            rms: false,
            eps,
        })
    }

    /// `{prefix}.weight` of width `dim`.
    pub fn rms(ckpt: &Checkpoint, prefix: &str, dim: usize, eps: f32) -> Result<Norm> {
        Ok(Norm {
            weight: ckpt.vector(&format!("{prefix}.weight"), dim)?,
            bias: None,
            rms: true,
            eps,
        })
    }

    /// The tower's norm kind at `prefix`.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        dim: usize,
        kind: crate::checkpoint::arch::vision::VisionNorm,
        eps: f32,
    ) -> Result<Norm> {
        match kind {
            crate::checkpoint::arch::vision::VisionNorm::LayerNorm => {
                Norm::layer(ckpt, prefix, dim, eps)
            }
            crate::checkpoint::arch::vision::VisionNorm::RmsNorm => {
                Norm::rms(ckpt, prefix, dim, eps)
            }
        }
    }

    /// Normalises every row of `x`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; x.len()];
        if self.rms {
            norm::rms_norm(x, &self.weight, self.eps, &mut out);
        } else {
            norm::layer_norm(x, &self.weight, self.bias.as_deref(), self.eps, &mut out);
        }
        out
    }
}
