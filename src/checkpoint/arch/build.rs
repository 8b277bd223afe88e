//! From `config.json` to [`Arch`]: the serde structs of [`super::keys`] per
//! family, the layer-kind rules, the checks against a checkpoint's tensor
//! headers, and `quantization_config`.

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::keys::{DeepseekV3Config, K3Extensions, KimiLinearConfig, LlamaConfig, LlamaMoeConfig};
use super::vision::VisionConfig;
use super::SUPPORTED_MODEL_TYPES;
use super::{
    ALogLayout, Arch, AttentionKind, GluAct, GqaDims, KdaDims, LayerKind, MlaDims, MlpKind,
    ModelType, MoeDims, QuantGroup, QuantMethod, Quantization, RopeSettings, RouterKeyNames,
    RouterSettings, MAX_LAYERS,
};
use crate::checkpoint::config::{defaults, rope_from_config};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// `config.json: {m}` as a config error.
fn bad<T>(m: String) -> Result<T> {
    Err(Error::Config(format!("config.json: {m}")))
}

/// Deserialises `value` into a family's keys; serde's message names the key.
fn keys<T: DeserializeOwned>(value: &Value) -> Result<T> {
    serde_json::from_value(value.clone()).map_err(|e| Error::Config(format!("config.json: {e}")))
}

/// `value` must be at least 1.
fn positive(key: &str, value: usize) -> Result<()> {
    if value == 0 {
        return bad(format!("`{key}` must be >= 1, got 0"));
    }
    Ok(())
}

/// A non-null key as u64.
fn num(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(|x| x.as_u64())
}

/// Which model type a config describes, and where its text keys are.
fn model_type(config: &Value) -> Result<(ModelType, &Value, bool)> {
    let found = config
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    let wrapped = config.get("text_config").filter(|v| v.is_object());
    if let Some(t) = ModelType::from_name(found) {
        return Ok(match t {
            ModelType::KimiK3 | ModelType::KimiK25 => {
                (t, super::text_config(config), wrapped.is_some())
            }
            _ => (t, config, false),
        });
    }
    // A multimodal wrapper Caracal does not know by name, around a text
    // decoder it does (the planner reads such configs).
    if let Some(text) = wrapped {
        let inner = text
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        if let Some(t) = ModelType::from_name(inner)
            .filter(|t| !matches!(t, ModelType::KimiK3 | ModelType::KimiK25))
        {
            return Ok((t, text, true));
        }
    }
    Err(Error::UnknownModelType {
        found: if found.is_empty() {
            "(missing)".into()
        } else {
            found.into()
        },
        supported: SUPPORTED_MODEL_TYPES.join(", "),
    })
}

/// The fields every family sets, before the layer list is built.
struct Common {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    layers: usize,
}

/// Checks `c` against the checkpoint headers (or, without one, against
/// [`MAX_LAYERS`]) before any per-layer vector exists.
fn check_sizes(c: &Common, ckpt: Option<&Checkpoint>, root: &str) -> Result<()> {
    positive("vocab_size", c.vocab_size)?;
    positive("hidden_size", c.hidden_size)?;
    positive("num_hidden_layers", c.layers)?;
    match ckpt {
        Some(ckpt) => {
            let have = checkpoint_layers(ckpt, root);
            if c.layers > have {
                return Err(Error::Config(format!(
                    "config.json says {} layers but the checkpoint has tensors for {have}",
                    c.layers
                )));
            }
            let embed = format!("{root}model.embed_tokens.weight");
            if let Ok(e) = ckpt.entry(&embed) {
                if e.shape != [c.vocab_size, c.hidden_size] {
                    return Err(Error::Config(format!(
                        "config.json says vocab_size {} and hidden_size {} but `{embed}` is {:?}",
                        c.vocab_size, c.hidden_size, e.shape
                    )));
                }
            }
        }
        None if c.layers > MAX_LAYERS => {
            return bad(format!(
                "`num_hidden_layers` must be <= {MAX_LAYERS}, got {}",
                c.layers
            ))
        }
        None => {}
    }
    Ok(())
}

