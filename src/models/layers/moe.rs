//! The DeepSeek-style MoE block: a router over `E` experts with top-k
//! selection (optionally grouped, with a selection-only bias), routed SwiGLU
//! experts weighted by their renormalised scores, plus shared experts that
//! see every token.
//!
//! [`MoeBlock::load`] reads a block for every MoE architecture from the
//! checkpoint's [`Arch`]: router (validated settings), correction bias,
//! routed experts through [`super::experts`] (every stored layout), shared
//! experts and K3's latent projections. [`Ffn`] is a layer's feed-forward
//! part (dense MLP or MoE block) in every model file, and
//! [`impl_moe_model!`] gives a model the [`caracal_actors::engine::MoeModel`]
//! interface over its layers' [`Ffn`]s.
//!
//! Routed experts run locally by default, as one grouped operation
//! ([`caracal_actors::engine::run_experts_local`]: rows gathered per expert
//! into one buffer, experts spread over the worker threads, each expert's
//! weights streamed once per step); once an [`ExpertDispatch`] is set
//! (expert shards, `--ep N`), the block sends its routed rows there, and the
//! shards run the same grouped kernel. Both paths sum expert outputs in the
//! router's order, so results do not depend on where experts run. Shared
//! experts run beside the routed group (`rayon::join`) and are added last.
//!
//! Kimi K3's **latent MoE** ([`LatentProj`], reference doc §4.1): the router
//! scores the full-width `x`, but routed experts live in a narrower latent
//! space: `z = routed_expert_down_proj(x)`, `r = Σ_k w_k·E_k(z)`,
//! `y = routed_expert_up_proj(routed_expert_norm(r)) + shared(x)`. The
//! experts (and a dispatcher, which is handed `z` and the latent width) never
//! see the full width; shared experts still do.

use std::sync::{Arc, RwLock};

use caracal_actors::engine::{run_experts_local, ExpertDispatch, ExpertFfn};
use caracal_kernels::moe::{route, RouterConfig};
use caracal_kernels::Matrix;

use super::experts::load_expert;
use super::{add_inplace, Mlp, RmsNorm};
use crate::checkpoint::arch::{Arch, MlpKind};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

impl ExpertFfn for Mlp {
    fn forward(&self, x: &[f32]) -> Vec<f32> {
        Mlp::forward(self, x)
    }

    fn forward_into(&self, x: &[f32], out: &mut [f32]) {
        Mlp::forward_into(self, x, out)
    }

    /// The first [`EXPERT_PREFETCH_BYTES`] of each projection: the second
    /// and third arrive while the first is computed, and the kernels' own
    /// prefetching takes over from there.
    fn prefetch(&self) {
        for m in [&self.gate_proj, &self.up_proj, &self.down_proj] {
            m.prefetch(EXPERT_PREFETCH_BYTES);
        }
    }
}

/// Weight bytes of each projection of a routed expert hinted into the
/// caches before it runs ([`ExpertFfn::prefetch`]): all of a small
/// expert's projection (the K3-shaped bench's are 35 KB), the start of a
/// large one. 8 KiB (the panel kernel's own distance ahead) gave no
/// measurable gain there, 64 KiB ~3%. Default 64 KiB.
pub const EXPERT_PREFETCH_BYTES: usize = 64 * 1024;

