//! DeepSeek-V3 / Kimi K2: MLA attention with a compressed latent cache, YaRN
//! RoPE, and a sigmoid-routed MoE with a selection-only bias, grouped top-k
//! and shared experts.
//!
//! Paper: "DeepSeek-V3 Technical Report" (arXiv 2412.19437); Kimi K2 ships the
//! same architecture as `model_type: kimi_k2`. Reference: transformers
//! `models/deepseek_v3/modeling_deepseek_v3.py`.
//! Tensor names: `model.layers.N.self_attn.{q_a_proj, q_a_layernorm, q_b_proj |
//! q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}`,
//! `mlp.{gate.weight, gate.e_score_correction_bias, experts.E.{gate,up,down}_proj,
//! shared_experts.*}` and dense `mlp.{gate,up,down}_proj` below
//! `first_k_dense_replace`.

use std::path::Path;

use caracal_kernels::mla::MlaShape;
use caracal_kernels::moe::{RouterConfig, Scoring};
use caracal_kernels::paged::KvPool;
use caracal_kernels::rope::{yarn_get_mscale, Rope, RopeScaling};
use caracal_kernels::Matrix;
use serde::Deserialize;
use serde_json::Value;

use super::layers::mla::{MlaAttention, MlaOptions};
use super::layers::moe::MoeBlock;
use super::layers::{add_inplace, embed, logits, BatchLayout, GluAct, Mlp, RmsNorm};
use super::{
    CausalLm, EngineError, ExpertDispatch, ExpertFfn, ModelInfo, MoeModel, SeqBatch, SeqState,
};
use crate::checkpoint::config::{defaults, parse_config, rope_from_config};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// `config.json` of a `deepseek_v3` / `kimi_k2` checkpoint (transformers' defaults).
#[derive(Debug, Clone, Deserialize)]
pub struct DeepseekV3Config {
    /// Vocabulary size.
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    /// Model width.
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    /// Width of the dense MLP layers.
    #[serde(default = "d_inter")]
    pub intermediate_size: usize,
    /// Width of one routed expert.
    #[serde(default = "d_moe_inter")]
    pub moe_intermediate_size: usize,
    /// Decoder layers.
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    /// Attention heads.
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    /// Shared experts per MoE layer.
    #[serde(default = "defaults::one")]
    pub n_shared_experts: usize,
    /// Routed experts per MoE layer.
    #[serde(default = "d_experts")]
    pub n_routed_experts: usize,
    /// Multiplier of the routed output.
    #[serde(default = "d_rsf")]
    pub routed_scaling_factor: f32,
    /// Rank of the KV latent.
    #[serde(default = "d_kv_lora")]
    pub kv_lora_rank: usize,
    /// Rank of the query latent (`null` → direct `q_proj`).
    #[serde(default = "d_q_lora")]
    pub q_lora_rank: Option<usize>,
    /// Rotary part of each query/key head.
    #[serde(default = "d_rope_dim")]
    pub qk_rope_head_dim: usize,
    /// Value head size.
    #[serde(default = "d_head128")]
    pub v_head_dim: usize,
    /// Non-rotary part of each query/key head.
    #[serde(default = "d_head128")]
    pub qk_nope_head_dim: usize,
    /// Expert groups for grouped top-k.
    #[serde(default = "d_n_group")]
    pub n_group: usize,
    /// Groups kept per token.
    #[serde(default = "d_topk_group")]
    pub topk_group: usize,
    /// Experts per token.
    #[serde(default = "d_topk")]
    pub num_experts_per_tok: usize,
    /// Layers `< first_k_dense_replace` use a dense MLP.
    #[serde(default = "d_first_dense")]
    pub first_k_dense_replace: usize,
    /// Renormalise the top-k weights.
    #[serde(default = "defaults::yes")]
    pub norm_topk_prob: bool,
    /// MLP activation.
    #[serde(default = "defaults::silu")]
    pub hidden_act: String,
    /// Context length.
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    /// RMSNorm eps of the residual-stream norms.
    #[serde(default = "defaults::eps_1e6")]
    pub rms_norm_eps: f32,
    /// Tie `lm_head` to the embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Adjacent-pair RoPE layout.
    #[serde(default = "defaults::yes")]
    pub rope_interleave: bool,
    /// Router scoring (`sigmoid` for V3/K2).
    #[serde(default = "d_scoring")]
    pub scoring_func: String,
}

fn d_vocab() -> usize {
    129280
}
fn d_hidden() -> usize {
    7168
}
fn d_inter() -> usize {
    18432
}
fn d_moe_inter() -> usize {
    2048
}
fn d_layers() -> usize {
    61
}
fn d_heads() -> usize {
    128
}
fn d_experts() -> usize {
    256
}
fn d_rsf() -> f32 {
    2.5
}
fn d_kv_lora() -> usize {
    512
}
fn d_q_lora() -> Option<usize> {
    Some(1536)
}
fn d_rope_dim() -> usize {
    64
}
fn d_head128() -> usize {
    128
}
fn d_n_group() -> usize {
    8
}
fn d_topk_group() -> usize {
    4
}
fn d_topk() -> usize {
    8
}
fn d_first_dense() -> usize {
    3
}
fn d_max_pos() -> usize {
    4096
}
fn d_scoring() -> String {
    "sigmoid".into()
}

/// The feed-forward part of a layer.
enum Ffn {
    Dense(Mlp),
    Moe(MoeBlock),
}

struct Layer {
    input_layernorm: RmsNorm,
    self_attn: MlaAttention,
    post_attention_layernorm: RmsNorm,
    ffn: Ffn,
}

/// A loaded DeepSeek-V3 / Kimi K2 model.
pub struct DeepseekV3 {
    info: ModelInfo,
    embed_tokens: Matrix,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Matrix,
    rope: Rope,
}

