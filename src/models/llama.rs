//! LLaMA-family decoder (GQA, RoPE, SwiGLU, RMSNorm), e.g. SmolLM2, with an
//! optional DeepSeek-V3 / Kimi K2 MoE feed-forward.
//!
//! Paper: "LLaMA: Open and Efficient Foundation Language Models" (arXiv
//! 2302.13971). Reference: transformers `models/llama/modeling_llama.py`.
//! Tensor names: `model.embed_tokens`, `model.layers.N.{input_layernorm,
//! self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}`,
//! `model.norm`, `lm_head` (absent when `tie_word_embeddings`).
//!
//! **MoE extension (Caracal).** A `llama` config that carries the DeepSeek-V3
//! MoE keys (`n_routed_experts`, `num_experts_per_tok`,
//! `moe_intermediate_size`, `n_shared_experts`, `first_k_dense_replace`,
//! `n_group`, `topk_group`, `routed_scaling_factor`, `norm_topk_prob`,
//! `scoring_func`; see [`LlamaMoeConfig`]) keeps LLaMA's GQA attention and
//! turns layers `>= first_k_dense_replace` into the DeepSeek-V3 / Kimi K2 MoE
//! block with its published tensor names: `mlp.gate.weight`,
//! `mlp.gate.e_score_correction_bias`, `mlp.experts.E.{gate,up,down}_proj`,
//! `mlp.shared_experts.{gate,up,down}_proj` (DeepSeek-V3 paper §2.1.2;
//! transformers `modeling_deepseek_v3.py` `DeepseekV3MoE`). No published
//! architecture combines GQA with that MoE: it exists so that an MoE built
//! exactly from a trained dense model (`caracal moeify`) can run, because
//! MLA cannot be derived exactly from GQA. A config without
//! `n_routed_experts` loads the plain dense model.

use std::path::Path;
use std::sync::Arc;

use caracal_kernels::attention::AttnShape;
use caracal_kernels::moe::{RouterConfig, Scoring};
use caracal_kernels::paged::KvPool;
use caracal_kernels::rope::Rope;
use caracal_kernels::Matrix;
use serde::Deserialize;
use serde_json::Value;

use super::layers::gqa::GqaAttention;
use super::layers::moe::MoeBlock;
use super::layers::{add_inplace, embed, logits, BatchLayout, GluAct, Mlp, RmsNorm};
use super::{
    CausalLm, EngineError, ExpertDispatch, ExpertFfn, ModelInfo, MoeModel, SeqBatch, SeqState,
};
use crate::checkpoint::config::{defaults, parse_config, rope_from_config};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// `config.json` of a `llama` checkpoint (absent keys get transformers' defaults).
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaConfig {
    /// Vocabulary size.
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    /// Model width.
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    /// SwiGLU width.
    #[serde(default = "d_inter")]
    pub intermediate_size: usize,
    /// Decoder layers.
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    /// Query heads.
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    /// KV heads (defaults to the query heads).
    pub num_key_value_heads: Option<usize>,
    /// Head size (defaults to hidden / heads).
    pub head_dim: Option<usize>,
    /// Activation of the MLP.
    #[serde(default = "defaults::silu")]
    pub hidden_act: String,
    /// Context length.
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    /// RMSNorm eps.
    #[serde(default = "defaults::eps_1e6")]
    pub rms_norm_eps: f32,
    /// Whether `lm_head` reuses the embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v/o (unsupported when true).
    #[serde(default)]
    pub attention_bias: bool,
}

/// The DeepSeek-V3 MoE keys of a `llama` config (Caracal extension, read
/// only when `n_routed_experts` is present). Key names and meanings are
/// DeepSeek-V3's; absent optional keys take the values that leave the
/// router plain (no groups, no scaling).
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaMoeConfig {
    /// Routed experts per MoE layer.
    pub n_routed_experts: usize,
    /// Experts per token (top-k).
    pub num_experts_per_tok: usize,
    /// Width of one routed expert.
    pub moe_intermediate_size: usize,
    /// Shared experts per MoE layer, fused into one MLP of width
    /// `n_shared_experts · moe_intermediate_size` (default 0: none).
    #[serde(default)]
    pub n_shared_experts: usize,
    /// Layers `< first_k_dense_replace` keep the dense MLP (default 0).
    #[serde(default)]
    pub first_k_dense_replace: usize,
    /// MoE every this many layers; only 1 is supported (default 1).
    #[serde(default = "defaults::one")]
    pub moe_layer_freq: usize,
    /// Expert groups for grouped top-k (default 1: plain top-k).
    #[serde(default = "defaults::one")]
    pub n_group: usize,
    /// Groups kept per token, `1..=n_group` (default 1).
    #[serde(default = "defaults::one")]
    pub topk_group: usize,
    /// Multiplier of the routed output (default 1.0).
    #[serde(default = "defaults::one_f32")]
    pub routed_scaling_factor: f32,
    /// Renormalise the top-k weights to sum to 1 (default true).
    #[serde(default = "defaults::yes")]
    pub norm_topk_prob: bool,
    /// Router scoring: `sigmoid` (DeepSeek-V3, Kimi K2; default) or `softmax`.
    #[serde(default = "d_scoring")]
    pub scoring_func: String,
}