/// The projections around latent routed experts (K3).
pub struct LatentProj {
    /// `[latent, hidden]`: full width → expert width.
    pub routed_expert_down_proj: Matrix,
    /// RMSNorm `[latent]` on the weighted expert sum (`latent_moe_use_norm`).
    pub routed_expert_norm: Option<RmsNorm>,
    /// `[hidden, latent]`: expert width → full width.
    pub routed_expert_up_proj: Matrix,
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
    /// Latent projections (K3); `None`: experts run at the full width.
    pub latent: Option<LatentProj>,
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
            experts: experts
                .into_iter()
                .map(|m| Arc::new(m) as Arc<dyn ExpertFfn>)
                .collect(),
            shared,
            router,
            moe_layer,
            dispatch: RwLock::new(None),
            latent: None,
        }
    }

    /// Loads the MoE block of decoder layer `layer` (tensors under
    /// `layer_prefix`, e.g. `model.layers.3`) as `arch` describes it.
    ///
    /// The block's module is the family's published one
    /// (`block_sparse_moe` for the Kimi family, `mlp` otherwise), or the
    /// other spelling transformers loads when only that one has a router
    /// (`….mlp.gate.weight` in a Kimi checkpoint).
    pub fn load(
        ckpt: &Checkpoint,
        layer_prefix: &str,
        arch: &Arch,
        layer: usize,
    ) -> Result<MoeBlock> {
        let m = arch.moe.as_ref().ok_or_else(|| {
            Error::Config(format!(
                "layer {layer} is MoE but the {} config has no experts",
                arch.model_type.name()
            ))
        })?;
        let (d, e, act) = (arch.hidden_size, m.experts, arch.act);
        let modules = arch.family.moe_modules();
        let module = modules
            .iter()
            .map(|name| format!("{layer_prefix}.{name}"))
            .find(|p| ckpt.has_matrix(&format!("{p}.gate.weight")))
            .unwrap_or_else(|| format!("{layer_prefix}.{}", modules[0]));
        let width = m.latent.unwrap_or(d);
        let experts = (0..e)
            .map(|j| {
                load_expert(
                    ckpt,
                    &module,
                    j,
                    arch.family.expert_names(),
                    width,
                    m.intermediate,
                    act,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let shared = if m.shared > 0 {
            Some(Mlp::load(
                ckpt,
                &format!("{module}.shared_experts"),
                ["gate_proj", "up_proj", "down_proj"],
                d,
                m.intermediate * m.shared,
                act,
            )?)
        } else {
            None
        };
        let bias_name = format!("{module}.gate.e_score_correction_bias");
        let bias = if ckpt.has(&bias_name) {
            Some(ckpt.vector(&bias_name, e)?)
        } else {
            None
        };
        let block = MoeBlock::new(
            ckpt.matrix(&format!("{module}.gate.weight"), e, d)?,
            bias,
            experts,
            shared,
            m.router.router_config(),
            arch.moe_index(layer),
        );
        Ok(match m.latent {
            Some(r) => block.with_latent(LatentProj {
                routed_expert_down_proj: ckpt.matrix(
                    &format!("{module}.routed_expert_down_proj.weight"),
                    r,
                    d,
                )?,
                routed_expert_norm: if m.latent_norm {
                    Some(RmsNorm::load(
                        ckpt,
                        &format!("{module}.routed_expert_norm.weight"),
                        r,
                        arch.rms_norm_eps,
                    )?)
                } else {
                    None
                },
                routed_expert_up_proj: ckpt.matrix(
                    &format!("{module}.routed_expert_up_proj.weight"),
                    d,
                    r,
                )?,
            }),
            None => block,
        })
    }

    /// Runs the routed experts in `latent`'s space (K3's latent MoE).
    pub fn with_latent(mut self, latent: LatentProj) -> MoeBlock {
        self.latent = Some(latent);
        self
    }

    /// Routes this block's expert compute through `dispatch` from now on.
    pub fn set_dispatch(&self, dispatch: Arc<dyn ExpertDispatch>) {
        *self
            .dispatch
            .write()
            .expect("dispatch lock is never poisoned: writers do not panic") = Some(dispatch);
    }

    /// Per-token `(expert, weight)` choices for `x` `[n, hidden]`.
    pub fn route(&self, x: &[f32]) -> Vec<Vec<(usize, f32)>> {
        let e = self.gate.rows;
        let logits = self.gate.forward(x);
        logits
            .chunks(e)
            .map(|l| route(l, self.bias.as_deref(), &self.router))
            .collect()
    }

    /// `Σ_k w_k · E_k(x) + shared(x)` for every row of `x` (with a latent
    /// space: `up(norm(Σ_k w_k · E_k(down(x)))) + shared(x)`).
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let choices = self.route(x);
        let latent_x = self
            .latent
            .as_ref()
            .map(|l| l.routed_expert_down_proj.forward(x));
        let (rx, width) = match (&latent_x, &self.latent) {
            (Some(z), Some(l)) => (z.as_slice(), l.routed_expert_down_proj.rows),
            _ => (x, self.gate.cols),
        };
        let dispatch = self
            .dispatch
            .read()
            .expect("dispatch lock is never poisoned: writers do not panic")
            .clone();
        let routed = || {
            let mut out = match &dispatch {
                Some(d_) => d_.run(self.moe_layer, rx, width, &choices),
                None => run_experts_local(&self.experts, rx, width, &choices),
            };
            if let Some(l) = &self.latent {
                if let Some(norm) = &l.routed_expert_norm {
                    out = norm.forward(&out);
                }
                out = l.routed_expert_up_proj.forward(&out);
            }
            out
        };
        match &self.shared {
            // Shared experts run beside the routed group (or while the
            // shards work) and are added last, as before.
            Some(shared) => {
                let (mut out, s) = rayon::join(routed, || shared.forward(x));
                add_inplace(&mut out, &s);
                out
            }
            None => routed(),
        }
    }
}

/// The feed-forward part of a decoder layer.
pub enum Ffn {
    /// One gated MLP.
    Dense(Box<Mlp>),
    /// Router, routed and shared experts.
    Moe(Box<MoeBlock>),
}

impl Ffn {
    /// Loads the feed-forward part of layer `layer` as `arch` says it is.
    pub fn load(ckpt: &Checkpoint, layer_prefix: &str, arch: &Arch, layer: usize) -> Result<Ffn> {
        Ok(match arch.layers[layer].mlp {
            MlpKind::Dense => Ffn::Dense(Box::new(Mlp::load_dense(
                ckpt,
                layer_prefix,
                arch.family,
                arch.hidden_size,
                arch.intermediate_size,
                arch.act,
            )?)),
            MlpKind::Moe => Ffn::Moe(Box::new(MoeBlock::load(ckpt, layer_prefix, arch, layer)?)),
        })
    }

    /// Runs the layer's MLP or MoE block on `x` `[n, hidden]`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        match self {
            Ffn::Dense(mlp) => mlp.forward(x),
            Ffn::Moe(moe) => moe.forward(x),
        }
    }

    /// The MoE block, if this is one.
    pub fn moe(&self) -> Option<&MoeBlock> {
        match self {
            Ffn::Moe(m) => Some(m),
            Ffn::Dense(_) => None,
        }
    }
}

