//! MoonViT3d, the vision tower of Kimi K2.5 / K2.6 / K3, with its
//! `sd2_tpool` patch merger and projector.
//!
//! ```text
//! x = Conv2d(3 → d, k = s = patch)(patches)            # as a matmul on flat patches
//! x += PosEmb(h, w) per frame (+ time(f) when t > 1)
//! for each block:
//!     x += wo(Attn(RoPE2D(wqkv(norm0(x)))))            # bidirectional within one item
//!     x += fc1(gelu_tanh(fc0(norm1(x))))
//! x = final_layernorm(x)
//! cell (i, j): mean over t of patches (ki+a, kj+b), concatenated a-major → projector
//! ```
//!
//! Several items are encoded in one packed pass: the linears run on all
//! tokens at once, attention runs per item over its `t·h·w` tokens (no
//! attention across items), so packing does not change any item's rows.
//!
//! Tensor names (published; the spelling transformers 5.x `save_pretrained`
//! writes differs only in `vision_tower.encoder.patch_embed.proj` and
//! `model.mm_projector.pre_norm`, both accepted):
//! `vision_tower.patch_embed.{proj.weight [d,3,p,p], proj.bias, pos_emb.weight [H0,W0,d]}`,
//! `vision_tower.encoder.blocks.N.{norm0, norm1, wqkv [3q,d], wo [d,q], mlp.fc0, mlp.fc1}`,
//! `vision_tower.encoder.final_layernorm`, `mm_projector.*`.

use caracal_kernels::activation;
use caracal_kernels::gemm;
use caracal_kernels::Matrix;
use rayon::prelude::*;

use super::pos_emb::PosEmb;
use super::projector::Projector;
use super::rope2d::{Rope2d, RopeTable};
use super::{pick, Linear, Norm};
use crate::checkpoint::arch::vision::{Gelu, VisionConfig};
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::models::{EngineError, VisionInfo, VisionInput, VisionTower};

/// One pre-norm transformer block of the tower.
struct Block {
    norm0: Norm,
    /// `[3·qkv, d]`: q | k | v, head-major.
    wqkv: Linear,
    /// `[d, qkv]`.
    wo: Linear,
    norm1: Norm,
    /// `[intermediate, d]`.
    fc0: Linear,
    /// `[d, intermediate]`.
    fc1: Linear,
}

/// A loaded MoonViT3d tower with its projector.
pub struct MoonVit3d {
    /// The validated `vision_config`.
    cfg: VisionConfig,
    /// What the runtime reads.
    info: VisionInfo,
    /// The patch conv as `[d, 3·p·p]`.
    patch_embed: Linear,
    /// Spatial grid and time table.
    pos_emb: PosEmb,
    /// 2D RoPE of the head width.
    rope: Rope2d,
    blocks: Vec<Block>,
    final_layernorm: Norm,
    projector: Projector,
}

/// Where one item's tokens sit in the packed pass.
struct Segment {
    /// First token.
    start: usize,
    /// `[t, h, w]`.
    grid: [usize; 3],
}

