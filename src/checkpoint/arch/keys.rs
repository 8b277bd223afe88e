//! The `config.json` keys of each supported architecture, as serde structs
//! whose field names are the published key names (aliases accept the other
//! spellings in use) and whose defaults are transformers'.
//!
//! These structs are read in one place, [`super::Arch::from_config`], which
//! turns them into the validated description; model files read only the few
//! keys they alone use (K3's AttnRes block size, SiTU betas, ...) from the
//! [`super::Arch`], never from these structs.

use serde::Deserialize;

use super::{ALogLayout, RouterKeyNames, RouterSettings};
use crate::checkpoint::config::defaults;
use crate::error::Result;

/// `config.json` of a `llama` checkpoint (absent keys get transformers' defaults).
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaConfig {
    /// Vocabulary size.
    #[serde(default = "d_llama_vocab")]
    pub vocab_size: usize,
    /// Model width.
    #[serde(default = "d_llama_hidden")]
    pub hidden_size: usize,
    /// SwiGLU width.
    #[serde(default = "d_llama_inter")]
    pub intermediate_size: usize,
    /// Decoder layers.
    #[serde(default = "d_llama_layers")]
    pub num_hidden_layers: usize,
    /// Query heads.
    #[serde(default = "d_llama_heads")]
    pub num_attention_heads: usize,
    /// KV heads (defaults to the query heads).
    pub num_key_value_heads: Option<usize>,
    /// Head size (defaults to hidden / heads).
    pub head_dim: Option<usize>,
    /// Activation of the MLP.
    #[serde(default = "defaults::silu")]
    pub hidden_act: String,
    /// Context length.
    #[serde(default = "d_llama_max_pos")]
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
    #[serde(default = "d_sigmoid")]
    pub scoring_func: String,
}

impl LlamaMoeConfig {
    /// The router settings, checked against the expert count (the checks of
    /// [`RouterSettings::new`], plus `moe_layer_freq` = 1).
    pub fn router(&self) -> Result<caracal_kernels::moe::RouterConfig> {
        Ok(self.router_settings()?.router_config())
    }

    /// The validated router settings.
    pub fn router_settings(&self) -> Result<RouterSettings> {
        let settings = RouterSettings::new(
            &RouterKeyNames::DEEPSEEK,
            &self.scoring_func,
            self.n_routed_experts,
            self.num_experts_per_tok,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.routed_scaling_factor,
        )?;
        if self.moe_layer_freq != 1 {
            return Err(crate::error::Error::Config(format!(
                "config.json: `moe_layer_freq` {} is not supported for llama (only 1)",
                self.moe_layer_freq
            )));
        }
        Ok(settings)
    }
}

/// `config.json` of a `deepseek_v3` / `kimi_k2` checkpoint (transformers' defaults).
#[derive(Debug, Clone, Deserialize)]
pub struct DeepseekV3Config {
    /// Vocabulary size.
    #[serde(default = "d_ds_vocab")]
    pub vocab_size: usize,
    /// Model width.
    #[serde(default = "d_ds_hidden")]
    pub hidden_size: usize,
    /// Width of the dense MLP layers.
    #[serde(default = "d_ds_inter")]
    pub intermediate_size: usize,
    /// Width of one routed expert.
    #[serde(default = "d_ds_moe_inter")]
    pub moe_intermediate_size: usize,
    /// Decoder layers.
    #[serde(default = "d_ds_layers")]
    pub num_hidden_layers: usize,
    /// Attention heads.
    #[serde(default = "d_ds_heads")]
    pub num_attention_heads: usize,
    /// Shared experts per MoE layer.
    #[serde(default = "defaults::one")]
    pub n_shared_experts: usize,
    /// Routed experts per MoE layer.
    #[serde(default = "d_ds_experts")]
    pub n_routed_experts: usize,
    /// Multiplier of the routed output.
    #[serde(default = "d_ds_rsf")]
    pub routed_scaling_factor: f32,
    /// Rank of the KV latent.
    #[serde(default = "d_kv_lora")]
    pub kv_lora_rank: usize,
    /// Rank of the query latent (`null` → direct `q_proj`).
    #[serde(default = "d_ds_q_lora")]
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
    #[serde(default = "d_ds_n_group")]
    pub n_group: usize,
    /// Groups kept per token.
    #[serde(default = "d_ds_topk_group")]
    pub topk_group: usize,
    /// Experts per token.
    #[serde(default = "d_topk")]
    pub num_experts_per_tok: usize,
    /// Layers `< first_k_dense_replace` use a dense MLP.
    #[serde(default = "d_ds_first_dense")]
    pub first_k_dense_replace: usize,
    /// MoE every this many layers from `first_k_dense_replace` (default 1).
    #[serde(default = "defaults::one")]
    pub moe_layer_freq: usize,
    /// Renormalise the top-k weights.
    #[serde(default = "defaults::yes")]
    pub norm_topk_prob: bool,
    /// MLP activation.
    #[serde(default = "defaults::silu")]
    pub hidden_act: String,
    /// Context length.
    #[serde(default = "d_ds_max_pos")]
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
    #[serde(default = "d_sigmoid")]
    pub scoring_func: String,
}

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