/// The module of `{root}model.` holding the decoder layers: `layers`, or
/// `blocks` when only that spelling has tensors (transformers' `kimi_k25`
/// save).
fn layers_module(ckpt: Option<&Checkpoint>, root: &str) -> &'static str {
    let (layers, blocks) = (
        format!("{root}model.layers."),
        format!("{root}model.blocks."),
    );
    match ckpt {
        Some(c) => {
            let names = c.names();
            if !names.iter().any(|n| n.starts_with(&layers))
                && names.iter().any(|n| n.starts_with(&blocks))
            {
                "blocks"
            } else {
                "layers"
            }
        }
        None => "layers",
    }
}

/// Decoder layers the checkpoint has tensors for: one past the largest `N`
/// of `{root}model.layers.N.*` (or `…model.blocks.N.*`).
fn checkpoint_layers(ckpt: &Checkpoint, root: &str) -> usize {
    let head = format!("{root}model.{}.", layers_module(Some(ckpt), root));
    ckpt.names()
        .iter()
        .filter_map(|n| n.strip_prefix(head.as_str()))
        .filter_map(|rest| rest.split('.').next()?.parse::<usize>().ok())
        .map(|i| i + 1)
        .max()
        .unwrap_or(0)
}

/// Parses `config` (checked against `ckpt` when given).
pub(super) fn parse(config: &Value, ckpt: Option<&Checkpoint>) -> Result<Arch> {
    let (model_type, text, wrapped) = model_type(config)?;
    let root = match ckpt {
        Some(c) if c.has("language_model.model.embed_tokens.weight") => "language_model.",
        Some(_) => "",
        None if wrapped => "language_model.",
        None => "",
    }
    .to_string();
    let mut arch = match model_type.family() {
        super::Family::Llama => llama(text, ckpt, &root)?,
        super::Family::DeepseekV3 => deepseek_v3(text, ckpt, &root)?,
        super::Family::KimiLinear => kimi(text, model_type, ckpt, &root)?,
    };
    arch.model_type = model_type;
    arch.root = root;
    arch.mlp_bias = text
        .get("mlp_bias")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    arch.mtp_layers = num(text, "num_nextn_predict_layers").unwrap_or(0) as usize;
    arch.quantization = quantization(
        config
            .get("quantization_config")
            .or_else(|| text.get("quantization_config"))
            .filter(|v| !v.is_null()),
    );
    arch.vision = config.get("vision_config").is_some_and(|v| v.is_object());
    arch.layers_module = layers_module(ckpt, &arch.root).to_string();
    if matches!(model_type, ModelType::KimiK25 | ModelType::KimiK3) {
        arch.vision_config = VisionConfig::from_config(config, arch.hidden_size)?;
    }
    check_dims(&arch)?;
    Ok(arch)
}

/// Largest width, head count, expert count or vocabulary a config may
/// declare: 2^24 (16,777,216; the largest published, vocabularies, are
/// near 2^18). Bounded so that sums and products of two dims, which the
/// loaders and planners compute, cannot overflow.
pub const MAX_DIM: usize = 1 << 24;

/// Longest context a config may declare: 2^30 tokens.
pub const MAX_CONTEXT: usize = 1 << 30;

