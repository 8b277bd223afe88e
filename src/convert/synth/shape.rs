//! The shapes of synthesized Kimi K3 checkpoints ([`K3Shape`], one per
//! [`Preset`]) and the `config.json` they are written with: the seam between
//! what a synthesized model looks like and how [`super::synthesize`] draws
//! and writes its tensors.

use caracal_kernels::mxfp4;
use serde_json::{json, Value};

use super::{Preset, BOS_ID, EOS_ID, MEDIA_PAD_ID, PAD_ID, SYNTH_VERSION};
use crate::error::{Error, Result};

/// Sizes of a synthesized Kimi K3 (text model + MoonViT3d + projector).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct K3Shape {
    /// Token vocabulary of the model (K3: 163,840).
    pub vocab_size: usize,
    /// Model width (K3: 7168).
    pub hidden_size: usize,
    /// Decoder layers (K3: 93).
    pub num_hidden_layers: usize,
    /// Decoder layers per AttnRes block (K3: 12).
    pub attn_res_block_size: usize,
    /// MLA heads (K3: 96).
    pub num_attention_heads: usize,
    /// MLA query LoRA rank (K3: 1536).
    pub q_lora_rank: usize,
    /// MLA KV latent width (K3: 512).
    pub kv_lora_rank: usize,
    /// MLA no-position part of a q/k head (K3: 128).
    pub qk_nope_head_dim: usize,
    /// MLA "rope" part of a q/k head, unrotated under NoPE (K3: 64).
    pub qk_rope_head_dim: usize,
    /// MLA value head width (K3: 128).
    pub v_head_dim: usize,
    /// KDA heads (K3: 96).
    pub kda_num_heads: usize,
    /// KDA head width (K3: 128).
    pub kda_head_dim: usize,
    /// KDA short-conv kernel (K3: 4).
    pub short_conv_kernel_size: usize,
    /// Dense MLP width of layer 0 (K3: 33792).
    pub intermediate_size: usize,
    /// Routed expert width; shared experts are `num_shared_experts` times it (K3: 3072).
    pub moe_intermediate_size: usize,
    /// Latent width routed experts work in (K3: 3584).
    pub routed_expert_hidden_size: usize,
    /// Routed experts per MoE layer (K3: 896).
    pub num_experts: usize,
    /// Experts per token (K3: 16).
    pub num_experts_per_token: usize,
    /// Shared experts (K3: 2).
    pub num_shared_experts: usize,
    /// Vision tower width (K3: 1024).
    pub vt_hidden_size: usize,
    /// Vision tower blocks (K3: 27).
    pub vt_num_hidden_layers: usize,
    /// Vision attention heads (K3: 12).
    pub vt_num_attention_heads: usize,
    /// Vision q/k/v width, heads × head dim (K3: 1536).
    pub vt_qkv_hidden_size: usize,
    /// Vision MLP width (K3: 4096).
    pub vt_intermediate_size: usize,
    /// Learnable position grid side (K3: 64).
    pub vt_pos_emb_size: usize,
}

impl K3Shape {
    /// The `tiny` preset: K3's vocabulary, expert count and routing, every
    /// width small. Widths differ from each other (64, 32, 96, 128, …) so a
    /// transposed weight fails to load instead of running.
    pub fn tiny() -> K3Shape {
        K3Shape {
            vocab_size: 163_840,
            hidden_size: 64,
            num_hidden_layers: 7,
            attn_res_block_size: 3,
            num_attention_heads: 4,
            q_lora_rank: 48,
            kv_lora_rank: 32,
            qk_nope_head_dim: 16,
            qk_rope_head_dim: 8,
            v_head_dim: 16,
            kda_num_heads: 4,
            kda_head_dim: 16,
            short_conv_kernel_size: 4,
            intermediate_size: 96,
            moe_intermediate_size: 64,
            routed_expert_hidden_size: 32,
            num_experts: 896,
            num_experts_per_token: 16,
            num_shared_experts: 2,
            vt_hidden_size: 32,
            vt_num_hidden_layers: 2,
            vt_num_attention_heads: 3,
            vt_qkv_hidden_size: 48,
            vt_intermediate_size: 128,
            vt_pos_emb_size: 64,
        }
    }

