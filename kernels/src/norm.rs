//! Row normalisations: RMSNorm (plain, in place, sigmoid-gated), LayerNorm,
//! and L2 row normalisation.
//!
//! Every function works on rows of `width` values (the weight's length where
//! there is a weight). Statistics are computed in f32 as PyTorch does for f32
//! inputs (HF `LlamaRMSNorm`: `x · rsqrt(mean(x²) + eps) · w`), with eight
//! partial sums so the reduction vectorises and rounds less than a serial sum.

use crate::activation::sigmoid;

/// Σ x² with eight partial sums.
#[inline]
fn sum_squares(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            acc[l] += c[l] * c[l];
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for &v in chunks.remainder() {
        s += v * v;
    }
    s
}

/// Σ x with eight partial sums.
#[inline]
fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for &v in chunks.remainder() {
        s += v;
    }
    s
}

/// `1 / sqrt(mean(x²) + eps)` of one row.
#[inline]
fn rms_inv(row: &[f32], eps: f32) -> f32 {
    1.0 / (sum_squares(row) / row.len() as f32 + eps).sqrt()
}

/// Panics unless `len` is a whole number of rows of `width`.
fn check_rows(op: &str, len: usize, width: usize) {
    assert!(width > 0, "{op}: row width must be positive");
    assert_eq!(
        len % width,
        0,
        "{op}: {len} values are not a whole number of rows of {width}"
    );
}

/// RMSNorm: `out = x / sqrt(mean(x²) + eps) · weight` per row of
/// `weight.len()` values.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let w = weight.len();
    check_rows("rms_norm", x.len(), w);
    assert_eq!(x.len(), out.len(), "rms_norm: out length differs from x");
    for (xr, or) in x.chunks_exact(w).zip(out.chunks_exact_mut(w)) {
        let inv = rms_inv(xr, eps);
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(weight) {
            *o = g * (v * inv);
        }
    }
}

/// [`rms_norm`] in place.
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let w = weight.len();
    check_rows("rms_norm_inplace", x.len(), w);
    for row in x.chunks_exact_mut(w) {
        let inv = rms_inv(row, eps);
        for (v, &g) in row.iter_mut().zip(weight) {
            *v = g * (*v * inv);
        }
    }
}

/// Sigmoid-gated RMSNorm (FLA `FusedRMSNormGated`, `activation="sigmoid"`,
/// Kimi Linear's KDA output norm), in place:
/// `x ← x / sqrt(mean(x²) + eps) · weight · sigmoid(gate)`, rows of
/// `weight.len()`; `gate` has the shape of `x`.
pub fn rms_norm_gated_sigmoid(x: &mut [f32], gate: &[f32], weight: &[f32], eps: f32) {
    let w = weight.len();
    check_rows("rms_norm_gated_sigmoid", x.len(), w);
    assert_eq!(
        x.len(),
        gate.len(),
        "rms_norm_gated_sigmoid: gate length differs from x"
    );
    for (row, gr) in x.chunks_exact_mut(w).zip(gate.chunks_exact(w)) {
        let inv = rms_inv(row, eps);
        for ((v, &g), &z) in row.iter_mut().zip(weight).zip(gr) {
            *v = g * (*v * inv) * sigmoid(z);
        }
    }
}

/// LayerNorm: `out = (x − mean) / sqrt(var + eps) · weight (+ bias)` per row
/// of `weight.len()`, with the biased variance (as `torch.nn.LayerNorm`).
pub fn layer_norm(x: &[f32], weight: &[f32], bias: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let w = weight.len();
    check_rows("layer_norm", x.len(), w);
    assert_eq!(x.len(), out.len(), "layer_norm: out length differs from x");
    if let Some(b) = bias {
        assert_eq!(b.len(), w, "layer_norm: bias length differs from weight");
    }
    for (xr, or) in x.chunks_exact(w).zip(out.chunks_exact_mut(w)) {
        let mut mean = sum(xr) / w as f32;
        // One refinement step: the mean of the residuals corrects the
        // rounding of the first sum (large offsets would otherwise leave an
        // error of ~ulp(Σx) in every centred value).
        for (o, &v) in or.iter_mut().zip(xr) {
            *o = v - mean;
        }
        mean += sum(or) / w as f32;
        // Two passes: the variance of the centred values does not cancel.
        for (o, &v) in or.iter_mut().zip(xr) {
            *o = v - mean;
        }
        let var = sum_squares(or) / w as f32;
        let inv = 1.0 / (var + eps).sqrt();
        match bias {
            Some(b) => {
                for ((o, &g), &bb) in or.iter_mut().zip(weight).zip(b) {
                    *o = *o * inv * g + bb;
                }
            }
            None => {
                for (o, &g) in or.iter_mut().zip(weight) {
                    *o = *o * inv * g;
                }
            }
        }
    }
}

