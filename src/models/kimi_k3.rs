//! Kimi K3 (text backbone): Kimi Linear's 3:1 KDA / NoPE-MLA hybrid with
//! Block Attention Residuals, a bounded KDA forget gate, full-rank output
//! gates, gated MLA, SiTU activations and a latent MoE with MXFP4 experts.
//!
//! Papers: "Kimi Linear" (arXiv 2510.26692), "Attention Residuals"
//! (arXiv 2603.15031), "Kimi K3 Technical Report" (arXiv 2607.24653).
//! Reference implementations: Moonshot's `modeling_kimi_linear.py` shipped
//! with `moonshotai/Kimi-K3` (read through third-party transcriptions) and
//! TokenSpeed's `kimi_k3.py`; formulas in the reference doc §1, §2, §4.1,
//! §6.3. The numbers are checked against `tools/k3_reference.py`, built
//! from transformers' `kimi_linear` modules plus the K3 pieces.
//!
//! Per layer `l` (block size `B = attn_res_block_size`, §2.3):
//!
//! ```text
//! h = input_layernorm(Mix_attn(blocks + [prefix]))
//! if l % B == 0 { blocks.push(prefix); prefix = attn(h) } else { prefix += attn(h) }
//! h = post_attention_layernorm(Mix_mlp(blocks + [prefix]))
//! prefix += ffn(h)                       # dense SiTU MLP (layer 0) or latent MoE
//! ```
//!
//! then `logits = lm_head(norm(Mix_out(blocks + [prefix])))`, where `prefix`
//! starts as the embedding. Without `attn_res_block_size` the layers use the
//! plain pre-norm residual of Kimi Linear.
//!
//! Checkpoint layout: the multimodal wrapper (`model_type: "kimi_k3"`,
//! `text_config`, `vision_config`; tensors `language_model.model.*` and
//! `language_model.lm_head.weight`) or a text-only one (flat config,
//! `model.*`, `lm_head.weight`). Only the text path is loaded here; the
//! vision tower's tensors are ignored. Routed experts load as MXFP4
//! (`weight_packed` + `weight_scale`) or float `.weight`.
//!
//! Choices where sources disagree (all switchable from `config.json`):
//! - `A_log` shape: `linear_attn_config.a_log_layout` (see [`ALogLayout`]).
//! - eps of `q_a_layernorm` / `kv_a_layernorm`: `mla_latent_norm_eps`
//!   (Caracal key), default 1e-6 as Moonshot's module builds them
//!   (TokenSpeed and vLLM use `rms_norm_eps`).

use std::path::Path;
use std::sync::Arc;

use caracal_kernels::mla::MlaShape;
use caracal_kernels::moe::{RouterConfig, Scoring};
use caracal_kernels::paged::KvPool;
use caracal_kernels::Matrix;
use serde::Deserialize;
use serde_json::Value;

use super::kimi_linear::KimiLinearConfig;
use super::layers::attn_res::{AttnResWeights, BlockHistory};
use super::layers::experts::load_expert_mlp;
use super::layers::kda::{ALogLayout, ForgetGate, KdaAttention, KdaOptions};
use super::layers::mla::{MlaAttention, MlaOptions};
use super::layers::moe::{LatentProj, MoeBlock};
use super::layers::{add_inplace, embed, logits, BatchLayout, GluAct, Mlp, RmsNorm};
use super::{
    CausalLm, EngineError, ExpertDispatch, ExpertFfn, ModelInfo, MoeModel, SeqBatch, SeqState,
};
use crate::checkpoint::config::{defaults, parse_config};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// K3 keys of `linear_attn_config` beyond Kimi Linear's.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct K3LinearAttnConfig {
    /// `g_proj` output gate instead of `g_a_proj`/`g_b_proj` (K3: true).
    #[serde(default)]
    pub use_full_rank_gate: bool,
    /// Bounded forget gate `g ∈ (gate_lower_bound, 0)` (K3: −5.0); `None`
    /// keeps Kimi Linear's softplus gate.
    #[serde(default)]
    pub gate_lower_bound: Option<f32>,
    /// How `A_log` is read (Caracal key; default `auto`, see [`ALogLayout`]).
    #[serde(default)]
    pub a_log_layout: ALogLayout,
}

