//! Kimi Delta Attention (KDA): the short convolution, the forget gates and
//! the gated delta-rule recurrence in its recurrent (decode) and chunked
//! (prefill) forms.
//!
//! Paper: "Kimi Linear: An Expressive, Efficient Attention Architecture"
//! (arXiv 2510.26692), Eq. 1. Reference implementation whose numbers we
//! match: transformers 5.x `models/kimi_linear/modeling_kimi_linear.py`
//! (`causal_conv1d_fn/_update`, `KimiLinearForgetGate`,
//! `recurrent_kimi_delta_attention`, `chunk_kimi_delta_attention`, both with
//! `use_qk_l2norm_in_kernel=True`), which mirrors FLA's naive kernels.
//!
//! Per head, with state `S ∈ R^{K×V}` (f32) and log decay `g ≤ 0`:
//!
//! ```text
//! q ← l2norm(q)·scale,  k ← l2norm(k)          l2norm(x) = x / sqrt(Σx² + 1e-6)
//! S' = Diag(exp g) · S                          decay the key rows
//! u  = β · (v − S'ᵀ k)                          delta-rule correction
//! S  = S' + k ⊗ u                               rank-1 write
//! o  = Sᵀ q                                     read after the write
//! ```
//!
//! [`kda_chunked`] computes the same thing chunk by chunk with the WY / UT
//! transform (reference doc §1.3). Inside a chunk every decay factor it uses
//! is `exp(G_r − G_i)` with `i ≤ r`, never a division by a cumulative decay,
//! so strong decays (K3's gate reaches −5 per token) underflow to 0 instead
//! of overflowing. On a CPU the chunked form does more arithmetic than the
//! recurrent one (about `3KV + C(2K+V)` vs `3KV` multiply-adds per token and
//! head, ≈1.5× for C = 64, K = V = 128); it is the form GPU kernels use, the
//! oracle for them, and what prefill calls. Smaller chunks cost less here.
//!
//! Layouts: activations are row-major `[tokens, heads·dim]`, `beta` is
//! `[tokens, heads]`, the recurrent state is `[heads, K, V]`, the conv state
//! `[channels, kernel−1]` (oldest first).

use rayon::prelude::*;

/// Epsilon inside the square root of the q/k L2 norm (FLA and transformers
/// add it to `Σx²`; they do not clamp with `max`).
const L2_EPS: f32 = 1e-6;

/// Above this input transformers' KDA gate uses `softplus(x) = x`
/// (`torch.where(g > 20.0, g, log(1 + exp(g)))`).
const SOFTPLUS_THRESHOLD: f32 = 20.0;

/// Cumulative decay products below this are flushed to zero in the chunked
/// form: their contribution is below f32 resolution of any term they are
/// added to, and subnormal arithmetic would be very slow on x86.
const DECAY_FLUSH: f32 = 1e-30;

/// Logistic sigmoid in f32, `1 / (1 + e^{−x})` as torch computes it.
#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SiLU, `x · sigmoid(x)`.
#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Softplus exactly as transformers' `KimiLinearForgetGate` writes it:
/// `x` above 20, else `log(1 + exp(x))` (not `log1p`, to round the same way).
#[inline]
fn softplus(x: f32) -> f32 {
    if x > SOFTPLUS_THRESHOLD {
        x
    } else {
        (1.0 + x.exp()).ln()
    }
}

/// `dst = src / sqrt(Σ src² + 1e-6) · mul`: first the division (as
/// transformers' `l2norm`), then the multiplication (the `scale` of q).
#[inline]
fn l2_normalize(src: &[f32], mul: f32, dst: &mut [f32]) {
    let ss: f32 = src.iter().map(|x| x * x).sum();
    let norm = (ss + L2_EPS).sqrt();
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s / norm * mul;
    }
}

/// Dot product of two equally long slices.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `acc += a · x` over equally long slices.
#[inline]
fn axpy(acc: &mut [f32], a: f32, x: &[f32]) {
    for (o, &xi) in acc.iter_mut().zip(x) {
        *o += a * xi;
    }
}

