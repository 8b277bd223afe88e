//! Tests of the Q8_0 panel layout and its GEMM.

use super::*;
use crate::int8_rows::{quantize_block, Scheme};
use crate::q8::{dequantize, matmul_q8_0, quantize, Activations};
use crate::testing::values;

/// A `[rows, cols]` Q8_0 matrix of spread values.
fn matrix(rows: usize, cols: usize) -> (Vec<i8>, Vec<f32>) {
    let w: Vec<f32> = values(7, rows * cols).iter().map(|v| v * 3.0).collect();
    quantize(&w, rows, cols).unwrap()
}

#[test]
fn packing_keeps_every_value_and_scale() {
    // 37 rows: two whole panels and a partial one; 96 columns: 3 blocks.
    let (rows, cols) = (37, 96);
    let (q, d) = matrix(rows, cols);
    let p = Q8Panels::pack(&q, &d, rows, cols).unwrap();
    assert_eq!((p.rows(), p.cols()), (rows, cols));
    assert_eq!(p.unpack(), (q.clone(), d.clone()));
    // 9 bits per weight, the last panel padded to 16 rows.
    assert_eq!(p.nbytes(), rows.div_ceil(16) * 16 * (cols + cols / 32 * 4));
    let w = dequantize(&q, &d, rows, cols).unwrap();
    let mut row = vec![0.0; cols];
    for r in [0, 15, 16, rows - 1] {
        p.dequantize_row(r, &mut row);
        assert_eq!(row, w[r * cols..(r + 1) * cols], "row {r}");
    }
    assert!(Q8Panels::pack(&q[1..], &d, rows, cols).is_err());
}

#[test]
fn panel_gemm_equals_the_exact_product_of_the_rounded_values() {
    let (rows, cols) = (37, 160);
    let (q, d) = matrix(rows, cols);
    let w = dequantize(&q, &d, rows, cols).unwrap();
    let p = Q8Panels::pack(&q, &d, rows, cols).unwrap();
    // Batches on both sides of the 8-row tile.
    for n in [1, 3, 8, 13] {
        let x: Vec<f32> = values(n as u64 + 11, n * cols);
        // The activations the kernel sees, from its own rounding.
        let mut xr = vec![0.0f32; n * cols];
        let mut qb = [0u8; BLOCK];
        for (blk, out) in x.chunks_exact(BLOCK).zip(xr.chunks_exact_mut(BLOCK)) {
            let (dx, _) = quantize_block(Scheme::Q8_0, blk, &mut qb);
            for (o, &v) in out.iter_mut().zip(&qb) {
                *o = v as i8 as f32 * dx;
            }
        }
        let mut y = vec![0.0; n * rows];
        p.matmul_with(Q8PanelKernel::Portable, &x, n, &mut y);
        let mut row = vec![0.0; n * rows];
        matmul_q8_0(&x, n, &q, &d, rows, cols, &mut row, Activations::Int8);
        for i in 0..n {
            for r in 0..rows {
                let (a, b) = (&xr[i * cols..(i + 1) * cols], &w[r * cols..(r + 1) * cols]);
                let exact: f64 = a.iter().zip(b).map(|(&u, &v)| u as f64 * v as f64).sum();
                let mag: f64 = a
                    .iter()
                    .zip(b)
                    .map(|(&u, &v)| (u as f64 * v as f64).abs())
                    .sum();
                // Per block one exact integer dot, one rounded scale product
                // and one fused add: within 1e-6 of the magnitude.
                let got = y[i * rows + r] as f64;
                assert!(
                    (got - exact).abs() <= 1e-6 * mag + 1e-30,
                    "n {n} ({i}, {r}): {got} vs {exact} (|terms| {mag})"
                );
                // The row kernel approximates the same value (its rounding
                // computes 1/d, not 127/amax, so an element on a half step
                // may round the other way; without VNNI it runs in f32).
                let tol = 2e-2;
                let other = row[i * rows + r] as f64;
                assert!(
                    (other - exact).abs() <= tol * mag + 1e-30,
                    "row kernel n {n} ({i}, {r}): {other} vs {exact}"
                );
            }
        }
    }
}

#[test]
fn simd_and_portable_tiles_agree_bit_for_bit() {
    if !Q8PanelKernel::Avx512Vnni.supported() {
        eprintln!("no AVX-512 VNNI here: only the portable tile runs");
        return;
    }
    // Block counts 1, 3 and 18 (fewer blocks than the AMX tile's lag, odd, even).
    for (rows, cols, ns) in [(53, 576, 1..=17), (20, 32, 5..=9), (33, 96, 5..=9)] {
        let (q, d) = matrix(rows, cols);
        let p = Q8Panels::pack(&q, &d, rows, cols).unwrap();
        for n in ns.chain([20, 35]) {
            let x: Vec<f32> = values(n as u64, n * cols);
            let (mut a, mut b) = (vec![0.0; n * rows], vec![0.0; n * rows]);
            p.matmul_with(Q8PanelKernel::Avx512Vnni, &x, n, &mut a);
            p.matmul_with(Q8PanelKernel::Portable, &x, n, &mut b);
            assert_eq!(a, b, "n {n}");
            if Q8PanelKernel::Amx.supported() {
                let mut t = vec![0.0; n * rows];
                p.matmul_with(Q8PanelKernel::Amx, &x, n, &mut t);
                assert_eq!(t, b, "n {n}: the AMX tile");
            }
            let mut best = vec![0.0; n * rows];
            p.matmul(&x, n, &mut best);
            assert_eq!(best, a, "n {n}: matmul runs the best tile");
        }
    }
}

#[test]
fn non_finite_activations_give_non_finite_outputs_of_their_row_only() {
    let (rows, cols, n) = (20, 64, 3);
    let (q, d) = matrix(rows, cols);
    let p = Q8Panels::pack(&q, &d, rows, cols).unwrap();
    let mut x = values(5, n * cols);
    x[cols + 7] = f32::INFINITY;
    let mut y = vec![0.0; n * rows];
    p.matmul(&x, n, &mut y);
    assert!(y[rows..2 * rows].iter().all(|v| v.is_nan()));
    assert!(y[..rows]
        .iter()
        .chain(&y[2 * rows..])
        .all(|v| v.is_finite()));
}

#[test]
fn a_product_into_unwritten_outputs_writes_every_output_as_the_zeroed_form_does() {
    // 37 rows: a partial last panel; batches on both sides of the tile height.
    let (rows, cols) = (37, 160);
    let (q, d) = matrix(rows, cols);
    let p = Q8Panels::pack(&q, &d, rows, cols).unwrap();
    for n in [1, 3, 8, 13] {
        let x: Vec<f32> = values(n as u64, n * cols);
        let mut want = vec![0.0; n * rows];
        p.matmul(&x, n, &mut want);
        let mut got = vec![MaybeUninit::new(f32::NAN); n * rows];
        p.matmul_uninit(&x, n, &mut got);
        // SAFETY: every element was initialised (to NaN) before the product.
        let got: Vec<f32> = got.iter().map(|v| unsafe { v.assume_init() }).collect();
        // Bit-identical and no NaN left: every output was written.
        assert_eq!(got, want, "n {n}");
    }
}