/// Routed experts of every MoE block among `ffns`, in layer order.
pub fn experts_of<'a>(ffns: impl Iterator<Item = &'a Ffn>) -> Vec<Vec<Arc<dyn ExpertFfn>>> {
    ffns.filter_map(Ffn::moe)
        .map(|m| m.experts.clone())
        .collect()
}

/// Routes every MoE block among `ffns` through `dispatch`.
pub fn set_dispatch_all<'a>(
    ffns: impl Iterator<Item = &'a Ffn>,
    dispatch: &Arc<dyn ExpertDispatch>,
) {
    for m in ffns.filter_map(Ffn::moe) {
        m.set_dispatch(dispatch.clone());
    }
}

/// Implements [`caracal_actors::engine::MoeModel`] for a model whose
/// `layers` each hold an [`Ffn`] in field `$ffn`.
macro_rules! impl_moe_model {
    ($model:ty, $ffn:ident) => {
        impl $crate::models::MoeModel for $model {
            fn experts(&self) -> Vec<Vec<std::sync::Arc<dyn $crate::models::ExpertFfn>>> {
                $crate::models::layers::moe::experts_of(self.layers.iter().map(|l| &l.$ffn))
            }

            fn set_expert_dispatch(
                &self,
                dispatch: std::sync::Arc<dyn $crate::models::ExpertDispatch>,
            ) {
                $crate::models::layers::moe::set_dispatch_all(
                    self.layers.iter().map(|l| &l.$ffn),
                    &dispatch,
                );
            }
        }
    };
}
pub(crate) use impl_moe_model;

#[cfg(test)]
mod tests {
    use caracal_kernels::moe::Scoring;

    use super::*;
    use crate::models::layers::GluAct;

    fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect()
    }

    fn mlp(hidden: usize, inter: usize, seed: u64, act: GluAct) -> Mlp {
        Mlp {
            gate_proj: Matrix::from_f32(inter, hidden, &values(inter * hidden, seed, 0.3)),
            up_proj: Matrix::from_f32(inter, hidden, &values(inter * hidden, seed + 1, 0.3)),
            down_proj: Matrix::from_f32(hidden, inter, &values(hidden * inter, seed + 2, 0.3)),
            act,
        }
    }

    /// `[r, c] · x` in f64.
    fn lin(w: &[f32], r: usize, c: usize, x: &[f64]) -> Vec<f64> {
        (0..r)
            .map(|i| (0..c).map(|j| w[i * c + j] as f64 * x[j]).sum())
            .collect()
    }

    fn mlp_f64(m: &Mlp, x: &[f64]) -> Vec<f64> {
        let (i, h) = (m.gate_proj.rows, m.gate_proj.cols);
        let g = lin(&m.gate_proj.to_f32_vec(), i, h, x);
        let u = lin(&m.up_proj.to_f32_vec(), i, h, x);
        let a: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| 4.0 * (g / 4.0).tanh() / (1.0 + (-g).exp()) * 25.0 * (u / 25.0).tanh())
            .collect();
        lin(&m.down_proj.to_f32_vec(), h, i, &a)
    }

    #[test]
    fn latent_moe_matches_a_direct_f64_evaluation_and_the_dispatch_path() {
        let (d, latent, inter, e, k) = (48, 32, 16, 6, 2);
        let act = GluAct::Situ {
            beta: 4.0,
            linear_beta: Some(25.0),
        };
        let router = RouterConfig {
            scoring: Scoring::Sigmoid,
            top_k: k,
            n_group: 1,
            topk_group: 1,
            renormalize: true,
            routed_scaling_factor: 1.5,
            bias_in_weights: false,
        };
        let experts: Vec<Mlp> = (0..e)
            .map(|j| mlp(latent, inter, 100 + 10 * j as u64, act))
            .collect();
        let experts_ref: Vec<Mlp> = (0..e)
            .map(|j| mlp(latent, inter, 100 + 10 * j as u64, act))
            .collect();
        let shared = mlp(d, 2 * inter, 7, act);
        let shared_ref = mlp(d, 2 * inter, 7, act);
        let gate = Matrix::from_f32(e, d, &values(e * d, 3, 1.0));
        let down = values(latent * d, 4, 0.4);
        let up = values(d * latent, 5, 0.4);
        let norm_w = values(latent, 6, 1.0);
        let block = MoeBlock::new(
            gate,
            Some(values(e, 8, 0.2)),
            experts,
            Some(shared),
            router,
            0,
        )
        .with_latent(LatentProj {
            routed_expert_down_proj: Matrix::from_f32(latent, d, &down),
            routed_expert_norm: Some(RmsNorm {
                weight: norm_w.clone(),
                eps: 1e-5,
            }),
            routed_expert_up_proj: Matrix::from_f32(d, latent, &up),
        });
        let rows = 5;
        let x = values(rows * d, 9, 1.0);
        let got = block.forward(&x);
        let choices = block.route(&x);
        for r in 0..rows {
            let xr: Vec<f64> = x[r * d..(r + 1) * d].iter().map(|&v| v as f64).collect();
            let z = lin(&down, latent, d, &xr);
            let mut acc = vec![0.0; latent];
            for &(j, w) in &choices[r] {
                for (a, y) in acc.iter_mut().zip(mlp_f64(&experts_ref[j], &z)) {
                    *a += w as f64 * y;
                }
            }
            let inv = 1.0 / (acc.iter().map(|v| v * v).sum::<f64>() / latent as f64 + 1e-5).sqrt();
            let normed: Vec<f64> = acc
                .iter()
                .zip(&norm_w)
                .map(|(v, w)| v * inv * *w as f64)
                .collect();
            let want: Vec<f64> = lin(&up, d, latent, &normed)
                .iter()
                .zip(mlp_f64(&shared_ref, &xr))
                .map(|(a, b)| a + b)
                .collect();
            for (g, w) in got[r * d..(r + 1) * d].iter().zip(&want) {
                // f32 matmuls of width ≤ 48 on O(1) values: 1e-4 absolute.
                assert!((*g as f64 - w).abs() < 1e-4, "row {r}: {g} vs {w}");
            }
        }

        // A dispatcher receives the latent rows and width; same result.
        struct Local(Vec<Arc<dyn ExpertFfn>>, usize);
        impl ExpertDispatch for Local {
            fn run(
                &self,
                _layer: usize,
                x: &[f32],
                hidden: usize,
                choices: &[Vec<(usize, f32)>],
            ) -> Vec<f32> {
                assert_eq!(hidden, self.1, "dispatch sees the latent width");
                run_experts_local(&self.0, x, hidden, choices)
            }
        }
        *block.dispatch.write().unwrap() = Some(Arc::new(Local(block.experts.clone(), latent)));
        assert_eq!(block.forward(&x), got);
    }

    /// Random routing of `rows` rows over `e` experts, `k` distinct each.
    fn random_choices(rows: usize, e: usize, k: usize, seed: u64) -> Vec<Vec<(usize, f32)>> {
        let mut rng = caracal_kernels::testing::Rng::seeded(seed);
        (0..rows)
            .map(|_| {
                let mut picked: Vec<(usize, f32)> = Vec::with_capacity(k);
                while picked.len() < k {
                    let j = (rng.next_u64() % e as u64) as usize;
                    if picked.iter().all(|&(p, _)| p != j) {
                        picked.push((j, 0.55 + 0.45 * rng.next_f32()));
                    }
                }
                picked
            })
            .collect()
    }

    #[test]
    fn grouped_experts_match_the_per_row_path_and_any_thread_count() {
        use caracal_actors::engine::{run_experts_per_row, ExpertGroups};
        let (d, inter, e) = (64, 96, 12);
        let act = GluAct::Silu;
        for dtype in ["f32", "bf16", "mxfp4"] {
            let experts: Vec<Arc<dyn ExpertFfn>> = (0..e)
                .map(|j| {
                    let m = mlp(d, inter, 500 + 7 * j as u64, act);
                    let conv = |w: &Matrix| match dtype {
                        "bf16" => Matrix::from_bf16(
                            w.rows,
                            w.cols,
                            &w.to_f32_vec()
                                .iter()
                                .map(|&v| caracal_kernels::dtype::f32_to_bf16(v))
                                .collect::<Vec<_>>(),
                        ),
                        "mxfp4" => Matrix::quantize_mxfp4(w.rows, w.cols, &w.to_f32_vec())
                            .expect("multiple of 32"),
                        _ => w.clone(),
                    };
                    Arc::new(Mlp {
                        gate_proj: conv(&m.gate_proj),
                        up_proj: conv(&m.up_proj),
                        down_proj: conv(&m.down_proj),
                        act,
                    }) as Arc<dyn ExpertFfn>
                })
                .collect();
            // Decode batches (each expert sees a handful of rows) and a
            // prefill-sized one (experts see more rows than the GEMV serves).
            for (rows, k, seed) in [(1, 4, 1), (3, 4, 2), (8, 3, 3), (64, 4, 4)] {
                let choices = random_choices(rows, e, k, seed);
                let x = values(rows * d, 40 + seed, 1.0);
                let grouped = run_experts_local(&experts, &x, d, &choices);
                let plain = run_experts_per_row(&experts, &x, d, &choices);
                // Same decoded weights, f32 accumulation in another order
                // (batched GEMV/GEMM vs one row at a time): 1e-5 relative.
                for (g, p) in grouped.iter().zip(&plain) {
                    assert!(
                        (g - p).abs() <= 1e-5 * (1.0 + p.abs()),
                        "{dtype} rows {rows}: {g} vs {p}"
                    );
                }
                // One worker thread runs every expert's kernels in place:
                // the grouped result must not change at all.
                let one = rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .build()
                    .expect("pool");
                let single = one.install(|| run_experts_local(&experts, &x, d, &choices));
                assert_eq!(grouped, single, "{dtype} rows {rows}: thread count");
                let groups = ExpertGroups::from_choices(&choices);
                assert_eq!(groups.slots(), rows * k);
                assert!(groups.offsets.windows(2).all(|w| w[0] < w[1]));
            }
        }
    }
}