/// `config.json` of a `kimi_linear` checkpoint (and the text part of
/// `kimi_k3`). Key names as published; aliases accept transformers' spellings.
#[derive(Debug, Clone, Deserialize)]
pub struct KimiLinearConfig {
    /// Vocabulary size.
    #[serde(default = "d_kimi_vocab")]
    pub vocab_size: usize,
    /// Model width.
    #[serde(default = "d_kimi_hidden")]
    pub hidden_size: usize,
    /// Dense MLP width.
    #[serde(default = "d_kimi_inter")]
    pub intermediate_size: usize,
    /// Routed expert width.
    #[serde(default = "d_kimi_moe_inter")]
    pub moe_intermediate_size: usize,
    /// Decoder layers.
    #[serde(default = "d_kimi_layers")]
    pub num_hidden_layers: usize,
    /// MLA heads.
    #[serde(default = "d_kimi_heads")]
    pub num_attention_heads: usize,
    /// Routed experts.
    #[serde(
        default = "d_kimi_experts",
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
    #[serde(default = "d_kimi_rsf")]
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
    #[serde(default = "d_kimi_max_pos", alias = "max_position_embeddings")]
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

fn d_llama_vocab() -> usize {
    32000
}
fn d_llama_hidden() -> usize {
    4096
}
fn d_llama_inter() -> usize {
    11008
}
fn d_llama_layers() -> usize {
    32
}
fn d_llama_heads() -> usize {
    32
}
fn d_llama_max_pos() -> usize {
    2048
}
fn d_sigmoid() -> String {
    "sigmoid".into()
}
fn d_ds_vocab() -> usize {
    129280
}
fn d_ds_hidden() -> usize {
    7168
}
fn d_ds_inter() -> usize {
    18432
}
fn d_ds_moe_inter() -> usize {
    2048
}
fn d_ds_layers() -> usize {
    61
}
fn d_ds_heads() -> usize {
    128
}
fn d_ds_experts() -> usize {
    256
}
fn d_ds_rsf() -> f32 {
    2.5
}
fn d_kv_lora() -> usize {
    512
}
fn d_ds_q_lora() -> Option<usize> {
    Some(1536)
}
fn d_rope_dim() -> usize {
    64
}
fn d_head128() -> usize {
    128
}
fn d_ds_n_group() -> usize {
    8
}
fn d_ds_topk_group() -> usize {
    4
}
fn d_topk() -> usize {
    8
}
fn d_ds_first_dense() -> usize {
    3
}
fn d_ds_max_pos() -> usize {
    4096
}
fn d_kimi_vocab() -> usize {
    163840
}
fn d_kimi_hidden() -> usize {
    2304
}
fn d_kimi_inter() -> usize {
    9216
}
fn d_kimi_moe_inter() -> usize {
    1024
}
fn d_kimi_layers() -> usize {
    27
}
fn d_kimi_heads() -> usize {
    32
}
fn d_kimi_experts() -> usize {
    256
}
fn d_kimi_rsf() -> f32 {
    2.446
}
fn d_kimi_max_pos() -> usize {
    1048576
}
fn d_lin_heads() -> usize {
    32
}
fn d_conv() -> usize {
    4
}