/// Causal depthwise convolution over `t = x.len() / channels` tokens,
/// followed by SiLU (FLA `ShortConvolution`, transformers
/// `causal_conv1d_fn` / `causal_conv1d_update` with `activation="silu"`).
///
/// `out[t, c] = SiLU(Σ_{j<W} weight[c, j] · x[t − (W−1) + j, c])`, where
/// positions before the first token are read from `state`. `weight` is the
/// checkpoint's `[C, 1, W]` tensor flattened to `[C, W]` (its last column
/// multiplies the current token). `state` (`[C, W−1]`, oldest first, zeros
/// at a sequence start) holds the previous `W−1` pre-convolution inputs of
/// each channel and is advanced past the `t` tokens, so feeding tokens one
/// at a time gives the same output as feeding them all at once.
///
/// The convolution runs in f32; transformers first casts the inputs to the
/// weight's dtype (bf16 in the checkpoints), which the caller may mimic by
/// rounding `x` before the call.
///
/// # Panics
/// If `channels` or `kernel` is 0, or a length disagrees with the shapes above.
pub fn short_conv(
    x: &[f32],
    channels: usize,
    weight: &[f32],
    kernel: usize,
    state: &mut [f32],
    out: &mut [f32],
) {
    assert!(
        channels > 0 && kernel > 0,
        "short_conv: channels and kernel must be positive"
    );
    assert_eq!(
        x.len() % channels,
        0,
        "short_conv: x length {} not a multiple of {channels}",
        x.len()
    );
    let t = x.len() / channels;
    let hist = kernel - 1;
    assert_eq!(
        weight.len(),
        channels * kernel,
        "short_conv: weight must be [channels, kernel]"
    );
    assert_eq!(
        state.len(),
        channels * hist,
        "short_conv: state must be [channels, kernel-1]"
    );
    assert_eq!(out.len(), x.len(), "short_conv: out must be as long as x");
    if t == 0 {
        return;
    }
    {
        let state: &[f32] = state;
        out.par_chunks_mut(channels)
            .enumerate()
            .for_each(|(i, row)| {
                for (c, o) in row.iter_mut().enumerate() {
                    let w = &weight[c * kernel..(c + 1) * kernel];
                    let s = &state[c * hist..(c + 1) * hist];
                    let mut acc = 0.0f32;
                    for (j, &wj) in w.iter().enumerate() {
                        // Index into the virtual sequence [state (hist) | x (t)].
                        let p = i + j;
                        let xv = if p < hist {
                            s[p]
                        } else {
                            x[(p - hist) * channels + c]
                        };
                        acc += wj * xv;
                    }
                    *o = silu(acc);
                }
            });
    }
    if hist > 0 {
        // New state = last `hist` entries of [state | x] per channel.
        let mut tail = vec![0.0f32; hist];
        for c in 0..channels {
            let s = &mut state[c * hist..(c + 1) * hist];
            for (m, slot) in tail.iter_mut().enumerate() {
                let p = t + m;
                *slot = if p < hist {
                    s[p]
                } else {
                    x[(p - hist) * channels + c]
                };
            }
            s.copy_from_slice(&tail);
        }
    }
}

/// Checks the gate arguments and returns nothing; shared by both gates.
fn check_gate(z: &[f32], heads: usize, head_dim: usize, a_log: &[f32], dt_bias: &[f32]) {
    let width = heads * head_dim;
    assert!(width > 0, "kda gate: heads and head_dim must be positive");
    assert_eq!(
        z.len() % width,
        0,
        "kda gate: z length {} not a multiple of {width}",
        z.len()
    );
    // K3 may store A_log in a larger buffer with only the first `heads` used.
    assert!(
        a_log.len() >= heads,
        "kda gate: A_log has {} < {heads} entries",
        a_log.len()
    );
    assert_eq!(
        dt_bias.len(),
        width,
        "kda gate: dt_bias must be [heads·head_dim]"
    );
}

/// Kimi-Linear forget gate, in place over `z` (`[t, heads·head_dim]`, the
/// `f_b_proj(f_a_proj(x))` logits):
/// `g = −exp(A_log[h]) · softplus(z + dt_bias[h·D + d])`, always `< 0`.
///
/// Softplus is transformers' thresholded form (`x` above 20).
///
/// # Panics
/// If `z` is not a whole number of `[heads·head_dim]` rows, `a_log` has fewer
/// than `heads` entries, or `dt_bias` is not `heads·head_dim` long.
pub fn kda_gate(z: &mut [f32], heads: usize, head_dim: usize, a_log: &[f32], dt_bias: &[f32]) {
    check_gate(z, heads, head_dim, a_log, dt_bias);
    let width = heads * head_dim;
    z.par_chunks_mut(width).for_each(|row| {
        for (h, head) in row.chunks_mut(head_dim).enumerate() {
            let decay = a_log[h].exp();
            let bias = &dt_bias[h * head_dim..(h + 1) * head_dim];
            for (zv, &b) in head.iter_mut().zip(bias) {
                *zv = -decay * softplus(*zv + b);
            }
        }
    });
}

