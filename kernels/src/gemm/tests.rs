//! Tests of [`super`] (gemm): every fast path against its plain reference.

use super::*;
use crate::dtype::f32_to_bf16;
use crate::testing::values;

/// Σ|x·w| per output: the scale the rounding error of a dot product is
/// proportional to (tolerances below are relative to it).
fn abs_scale<E: Elem>(x: &[f32], n: usize, w: &[E], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; n * rows];
    for i in 0..n {
        for r in 0..rows {
            out[i * rows + r] = (0..cols)
                .map(|c| (x[i * cols + c] as f64 * w[r * cols + c].to_f32() as f64).abs())
                .sum::<f64>() as f32;
        }
    }
    out
}

/// Asserts |got − want| <= rel·scale + 1e-30 elementwise.
fn assert_close(got: &[f32], want: &[f32], scale: &[f32], rel: f32, what: &str) {
    assert_eq!(got.len(), want.len());
    for (k, ((&g, &r), &s)) in got.iter().zip(want).zip(scale).enumerate() {
        assert!(
            (g - r).abs() <= rel * s + 1e-30,
            "{what}: element {k}: got {g}, want {r} (scale {s})"
        );
    }
}

fn isas() -> Vec<Isa> {
    [Isa::Portable, Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|&i| supported(i))
        .collect()
}

const SHAPES: &[(usize, usize)] = &[(1, 1), (5, 19), (37, 16), (301, 257), (130, 1000)];

fn to_bf16(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| f32_to_bf16(x)).collect()
}

fn to_f16(v: &[f32]) -> Vec<u16> {
    v.iter()
        .map(|&x| half::f16::from_f32(x).to_bits())
        .collect()
}

/// Runs every available GEMV instruction set for n = 1..=4 on every
/// shape and compares with the f64 reference: 1e-5 relative to Σ|x·w|
/// (f32 accumulation vs f64; widening bf16/f16 is exact).
fn check_every_gemv_path<E: Elem>(label: &str, make_w: impl Fn(usize) -> Vec<E>) {
    for &(rows, cols) in SHAPES {
        let w = make_w(rows * cols);
        for n in 1..=GEMV_MAX_N {
            let x = values(2 + n as u64, n * cols);
            let mut want = vec![0.0; n * rows];
            matmul_ref_any(&x, n, &w, rows, cols, &mut want);
            let scale = abs_scale(&x, n, &w, rows, cols);
            for isa in isas() {
                let mut got = vec![f32::NAN; n * rows];
                gemv(isa, &x, n, &w, rows, cols, &mut got);
                let what = format!("{label} {isa:?} n={n} [{rows}x{cols}]");
                assert_close(&got, &want, &scale, 1e-5, &what);
            }
        }
    }
}

#[test]
fn every_gemv_path_matches_f64_reference_f32_weights() {
    check_every_gemv_path("f32", |len| values(1, len));
}

#[test]
fn every_gemv_path_matches_f64_reference_bf16_weights() {
    check_every_gemv_path("bf16", |len| {
        to_bf16(&values(3, len)).into_iter().map(Bf16).collect()
    });
}

#[test]
fn every_gemv_path_matches_f64_reference_f16_weights() {
    check_every_gemv_path("f16", |len| {
        to_f16(&values(5, len)).into_iter().map(F16).collect()
    });
}

