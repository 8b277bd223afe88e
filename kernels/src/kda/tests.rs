//! Tests of [`super`] (kda): every fast path against its plain reference.

use super::*;
use crate::testing::Rng;

/// Random KDA inputs: q, k, v, g (from one of the two gates), beta, state.
struct Case {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    state: Vec<f32>,
}

fn case(shape: &KdaShape, t: usize, seed: u64, k3_gate: bool) -> Case {
    let mut rng = Rng::seeded(seed);
    let (hk, hv) = (shape.heads * shape.k_dim, shape.heads * shape.v_dim);
    let mut g = rng.vec(t * hk, 3.0);
    let a_log = rng.vec(shape.heads, 1.0);
    let dt_bias = rng.vec(hk, 1.0);
    if k3_gate {
        kda_gate_lower_bound(&mut g, shape.heads, shape.k_dim, &a_log, &dt_bias, -5.0);
    } else {
        kda_gate(&mut g, shape.heads, shape.k_dim, &a_log, &dt_bias);
    }
    Case {
        q: rng.vec(t * hk, 1.0),
        k: rng.vec(t * hk, 1.0),
        v: rng.vec(t * hv, 1.0),
        g,
        beta: rng
            .vec(t * shape.heads, 4.0)
            .into_iter()
            .map(sigmoid)
            .collect(),
        state: rng.vec(shape.heads * shape.k_dim * shape.v_dim, 0.5),
    }
}

/// The decode step of reference doc §1.1 in f64, one token and head at a time.
fn f64_recurrence(c: &Case, shape: &KdaShape, scale: f64) -> (Vec<f64>, Vec<f64>) {
    let KdaShape {
        heads,
        k_dim: kd,
        v_dim: vd,
    } = *shape;
    let t = c.q.len() / (heads * kd);
    let mut s: Vec<f64> = c.state.iter().map(|&x| x as f64).collect();
    let mut out = vec![0.0f64; t * heads * vd];
    let norm = |x: &[f32]| -> Vec<f64> {
        let ss: f64 = x.iter().map(|&a| (a as f64) * (a as f64)).sum();
        x.iter().map(|&a| a as f64 / (ss + 1e-6).sqrt()).collect()
    };
    for i in 0..t {
        for h in 0..heads {
            let at = i * heads * kd + h * kd;
            let q: Vec<f64> = norm(&c.q[at..at + kd])
                .into_iter()
                .map(|x| x * scale)
                .collect();
            let k = norm(&c.k[at..at + kd]);
            let b = c.beta[i * heads + h] as f64;
            let sh = &mut s[h * kd * vd..(h + 1) * kd * vd];
            for a in 0..kd {
                let alpha = (c.g[at + a] as f64).exp();
                for e in 0..vd {
                    sh[a * vd + e] *= alpha;
                }
            }
            for e in 0..vd {
                let mem: f64 = (0..kd).map(|a| sh[a * vd + e] * k[a]).sum();
                let u = b * (c.v[i * heads * vd + h * vd + e] as f64 - mem);
                for a in 0..kd {
                    sh[a * vd + e] += k[a] * u;
                }
                out[i * heads * vd + h * vd + e] = (0..kd).map(|a| sh[a * vd + e] * q[a]).sum();
            }
        }
    }
    (out, s)
}

/// Asserts |got − want| ≤ tol·max|want| elementwise (relative to the
/// largest reference magnitude, so small entries are not let off).
fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let peak = want.iter().fold(0.0f64, |m, w| m.max(w.abs())).max(1e-30);
    let mut worst = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        worst = worst.max(err / peak);
        assert!(
            err <= tol * peak,
            "{what}[{i}]: got {g}, want {w}, err {err:e}, peak {peak:e}"
        );
    }
    if std::env::var_os("KDA_REPORT").is_some() {
        eprintln!("{what}: worst relative error {worst:e}, peak {peak:e}");
    }
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&a| a as f64).collect()
}

fn run_recurrent(c: &Case, shape: &KdaShape, scale: f32) -> (Vec<f32>, Vec<f32>) {
    let mut state = c.state.clone();
    let mut out = vec![0.0; c.v.len()];
    kda_recurrent(
        &c.q, &c.k, &c.v, &c.g, &c.beta, shape, scale, &mut state, &mut out,
    );
    (out, state)
}

fn run_chunked(c: &Case, shape: &KdaShape, scale: f32, chunk: usize) -> (Vec<f32>, Vec<f32>) {
    let mut state = c.state.clone();
    let mut out = vec![0.0; c.v.len()];
    kda_chunked(
        &c.q, &c.k, &c.v, &c.g, &c.beta, shape, scale, &mut state, &mut out, chunk,
    );
    (out, state)
}