/// Kimi K3 lower-bounded forget gate, in place over `z`:
/// `g = lower_bound · sigmoid(exp(A_log[h]) · (z + dt_bias[h·D + d]))`, so
/// `g ∈ (lower_bound, 0)` for a negative `lower_bound` (K3: −5). Same
/// formula as transformers' `Glm5NextTextForgetGate` / `BailingHybridForgetGate`
/// safe-gate branch and FLA `naive_kda_lowerbound_gate`.
///
/// # Panics
/// As [`kda_gate`].
pub fn kda_gate_lower_bound(
    z: &mut [f32],
    heads: usize,
    head_dim: usize,
    a_log: &[f32],
    dt_bias: &[f32],
    lower_bound: f32,
) {
    check_gate(z, heads, head_dim, a_log, dt_bias);
    let width = heads * head_dim;
    z.par_chunks_mut(width).for_each(|row| {
        for (h, head) in row.chunks_mut(head_dim).enumerate() {
            let decay = a_log[h].exp();
            let bias = &dt_bias[h * head_dim..(h + 1) * head_dim];
            for (zv, &b) in head.iter_mut().zip(bias) {
                *zv = lower_bound * sigmoid(decay * (*zv + b));
            }
        }
    });
}

/// Head geometry of one KDA layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KdaShape {
    /// Number of KDA heads (`linear_attn_config.num_heads`).
    pub heads: usize,
    /// Key (and query, gate) width per head; 128 in every Kimi checkpoint.
    pub k_dim: usize,
    /// Value width per head; equals `k_dim` in Kimi checkpoints, kept apart
    /// so that layouts are tested with unequal sizes.
    pub v_dim: usize,
}

/// Validates the KDA argument lengths and returns the token count.
#[allow(clippy::too_many_arguments)]
fn kda_tokens(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    shape: &KdaShape,
    state: &[f32],
    out: &[f32],
) -> usize {
    let hk = shape.heads * shape.k_dim;
    let hv = shape.heads * shape.v_dim;
    assert!(
        hk > 0 && hv > 0,
        "kda: heads, k_dim and v_dim must be positive"
    );
    assert_eq!(
        q.len() % hk,
        0,
        "kda: q length {} not a multiple of heads·k_dim {hk}",
        q.len()
    );
    let t = q.len() / hk;
    assert_eq!(k.len(), t * hk, "kda: k must be [t, heads·k_dim]");
    assert_eq!(g.len(), t * hk, "kda: g must be [t, heads·k_dim]");
    assert_eq!(v.len(), t * hv, "kda: v must be [t, heads·v_dim]");
    assert_eq!(beta.len(), t * shape.heads, "kda: beta must be [t, heads]");
    assert_eq!(out.len(), t * hv, "kda: out must be [t, heads·v_dim]");
    assert_eq!(
        state.len(),
        shape.heads * shape.k_dim * shape.v_dim,
        "kda: state must be [heads, k_dim, v_dim]"
    );
    t
}

/// Copies per-head outputs (`[t, V]` each) into `out` (`[t, H·V]`).
fn scatter_heads(per_head: &[Vec<f32>], v_dim: usize, out: &mut [f32]) {
    let hv = per_head.len() * v_dim;
    for (h, o) in per_head.iter().enumerate() {
        for (i, src) in o.chunks_exact(v_dim).enumerate() {
            out[i * hv + h * v_dim..i * hv + (h + 1) * v_dim].copy_from_slice(src);
        }
    }
}

