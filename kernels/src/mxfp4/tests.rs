//! Tests of [`super`] (mxfp4): every fast path against its plain reference.

use super::*;
use crate::testing::Rng;

/// Random packed matrix with scale bytes around 2^0 (120..=130).
fn random_packed(rng: &mut Rng, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    let nb = rows * cols / 32;
    let blocks = (0..nb * 16).map(|_| rng.next_u64() as u8).collect();
    let scales = (0..nb).map(|_| 120 + (rng.next_u64() % 11) as u8).collect();
    (blocks, scales)
}

/// f64 reference product from the plain decoder, and Σ|w·x| per output.
fn reference(x: &[f32], n: usize, w: &[f32], rows: usize, cols: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut y, mut mag) = (vec![0.0; n * rows], vec![0.0; n * rows]);
    for i in 0..n {
        for r in 0..rows {
            for k in 0..cols {
                let p = x[i * cols + k] as f64 * w[r * cols + k] as f64;
                y[i * rows + r] += p;
                mag[i * rows + r] += p.abs();
            }
        }
    }
    (y, mag)
}

/// Kernels this CPU can run.
fn available_isas() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.supported()).collect()
}

const SHAPES: [(usize, usize); 5] = [(1, 32), (7, 96), (37, 544), (130, 64), (19, 160)];
const NS: [usize; 4] = [1, 2, 5, 17];

#[test]
fn e2m1_table_is_the_ocp_value_list() {
    let pos = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    for c in 0..8 {
        assert_eq!(E2M1_VALUES[c], pos[c]);
        assert_eq!(E2M1_VALUES[c + 8], -pos[c]);
        assert!(
            E2M1_VALUES[c + 8].is_sign_negative(),
            "code {} carries the sign bit",
            c + 8
        );
        assert_eq!(E2M1_X2_I8[c] as f32, 2.0 * pos[c]);
        assert_eq!(E2M1_X2_I8[c + 8] as f32, -2.0 * pos[c]);
    }
}

#[test]
fn e8m0_decodes_powers_of_two_and_ff_to_nan() {
    for e in 0..=254u8 {
        assert_eq!(e8m0_to_f32(e) as f64, 2f64.powi(e as i32 - 127), "byte {e}");
    }
    assert_eq!(e8m0_to_f32(127), 1.0);
    assert!(e8m0_to_f32(0xFF).is_nan());
}

#[test]
fn decode_block_puts_low_nibble_first() {
    let mut block = [0u8; 16];
    block[0] = 0x71; // element 0 = code 1 (0.5), element 1 = code 7 (6)
    block[15] = 0xF8; // element 30 = code 8 (-0), element 31 = code 15 (-6)
    let mut out = [1.0f32; 32];
    decode_block(&block, 128, &mut out); // scale 2
    assert_eq!((out[0], out[1]), (1.0, 12.0));
    assert!(out[30] == 0.0 && out[30].is_sign_negative());
    assert_eq!(out[31], -12.0);
    assert!(out[2..30].iter().all(|&v| v == 0.0));
}

#[test]
fn nan_scale_decodes_whole_block_to_nan() {
    let mut out = [0.0f32; 32];
    decode_block(&[0u8; 16], E8M0_NAN, &mut out);
    assert!(out.iter().all(|v| v.is_nan()));
    let w = dequantize(&[0x21; 32], &[127, E8M0_NAN], 1, 64).expect("valid layout");
    assert!(w[..32].iter().all(|v| v.is_finite()) && w[32..].iter().all(|v| v.is_nan()));
}

#[test]
fn every_code_round_trips_at_every_scale() {
    // Element 0 holds code 7 (6.0), so the block's amax pins the exponent.
    // Scales 253 and 254 are left out: 4·2^126 and above overflow f32 to ∞.
    for scale in 0..=252u8 {
        for code in 0..16u8 {
            let mut block = [0u8; 16];
            block[0] = 0x07 | (code << 4);
            block[9] = code | (code << 4);
            let mut vals = [0.0f32; 32];
            decode_block(&block, scale, &mut vals);
            assert_eq!(
                quantize_block(&vals),
                (block, scale),
                "scale {scale} code {code}"
            );
        }
    }
}