/// Runs tokens `range` of a [`SHAPE`] case from `state` (chunked with
/// `Some(chunk)`, recurrent with `None`) and returns their outputs.
fn piece(
    c: &Case,
    range: std::ops::Range<usize>,
    chunk: Option<usize>,
    scale: f32,
    state: &mut [f32],
) -> Vec<f32> {
    let (hk, hv, h) = (
        SHAPE.heads * SHAPE.k_dim,
        SHAPE.heads * SHAPE.v_dim,
        SHAPE.heads,
    );
    let (a, b) = (range.start, range.end);
    let (q, k, g) = (
        &c.q[a * hk..b * hk],
        &c.k[a * hk..b * hk],
        &c.g[a * hk..b * hk],
    );
    let (v, beta) = (&c.v[a * hv..b * hv], &c.beta[a * h..b * h]);
    let mut out = vec![0.0; (b - a) * hv];
    match chunk {
        Some(n) => kda_chunked(q, k, v, g, beta, &SHAPE, scale, state, &mut out, n),
        None => kda_recurrent(q, k, v, g, beta, &SHAPE, scale, state, &mut out),
    }
    out
}

const SHAPE: KdaShape = KdaShape {
    heads: 3,
    k_dim: 16,
    v_dim: 12,
};

#[test]
fn chunked_kda_equals_recurrent() {
    // Tolerance: 1e-4 relative (|err| ≤ 1e-4·max|ref|), f32 both sides.
    let scale = (SHAPE.k_dim as f32).powf(-0.5);
    for (seed, &t) in [1usize, 5, 64, 130].iter().enumerate() {
        for k3_gate in [false, true] {
            let c = case(&SHAPE, t, seed as u64 + 1, k3_gate);
            let (ro, rs) = run_recurrent(&c, &SHAPE, scale);
            for chunk in [64, 16, 7] {
                let (co, cs) = run_chunked(&c, &SHAPE, scale, chunk);
                let what = format!("t={t} chunk={chunk} k3={k3_gate}");
                assert_close(&co, &widen(&ro), 1e-4, &format!("out {what}"));
                assert_close(&cs, &widen(&rs), 1e-4, &format!("state {what}"));
            }
        }
    }
}

#[test]
fn recurrent_and_chunked_match_f64_scalar_recurrence() {
    // Tolerance: 1e-4 relative against an f64 evaluation of §1.1.
    let shape = KdaShape {
        heads: 2,
        k_dim: 32,
        v_dim: 24,
    };
    let scale = (shape.k_dim as f32).powf(-0.5);
    for (seed, &t) in [1usize, 5, 64, 130].iter().enumerate() {
        for k3_gate in [false, true] {
            let c = case(&shape, t, 100 + seed as u64, k3_gate);
            let (want_o, want_s) = f64_recurrence(&c, &shape, scale as f64);
            let (ro, rs) = run_recurrent(&c, &shape, scale);
            assert_close(&ro, &want_o, 1e-4, &format!("recurrent out t={t}"));
            assert_close(&rs, &want_s, 1e-4, &format!("recurrent state t={t}"));
            let (co, cs) = run_chunked(&c, &shape, scale, 64);
            assert_close(&co, &want_o, 1e-4, &format!("chunked out t={t}"));
            assert_close(&cs, &want_s, 1e-4, &format!("chunked state t={t}"));
        }
    }
}

#[test]
fn prefill_in_two_pieces_equals_one_piece() {
    // Tolerance: 1e-5 relative (same algorithm, different chunk boundaries).
    let scale = (SHAPE.k_dim as f32).powf(-0.5);
    let c = case(&SHAPE, 100, 7, false);
    let (whole_o, whole_s) = run_chunked(&c, &SHAPE, scale, 64);
    let mut state = c.state.clone();
    let mut out = piece(&c, 0..37, Some(64), scale, &mut state);
    out.extend(piece(&c, 37..100, Some(64), scale, &mut state));
    assert_close(&out, &widen(&whole_o), 1e-5, "out");
    assert_close(&state, &widen(&whole_s), 1e-5, "state");
}

#[test]
fn decode_after_chunked_prefill_continues_the_sequence() {
    // Tolerance: 1e-4 relative. Prefill 70 tokens chunked, decode 3 one by one.
    let scale = (SHAPE.k_dim as f32).powf(-0.5);
    let c = case(&SHAPE, 73, 11, true);
    let (want_o, want_s) = f64_recurrence(&c, &SHAPE, scale as f64);
    let mut state = c.state.clone();
    let mut out = piece(&c, 0..70, Some(32), scale, &mut state);
    for i in 70..73 {
        out.extend(piece(&c, i..i + 1, None, scale, &mut state));
    }
    assert_close(&out, &want_o, 1e-4, "out");
    assert_close(&state, &want_s, 1e-4, "state");
}

#[test]
fn empty_input_leaves_state_alone() {
    let mut state = vec![1.5; SHAPE.heads * SHAPE.k_dim * SHAPE.v_dim];
    let before = state.clone();
    let mut out = vec![];
    kda_chunked(
        &[],
        &[],
        &[],
        &[],
        &[],
        &SHAPE,
        1.0,
        &mut state,
        &mut out,
        64,
    );
    kda_recurrent(&[], &[], &[], &[], &[], &SHAPE, 1.0, &mut state, &mut out);
    assert_eq!(state, before);
}

