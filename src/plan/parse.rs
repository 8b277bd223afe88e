//! Config reading for the memory planner: the checkpoint's [`Arch`] (the
//! one description the loaders use too) into the planner's [`TextArch`],
//! `vision_config` keys into [`VisionArch`], and the built-in preset configs.

use serde_json::{json, Value};

use super::shape::{
    AttentionKind, GqaDims, KdaDims, MlaDims, MoeDims, ProjectorArch, TextArch, VisionArch,
};
use crate::checkpoint::arch::{Arch, MlpKind};
use crate::error::Result;

/// Reads config keys, skipping nulls, with alternative spellings.
struct Keys<'a>(&'a Value);

impl Keys<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }
    fn num(&self, keys: &[&str]) -> Option<u64> {
        keys.iter()
            .find_map(|k| self.get(k).and_then(|v| v.as_u64()))
    }
    fn or(&self, keys: &[&str], default: u64) -> u64 {
        self.num(keys).unwrap_or(default)
    }
    fn flag(&self, key: &str, default: bool) -> bool {
        self.get(key).and_then(|v| v.as_bool()).unwrap_or(default)
    }
    fn list(&self, key: &str) -> Option<Vec<u64>> {
        self.get(key)?
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
    }
}

/// The planner's view of a text decoder, from the checkpoint's [`Arch`].
pub(super) fn text_arch(a: &Arch) -> TextArch {
    let w = |v: usize| v as u64;
    let moe = a.moe.as_ref().map(|m| {
        let latent = m.latent.map(w).filter(|&l| l != w(a.hidden_size));
        MoeDims {
            experts: w(m.experts),
            top_k: w(m.router.top_k),
            shared: w(m.shared),
            intermediate: w(m.intermediate),
            latent,
            latent_norm: latent.is_some() && m.latent_norm,
        }
    });
    TextArch {
        family: a.family,
        hidden: w(a.hidden_size),
        vocab: w(a.vocab_size),
        layers: a.num_layers(),
        tie_embeddings: a.tie_word_embeddings,
        attention: a.layers.iter().map(|l| l.attention).collect(),
        moe_layers: a.layers.iter().map(|l| l.mlp == MlpKind::Moe).collect(),
        gqa: a.gqa.as_ref().map(|g| GqaDims {
            heads: w(g.heads),
            kv_heads: w(g.kv_heads),
            head_dim: w(g.head_dim),
            bias: g.bias,
        }),
        mla: a
            .mla
            .as_ref()
            .filter(|_| a.count(AttentionKind::Mla) > 0)
            .map(|m| MlaDims {
                heads: w(m.heads),
                q_lora_rank: m.q_lora_rank.map(w),
                kv_lora_rank: w(m.kv_lora_rank),
                qk_nope: w(m.qk_nope_head_dim),
                qk_rope: w(m.qk_rope_head_dim),
                v_head: w(m.v_head_dim),
                output_gate: m.output_gate,
            }),
        kda: a
            .kda
            .as_ref()
            .filter(|_| a.count(AttentionKind::Kda) > 0)
            .map(|k| KdaDims {
                heads: w(k.heads),
                head_dim: w(k.head_dim),
                conv_kernel: w(k.conv_kernel),
                full_rank_gate: k.full_rank_gate,
            }),
        moe,
        dense_intermediate: w(a.intermediate_size),
        mlp_bias: a.mlp_bias,
        attn_res_block: a.attn_res_block_size,
        max_position: w(a.max_position),
        mtp_layers: w(a.mtp_layers),
        prefix: format!("{}model.", a.root),
    }
}