/// Recurrent KDA over `t` tokens (the decode path; any `t` works), exactly
/// transformers' `recurrent_kimi_delta_attention` with
/// `use_qk_l2norm_in_kernel=True`.
///
/// - `q`, `k`, `g`: `[t, heads·k_dim]`; `g` is the log decay (≤ 0).
/// - `v`: `[t, heads·v_dim]`; `beta`: `[t, heads]`, already sigmoid-ed.
/// - q and k are L2-normalised per head here; q is then multiplied by
///   `scale` (callers pass `k_dim^-0.5`, as every implementation does).
/// - `state`: `[heads, k_dim, v_dim]` f32, read as the initial state and
///   overwritten with the final one.
/// - `out`: `[t, heads·v_dim]`.
///
/// Heads run in parallel on the rayon pool.
///
/// # Panics
/// If a length disagrees with the shapes above.
#[allow(clippy::too_many_arguments)]
pub fn kda_recurrent(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    shape: &KdaShape,
    scale: f32,
    state: &mut [f32],
    out: &mut [f32],
) {
    let t = kda_tokens(q, k, v, g, beta, shape, state, out);
    let KdaShape {
        heads,
        k_dim: kd,
        v_dim: vd,
    } = *shape;
    let per_head: Vec<Vec<f32>> = state
        .par_chunks_mut(kd * vd)
        .enumerate()
        .map(|(h, s)| {
            let mut o = vec![0.0f32; t * vd];
            let mut qn = vec![0.0f32; kd];
            let mut kn = vec![0.0f32; kd];
            let mut u = vec![0.0f32; vd];
            for i in 0..t {
                let qk_at = i * heads * kd + h * kd;
                l2_normalize(&q[qk_at..qk_at + kd], scale, &mut qn);
                l2_normalize(&k[qk_at..qk_at + kd], 1.0, &mut kn);
                let gi = &g[qk_at..qk_at + kd];
                let vi = &v[i * heads * vd + h * vd..i * heads * vd + (h + 1) * vd];
                let b = beta[i * heads + h];
                // Decay the key rows and read the memory for k in one pass.
                u.fill(0.0);
                for a in 0..kd {
                    let row = &mut s[a * vd..(a + 1) * vd];
                    let alpha = gi[a].exp();
                    for x in row.iter_mut() {
                        *x *= alpha;
                    }
                    axpy(&mut u, kn[a], row);
                }
                for (uc, &vc) in u.iter_mut().zip(vi) {
                    *uc = (vc - *uc) * b;
                }
                // Rank-1 write, then read with q.
                let orow = &mut o[i * vd..(i + 1) * vd];
                for a in 0..kd {
                    let row = &mut s[a * vd..(a + 1) * vd];
                    axpy(row, kn[a], &u);
                    axpy(orow, qn[a], row);
                }
            }
            o
        })
        .collect();
    scatter_heads(&per_head, vd, out);
}

/// Chunked KDA for prefill (reference doc §1.3, FLA `naive_chunk_kda`,
/// transformers `chunk_kimi_delta_attention`): same arguments and result as
/// [`kda_recurrent`] (up to f32 rounding), plus `chunk`, the chunk length
/// (FLA uses 64; any value ≥ 1 is correct). A ragged last chunk is handled
/// directly (transformers zero-pads it, which gives the same numbers). The
/// initial state is read from `state` and the final state written back, so
/// a prompt may be prefilled in several calls.
///
/// Heads run in parallel on the rayon pool.
///
/// # Panics
/// If `chunk` is 0 or a length disagrees with the shapes of [`kda_recurrent`].
#[allow(clippy::too_many_arguments)]
pub fn kda_chunked(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    shape: &KdaShape,
    scale: f32,
    state: &mut [f32],
    out: &mut [f32],
    chunk: usize,
) {
    assert!(chunk > 0, "kda_chunked: chunk must be positive");
    let t = kda_tokens(q, k, v, g, beta, shape, state, out);
    let (kd, vd) = (shape.k_dim, shape.v_dim);
    let per_head: Vec<Vec<f32>> = state
        .par_chunks_mut(kd * vd)
        .enumerate()
        .map(|(h, s)| {
            let mut head = ChunkHead::new(shape, chunk);
            let mut o = vec![0.0f32; t * vd];
            let mut start = 0;
            while start < t {
                let n = chunk.min(t - start);
                let inputs = ChunkInputs {
                    q,
                    k,
                    v,
                    g,
                    beta,
                    head: h,
                    start,
                    len: n,
                    scale,
                };
                head.run(&inputs, s, &mut o[start * vd..(start + n) * vd]);
                start += n;
            }
            o
        })
        .collect();
    scatter_heads(&per_head, vd, out);
}

