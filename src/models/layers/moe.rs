//! The DeepSeek-style MoE block: a router over `E` experts with top-k
//! selection (optionally grouped, with a selection-only bias), routed SwiGLU
//! experts weighted by their renormalised scores, plus shared experts that
//! see every token.
//!
//! Routed experts run locally by default; once an [`ExpertDispatch`] is set
//! (expert shards, `--ep N`), the block sends its routed rows there. Both
//! paths sum expert outputs in the router's order, so results do not depend
//! on where experts run.

use std::sync::{Arc, RwLock};

use caracal_actors::engine::{run_experts_local, ExpertDispatch, ExpertFfn};
use caracal_kernels::moe::{route, RouterConfig};
use caracal_kernels::Matrix;

use super::{add_inplace, Mlp};

impl ExpertFfn for Mlp {
    fn forward(&self, x: &[f32]) -> Vec<f32> {
        Mlp::forward(self, x)
    }
}

/// One MoE block.
pub struct MoeBlock {
    /// Router weight `[E, hidden]` (scores computed in f32).
    pub gate: Matrix,
    /// `e_score_correction_bias` `[E]` (selection only).
    pub bias: Option<Vec<f32>>,
    /// Routed experts.
    pub experts: Vec<Arc<dyn ExpertFfn>>,
    /// Shared experts fused into one MLP (intermediate = n_shared · moe_intermediate).
    pub shared: Option<Mlp>,
    /// Scoring, top-k and grouping.
    pub router: RouterConfig,
    /// Index of this block among the model's MoE layers.
    pub moe_layer: usize,
    /// Where routed experts run when not locally (set once by the runtime).
    pub dispatch: RwLock<Option<Arc<dyn ExpertDispatch>>>,
}

impl MoeBlock {
    /// A block whose experts run locally until a dispatcher is set.
    pub fn new(
        gate: Matrix,
        bias: Option<Vec<f32>>,
        experts: Vec<Mlp>,
        shared: Option<Mlp>,
        router: RouterConfig,
        moe_layer: usize,
    ) -> MoeBlock {
        MoeBlock {
            gate,
            bias,
            experts: experts.into_iter().map(|m| Arc::new(m) as Arc<dyn ExpertFfn>).collect(),
            shared,
            router,
            moe_layer,
            dispatch: RwLock::new(None),
        }
    }

    /// Per-token `(expert, weight)` choices for `x` `[n, hidden]`.
    pub fn route(&self, x: &[f32]) -> Vec<Vec<(usize, f32)>> {
        let e = self.gate.rows;
        let logits = self.gate.forward(x);
        logits.chunks(e).map(|l| route(l, self.bias.as_deref(), &self.router)).collect()
    }

    /// `Σ_k w_k · E_k(x) + shared(x)` for every row of `x`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let d = self.gate.cols;
        let choices = self.route(x);
        let dispatch = self.dispatch.read().expect("dispatch lock is never poisoned: writers do not panic").clone();
        let mut out = match dispatch {
            Some(d_) => d_.run(self.moe_layer, x, d, &choices),
            None => run_experts_local(&self.experts, x, d, &choices),
        };
        if let Some(shared) = &self.shared {
            add_inplace(&mut out, &shared.forward(x));
        }
        out
    }
}
