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
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: gate and up lengths differ");
    assert_eq!(gate.len(), out.len(), "swiglu: out length differs");
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu(g) * u;
    }
}

/// SiTU-GLU combiner (Kimi K3):
/// `out = [β·tanh(gate/β)·sigmoid(gate)] · [β_lin·tanh(up/β_lin)]`, with
/// `beta` = β and `linear_beta` = β_lin (both > 0).
pub fn situ_glu(gate: &[f32], up: &[f32], beta: f32, linear_beta: f32, out: &mut [f32]) {
    assert_eq!(gate.len(), up.len(), "situ_glu: gate and up lengths differ");
    assert_eq!(gate.len(), out.len(), "situ_glu: out length differs");
    assert!(
        beta > 0.0 && linear_beta > 0.0,
        "situ_glu: betas must be positive"
    );
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let act = beta * (g / beta).tanh() * sigmoid(g);
        let lin = linear_beta * (u / linear_beta).tanh();
        *o = act * lin;
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
        let gate = [-2.0f32, 0.0, 1.5];
        let up = [3.0f32, 4.0, -0.5];
        let mut out = [0.0; 3];
        swiglu(&gate, &up, &mut out);
        for i in 0..3 {
            assert_eq!(out[i], silu(gate[i]) * up[i]);
        }
    }

    #[test]
    fn situ_glu_matches_f64_formula_and_saturates() {
        // Relative 1e-6 against f64. The gate factor saturates at β·sigmoid and
        // the linear factor at ±β_lin.
        let (beta, lin) = (4.0f32, 25.0f32);
        let gate = [-10.0f32, -1.0, 0.0, 0.7, 3.0, 50.0];
        let up = [100.0f32, -2.0, 5.0, 0.3, -1000.0, 1.0];
        let mut out = [0.0; 6];
        situ_glu(&gate, &up, beta, lin, &mut out);
        for i in 0..6 {
            let (g, u) = (gate[i] as f64, up[i] as f64);
            let want = 4.0 * (g / 4.0).tanh() / (1.0 + (-g).exp()) * 25.0 * (u / 25.0).tanh();
            assert!(
                close(out[i], want, 1e-6, 1e-12),
                "situ_glu[{i}] = {} want {want}",
                out[i]
            );
        }
        assert!((out[4] - 4.0 * (0.75f32).tanh() * sigmoid(3.0) * -25.0).abs() < 1e-3);
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