/// Where one chunk of one head reads its inputs from.
struct ChunkInputs<'a> {
    /// Queries `[t, H·K]` (raw, normalised inside).
    q: &'a [f32],
    /// Keys `[t, H·K]` (raw, normalised inside).
    k: &'a [f32],
    /// Values `[t, H·V]`.
    v: &'a [f32],
    /// Log decays `[t, H·K]`.
    g: &'a [f32],
    /// Write strengths `[t, H]`.
    beta: &'a [f32],
    /// Head index.
    head: usize,
    /// First token of the chunk.
    start: usize,
    /// Tokens in the chunk (≤ the chunk size).
    len: usize,
    /// Query scale.
    scale: f32,
}

/// Scratch buffers of one head for one chunk; allocated once per head and
/// reused for every chunk. Row-major, `chunk` rows each.
struct ChunkHead {
    /// Heads (to index the interleaved inputs).
    heads: usize,
    /// Key width.
    kd: usize,
    /// Value width.
    vd: usize,
    /// Chunk capacity (row stride of the square matrices).
    c: usize,
    /// Normalised, scaled queries `[C, K]`.
    qn: Vec<f32>,
    /// Normalised keys `[C, K]`.
    kn: Vec<f32>,
    /// Cumulative log decay `G_r` `[C, K]`.
    gcum: Vec<f32>,
    /// Per-token decay `α_r = exp(g_r)` `[C, K]`.
    alpha: Vec<f32>,
    /// `β_r` of the chunk `[C]`.
    beta: Vec<f32>,
    /// Strictly lower `L[r, i] = β_r Σ_d k_r k_i exp(G_r − G_i)` `[C, C]`.
    lmat: Vec<f32>,
    /// Lower (diagonal included) `A_qk[r, j] = Σ_d q_r k_j exp(G_r − G_j)` `[C, C]`.
    aqk: Vec<f32>,
    /// `W = (I + L)⁻¹ Diag(β) (γ ⊙ K)` `[C, K]`.
    w: Vec<f32>,
    /// `U = (I + L)⁻¹ Diag(β) V`, then the pseudo-values `Ṽ = U − W·S` `[C, V]`.
    u: Vec<f32>,
    /// Running decay product for one column `i` `[K]`.
    p: Vec<f32>,
    /// `k_i ⊙ p` `[K]`.
    kp: Vec<f32>,
    /// `γ_r ⊙ q_r` or a state-row coefficient `[K]`.
    tmp: Vec<f32>,
}

impl ChunkHead {
    /// Scratch for chunks of up to `chunk` tokens.
    fn new(shape: &KdaShape, chunk: usize) -> ChunkHead {
        let (kd, vd, c) = (shape.k_dim, shape.v_dim, chunk);
        ChunkHead {
            heads: shape.heads,
            kd,
            vd,
            c,
            qn: vec![0.0; c * kd],
            kn: vec![0.0; c * kd],
            gcum: vec![0.0; c * kd],
            alpha: vec![0.0; c * kd],
            beta: vec![0.0; c],
            lmat: vec![0.0; c * c],
            aqk: vec![0.0; c * c],
            w: vec![0.0; c * kd],
            u: vec![0.0; c * vd],
            p: vec![0.0; kd],
            kp: vec![0.0; kd],
            tmp: vec![0.0; kd],
        }
    }

