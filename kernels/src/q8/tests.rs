//! Tests of the Q8_0 encoder, decoder and fused products.

use super::*;
use crate::testing::values;

/// `x · Wᵀ` of the decoded weights in f64.
fn reference(x: &[f32], n: usize, w: &[f32], rows: usize, cols: usize) -> Vec<f64> {
    let mut y = vec![0.0f64; n * rows];
    for i in 0..n {
        for r in 0..rows {
            y[i * rows + r] = (0..cols)
                .map(|c| x[i * cols + c] as f64 * w[r * cols + c] as f64)
                .sum();
        }
    }
    y
}

#[test]
fn quantize_block_matches_the_llama_cpp_rule() {
    let mut x = [0.0f32; BLOCK];
    x[0] = 1.27;
    x[1] = -0.635;
    x[2] = 0.0051; // 0.51 steps: 1
    x[3] = 0.0049; // 0.49 steps: 0
    let mut q = [0i8; BLOCK];
    let d = quantize_block(&x, &mut q);
    assert!((d - 0.01).abs() < 1e-9);
    assert_eq!(&q[..4], &[127, -64, 1, 0]);
    // Exact halves go to the even neighbour.
    assert_eq!(
        [0.5f32, 1.5, 2.5, -0.5, -1.5, 126.5].map(round_even),
        [0.0, 2.0, 2.0, -0.0, -2.0, 126.0]
    );
    assert_eq!(round_even(3.7), 4.0);
    assert!(round_even(f32::NAN).is_nan());
    let mut z = [0i8; BLOCK];
    assert_eq!(quantize_block(&[0.0; BLOCK], &mut z), 0.0);
    assert!(z.iter().all(|&v| v == 0));
}

#[test]
fn round_trip_error_is_at_most_half_a_step() {
    let (rows, cols) = (7, 96);
    let w = values(1, rows * cols);
    let (q, d) = quantize(&w, rows, cols).unwrap();
    let back = dequantize(&q, &d, rows, cols).unwrap();
    for (b, (wb, bb)) in w.chunks(BLOCK).zip(back.chunks(BLOCK)).enumerate() {
        for (a, c) in wb.iter().zip(bb) {
            assert!(
                (a - c).abs() <= d[b] * 0.5 * (1.0 + 1e-6),
                "block {b}: {a} vs {c}"
            );
        }
    }
}

#[test]
fn layout_errors_are_reported() {
    assert!(quantize(&[0.0; 40], 1, 40).is_err());
    assert!(check_layout("t", 64, 1, 1, 64).is_err());
    assert!(check_layout("t", 64, 2, 1, 64).is_ok());
}

#[test]
fn f32_product_equals_the_decoded_weights_product() {
    // Tolerance: f32 accumulation, 1e-5 of Σ|x·w| (cols ≤ 160).
    for (rows, cols, n) in [(9, 32, 1), (13, 96, 3), (33, 160, 6), (4, 64, 4)] {
        let w = values(2, rows * cols);
        let x = values(3, n * cols);
        let (q, d) = quantize(&w, rows, cols).unwrap();
        let wd = dequantize(&q, &d, rows, cols).unwrap();
        let want = reference(&x, n, &wd, rows, cols);
        let mut got = vec![0.0f32; n * rows];
        matmul_q8_0(&x, n, &q, &d, rows, cols, &mut got, Activations::F32);
        for (g, e) in got.iter().zip(&want) {
            assert!((*g as f64 - e).abs() <= 1e-5 * cols as f64, "{g} vs {e}");
        }
    }
}

#[test]
fn int8_product_equals_the_exact_integer_block_dot() {
    // Reference: activations rounded with the same rule, dot in f64. Only f32
    // rounding of the per-block terms separates the kernel from it (1e-5 rel).
    if !cpu::features().avx512_vnni {
        eprintln!("skipped: no AVX-512 VNNI on this CPU");
        return;
    }
    for (rows, cols, n) in [
        (9, 32, 1),
        (13, 96, 3),
        (33, 160, 6),
        (4, 64, 4),
        (130, 576, 5),
    ] {
        let w = values(4, rows * cols);
        let x: Vec<f32> = values(5, n * cols).iter().map(|v| v * 3.0).collect();
        let (q, d) = quantize(&w, rows, cols).unwrap();
        let (xq, xd) = quantize(&x, n, cols).unwrap();
        let mut got = vec![0.0f32; n * rows];
        matmul_q8_0(&x, n, &q, &d, rows, cols, &mut got, Activations::Int8);
        for i in 0..n {
            for r in 0..rows {
                let mut want = 0.0f64;
                let mut mag = 0.0f64;
                for b in 0..cols / BLOCK {
                    let s: i64 = (0..BLOCK)
                        .map(|j| {
                            q[r * cols + b * BLOCK + j] as i64 * xq[i * cols + b * BLOCK + j] as i64
                        })
                        .sum();
                    let t =
                        s as f64 * d[r * cols / BLOCK + b] as f64 * xd[i * cols / BLOCK + b] as f64;
                    want += t;
                    mag += t.abs();
                }
                let g = got[i * rows + r] as f64;
                assert!(
                    (g - want).abs() <= 1e-5 * mag.max(1e-12),
                    "({i},{r}): {g} vs {want}"
                );
            }
        }
    }
}

#[test]
fn int8_product_is_within_one_percent_of_the_f32_product() {
    let (rows, cols, n) = (256, 576, 2);
    let w = values(6, rows * cols);
    let x = values(7, n * cols);
    let (q, d) = quantize(&w, rows, cols).unwrap();
    let mut exact = vec![0.0f32; n * rows];
    let mut fast = vec![0.0f32; n * rows];
    matmul_q8_0(&x, n, &q, &d, rows, cols, &mut exact, Activations::F32);
    matmul_q8_0(&x, n, &q, &d, rows, cols, &mut fast, Activations::Int8);
    let err: f64 = exact
        .iter()
        .zip(&fast)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let norm: f64 = exact.iter().map(|a| (*a as f64).powi(2)).sum();
    // Relative RMS error of the int8 activations: measured ~0.5% on uniform data.
    assert!(
        (err / norm).sqrt() < 0.01,
        "relative rms {}",
        (err / norm).sqrt()
    );
}

#[test]
fn non_finite_activations_give_non_finite_outputs() {
    let (rows, cols) = (5, 64);
    let (q, d) = quantize(&values(8, rows * cols), rows, cols).unwrap();
    let mut x = values(9, cols);
    x[40] = f32::NAN;
    for act in [Activations::F32, Activations::Int8] {
        let mut y = vec![0.0f32; rows];
        matmul_q8_0(&x, 1, &q, &d, rows, cols, &mut y, act);
        assert!(y.iter().all(|v| !v.is_finite()), "{act:?}: {y:?}");
    }
}

#[test]
fn large_products_split_over_the_pool_match_the_single_task_result() {
    let (rows, cols, n) = (3000, 128, 2);
    let w = values(10, rows * cols);
    let x = values(11, n * cols);
    let (q, d) = quantize(&w, rows, cols).unwrap();
    for act in [Activations::F32, Activations::Int8] {
        let mut par = vec![0.0f32; n * rows];
        matmul_q8_0(&x, n, &q, &d, rows, cols, &mut par, act);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let mut one = vec![0.0f32; n * rows];
        pool.install(|| matmul_q8_0(&x, n, &q, &d, rows, cols, &mut one, act));
        assert_eq!(par, one, "{act:?}: splitting rows must not change results");
    }
}