impl LlamaMoeConfig {
    /// The router settings, checked against the expert count.
    pub fn router(&self) -> Result<RouterConfig> {
        let scoring = match self.scoring_func.as_str() {
            "sigmoid" => Scoring::Sigmoid,
            "softmax" => Scoring::Softmax,
            other => {
                return Err(Error::Config(format!(
                    "unsupported scoring_func `{other}` (supported: sigmoid, softmax)"
                )))
            }
        };
        let e = self.n_routed_experts;
        if e == 0 || self.n_group == 0 || !e.is_multiple_of(self.n_group) {
            return Err(Error::Config(format!(
                "n_routed_experts {e} must be > 0 and divisible by n_group {}",
                self.n_group
            )));
        }
        if !(1..=self.n_group).contains(&self.topk_group) {
            return Err(Error::Config(format!(
                "topk_group {} must be in 1..={}",
                self.topk_group, self.n_group
            )));
        }
        let reachable = self.topk_group * (e / self.n_group);
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > reachable {
            return Err(Error::Config(format!(
                "num_experts_per_tok {} must be in 1..={reachable} (experts in the {} kept groups)",
                self.num_experts_per_tok, self.topk_group
            )));
        }
        if self.moe_layer_freq != 1 {
            return Err(Error::Config(format!(
                "moe_layer_freq {} is not supported (only 1)",
                self.moe_layer_freq
            )));
        }
        Ok(RouterConfig {
            scoring,
            top_k: self.num_experts_per_tok,
            n_group: self.n_group,
            topk_group: self.topk_group,
            renormalize: self.norm_topk_prob,
            routed_scaling_factor: self.routed_scaling_factor,
            bias_in_weights: false,
        })
    }
}

fn d_vocab() -> usize {
    32000
}
fn d_hidden() -> usize {
    4096
}
fn d_inter() -> usize {
    11008
}
fn d_layers() -> usize {
    32
}
fn d_heads() -> usize {
    32
}
fn d_max_pos() -> usize {
    2048
}
fn d_scoring() -> String {
    "sigmoid".into()
}

/// The feed-forward part of a layer (one per layer, so variant sizes do not matter).
#[allow(clippy::large_enum_variant)]
enum Ffn {
    /// LLaMA's SwiGLU MLP.
    Dense(Mlp),
    /// DeepSeek-V3 MoE (router, routed and shared experts).
    Moe(MoeBlock),
}

/// One decoder layer.
struct LlamaLayer {
    input_layernorm: RmsNorm,
    self_attn: GqaAttention,
    post_attention_layernorm: RmsNorm,
    mlp: Ffn,
}

/// A loaded LLaMA model.
pub struct Llama {
    info: ModelInfo,
    embed_tokens: Matrix,
    layers: Vec<LlamaLayer>,
    norm: RmsNorm,
    lm_head: Matrix,
    rope: Rope,
}