/// Refuses dims past [`MAX_DIM`] (and a context past [`MAX_CONTEXT`]),
/// naming the key.
fn check_dims(a: &Arch) -> Result<()> {
    let mut dims: Vec<(&str, usize)> = vec![
        ("vocab_size", a.vocab_size),
        ("hidden_size", a.hidden_size),
        ("intermediate_size", a.intermediate_size),
        ("num_nextn_predict_layers", a.mtp_layers),
    ];
    if let Some(g) = &a.gqa {
        dims.extend([
            ("num_attention_heads", g.heads),
            ("num_key_value_heads", g.kv_heads),
            ("head_dim", g.head_dim),
        ]);
    }
    if let Some(m) = &a.mla {
        dims.extend([
            ("num_attention_heads", m.heads),
            ("q_lora_rank", m.q_lora_rank.unwrap_or(0)),
            ("kv_lora_rank", m.kv_lora_rank),
            ("qk_nope_head_dim", m.qk_nope_head_dim),
            ("qk_rope_head_dim", m.qk_rope_head_dim),
            ("v_head_dim", m.v_head_dim),
        ]);
    }
    if let Some(k) = &a.kda {
        dims.extend([
            ("linear_attn_config.num_heads", k.heads),
            ("linear_attn_config.head_dim", k.head_dim),
            ("linear_attn_config.short_conv_kernel_size", k.conv_kernel),
        ]);
    }
    if let Some(m) = &a.moe {
        dims.extend([
            ("n_routed_experts", m.experts),
            ("n_shared_experts", m.shared),
            ("moe_intermediate_size", m.intermediate),
            ("routed_expert_hidden_size", m.latent.unwrap_or(0)),
        ]);
    }
    if let Some(b) = a.attn_res_block_size {
        dims.push(("attn_res_block_size", b));
    }
    if let Some((key, v)) = dims.into_iter().find(|&(_, v)| v > MAX_DIM) {
        return bad(format!("`{key}` must be <= {MAX_DIM}, got {v}"));
    }
    if a.max_position > MAX_CONTEXT {
        return bad(format!(
            "`max_position_embeddings` must be <= {MAX_CONTEXT}, got {}",
            a.max_position
        ));
    }
    Ok(())
}

/// An [`Arch`] with the shared fields set; the caller fills in the rest.
fn base(model_type: ModelType, c: &Common, act: GluAct, layers: Vec<LayerKind>) -> Arch {
    Arch {
        model_type,
        family: model_type.family(),
        root: String::new(),
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        max_position: 0,
        rms_norm_eps: 0.0,
        tie_word_embeddings: false,
        act,
        layers,
        gqa: None,
        mla: None,
        kda: None,
        moe: None,
        rope: None,
        attn_res_block_size: None,
        mlp_bias: false,
        mtp_layers: 0,
        quantization: quantization(None),
        vision: false,
        vision_config: None,
        layers_module: "layers".into(),
    }
}

/// MoE layer rule without a per-layer list.
fn moe_rule(i: usize, first_dense: usize, freq: usize) -> MlpKind {
    if i >= first_dense && i.is_multiple_of(freq) {
        MlpKind::Moe
    } else {
        MlpKind::Dense
    }
}

fn rope(config: &Value, dim: usize, key: &str) -> Result<RopeSettings> {
    if dim < 2 || !dim.is_multiple_of(2) {
        return bad(format!(
            "`{key}` must be even and >= 2 (RoPE rotates pairs), got {dim}"
        ));
    }
    let (theta, scaling) = rope_from_config(config, defaults::theta_10k())?;
    Ok(RopeSettings { theta, scaling })
}