    /// Processes one chunk: writes its outputs (`[len, V]`) to `o` and
    /// advances the head's state `s` (`[K, V]`).
    fn run(&mut self, x: &ChunkInputs<'_>, s: &mut [f32], o: &mut [f32]) {
        let (kd, vd, c, n, h) = (self.kd, self.vd, self.c, x.len, x.head);
        let (hk, hv) = (self.heads * kd, self.heads * vd);

        // Load the chunk: normalise q, k; cumulative log decays; per-token decays.
        for r in 0..n {
            let at = (x.start + r) * hk + h * kd;
            l2_normalize(
                &x.q[at..at + kd],
                x.scale,
                &mut self.qn[r * kd..(r + 1) * kd],
            );
            l2_normalize(&x.k[at..at + kd], 1.0, &mut self.kn[r * kd..(r + 1) * kd]);
            let gr = &x.g[at..at + kd];
            for (d, &gd) in gr.iter().enumerate() {
                let prev = if r == 0 {
                    0.0
                } else {
                    self.gcum[(r - 1) * kd + d]
                };
                self.gcum[r * kd + d] = prev + gd;
                self.alpha[r * kd + d] = gd.exp();
            }
            self.beta[r] = x.beta[(x.start + r) * self.heads + h];
        }

        // L and A_qk. exp(G_r − G_i) = Π_{i<m≤r} α_m, built as a running
        // product down each column: no exponentials in the O(C²K) part and
        // no growing factor that could overflow.
        for i in 0..n {
            let ki = &self.kn[i * kd..(i + 1) * kd];
            self.aqk[i * c + i] = dot(&self.qn[i * kd..(i + 1) * kd], ki);
            self.p.fill(1.0);
            for r in i + 1..n {
                let ar = &self.alpha[r * kd..(r + 1) * kd];
                for d in 0..kd {
                    let pd = self.p[d] * ar[d];
                    let pd = if pd < DECAY_FLUSH { 0.0 } else { pd };
                    self.p[d] = pd;
                    self.kp[d] = ki[d] * pd;
                }
                self.lmat[r * c + i] = self.beta[r] * dot(&self.kn[r * kd..(r + 1) * kd], &self.kp);
                self.aqk[r * c + i] = dot(&self.qn[r * kd..(r + 1) * kd], &self.kp);
            }
        }

        // Forward substitution with the unit lower-triangular (I + L):
        // W_r = β_r γ_r⊙k_r − Σ_{i<r} L[r,i] W_i,  U_r = β_r v_r − Σ_{i<r} L[r,i] U_i.
        for r in 0..n {
            let b = self.beta[r];
            let vat = (x.start + r) * hv + h * vd;
            let (w_done, w_rest) = self.w.split_at_mut(r * kd);
            let wr = &mut w_rest[..kd];
            let (gc, kn) = (
                &self.gcum[r * kd..(r + 1) * kd],
                &self.kn[r * kd..(r + 1) * kd],
            );
            for ((wd, &gd), &kv) in wr.iter_mut().zip(gc).zip(kn) {
                *wd = b * gd.exp() * kv;
            }
            let (u_done, u_rest) = self.u.split_at_mut(r * vd);
            let ur = &mut u_rest[..vd];
            for (uc, &vc) in ur.iter_mut().zip(&x.v[vat..vat + vd]) {
                *uc = b * vc;
            }
            for i in 0..r {
                let l = self.lmat[r * c + i];
                axpy(wr, -l, &w_done[i * kd..(i + 1) * kd]);
                axpy(ur, -l, &u_done[i * vd..(i + 1) * vd]);
            }
        }

        // Pseudo-values Ṽ = U − W·S (in place in `u`).
        for r in 0..n {
            let ur = &mut self.u[r * vd..(r + 1) * vd];
            for a in 0..kd {
                axpy(ur, -self.w[r * kd + a], &s[a * vd..(a + 1) * vd]);
            }
        }

        // Outputs O_r = (γ_r ⊙ q_r)·S + Σ_{j≤r} A_qk[r,j] Ṽ_j.
        for r in 0..n {
            for d in 0..kd {
                self.tmp[d] = self.gcum[r * kd + d].exp() * self.qn[r * kd + d];
            }
            let orow = &mut o[r * vd..(r + 1) * vd];
            orow.fill(0.0);
            for a in 0..kd {
                axpy(orow, self.tmp[a], &s[a * vd..(a + 1) * vd]);
            }
            for j in 0..=r {
                axpy(orow, self.aqk[r * c + j], &self.u[j * vd..(j + 1) * vd]);
            }
        }

        // State S ← Diag(γ_last)·S + Σ_j (exp(G_last − G_j) ⊙ k_j) ⊗ Ṽ_j.
        let last = (n - 1) * kd;
        for a in 0..kd {
            let gl = self.gcum[last + a];
            let row = &mut s[a * vd..(a + 1) * vd];
            let decay = gl.exp();
            for x in row.iter_mut() {
                *x *= decay;
            }
            for j in 0..n {
                let coef = (gl - self.gcum[j * kd + a]).exp() * self.kn[j * kd + a];
                axpy(row, coef, &self.u[j * vd..(j + 1) * vd]);
            }
        }
    }
}

#[cfg(test)]
mod tests;