/// Parses a MoonViT (`hidden_size`, …) or MoonViT3d (`vt_*`) vision config;
/// projector keys may sit in `vision_config` or at the top level.
pub(super) fn parse_vision(v: &Value, top: &Value, text_hidden: u64) -> Result<VisionArch> {
    let (k, tk) = (Keys(v), Keys(top));
    let hidden = k.or(&["vt_hidden_size", "hidden_size"], 1152);
    let merge: u64 = k
        .list("merge_kernel_size")
        .map(|m| m.iter().product())
        .unwrap_or(4)
        .max(1);
    let kind = [v, top]
        .iter()
        .find_map(|x| x.get("mm_projector_type").and_then(|s| s.as_str()))
        .unwrap_or("patchmerger")
        .to_string();
    let v2 = kind == "patchmergerv2";
    let norm = [v, top]
        .iter()
        .find_map(|x| x.get("norm_type").and_then(|s| s.as_str()))
        .unwrap_or("layernorm");
    Ok(VisionArch {
        hidden,
        layers: k.or(&["vt_num_hidden_layers", "num_hidden_layers"], 27),
        heads: k.or(&["vt_num_attention_heads", "num_attention_heads"], 16),
        qkv_hidden: k.or(&["qkv_hidden_size"], hidden),
        mlp: k.or(&["vt_intermediate_size", "intermediate_size"], 4304),
        patch: k.or(&["patch_size"], 14),
        pos_cells: k.or(&["init_pos_emb_height"], 64) * k.or(&["init_pos_emb_width"], 64),
        rms_norm: norm == "rmsnorm",
        attn_bias: k.flag("attn_bias", true),
        linear_bias: k.flag("linear_bias", true),
        patch_bias: k.flag("patch_embed_proj_bias", true),
        projector: ProjectorArch {
            input: k
                .num(&["mm_hidden_size"])
                .or(tk.num(&["mm_hidden_size"]))
                .unwrap_or(hidden * merge),
            output: k
                .num(&["text_hidden_size"])
                .or(tk.num(&["text_hidden_size"]))
                .unwrap_or(text_hidden),
            bias: !v2,
            pre_norm: !v2,
            post_norm: v2,
            kind,
        },
    })
}

/// Kimi K3 per reference §1.5 (TS `kimi_k3_config.py` defaults) and §3.2 (MoonViT3d).
pub(super) fn kimi_k3_config() -> Value {
    let full: Vec<u64> = (4..93).step_by(4).chain([93]).collect();
    let kda: Vec<u64> = (1..=93).filter(|l| !full.contains(l)).collect();
    json!({
        "model_type": "kimi_k3",
        "media_placeholder_token_id": 163605,
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "ignore": ["self_attn.*"]},
        "text_config": {
            "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 33792,
            "num_hidden_layers": 93, "num_attention_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": true,
            "mla_use_output_gate": true, "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
            "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": true,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "attn_res_block_size": 12, "hidden_act": "situ",
            "routed_scaling_factor": 1.0, "max_position_embeddings": 1048576, "tie_word_embeddings": false,
            "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 0,
            "linear_attn_config": {"kda_layers": kda, "full_attn_layers": full, "num_heads": 96, "head_dim": 128,
                "short_conv_kernel_size": 4, "use_full_rank_gate": true, "gate_lower_bound": -5.0}
        },
        "vision_config": {
            "vt_hidden_size": 1024, "vt_num_hidden_layers": 27, "vt_num_attention_heads": 12,
            "vt_intermediate_size": 4096, "qkv_hidden_size": 1536, "norm_type": "rmsnorm", "attn_bias": false,
            "linear_bias": false, "patch_embed_proj_bias": false, "patch_size": 14, "init_pos_emb_height": 64,
            "init_pos_emb_width": 64, "merge_kernel_size": [2, 2], "mm_projector_type": "patchmergerv2",
            "mm_hidden_size": 4096, "text_hidden_size": 7168
        }
    })
}

/// Kimi K2 per reference §4.3.
pub(super) fn kimi_k2_config() -> Value {
    json!({
        "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
        "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 2048,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "max_position_embeddings": 131072,
        "tie_word_embeddings": false, "num_nextn_predict_layers": 0,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}
    })
}

/// Kimi-Linear-48B-A3B per reference §1.5.
pub(super) fn kimi_linear_config() -> Value {
    json!({
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 27, "num_attention_heads": 32, "q_lora_rank": null, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": true,
        "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "model_max_length": 1048576, "tie_word_embeddings": false,
        "linear_attn_config": {"kda_layers": [1,2,3,5,6,7,9,10,11,13,14,15,17,18,19,21,22,23,25,26],
            "full_attn_layers": [4,8,12,16,20,24,27], "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4}
    })
}