/// L2-normalises each row of `width` in place: `x ← x / sqrt(Σx² + eps)`
/// (FLA's `l2norm`, used on KDA queries and keys).
pub fn l2_normalize_rows(x: &mut [f32], width: usize, eps: f32) {
    check_rows("l2_normalize_rows", x.len(), width);
    for row in x.chunks_exact_mut(width) {
        let inv = 1.0 / (sum_squares(row) + eps).sqrt();
        for v in row {
            *v *= inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    /// Relative 2e-6 (plus 1e-7 absolute) vs f64: a few f32 roundings.
    fn assert_close(got: &[f32], want: &[f64]) {
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= 2e-6 * w.abs() + 1e-7,
                "{i}: {g} vs {w}"
            );
        }
    }

    fn rms_ref(x: &[f32], w: &[f32], eps: f64) -> Vec<f64> {
        let mut out = Vec::new();
        for row in x.chunks(w.len()) {
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / w.len() as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            out.extend(row.iter().zip(w).map(|(&v, &g)| v as f64 * inv * g as f64));
        }
        out
    }

    #[test]
    fn rms_norm_matches_f64_reference_over_rows() {
        let width = 37;
        let x = Rng::seeded(1).vec(3 * width, 3.0);
        let w = Rng::seeded(2).vec(width, 3.0);
        let mut out = vec![0.0; x.len()];
        rms_norm(&x, &w, 1e-6, &mut out);
        assert_close(&out, &rms_ref(&x, &w, 1e-6));
        let mut y = x.clone();
        rms_norm_inplace(&mut y, &w, 1e-6);
        assert_eq!(y, out);
    }

    #[test]
    fn rms_norm_eps_dominates_a_zero_row() {
        let mut x = vec![0.0f32; 8];
        rms_norm_inplace(&mut x, &[1.0; 8], 1e-5);
        assert!(x.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn gated_rms_norm_multiplies_by_sigmoid_of_gate() {
        let width = 20;
        let x = Rng::seeded(3).vec(2 * width, 3.0);
        let gate = Rng::seeded(4).vec(2 * width, 3.0);
        let w = Rng::seeded(5).vec(width, 3.0);
        let mut y = x.clone();
        rms_norm_gated_sigmoid(&mut y, &gate, &w, 1e-5);
        let want: Vec<f64> = rms_ref(&x, &w, 1e-5)
            .iter()
            .zip(&gate)
            .map(|(&v, &g)| v / (1.0 + (-(g as f64)).exp()))
            .collect();
        assert_close(&y, &want);
    }

    #[test]
    fn layer_norm_matches_f64_reference_with_and_without_bias() {
        let width = 45;
        let x: Vec<f32> = Rng::seeded(6)
            .vec(2 * width, 3.0)
            .iter()
            .map(|v| v + 100.0)
            .collect(); // large mean
        let w = Rng::seeded(7).vec(width, 3.0);
        let b = Rng::seeded(8).vec(width, 3.0);
        for bias in [None, Some(&b[..])] {
            let mut out = vec![0.0; x.len()];
            layer_norm(&x, &w, bias, 1e-5, &mut out);
            let mut want = Vec::new();
            for row in x.chunks(width) {
                let mean = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
                let var =
                    row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / width as f64;
                let inv = 1.0 / (var + 1e-5).sqrt();
                for j in 0..width {
                    want.push(
                        (row[j] as f64 - mean) * inv * w[j] as f64
                            + bias.map_or(0.0, |b| b[j] as f64),
                    );
                }
            }
            // The +100 offset costs ~100·2^-24 absolute on the centred values.
            for (i, (&g, &wv)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (g as f64 - wv).abs() <= 2e-5 * wv.abs().max(1.0),
                    "{i}: {g} vs {wv}"
                );
            }
        }
    }

    #[test]
    fn l2_normalized_rows_have_unit_norm() {
        let width = 13;
        let mut x = Rng::seeded(9).vec(4 * width, 3.0);
        let orig = x.clone();
        l2_normalize_rows(&mut x, width, 1e-6);
        for (row, o) in x.chunks(width).zip(orig.chunks(width)) {
            let n2 = o.iter().map(|&v| (v as f64).powi(2)).sum::<f64>();
            let want: Vec<f64> = o.iter().map(|&v| v as f64 / (n2 + 1e-6).sqrt()).collect();
            assert_close(row, &want);
        }
    }
}