#[test]
fn quantize_of_decoded_block_is_identity_when_max_code_is_4_or_6() {
    let mut rng = Rng::new(7);
    for _ in 0..5000 {
        let mut block: [u8; 16] = std::array::from_fn(|_| rng.next_u64() as u8);
        let big = [6u8, 7, 14, 15][(rng.next_u64() % 4) as usize];
        let pos = (rng.next_u64() % 32) as usize;
        block[pos / 2] = if pos.is_multiple_of(2) {
            (block[pos / 2] & 0xF0) | big
        } else {
            (block[pos / 2] & 0x0F) | (big << 4)
        };
        let scale = (rng.next_u64() % 253) as u8; // 0..=252: decoded values stay finite
        let mut vals = [0.0f32; 32];
        decode_block(&block, scale, &mut vals);
        assert_eq!(quantize_block(&vals), (block, scale));
    }
}

#[test]
fn quantize_error_is_within_half_a_grid_step_or_saturates() {
    let mut rng = Rng::new(11);
    for _ in 0..3000 {
        let mag = 2f32.powi((rng.next_u64() % 40) as i32 - 20);
        let x: [f32; 32] = std::array::from_fn(|_| rng.next_f32() * mag);
        let (b, s) = quantize_block(&x);
        let mut q = [0.0f32; 32];
        decode_block(&b, s, &mut q);
        let step = e8m0_to_f32(s);
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(
            (4.0..8.0).contains(&(amax / step)),
            "exponent puts amax in [4, 8) steps"
        );
        for (&xi, &qi) in x.iter().zip(&q) {
            let m = xi.abs() / step;
            if m > 6.0 {
                assert_eq!(qi, 6.0 * step * xi.signum(), "saturates to ±6·scale");
            } else {
                let half_gap = if m <= 2.0 {
                    0.25
                } else if m <= 4.0 {
                    0.5
                } else {
                    1.0
                };
                assert!(
                    (xi - qi).abs() <= half_gap * step,
                    "x {xi} q {qi} step {step}"
                );
            }
        }
    }
}

#[test]
fn quantize_saturates_values_between_6_and_8_steps() {
    let mut x = [0.0f32; 32];
    x[0] = 7.9;
    x[1] = -6.9;
    x[2] = 4.0;
    let (b, s) = quantize_block(&x);
    assert_eq!(s, 127, "floor(log2 7.9) - 2 = 0");
    let mut q = [0.0f32; 32];
    decode_block(&b, s, &mut q);
    assert_eq!(&q[..3], &[6.0, -6.0, 4.0]);
}

#[test]
fn quantize_ties_round_to_the_even_code() {
    let mids = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let expect = [0.0f32, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0];
    let mut x = [0.0f32; 32];
    x[31] = 4.0; // pins the scale to 2^0
    for (i, &m) in mids.iter().enumerate() {
        x[2 * i] = m;
        x[2 * i + 1] = -m;
    }
    let (b, s) = quantize_block(&x);
    assert_eq!(s, 127);
    let mut q = [0.0f32; 32];
    decode_block(&b, s, &mut q);
    for (i, &e) in expect.iter().enumerate() {
        assert_eq!((q[2 * i], q[2 * i + 1]), (e, -e), "tie at {}", mids[i]);
    }
}