/// MLA softmax scale: `qk_head_dim^-0.5`, times `mscale²` under YaRN with
/// `mscale_all_dim` (transformers' `yarn_apply_mscale`).
pub fn mla_softmax_scale(qk_head_dim: usize, scaling: &RopeScaling) -> f32 {
    let base = (qk_head_dim as f32).powf(-0.5);
    match scaling {
        RopeScaling::Yarn {
            factor,
            mscale_all_dim: Some(m),
            ..
        } if *m != 0.0 => {
            let ms = yarn_get_mscale(*factor, *m);
            base * ms * ms
        }
        _ => base,
    }
}

impl DeepseekV3 {
    /// Loads the weights named by `config` from `ckpt`.
    pub fn load(
        config: &Value,
        cfg_path: &Path,
        ckpt: &Checkpoint,
        eos_ids: Vec<u32>,
    ) -> Result<DeepseekV3> {
        let c: DeepseekV3Config = parse_config(config, cfg_path)?;
        let d = c.hidden_size;
        let act = GluAct::from_name(&c.hidden_act)?;
        let (theta, scaling) = rope_from_config(config, defaults::theta_10k())?;
        let rope = Rope::new(c.qk_rope_head_dim, theta, &scaling);
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
            scale: mla_softmax_scale(c.qk_nope_head_dim + c.qk_rope_head_dim, &scaling),
            rope_interleave: c.rope_interleave,
        };
        let scoring = match c.scoring_func.as_str() {
            "sigmoid" => Scoring::Sigmoid,
            "softmax" => Scoring::Softmax,
            other => {
                return Err(Error::Config(format!(
                    "unsupported scoring_func `{other}` (supported: sigmoid, softmax)"
                )))
            }
        };
        if c.n_group == 0 || c.n_routed_experts % c.n_group != 0 {
            return Err(Error::Config(format!(
                "n_routed_experts {} is not divisible by n_group {}",
                c.n_routed_experts, c.n_group
            )));
        }
        let router = RouterConfig {
            scoring,
            top_k: c.num_experts_per_tok,
            n_group: c.n_group,
            topk_group: c.topk_group,
            renormalize: c.norm_topk_prob,
            routed_scaling_factor: c.routed_scaling_factor,
            bias_in_weights: false,
        };
        let embed_tokens = ckpt.matrix("model.embed_tokens.weight", c.vocab_size, d)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let ffn = if i < c.first_k_dense_replace {
                Ffn::Dense(Mlp::load(
                    ckpt,
                    &format!("{p}.mlp"),
                    ["gate_proj", "up_proj", "down_proj"],
                    d,
                    c.intermediate_size,
                    act,
                )?)
            } else {
                let e = c.n_routed_experts;
                let experts = (0..e)
                    .map(|j| {
                        Mlp::load(
                            ckpt,
                            &format!("{p}.mlp.experts.{j}"),
                            ["gate_proj", "up_proj", "down_proj"],
                            d,
                            c.moe_intermediate_size,
                            act,
                        )
                    })
                    .collect::<Result<Vec<_>>>()?;
                let shared = if c.n_shared_experts > 0 {
                    Some(Mlp::load(
                        ckpt,
                        &format!("{p}.mlp.shared_experts"),
                        ["gate_proj", "up_proj", "down_proj"],
                        d,
                        c.moe_intermediate_size * c.n_shared_experts,
                        act,
                    )?)
                } else {
                    None
                };
                let bias_name = format!("{p}.mlp.gate.e_score_correction_bias");
                let bias = if ckpt.has(&bias_name) {
                    Some(ckpt.vector(&bias_name, e)?)
                } else {
                    None
                };
                Ffn::Moe(MoeBlock::new(
                    ckpt.matrix(&format!("{p}.mlp.gate.weight"), e, d)?,
                    bias,
                    experts,
                    shared,
                    router.clone(),
                    i - c.first_k_dense_replace,
                ))
            };
            layers.push(Layer {
                input_layernorm: RmsNorm::load(
                    ckpt,
                    &format!("{p}.input_layernorm.weight"),
                    d,
                    c.rms_norm_eps,
                )?,
                self_attn: MlaAttention::load(
                    ckpt,
                    &format!("{p}.self_attn"),
                    d,
                    shape.clone(),
                    &opts,
                    i,
                )?,
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
            model_type: config
                .get("model_type")
                .and_then(|v| v.as_str())
                .unwrap_or("deepseek_v3")
                .into(),
            vocab_size: c.vocab_size,
            max_position: c.max_position_embeddings,
            kv_layers: c.num_hidden_layers,
            kv_width: c.kv_lora_rank + c.qk_rope_head_dim,
            linear_layers: 0,
            eos_ids,
            num_params: ckpt.total_params(),
        };
        Ok(DeepseekV3 {
            info,
            embed_tokens,
            layers,
            norm: RmsNorm::load(ckpt, "model.norm.weight", d, c.rms_norm_eps)?,
            lm_head,
            rope,
        })
    }
}

impl CausalLm for DeepseekV3 {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_state(&self) -> SeqState {
        SeqState::default()
    }

    fn forward(
        &self,
        cache: &mut KvPool,
        batch: &mut [SeqBatch<'_>],
    ) -> std::result::Result<Vec<f32>, EngineError> {
        let layout = BatchLayout::prepare(batch, cache, true, self.info.max_position)?;
        let mut h = embed(&self.embed_tokens, &layout.tokens)?;
        for layer in &self.layers {
            let a = layer.self_attn.forward(
                &layer.input_layernorm.forward(&h),
                &layout,
                Some(&self.rope),
                cache,
            );
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

impl MoeModel for DeepseekV3 {
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