/// The keys K3 adds to a `kimi_linear` text config (reference doc §1.5).
/// The shared keys are read as [`KimiLinearConfig`].
#[derive(Debug, Clone, Deserialize)]
pub struct K3Extensions {
    /// Decoder layers per AttnRes block (K3: 12); `None` disables AttnRes.
    #[serde(default)]
    pub attn_res_block_size: Option<usize>,
    /// Sigmoid output gate `g_proj` on MLA layers (K3: true).
    #[serde(default)]
    pub mla_use_output_gate: bool,
    /// SiTU β (K3: 4.0).
    #[serde(default)]
    pub activation_situ_beta: Option<f32>,
    /// SiTU β_lin (K3: 25.0); `None`: `up` is not clipped.
    #[serde(default)]
    pub activation_situ_linear_beta: Option<f32>,
    /// Width routed experts run at (K3: 3584); `None`: the full width.
    #[serde(default)]
    pub routed_expert_hidden_size: Option<usize>,
    /// RMSNorm on the weighted expert sum before `routed_expert_up_proj`.
    #[serde(default)]
    pub latent_moe_use_norm: bool,
    /// Every `moe_layer_freq`-th layer from `first_k_dense_replace` is MoE.
    #[serde(default = "defaults::one")]
    pub moe_layer_freq: usize,
    /// eps of MLA's `q_a_layernorm` / `kv_a_layernorm` (Caracal key; default
    /// 1e-6 as in Moonshot's code, which builds them without the config eps).
    #[serde(default = "defaults::eps_1e6")]
    pub mla_latent_norm_eps: f32,
    /// K3 keys inside `linear_attn_config`.
    #[serde(default)]
    pub linear_attn_config: K3LinearAttnConfig,
}

/// Token mixer of a layer.
enum Mixer {
    Kda(Box<KdaAttention>),
    Mla(Box<MlaAttention>),
}

/// Channel mixer of a layer.
enum Ffn {
    Dense(Box<Mlp>),
    Moe(Box<MoeBlock>),
}

/// The two AttnRes mixes of a decoder layer.
struct LayerAttnRes {
    /// Before the token mixer (`self_attention_res_{norm,proj}`).
    attn: AttnResWeights,
    /// Before the FFN (`mlp_res_{norm,proj}`).
    mlp: AttnResWeights,
}

struct Layer {
    attn_res: Option<LayerAttnRes>,
    input_layernorm: RmsNorm,
    mixer: Mixer,
    post_attention_layernorm: RmsNorm,
    ffn: Ffn,
}

/// A loaded Kimi K3 text model.
pub struct KimiK3 {
    info: ModelInfo,
    embed_tokens: Matrix,
    layers: Vec<Layer>,
    /// AttnRes block size (`None`: plain residuals).
    block_size: Option<usize>,
    /// The final mix before `norm` (`output_attn_res_{norm,proj}`).
    output_attn_res: Option<AttnResWeights>,
    norm: RmsNorm,
    lm_head: Matrix,
    /// `rms_norm_eps`, also the eps of AttnRes scores.
    eps: f32,
}

/// The text part of a K3 config: `text_config` when present, else the
/// config itself (text-only checkpoints).
pub fn text_config(config: &Value) -> &Value {
    match config.get("text_config") {
        Some(t) if t.is_object() => t,
        _ => config,
    }
}