fn llama(v: &Value, ckpt: Option<&Checkpoint>, root: &str) -> Result<Arch> {
    let c: LlamaConfig = keys(v)?;
    let common = Common {
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        layers: c.num_hidden_layers,
    };
    check_sizes(&common, ckpt, root)?;
    let heads = c.num_attention_heads;
    positive("num_attention_heads", heads)?;
    let kv_heads = c.num_key_value_heads.unwrap_or(heads);
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return bad(format!(
            "`num_key_value_heads` must divide `num_attention_heads` ({heads}), got {kv_heads}"
        ));
    }
    let head_dim = match c.head_dim {
        Some(h) => h,
        None if c.hidden_size.is_multiple_of(heads) => c.hidden_size / heads,
        None => {
            return bad(format!(
                "`hidden_size` ({}) must be divisible by `num_attention_heads` ({heads}) when `head_dim` is absent",
                c.hidden_size
            ))
        }
    };
    let moe = if v.get("n_routed_experts").is_some_and(|x| !x.is_null()) {
        let m: LlamaMoeConfig = keys(v)?;
        Some((m.router_settings()?, m))
    } else {
        None
    };
    let layers = (0..c.num_hidden_layers)
        .map(|i| LayerKind {
            attention: AttentionKind::Gqa,
            mlp: match &moe {
                Some((_, m)) => moe_rule(i, m.first_k_dense_replace, m.moe_layer_freq),
                None => MlpKind::Dense,
            },
        })
        .collect();
    let mut a = base(
        ModelType::Llama,
        &common,
        GluAct::from_name(&c.hidden_act)?,
        layers,
    );
    a.max_position = c.max_position_embeddings;
    a.rms_norm_eps = c.rms_norm_eps;
    a.tie_word_embeddings = c.tie_word_embeddings;
    a.rope = Some(rope(v, head_dim, "head_dim")?);
    a.gqa = Some(GqaDims {
        heads,
        kv_heads,
        head_dim,
        bias: c.attention_bias,
    });
    a.moe = moe.map(|(router, m)| MoeDims {
        experts: m.n_routed_experts,
        shared: m.n_shared_experts,
        intermediate: m.moe_intermediate_size,
        latent: None,
        latent_norm: false,
        router,
    });
    Ok(a)
}

fn deepseek_v3(v: &Value, ckpt: Option<&Checkpoint>, root: &str) -> Result<Arch> {
    let c: DeepseekV3Config = keys(v)?;
    let common = Common {
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        layers: c.num_hidden_layers,
    };
    check_sizes(&common, ckpt, root)?;
    positive("num_attention_heads", c.num_attention_heads)?;
    positive("kv_lora_rank", c.kv_lora_rank)?;
    positive("moe_layer_freq", c.moe_layer_freq)?;
    let router = RouterSettings::new(
        &RouterKeyNames::DEEPSEEK,
        &c.scoring_func,
        c.n_routed_experts,
        c.num_experts_per_tok,
        c.n_group,
        c.topk_group,
        c.norm_topk_prob,
        c.routed_scaling_factor,
    )?;
    let layers = (0..c.num_hidden_layers)
        .map(|i| LayerKind {
            attention: AttentionKind::Mla,
            mlp: moe_rule(i, c.first_k_dense_replace, c.moe_layer_freq),
        })
        .collect();
    let mut a = base(
        ModelType::DeepseekV3,
        &common,
        GluAct::from_name(&c.hidden_act)?,
        layers,
    );
    a.max_position = c.max_position_embeddings;
    a.rms_norm_eps = c.rms_norm_eps;
    a.tie_word_embeddings = c.tie_word_embeddings;
    a.rope = Some(rope(v, c.qk_rope_head_dim, "qk_rope_head_dim")?);
    a.mla = Some(MlaDims {
        heads: c.num_attention_heads,
        q_lora_rank: c.q_lora_rank,
        kv_lora_rank: c.kv_lora_rank,
        qk_nope_head_dim: c.qk_nope_head_dim,
        qk_rope_head_dim: c.qk_rope_head_dim,
        v_head_dim: c.v_head_dim,
        nope: false,
        rope_interleave: c.rope_interleave,
        latent_norm_eps: 1e-6,
        output_gate: false,
    });
    a.moe = Some(MoeDims {
        experts: c.n_routed_experts,
        shared: c.n_shared_experts,
        intermediate: c.moe_intermediate_size,
        latent: None,
        latent_norm: false,
        router,
    });
    Ok(a)
}

