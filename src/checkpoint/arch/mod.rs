//! One typed description of a checkpoint's architecture, parsed once from
//! `config.json` and used by every model loader, the memory planner and
//! `caracal synth`.
//!
//! [`Arch::from_config`] reads the keys of the supported `model_type`s
//! ([`ModelType`], the one list) through the serde structs of [`keys`] and
//! turns them into per-layer kinds ([`LayerKind`]: attention [`AttentionKind`]
//! × MLP [`MlpKind`]), the dimensions of each block ([`GqaDims`],
//! [`MlaDims`], [`KdaDims`], [`MoeDims`]), the router settings
//! ([`RouterSettings`], built by a fallible constructor), RoPE, the
//! activation, the `quantization_config` groups ([`Quantization`]) and
//! whether a vision tower is configured.
//!
//! Validation happens here, with errors that name the key and its value
//! (`config.json: \`num_expert_group\` must be >= 1, got 0`), so no bad
//! setting reaches an `assert!` inside a forward. [`Arch::for_checkpoint`]
//! also checks the declared layer count and widths against the safetensors
//! headers (no weight is read, nothing is allocated from the config first),
//! so `num_hidden_layers: 1000000000` is an error, not a 1 TB allocation.
//!
//! Which layers are KDA and which are MoE is decided only here:
//! - KDA (Kimi family): `linear_attn_config.kda_layers` (1-based), else the
//!   complement of `full_attn_layers`, else `layer_types`
//!   (`linear_attention`), else transformers' fallback (every 4th layer,
//!   1-based, is full attention). Other families have no KDA layers.
//! - MoE: `mlp_layer_types` (`sparse`, Kimi family), else layers
//!   `i >= first_k_dense_replace` with `i % moe_layer_freq == 0`, when the
//!   config has routed experts (a `llama` config only with the DeepSeek-V3
//!   MoE keys, see [`keys::LlamaMoeConfig`]).

pub mod keys;
pub mod vision;

mod build;
#[cfg(test)]
mod tests;

use std::path::Path;

use caracal_kernels::moe::{RouterConfig, Scoring};
use caracal_kernels::rope::RopeScaling;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::checkpoint::config::read_json;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// Architectures Caracal loads, by `model_type`: the names of
/// [`ModelType::ALL`], in that order.
pub const SUPPORTED_MODEL_TYPES: [&str; ModelType::ALL.len()] = {
    let mut names = [""; ModelType::ALL.len()];
    let mut i = 0;
    while i < names.len() {
        names[i] = ModelType::ALL[i].name();
        i += 1;
    }
    names
};

/// The most decoder layers a config may declare without a checkpoint to
/// check them against (K3 has 93).
pub const MAX_LAYERS: usize = 4096;

/// Architectures Caracal loads, by `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelType {
    /// `llama` (optionally with the DeepSeek-V3 MoE keys).
    Llama,
    /// `deepseek_v3`.
    DeepseekV3,
    /// `kimi_k2` (DeepSeek-V3's architecture).
    KimiK2,
    /// `kimi_linear`.
    KimiLinear,
    /// `kimi_k3` (multimodal wrapper or text-only).
    KimiK3,
    /// `kimi_k25` (Kimi K2.5 / K2.6: a DeepSeek-V3 text model with a
    /// MoonViT3d tower).
    KimiK25,
}

impl ModelType {
    /// Every supported type, in the order they are listed to users.
    pub const ALL: [ModelType; 6] = [
        ModelType::Llama,
        ModelType::DeepseekV3,
        ModelType::KimiK2,
        ModelType::KimiLinear,
        ModelType::KimiK3,
        ModelType::KimiK25,
    ];

    /// The `model_type` string.
    pub const fn name(self) -> &'static str {
        match self {
            ModelType::Llama => "llama",
            ModelType::DeepseekV3 => "deepseek_v3",
            ModelType::KimiK2 => "kimi_k2",
            ModelType::KimiLinear => "kimi_linear",
            ModelType::KimiK3 => "kimi_k3",
            ModelType::KimiK25 => "kimi_k25",
        }
    }

    /// The type named `name`, if supported.
    pub fn from_name(name: &str) -> Option<ModelType> {
        ModelType::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The published tensor naming its checkpoints follow.
    pub fn family(self) -> Family {
        match self {
            ModelType::Llama => Family::Llama,
            ModelType::DeepseekV3 | ModelType::KimiK2 | ModelType::KimiK25 => Family::DeepseekV3,
            ModelType::KimiLinear | ModelType::KimiK3 => Family::KimiLinear,
        }
    }
}

