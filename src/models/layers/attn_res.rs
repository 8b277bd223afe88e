//! Block Attention Residuals (AttnRes; "Attention Residuals", Kimi Team,
//! arXiv 2603.15031), the depth-wise mixing Kimi K3 uses instead of
//! `h += f(h)` (reference doc §2).
//!
//! Each sublayer (and the final norm) reads a per-token softmax mixture of
//! its candidates: the completed block snapshots `b_0 = embedding, b_1, …`
//! and the current partial sum `prefix`:
//!
//! ```text
//! s_v = Σ_d (v_d / sqrt(mean(v²) + eps)) · norm_w[d] · proj_w[d]     per candidate v
//! Mix = Σ_v softmax(s)_v · v                                          (the raw v, not the normed one)
//! ```
//!
//! (Moonshot's `_apply_attn_res`: the RMSNorm weight enters only through the
//! score vector.) Everything is computed in f32, on the residual stream.
//!
//! Cost-saving structure (§2.4): snapshots never change once taken, so
//! [`BlockHistory`] stores each snapshot's per-row inverse RMS when it is
//! pushed, [`AttnResWeights`] keeps `norm_w ⊙ proj_w` pre-multiplied, and a
//! mix is split into [`BlockHistory::partial`] (running max, sum of
//! exponentials and weighted accumulator over the blocks) and
//! [`MixPartial::combine`] (folding in `prefix` with the online-softmax
//! update). The result is the same function as the direct softmax, up to
//! f32 rounding.

use rayon::prelude::*;

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// The learned parameters of one mix: the pre-multiplied score vector.
#[derive(Debug, Clone)]
pub struct AttnResWeights {
    /// `norm.weight ⊙ proj.weight`, `[width]`.
    pub score: Vec<f32>,
}

impl AttnResWeights {
    /// From the RMSNorm weight `[width]` and the projection `[1, width]`
    /// (flattened).
    pub fn new(norm_weight: &[f32], proj_weight: &[f32]) -> Result<AttnResWeights> {
        if norm_weight.len() != proj_weight.len() || norm_weight.is_empty() {
            return Err(Error::Config(format!(
                "AttnRes norm ({}) and projection ({}) widths differ",
                norm_weight.len(),
                proj_weight.len()
            )));
        }
        Ok(AttnResWeights {
            score: norm_weight
                .iter()
                .zip(proj_weight)
                .map(|(a, b)| a * b)
                .collect(),
        })
    }

    /// Loads `{norm}` `[width]` and `{proj}` `[1, width]` (e.g.
    /// `…self_attention_res_norm.weight`, `…self_attention_res_proj.weight`).
    pub fn load(ckpt: &Checkpoint, norm: &str, proj: &str, width: usize) -> Result<AttnResWeights> {
        AttnResWeights::new(
            &ckpt.vector(norm, width)?,
            &ckpt.tensor_f32(proj, &[1, width])?,
        )
    }

    /// Candidate width.
    pub fn width(&self) -> usize {
        self.score.len()
    }

    fn score_row(&self, v: &[f32], inv_rms: f32) -> f32 {
        inv_rms * v.iter().zip(&self.score).map(|(a, b)| a * b).sum::<f32>()
    }
}

/// `1 / sqrt(mean(v²) + eps)` of one row.
fn inv_rms(v: &[f32], eps: f32) -> f32 {
    let ms = v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32;
    1.0 / (ms + eps).sqrt()
}

/// The completed block snapshots of one forward pass (`[rows, width]` each,
/// rows = the batch's tokens), with their per-row inverse RMS.
#[derive(Debug, Clone)]
pub struct BlockHistory {
    /// Tokens per snapshot.
    rows: usize,
    /// Hidden width.
    width: usize,
    /// RMSNorm eps of the scores (`rms_norm_eps`).
    eps: f32,
    /// The snapshots in order (`b_0` = embedding first).
    blocks: Vec<Vec<f32>>,
    /// `inv_rms[b][row]` of each snapshot, computed once at push.
    inv_rms: Vec<Vec<f32>>,
}

impl BlockHistory {
    /// An empty history for `rows` tokens of `width`.
    pub fn new(rows: usize, width: usize, eps: f32) -> BlockHistory {
        BlockHistory {
            rows,
            width,
            eps,
            blocks: Vec::new(),
            inv_rms: Vec::new(),
        }
    }

    /// Number of snapshots.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no snapshot was taken yet.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The snapshots, oldest first.
    pub fn blocks(&self) -> &[Vec<f32>] {
        &self.blocks
    }

    /// Appends a snapshot `[rows, width]`.
    ///
    /// # Panics
    /// If the snapshot has the wrong size.
    pub fn push(&mut self, snapshot: Vec<f32>) {
        assert_eq!(
            snapshot.len(),
            self.rows * self.width,
            "AttnRes snapshot has the wrong size"
        );
        let inv = if self.width == 0 {
            Vec::new()
        } else {
            snapshot
                .par_chunks(self.width)
                .map(|r| inv_rms(r, self.eps))
                .collect()
        };
        self.blocks.push(snapshot);
        self.inv_rms.push(inv);
    }