impl KimiK3 {
    /// Loads the text backbone named by `config` from `ckpt`.
    pub fn load(
        config: &Value,
        cfg_path: &Path,
        ckpt: &Checkpoint,
        eos_ids: Vec<u32>,
    ) -> Result<KimiK3> {
        let text = text_config(config);
        let c: KimiLinearConfig = parse_config(text, cfg_path)?;
        let x: K3Extensions = parse_config(text, cfg_path)?;
        if !c.mla_use_nope {
            return Err(Error::Config(
                "kimi_k3 with mla_use_nope=false is not supported".into(),
            ));
        }
        if x.attn_res_block_size == Some(0) || x.moe_layer_freq == 0 {
            return Err(Error::Config(
                "`attn_res_block_size` and `moe_layer_freq` must be at least 1".into(),
            ));
        }
        let d = c.hidden_size;
        let eps = c.rms_norm_eps;
        let act = GluAct::from_config(
            &c.hidden_act,
            x.activation_situ_beta,
            x.activation_situ_linear_beta,
        )?;
        let root = if ckpt.has("language_model.model.embed_tokens.weight") {
            "language_model."
        } else {
            ""
        };
        let lin = &c.linear_attn_config;
        let kda = KdaOptions {
            hidden: d,
            heads: lin.num_heads,
            head_dim: lin.head_dim,
            kernel: lin.short_conv_kernel_size,
            eps,
            full_rank_gate: x.linear_attn_config.use_full_rank_gate,
            forget_gate: x
                .linear_attn_config
                .gate_lower_bound
                .map_or(ForgetGate::Softplus, ForgetGate::LowerBound),
            a_log_layout: x.linear_attn_config.a_log_layout,
        };
        let shape = MlaShape {
            heads: c.num_attention_heads,
            nope_dim: c.qk_nope_head_dim,
            rope_dim: c.qk_rope_head_dim,
            v_dim: c.v_head_dim,
            kv_lora_rank: c.kv_lora_rank,
        };
        let mla = MlaOptions {
            q_lora_rank: c.q_lora_rank,
            latent_norm_eps: x.mla_latent_norm_eps,
            scale: ((c.qk_nope_head_dim + c.qk_rope_head_dim) as f32).powf(-0.5),
            rope_interleave: false,
        };
        let router = RouterConfig {
            scoring: match c.moe_router_activation_func.as_str() {
                "sigmoid" => Scoring::Sigmoid,
                "softmax" => Scoring::Softmax,
                other => {
                    return Err(Error::Config(format!(
                        "unsupported moe_router_activation_func `{other}`"
                    )))
                }
            },
            top_k: c.num_experts_per_token,
            n_group: c.num_expert_group,
            topk_group: c.topk_group,
            renormalize: c.moe_renormalize,
            routed_scaling_factor: c.routed_scaling_factor,
            bias_in_weights: false,
        };
        let is_moe = |i: usize| match &c.mlp_layer_types {
            Some(types) => types.get(i).map(|t| t == "sparse").unwrap_or(false),
            None => {
                c.num_experts > 0
                    && i >= c.first_k_dense_replace
                    && i.is_multiple_of(x.moe_layer_freq)
            }
        };
        let embed_tokens =
            ckpt.matrix(&format!("{root}model.embed_tokens.weight"), c.vocab_size, d)?;
        let (mut kv_layers, mut linear_layers, mut moe_layers) = (0, 0, 0);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("{root}model.layers.{i}");
            let attn_p = format!("{p}.self_attn");
            let mixer = if c.is_kda_layer(i) {
                linear_layers += 1;
                Mixer::Kda(Box::new(KdaAttention::load_with(
                    ckpt,
                    &attn_p,
                    &kda,
                    linear_layers - 1,
                )?))
            } else {
                kv_layers += 1;
                let m = MlaAttention::load(ckpt, &attn_p, d, shape, &mla, kv_layers - 1)?;
                Mixer::Mla(Box::new(if x.mla_use_output_gate {
                    m.with_output_gate(ckpt, &attn_p, d)?
                } else {
                    m
                }))
            };
            let ffn = if is_moe(i) {
                moe_layers += 1;
                Ffn::Moe(Box::new(load_moe(
                    ckpt,
                    &format!("{p}.block_sparse_moe"),
                    &c,
                    &x,
                    act,
                    router.clone(),
                    moe_layers - 1,
                )?))
            } else {
                Ffn::Dense(Box::new(Mlp::load(
                    ckpt,
                    &format!("{p}.mlp"),
                    ["gate_proj", "up_proj", "down_proj"],
                    d,
                    c.intermediate_size,
                    act,
                )?))
            };
            let attn_res = match x.attn_res_block_size {
                Some(_) => Some(LayerAttnRes {
                    attn: AttnResWeights::load(
                        ckpt,
                        &format!("{p}.self_attention_res_norm.weight"),
                        &format!("{p}.self_attention_res_proj.weight"),
                        d,
                    )?,
                    mlp: AttnResWeights::load(
                        ckpt,
                        &format!("{p}.mlp_res_norm.weight"),
                        &format!("{p}.mlp_res_proj.weight"),
                        d,
                    )?,
                }),
                None => None,
            };
            layers.push(Layer {
                attn_res,
                input_layernorm: RmsNorm::load(
                    ckpt,
                    &format!("{p}.input_layernorm.weight"),
                    d,
                    eps,
                )?,
                mixer,
                post_attention_layernorm: RmsNorm::load(
                    ckpt,
                    &format!("{p}.post_attention_layernorm.weight"),
                    d,
                    eps,
                )?,
                ffn,
            });
        }
        let output_attn_res = match x.attn_res_block_size {
            Some(_) => Some(AttnResWeights::load(
                ckpt,
                &format!("{root}model.output_attn_res_norm.weight"),
                &format!("{root}model.output_attn_res_proj.weight"),
                d,
            )?),
            None => None,
        };
        let lm_head = if c.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            ckpt.matrix(&format!("{root}lm_head.weight"), c.vocab_size, d)?
        };
        let info = ModelInfo {
            model_type: "kimi_k3".into(),
            vocab_size: c.vocab_size,
            max_position: c.model_max_length,
            kv_layers,
            kv_width: c.kv_lora_rank + c.qk_rope_head_dim,
            linear_layers,
            eos_ids,
            num_params: ckpt.total_params(),
        };
        Ok(KimiK3 {
            info,
            embed_tokens,
            layers,
            block_size: x.attn_res_block_size,
            output_attn_res,
            norm: RmsNorm::load(ckpt, &format!("{root}model.norm.weight"), d, eps)?,
            lm_head,
            eps,
        })
    }

    /// The token mixer of `layer` on normed input `x`.
    fn mix_tokens(
        &self,
        layer: &Layer,
        x: &[f32],
        layout: &BatchLayout,
        batch: &mut [SeqBatch<'_>],
        cache: &mut KvPool,
    ) -> Vec<f32> {
        match &layer.mixer {
            Mixer::Kda(kda) => kda.forward(x, layout, batch),
            Mixer::Mla(mla) => mla.forward(x, layout, None, cache),
        }
    }

    /// The FFN of `layer` on normed input `x`.
    fn mix_channels(layer: &Layer, x: &[f32]) -> Vec<f32> {
        match &layer.ffn {
            Ffn::Dense(mlp) => mlp.forward(x),
            Ffn::Moe(moe) => moe.forward(x),
        }
    }
}

