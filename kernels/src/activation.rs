//! Elementwise activations and gated-linear-unit combiners.
//!
//! Scalar functions follow PyTorch's definitions (`torch.nn.functional`):
//! [`silu`] is `x / (1 + e^{-x})`, [`softplus`] returns `x` above the
//! threshold 20, [`gelu_tanh`] is `gelu(approximate="tanh")` and [`gelu_erf`]
//! the exact `gelu`. They compute in f32 except [`gelu_erf`], which evaluates
//! in f64 through [`erf_f64`] (absolute error below 1e-13) and rounds once.
//!
//! Slice combiners: [`swiglu`] (`silu(gate)·up`, Llama/DeepSeek MLPs) and
//! [`situ_glu`] (Kimi K3's SiTU-GLU, β = 4 and β_lin = 25 in K3's config).

use std::f64::consts::{FRAC_2_SQRT_PI, PI};

use rayon::prelude::*;

use crate::cpu::Isa;
use crate::simd::{exp, Portable, Simd};
#[cfg(target_arch = "x86_64")]
use crate::simd::{Avx2, Avx512};

/// Logistic sigmoid `1 / (1 + e^{-x})`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SiLU (swish): `x · sigmoid(x)`, computed as PyTorch does, `x / (1 + e^{-x})`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// PyTorch's softplus with β = 1 and threshold 20: `x` when `x > 20`, else
/// `ln(1 + e^x)`.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// GELU with the tanh approximation:
/// `0.5·x·(1 + tanh(u))`, `u = √(2/π)·(x + 0.044715·x³)`.
///
/// Evaluated as the identical `x / (1 + e^{-2u})`, which avoids the
/// cancellation in `1 + tanh(u)` for negative `x` (PyTorch's f32 kernel loses
/// up to ~5e-6 relative there; this form stays within a few ulps).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 =
        (std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2) as f32;
    let inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    x / (1.0 + (-2.0 * inner).exp())
}

/// Exact GELU `0.5·x·(1 + erf(x/√2))`, evaluated in f64 and rounded once.
#[inline]
pub fn gelu_erf(x: f32) -> f32 {
    let x = x as f64;
    (0.5 * x * (1.0 + erf_f64(x * std::f64::consts::FRAC_1_SQRT_2))) as f32
}

/// The error function in f32 (from [`erf_f64`]; error below 1e-7).
#[inline]
pub fn erf(x: f32) -> f32 {
    erf_f64(x as f64) as f32
}

/// Terms of the Laplace continued fraction used for `|x| >= 2.5`; 40 terms
/// give a relative error below 1e-13 on erfc there.
const ERFC_CF_TERMS: usize = 40;

/// The error function in f64, absolute error below 1e-13.
///
/// `|x| < 2.5`: Maclaurin series `2/√π · Σ (-1)^k x^{2k+1} / (k!(2k+1))`,
/// summed until a term is below 1e-17 of the sum (at most ~40 terms; the
/// largest term at 2.5 is ~10, so cancellation costs about one digit).
/// `2.5 <= |x| < 6`: `erf = 1 − erfc` with erfc from Laplace's continued
/// fraction `e^{-x²}/√π · 1/(x + (1/2)/(x + 1/(x + (3/2)/(x + …))))`,
/// evaluated backwards. `|x| >= 6`: ±1 (erfc(6) ≈ 2e-17).
pub fn erf_f64(x: f64) -> f64 {
    let a = x.abs();
    if a.is_nan() {
        return x;
    }
    if a >= 6.0 {
        return 1.0f64.copysign(x);
    }
    if a < 2.5 {
        let z = x * x;
        let mut term = x;
        let mut sum = x;
        let mut k = 0.0f64;
        loop {
            k += 1.0;
            term *= -z / k;
            let c = term / (2.0 * k + 1.0);
            sum += c;
            if c.abs() <= 1e-17 * sum.abs() {
                break;
            }
        }
        return sum * FRAC_2_SQRT_PI;
    }
    let mut f = a;
    for k in (1..=ERFC_CF_TERMS).rev() {
        f = a + (k as f64 * 0.5) / f;
    }
    let erfc = (-a * a).exp() / (PI.sqrt() * f);
    (1.0 - erfc).copysign(x)
}

