//! MoonViT3d position embeddings (`pos_emb_type: "divided_fixed"`): a
//! learnable spatial grid `[H0, W0, d]` resampled to each item's patch grid,
//! plus a fixed sin/cos time embedding added to every frame of a multi-frame
//! chunk (reference `kimi-architecture.md` §3.2, `video-anchors.md` §1.3).
//!
//! The resampling reproduces torch's
//! `F.interpolate(grid as [1, d, H0, W0], size=(h, w), mode, align_corners=False)`
//! (ATen `upsample_bicubic2d` / `upsample_bilinear2d`): source coordinate
//! `scale·(dst + 0.5) − 0.5` with `scale = in/out` in f32; bicubic uses Keys'
//! kernel with `A = −0.75` on four taps clamped to the border, bilinear two
//! taps with the coordinate clamped at 0. transformers' `Kimi_K25` computes
//! the same weights as a gather (`get_vision_interpolation_indices_and_weights`).
//!
//! Time: `emb(f) = [sin(f·ω), cos(f·ω)]`, `ω_i = 10000^{−2i/d}`, for frame
//! `f = 0..t` of a chunk with `t > 1`; a still image (`t = 1`) gets none
//! (transformers prepends a zero row to the table for it).

use crate::checkpoint::arch::vision::PosInterpolation;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// Keys' cubic convolution parameter used by torch.
const CUBIC_A: f32 = -0.75;

/// Taps `(source index, weight)` of every output index of one axis.
pub fn axis_taps(input: usize, output: usize, mode: PosInterpolation) -> Vec<Vec<(usize, f32)>> {
    let scale = input as f32 / output as f32;
    let last = input as i64 - 1;
    (0..output)
        .map(|dst| {
            let real = scale * (dst as f32 + 0.5) - 0.5;
            match mode {
                PosInterpolation::Bicubic => {
                    let idx = real.floor();
                    let t = real - idx;
                    let cubic1 = |x: f32| ((CUBIC_A + 2.0) * x - (CUBIC_A + 3.0)) * x * x + 1.0;
                    let cubic2 = |x: f32| {
                        ((CUBIC_A * x - 5.0 * CUBIC_A) * x + 8.0 * CUBIC_A) * x - 4.0 * CUBIC_A
                    };
                    let w = [cubic2(t + 1.0), cubic1(t), cubic1(1.0 - t), cubic2(2.0 - t)];
                    (0..4)
                        .map(|k| {
                            let i = (idx as i64 - 1 + k as i64).clamp(0, last) as usize;
                            (i, w[k])
                        })
                        .collect()
                }
                PosInterpolation::Bilinear => {
                    let real = real.max(0.0);
                    let i0 = real as usize;
                    let i1 = if (i0 as i64) < last { i0 + 1 } else { i0 };
                    let l1 = real - i0 as f32;
                    vec![(i0, 1.0 - l1), (i1, l1)]
                }
            }
        })
        .collect()
}

/// The learned spatial grid and the fixed time table of one tower.
pub struct PosEmb {
    /// `[height, width, d]` row-major.
    table: Vec<f32>,
    /// Grid rows (`init_pos_emb_height`).
    height: usize,
    /// Grid columns (`init_pos_emb_width`).
    width: usize,
    /// Tower width.
    dim: usize,
    /// Resampling mode.
    mode: PosInterpolation,
    /// `[frames, d]` sin/cos rows (`init_pos_emb_time` frames).
    time: Vec<f32>,
}

impl PosEmb {
    /// Loads the grid `name` (`[height, width, dim]`) and builds the time
    /// table for `frames` frames.
    pub fn load(
        ckpt: &Checkpoint,
        name: &str,
        (height, width, dim): (usize, usize, usize),
        frames: usize,
        mode: PosInterpolation,
    ) -> Result<PosEmb> {
        let table = ckpt.tensor_f32(name, &[height, width, dim])?;
        Ok(PosEmb::new(table, (height, width, dim), frames, mode))
    }