/// Which published naming the tensors follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// `LlamaForCausalLM`.
    Llama,
    /// `DeepseekV3ForCausalLM` (Kimi K2): `mlp.experts.{e}.gate_proj`.
    DeepseekV3,
    /// `KimiLinearForCausalLM` (Kimi-Linear, K3 text): `block_sparse_moe.experts.{e}.w1`.
    KimiLinear,
}

impl Family {
    /// Sub-module names of a layer's MoE block, the published one first:
    /// transformers 5.x loads a Kimi MoE block saved under either name.
    pub fn moe_modules(self) -> &'static [&'static str] {
        match self {
            Family::KimiLinear => &["block_sparse_moe", "mlp"],
            Family::Llama | Family::DeepseekV3 => &["mlp"],
        }
    }

    /// Sub-module names of a layer's dense MLP, the published one first.
    /// transformers 5.x `save_pretrained` writes a `kimi_linear` dense layer's
    /// MLP as `block_sparse_moe.{gate,up,down}_proj` (its save-time rename of
    /// every `.mlp.`), the published checkpoints as `mlp.*`.
    pub fn dense_modules(self) -> &'static [&'static str] {
        match self {
            Family::KimiLinear => &["mlp", "block_sparse_moe"],
            Family::Llama | Family::DeepseekV3 => &["mlp"],
        }
    }

    /// Per-expert `[gate, up, down]` sub-names, the published spelling first.
    pub fn expert_names(self) -> &'static [[&'static str; 3]] {
        match self {
            Family::KimiLinear => &[["w1", "w3", "w2"], ["gate_proj", "up_proj", "down_proj"]],
            Family::Llama | Family::DeepseekV3 => {
                &[["gate_proj", "up_proj", "down_proj"], ["w1", "w3", "w2"]]
            }
        }
    }
}

/// Token mixer of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKind {
    /// Grouped-query softmax attention (llama).
    Gqa,
    /// Multi-head latent attention.
    Mla,
    /// Kimi Delta Attention.
    Kda,
}

/// Channel mixer of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpKind {
    /// One gated MLP of `intermediate_size`.
    Dense,
    /// Router, routed experts and shared experts.
    Moe,
}

/// What one decoder layer is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LayerKind {
    /// Token mixer.
    pub attention: AttentionKind,
    /// Channel mixer.
    pub mlp: MlpKind,
}

/// The activation between gate and up projections (`hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GluAct {
    /// SwiGLU: silu(gate) · up.
    Silu,
    /// Kimi K3's SiTU-GLU (`hidden_act: "situ"`):
    /// `[β·tanh(gate/β)·sigmoid(gate)] · [β_lin·tanh(up/β_lin)]`, the second
    /// factor being plain `up` when `linear_beta` is `None` (Moonshot's
    /// `SituAndMul`; reference doc §4.1).
    Situ {
        /// β (`activation_situ_beta`, K3: 4.0; 1.0 when the key is absent, as
        /// in Moonshot's `_get_situ_activation_params`). Must be > 0.
        beta: f32,
        /// β_lin (`activation_situ_linear_beta`, K3: 25.0); `None` leaves `up`
        /// unclipped. Must be > 0 when set.
        linear_beta: Option<f32>,
    },
}

impl GluAct {
    /// Parses `hidden_act` with no SiTU settings (`situ` gets β = 1 and no
    /// linear clip, the defaults of Moonshot's code).
    pub fn from_name(name: &str) -> Result<GluAct> {
        GluAct::from_config(name, None, None)
    }

