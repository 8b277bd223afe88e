//! Kimi Linear: a 3:1 hybrid of Kimi Delta Attention (linear, recurrent)
//! and NoPE MLA layers, with a DeepSeek-style sigmoid-routed MoE.
//!
//! Paper: "Kimi Linear: An Expressive, Efficient Attention Architecture"
//! (arXiv 2510.26692). Reference: transformers
//! `models/kimi_linear/modeling_kimi_linear.py` and Moonshot's
//! `modeling_kimi.py`. Published tensor names: KDA layers
//! `self_attn.{q,k,v}_proj, {q,k,v}_conv1d, f_a_proj, f_b_proj, dt_bias, A_log,
//! b_proj, g_a_proj, g_b_proj, o_norm, o_proj`; MLA layers as DeepSeek with
//! `q_proj`; MoE `block_sparse_moe.{gate, experts.E.{w1,w2,w3},
//! shared_experts}`; dense layers `mlp.{gate,up,down}_proj`. Layer lists in
//! `linear_attn_config` are 1-based.

use std::path::Path;

use caracal_kernels::mla::MlaShape;
use caracal_kernels::moe::{RouterConfig, Scoring};
use caracal_kernels::paged::KvPool;
use caracal_kernels::Matrix;
use serde::Deserialize;
use serde_json::Value;

use super::layers::kda::KdaAttention;
use super::layers::mla::{MlaAttention, MlaOptions};
use super::layers::moe::MoeBlock;
use super::layers::{add_inplace, embed, logits, BatchLayout, GluAct, Mlp, RmsNorm};
use super::{
    CausalLm, EngineError, ExpertDispatch, ExpertFfn, ModelInfo, MoeModel, SeqBatch, SeqState,
};
use crate::checkpoint::config::{defaults, parse_config};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// `linear_attn_config` of Kimi Linear.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct LinearAttnConfig {
    /// 1-based indices of KDA layers.
    #[serde(default)]
    pub kda_layers: Vec<usize>,
    /// 1-based indices of full-attention (MLA) layers.
    #[serde(default)]
    pub full_attn_layers: Vec<usize>,
    /// KDA head size.
    #[serde(default = "d_head128")]
    pub head_dim: usize,
    /// KDA heads.
    #[serde(default = "d_lin_heads")]
    pub num_heads: usize,
    /// Short-conv kernel size.
    #[serde(default = "d_conv")]
    pub short_conv_kernel_size: usize,
}

/// `config.json` of a `kimi_linear` checkpoint. Key names as published;
/// aliases accept transformers' spellings.
#[derive(Debug, Clone, Deserialize)]
pub struct KimiLinearConfig {
    /// Vocabulary size.
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    /// Model width.
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    /// Dense MLP width.
    #[serde(default = "d_inter")]
    pub intermediate_size: usize,
    /// Routed expert width.
    #[serde(default = "d_moe_inter")]
    pub moe_intermediate_size: usize,
    /// Decoder layers.
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    /// MLA heads.
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    /// Routed experts.
    #[serde(
        default = "d_experts",
        alias = "num_local_experts",
        alias = "n_routed_experts"
    )]
    pub num_experts: usize,
    /// Experts per token.
    #[serde(default = "d_topk", alias = "num_experts_per_tok")]
    pub num_experts_per_token: usize,
    /// Shared experts.
    #[serde(default = "defaults::one", alias = "n_shared_experts")]
    pub num_shared_experts: usize,
    /// Renormalise top-k weights.
    #[serde(default = "defaults::yes", alias = "norm_topk_prob")]
    pub moe_renormalize: bool,
    /// Router activation (`sigmoid`).
    #[serde(default = "d_sigmoid")]
    pub moe_router_activation_func: String,
    /// Routed output multiplier.
    #[serde(default = "d_rsf")]
    pub routed_scaling_factor: f32,
    /// Expert groups.
    #[serde(default = "defaults::one", alias = "n_group")]
    pub num_expert_group: usize,
    /// Groups kept per token.
    #[serde(default = "defaults::one")]
    pub topk_group: usize,
    /// Layers `< first_k_dense_replace` are dense.
    #[serde(default = "defaults::one")]
    pub first_k_dense_replace: usize,
    /// Per-layer `dense`/`sparse` (transformers' spelling; overrides the above).
    #[serde(default)]
    pub mlp_layer_types: Option<Vec<String>>,
    /// Per-layer `linear_attention`/`full_attention` (transformers' spelling).
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// Context length.
    #[serde(default = "d_max_pos", alias = "max_position_embeddings")]
    pub model_max_length: usize,
    /// RMSNorm eps.
    #[serde(default = "defaults::eps_1e5")]
    pub rms_norm_eps: f32,
    /// KV latent rank.
    #[serde(default = "d_kv_lora")]
    pub kv_lora_rank: usize,
    /// Query latent rank (`null` in Kimi Linear).
    #[serde(default)]
    pub q_lora_rank: Option<usize>,
    /// Rotary part of MLA heads (unrotated under NoPE).
    #[serde(default = "d_rope_dim")]
    pub qk_rope_head_dim: usize,
    /// Non-rotary part of MLA heads.
    #[serde(default = "d_head128")]
    pub qk_nope_head_dim: usize,
    /// MLA value head size.
    #[serde(default = "d_head128")]
    pub v_head_dim: usize,
    /// MLA without RoPE (always true in published checkpoints).
    #[serde(default = "defaults::yes")]
    pub mla_use_nope: bool,
    /// Tie `lm_head` to the embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// MLP activation.
    #[serde(default = "defaults::silu")]
    pub hidden_act: String,
    /// KDA settings.
    #[serde(default)]
    pub linear_attn_config: LinearAttnConfig,
}

