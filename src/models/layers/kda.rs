//! Kimi Delta Attention layer (Kimi Linear, arXiv 2510.26692 §3).
//!
//! `q, k, v = SiLU(ShortConv(proj(x)))`, a per-channel forget gate
//! `g = −exp(A_log)·softplus(f_b(f_a(x)) + dt_bias)`, `β = σ(b_proj(x))`, the
//! gated delta rule over a `[heads, d, d]` state, then a sigmoid-gated
//! RMSNorm per head and `o_proj`. The per-sequence [`LinearState`] carries the
//! conv history and the delta-rule state, so decode is O(1) per token.
//!
//! Kimi K3 variants (reference doc §1.2, Moonshot's `KimiDeltaAttention`):
//! the bounded forget gate `g = lower_bound·σ(exp(A_log)·(z + dt_bias))`
//! ([`ForgetGate::LowerBound`], `linear_attn_config.gate_lower_bound`) and
//! the full-rank output gate `g_proj: hidden → heads·d`
//! ([`OutputGate::FullRank`], `use_full_rank_gate`). The stored shape of
//! `A_log` differs between sources; [`ALogLayout`] says how it is read.

use caracal_kernels::activation::{sigmoid, softplus};
use caracal_kernels::kda::{
    kda_chunked, kda_gate, kda_gate_lower_bound, kda_recurrent, short_conv, KdaShape,
};
use caracal_kernels::norm::rms_norm_gated_sigmoid;
use caracal_kernels::Matrix;

use super::BatchLayout;
use crate::checkpoint::arch::Arch;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::models::{LinearState, SeqBatch};

/// Chunk length of the parallel (WY) form used for multi-token prefill.
pub const KDA_CHUNK: usize = 64;

/// How the output gate is produced.
pub enum OutputGate {
    /// Kimi Linear: `g_b_proj(g_a_proj(x))` (rank `head_dim`).
    LowRank {
        /// `[head_dim, hidden]`.
        g_a_proj: Matrix,
        /// `[heads·head_dim, head_dim]`.
        g_b_proj: Matrix,
    },
    /// Kimi K3 (`use_full_rank_gate: true`): `g_proj(x)`.
    FullRank {
        /// `[heads·head_dim, hidden]`.
        g_proj: Matrix,
    },
}

/// The forget-gate nonlinearity turning `z = f_b(f_a(x))` into log-decays.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ForgetGate {
    /// Kimi Linear: `g = −exp(A_log)·softplus(z + dt_bias)`.
    Softplus,
    /// Kimi K3 (`gate_lower_bound`, −5 in K3):
    /// `g = lower_bound·σ(exp(A_log)·(z + dt_bias))`, so `g ∈ (lower_bound, 0)`.
    LowerBound(f32),
}

pub use crate::checkpoint::arch::ALogLayout;

/// Everything that distinguishes one KDA variant from another at load time.
#[derive(Debug, Clone, Copy)]
pub struct KdaOptions {
    /// Model width.
    pub hidden: usize,
    /// KDA heads (`linear_attn_config.num_heads`).
    pub heads: usize,
    /// Head size (`linear_attn_config.head_dim`).
    pub head_dim: usize,
    /// Short-conv kernel size.
    pub kernel: usize,
    /// eps of `o_norm` (`rms_norm_eps`).
    pub eps: f32,
    /// Read `g_proj` (K3) instead of `g_a_proj`/`g_b_proj`.
    pub full_rank_gate: bool,
    /// Forget-gate nonlinearity.
    pub forget_gate: ForgetGate,
    /// How `A_log` is read.
    pub a_log_layout: ALogLayout,
}