    /// Parses `hidden_act` together with `activation_situ_beta` and
    /// `activation_situ_linear_beta` (used only by `situ`).
    pub fn from_config(
        name: &str,
        situ_beta: Option<f32>,
        situ_linear_beta: Option<f32>,
    ) -> Result<GluAct> {
        match name {
            "silu" | "swish" => Ok(GluAct::Silu),
            "situ" => {
                let beta = situ_beta.unwrap_or(1.0);
                if !(beta > 0.0 && beta.is_finite()) {
                    return Err(Error::Config(format!(
                        "`activation_situ_beta` must be a positive number, got {beta}"
                    )));
                }
                if let Some(lb) = situ_linear_beta {
                    if !(lb > 0.0 && lb.is_finite()) {
                        return Err(Error::Config(format!(
                            "`activation_situ_linear_beta` must be a positive number, got {lb}"
                        )));
                    }
                }
                Ok(GluAct::Situ {
                    beta,
                    linear_beta: situ_linear_beta,
                })
            }
            other => Err(Error::Config(format!(
                "unsupported hidden_act `{other}` (supported: silu, situ)"
            ))),
        }
    }
}

/// How the stored `A_log` maps onto heads and channels.
///
/// Sources disagree on K3's `A_log` (reference doc §1.6, marked uncertain):
/// Kimi Linear stores one value per head (`[1, 1, heads, 1]`); TokenSpeed
/// reads K3's as a `[head_dim]` buffer of which only the first `heads`
/// entries are the per-head values (the rest zero); a third-party port reads
/// a `[head_dim]` tensor as one decay per key channel shared by all heads.
/// Set with `linear_attn_config.a_log_layout` (a Caracal key, default `auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ALogLayout {
    /// `heads` values: used as is. A `[head_dim]` buffer (≠ heads): the
    /// first `heads` entries per head when the tail is all zero (TokenSpeed's
    /// reading), else one value per channel ([`ALogLayout::PerChannel`]).
    #[default]
    Auto,
    /// One value per head: `heads` values, or the first `heads` entries of a
    /// longer buffer.
    PerHead,
    /// One value per key channel `d`, shared by all heads (`[head_dim]`).
    PerChannel,
}

/// GQA shapes (llama).
#[derive(Debug, Clone, PartialEq)]
pub struct GqaDims {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Per-head width (even: RoPE rotates pairs).
    pub head_dim: usize,
    /// Biases on q/k/v/o (`attention_bias`; the loader refuses them).
    pub bias: bool,
}

/// MLA shapes and options.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaDims {
    /// Heads.
    pub heads: usize,
    /// `q_lora_rank`; `None` means a direct `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Width of the cached latent `c_kv`.
    pub kv_lora_rank: usize,
    /// Non-rotary q/k width per head.
    pub qk_nope_head_dim: usize,
    /// Rotary (or unrotated NoPE) q/k width, also cached per token.
    pub qk_rope_head_dim: usize,
    /// Value width per head.
    pub v_head_dim: usize,
    /// Attention without RoPE (Kimi family; `mla_use_nope`).
    pub nope: bool,
    /// Adjacent-pair RoPE layout (`rope_interleave`, DeepSeek-V3).
    pub rope_interleave: bool,
    /// eps of `q_a_layernorm` / `kv_a_layernorm` (1e-6; K3:
    /// `mla_latent_norm_eps`).
    pub latent_norm_eps: f32,
    /// K3's sigmoid output gate `g_proj` (`mla_use_output_gate`).
    pub output_gate: bool,
}

/// KDA shapes and variant switches.
#[derive(Debug, Clone, PartialEq)]
pub struct KdaDims {
    /// Heads (`linear_attn_config.num_heads`).
    pub heads: usize,
    /// Key = value width per head (`linear_attn_config.head_dim`).
    pub head_dim: usize,
    /// Short-conv kernel width (`short_conv_kernel_size`).
    pub conv_kernel: usize,
    /// K3's full-rank output gate `g_proj` instead of `g_a_proj`/`g_b_proj`.
    pub full_rank_gate: bool,
    /// K3's bounded forget gate (`gate_lower_bound`); `None`: softplus gate.
    pub gate_lower_bound: Option<f32>,
    /// How `A_log` is read (Kimi Linear: per head; K3: the config's).
    pub a_log_layout: ALogLayout,
}

/// The key names one family uses for its router settings (errors name the
/// key as that family's configs spell it).
#[derive(Debug, Clone, Copy)]
pub struct RouterKeyNames {
    /// Routed expert count.
    pub experts: &'static str,
    /// Experts per token.
    pub top_k: &'static str,
    /// Expert groups.
    pub n_group: &'static str,
    /// Groups kept per token.
    pub topk_group: &'static str,
    /// Score function.
    pub scoring: &'static str,
}