/// Loads the DeepSeek-V3 MoE block of layer prefix `p` (`model.layers.3`).
fn load_moe(
    ckpt: &Checkpoint,
    p: &str,
    d: usize,
    m: &LlamaMoeConfig,
    router: &RouterConfig,
    act: GluAct,
    moe_layer: usize,
) -> Result<MoeBlock> {
    let e = m.n_routed_experts;
    let names = ["gate_proj", "up_proj", "down_proj"];
    let experts = (0..e)
        .map(|j| {
            Mlp::load(
                ckpt,
                &format!("{p}.mlp.experts.{j}"),
                names,
                d,
                m.moe_intermediate_size,
                act,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let shared = if m.n_shared_experts > 0 {
        Some(Mlp::load(
            ckpt,
            &format!("{p}.mlp.shared_experts"),
            names,
            d,
            m.moe_intermediate_size * m.n_shared_experts,
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
    let gate = ckpt.matrix(&format!("{p}.mlp.gate.weight"), e, d)?;
    Ok(MoeBlock::new(
        gate,
        bias,
        experts,
        shared,
        router.clone(),
        moe_layer,
    ))
}

impl Llama {
    /// Loads the weights named by `config` from `ckpt`.
    pub fn load(
        config: &Value,
        cfg_path: &Path,
        ckpt: &Checkpoint,
        eos_ids: Vec<u32>,
    ) -> Result<Llama> {
        let c: LlamaConfig = parse_config(config, cfg_path)?;
        if c.attention_bias {
            return Err(Error::Config(
                "llama with attention_bias=true is not supported".into(),
            ));
        }
        let moe: Option<LlamaMoeConfig> =
            if config.get("n_routed_experts").is_some_and(|v| !v.is_null()) {
                Some(parse_config(config, cfg_path)?)
            } else {
                None
            };
        let router = moe.as_ref().map(LlamaMoeConfig::router).transpose()?;
        let heads = c.num_attention_heads;
        let kv_heads = c.num_key_value_heads.unwrap_or(heads);
        let head_dim = c.head_dim.unwrap_or(c.hidden_size / heads);
        let (theta, scaling) = rope_from_config(config, defaults::theta_10k())?;
        let rope = Rope::new(head_dim, theta, &scaling);
        let act = GluAct::from_name(&c.hidden_act)?;
        let d = c.hidden_size;
        let embed_tokens = ckpt.matrix("model.embed_tokens.weight", c.vocab_size, d)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let shape = AttnShape {
                q_heads: heads,
                kv_heads,
                head_dim,
                v_dim: head_dim,
            };
            let mlp = match (&moe, &router) {
                (Some(m), Some(r)) if i >= m.first_k_dense_replace => Ffn::Moe(load_moe(
                    ckpt,
                    &p,
                    d,
                    m,
                    r,
                    act,
                    i - m.first_k_dense_replace,
                )?),
                _ => Ffn::Dense(Mlp::load(
                    ckpt,
                    &format!("{p}.mlp"),
                    ["gate_proj", "up_proj", "down_proj"],
                    d,
                    c.intermediate_size,
                    act,
                )?),
            };
            layers.push(LlamaLayer {
                input_layernorm: RmsNorm::load(
                    ckpt,
                    &format!("{p}.input_layernorm.weight"),
                    d,
                    c.rms_norm_eps,
                )?,
                self_attn: GqaAttention::load(ckpt, &format!("{p}.self_attn"), d, shape, i)?,
                post_attention_layernorm: RmsNorm::load(
                    ckpt,
                    &format!("{p}.post_attention_layernorm.weight"),
                    d,
                    c.rms_norm_eps,
                )?,
                mlp,
            });
        }
        let lm_head = if c.tie_word_embeddings || !ckpt.has("lm_head.weight") {
            embed_tokens.clone()
        } else {
            ckpt.matrix("lm_head.weight", c.vocab_size, d)?
        };
        let info = ModelInfo {
            model_type: "llama".into(),
            vocab_size: c.vocab_size,
            max_position: c.max_position_embeddings,
            kv_layers: c.num_hidden_layers,
            kv_width: kv_heads * head_dim * 2,
            linear_layers: 0,
            eos_ids,
            num_params: ckpt.total_params(),
        };
        Ok(Llama {
            info,
            embed_tokens,
            layers,
            norm: RmsNorm::load(ckpt, "model.norm.weight", d, c.rms_norm_eps)?,
            lm_head,
            rope,
        })
    }

    /// Whether any layer is an MoE block (the config carried `n_routed_experts`).
    pub fn is_moe(&self) -> bool {
        self.layers.iter().any(|l| matches!(l.mlp, Ffn::Moe(_)))
    }
}

impl CausalLm for Llama {
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
                &self.rope,
                cache,
            );
            add_inplace(&mut h, &a);
            let x = layer.post_attention_layernorm.forward(&h);
            let m = match &layer.mlp {
                Ffn::Dense(mlp) => mlp.forward(&x),
                Ffn::Moe(moe) => moe.forward(&x),
            };
            add_inplace(&mut h, &m);
        }
        layout.commit(batch);
        Ok(logits(&h, &layout, &self.norm, &self.lm_head))
    }

    fn as_moe(&self) -> Option<&dyn MoeModel> {
        if self.is_moe() {
            Some(self)
        } else {
            None
        }
    }
}

impl MoeModel for Llama {
    fn experts(&self) -> Vec<Vec<Arc<dyn ExpertFfn>>> {
        self.layers
            .iter()
            .filter_map(|l| match &l.mlp {
                Ffn::Moe(m) => Some(m.experts.clone()),
                Ffn::Dense(_) => None,
            })
            .collect()
    }

    fn set_expert_dispatch(&self, dispatch: Arc<dyn ExpertDispatch>) {
        for l in &self.layers {
            if let Ffn::Moe(m) = &l.mlp {
                m.set_dispatch(dispatch.clone());
            }
        }
    }
}