#[test]
fn zero_block_gets_scale_127_and_non_finite_block_gets_nan_scale() {
    let (b, s) = quantize_block(&[0.0; 32]);
    assert_eq!((b, s), ([0; 16], ZERO_BLOCK_SCALE));
    let mut x = [1.0f32; 32];
    x[3] = f32::NAN;
    assert_eq!(quantize_block(&x).1, E8M0_NAN);
    x[3] = f32::INFINITY;
    assert_eq!(quantize_block(&x).1, E8M0_NAN);
    let tiny = [f32::from_bits(1); 32]; // 2^-149 clamps the exponent to -127
    let (b, s) = quantize_block(&tiny);
    assert_eq!(
        (b, s),
        ([0; 16], 0),
        "rounds to zero codes at the smallest scale"
    );
}

#[test]
fn shapes_that_are_not_whole_blocks_are_rejected() {
    assert!(matches!(
        quantize(&[0.0; 40], 1, 40),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        quantize(&[0.0; 64], 1, 32),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        dequantize(&[0; 20], &[0; 1], 1, 40),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        dequantize(&[0; 16], &[0; 2], 1, 32),
        Err(Error::Shape { .. })
    ));
    let (b, s) = quantize(&[1.0; 64], 2, 32).expect("whole blocks");
    assert_eq!((b.len(), s.len()), (32, 2));
}

/// Checks `y` against the f64 reference with `|Δ| ≤ cols·2⁻²³·Σ|w·x| + 1e-30`.
fn assert_close(y: &[f32], reference: &(Vec<f64>, Vec<f64>), cols: usize, what: &str) {
    for (k, (&v, (&r, &m))) in y
        .iter()
        .zip(reference.0.iter().zip(&reference.1))
        .enumerate()
    {
        let tol = cols as f64 * f32::EPSILON as f64 * m + 1e-30;
        assert!(
            (v as f64 - r).abs() <= tol,
            "{what}: out[{k}] = {v}, want {r} ± {tol}"
        );
    }
}

#[test]
fn every_exact_kernel_matches_f64_reference_on_odd_shapes() {
    let mut rng = Rng::new(3);
    for &(rows, cols) in &SHAPES {
        let (blocks, scales) = random_packed(&mut rng, rows, cols);
        let w = dequantize(&blocks, &scales, rows, cols).expect("valid layout");
        for &n in &NS {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.next_f32()).collect();
            let want = reference(&x, n, &w, rows, cols);
            for isa in available_isas() {
                for slice in [1, 4, slice_blocks(n, 128, 1)] {
                    let mut y = vec![f32::NAN; n * rows];
                    matmul_exact(isa, slice, &x, n, &blocks, &scales, rows, cols, &mut y);
                    assert_close(
                        &y,
                        &want,
                        cols,
                        &format!("{isa:?} slice {slice} [{rows}x{cols}] n {n}"),
                    );
                }
            }
            let mut y = vec![f32::NAN; n * rows];
            matmul_mxfp4(&x, n, &blocks, &scales, rows, cols, &mut y);
            assert_close(&y, &want, cols, "matmul_mxfp4");
        }
    }
}

#[test]
fn k_sliced_products_match_reference() {
    let mut rng = Rng::new(5);
    let (rows, cols, n) = (5, 4160, 33); // 130 blocks
    let (blocks, scales) = random_packed(&mut rng, rows, cols);
    let w = dequantize(&blocks, &scales, rows, cols).expect("valid layout");
    let x: Vec<f32> = (0..n * cols).map(|_| rng.next_f32()).collect();
    let want = reference(&x, n, &w, rows, cols);
    for slice in [7, 64, 130, slice_blocks(n, 128, 1)] {
        let mut y = vec![f32::NAN; n * rows];
        matmul_exact(
            Isa::best(),
            slice,
            &x,
            n,
            &blocks,
            &scales,
            rows,
            cols,
            &mut y,
        );
        assert_close(&y, &want, cols, &format!("exact, slice {slice}"));
    }
    if q8_available() {
        let mut whole = vec![f32::NAN; n * rows];
        matmul_q8(132, &x, n, &blocks, &scales, rows, cols, &mut whole);
        for slice in [4, 8, 128] {
            let mut y = vec![f32::NAN; n * rows];
            matmul_q8(slice, &x, n, &blocks, &scales, rows, cols, &mut y);
            // Same integer sums, only the f32 summation order differs.
            for (k, (&a, &b)) in y.iter().zip(&whole).enumerate() {
                let tol = cols as f64 * f32::EPSILON as f64 * want.1[k];
                assert!(
                    ((a - b) as f64).abs() <= tol,
                    "q8 slice {slice}: out[{k}] {a} vs {b}"
                );
            }
        }
    }
}