    /// The `small` preset: K3's vocabulary, layer pattern and routing with
    /// widths chosen so that attention over a long history costs the same
    /// share of a token's work as in K3. Per token at 4,096 cached tokens, K3's
    /// 24 MLA layers read 96 heads × 1,088 latent MACs per key (10.3 G MACs)
    /// against 104 G MACs of active weights (0.099); here 2 MLA layers × 8
    /// heads × 144 MACs per key give 9.4 M MACs against ~114 M (0.083). For
    /// timing the runtime on realistic proportions (`caracal bench --history`);
    /// tests use `tiny`.
    pub fn small() -> K3Shape {
        K3Shape {
            vocab_size: 163_840,
            hidden_size: 512,
            num_hidden_layers: 8,
            attn_res_block_size: 4,
            num_attention_heads: 8,
            q_lora_rank: 128,
            kv_lora_rank: 64,
            qk_nope_head_dim: 32,
            qk_rope_head_dim: 16,
            v_head_dim: 32,
            kda_num_heads: 8,
            kda_head_dim: 64,
            short_conv_kernel_size: 4,
            intermediate_size: 1536,
            moe_intermediate_size: 256,
            routed_expert_hidden_size: 256,
            num_experts: 64,
            num_experts_per_token: 8,
            num_shared_experts: 2,
            vt_hidden_size: 32,
            vt_num_hidden_layers: 2,
            vt_num_attention_heads: 3,
            vt_qkv_hidden_size: 48,
            vt_intermediate_size: 128,
            vt_pos_emb_size: 64,
        }
    }

    /// The shape of a preset.
    pub fn of(preset: Preset) -> K3Shape {
        match preset {
            Preset::Tiny => K3Shape::tiny(),
            Preset::Small => K3Shape::small(),
        }
    }

    /// 1-based full-attention (MLA) layers: every 4th and the last, as K3.
    pub fn full_attn_layers(&self) -> Vec<usize> {
        (1..=self.num_hidden_layers)
            .filter(|l| l % 4 == 0 || *l == self.num_hidden_layers)
            .collect()
    }

    /// 1-based KDA layers: the rest.
    pub fn kda_layers(&self) -> Vec<usize> {
        let full = self.full_attn_layers();
        (1..=self.num_hidden_layers)
            .filter(|l| !full.contains(l))
            .collect()
    }

    /// Checks the constraints of the layout (MXFP4 needs input widths that
    /// are multiples of 32; KDA's `A_log` buffer holds one entry per head).
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::Config(format!("synth shape: {what}")));
        for (name, v) in [
            ("routed_expert_hidden_size", self.routed_expert_hidden_size),
            ("moe_intermediate_size", self.moe_intermediate_size),
        ] {
            if v == 0 || !v.is_multiple_of(mxfp4::BLOCK_ELEMS) {
                return bad(format!(
                    "{name} must be a positive multiple of {}, got {v}",
                    mxfp4::BLOCK_ELEMS
                ));
            }
        }
        if self.kda_num_heads > self.kda_head_dim {
            return bad(format!(
                "A_log holds head_dim ({}) entries but there are {} KDA heads",
                self.kda_head_dim, self.kda_num_heads
            ));
        }
        if self.num_experts_per_token > self.num_experts || self.num_hidden_layers < 2 {
            return bad("needs top-k ≤ experts and at least 2 layers".into());
        }
        if !self
            .vt_qkv_hidden_size
            .is_multiple_of(self.vt_num_attention_heads)
            || !(self.vt_qkv_hidden_size / self.vt_num_attention_heads).is_multiple_of(4)
        {
            return bad("vision head dim must be an integer multiple of 4 (2D RoPE)".into());
        }
        Ok(())
    }
}

