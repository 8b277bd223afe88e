//! Tests of [`super`]: the panel GEMM against the plain decoder and an
//! f64 product, every kernel this CPU runs, odd shapes.

use super::{PanelKernel, Panels, PANEL_ROWS};
use crate::mxfp4::*;
use crate::testing::Rng;

/// Random packed matrix with scale bytes around 2^0 (120..=130).
fn random_packed(rng: &mut Rng, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    let nb = rows * cols / 32;
    let blocks = (0..nb * 16).map(|_| rng.next_u64() as u8).collect();
    let scales = (0..nb).map(|_| 120 + (rng.next_u64() % 11) as u8).collect();
    (blocks, scales)
}

fn kernels() -> Vec<PanelKernel> {
    PanelKernel::ALL
        .into_iter()
        .filter(|k| k.supported())
        .collect()
}

/// Output rows not a multiple of 16, activation rows not a multiple of any
/// tile height, cols = 32·k.
const SHAPES: [(usize, usize); 6] = [(1, 32), (7, 96), (16, 64), (37, 544), (130, 64), (19, 160)];
const NS: [usize; 7] = [1, 2, 3, 6, 9, 17, 22];

#[test]
fn pack_then_unpack_is_the_identity_and_keeps_the_byte_count() {
    let mut rng = Rng::new(3);
    for &(rows, cols) in &SHAPES {
        let (blocks, scales) = random_packed(&mut rng, rows, cols);
        let p = Panels::pack(&blocks, &scales, rows, cols).expect("valid layout");
        assert_eq!(
            p.unpack(),
            (blocks.clone(), scales.clone()),
            "[{rows}x{cols}]"
        );
        let padded = rows.div_ceil(PANEL_ROWS) * PANEL_ROWS;
        assert_eq!(
            p.nbytes(),
            padded * cols * 17 / 32 + rows.div_ceil(PANEL_ROWS),
            "[{rows}x{cols}]: codes and scales of the padded rows, one flag per panel"
        );
    }
    assert!(
        Panels::pack(&[0; 16], &[0; 2], 1, 32).is_err(),
        "wrong scale count"
    );
    assert!(
        Panels::pack(&[0; 8], &[0; 1], 1, 16).is_err(),
        "cols not 32·k"
    );
}

#[test]
fn rows_read_from_panels_equal_the_row_layout_and_its_decoding_bit_for_bit() {
    let mut rng = Rng::new(8);
    for &(rows, cols) in &SHAPES {
        let (blocks, mut scales) = random_packed(&mut rng, rows, cols);
        // Every E8M0 class: NaN (255), the smallest (0), the top (254).
        for (i, s) in scales.iter_mut().enumerate() {
            *s = match i % 7 {
                0 => E8M0_NAN,
                3 => 0,
                5 => 254,
                _ => *s,
            };
        }
        let p = Panels::pack(&blocks, &scales, rows, cols).expect("valid layout");
        let want = dequantize(&blocks, &scales, rows, cols).expect("valid layout");
        let nb = cols / BLOCK_ELEMS;
        let (mut rb, mut rs, mut out) = (vec![0; nb * 16], vec![0; nb], vec![0.0; cols]);
        for row in 0..rows {
            p.row_into(row, &mut rb, &mut rs);
            assert_eq!(
                rb,
                blocks[row * nb * 16..(row + 1) * nb * 16],
                "[{rows}x{cols}] row {row}"
            );
            assert_eq!(
                rs,
                scales[row * nb..(row + 1) * nb],
                "[{rows}x{cols}] row {row}"
            );
            p.dequantize_row(row, &mut out);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&out),
                bits(&want[row * cols..(row + 1) * cols]),
                "[{rows}x{cols}] row {row} decoded"
            );
        }
    }
}

/// f64 product of `x` with the decoded weights, and the int8 error bound of
/// every output: `Σ_b Σ|w|·d_b/2 · (1 + 2⁻²⁰)` plus f32 summation
/// (`cols · 2⁻²³ · Σ|w·x|`), as stated on `matmul_mxfp4_q8`.
fn reference_and_bound(
    x: &[f32],
    n: usize,
    w: &[f32],
    rows: usize,
    cols: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (mut y, mut bound) = (vec![0.0; n * rows], vec![0.0; n * rows]);
    for i in 0..n {
        let xi = &x[i * cols..(i + 1) * cols];
        let d: Vec<f64> = xi
            .chunks_exact(32)
            .map(|b| b.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64 / 127.0)
            .collect();
        for r in 0..rows {
            let wr = &w[r * cols..(r + 1) * cols];
            let (mut s, mut mag, mut q) = (0.0f64, 0.0f64, 0.0f64);
            for k in 0..cols {
                let p = xi[k] as f64 * wr[k] as f64;
                s += p;
                mag += p.abs();
                q += wr[k].abs() as f64 * d[k / 32] * 0.5 * (1.0 + 2f64.powi(-20));
            }
            y[i * rows + r] = s;
            bound[i * rows + r] = q + cols as f64 * f32::EPSILON as f64 * mag + 1e-30;
        }
    }
    (y, bound)
}