impl RouterKeyNames {
    /// DeepSeek-V3 / Kimi K2 / llama-MoE spellings.
    pub const DEEPSEEK: RouterKeyNames = RouterKeyNames {
        experts: "n_routed_experts",
        top_k: "num_experts_per_tok",
        n_group: "n_group",
        topk_group: "topk_group",
        scoring: "scoring_func",
    };
    /// Kimi Linear / K3 spellings.
    pub const KIMI: RouterKeyNames = RouterKeyNames {
        experts: "num_experts",
        top_k: "num_experts_per_token",
        n_group: "num_expert_group",
        topk_group: "topk_group",
        scoring: "moe_router_activation_func",
    };
}

/// Validated router settings of a MoE block.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterSettings {
    /// Score function.
    pub scoring: Scoring,
    /// Routed experts.
    pub experts: usize,
    /// Experts per token, `1..=experts` and reachable in the kept groups.
    pub top_k: usize,
    /// Expert groups (divides `experts`).
    pub n_group: usize,
    /// Groups kept per token, `1..=n_group`.
    pub topk_group: usize,
    /// Renormalise the chosen weights.
    pub renormalize: bool,
    /// Multiplier of the routed output (finite).
    pub routed_scaling_factor: f32,
}

impl RouterSettings {
    /// Checks the router keys of a config; each error names the key (as
    /// `names` spells it) and its value.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        names: &RouterKeyNames,
        scoring: &str,
        experts: usize,
        top_k: usize,
        n_group: usize,
        topk_group: usize,
        renormalize: bool,
        routed_scaling_factor: f32,
    ) -> Result<RouterSettings> {
        let bad = |m: String| Err(Error::Config(format!("config.json: {m}")));
        let scoring = match scoring {
            "sigmoid" => Scoring::Sigmoid,
            "softmax" => Scoring::Softmax,
            other => {
                return bad(format!(
                    "`{}` must be `sigmoid` or `softmax`, got `{other}`",
                    names.scoring
                ))
            }
        };
        if experts == 0 {
            return bad(format!("`{}` must be >= 1, got 0", names.experts));
        }
        if n_group == 0 {
            return bad(format!("`{}` must be >= 1, got 0", names.n_group));
        }
        if top_k == 0 {
            return bad(format!("`{}` must be >= 1, got 0", names.top_k));
        }
        if top_k > experts {
            return bad(format!(
                "`{}` ({top_k}) must be <= `{}` ({experts})",
                names.top_k, names.experts
            ));
        }
        if !experts.is_multiple_of(n_group) {
            return bad(format!(
                "`{}` ({experts}) must be divisible by `{}` ({n_group})",
                names.experts, names.n_group
            ));
        }
        if !(1..=n_group).contains(&topk_group) {
            return bad(format!(
                "`{}` must be in 1..=`{}` ({n_group}), got {topk_group}",
                names.topk_group, names.n_group
            ));
        }
        let reachable = topk_group * (experts / n_group);
        if top_k > reachable {
            return bad(format!(
                "`{}` ({top_k}) must be <= the {reachable} experts in the `{}` ({topk_group}) kept groups",
                names.top_k, names.topk_group
            ));
        }
        if !routed_scaling_factor.is_finite() {
            return bad(format!(
                "`routed_scaling_factor` must be a finite number, got {routed_scaling_factor}"
            ));
        }
        Ok(RouterSettings {
            scoring,
            experts,
            top_k,
            n_group,
            topk_group,
            renormalize,
            routed_scaling_factor,
        })
    }

    /// The kernels' router settings (unbiased weights, as transformers).
    pub fn router_config(&self) -> RouterConfig {
        RouterConfig {
            scoring: self.scoring,
            top_k: self.top_k,
            n_group: self.n_group,
            topk_group: self.topk_group,
            renormalize: self.renormalize,
            routed_scaling_factor: self.routed_scaling_factor,
            bias_in_weights: false,
        }
    }
}

