//! The shapes the memory planner counts, shared by the config reader
//! ([`super::parse`]), the weight schemes ([`super::weights`]) and the model
//! expansion ([`super::model`]): the planner's per-block dimensions
//! ([`TextArch`], [`VisionArch`]) and the tensor list entries
//! ([`TensorSpec`], tagged with the [`Component`] they belong to).

use serde::Serialize;

/// A part of the model whose parameters and bytes are reported separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Component {
    /// Input token embedding.
    Embedding,
    /// Output projection (absent when tied).
    LmHead,
    /// KDA projections, convs, `A_log`, `dt_bias`, `o_norm`.
    KdaAttention,
    /// MLA projections and their norms, K3's output gate `g_proj`.
    MlaAttention,
    /// GQA/MHA projections (llama).
    GqaAttention,
    /// `input_layernorm`, `post_attention_layernorm`, final `norm`.
    LayerNorms,
    /// Block AttnRes pseudo-queries and norms (4·d per layer + 2·d).
    AttnRes,
    /// Dense FFN layers (K2/K3 layer 0, every llama layer).
    DenseMlp,
    /// MoE router weight and `e_score_correction_bias`.
    Router,
    /// Routed experts (only top-k of them active per token).
    RoutedExperts,
    /// K3 latent MoE: `routed_expert_down_proj`, `routed_expert_up_proj`, `routed_expert_norm`.
    LatentProjections,
    /// Shared experts.
    SharedExperts,
    /// Vision tower (MoonViT / MoonViT3d).
    VisionTower,
    /// Vision → text projector.
    Projector,
}

impl Component {
    /// Every component, in report order.
    pub const ALL: [Component; 14] = [
        Component::Embedding,
        Component::LmHead,
        Component::KdaAttention,
        Component::MlaAttention,
        Component::GqaAttention,
        Component::LayerNorms,
        Component::AttnRes,
        Component::DenseMlp,
        Component::Router,
        Component::RoutedExperts,
        Component::LatentProjections,
        Component::SharedExperts,
        Component::VisionTower,
        Component::Projector,
    ];

    /// Table label.
    pub fn label(self) -> &'static str {
        match self {
            Component::Embedding => "embedding",
            Component::LmHead => "lm_head",
            Component::KdaAttention => "attention (KDA)",
            Component::MlaAttention => "attention (MLA)",
            Component::GqaAttention => "attention (GQA)",
            Component::LayerNorms => "layer norms",
            Component::AttnRes => "AttnRes",
            Component::DenseMlp => "dense MLP",
            Component::Router => "MoE router",
            Component::RoutedExperts => "routed experts",
            Component::LatentProjections => "latent MoE proj+norm",
            Component::SharedExperts => "shared experts",
            Component::VisionTower => "vision tower",
            Component::Projector => "projector",
        }
    }
}

/// How a tensor is used, which decides its format under each weight scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    /// A linear weight `[out, in]`.
    Linear,
    /// The down projection of an FFN (llama.cpp's `ffn_down*`, gets more bits in Q4_K_M).
    FfnDown,
    /// The token embedding table.
    Embedding,
    /// The output projection.
    LmHead,
    /// The MoE router weight (kept F32 by llama.cpp).
    Router,
    /// Vectors and small tensors: norms, biases, `A_log`, `dt_bias`, convs, position tables.
    Small,
}

/// One published tensor (or `count` identically shaped ones, e.g. the experts of a layer).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorSpec {
    /// Checkpoint name; `{e}` stands for the expert index when `count` > 1.
    pub name: String,
    /// The component it is reported under.
    pub component: Component,
    /// Its use.
    pub kind: TensorKind,
    /// Leading dimensions folded together (1 for a vector).
    pub rows: u64,
    /// Last dimension (the one block formats quantise along).
    pub cols: u64,
    /// How many copies (routed experts per layer; else 1).
    pub count: u64,
    /// Copies used by one token's forward (top-k for routed experts, 0 for vision).
    pub active_count: u64,
    /// Decoder layer index, for per-layer format rules.
    pub layer: Option<usize>,
}

impl TensorSpec {
    /// Parameters over all copies.
    pub fn params(&self) -> u64 {
        self.rows * self.cols * self.count
    }

    /// Parameters used by one token.
    pub fn active_params(&self) -> u64 {
        self.rows * self.cols * self.active_count
    }
}

pub use crate::checkpoint::arch::{AttentionKind, Family};

/// GQA shapes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GqaDims {
    /// Query heads.
    pub heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Per-head width.
    pub head_dim: u64,
    /// Biases on q/k/v/o (`attention_bias`).
    pub bias: bool,
}