impl MoonVit3d {
    /// Loads the tower `cfg` describes from `ckpt`.
    pub fn load(ckpt: &Checkpoint, cfg: &VisionConfig) -> Result<MoonVit3d> {
        let (d, q, m, p) = (cfg.hidden, cfg.qkv_hidden, cfg.intermediate, cfg.patch_size);
        let norm = |name: &str| Norm::load(ckpt, name, d, cfg.norm, cfg.norm_eps);
        let pe = pick(
            ckpt,
            &[
                "vision_tower.patch_embed.proj",
                "vision_tower.encoder.patch_embed.proj",
            ],
        );
        let conv = ckpt.tensor_f32(&format!("{pe}.weight"), &[d, 3, p, p])?;
        let patch_embed = Linear::from_parts(
            Matrix::from_f32(d, 3 * p * p, &conv),
            match cfg.patch_bias {
                true => Some(ckpt.vector(&format!("{pe}.bias"), d)?),
                false => None,
            },
        );
        let pos_name = pick(
            ckpt,
            &[
                "vision_tower.patch_embed.pos_emb",
                "vision_tower.encoder.patch_embed.pos_emb",
            ],
        );
        let pos_emb = PosEmb::load(
            ckpt,
            &format!("{pos_name}.weight"),
            (cfg.pos_emb_height, cfg.pos_emb_width, d),
            cfg.pos_emb_time,
            cfg.interpolation,
        )?;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let b = format!("vision_tower.encoder.blocks.{i}");
            blocks.push(Block {
                norm0: norm(&format!("{b}.norm0"))?,
                wqkv: Linear::load(ckpt, &format!("{b}.wqkv"), 3 * q, d, cfg.attn_bias)?,
                wo: Linear::load(ckpt, &format!("{b}.wo"), d, q, cfg.attn_bias)?,
                norm1: norm(&format!("{b}.norm1"))?,
                fc0: Linear::load(ckpt, &format!("{b}.mlp.fc0"), m, d, cfg.linear_bias)?,
                fc1: Linear::load(ckpt, &format!("{b}.mlp.fc1"), d, m, cfg.linear_bias)?,
            });
        }
        Ok(MoonVit3d {
            info: VisionInfo {
                patch_size: p,
                merge_size: cfg.merge,
                max_frames: cfg.pos_emb_time,
                out_dim: cfg.text_hidden,
                placeholder_id: cfg.placeholder_id,
            },
            patch_embed,
            pos_emb,
            rope: Rope2d::new(cfg.head_dim(), cfg.rope_theta),
            blocks,
            final_layernorm: norm("vision_tower.encoder.final_layernorm")?,
            projector: Projector::load(ckpt, cfg)?,
            cfg: cfg.clone(),
        })
    }

    /// The `vision_config` the tower was built from.
    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// Checks one item against the tower's limits.
    fn check(&self, i: usize, item: &VisionInput) -> std::result::Result<(), EngineError> {
        let [t, h, w] = item.grid_thw;
        let k = self.cfg.merge;
        let bad = |m: String| Err(EngineError::InvalidInput(format!("media item {i}: {m}")));
        if t == 0 || h == 0 || w == 0 {
            return bad(format!("grid_thw {:?} has an empty side", item.grid_thw));
        }
        if !h.is_multiple_of(k) || !w.is_multiple_of(k) {
            return bad(format!(
                "a {h}×{w} patch grid is not a multiple of the {k}×{k} merge"
            ));
        }
        if t > self.cfg.pos_emb_time {
            return bad(format!(
                "{t} frames exceed the tower's {} frames per chunk",
                self.cfg.pos_emb_time
            ));
        }
        let p = self.cfg.patch_size;
        let want = t
            .checked_mul(h)
            .and_then(|x| x.checked_mul(w))
            .and_then(|x| x.checked_mul(3 * p * p));
        if want != Some(item.pixel_values.len()) {
            return bad(format!(
                "{} pixel values for grid_thw {:?} (want t·h·w·3·{p}·{p})",
                item.pixel_values.len(),
                item.grid_thw
            ));
        }
        Ok(())
    }

    /// Patch embedding plus position and time embeddings of all items.
    fn embed(&self, items: &[VisionInput], segs: &[Segment], n: usize) -> Vec<f32> {
        let d = self.cfg.hidden;
        let mut pixels = Vec::with_capacity(items.iter().map(|x| x.pixel_values.len()).sum());
        for it in items {
            pixels.extend_from_slice(&it.pixel_values);
        }
        let mut x = self.patch_embed.forward(&pixels);
        debug_assert_eq!(x.len(), n * d);
        for s in segs {
            let [t, h, w] = s.grid;
            let pos = self.pos_emb.spatial(h, w);
            for f in 0..t {
                let rows = &mut x[(s.start + f * h * w) * d..(s.start + (f + 1) * h * w) * d];
                for (r, pr) in rows.chunks_exact_mut(d).zip(pos.chunks_exact(d)) {
                    if t > 1 {
                        let tr = self.pos_emb.time(f);
                        for ((v, &a), &b) in r.iter_mut().zip(pr).zip(tr) {
                            *v += a + b;
                        }
                    } else {
                        for (v, &a) in r.iter_mut().zip(pr) {
                            *v += a;
                        }
                    }
                }
            }
        }
        x
    }

    /// Bidirectional attention of `qkv` (`[n, 3·q]`) within each segment.
    ///
    /// Per segment and head, as two matmuls on the f32 GEMM
    /// (`S = scale·Q·Kᵀ`, then `O = softmax(S)·V`) with the row softmax in
    /// between: the `len × len` scores of one head exist at a time.
    fn attention(&self, qkv: &[f32], segs: &[Segment], n: usize) -> Vec<f32> {
        let (qw, heads, hd) = (self.cfg.qkv_hidden, self.cfg.heads, self.cfg.head_dim());
        let scale = (hd as f32).powf(-0.5);
        let mut out = vec![0.0f32; n * qw];
        for s in segs {
            let len = s.grid.iter().product::<usize>();
            let rows = &qkv[s.start * 3 * qw..(s.start + len) * 3 * qw];
            let (mut q, mut k, mut vt) = (
                vec![0.0f32; len * hd],
                vec![0.0f32; len * hd],
                vec![0.0f32; hd * len],
            );
            let (mut scores, mut o) = (vec![0.0f32; len * len], vec![0.0f32; len * hd]);
            for h in 0..heads {
                for (j, r) in rows.chunks_exact(3 * qw).enumerate() {
                    let (qr, kr, vr) = (
                        &r[h * hd..(h + 1) * hd],
                        &r[qw + h * hd..qw + (h + 1) * hd],
                        &r[2 * qw + h * hd..2 * qw + (h + 1) * hd],
                    );
                    for (d, &x) in q[j * hd..(j + 1) * hd].iter_mut().zip(qr) {
                        *d = x * scale;
                    }
                    k[j * hd..(j + 1) * hd].copy_from_slice(kr);
                    for (c, &x) in vr.iter().enumerate() {
                        vt[c * len + j] = x;
                    }
                }
                gemm::matmul_f32(&q, len, &k, len, hd, &mut scores);
                scores.par_chunks_mut(len).for_each(|row| {
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0.0f32;
                    for v in row.iter_mut() {
                        *v = (*v - max).exp();
                        sum += *v;
                    }
                    let inv = 1.0 / sum;
                    row.iter_mut().for_each(|v| *v *= inv);
                });
                gemm::matmul_f32(&scores, len, &vt, hd, len, &mut o);
                let dst = &mut out[s.start * qw..(s.start + len) * qw];
                for (d, src) in dst.chunks_exact_mut(qw).zip(o.chunks_exact(hd)) {
                    d[h * hd..(h + 1) * hd].copy_from_slice(src);
                }
            }
        }
        out
    }

    /// Applies RoPE to the q and k parts of `qkv` (`[n, 3·q]`).
    fn rotate(&self, qkv: &mut [f32], table: &RopeTable) {
        let qw = self.cfg.qkv_hidden;
        qkv.par_chunks_mut(3 * qw).enumerate().for_each(|(t, row)| {
            self.rope.apply_token(&mut row[..2 * qw], table, t);
        });
    }

    /// `sd2_tpool`: per merged cell the mean over frames of its `k²` patches,
    /// concatenated in row-major order within the cell.
    fn merge(&self, x: &[f32], s: &Segment) -> Vec<f32> {
        let (d, k) = (self.cfg.hidden, self.cfg.merge);
        let [t, h, w] = s.grid;
        let mut out = Vec::with_capacity(h * w * d);
        let inv = 1.0 / t as f32;
        for i in 0..h / k {
            for j in 0..w / k {
                for a in 0..k {
                    for b in 0..k {
                        let p = (k * i + a) * w + (k * j + b);
                        let mut acc = vec![0.0f32; d];
                        for f in 0..t {
                            let r = s.start + f * h * w + p;
                            for (v, &xv) in acc.iter_mut().zip(&x[r * d..(r + 1) * d]) {
                                *v += xv;
                            }
                        }
                        if t > 1 {
                            acc.iter_mut().for_each(|v| *v *= inv);
                        }
                        out.extend_from_slice(&acc);
                    }
                }
            }
        }
        out
    }
}

