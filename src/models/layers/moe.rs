//! The DeepSeek-style MoE block: a router over `E` experts with top-k
//! selection (optionally grouped, with a selection-only bias), routed SwiGLU
//! experts weighted by their renormalised scores, plus shared experts that
//! see every token.

use caracal_kernels::moe::{route, RouterConfig};
use caracal_kernels::Matrix;

use super::{add_inplace, Mlp};

/// One MoE block.
pub struct MoeBlock {
    /// Router weight `[E, hidden]` (scores computed in f32).
    pub gate: Matrix,
    /// `e_score_correction_bias` `[E]` (selection only).
    pub bias: Option<Vec<f32>>,
    /// Routed experts.
    pub experts: Vec<Mlp>,
    /// Shared experts fused into one MLP (intermediate = n_shared · moe_intermediate).
    pub shared: Option<Mlp>,
    /// Scoring, top-k and grouping.
    pub router: RouterConfig,
}

impl MoeBlock {
    /// Per-token `(expert, weight)` choices for `x` `[n, hidden]`.
    pub fn route(&self, x: &[f32]) -> Vec<Vec<(usize, f32)>> {
        let e = self.gate.rows;
        let logits = self.gate.forward(x);
        logits.chunks(e).map(|l| route(l, self.bias.as_deref(), &self.router)).collect()
    }

    /// `Σ_k w_k · E_k(x) + shared(x)` for every row of `x`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let d = self.gate.cols;
        let n = x.len() / d;
        let choices = self.route(x);
        let mut out = vec![0.0; n * d];
        // Group rows by expert so each expert runs once on all its rows.
        let mut rows_of: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.experts.len()];
        for (row, c) in choices.iter().enumerate() {
            for &(expert, w) in c {
                rows_of[expert].push((row, w));
            }
        }
        for (expert, rows) in rows_of.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let mut xs = Vec::with_capacity(rows.len() * d);
            for &(r, _) in rows {
                xs.extend_from_slice(&x[r * d..(r + 1) * d]);
            }
            let y = self.experts[expert].forward(&xs);
            for (i, &(r, w)) in rows.iter().enumerate() {
                for (o, v) in out[r * d..(r + 1) * d].iter_mut().zip(&y[i * d..(i + 1) * d]) {
                    *o += w * v;
                }
            }
        }
        if let Some(shared) = &self.shared {
            add_inplace(&mut out, &shared.forward(x));
        }
        out
    }
}