/// Direct causal conv in f64 with zero history.
fn conv_f64(x: &[f32], channels: usize, w: &[f32], kernel: usize) -> Vec<f64> {
    let t = x.len() / channels;
    let mut out = vec![0.0; x.len()];
    for i in 0..t {
        for c in 0..channels {
            let mut acc = 0.0f64;
            for j in 0..kernel {
                let p = i as isize + j as isize - (kernel as isize - 1);
                if p >= 0 {
                    acc += w[c * kernel + j] as f64 * x[p as usize * channels + c] as f64;
                }
            }
            out[i * channels + c] = acc / (1.0 + (-acc).exp());
        }
    }
    out
}

#[test]
fn short_conv_one_at_a_time_equals_all_at_once() {
    // Tolerance: exact equality between streaming and whole (same f32
    // operations); 1e-5 relative (to max|ref|) against an f64 direct convolution.
    let (channels, kernel, t) = (10, 4, 9);
    let mut rng = Rng::new(42);
    let x = rng.vec(t * channels, 2.0);
    let w = rng.vec(channels * kernel, 1.0);
    let mut whole_state = vec![0.0; channels * (kernel - 1)];
    let mut whole = vec![0.0; x.len()];
    short_conv(&x, channels, &w, kernel, &mut whole_state, &mut whole);
    assert_close(
        &whole,
        &conv_f64(&x, channels, &w, kernel),
        1e-5,
        "whole vs f64",
    );

    let mut state = vec![0.0; channels * (kernel - 1)];
    let mut stream = vec![0.0; x.len()];
    for i in 0..t {
        let r = i * channels..(i + 1) * channels;
        short_conv(
            &x[r.clone()],
            channels,
            &w,
            kernel,
            &mut state,
            &mut stream[r],
        );
    }
    assert_eq!(stream, whole);
    assert_eq!(state, whole_state);

    // Uneven pieces (2, then 1, then 6) give the same result too.
    let mut state = vec![0.0; channels * (kernel - 1)];
    let mut pieces = vec![0.0; x.len()];
    for (a, b) in [(0, 2), (2, 3), (3, t)] {
        let r = a * channels..b * channels;
        short_conv(
            &x[r.clone()],
            channels,
            &w,
            kernel,
            &mut state,
            &mut pieces[r],
        );
    }
    assert_eq!(pieces, whole);
    assert_eq!(state, whole_state);
}

#[test]
fn short_conv_state_holds_last_inputs_oldest_first() {
    // One channel, kernel 3: state = the two most recent inputs.
    let w = [0.0, 0.0, 1.0];
    let mut state = vec![0.0; 2];
    let mut out = vec![0.0; 3];
    short_conv(&[1.0, 2.0, 3.0], 1, &w, 3, &mut state, &mut out);
    assert_eq!(state, vec![2.0, 3.0]);
    short_conv(&[4.0], 1, &w, 3, &mut state, &mut out[..1]);
    assert_eq!(state, vec![3.0, 4.0]);
    // With w = [1, 0, 0] the output reads the oldest entry: SiLU(3).
    let mut o = [0.0];
    short_conv(&[5.0], 1, &[1.0, 0.0, 0.0], 3, &mut state, &mut o);
    assert!((o[0] - 3.0 * sigmoid(3.0)).abs() < 1e-6);
}

#[test]
fn kimi_linear_gate_matches_hand_computed_values() {
    // Tolerance 1e-6 absolute. Heads 2, head_dim 2.
    // head 0: A_log = 0 (rate 1); head 1: A_log = ln 2 (rate 2).
    let a_log = [0.0, 2f32.ln()];
    let dt_bias = [0.0, 1.0, 0.5, 0.0];
    let mut z = vec![0.0, -1.0, 0.5, 25.0];
    kda_gate(&mut z, 2, 2, &a_log, &dt_bias);
    let want = [
        -(2f64.ln()),                   // softplus(0) = ln 2
        -(2f64.ln()),                   // −1 + 1 = 0
        -2.0 * (1.0 + 1f64.exp()).ln(), // 2·softplus(1)
        -2.0 * 25.0,                    // above the threshold softplus(x) = x
    ];
    for (g, w) in z.iter().zip(want) {
        assert!((*g as f64 - w).abs() < 1e-6, "got {g}, want {w}");
    }
}

#[test]
fn k3_lower_bound_gate_matches_hand_computed_values() {
    // Tolerance 1e-6 absolute. g = −5·sigmoid(exp(A_log)·(z + dt_bias)).
    let a_log = [0.0, 2f32.ln(), 99.0]; // extra A_log slot unused (K3 padding)
    let dt_bias = [0.0, 1.0];
    let mut z = vec![0.0, 0.0];
    kda_gate_lower_bound(&mut z, 2, 1, &a_log, &dt_bias, -5.0);
    let s2 = 1.0 / (1.0 + (-2f64).exp());
    let want = [-2.5, -5.0 * s2];
    for (g, w) in z.iter().zip(want) {
        assert!((*g as f64 - w).abs() < 1e-6, "got {g}, want {w}");
    }
}