fn d_vocab() -> usize {
    163840
}
fn d_hidden() -> usize {
    2304
}
fn d_inter() -> usize {
    9216
}
fn d_moe_inter() -> usize {
    1024
}
fn d_layers() -> usize {
    27
}
fn d_heads() -> usize {
    32
}
fn d_experts() -> usize {
    256
}
fn d_topk() -> usize {
    8
}
fn d_sigmoid() -> String {
    "sigmoid".into()
}
fn d_rsf() -> f32 {
    2.446
}
fn d_max_pos() -> usize {
    1048576
}
fn d_kv_lora() -> usize {
    512
}
fn d_rope_dim() -> usize {
    64
}
fn d_head128() -> usize {
    128
}
fn d_lin_heads() -> usize {
    32
}
fn d_conv() -> usize {
    4
}

impl KimiLinearConfig {
    /// Whether 0-based layer `i` is a KDA layer.
    pub fn is_kda_layer(&self, i: usize) -> bool {
        if !self.linear_attn_config.kda_layers.is_empty() {
            return self.linear_attn_config.kda_layers.contains(&(i + 1));
        }
        if let Some(types) = &self.layer_types {
            return types
                .get(i)
                .map(|t| t == "linear_attention")
                .unwrap_or(false);
        }
        // transformers' fallback: every 4th layer (1-based) is full attention.
        !(i > 0 && i % 4 == 0)
    }

    /// Whether 0-based layer `i` uses the MoE block.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        match &self.mlp_layer_types {
            Some(types) => types.get(i).map(|t| t == "sparse").unwrap_or(false),
            None => i >= self.first_k_dense_replace,
        }
    }
}

/// Token mixer of a layer.
enum Mixer {
    Kda(KdaAttention),
    Mla(MlaAttention),
}

/// Channel mixer of a layer.
enum Ffn {
    Dense(Mlp),
    Moe(MoeBlock),
}

struct Layer {
    input_layernorm: RmsNorm,
    mixer: Mixer,
    post_attention_layernorm: RmsNorm,
    ffn: Ffn,
}

/// A loaded Kimi Linear model.
pub struct KimiLinear {
    info: ModelInfo,
    embed_tokens: Matrix,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Matrix,
}