/// The int8 scheme in plain scalar code: per block `Σ q·(2w)` in i64, times `(d/2)·s`.
fn q8_scalar(x: &[f32], w_blocks: &[u8], scales: &[u8]) -> f64 {
    let mut y = 0.0f64;
    for (b, xb) in x.chunks_exact(32).enumerate() {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut dot = 0i64;
        for j in 0..16 {
            let byte = w_blocks[(b * 16) + j];
            let q = |v: f32| crate::q8::round_even(v * inv).clamp(-127.0, 127.0) as i64;
            dot += q(xb[2 * j]) * E2M1_X2_I8[(byte & 15) as usize] as i64;
            dot += q(xb[2 * j + 1]) * E2M1_X2_I8[(byte >> 4) as usize] as i64;
        }
        y += dot as f64 * ((amax / 127.0 * 0.5) * e8m0_to_f32(scales[b])) as f64;
    }
    y
}

#[test]
fn q8_kernel_matches_scalar_int8_model_and_stays_within_its_bound() {
    let mut rng = Rng::new(9);
    for &(rows, cols) in &SHAPES {
        let (blocks, scales) = random_packed(&mut rng, rows, cols);
        let w = dequantize(&blocks, &scales, rows, cols).expect("valid layout");
        let nb = cols / 32;
        for &n in &NS {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.next_f32() * 3.0).collect();
            let (want, mag) = reference(&x, n, &w, rows, cols);
            let mut y = vec![f32::NAN; n * rows];
            matmul_mxfp4_q8(&x, n, &blocks, &scales, rows, cols, &mut y);
            // Typical size: relative RMS error 0.3–0.7% on these uniform
            // activations (~1.1% when blocks hold 20× outliers); asserted < 1%.
            let err2: f64 = y
                .iter()
                .zip(&want)
                .map(|(&a, &b)| (a as f64 - b).powi(2))
                .sum();
            let ref2: f64 = want.iter().map(|b| b * b).sum();
            let rel_rms = (err2 / ref2).sqrt();
            assert!(
                rel_rms < 0.01,
                "[{rows}x{cols}] n {n}: relative RMS {rel_rms}"
            );
            for i in 0..n {
                for r in 0..rows {
                    let xi = &x[i * cols..(i + 1) * cols];
                    // Bound: Σ|w|·d/2 per block (d = amax/127), plus f32 summation.
                    let mut bound = cols as f64 * f32::EPSILON as f64 * mag[i * rows + r] + 1e-30;
                    for (b, xb) in xi.chunks_exact(32).enumerate() {
                        let d = xb.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64 / 127.0;
                        let wsum: f64 = w[r * cols + 32 * b..r * cols + 32 * b + 32]
                            .iter()
                            .map(|v| v.abs() as f64)
                            .sum();
                        bound += wsum * d * 0.5 * (1.0 + 2f64.powi(-20));
                    }
                    let got = y[i * rows + r] as f64;
                    let k = i * rows + r;
                    assert!(
                        (got - want[k]).abs() <= bound,
                        "[{rows}x{cols}] n {n} out[{k}] {got} vs {} ± {bound}",
                        want[k]
                    );
                    if q8_available() {
                        let model = q8_scalar(
                            xi,
                            &blocks[r * nb * 16..(r + 1) * nb * 16],
                            &scales[r * nb..(r + 1) * nb],
                        );
                        let tol = 1e-5 * mag[k] + 1e-30;
                        assert!(
                            (got - model).abs() <= tol,
                            "int8 model {model} vs kernel {got}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn nan_scale_block_makes_only_its_rows_nan_in_every_kernel() {
    let mut rng = Rng::new(13);
    let (rows, cols) = (9, 160);
    let (blocks, mut scales) = random_packed(&mut rng, rows, cols);
    scales[3 * 5 + 4] = E8M0_NAN; // row 3, last block (a tail group in the int8 kernel)
    scales[7 * 5] = 0; // row 7, the subnormal scale 2^-127 stays finite
    for n in [1, 5, 17] {
        let x: Vec<f32> = (0..n * cols).map(|_| rng.next_f32()).collect();
        let mut runs: Vec<(String, Vec<f32>)> = Vec::new();
        for isa in available_isas() {
            for slice in [2, slice_blocks(n, 128, 1)] {
                let mut y = vec![0.0; n * rows];
                matmul_exact(isa, slice, &x, n, &blocks, &scales, rows, cols, &mut y);
                runs.push((format!("{isa:?} slice {slice}"), y));
            }
        }
        let mut y = vec![0.0; n * rows];
        matmul_mxfp4_q8(&x, n, &blocks, &scales, rows, cols, &mut y);
        runs.push(("q8".into(), y));
        if q8_available() {
            let mut y = vec![0.0; n * rows];
            matmul_q8(4, &x, n, &blocks, &scales, rows, cols, &mut y);
            runs.push(("q8 slice 4".into(), y));
        }
        for (what, y) in runs {
            for i in 0..n {
                for r in 0..rows {
                    assert_eq!(
                        y[i * rows + r].is_nan(),
                        r == 3,
                        "{what}: n {n} out[{i}, {r}]"
                    );
                }
            }
        }
    }
}

#[test]
fn empty_products_leave_output_untouched_or_zero() {
    let mut out: Vec<f32> = vec![];
    matmul_mxfp4(&[], 0, &[0; 16], &[127], 1, 32, &mut out);
    let mut out = vec![1.0f32; 3];
    matmul_mxfp4(&[], 3, &[], &[], 1, 0, &mut out);
    assert_eq!(out, vec![0.0; 3]);
}

#[test]
fn vector_activation_rounding_equals_the_plain_loop() {
    if !q8_available() {
        eprintln!("skipped: no AVX-512 VNNI on this CPU");
        return;
    }
    let mut rng = Rng::new(77);
    for blocks in [1usize, 3, 4, 18, 48] {
        let cols = blocks * 32;
        let ng = blocks.div_ceil(4);
        // Exact halves after scaling (amax 127 → inv 1) exercise ties-to-even.
        let mut x: Vec<f32> = (0..cols).map(|_| rng.next_f32() * 5.0).collect();
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        let (mut q1, mut d1, mut c1) = (
            vec![0u8; ng * 128],
            vec![0.0f32; ng * 4],
            vec![0i32; ng * 16],
        );
        let (mut q2, mut d2, mut c2) = (q1.clone(), d1.clone(), c1.clone());
        quantize_activations_q8_body(&x, &mut q1, &mut d1, &mut c1);
        // SAFETY: q8_available() checked above.
        unsafe { quantize_activations_q8_avx512(&x, &mut q2, &mut d2, &mut c2) };
        assert_eq!(q1, q2, "{blocks} blocks: codes");
        assert_eq!(d1, d2, "{blocks} blocks: scales");
        assert_eq!(c1, c2, "{blocks} blocks: lane sums");
    }
    let mut x = vec![1.0f32; 32];
    x[5] = f32::INFINITY;
    let (mut q, mut d, mut c) = (vec![0u8; 128], vec![0.0f32; 4], vec![0i32; 16]);
    // SAFETY: as above.
    unsafe { quantize_activations_q8_avx512(&x, &mut q, &mut d, &mut c) };
    assert!(
        d[0].is_nan(),
        "an infinite activation poisons its block scale"
    );
}