    /// A grid from values (`[height, width, dim]`).
    pub fn new(
        table: Vec<f32>,
        (height, width, dim): (usize, usize, usize),
        frames: usize,
        mode: PosInterpolation,
    ) -> PosEmb {
        assert_eq!(table.len(), height * width * dim, "pos_emb: table size");
        // As transformers: inv_freq = 1 / 10000^(2i/d) in f32, then sin/cos of f·inv_freq.
        let half = dim / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / 10000f32.powf((2 * i) as f32 / dim as f32))
            .collect();
        let mut time = vec![0.0; frames * dim];
        for f in 0..frames {
            let row = &mut time[f * dim..(f + 1) * dim];
            for (i, &w) in inv.iter().enumerate() {
                let a = f as f32 * w;
                row[i] = a.sin();
                row[half + i] = a.cos();
            }
        }
        PosEmb {
            table,
            height,
            width,
            dim,
            mode,
            time,
        }
    }

    /// Most frames the time table covers.
    pub fn frames(&self) -> usize {
        self.time.len() / self.dim.max(1)
    }

    /// The grid resampled to `h × w` patches: `[h·w, d]`, row-major.
    pub fn spatial(&self, h: usize, w: usize) -> Vec<f32> {
        let d = self.dim;
        if (h, w) == (self.height, self.width) {
            return self.table.clone();
        }
        let ty = axis_taps(self.height, h, self.mode);
        let tx = axis_taps(self.width, w, self.mode);
        let mut out = vec![0.0f32; h * w * d];
        let mut row = vec![0.0f32; d];
        for (y, wy) in ty.iter().enumerate() {
            for (x, wx) in tx.iter().enumerate() {
                let o = &mut out[(y * w + x) * d..(y * w + x + 1) * d];
                for &(sy, cy) in wy {
                    row.iter_mut().for_each(|v| *v = 0.0);
                    for &(sx, cx) in wx {
                        let src =
                            &self.table[(sy * self.width + sx) * d..(sy * self.width + sx + 1) * d];
                        for (r, &s) in row.iter_mut().zip(src) {
                            *r += cx * s;
                        }
                    }
                    for (a, &r) in o.iter_mut().zip(&row) {
                        *a += cy * r;
                    }
                }
            }
        }
        out
    }

    /// The time row of frame `f` of a chunk with more than one frame.
    pub fn time(&self, f: usize) -> &[f32] {
        &self.time[f * self.dim..(f + 1) * self.dim]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// torch: `F.interpolate(torch.arange(4.)[None, None, None], size=(1, 6),
    /// mode="bicubic", align_corners=False)` and the bilinear twin.
    #[test]
    fn matches_torch_interpolate_on_a_ramp() {
        let ramp = [0.0f32, 1.0, 2.0, 3.0];
        let run = |mode, out: usize| -> Vec<f32> {
            axis_taps(4, out, mode)
                .iter()
                .map(|taps| taps.iter().map(|&(i, w)| w * ramp[i]).sum())
                .collect()
        };
        let bicubic = [
            -0.086_805_58f32,
            0.40625,
            1.212_962_7,
            1.787_037_1,
            2.59375,
            3.086_805_8,
        ];
        for (a, b) in run(PosInterpolation::Bicubic, 6).iter().zip(bicubic) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        let bilinear = [0.0f32, 0.5, 1.1666666, 1.8333334, 2.5, 3.0];
        for (a, b) in run(PosInterpolation::Bilinear, 6).iter().zip(bilinear) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        // Same size: identity weights.
        for (a, b) in run(PosInterpolation::Bicubic, 4).iter().zip(ramp) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    #[test]
    fn time_rows_are_sin_then_cos() {
        let p = PosEmb::new(vec![0.0; 4], (1, 1, 4), 3, PosInterpolation::Bicubic);
        assert_eq!(p.time(0), &[0.0, 0.0, 1.0, 1.0]);
        let r = p.time(2);
        assert!((r[0] - 2f32.sin()).abs() < 1e-6 && (r[1] - 0.02f32.sin()).abs() < 1e-6);
        assert!((r[2] - 2f32.cos()).abs() < 1e-6 && (r[3] - 0.02f32.cos()).abs() < 1e-6);
    }
}