impl KimiLinear {
    /// Loads the weights named by `config` from `ckpt`.
    pub fn load(
        config: &Value,
        cfg_path: &Path,
        ckpt: &Checkpoint,
        eos_ids: Vec<u32>,
    ) -> Result<KimiLinear> {
        let c: KimiLinearConfig = parse_config(config, cfg_path)?;
        if !c.mla_use_nope {
            return Err(Error::Config(
                "kimi_linear with mla_use_nope=false is not supported".into(),
            ));
        }
        let d = c.hidden_size;
        let act = GluAct::from_name(&c.hidden_act)?;
        let lin = &c.linear_attn_config;
        let shape = MlaShape {
            heads: c.num_attention_heads,
            nope_dim: c.qk_nope_head_dim,
            rope_dim: c.qk_rope_head_dim,
            v_dim: c.v_head_dim,
            kv_lora_rank: c.kv_lora_rank,
        };
        let opts = MlaOptions {
            q_lora_rank: c.q_lora_rank,
            latent_norm_eps: 1e-6,
            scale: ((c.qk_nope_head_dim + c.qk_rope_head_dim) as f32).powf(-0.5),
            rope_interleave: false,
        };
        let scoring = match c.moe_router_activation_func.as_str() {
            "sigmoid" => Scoring::Sigmoid,
            "softmax" => Scoring::Softmax,
            other => {
                return Err(Error::Config(format!(
                    "unsupported moe_router_activation_func `{other}`"
                )))
            }
        };
        let router = RouterConfig {
            scoring,
            top_k: c.num_experts_per_token,
            n_group: c.num_expert_group,
            topk_group: c.topk_group,
            renormalize: c.moe_renormalize,
            routed_scaling_factor: c.routed_scaling_factor,
            bias_in_weights: false,
        };
        let embed_tokens = ckpt.matrix("model.embed_tokens.weight", c.vocab_size, d)?;
        let (mut kv_layers, mut linear_layers) = (0, 0);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let mixer = if c.is_kda_layer(i) {
                linear_layers += 1;
                Mixer::Kda(KdaAttention::load(
                    ckpt,
                    &format!("{p}.self_attn"),
                    d,
                    lin.num_heads,
                    lin.head_dim,
                    lin.short_conv_kernel_size,
                    c.rms_norm_eps,
                    linear_layers - 1,
                )?)
            } else {
                kv_layers += 1;
                Mixer::Mla(MlaAttention::load(
                    ckpt,
                    &format!("{p}.self_attn"),
                    d,
                    shape.clone(),
                    &opts,
                    kv_layers - 1,
                )?)
            };
            let ffn = if c.is_moe_layer(i) {
                let m = format!("{p}.block_sparse_moe");
                let e = c.num_experts;
                let experts = (0..e)
                    .map(|j| {
                        Mlp::load(
                            ckpt,
                            &format!("{m}.experts.{j}"),
                            ["w1", "w3", "w2"],
                            d,
                            c.moe_intermediate_size,
                            act,
                        )
                    })
                    .collect::<Result<Vec<_>>>()?;
                let shared = if c.num_shared_experts > 0 {
                    Some(Mlp::load(
                        ckpt,
                        &format!("{m}.shared_experts"),
                        ["gate_proj", "up_proj", "down_proj"],
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
                Ffn::Moe(MoeBlock::new(
                    ckpt.matrix(&format!("{m}.gate.weight"), e, d)?,
                    bias,
                    experts,
                    shared,
                    router.clone(),
                    (0..i).filter(|&j| c.is_moe_layer(j)).count(),
                ))
            } else {
                Ffn::Dense(Mlp::load(
                    ckpt,
                    &format!("{p}.mlp"),
                    ["gate_proj", "up_proj", "down_proj"],
                    d,
                    c.intermediate_size,
                    act,
                )?)
            };
            layers.push(Layer {
                input_layernorm: RmsNorm::load(
                    ckpt,
                    &format!("{p}.input_layernorm.weight"),
                    d,
                    c.rms_norm_eps,
                )?,
                mixer,
                post_attention_layernorm: RmsNorm::load(
                    ckpt,
                    &format!("{p}.post_attention_layernorm.weight"),
                    d,
                    c.rms_norm_eps,
                )?,
                ffn,
            });
        }
        let lm_head = if c.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            ckpt.matrix("lm_head.weight", c.vocab_size, d)?
        };
        let info = ModelInfo {
            model_type: "kimi_linear".into(),
            vocab_size: c.vocab_size,
            max_position: c.model_max_length,
            kv_layers,
            kv_width: c.kv_lora_rank + c.qk_rope_head_dim,
            linear_layers,
            eos_ids,
            num_params: ckpt.total_params(),
        };
        Ok(KimiLinear {
            info,
            embed_tokens,
            layers,
            norm: RmsNorm::load(ckpt, "model.norm.weight", d, c.rms_norm_eps)?,
            lm_head,
        })
    }
}

impl CausalLm for KimiLinear {
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
        let mut h = embed(&self.embed_tokens, &layout.tokens)?;
        for layer in &self.layers {
            let x = layer.input_layernorm.forward(&h);
            let a = match &layer.mixer {
                Mixer::Kda(kda) => kda.forward(&x, &layout, batch),
                Mixer::Mla(mla) => mla.forward(&x, &layout, None, cache),
            };
            add_inplace(&mut h, &a);
            let x = layer.post_attention_layernorm.forward(&h);
            let m = match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward(&x),
                Ffn::Moe(moe) => moe.forward(&x),
            };
            add_inplace(&mut h, &m);
        }
        layout.commit(batch);
        Ok(logits(&h, &layout, &self.norm, &self.lm_head))
    }

    fn as_moe(&self) -> Option<&dyn MoeModel> {
        Some(self)
    }
}

impl MoeModel for KimiLinear {
    fn experts(&self) -> Vec<Vec<std::sync::Arc<dyn ExpertFfn>>> {
        self.layers
            .iter()
            .filter_map(|l| match &l.ffn {
                Ffn::Moe(m) => Some(m.experts.clone()),
                Ffn::Dense(_) => None,
            })
            .collect()
    }

    fn set_expert_dispatch(&self, dispatch: std::sync::Arc<dyn ExpertDispatch>) {
        for l in &self.layers {
            if let Ffn::Moe(m) = &l.ffn {
                m.set_dispatch(dispatch.clone());
            }
        }
    }
}