/// A per-layer string list that must have one known entry per layer.
fn per_layer<'a>(
    key: &str,
    list: &'a Option<Vec<String>>,
    layers: usize,
    known: [&str; 2],
) -> Result<Option<&'a [String]>> {
    let Some(list) = list else { return Ok(None) };
    if list.len() != layers {
        return bad(format!(
            "`{key}` has {} entries but `num_hidden_layers` is {layers}",
            list.len()
        ));
    }
    if let Some(other) = list.iter().find(|t| !known.contains(&t.as_str())) {
        return bad(format!(
            "`{key}` entries must be `{}` or `{}`, got `{other}`",
            known[0], known[1]
        ));
    }
    Ok(Some(list))
}

/// Checks 1-based layer indices of `linear_attn_config.{key}`.
fn one_based(key: &str, list: &[usize], layers: usize) -> Result<()> {
    if let Some(l) = list.iter().find(|&&l| l == 0 || l > layers) {
        return bad(format!(
            "`linear_attn_config.{key}` entry {l} is outside 1..={layers}"
        ));
    }
    Ok(())
}

fn kimi(v: &Value, model_type: ModelType, ckpt: Option<&Checkpoint>, root: &str) -> Result<Arch> {
    let c: KimiLinearConfig = keys(v)?;
    let x: K3Extensions = keys(v)?;
    let k3 = model_type == ModelType::KimiK3;
    let n = c.num_hidden_layers;
    let common = Common {
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        layers: n,
    };
    check_sizes(&common, ckpt, root)?;
    positive("num_attention_heads", c.num_attention_heads)?;
    positive("kv_lora_rank", c.kv_lora_rank)?;
    positive("moe_layer_freq", x.moe_layer_freq)?;
    if k3 && x.attn_res_block_size == Some(0) {
        return bad("`attn_res_block_size` must be >= 1, got 0".into());
    }
    let lin = &c.linear_attn_config;
    one_based("kda_layers", &lin.kda_layers, n)?;
    one_based("full_attn_layers", &lin.full_attn_layers, n)?;
    let layer_types = per_layer(
        "layer_types",
        &c.layer_types,
        n,
        ["linear_attention", "full_attention"],
    )?;
    let mlp_types = per_layer(
        "mlp_layer_types",
        &c.mlp_layer_types,
        n,
        ["dense", "sparse"],
    )?;
    let is_kda = |i: usize| -> bool {
        if !lin.kda_layers.is_empty() {
            return lin.kda_layers.contains(&(i + 1));
        }
        if !lin.full_attn_layers.is_empty() {
            return !lin.full_attn_layers.contains(&(i + 1));
        }
        if let Some(types) = layer_types {
            return types[i] == "linear_attention";
        }
        // transformers' fallback: every 4th layer (1-based) is full attention.
        !(i > 0 && i.is_multiple_of(4))
    };
    let is_moe = |i: usize| -> MlpKind {
        match mlp_types {
            Some(types) if types[i] == "sparse" => MlpKind::Moe,
            Some(_) => MlpKind::Dense,
            None if c.num_experts == 0 => MlpKind::Dense,
            None => moe_rule(i, c.first_k_dense_replace, x.moe_layer_freq),
        }
    };
    let layers: Vec<LayerKind> = (0..n)
        .map(|i| LayerKind {
            attention: if is_kda(i) {
                AttentionKind::Kda
            } else {
                AttentionKind::Mla
            },
            mlp: is_moe(i),
        })
        .collect();
    let act = if k3 {
        GluAct::from_config(
            &c.hidden_act,
            x.activation_situ_beta,
            x.activation_situ_linear_beta,
        )?
    } else {
        GluAct::from_name(&c.hidden_act)?
    };
    let any_moe = layers.iter().any(|l| l.mlp == MlpKind::Moe);
    let mut a = base(model_type, &common, act, layers);
    a.max_position = c.model_max_length;
    a.rms_norm_eps = c.rms_norm_eps;
    a.tie_word_embeddings = c.tie_word_embeddings;
    a.mla = Some(MlaDims {
        heads: c.num_attention_heads,
        q_lora_rank: c.q_lora_rank,
        kv_lora_rank: c.kv_lora_rank,
        qk_nope_head_dim: c.qk_nope_head_dim,
        qk_rope_head_dim: c.qk_rope_head_dim,
        v_head_dim: c.v_head_dim,
        nope: c.mla_use_nope,
        rope_interleave: false,
        latent_norm_eps: if k3 { x.mla_latent_norm_eps } else { 1e-6 },
        output_gate: k3 && x.mla_use_output_gate,
    });
    positive("linear_attn_config.num_heads", lin.num_heads)?;
    positive("linear_attn_config.head_dim", lin.head_dim)?;
    positive(
        "linear_attn_config.short_conv_kernel_size",
        lin.short_conv_kernel_size,
    )?;
    a.kda = Some(KdaDims {
        heads: lin.num_heads,
        head_dim: lin.head_dim,
        conv_kernel: lin.short_conv_kernel_size,
        full_rank_gate: k3 && x.linear_attn_config.use_full_rank_gate,
        gate_lower_bound: x.linear_attn_config.gate_lower_bound.filter(|_| k3),
        a_log_layout: if k3 {
            x.linear_attn_config.a_log_layout
        } else {
            ALogLayout::PerHead
        },
    });
    if any_moe || c.num_experts > 0 {
        let router = RouterSettings::new(
            &RouterKeyNames::KIMI,
            &c.moe_router_activation_func,
            c.num_experts,
            c.num_experts_per_token,
            c.num_expert_group,
            c.topk_group,
            c.moe_renormalize,
            c.routed_scaling_factor,
        )?;
        let latent = x.routed_expert_hidden_size.filter(|_| k3);
        if latent == Some(0) {
            return bad("`routed_expert_hidden_size` must be >= 1, got 0".into());
        }
        a.moe = Some(MoeDims {
            experts: c.num_experts,
            shared: c.num_shared_experts,
            intermediate: c.moe_intermediate_size,
            latent,
            latent_norm: latent.is_some() && x.latent_moe_use_norm,
            router,
        });
    }
    if k3 {
        a.attn_res_block_size = x.attn_res_block_size;
    }
    Ok(a)
}