impl VisionTower for MoonVit3d {
    fn info(&self) -> &VisionInfo {
        &self.info
    }

    fn encode(&self, items: &[VisionInput]) -> std::result::Result<Vec<Vec<f32>>, EngineError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let mut segs = Vec::with_capacity(items.len());
        let mut n = 0;
        for (i, it) in items.iter().enumerate() {
            self.check(i, it)?;
            segs.push(Segment {
                start: n,
                grid: it.grid_thw,
            });
            n += it.grid_thw.iter().product::<usize>();
        }
        let mut positions = Vec::with_capacity(n);
        for s in &segs {
            let [t, h, w] = s.grid;
            for _ in 0..t {
                positions.extend((0..h * w).map(|p| (p / w, p % w)));
            }
        }
        let table = self.rope.table(&positions);
        let mut x = self.embed(items, &segs, n);
        for b in &self.blocks {
            let mut qkv = b.wqkv.forward(&b.norm0.forward(&x));
            self.rotate(&mut qkv, &table);
            let a = b.wo.forward(&self.attention(&qkv, &segs, n));
            x.iter_mut().zip(&a).for_each(|(v, d)| *v += d);
            let mut h = b.fc0.forward(&b.norm1.forward(&x));
            match self.cfg.act {
                Gelu::Tanh => activation::gelu_tanh_inplace(&mut h),
                Gelu::Erf => activation::gelu_erf_inplace(&mut h),
            }
            let m = b.fc1.forward(&h);
            x.iter_mut().zip(&m).for_each(|(v, d)| *v += d);
        }
        let x = self.final_layernorm.forward(&x);
        Ok(segs
            .iter()
            .map(|s| self.projector.forward(&self.merge(&x, s)))
            .collect())
    }
}
