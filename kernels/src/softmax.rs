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
///
/// Two vector passes instead of one loop whose every step waits on the
/// last comparison: the largest non-NaN value (`max` keeps its second
/// operand when the first is NaN), then the first index holding it. A
/// greedy step takes one per sequence over the whole vocabulary, on the
/// scheduler's thread while the pool waits. [`argmax_ref`] is the plain
/// form the tests hold it to.
pub fn argmax(x: &[f32]) -> usize {
    assert!(!x.is_empty(), "argmax of an empty row");
    let isa = crate::cpu::Isa::best();
    let m = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::best` only names an instruction set the CPU has.
        crate::cpu::Isa::Avx512 => unsafe { max_avx512(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        crate::cpu::Isa::Avx2 => unsafe { max_avx2(x) },
        _ => max_of(f32::NEG_INFINITY, x),
    };
    // `m` is −∞ when every value is −∞ or NaN; no match means all NaN.
    x.iter().position(|&v| v == m).unwrap_or(0)
}

/// The plain form of [`argmax`]: one comparison per value.
pub fn argmax_ref(x: &[f32]) -> usize {
    assert!(!x.is_empty(), "argmax of an empty row");
    let mut best = 0;
    for (i, &v) in x.iter().enumerate().skip(1) {
        if v > x[best] || (x[best].is_nan() && !v.is_nan()) {
            best = i;
        }
    }
    best
}

/// Largest non-NaN value of `x` (−∞ if none), four 16-lane chains.
///
/// # Safety
/// The CPU supports AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn max_avx512(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let p = x.as_ptr();
    let mut acc = [_mm512_set1_ps(f32::NEG_INFINITY); 4];
    let mut i = 0;
    while i + 64 <= x.len() {
        for (k, a) in acc.iter_mut().enumerate() {
            // `max(v, a)` returns `a` when `v` is NaN.
            *a = _mm512_max_ps(_mm512_loadu_ps(p.add(i + 16 * k)), *a);
        }
        i += 64;
    }
    while i + 16 <= x.len() {
        acc[0] = _mm512_max_ps(_mm512_loadu_ps(p.add(i)), acc[0]);
        i += 16;
    }
    let v = _mm512_max_ps(_mm512_max_ps(acc[0], acc[1]), _mm512_max_ps(acc[2], acc[3]));
    max_of(_mm512_reduce_max_ps(v), &x[i..])
}

/// Largest non-NaN value of `x` (−∞ if none), four 8-lane chains.
///
/// # Safety
/// The CPU supports AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn max_avx2(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let p = x.as_ptr();
    let mut acc = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
    let mut i = 0;
    while i + 32 <= x.len() {
        for (k, a) in acc.iter_mut().enumerate() {
            *a = _mm256_max_ps(_mm256_loadu_ps(p.add(i + 8 * k)), *a);
        }
        i += 32;
    }
    let v = _mm256_max_ps(_mm256_max_ps(acc[0], acc[1]), _mm256_max_ps(acc[2], acc[3]));
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), v);
    max_of(max_of(f32::NEG_INFINITY, &lanes), &x[i..])
}

/// The largest of `m` and the non-NaN values of `x` (a NaN never wins).
fn max_of(m: f32, x: &[f32]) -> f32 {
    x.iter().fold(m, |m, &v| if v > m { v } else { m })
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
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
    }

    #[test]
    fn vector_argmax_is_the_plain_one() {
        // Lengths around every vector and unroll boundary; values from few
        // levels (many ties), with NaN, ±∞ and ±0 sprinkled in, placed
        // before, inside and after the vector part.
        let mut rng = crate::testing::Rng::seeded(11);
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0];
        for len in (1..=140).chain([1023, 49152, 49153]) {
            for _ in 0..8 {
                let mut x: Vec<f32> = (0..len)
                    .map(|_| (rng.next_u64() % 9) as f32 - 4.0)
                    .collect();
                for _ in 0..(rng.next_u64() % 4) {
                    let at = (rng.next_u64() % len as u64) as usize;
                    x[at] = specials[(rng.next_u64() % specials.len() as u64) as usize];
                }
                assert_eq!(argmax(&x), argmax_ref(&x), "len {len}: {x:?}");
                let fill = specials[(rng.next_u64() % 3) as usize];
                let mut y = vec![fill; len];
                y[len / 2] = specials[(rng.next_u64() % specials.len() as u64) as usize];
                assert_eq!(argmax(&y), argmax_ref(&y), "len {len}: {y:?}");
            }
        }
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