#[test]
fn every_kernel_meets_the_int8_bound_against_the_plain_decoder() {
    let mut rng = Rng::new(21);
    for &(rows, cols) in &SHAPES {
        let (blocks, scales) = random_packed(&mut rng, rows, cols);
        let w = dequantize(&blocks, &scales, rows, cols).expect("valid layout");
        let p = Panels::pack(&blocks, &scales, rows, cols).expect("valid layout");
        for &n in &NS {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.next_f32() * 3.0).collect();
            let (want, bound) = reference_and_bound(&x, n, &w, rows, cols);
            for k in kernels() {
                let mut y = vec![f32::NAN; n * rows];
                p.matmul_with(k, &x, n, &mut y);
                for (j, (&got, (&wv, &b))) in y.iter().zip(want.iter().zip(&bound)).enumerate() {
                    assert!(
                        (got as f64 - wv).abs() <= b,
                        "{k:?} [{rows}x{cols}] n {n} out[{j}] {got} vs {wv} ± {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn every_kernel_is_bit_identical_to_the_portable_one() {
    let mut rng = Rng::new(5);
    for &(rows, cols) in &SHAPES {
        let (blocks, scales) = random_packed(&mut rng, rows, cols);
        let p = Panels::pack(&blocks, &scales, rows, cols).expect("valid layout");
        for &n in &NS {
            // Outliers in some blocks, so d varies a lot between blocks.
            let x: Vec<f32> = (0..n * cols)
                .map(|i| rng.next_f32() * if i % 53 == 0 { 40.0 } else { 1.0 })
                .collect();
            let mut want = vec![0.0; n * rows];
            p.matmul_with(PanelKernel::Portable, &x, n, &mut want);
            for k in kernels() {
                let mut y = vec![f32::NAN; n * rows];
                p.matmul_with(k, &x, n, &mut y);
                let same = y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{k:?} [{rows}x{cols}] n {n}");
            }
        }
    }
}

#[test]
fn panels_agree_with_the_row_layout_int8_kernel() {
    // Same rounding of the activations, other summation order: agreement to
    // f32 summation rounding (1e-5 of Σ|w·x|).
    let mut rng = Rng::new(8);
    let (rows, cols, n) = (45, 384, 11);
    let (blocks, scales) = random_packed(&mut rng, rows, cols);
    let w = dequantize(&blocks, &scales, rows, cols).expect("valid layout");
    let p = Panels::pack(&blocks, &scales, rows, cols).expect("valid layout");
    let x: Vec<f32> = (0..n * cols).map(|_| rng.next_f32()).collect();
    let mut a = vec![0.0; n * rows];
    let mut b = vec![0.0; n * rows];
    p.matmul(&x, n, &mut a);
    matmul_mxfp4_q8(&x, n, &blocks, &scales, rows, cols, &mut b);
    if !q8_available() {
        return; // the row-layout call ran the exact kernel: covered by the bound test
    }
    for i in 0..n {
        for r in 0..rows {
            let mag: f64 = (0..cols)
                .map(|k| (x[i * cols + k] * w[r * cols + k]).abs() as f64)
                .sum();
            let (u, v) = (a[i * rows + r], b[i * rows + r]);
            assert!((u - v).abs() as f64 <= 1e-5 * mag + 1e-30, "{u} vs {v}");
        }
    }
}

#[test]
fn special_scales_nan_and_subnormal_decode_in_every_kernel() {
    let mut rng = Rng::new(13);
    let (rows, cols, n) = (33, 160, 5);
    let (blocks, mut scales) = random_packed(&mut rng, rows, cols);
    let nb = cols / 32;
    scales[4 * nb + 2] = E8M0_NAN; // row 4
    scales[20 * nb] = 0; // row 20: 2^-127, as good as zero next to 2^-7..2^3
    let p = Panels::pack(&blocks, &scales, rows, cols).expect("valid layout");
    let w = dequantize(&blocks, &scales, rows, cols).expect("valid layout");
    let x: Vec<f32> = (0..n * cols).map(|_| rng.next_f32()).collect();
    let (want, bound) = reference_and_bound(&x, n, &w, rows, cols);
    let mut first: Option<Vec<f32>> = None;
    for k in kernels() {
        let mut y = vec![0.0; n * rows];
        p.matmul_with(k, &x, n, &mut y);
        for i in 0..n {
            for r in 0..rows {
                let (got, j) = (y[i * rows + r], i * rows + r);
                if r == 4 {
                    assert!(got.is_nan(), "{k:?} row 4 must be NaN");
                } else {
                    assert!((got as f64 - want[j]).abs() <= bound[j], "{k:?} out[{j}]");
                }
            }
        }
        if let Some(f) = &first {
            assert!(
                f.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{k:?}"
            );
        }
        first = Some(y);
    }
}

#[test]
fn non_finite_activations_make_only_their_rows_non_finite() {
    let mut rng = Rng::new(17);
    let (rows, cols, n) = (20, 96, 4);
    let (blocks, scales) = random_packed(&mut rng, rows, cols);
    let p = Panels::pack(&blocks, &scales, rows, cols).expect("valid layout");
    let mut x: Vec<f32> = (0..n * cols).map(|_| rng.next_f32()).collect();
    x[cols + 40] = f32::NAN;
    x[3 * cols + 5] = f32::INFINITY;
    for k in kernels() {
        let mut y = vec![0.0; n * rows];
        p.matmul_with(k, &x, n, &mut y);
        for i in 0..n {
            let bad = i == 1 || i == 3;
            for r in 0..rows {
                assert_eq!(!y[i * rows + r].is_finite(), bad, "{k:?} out[{i}, {r}]");
            }
        }
    }
}

#[test]
fn serial_and_pool_runs_are_bit_identical_and_empty_products_are_handled() {
    let mut rng = Rng::new(29);
    let (rows, cols, n) = (300, 256, 70);
    let (blocks, scales) = random_packed(&mut rng, rows, cols);
    let p = Panels::pack(&blocks, &scales, rows, cols).expect("valid layout");
    let x: Vec<f32> = (0..n * cols).map(|_| rng.next_f32()).collect();
    let mut a = vec![0.0; n * rows];
    let mut b = vec![0.0; n * rows];
    p.matmul(&x, n, &mut a);
    crate::threads::serial(|| p.matmul(&x, n, &mut b));
    assert!(a.iter().zip(&b).all(|(u, v)| u.to_bits() == v.to_bits()));

    let mut none: Vec<f32> = Vec::new();
    p.matmul(&[], 0, &mut none);
    let e = Panels::pack(&[], &[], 0, 64).expect("no rows");
    e.matmul(&vec![1.0; 3 * 64], 3, &mut none);
}

#[test]
fn a_grouped_product_equals_one_call_per_matrix_bit_for_bit() {
    let mut rng = Rng::new(11);
    // q, k, v of a small GQA layer (one partial panel each) and gate/up.
    for sizes in [[40usize, 24, 24].as_slice(), &[70, 70], &[5]] {
        let cols = 96;
        let mats: Vec<Panels> = sizes
            .iter()
            .map(|&rows| {
                let (b, s) = random_packed(&mut rng, rows, cols);
                Panels::pack(&b, &s, rows, cols).expect("valid layout")
            })
            .collect();
        for &n in &NS {
            let x = rng.vec(n * cols, 2.0);
            let want: Vec<Vec<f32>> = mats
                .iter()
                .map(|m| {
                    let mut o = vec![0.0; n * m.rows()];
                    m.matmul(&x, n, &mut o);
                    o
                })
                .collect();
            let mut got: Vec<Vec<f32>> =
                mats.iter().map(|m| vec![f32::NAN; n * m.rows()]).collect();
            let refs: Vec<&Panels> = mats.iter().collect();
            let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|o| o.as_mut_slice()).collect();
            Panels::matmul_group(&refs, &x, n, &mut outs);
            assert_eq!(got, want, "{sizes:?}, n {n}");
        }
    }
}

/// `len` outputs that read NaN until written.
fn unwritten(len: usize) -> Vec<std::mem::MaybeUninit<f32>> {
    vec![std::mem::MaybeUninit::new(f32::NAN); len]
}

/// The values of outputs that the product must have written.
fn written(out: &[std::mem::MaybeUninit<f32>]) -> Vec<f32> {
    // SAFETY: `unwritten` initialised every element (to NaN before the product).
    out.iter().map(|v| unsafe { v.assume_init() }).collect()
}

#[test]
fn products_into_unwritten_outputs_write_every_output_as_the_zeroed_forms_do() {
    let mut rng = Rng::new(41);
    for &(rows, cols) in &SHAPES {
        let (blocks, scales) = random_packed(&mut rng, rows, cols);
        let p = Panels::pack(&blocks, &scales, rows, cols).expect("valid layout");
        let q = Panels::pack(&blocks, &scales, rows, cols).expect("valid layout");
        for &n in &NS {
            let x = rng.vec(n * cols, 2.0);
            let mut want = vec![0.0; n * rows];
            p.matmul(&x, n, &mut want);
            let mut got = unwritten(n * rows);
            p.matmul_uninit(&x, n, &mut got);
            // Bit-identical and no NaN left: every output was written.
            assert_eq!(written(&got), want, "{rows}x{cols}, n {n}");
            let (mut g0, mut g1) = (unwritten(n * rows), unwritten(n * rows));
            Panels::matmul_group_uninit(&[&p, &q], &x, n, &mut [&mut g0[..], &mut g1[..]]);
            assert_eq!(written(&g0), want, "group, {rows}x{cols}, n {n}");
            assert_eq!(written(&g1), want, "group, {rows}x{cols}, n {n}");
        }
    }
    // No rows of activations: nothing to write; a width of 0: zeros.
    let e = Panels::pack(&[], &[], 3, 0).expect("no columns");
    let mut z = unwritten(2 * 3);
    e.matmul_uninit(&[], 2, &mut z);
    assert_eq!(written(&z), vec![0.0; 6]);
}