/// One KDA layer.
pub struct KdaAttention {
    /// `[heads·d, hidden]`.
    pub q_proj: Matrix,
    /// `[heads·d, hidden]`.
    pub k_proj: Matrix,
    /// `[heads·d, hidden]`.
    pub v_proj: Matrix,
    /// Depthwise conv weights `[heads·d, kernel]` for q, k, v.
    pub conv: [Vec<f32>; 3],
    /// Forget-gate down projection `[d, hidden]`.
    pub f_a_proj: Matrix,
    /// Forget-gate up projection `[heads·d, d]`.
    pub f_b_proj: Matrix,
    /// Per-channel gate bias `[heads·d]`.
    pub dt_bias: Vec<f32>,
    /// Log decay rate: `[heads]`, or `[head_dim]` when `a_log_per_channel`.
    pub a_log: Vec<f32>,
    /// `a_log` holds one value per key channel shared by all heads.
    pub a_log_per_channel: bool,
    /// Forget-gate nonlinearity.
    pub forget_gate: ForgetGate,
    /// β logits `[heads, hidden]`.
    pub b_proj: Matrix,
    /// Output gate.
    pub gate: OutputGate,
    /// Gated RMSNorm weight `[d]`.
    pub o_norm: Vec<f32>,
    /// eps of `o_norm`.
    pub o_norm_eps: f32,
    /// `[hidden, heads·d]`.
    pub o_proj: Matrix,
    /// Heads and head size.
    pub shape: KdaShape,
    /// Short-conv kernel size.
    pub kernel: usize,
    /// Index among the model's linear layers (into `SeqState::linear`).
    pub linear_layer: usize,
}

impl KdaOptions {
    /// The options `arch` describes (its KDA dims; `o_norm` eps is
    /// `rms_norm_eps`).
    pub fn from_arch(arch: &Arch) -> Result<KdaOptions> {
        let k = arch.kda.as_ref().ok_or_else(|| {
            Error::Config(format!(
                "{} config has no KDA settings",
                arch.model_type.name()
            ))
        })?;
        Ok(KdaOptions {
            hidden: arch.hidden_size,
            heads: k.heads,
            head_dim: k.head_dim,
            kernel: k.conv_kernel,
            eps: arch.rms_norm_eps,
            full_rank_gate: k.full_rank_gate,
            forget_gate: k
                .gate_lower_bound
                .map_or(ForgetGate::Softplus, ForgetGate::LowerBound),
            a_log_layout: k.a_log_layout,
        })
    }
}

impl KdaAttention {
    /// Loads `{prefix}.*` for any variant (Kimi Linear or K3).
    pub fn load_with(
        ckpt: &Checkpoint,
        prefix: &str,
        o: &KdaOptions,
        linear_layer: usize,
    ) -> Result<KdaAttention> {
        let (hidden, heads, head_dim, kernel) = (o.hidden, o.heads, o.head_dim, o.kernel);
        let p = heads * head_dim;
        let m = |n: &str, r, c| ckpt.matrix(&format!("{prefix}.{n}.weight"), r, c);
        let conv = |n: &str| ckpt.tensor_f32(&format!("{prefix}.{n}.weight"), &[p, 1, kernel]);
        let gate = if o.full_rank_gate {
            OutputGate::FullRank {
                g_proj: m("g_proj", p, hidden)?,
            }
        } else {
            OutputGate::LowRank {
                g_a_proj: m("g_a_proj", head_dim, hidden)?,
                g_b_proj: m("g_b_proj", p, head_dim)?,
            }
        };
        let (a_log, a_log_per_channel) = load_a_log(
            ckpt,
            &format!("{prefix}.A_log"),
            heads,
            head_dim,
            o.a_log_layout,
        )?;
        Ok(KdaAttention {
            q_proj: m("q_proj", p, hidden)?,
            k_proj: m("k_proj", p, hidden)?,
            v_proj: m("v_proj", p, hidden)?,
            conv: [conv("q_conv1d")?, conv("k_conv1d")?, conv("v_conv1d")?],
            f_a_proj: m("f_a_proj", head_dim, hidden)?,
            f_b_proj: m("f_b_proj", p, head_dim)?,
            dt_bias: ckpt.vector(&format!("{prefix}.dt_bias"), p)?,
            a_log,
            a_log_per_channel,
            forget_gate: o.forget_gate,
            b_proj: m("b_proj", heads, hidden)?,
            gate,
            o_norm: ckpt.vector(&format!("{prefix}.o_norm.weight"), head_dim)?,
            o_norm_eps: o.eps,
            o_proj: m("o_proj", hidden, p)?,
            shape: KdaShape {
                heads,
                k_dim: head_dim,
                v_dim: head_dim,
            },
            kernel,
            linear_layer,
        })
    }