    /// Softmax partials of `w`'s scores over the snapshots (see the module docs).
    pub fn partial(&self, w: &AttnResWeights) -> MixPartial {
        assert_eq!(
            w.width(),
            self.width,
            "AttnRes weights and history widths differ"
        );
        let d = self.width;
        let mut max = vec![f32::NEG_INFINITY; self.rows];
        let mut sum = vec![0.0f32; self.rows];
        let mut acc = vec![0.0f32; self.rows * d];
        max.par_iter_mut()
            .zip(sum.par_iter_mut())
            .zip(acc.par_chunks_mut(d.max(1)))
            .enumerate()
            .for_each(|(r, ((m, s), a))| {
                let scores: Vec<f32> = self
                    .blocks
                    .iter()
                    .zip(&self.inv_rms)
                    .map(|(b, inv)| w.score_row(&b[r * d..(r + 1) * d], inv[r]))
                    .collect();
                *m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                for (b, &sc) in self.blocks.iter().zip(&scores) {
                    let e = (sc - *m).exp();
                    *s += e;
                    for (x, &v) in a.iter_mut().zip(&b[r * d..(r + 1) * d]) {
                        *x += e * v;
                    }
                }
            });
        MixPartial {
            width: d,
            max,
            sum,
            acc,
        }
    }

    /// `Mix(blocks + [prefix])` for every row; `prefix` itself when there is
    /// no snapshot (a single candidate has softmax weight 1).
    pub fn mix(&self, w: &AttnResWeights, prefix: &[f32]) -> Vec<f32> {
        if self.is_empty() {
            return prefix.to_vec();
        }
        self.partial(w).combine(w, prefix, self.eps)
    }

    /// The softmax weights of every candidate (snapshots, then `prefix`), per
    /// row: `[rows, len() + 1]`. For tests and inspection.
    pub fn weights(&self, w: &AttnResWeights, prefix: &[f32]) -> Vec<f32> {
        let d = self.width;
        let n = self.len() + 1;
        let mut out = vec![0.0; self.rows * n];
        for r in 0..self.rows {
            let p = &prefix[r * d..(r + 1) * d];
            let mut s: Vec<f32> = self
                .blocks
                .iter()
                .zip(&self.inv_rms)
                .map(|(b, inv)| w.score_row(&b[r * d..(r + 1) * d], inv[r]))
                .collect();
            s.push(w.score_row(p, inv_rms(p, self.eps)));
            let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = s.iter().map(|x| (x - m).exp()).sum();
            for (o, x) in out[r * n..(r + 1) * n].iter_mut().zip(&s) {
                *o = (x - m).exp() / z;
            }
        }
        out
    }
}

/// Per-row online-softmax state over the completed blocks of one mix.
#[derive(Debug, Clone)]
pub struct MixPartial {
    /// Hidden width.
    width: usize,
    /// Largest block score per row.
    max: Vec<f32>,
    /// `Σ_b exp(s_b − max)` per row.
    sum: Vec<f32>,
    /// `Σ_b exp(s_b − max) · v_b`, `[rows, width]`.
    acc: Vec<f32>,
}