#[test]
fn public_matmuls_match_reference_for_gemv_and_gemm_batch_sizes() {
    // n in {1,2,3,7,33}: 1–3 take the GEMV path, 7 and 33 the GEMM path
    // (bf16/f16 with several row tiles, the last one partial).
    // Tolerance 1e-5 relative to Σ|x·w|.
    type Matmul = fn(&[f32], usize, &[u16], usize, usize, &mut [f32]);
    for &(rows, cols) in &[(5usize, 19usize), (301, 257), (333, 70)] {
        let wf = values(7, rows * cols);
        let (wb, wh) = (to_bf16(&wf), to_f16(&wf));
        for &n in &[1usize, 2, 3, 7, 33] {
            let x = values(8 + n as u64, n * cols);
            let (mut want, mut got) = (vec![0.0; n * rows], vec![f32::NAN; n * rows]);
            matmul_f32_ref(&x, n, &wf, rows, cols, &mut want);
            matmul_f32(&x, n, &wf, rows, cols, &mut got);
            let scale = abs_scale(&x, n, &wf, rows, cols);
            assert_close(
                &got,
                &want,
                &scale,
                1e-5,
                &format!("f32 n={n} [{rows}x{cols}]"),
            );
            let cases: [(&str, &[u16], Matmul, Matmul); 2] = [
                ("bf16", &wb, matmul_bf16, matmul_bf16_ref),
                ("f16", &wh, matmul_f16, matmul_f16_ref),
            ];
            for (label, w, fast, oracle) in cases {
                oracle(&x, n, w, rows, cols, &mut want);
                fast(&x, n, w, rows, cols, &mut got);
                let scale = if label == "bf16" {
                    abs_scale(&x, n, bits_as::<Bf16>(w), rows, cols)
                } else {
                    abs_scale(&x, n, bits_as::<F16>(w), rows, cols)
                };
                assert_close(
                    &got,
                    &want,
                    &scale,
                    1e-5,
                    &format!("{label} n={n} [{rows}x{cols}]"),
                );
            }
        }
    }
}

#[test]
fn bf16_gemv_agrees_with_f32_gemv_on_widened_weights() {
    // Same values, same kernel structure: agreement within 1e-6 of Σ|x·w|.
    let (rows, cols) = (777, 333);
    let wb: Vec<u16> = values(9, rows * cols)
        .iter()
        .map(|&v| f32_to_bf16(v))
        .collect();
    let wf: Vec<f32> = wb.iter().map(|&b| crate::dtype::bf16_to_f32(b)).collect();
    for n in 1..=GEMV_MAX_N {
        let x = values(10, n * cols);
        let (mut a, mut b) = (vec![0.0; n * rows], vec![0.0; n * rows]);
        matmul_bf16(&x, n, &wb, rows, cols, &mut a);
        matmul_f32(&x, n, &wf, rows, cols, &mut b);
        assert_close(
            &a,
            &b,
            &abs_scale(&x, n, &wf, rows, cols),
            1e-6,
            &format!("n={n}"),
        );
    }
}

#[test]
fn dot_matches_f64_on_every_path_and_length() {
    // Tolerance 1e-5 relative to Σ|a·b|.
    for len in [0usize, 1, 7, 8, 15, 16, 17, 63, 64, 65, 200, 1031] {
        let a = values(11, len);
        let b = values(12, len);
        let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
        let scale: f64 = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| (x as f64 * y as f64).abs())
            .sum();
        for isa in isas() {
            let got = dot_with(isa, &a, &b) as f64;
            assert!(
                (got - want).abs() <= 1e-5 * scale + 1e-30,
                "{isa:?} len {len}: {got} vs {want}"
            );
        }
        assert!((dot_f32(&a, &b) as f64 - want).abs() <= 1e-5 * scale + 1e-30);
    }
}

#[test]
fn zero_width_input_gives_zero_output() {
    let mut out = vec![1.0; 6];
    matmul_f32(&[], 2, &[], 3, 0, &mut out);
    assert_eq!(out, vec![0.0; 6]);
}

#[test]
fn tiles_stay_within_bounds_and_cache_budget() {
    assert_eq!(tile_rows(4096, 4096, 2), 64);
    assert_eq!(tile_rows(1536, 576, 2), 384usize.min(TILE_MAX_ROWS));
    assert_eq!(tile_rows(10, 100_000, 2), TILE_MIN_ROWS);
    for &(r, c, t) in &[(1usize, 1usize, 1usize), (333, 70, 2), (50_000, 7168, 2)] {
        let tile = tile_rows(r, c, t);
        assert!((TILE_MIN_ROWS..=TILE_MAX_ROWS).contains(&tile) && tile.is_multiple_of(16));
    }
}