    /// Turns forget-gate logits `z` `[rows, heads·d]` into log-decays in place.
    pub fn apply_forget_gate(&self, z: &mut [f32]) {
        let (h, d) = (self.shape.heads, self.shape.k_dim);
        match (self.forget_gate, self.a_log_per_channel) {
            (ForgetGate::Softplus, false) => kda_gate(z, h, d, &self.a_log, &self.dt_bias),
            (ForgetGate::LowerBound(lb), false) => {
                kda_gate_lower_bound(z, h, d, &self.a_log, &self.dt_bias, lb)
            }
            (gate, true) => gate_per_channel(z, h, d, &self.a_log, &self.dt_bias, gate),
        }
    }

    /// A zeroed state for a new sequence.
    pub fn new_state(&self) -> LinearState {
        let p = self.shape.heads * self.shape.k_dim;
        LinearState {
            conv: vec![0.0; 3 * p * (self.kernel - 1)],
            recurrent: vec![0.0; self.shape.heads * self.shape.k_dim * self.shape.v_dim],
        }
    }

    /// Runs the layer on `x` (normed hidden states of the batch).
    pub fn forward(&self, x: &[f32], layout: &BatchLayout, batch: &mut [SeqBatch<'_>]) -> Vec<f32> {
        let (h, d) = (self.shape.heads, self.shape.k_dim);
        let p = h * d;
        let n = layout.rows;
        let proj = [
            self.q_proj.forward(x),
            self.k_proj.forward(x),
            self.v_proj.forward(x),
        ];
        let mut g = self.f_b_proj.forward(&self.f_a_proj.forward(x));
        self.apply_forget_gate(&mut g);
        let mut beta = self.b_proj.forward(x);
        for b in beta.iter_mut() {
            *b = sigmoid(*b);
        }
        let mut core = vec![0.0; n * p];
        let hist = p * (self.kernel - 1);
        for (sl, seq) in layout.seqs.iter().zip(batch.iter_mut()) {
            let st = &mut seq.state.linear[self.linear_layer];
            let rows = sl.row..sl.row + sl.len;
            let mut qkv: [Vec<f32>; 3] = Default::default();
            for i in 0..3 {
                let mut out = vec![0.0; sl.len * p];
                short_conv(
                    &proj[i][rows.start * p..rows.end * p],
                    p,
                    &self.conv[i],
                    self.kernel,
                    &mut st.conv[i * hist..(i + 1) * hist],
                    &mut out,
                );
                qkv[i] = out;
            }
            let scale = (d as f32).powf(-0.5);
            let args = (
                &g[rows.start * p..rows.end * p],
                &beta[rows.start * h..rows.end * h],
            );
            let out = &mut core[rows.start * p..rows.end * p];
            if sl.len == 1 {
                kda_recurrent(
                    &qkv[0],
                    &qkv[1],
                    &qkv[2],
                    args.0,
                    args.1,
                    &self.shape,
                    scale,
                    &mut st.recurrent,
                    out,
                );
            } else {
                kda_chunked(
                    &qkv[0],
                    &qkv[1],
                    &qkv[2],
                    args.0,
                    args.1,
                    &self.shape,
                    scale,
                    &mut st.recurrent,
                    out,
                    KDA_CHUNK,
                );
            }
        }
        let gate = match &self.gate {
            OutputGate::LowRank { g_a_proj, g_b_proj } => g_b_proj.forward(&g_a_proj.forward(x)),
            OutputGate::FullRank { g_proj } => g_proj.forward(x),
        };
        rms_norm_gated_sigmoid(&mut core, &gate, &self.o_norm, self.o_norm_eps);
        self.o_proj.forward(&core)
    }
}

/// Reads `A_log` (see [`ALogLayout`]); returns the values and whether they
/// are per channel.
fn load_a_log(
    ckpt: &Checkpoint,
    name: &str,
    heads: usize,
    head_dim: usize,
    layout: ALogLayout,
) -> Result<(Vec<f32>, bool)> {
    let shape = ckpt.entry(name)?.shape.clone();
    let numel: usize = shape.iter().product();
    let values = ckpt.tensor_f32(name, &shape)?;
    let bad = || Error::TensorShape {
        name: name.into(),
        expected: vec![heads],
        found: shape.clone(),
    };
    match layout {
        ALogLayout::PerChannel if numel == head_dim => Ok((values, true)),
        ALogLayout::PerChannel => Err(Error::TensorShape {
            name: name.into(),
            expected: vec![head_dim],
            found: shape.clone(),
        }),
        ALogLayout::PerHead if numel >= heads && (numel == heads || numel == head_dim) => {
            Ok((values[..heads].to_vec(), false))
        }
        ALogLayout::Auto if numel == heads => Ok((values, false)),
        ALogLayout::Auto if numel == head_dim && numel > heads => {
            if values[heads..].iter().all(|&v| v == 0.0) {
                Ok((values[..heads].to_vec(), false))
            } else {
                tracing::warn!(tensor = name, "A_log is a [head_dim] buffer with a non-zero tail: reading it per channel (set linear_attn_config.a_log_layout to override)");
                Ok((values, true))
            }
        }
        _ => Err(bad()),
    }
}

/// Forget gate with one `A_log` value per key channel `d`, shared by all
/// heads: `g[h,d] = −exp(A[d])·softplus(z + b)` or `lb·σ(exp(A[d])·(z + b))`.
fn gate_per_channel(
    z: &mut [f32],
    heads: usize,
    head_dim: usize,
    a_log: &[f32],
    dt_bias: &[f32],
    gate: ForgetGate,
) {
    assert_eq!(
        a_log.len(),
        head_dim,
        "per-channel A_log must have head_dim values"
    );
    assert_eq!(
        dt_bias.len(),
        heads * head_dim,
        "dt_bias must have heads·head_dim values"
    );
    let rate: Vec<f32> = a_log.iter().map(|a| a.exp()).collect();
    for row in z.chunks_mut(heads * head_dim) {
        for (i, v) in row.iter_mut().enumerate() {
            let (a, x) = (rate[i % head_dim], *v + dt_bias[i]);
            *v = match gate {
                ForgetGate::Softplus => -a * softplus(x),
                ForgetGate::LowerBound(lb) => lb * sigmoid(a * x),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig64(x: f64) -> f64 {
        1.0 / (1.0 + (-x).exp())
    }

    #[test]
    fn per_channel_gate_matches_the_formula_in_f64() {
        let (h, d) = (3, 8);
        let a_log: Vec<f32> = (0..d).map(|i| (i as f32 - 4.0) * 0.3).collect();
        let dt: Vec<f32> = (0..h * d)
            .map(|i| ((i * 7) % 11) as f32 * 0.2 - 1.0)
            .collect();
        let z0: Vec<f32> = (0..2 * h * d)
            .map(|i| ((i * 13) % 17) as f32 * 0.5 - 4.0)
            .collect();
        for gate in [ForgetGate::LowerBound(-5.0), ForgetGate::Softplus] {
            let mut z = z0.clone();
            gate_per_channel(&mut z, h, d, &a_log, &dt, gate);
            for (i, (&g, &x)) in z.iter().zip(&z0).enumerate() {
                let c = i % (h * d);
                let a = (a_log[c % d] as f64).exp();
                let x = x as f64 + dt[c] as f64;
                let want = match gate {
                    ForgetGate::LowerBound(lb) => lb as f64 * sig64(a * x),
                    ForgetGate::Softplus => -a * x.exp().ln_1p(),
                };
                // f32 exp/sigmoid/softplus of O(10) arguments: 1e-5 relative.
                assert!(
                    (g as f64 - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{gate:?} {i}: {g} vs {want}"
                );
            }
        }
    }

    #[test]
    fn per_channel_gate_with_equal_channels_equals_the_per_head_kernel() {
        // A per-channel A_log that is constant equals a per-head A_log with that value.
        let (h, d) = (2, 32);
        let dt: Vec<f32> = (0..h * d).map(|i| (i % 5) as f32 * 0.3 - 0.6).collect();
        let z0: Vec<f32> = (0..h * d).map(|i| (i % 9) as f32 * 0.7 - 3.0).collect();
        let mut a = z0.clone();
        gate_per_channel(
            &mut a,
            h,
            d,
            &vec![0.4; d],
            &dt,
            ForgetGate::LowerBound(-5.0),
        );
        let mut b = z0.clone();
        kda_gate_lower_bound(&mut b, h, d, &[0.4, 0.4], &dt, -5.0);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-6, "{x} vs {y}");
        }
    }

    #[test]
    fn a_log_layout_parses_from_snake_case() {
        let l: ALogLayout = serde_json::from_str("\"per_channel\"").unwrap();
        assert_eq!(l, ALogLayout::PerChannel);
        let l: ALogLayout = serde_json::from_str("\"auto\"").unwrap();
        assert_eq!(l, ALogLayout::Auto);
    }
}