/// Loads one latent MoE block at `m` (`….block_sparse_moe`).
fn load_moe(
    ckpt: &Checkpoint,
    m: &str,
    c: &KimiLinearConfig,
    x: &K3Extensions,
    act: GluAct,
    router: RouterConfig,
    moe_layer: usize,
) -> Result<MoeBlock> {
    let (d, e) = (c.hidden_size, c.num_experts);
    let width = x.routed_expert_hidden_size.unwrap_or(d);
    let experts = (0..e)
        .map(|j| {
            load_expert_mlp(
                ckpt,
                m,
                j,
                ["w1", "w3", "w2"],
                width,
                c.moe_intermediate_size,
                act,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let shared = if c.num_shared_experts > 0 {
        let names = ["gate_proj", "up_proj", "down_proj"];
        Some(Mlp::load(
            ckpt,
            &format!("{m}.shared_experts"),
            names,
            d,
            c.moe_intermediate_size * c.num_shared_experts,
            act,
        )?)
    } else {
        None
    };
    let bias_name = format!("{m}.gate.e_score_correction_bias");
    let bias = if ckpt.has(&bias_name) {
        Some(ckpt.vector(&bias_name, e)?)
    } else {
        None
    };
    let block = MoeBlock::new(
        ckpt.matrix(&format!("{m}.gate.weight"), e, d)?,
        bias,
        experts,
        shared,
        router,
        moe_layer,
    );
    Ok(match x.routed_expert_hidden_size {
        Some(r) => block.with_latent(LatentProj {
            routed_expert_down_proj: ckpt.matrix(
                &format!("{m}.routed_expert_down_proj.weight"),
                r,
                d,
            )?,
            routed_expert_norm: if x.latent_moe_use_norm {
                Some(RmsNorm::load(
                    ckpt,
                    &format!("{m}.routed_expert_norm.weight"),
                    r,
                    c.rms_norm_eps,
                )?)
            } else {
                None
            },
            routed_expert_up_proj: ckpt.matrix(
                &format!("{m}.routed_expert_up_proj.weight"),
                d,
                r,
            )?,
        }),
        None => block,
    })
}

impl CausalLm for KimiK3 {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_state(&self) -> SeqState {
        let linear = self
            .layers
            .iter()
            .filter_map(|l| match &l.mixer {
                Mixer::Kda(k) => Some(k.new_state()),
                Mixer::Mla(_) => None,
            })
            .collect();
        SeqState {
            linear,
            ..SeqState::default()
        }
    }

    fn forward(
        &self,
        cache: &mut KvPool,
        batch: &mut [SeqBatch<'_>],
    ) -> std::result::Result<Vec<f32>, EngineError> {
        for s in batch.iter() {
            if s.state.linear.len() != self.info.linear_layers {
                return Err(EngineError::InvalidInput(
                    "sequence state was not made by this model's new_state()".into(),
                ));
            }
        }
        let layout = BatchLayout::prepare(
            batch,
            cache,
            self.info.kv_layers > 0,
            self.info.max_position,
        )?;
        let d = self.embed_tokens.cols;
        // `prefix`: the running sum of the current block (the residual
        // stream itself when AttnRes is off); it starts as the embedding.
        let mut prefix = embed(&self.embed_tokens, &layout.tokens)?;
        let mut blocks = BlockHistory::new(layout.rows, d, self.eps);
        for (l, layer) in self.layers.iter().enumerate() {
            match (&layer.attn_res, self.block_size) {
                (Some(res), Some(bs)) => {
                    let h = layer
                        .input_layernorm
                        .forward(&blocks.mix(&res.attn, &prefix));
                    let a = self.mix_tokens(layer, &h, &layout, batch, cache);
                    if l.is_multiple_of(bs) {
                        // Block boundary: snapshot the finished block, start a new sum.
                        blocks.push(std::mem::replace(&mut prefix, a));
                    } else {
                        add_inplace(&mut prefix, &a);
                    }
                    let h = layer
                        .post_attention_layernorm
                        .forward(&blocks.mix(&res.mlp, &prefix));
                    add_inplace(&mut prefix, &Self::mix_channels(layer, &h));
                }
                _ => {
                    let a = self.mix_tokens(
                        layer,
                        &layer.input_layernorm.forward(&prefix),
                        &layout,
                        batch,
                        cache,
                    );
                    add_inplace(&mut prefix, &a);
                    let m =
                        Self::mix_channels(layer, &layer.post_attention_layernorm.forward(&prefix));
                    add_inplace(&mut prefix, &m);
                }
            }
        }
        let out = match &self.output_attn_res {
            Some(w) => blocks.mix(w, &prefix),
            None => prefix,
        };
        layout.commit(batch);
        Ok(logits(&out, &layout, &self.norm, &self.lm_head))
    }

    fn as_moe(&self) -> Option<&dyn MoeModel> {
        Some(self)
    }
}

impl MoeModel for KimiK3 {
    fn experts(&self) -> Vec<Vec<Arc<dyn ExpertFfn>>> {
        self.layers
            .iter()
            .filter_map(|l| match &l.ffn {
                Ffn::Moe(m) => Some(m.experts.clone()),
                Ffn::Dense(_) => None,
            })
            .collect()
    }

    fn set_expert_dispatch(&self, dispatch: Arc<dyn ExpertDispatch>) {
        for l in &self.layers {
            if let Ffn::Moe(m) = &l.ffn {
                m.set_dispatch(dispatch.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k3_keys_parse_with_their_defaults() {
        let v = serde_json::json!({
            "attn_res_block_size": 12, "mla_use_output_gate": true, "hidden_act": "situ",
            "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "routed_expert_hidden_size": 3584, "latent_moe_use_norm": true,
            "linear_attn_config": {"num_heads": 96, "head_dim": 128, "use_full_rank_gate": true, "gate_lower_bound": -5.0}
        });
        let x: K3Extensions = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(x.attn_res_block_size, Some(12));
        assert_eq!(x.routed_expert_hidden_size, Some(3584));
        assert_eq!(x.linear_attn_config.gate_lower_bound, Some(-5.0));
        assert_eq!(x.linear_attn_config.a_log_layout, ALogLayout::Auto);
        assert_eq!(x.mla_latent_norm_eps, 1e-6);
        assert_eq!(x.moe_layer_freq, 1);
        let c: KimiLinearConfig = serde_json::from_value(v).unwrap();
        assert_eq!(c.linear_attn_config.num_heads, 96);
        let wrapped =
            serde_json::json!({"model_type": "kimi_k3", "text_config": {"hidden_size": 7}});
        assert_eq!(text_config(&wrapped)["hidden_size"], 7);
        assert_eq!(
            text_config(&serde_json::json!({"hidden_size": 8}))["hidden_size"],
            8
        );
    }
}