/// MLA shapes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MlaDims {
    /// Heads.
    pub heads: u64,
    /// `q_lora_rank`; `None` means a direct `q_proj`.
    pub q_lora_rank: Option<u64>,
    /// Width of the cached latent `c_kv`.
    pub kv_lora_rank: u64,
    /// Non-rotary q/k width per head.
    pub qk_nope: u64,
    /// Rotary (or unrotated NoPE) q/k width, also cached per token.
    pub qk_rope: u64,
    /// Value width per head.
    pub v_head: u64,
    /// K3's sigmoid output gate `g_proj` (`mla_use_output_gate`).
    pub output_gate: bool,
}

/// KDA shapes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KdaDims {
    /// Heads.
    pub heads: u64,
    /// Key = value width per head.
    pub head_dim: u64,
    /// Short-conv kernel width `W` (state keeps `W − 1` columns).
    pub conv_kernel: u64,
    /// K3's full-rank output gate `g_proj` instead of `g_a_proj`/`g_b_proj`.
    pub full_rank_gate: bool,
}

/// MoE shapes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MoeDims {
    /// Routed experts per layer.
    pub experts: u64,
    /// Routed experts per token.
    pub top_k: u64,
    /// Shared experts (one MLP of `shared · intermediate`).
    pub shared: u64,
    /// Expert intermediate width.
    pub intermediate: u64,
    /// K3 latent width the routed experts live in (`routed_expert_hidden_size`).
    pub latent: Option<u64>,
    /// K3 `routed_expert_norm` before the up projection.
    pub latent_norm: bool,
}

/// The text decoder.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TextArch {
    /// Naming family.
    pub family: Family,
    /// Model width `d`.
    pub hidden: u64,
    /// Vocabulary rows of the embedding and lm_head.
    pub vocab: u64,
    /// Decoder layers (MTP layers excluded).
    pub layers: usize,
    /// `lm_head` shares the embedding matrix.
    pub tie_embeddings: bool,
    /// Attention type per layer.
    pub attention: Vec<AttentionKind>,
    /// Whether each layer's FFN is MoE (else dense).
    pub moe_layers: Vec<bool>,
    /// GQA shapes, when any layer is GQA.
    pub gqa: Option<GqaDims>,
    /// MLA shapes, when any layer is MLA.
    pub mla: Option<MlaDims>,
    /// KDA shapes, when any layer is KDA.
    pub kda: Option<KdaDims>,
    /// MoE shapes, when any layer is MoE.
    pub moe: Option<MoeDims>,
    /// Dense FFN width (`intermediate_size`).
    pub dense_intermediate: u64,
    /// Biases on the dense MLP (`mlp_bias`, llama).
    pub mlp_bias: bool,
    /// Block AttnRes block size, if the model uses AttnRes.
    pub attn_res_block: Option<usize>,
    /// `max_position_embeddings` (0 if absent).
    pub max_position: u64,
    /// MTP layers in the checkpoint (`num_nextn_predict_layers`), not counted.
    pub mtp_layers: u64,
    /// Name prefix of decoder tensors (`model.` or `language_model.model.`).
    pub prefix: String,
}

impl TextArch {
    /// Layers with the given attention type.
    pub fn count(&self, kind: AttentionKind) -> usize {
        self.attention.iter().filter(|&&a| a == kind).count()
    }
}

/// Vision → text projector.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProjectorArch {
    /// `mm_projector_type` (`patchmerger`, `patchmergerv2`).
    pub kind: String,
    /// Input width after the 2×2 merge (`mm_hidden_size`).
    pub input: u64,
    /// Text width.
    pub output: u64,
    /// Linear biases (patchmerger: yes; v2: no).
    pub bias: bool,
    /// LayerNorm over the tower width before merging (patchmerger).
    pub pre_norm: bool,
    /// RMSNorm over the text width after the MLP (patchmergerv2).
    pub post_norm: bool,
}

/// MoonViT / MoonViT3d tower.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VisionArch {
    /// Tower width.
    pub hidden: u64,
    /// Blocks.
    pub layers: u64,
    /// Attention heads.
    pub heads: u64,
    /// q (= k = v) width (`qkv_hidden_size`).
    pub qkv_hidden: u64,
    /// MLP width.
    pub mlp: u64,
    /// Patch side in pixels.
    pub patch: u64,
    /// Learned position grid cells (64·64).
    pub pos_cells: u64,
    /// RMSNorm (weight only) instead of LayerNorm (weight + bias).
    pub rms_norm: bool,
    /// Biases on `wqkv`/`wo`.
    pub attn_bias: bool,
    /// Biases on the MLP.
    pub linear_bias: bool,
    /// Bias on the patch-embedding conv.
    pub patch_bias: bool,
    /// The projector.
    pub projector: ProjectorArch,
}