/// MoE shapes and router.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeDims {
    /// Routed experts per layer.
    pub experts: usize,
    /// Shared experts (one MLP of `shared · intermediate`).
    pub shared: usize,
    /// Expert intermediate width.
    pub intermediate: usize,
    /// K3 latent width the routed experts live in (`routed_expert_hidden_size`).
    pub latent: Option<usize>,
    /// K3 `routed_expert_norm` before the up projection (`latent_moe_use_norm`).
    pub latent_norm: bool,
    /// The router.
    pub router: RouterSettings,
}

/// RoPE of the attention layers that rotate (llama, DeepSeek-V3).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSettings {
    /// Base frequency.
    pub theta: f32,
    /// Scaling variant.
    pub scaling: RopeScaling,
}

/// What `quantization_config` says the weights are stored as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QuantMethod {
    /// No `quantization_config`: weights as stored (bf16 / f32).
    None,
    /// MXFP4 (compressed-tensors `mxfp4-pack-quantized` or gpt-oss `mxfp4`).
    Mxfp4,
    /// FP8 block quantization (`quant_method: fp8`, DeepSeek-V3 / K2).
    Fp8,
    /// Anything else (kept in [`Quantization::config`]).
    Other,
}

/// One compressed-tensors `config_groups` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantGroup {
    /// Group name (`group_0`).
    pub name: String,
    /// Storage format of its weights (`mxfp4-pack-quantized`, `int-quantized`).
    pub format: String,
    /// Module patterns it applies to (`Linear`, `re:.*\.experts\..*`).
    pub targets: Vec<String>,
    /// Bits per weight (`weights.num_bits`).
    pub num_bits: Option<u64>,
}

/// The `quantization_config` of a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantization {
    /// The overall method.
    pub method: QuantMethod,
    /// compressed-tensors groups, in key order.
    pub groups: Vec<QuantGroup>,
    /// Modules left unquantized (`ignore`).
    pub ignore: Vec<String>,
    /// The raw object, for reports.
    pub config: Option<Value>,
}

/// The architecture of one checkpoint's text decoder (plus whether a vision
/// tower is configured).
#[derive(Debug, Clone, PartialEq)]
pub struct Arch {
    /// The `model_type` (for a multimodal wrapper Caracal does not know by
    /// name, the `text_config`'s).
    pub model_type: ModelType,
    /// Tensor naming family.
    pub family: Family,
    /// Prefix of the text decoder's tensors: `language_model.` for the
    /// multimodal wrapper, else empty (from the tensors when a checkpoint
    /// was given, else from the config's `text_config`).
    pub root: String,
    /// Vocabulary rows of the embedding and `lm_head`.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Dense MLP width (`intermediate_size`).
    pub intermediate_size: usize,
    /// Context length (`max_position_embeddings` / `model_max_length`).
    pub max_position: usize,
    /// eps of the residual-stream RMSNorms (`rms_norm_eps`).
    pub rms_norm_eps: f32,
    /// `lm_head` shares the embedding.
    pub tie_word_embeddings: bool,
    /// MLP activation (dense, shared and routed experts).
    pub act: GluAct,
    /// Kind of every decoder layer (MTP layers excluded).
    pub layers: Vec<LayerKind>,
    /// GQA shapes, when any layer is GQA.
    pub gqa: Option<GqaDims>,
    /// MLA shapes, when any layer is MLA.
    pub mla: Option<MlaDims>,
    /// KDA shapes (Kimi family).
    pub kda: Option<KdaDims>,
    /// MoE shapes, when the config has routed experts.
    pub moe: Option<MoeDims>,
    /// RoPE, for architectures whose attention rotates.
    pub rope: Option<RopeSettings>,
    /// K3 Block AttnRes block size (`attn_res_block_size`).
    pub attn_res_block_size: Option<usize>,
    /// Biases on the dense MLP (`mlp_bias`, llama; the loader has none).
    pub mlp_bias: bool,
    /// MTP layers in the checkpoint (`num_nextn_predict_layers`), not loaded.
    pub mtp_layers: usize,
    /// The `quantization_config`.
    pub quantization: Quantization,
    /// Whether a `vision_config` is present.
    pub vision: bool,
    /// The validated `vision_config` of a `kimi_k25` / `kimi_k3` wrapper.
    pub vision_config: Option<vision::VisionConfig>,
    /// Module holding the decoder layers under `{root}model.`: `layers`, or
    /// `blocks` in what transformers 5.x `save_pretrained` writes for
    /// `kimi_k25` (its save-time reverse of the `blocks` → `layers` rename).
    pub layers_module: String,
}

