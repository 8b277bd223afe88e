//! Softmax, log-softmax and index selection over one row of f32 values.
//!
//! Softmaxes subtract the row maximum before exponentiating (no overflow for
//! any finite input) and sum in f32, as PyTorch's CPU kernel does. Index
//! selection is deterministic: ties go to the lower index, and NaN never wins
//! against a number.

use std::cmp::Ordering;

/// In-place softmax: `x_i ← e^{x_i − max} / Σ_j e^{x_j − max}`.
///
/// An empty row is left alone. A row whose maximum is `+∞` or NaN becomes NaN,
/// like PyTorch.
pub fn softmax_inplace(x: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    let max = row_max(x);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// In-place log-softmax: `x_i ← x_i − max − ln Σ_j e^{x_j − max}`.
pub fn log_softmax_inplace(x: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    let max = row_max(x);
    let sum: f32 = x.iter().map(|&v| (v - max).exp()).sum();
    let shift = max + sum.ln();
    for v in x.iter_mut() {
        *v -= shift;
    }
}

/// Largest value of a non-empty row (NaN propagates, as in `torch.max`).
fn row_max(x: &[f32]) -> f32 {
    x.iter().fold(
        f32::NEG_INFINITY,
        |m, &v| if v > m || v.is_nan() { v } else { m },
    )
}

/// Index of the largest value; the first one wins ties. NaN values are
/// skipped unless every value is NaN. Panics on an empty row.
pub fn argmax(x: &[f32]) -> usize {
    assert!(!x.is_empty(), "argmax of an empty row");
    let mut best = 0;
    for (i, &v) in x.iter().enumerate().skip(1) {
        if v > x[best] || (x[best].is_nan() && !v.is_nan()) {
            best = i;
        }
    }
    best
}

/// Descending order of values, NaN last, ties by lower index.
fn rank(x: &[f32], a: usize, b: usize) -> Ordering {
    let (va, vb) = (x[a], x[b]);
    let by_value = match (va.is_nan(), vb.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        (false, false) => vb.partial_cmp(&va).expect("neither value is NaN"),
    };
    by_value.then(a.cmp(&b))
}

/// Indices of the `k` largest values in descending order of value, ties by
/// lower index (`k` is capped at `x.len()`).
pub fn top_k_indices(x: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(x.len());
    if k == 0 {
        return Vec::new();
    }
    let mut idx: Vec<usize> = (0..x.len()).collect();
    if k < idx.len() {
        // The order is total (index breaks every tie), so the first k after
        // partitioning are exactly the k best.
        idx.select_nth_unstable_by(k - 1, |&a, &b| rank(x, a, b));
        idx.truncate(k);
    }
    idx.sort_unstable_by(|&a, &b| rank(x, a, b));
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_matches_f64_and_sums_to_one() {
        // Relative 1e-6 vs an f64 evaluation.
        let row = [1.0f32, -2.0, 3.5, 0.0, 3.5, -100.0];
        let mut x = row;
        softmax_inplace(&mut x);
        let max = 3.5f64;
        let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
        for (i, &v) in row.iter().enumerate() {
            let want = (v as f64 - max).exp() / sum;
            assert!(
                (x[i] as f64 - want).abs() <= 1e-6 * want + 1e-30,
                "{i}: {} vs {want}",
                x[i]
            );
        }
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn softmax_does_not_overflow_on_large_logits() {
        let mut x = [1000.0f32, 1000.0, 999.0];
        softmax_inplace(&mut x);
        assert!(x.iter().all(|v| v.is_finite()));
        assert!((x[0] - x[1]).abs() < 1e-7 && x[0] > x[2]);
    }

    #[test]
    fn log_softmax_matches_log_of_softmax() {
        // Absolute 1e-5 on log-probabilities.
        let row = [0.3f32, -1.2, 2.2, 7.0, -30.0];
        let mut a = row;
        let mut b = row;
        log_softmax_inplace(&mut a);
        softmax_inplace(&mut b);
        for i in 0..row.len() {
            let lse: f64 = row.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln();
            assert!((a[i] as f64 - (row[i] as f64 - lse)).abs() < 1e-5, "{i}");
            if b[i] > 1e-30 {
                assert!((a[i] - b[i].ln()).abs() < 1e-5, "{i}");
            }
        }
    }

    #[test]
    fn argmax_takes_the_first_of_equal_maxima() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax(&[-5.0]), 0);
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0]), 2);
        assert_eq!(argmax(&[0.5, f32::NAN, 0.2]), 0);
    }

    #[test]
    fn top_k_is_descending_with_ties_broken_by_lower_index() {
        let x = [0.1f32, 0.9, 0.5, 0.9, -1.0, 0.5, f32::NAN];
        assert_eq!(top_k_indices(&x, 4), vec![1, 3, 2, 5]);
        assert_eq!(top_k_indices(&x, 1), vec![1]);
        assert_eq!(top_k_indices(&x, 0), Vec::<usize>::new());
        assert_eq!(top_k_indices(&x, 100), vec![1, 3, 2, 5, 0, 4, 6]);
    }

    #[test]
    fn top_k_agrees_with_a_full_stable_sort() {
        // Many ties: values drawn from 7 levels.
        let x: Vec<f32> = (0..200).map(|i| ((i * 37) % 7) as f32 - 3.0).collect();
        let mut all: Vec<usize> = (0..x.len()).collect();
        all.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).unwrap());
        for k in [1, 5, 29, 200] {
            assert_eq!(top_k_indices(&x, k), all[..k].to_vec(), "k={k}");
        }
    }
}