/// Applies [`silu`] to every value.
pub fn silu_inplace(x: &mut [f32]) {
    for v in x {
        *v = silu(*v);
    }
}

/// Applies [`gelu_tanh`] to every value.
pub fn gelu_tanh_inplace(x: &mut [f32]) {
    for v in x {
        *v = gelu_tanh(*v);
    }
}

/// Applies [`gelu_erf`] to every value.
pub fn gelu_erf_inplace(x: &mut [f32]) {
    for v in x {
        *v = gelu_erf(*v);
    }
}

/// SwiGLU combiner: `out[i] = silu(gate[i]) · up[i]`.
///
/// Vectorised (`g / (1 + e^{-g}) · u` in the kernels' SIMD layer with their
/// `exp`, within 4 ulp of the exact value) and split over the pool from
/// [`GLU_TASK`] values per task. Every value goes through the same vector
/// code whatever its position, so the result does not depend on how rows
/// are batched or on the thread count.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: gate and up lengths differ");
    assert_eq!(gate.len(), out.len(), "swiglu: out length differs");
    out.copy_from_slice(gate);
    swiglu_in_place(out, up);
}

/// SiTU-GLU combiner (Kimi K3):
/// `out = [β·tanh(gate/β)·sigmoid(gate)] · [β_lin·tanh(up/β_lin)]`, with
/// `beta` = β and `linear_beta` = β_lin (both > 0).
///
/// Vectorised and split like [`swiglu`]; `tanh` is Cephes' `tanhf` (an odd
/// polynomial below 0.625, `1 − 2/(e^{2x} + 1)` above) on the kernels' `exp`,
/// within 1e-6 relative of the exact value.
pub fn situ_glu(gate: &[f32], up: &[f32], beta: f32, linear_beta: f32, out: &mut [f32]) {
    assert_eq!(gate.len(), up.len(), "situ_glu: gate and up lengths differ");
    assert_eq!(gate.len(), out.len(), "situ_glu: out length differs");
    out.copy_from_slice(gate);
    situ_glu_in_place(out, up, beta, linear_beta);
}

/// [`swiglu`] written over `gate` (bit-identical, no output buffer).
pub fn swiglu_in_place(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: gate and up lengths differ");
    glu_in_place_with(Glu::Silu, Isa::best(), gate, up);
}

/// [`situ_glu`] written over `gate` (bit-identical, no output buffer).
pub fn situ_glu_in_place(gate: &mut [f32], up: &[f32], beta: f32, linear_beta: f32) {
    assert_eq!(gate.len(), up.len(), "situ_glu: gate and up lengths differ");
    assert!(
        beta > 0.0 && linear_beta > 0.0,
        "situ_glu: betas must be positive"
    );
    glu_in_place_with(Glu::Situ { beta, linear_beta }, Isa::best(), gate, up);
}

/// Values per task of a parallel GLU combiner (~5 µs of work). Default 8,192.
pub const GLU_TASK: usize = 8192;

/// A gated-linear-unit combiner.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Glu {
    /// `silu(g)·u`.
    Silu,
    /// `β·tanh(g/β)·sigmoid(g) · β_lin·tanh(u/β_lin)`.
    Situ { beta: f32, linear_beta: f32 },
}

/// The combiner `kind` on instruction set `isa` (narrowed to one this CPU
/// has) into `out`: [`glu_in_place_with`] on a copy of `gate`.
#[cfg(test)]
fn glu_with(kind: Glu, isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    out.copy_from_slice(gate);
    glu_in_place_with(kind, isa, out, up);
}