impl MixPartial {
    /// Folds the current partial sum `prefix` `[rows, width]` into the
    /// block partials and normalises: the finished mix.
    pub fn combine(&self, w: &AttnResWeights, prefix: &[f32], eps: f32) -> Vec<f32> {
        let d = self.width;
        assert_eq!(
            prefix.len(),
            self.max.len() * d,
            "AttnRes prefix has the wrong size"
        );
        let mut out = vec![0.0; prefix.len()];
        out.par_chunks_mut(d.max(1)).enumerate().for_each(|(r, o)| {
            let p = &prefix[r * d..(r + 1) * d];
            let sp = w.score_row(p, inv_rms(p, eps));
            let m = self.max[r].max(sp);
            let a = (self.max[r] - m).exp();
            let b = (sp - m).exp();
            let inv_z = 1.0 / (a * self.sum[r] + b);
            for ((y, &acc), &pv) in o.iter_mut().zip(&self.acc[r * d..(r + 1) * d]).zip(p) {
                *y = (a * acc + b * pv) * inv_z;
            }
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect()
    }

    /// Mix straight from the formula in f64: normalise, score, softmax, sum.
    fn direct_f64(
        cands: &[&[f32]],
        norm_w: &[f32],
        proj_w: &[f32],
        eps: f64,
        rows: usize,
        d: usize,
    ) -> Vec<f64> {
        let mut out = vec![0.0; rows * d];
        for r in 0..rows {
            let scores: Vec<f64> = cands
                .iter()
                .map(|c| {
                    let v = &c[r * d..(r + 1) * d];
                    let ms = v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / d as f64;
                    let inv = 1.0 / (ms + eps).sqrt();
                    (0..d)
                        .map(|i| v[i] as f64 * inv * norm_w[i] as f64 * proj_w[i] as f64)
                        .sum::<f64>()
                })
                .collect();
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
            for (c, s) in cands.iter().zip(&scores) {
                let p = (s - m).exp() / z;
                for i in 0..d {
                    out[r * d + i] += p * c[r * d + i] as f64;
                }
            }
        }
        out
    }

    #[test]
    fn one_candidate_mix_is_the_identity() {
        let (rows, d) = (3, 16);
        let w = AttnResWeights::new(&values(d, 1, 1.0), &values(d, 2, 3.0)).unwrap();
        let h = BlockHistory::new(rows, d, 1e-5);
        let prefix = values(rows * d, 3, 2.0);
        assert_eq!(h.mix(&w, &prefix), prefix);
        assert_eq!(h.weights(&w, &prefix), vec![1.0; rows]);
    }

    #[test]
    fn weights_are_the_softmax_of_normed_scores() {
        let (rows, d) = (4, 32);
        let (nw, pw) = (values(d, 5, 1.0), values(d, 6, 2.0));
        let w = AttnResWeights::new(&nw, &pw).unwrap();
        let mut h = BlockHistory::new(rows, d, 1e-5);
        let blocks: Vec<Vec<f32>> = (0..3)
            .map(|i| values(rows * d, 10 + i, 1.0 + i as f32))
            .collect();
        for b in &blocks {
            h.push(b.clone());
        }
        let prefix = values(rows * d, 20, 0.5);
        let got = h.weights(&w, &prefix);
        for r in 0..rows {
            let row = &got[r * 4..(r + 1) * 4];
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            // Scaling a candidate does not change its score (RMS-normalised):
            // recompute each score in f64 and compare the softmax.
            let cands: Vec<&[f32]> = blocks
                .iter()
                .map(|b| b.as_slice())
                .chain([prefix.as_slice()])
                .collect();
            let s: Vec<f64> = cands
                .iter()
                .map(|c| {
                    let v = &c[r * d..(r + 1) * d];
                    let inv = 1.0
                        / (v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / d as f64 + 1e-5)
                            .sqrt();
                    (0..d)
                        .map(|i| v[i] as f64 * inv * nw[i] as f64 * pw[i] as f64)
                        .sum()
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            for (j, x) in s.iter().enumerate() {
                // f32 scores of O(10): softmax weights within 1e-5 absolute.
                assert!(
                    (row[j] as f64 - (x - m).exp() / z).abs() < 1e-5,
                    "row {r} cand {j}"
                );
            }
        }
    }

    #[test]
    fn partial_then_combine_equals_the_direct_formula() {
        let (rows, d) = (5, 64);
        let (nw, pw) = (values(d, 7, 1.0), values(d, 8, 1.5));
        let w = AttnResWeights::new(&nw, &pw).unwrap();
        for nblocks in 1..=9 {
            let mut h = BlockHistory::new(rows, d, 1e-5);
            let blocks: Vec<Vec<f32>> = (0..nblocks)
                .map(|i| values(rows * d, 100 + i as u64, 0.3 + i as f32))
                .collect();
            for b in &blocks {
                h.push(b.clone());
            }
            let prefix = values(rows * d, 200, 4.0);
            let got = h.mix(&w, &prefix);
            let cands: Vec<&[f32]> = blocks
                .iter()
                .map(|b| b.as_slice())
                .chain([prefix.as_slice()])
                .collect();
            let want = direct_f64(&cands, &nw, &pw, 1e-5, rows, d);
            // Values of O(10): f32 rounding in scores, exps and sums stays below 1e-5 relative.
            for (g, x) in got.iter().zip(&want) {
                assert!(
                    (*g as f64 - x).abs() <= 1e-5 * x.abs().max(1.0),
                    "{nblocks} blocks: {g} vs {x}"
                );
            }
            // The partial is reusable: a different prefix against the same blocks.
            let prefix2 = values(rows * d, 300, 0.1);
            let part = h.partial(&w);
            let got2 = part.combine(&w, &prefix2, 1e-5);
            let cands2: Vec<&[f32]> = blocks
                .iter()
                .map(|b| b.as_slice())
                .chain([prefix2.as_slice()])
                .collect();
            let want2 = direct_f64(&cands2, &nw, &pw, 1e-5, rows, d);
            for (g, x) in got2.iter().zip(&want2) {
                assert!((*g as f64 - x).abs() <= 1e-5 * x.abs().max(1.0));
            }
        }
    }

    #[test]
    fn large_scores_do_not_overflow() {
        let (rows, d) = (2, 32);
        // Scores of ±~3000: a naive exp would overflow f32.
        let w = AttnResWeights::new(&vec![1.0; d], &vec![100.0; d]).unwrap();
        // eps 0 so that the two positive candidates score exactly alike.
        let mut h = BlockHistory::new(rows, d, 0.0);
        h.push(vec![1.0; rows * d]);
        h.push(vec![-1.0; rows * d]);
        let out = h.mix(&w, &vec![0.5; rows * d]);
        // Candidates 1.0 and 0.5 both score +3200 (RMS-normed), −1.0 scores −3200:
        // equal weights on the two positive ones.
        for v in out {
            assert!((v - 0.75).abs() < 1e-6, "{v}");
        }
    }

    #[test]
    fn mismatched_widths_are_an_error() {
        assert!(AttnResWeights::new(&[1.0, 2.0], &[1.0]).is_err());
    }
}