impl Arch {
    /// Parses and validates `config.json` of `dir`.
    pub fn read(dir: &Path) -> Result<Arch> {
        Arch::from_config(&read_json(&dir.join("config.json"), "config.json")?)
    }

    /// Parses and validates a `config.json` value (no checkpoint to check
    /// against: layer counts above [`MAX_LAYERS`] are refused).
    pub fn from_config(config: &Value) -> Result<Arch> {
        build::parse(config, None)
    }

    /// Parses `config` and checks it against `ckpt`'s tensor headers before
    /// building anything: the declared layer count must not exceed the
    /// layers the checkpoint has tensors for, and the embedding must be
    /// `[vocab_size, hidden_size]`.
    pub fn for_checkpoint(config: &Value, ckpt: &Checkpoint) -> Result<Arch> {
        build::parse(config, Some(ckpt))
    }

    /// Tensor prefix of decoder layer `i`: `{root}model.layers.{i}` (or
    /// `…model.blocks.{i}`, see [`Arch::layers_module`]).
    pub fn layer_prefix(&self, i: usize) -> String {
        format!("{}model.{}.{i}", self.root, self.layers_module)
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Layers with the given attention kind.
    pub fn count(&self, kind: AttentionKind) -> usize {
        self.layers.iter().filter(|l| l.attention == kind).count()
    }

    /// Whether 0-based layer `i` is MoE.
    pub fn is_moe(&self, i: usize) -> bool {
        self.layers.get(i).is_some_and(|l| l.mlp == MlpKind::Moe)
    }

    /// Index of layer `i` among the MoE layers (the expert dispatcher's layer id).
    pub fn moe_index(&self, i: usize) -> usize {
        self.layers[..i]
            .iter()
            .filter(|l| l.mlp == MlpKind::Moe)
            .count()
    }

    /// Index of layer `i` among the layers of its attention family: KDA
    /// layers count KDA layers (their recurrent state slot), GQA/MLA layers
    /// count KV-cached layers (their cache slot).
    pub fn cache_index(&self, i: usize) -> usize {
        let kda = self.layers[i].attention == AttentionKind::Kda;
        self.layers[..i]
            .iter()
            .filter(|l| (l.attention == AttentionKind::Kda) == kda)
            .count()
    }

    /// Layers that keep a KV cache (GQA, MLA).
    pub fn kv_layers(&self) -> usize {
        self.layers.len() - self.count(AttentionKind::Kda)
    }

    /// Width of one cached token per KV layer: MLA's latent + rope part,
    /// GQA's keys and values.
    pub fn kv_width(&self) -> usize {
        match (&self.mla, &self.gqa) {
            (Some(m), _) => m.kv_lora_rank + m.qk_rope_head_dim,
            (None, Some(g)) => g.kv_heads * g.head_dim * 2,
            (None, None) => 0,
        }
    }

    /// Values per int8 KV scale: a GQA head (its K or its V), or for MLA
    /// the greatest common divisor of the latent and rope widths, so that
    /// the two never share a scale. Divides [`Arch::kv_width`] (1 when
    /// there is no KV layer).
    pub fn kv_segment(&self) -> usize {
        match (&self.mla, &self.gqa) {
            (Some(m), _) => {
                caracal_kernels::paged::common_segment(m.kv_lora_rank, m.qk_rope_head_dim)
            }
            (None, Some(g)) => g.head_dim.max(1),
            (None, None) => 1,
        }
    }

    /// The router of the MoE layers, or an error when the config has none.
    pub fn router_config(&self) -> Result<RouterConfig> {
        self.moe
            .as_ref()
            .map(|m| m.router.router_config())
            .ok_or_else(|| {
                Error::Config(format!(
                    "{} config has no MoE layers",
                    self.model_type.name()
                ))
            })
    }
}

/// The text part of a K3 config: `text_config` when present, else the
/// config itself (text-only checkpoints).
pub fn text_config(config: &Value) -> &Value {
    match config.get("text_config") {
        Some(t) if t.is_object() => t,
        _ => config,
    }
}