/// Reads `quantization_config` (method, compressed-tensors groups, ignore list).
fn quantization(q: Option<&Value>) -> Quantization {
    let Some(q) = q else {
        return Quantization {
            method: QuantMethod::None,
            groups: Vec::new(),
            ignore: Vec::new(),
            config: None,
        };
    };
    let method = if q.to_string().to_ascii_lowercase().contains("mxfp4") {
        QuantMethod::Mxfp4
    } else if q.get("quant_method").and_then(|m| m.as_str()) == Some("fp8") {
        QuantMethod::Fp8
    } else {
        QuantMethod::Other
    };
    let strings = |v: Option<&Value>| -> Vec<String> {
        v.and_then(|a| a.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    };
    let groups = q
        .get("config_groups")
        .and_then(|g| g.as_object())
        .map(|g| {
            g.iter()
                .map(|(name, group)| QuantGroup {
                    name: name.clone(),
                    format: group
                        .get("format")
                        .or_else(|| q.get("format"))
                        .and_then(|f| f.as_str())
                        .unwrap_or("")
                        .to_string(),
                    targets: strings(group.get("targets")),
                    num_bits: group.get("weights").and_then(|w| num(w, "num_bits")),
                })
                .collect()
        })
        .unwrap_or_default();
    Quantization {
        method,
        groups,
        ignore: strings(q.get("ignore")),
        config: Some(q.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_model_type_lists_supported_ones() {
        let err = model_type(&serde_json::json!({"model_type": "gpt_neox"}))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("gpt_neox") && err.contains("kimi_linear") && err.contains("llama"),
            "{err}"
        );
    }
}
