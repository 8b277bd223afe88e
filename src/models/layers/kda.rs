//! Kimi Delta Attention layer (Kimi Linear, arXiv 2510.26692 §3).
//!
//! `q, k, v = SiLU(ShortConv(proj(x)))`, a per-channel forget gate
//! `g = −exp(A_log)·softplus(f_b(f_a(x)) + dt_bias)`, `β = σ(b_proj(x))`, the
//! gated delta rule over a `[heads, d, d]` state, then a sigmoid-gated
//! RMSNorm per head and `o_proj`. The per-sequence [`LinearState`] carries the
//! conv history and the delta-rule state, so decode is O(1) per token.

use caracal_kernels::activation::sigmoid;
use caracal_kernels::kda::{kda_chunked, kda_gate, kda_recurrent, short_conv, KdaShape};
use caracal_kernels::norm::rms_norm_gated_sigmoid;
use caracal_kernels::Matrix;

use super::BatchLayout;
use crate::checkpoint::Checkpoint;
use crate::error::Result;
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
    /// Per-head log decay rate `[heads]`.
    pub a_log: Vec<f32>,
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

impl KdaAttention {
    /// Loads `{prefix}.*` with Kimi Linear's published names.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        hidden: usize,
        heads: usize,
        head_dim: usize,
        kernel: usize,
        eps: f32,
        linear_layer: usize,
    ) -> Result<KdaAttention> {
        let p = heads * head_dim;
        let m = |n: &str, r, c| ckpt.matrix(&format!("{prefix}.{n}.weight"), r, c);
        let conv = |n: &str| ckpt.tensor_f32(&format!("{prefix}.{n}.weight"), &[p, 1, kernel]);
        Ok(KdaAttention {
            q_proj: m("q_proj", p, hidden)?,
            k_proj: m("k_proj", p, hidden)?,
            v_proj: m("v_proj", p, hidden)?,
            conv: [conv("q_conv1d")?, conv("k_conv1d")?, conv("v_conv1d")?],
            f_a_proj: m("f_a_proj", head_dim, hidden)?,
            f_b_proj: m("f_b_proj", p, head_dim)?,
            dt_bias: ckpt.vector(&format!("{prefix}.dt_bias"), p)?,
            a_log: ckpt.tensor_f32(&format!("{prefix}.A_log"), &[1, 1, heads, 1])?,
            b_proj: m("b_proj", heads, hidden)?,
            gate: OutputGate::LowRank { g_a_proj: m("g_a_proj", head_dim, hidden)?, g_b_proj: m("g_b_proj", p, head_dim)? },
            o_norm: ckpt.vector(&format!("{prefix}.o_norm.weight"), head_dim)?,
            o_norm_eps: eps,
            o_proj: m("o_proj", hidden, p)?,
            shape: KdaShape { heads, k_dim: head_dim, v_dim: head_dim },
            kernel,
            linear_layer,
        })
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
        let proj = [self.q_proj.forward(x), self.k_proj.forward(x), self.v_proj.forward(x)];
        let mut g = self.f_b_proj.forward(&self.f_a_proj.forward(x));
        kda_gate(&mut g, h, d, &self.a_log, &self.dt_bias);
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
            let args = (&g[rows.start * p..rows.end * p], &beta[rows.start * h..rows.end * h]);
            let out = &mut core[rows.start * p..rows.end * p];
            if sl.len == 1 {
                kda_recurrent(&qkv[0], &qkv[1], &qkv[2], args.0, args.1, &self.shape, scale, &mut st.recurrent, out);
            } else {
                kda_chunked(&qkv[0], &qkv[1], &qkv[2], args.0, args.1, &self.shape, scale, &mut st.recurrent, out, KDA_CHUNK);
            }
        }
        let gate = match &self.gate {
            OutputGate::LowRank { g_a_proj, g_b_proj } => g_b_proj.forward(&g_a_proj.forward(x)),
        };
        rms_norm_gated_sigmoid(&mut core, &gate, &self.o_norm, self.o_norm_eps);
        self.o_proj.forward(&core)
    }
}