/// `text_config` of a synthesized K3: every key of reference §1.5.
pub fn k3_text_config(s: &K3Shape) -> Value {
    json!({
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "head_dim": s.hidden_size / s.num_attention_heads,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_attention_heads,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        // K3 spells the context length `max_position_embeddings` (Kimi-Linear:
        // `model_max_length`); writing both trips loaders that alias one to the other.
        "max_position_embeddings": 1_048_576,
        "tie_word_embeddings": false,
        "q_lora_rank": s.q_lora_rank,
        "kv_lora_rank": s.kv_lora_rank,
        "qk_nope_head_dim": s.qk_nope_head_dim,
        "qk_rope_head_dim": s.qk_rope_head_dim,
        "v_head_dim": s.v_head_dim,
        "mla_use_nope": true,
        "mla_use_output_gate": true,
        "num_experts": s.num_experts,
        "num_experts_per_token": s.num_experts_per_token,
        "num_shared_experts": s.num_shared_experts,
        "moe_intermediate_size": s.moe_intermediate_size,
        "routed_expert_hidden_size": s.routed_expert_hidden_size,
        "latent_moe_use_norm": true,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": true,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "use_grouped_topk": true,
        "num_expert_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
        "attn_res_block_size": s.attn_res_block_size,
        "linear_attn_config": {
            "kda_layers": s.kda_layers(),
            "full_attn_layers": s.full_attn_layers(),
            "num_heads": s.kda_num_heads,
            "head_dim": s.kda_head_dim,
            "short_conv_kernel_size": s.short_conv_kernel_size,
            "use_full_rank_gate": true,
            "gate_lower_bound": -5.0,
        },
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "bfloat16",
    })
}

/// `vision_config` of a synthesized K3: MoonViT3d keys (§3.2, §3.5).
/// **[uncertain]** `model_type` and `mlp_type` values; the rest are K3's.
pub fn k3_vision_config(s: &K3Shape) -> Value {
    json!({
        "model_type": "moonvit3d",
        "patch_size": 14,
        "init_pos_emb_height": s.vt_pos_emb_size,
        "init_pos_emb_width": s.vt_pos_emb_size,
        "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "pos_emb_interpolation_mode": "bilinear",
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "video_attn_type": "spatial_temporal",
        "vt_hidden_size": s.vt_hidden_size,
        "vt_num_hidden_layers": s.vt_num_hidden_layers,
        "vt_num_attention_heads": s.vt_num_attention_heads,
        "vt_intermediate_size": s.vt_intermediate_size,
        "qkv_hidden_size": s.vt_qkv_hidden_size,
        "norm_type": "rmsnorm",
        "attn_bias": false,
        "linear_bias": false,
        "patch_embed_proj_bias": false,
        "mlp_type": "mlp",
        "activation_func": "gelu_pytorch_tanh",
        "mm_projector_type": "patchmergerv2",
        "mm_hidden_size": s.vt_hidden_size,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
        "text_hidden_size": s.hidden_size,
    })
}

/// The whole `config.json` of a synthesized K3 (wrapper + text + vision +
/// MXFP4 `quantization_config` + [`SYNTH_VERSION`]).
pub fn k3_config(s: &K3Shape, seed: u64) -> Value {
    let ignore: Vec<String> = [
        "language_model.lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*\\.mlp\\..*",
        "re:vision_tower.*",
        "re:mm_projector.*",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let preset = if *s == K3Shape::tiny() {
        "tiny"
    } else if *s == K3Shape::small() {
        "small"
    } else {
        "custom"
    };
    json!({
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": k3_text_config(s),
        "vision_config": k3_vision_config(s),
        "media_placeholder_token_id": MEDIA_PAD_ID,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "quantization_config": crate::convert::quantize::quantization_config(true, &ignore, &[]),
        "synth_version": SYNTH_VERSION,
        "synth": {"generator": "caracal synth", "arch": "kimi_k3", "preset": preset, "seed": seed,
                  "note": "random weights with Kimi K3's layout; not a trained model"},
    })
}