/// The combiner `kind` on instruction set `isa` (narrowed to one this CPU
/// has) written over `gate`, split over the pool in tasks of [`GLU_TASK`]
/// values.
pub(crate) fn glu_in_place_with(kind: Glu, isa: Isa, gate: &mut [f32], up: &[f32]) {
    let isa = if isa.supported() { isa } else { Isa::Portable };
    let one = |(g, u): (&mut [f32], &[f32])| glu_chunk(kind, isa, g, u);
    if gate.len() <= GLU_TASK || crate::threads::is_serial() || rayon::current_num_threads() == 1 {
        one((gate, up));
    } else {
        gate.par_chunks_mut(GLU_TASK)
            .zip(up.par_chunks(GLU_TASK))
            .for_each(one);
    }
}

/// One task of [`glu_in_place_with`].
fn glu_chunk(kind: Glu, isa: Isa, gate: &mut [f32], up: &[f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: glu_in_place_with keeps only an ISA the CPU has.
        Isa::Avx512 => unsafe { glu_avx512(kind, gate, up) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { glu_avx2(kind, gate, up) },
        // SAFETY: the portable build needs no CPU feature.
        _ => unsafe { glu_simd::<Portable>(kind, gate, up) },
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn glu_avx512(kind: Glu, gate: &mut [f32], up: &[f32]) {
    // SAFETY: AVX-512F is enabled for this function.
    unsafe { glu_simd::<Avx512>(kind, gate, up) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn glu_avx2(kind: Glu, gate: &mut [f32], up: &[f32]) {
    // SAFETY: AVX2 and FMA are enabled for this function.
    unsafe { glu_simd::<Avx2>(kind, gate, up) }
}

/// The combiner over `gate` in place, `S::LANES` values at a time (each
/// vector is loaded before its result is stored); the tail goes through the
/// same vector code from a zero-padded copy.
///
/// # Safety
/// `S`'s instruction set is supported by the CPU; equal lengths.
#[inline(always)]
unsafe fn glu_simd<S: Simd>(kind: Glu, gate: &mut [f32], up: &[f32]) {
    let l = S::LANES;
    let full = gate.len() / l * l;
    let g = gate.as_mut_ptr();
    // SAFETY (both calls): LANES values at each pointer (the caller's
    // equal lengths, or the 16-value tail buffers).
    for i in (0..full).step_by(l) {
        unsafe { glu_lanes::<S>(kind, g.add(i), up[i..].as_ptr(), g.add(i)) };
    }
    if full < gate.len() {
        let n = gate.len() - full;
        let (mut t, mut u) = ([0.0f32; 16], [0.0f32; 16]);
        t[..n].copy_from_slice(&gate[full..]);
        u[..n].copy_from_slice(&up[full..]);
        unsafe { glu_lanes::<S>(kind, t.as_ptr(), u.as_ptr(), t.as_mut_ptr()) };
        gate[full..].copy_from_slice(&t[..n]);
    }
}

/// One vector of [`glu_simd`] (a function, not a closure, so that it is
/// inlined into the caller's instruction set).
///
/// # Safety
/// As [`glu_simd`]; `S::LANES` values readable at `g` and `u` and writable
/// at `o`.
#[inline(always)]
unsafe fn glu_lanes<S: Simd>(kind: Glu, g: *const f32, u: *const f32, o: *mut f32) {
    // SAFETY: the caller's contract.
    unsafe {
        let (g, u) = (S::load(g), S::load(u));
        let one = S::splat(1.0);
        let sig_den = S::add(one, exp::<S>(S::sub(S::zero(), g)));
        let y = match kind {
            Glu::Silu => S::mul(S::div(g, sig_den), u),
            Glu::Situ { beta, linear_beta } => {
                let (b, bl) = (S::splat(beta), S::splat(linear_beta));
                let act = S::div(S::mul(b, tanh::<S>(S::div(g, b))), sig_den);
                S::mul(act, S::mul(bl, tanh::<S>(S::div(u, bl))))
            }
        };
        S::store(o, y);
    }
}

/// Cephes `tanhf` coefficients of the odd polynomial used below 0.625,
/// highest degree first: `tanh x ≈ x + x·s·P(s)`, `s = x²`.
const TANH_POLY: [f32; 5] = [
    -5.704_988_7e-3,
    2.063_908_8e-2,
    -5.373_971_5e-2,
    1.333_144_2e-1,
    -3.333_328e-1,
];

/// Vectorised `tanh` (Cephes `tanhf`): the polynomial for `|x| < 0.625`,
/// `1 − 2/(e^{2|x|} + 1)` with the sign restored above (±1 once `e^{2|x|}`
/// saturates).
///
/// # Safety
/// `S`'s instruction set is supported by the CPU.
#[inline(always)]
unsafe fn tanh<S: Simd>(x: S::V) -> S::V {
    // SAFETY: the caller's contract.
    unsafe {
        let zero = S::zero();
        let a = S::max(x, S::sub(zero, x));
        let s = S::mul(x, x);
        let mut p = S::splat(TANH_POLY[0]);
        for &c in &TANH_POLY[1..] {
            p = S::fma(p, s, S::splat(c));
        }
        let small = S::fma(S::mul(p, s), x, x);
        let e = exp::<S>(S::add(a, a));
        let big = S::sub(
            S::splat(1.0),
            S::div(S::splat(2.0), S::add(e, S::splat(1.0))),
        );
        let big = S::select_gt(zero, x, S::sub(zero, big), big);
        S::select_gt(S::splat(0.625), a, small, big)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sample points spanning the saturating regions and zero.
    const XS: &[f32] = &[
        -30.0, -20.5, -8.0, -3.0, -1.0, -0.25, 0.0, 1e-4, 0.5, 1.0, 2.0, 5.0, 19.9, 20.0, 20.5,
        40.0,
    ];

    fn close(got: f32, want: f64, rel: f64, abs: f64) -> bool {
        (got as f64 - want).abs() <= rel * want.abs() + abs
    }

    #[test]
    fn erf_matches_python_math_erf_within_1e_minus_13() {
        // Values from CPython's math.erf (correctly rounded libm erf).
        let table: &[(f64, f64)] = &[
            (0.0, 0.0),
            (1e-08, 1.1283791670955126e-08),
            (0.1, 0.1124629160182849),
            (0.3, 0.3286267594591274),
            (0.5, 0.5204998778130465),
            (0.84375, 0.7672256612323416),
            (1.0, 0.8427007929497149),
            (1.25, 0.9229001282564582),
            (1.5, 0.9661051464753108),
            (2.0, 0.9953222650189527),
            (2.4, 0.999311486103355),
            (2.5, 0.999593047982555),
            (2.6, 0.9997639655834707),
            (3.0, 0.9999779095030014),
            (3.5, 0.9999992569016276),
            (4.0, 0.9999999845827421),
            (5.0, 0.9999999999984626),
            (6.0, 1.0),
            (-0.7, -0.6778011938374184),
            (-2.2, -0.9981371537020182),
            (-4.5, -0.9999999998033839),
        ];
        for &(x, want) in table {
            assert!(
                (erf_f64(x) - want).abs() < 1e-13,
                "erf_f64({x}) = {} want {want}",
                erf_f64(x)
            );
            // f32: below 1e-7 plus the effect of rounding x itself to f32 (erf' <= 2/√π).
            let input_err = 1.13 * (x - x as f32 as f64).abs();
            assert!(
                ((erf(x as f32) as f64) - want).abs() < 1e-7 + input_err,
                "erf({x})"
            );
        }
        assert!(erf_f64(f64::NAN).is_nan());
        assert_eq!(erf_f64(f64::INFINITY), 1.0);
        assert_eq!(erf_f64(f64::NEG_INFINITY), -1.0);
    }

    #[test]
    fn erf_is_continuous_across_the_series_and_fraction_boundary() {
        let below = erf_f64(2.5 - 1e-12);
        let above = erf_f64(2.5);
        assert!((above - below).abs() < 1e-13);
    }

    #[test]
    fn pointwise_activations_match_f64_formulas() {
        // f32 evaluation vs the same formula in f64: relative 1e-6, abs 1e-12.
        for &x in XS {
            let xd = x as f64;
            let sig = 1.0 / (1.0 + (-xd).exp());
            assert!(close(sigmoid(x), sig, 1e-6, 1e-12), "sigmoid({x})");
            assert!(close(silu(x), xd * sig, 1e-6, 1e-12), "silu({x})");
            let sp = if xd > 20.0 { xd } else { xd.exp().ln_1p() };
            assert!(close(softplus(x), sp, 1e-6, 1e-12), "softplus({x})");
            let gt = 0.5 * xd * (1.0 + ((2.0 / PI).sqrt() * (xd + 0.044715 * xd * xd * xd)).tanh());
            assert!(close(gelu_tanh(x), gt, 1e-6, 1e-12), "gelu_tanh({x})");
            let ge = 0.5 * xd * (1.0 + erf_f64(xd / 2f64.sqrt()));
            assert!(close(gelu_erf(x), ge, 2e-7, 1e-30), "gelu_erf({x})");
        }
    }

    #[test]
    fn softplus_passes_large_inputs_through_like_pytorch() {
        assert_eq!(softplus(20.5), 20.5);
        assert_eq!(softplus(1e30), 1e30);
        assert!((softplus(20.0) - 20.0).abs() < 1e-6);
        assert!(softplus(-100.0) >= 0.0 && softplus(-100.0) < 1e-40);
    }

    #[test]
    fn gelu_erf_matches_torch_values() {
        // torch.nn.functional.gelu(torch.tensor([-3, -1, 0.5, 2], dtype=float32))
        // (torch 2.15). Absolute tolerance 1e-6: torch evaluates 1 + erf in f32,
        // which cancels for negative x (at -3 it is off by 5e-7 from the exact
        // -0.00404969); we evaluate in f64.
        let want = [-0.004050225f32, -0.15865526, 0.34573123, 1.9544997];
        for (&x, &w) in [-3.0f32, -1.0, 0.5, 2.0].iter().zip(&want) {
            assert!(
                (gelu_erf(x) - w).abs() <= 1e-6,
                "gelu_erf({x}) = {} want {w}",
                gelu_erf(x)
            );
        }
    }

    #[test]
    fn swiglu_is_silu_of_gate_times_up() {
        // Within 4 ulp (2e-7 relative, the vector exp's 2 ulp plus the
        // division and product) of the f64 formula, on every instruction
        // set, over the saturating regions and zero; below g = −88 the exp
        // argument is clamped, leaving |out| < 1e-36 where the exact value
        // is smaller still (absolute 1e-30).
        let mut gate: Vec<f32> = XS.to_vec();
        gate.extend((0..1000).map(|i| (i as f32 - 500.0) * 0.037));
        gate.extend([-100.0, -88.5, 87.5, 100.0]);
        let up: Vec<f32> = (0..gate.len())
            .map(|i| 1.0 + (i % 7) as f32 * 0.25)
            .collect();
        for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
            if !isa.supported() {
                continue;
            }
            let mut out = vec![f32::NAN; gate.len()];
            glu_with(Glu::Silu, isa, &gate, &up, &mut out);
            for ((&o, &g), &u) in out.iter().zip(&gate).zip(&up) {
                let (g64, u64) = (g as f64, u as f64);
                let want = g64 / (1.0 + (-g64).exp()) * u64;
                assert!(
                    close(o, want, 5e-7, 1e-30),
                    "{isa:?} swiglu({g}, {u}) = {o}, want {want}"
                );
            }
        }
    }

    /// `n` gate values over ±10 and up values over ±1.5, spread by position.
    fn glu_inputs(n: usize) -> (Vec<f32>, Vec<f32>) {
        let gate = (0..n)
            .map(|i| ((i * 7919) % 2000) as f32 * 0.01 - 10.0)
            .collect();
        let up = (0..n)
            .map(|i| ((i * 104729) % 300) as f32 * 0.01 - 1.5)
            .collect();
        (gate, up)
    }

    #[test]
    fn swiglu_does_not_depend_on_position_split_or_threads() {
        // Each value goes through the same vector code (tails from a padded
        // copy), so a value's result is the same wherever it sits.
        let n = 3 * GLU_TASK + 37;
        let (gate, up) = glu_inputs(n);
        let mut all = vec![0.0; n];
        swiglu(&gate, &up, &mut all);
        let mut serial = vec![0.0; n];
        crate::threads::serial(|| swiglu(&gate, &up, &mut serial));
        assert!(all
            .iter()
            .zip(&serial)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        for start in [1, 5, 17, n - 3] {
            let mut part = vec![0.0; n - start];
            swiglu(&gate[start..], &up[start..], &mut part);
            assert!(part
                .iter()
                .zip(&all[start..])
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn in_place_combiners_are_the_out_of_place_ones_bit_for_bit() {
        // Pool-sized and tail lengths, so both the split and the padded tail run in place.
        for n in [1, 15, 17, 2 * GLU_TASK + 5] {
            let (gate, up) = glu_inputs(n);
            let mut want = vec![0.0; n];
            swiglu(&gate, &up, &mut want);
            let mut got = gate.clone();
            swiglu_in_place(&mut got, &up);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "n {n}"
            );
            situ_glu(&gate, &up, 4.0, 25.0, &mut want);
            let mut got = gate.clone();
            situ_glu_in_place(&mut got, &up, 4.0, 25.0);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "n {n}"
            );
        }
    }

    #[test]
    fn situ_glu_matches_f64_formula_and_saturates() {
        // Relative 1e-6 against f64 on every instruction set, with tanh's
        // polynomial and exp branches on both sides of 0.625·β. The gate
        // factor saturates at β·sigmoid and the linear factor at ±β_lin.
        let (beta, lin) = (4.0f32, 25.0f32);
        let mut gate = vec![-10.0f32, -1.0, 0.0, 0.7, 3.0, 50.0];
        let mut up = vec![100.0f32, -2.0, 5.0, 0.3, -1000.0, 1.0];
        gate.extend((0..400).map(|i| (i as f32 - 200.0) * 0.061));
        up.extend((0..400).map(|i| (i as f32 - 200.0) * 0.43));
        for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
            if !isa.supported() {
                continue;
            }
            let kind = Glu::Situ {
                beta,
                linear_beta: lin,
            };
            let mut out = vec![f32::NAN; gate.len()];
            glu_with(kind, isa, &gate, &up, &mut out);
            for i in 0..gate.len() {
                let (g, u) = (gate[i] as f64, up[i] as f64);
                let want = 4.0 * (g / 4.0).tanh() / (1.0 + (-g).exp()) * 25.0 * (u / 25.0).tanh();
                assert!(
                    close(out[i], want, 1e-6, 1e-12),
                    "{isa:?} situ_glu({}, {}) = {} want {want}",
                    gate[i],
                    up[i],
                    out[i]
                );
            }
            assert!((out[4] - 4.0 * (0.75f32).tanh() * sigmoid(3.0) * -25.0).abs() < 1e-3);
        }
    }

    #[test]
    fn inplace_variants_apply_the_scalar_function() {
        let mut a = XS.to_vec();
        let mut b = XS.to_vec();
        let mut c = XS.to_vec();
        silu_inplace(&mut a);
        gelu_tanh_inplace(&mut b);
        gelu_erf_inplace(&mut c);
        for (i, &x) in XS.iter().enumerate() {
            assert_eq!(a[i], silu(x));
            assert_eq!(b[i], gelu_tanh(x));
            assert_eq!(c[i], gelu_erf(x));
        }
    }
}
