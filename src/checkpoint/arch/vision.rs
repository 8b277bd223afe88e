//! The `vision_config` of a MoonViT3d tower (Kimi K2.5 / K2.6 / K3) and its
//! projector, parsed once and validated like the text keys.
//!
//! Both spellings are read (reference `kimi-architecture.md` §3.2, §3.5):
//! - published (Moonshot's remote code): `vt_hidden_size`,
//!   `vt_num_hidden_layers`, `vt_num_attention_heads`, `vt_intermediate_size`,
//!   `init_pos_emb_{height,width,time}`, `mm_projector_type`,
//!   `projector_ln_eps`, `media_placeholder_token_id` (top level or in
//!   `vision_config`), and K3's `qkv_hidden_size`, `norm_type`, `attn_bias`,
//!   `linear_bias`, `patch_embed_proj_bias`, `activation_func`,
//!   `pos_emb_interpolation_mode`;
//! - transformers 5.x `Kimi_K25Config`: `hidden_size`, `num_hidden_layers`,
//!   `num_attention_heads`, `intermediate_size`, `pos_emb_{height,width,time}`,
//!   `hidden_act`, `rope_parameters.rope_theta`, and at the top level
//!   `image_token_id`, `projection_hidden_size`, `projection_layer_norm_eps`.
//!
//! Missing keys take the K2.5 defaults (transformers' config class does the
//! same). Every error names the key and its value.

use serde_json::Value;

use crate::error::{Error, Result};

/// Default placeholder id: `<|media_pad|>` of the Kimi tokenizers.
pub const MEDIA_PAD_ID: u32 = 163_605;

/// Most tower blocks a config may declare (K2.5/K3 have 27).
pub const MAX_VISION_LAYERS: usize = 1024;

/// Norm of the tower blocks (`norm_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionNorm {
    /// `nn.LayerNorm` with weight and bias (K2.5).
    LayerNorm,
    /// RMSNorm, weight only (K3).
    RmsNorm,
}

/// A GELU flavour (`hidden_act`, `activation_func`, `projector_hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gelu {
    /// `gelu_pytorch_tanh` (the tower MLP).
    Tanh,
    /// Exact erf GELU (`gelu`, the projector).
    Erf,
}

impl Gelu {
    fn parse(key: &str, name: &str) -> Result<Gelu> {
        match name {
            "gelu_pytorch_tanh" | "gelu_tanh" | "gelu_new" => Ok(Gelu::Tanh),
            "gelu" => Ok(Gelu::Erf),
            other => bad(format!(
                "`{key}` must be `gelu_pytorch_tanh` or `gelu`, got `{other}`"
            )),
        }
    }
}

/// How the learned position grid is resampled (`pos_emb_interpolation_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PosInterpolation {
    /// `F.interpolate(mode="bicubic", align_corners=False)` (K2.5 default).
    Bicubic,
    /// `F.interpolate(mode="bilinear", align_corners=False)` (K3).
    Bilinear,
}

/// The projector after the patch merger (`mm_projector_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProjectorKind {
    /// K2.5 `patchmerger`: LayerNorm(d) per patch → Linear(4d→4d) → GELU →
    /// Linear(4d→text), with biases.
    PatchMerger,
    /// K3 `patchmergerv2`: Linear → GELU → Linear without biases, then
    /// RMSNorm(text) (`post_norm`).
    PatchMergerV2,
}

/// A validated MoonViT3d `vision_config`.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// Pixels per patch side (14).
    pub patch_size: usize,
    /// Rows of the learned position grid (64).
    pub pos_emb_height: usize,
    /// Columns of the learned position grid (64).
    pub pos_emb_width: usize,
    /// Frames of the fixed time embedding, also the most frames per chunk (4).
    pub pos_emb_time: usize,
    /// Tower width (K2.5 1152, K3 1024).
    pub hidden: usize,
    /// Tower blocks (27).
    pub layers: usize,
    /// Attention heads (K2.5 16, K3 12).
    pub heads: usize,
    /// q = k = v width (`qkv_hidden_size`; K3 1536, else `hidden`).
    pub qkv_hidden: usize,
    /// MLP width (K2.5 4304, K3 4096).
    pub intermediate: usize,
    /// Spatial merge per side (`merge_kernel_size` `[2, 2]`).
    pub merge: usize,
    /// Norm of the blocks and of `final_layernorm`.
    pub norm: VisionNorm,
    /// eps of the tower norms (1e-5, transformers' `nn.LayerNorm(eps=1e-5)`).
    pub norm_eps: f32,
    /// Biases on `wqkv` / `wo` (`attn_bias`).
    pub attn_bias: bool,
    /// Biases on the MLP (`linear_bias`).
    pub linear_bias: bool,
    /// Bias on the patch-embedding conv (`patch_embed_proj_bias`).
    pub patch_bias: bool,
    /// Tower MLP activation.
    pub act: Gelu,
    /// Position-grid resampling.
    pub interpolation: PosInterpolation,
    /// 2D RoPE base (`rope_parameters.rope_theta`, 10000).
    pub rope_theta: f32,
    /// Projector variant.
    pub projector: ProjectorKind,
    /// Projector activation (`projector_hidden_act`, erf GELU).
    pub projector_act: Gelu,
    /// eps of the projector norm (`projector_ln_eps` /
    /// `projection_layer_norm_eps`, 1e-5).
    pub projector_eps: f32,
    /// Text model width: the projector's output.
    pub text_hidden: usize,
    /// The placeholder id media tokens are expanded to.
    pub placeholder_id: u32,
}

fn bad<T>(m: String) -> Result<T> {
    Err(Error::Config(format!("config.json: vision_config: {m}")))
}

/// Reads keys from `vision_config`, falling back to the top level.
struct Keys<'a> {
    v: &'a Value,
    top: &'a Value,
}

impl Keys<'_> {
    fn raw(&self, names: &[&str]) -> Option<(String, &Value)> {
        names.iter().find_map(|n| {
            self.v
                .get(*n)
                .or_else(|| self.top.get(*n))
                .filter(|x| !x.is_null())
                .map(|x| (n.to_string(), x))
        })
    }

    fn usize(&self, names: &[&str], default: usize) -> Result<usize> {
        match self.raw(names) {
            None => Ok(default),
            Some((k, x)) => match x.as_u64() {
                Some(n) => Ok(n as usize),
                None => bad(format!("`{k}` must be a non-negative integer, got {x}")),
            },
        }
    }

    fn positive(&self, names: &[&str], default: usize) -> Result<usize> {
        let n = self.usize(names, default)?;
        if n == 0 {
            return bad(format!("`{}` must be >= 1, got 0", names[0]));
        }
        Ok(n)
    }

    fn flag(&self, name: &str, default: bool) -> Result<bool> {
        match self.raw(&[name]) {
            None => Ok(default),
            Some((k, x)) => x
                .as_bool()
                .map_or_else(|| bad(format!("`{k}` must be true or false, got {x}")), Ok),
        }
    }

    fn str(&self, names: &[&str], default: &str) -> Result<String> {
        match self.raw(names) {
            None => Ok(default.to_string()),
            Some((k, x)) => x
                .as_str()
                .map(str::to_string)
                .map_or_else(|| bad(format!("`{k}` must be a string, got {x}")), Ok),
        }
    }

    fn eps(&self, names: &[&str], default: f32) -> Result<f32> {
        match self.raw(names) {
            None => Ok(default),
            Some((k, x)) => match x.as_f64() {
                Some(e) if e > 0.0 && e.is_finite() => Ok(e as f32),
                _ => bad(format!("`{k}` must be a positive number, got {x}")),
            },
        }
    }
}

impl VisionConfig {
    /// Parses the `vision_config` of `config` (a `kimi_k25` / `kimi_k3`
    /// wrapper) for a text model of width `text_hidden`. `Ok(None)` when the
    /// config has no `vision_config` object.
    pub fn from_config(config: &Value, text_hidden: usize) -> Result<Option<VisionConfig>> {
        let Some(v) = config.get("vision_config").filter(|v| v.is_object()) else {
            return Ok(None);
        };
        let k = Keys { v, top: config };
        let hidden = k.positive(&["vt_hidden_size", "hidden_size"], 1152)?;
        let heads = k.positive(&["vt_num_attention_heads", "num_attention_heads"], 16)?;
        let qkv_hidden = k.positive(&["qkv_hidden_size"], hidden)?;
        let layers = k.positive(&["vt_num_hidden_layers", "num_hidden_layers"], 27)?;
        if layers > MAX_VISION_LAYERS {
            return bad(format!(
                "`vt_num_hidden_layers` must be <= {MAX_VISION_LAYERS}, got {layers}"
            ));
        }
        if !qkv_hidden.is_multiple_of(heads) || !(qkv_hidden / heads).is_multiple_of(4) {
            return bad(format!(
                "the head width `qkv_hidden_size` / `vt_num_attention_heads` ({qkv_hidden} / {heads}) \
                 must be a whole multiple of 4 (2D RoPE rotates pairs along two axes)"
            ));
        }
        let merge = match v.get("merge_kernel_size") {
            None | Some(Value::Null) => 2,
            Some(Value::Array(m))
                if m.len() == 2 && m[0].as_u64().is_some_and(|a| a >= 1) && m[0] == m[1] =>
            {
                m[0].as_u64().unwrap_or(2) as usize
            }
            Some(Value::Number(n)) if n.as_u64().is_some_and(|a| a >= 1) => {
                n.as_u64().unwrap_or(2) as usize
            }
            Some(x) => {
                return bad(format!(
                    "`merge_kernel_size` must be a square kernel like [2, 2], got {x}"
                ))
            }
        };
        let norm = match k.str(&["norm_type"], "layernorm")?.as_str() {
            "layernorm" | "layer_norm" => VisionNorm::LayerNorm,
            "rmsnorm" | "rms_norm" => VisionNorm::RmsNorm,
            other => {
                return bad(format!(
                    "`norm_type` must be `layernorm` or `rmsnorm`, got `{other}`"
                ))
            }
        };
        let interpolation = match k.str(&["pos_emb_interpolation_mode"], "bicubic")?.as_str() {
            "bicubic" => PosInterpolation::Bicubic,
            "bilinear" => PosInterpolation::Bilinear,
            other => {
                return bad(format!(
                    "`pos_emb_interpolation_mode` must be `bicubic` or `bilinear`, got `{other}`"
                ))
            }
        };
        for (key, want) in [
            ("pos_emb_type", "divided_fixed"),
            ("merge_type", "sd2_tpool"),
            ("video_attn_type", "spatial_temporal"),
        ] {
            let got = k.str(&[key], want)?;
            if got != want {
                return bad(format!("`{key}` must be `{want}`, got `{got}`"));
            }
        }
        let projector = match k.str(&["mm_projector_type"], "patchmerger")?.as_str() {
            "patchmerger" => ProjectorKind::PatchMerger,
            "patchmergerv2" => ProjectorKind::PatchMergerV2,
            other => {
                return bad(format!(
                    "`mm_projector_type` must be `patchmerger` or `patchmergerv2`, got `{other}`"
                ))
            }
        };
        // `mm_hidden_size` is the tower width in K2.5's config and the merged
        // width (4·hidden) in K3's; either is consistent.
        let mm = k.usize(&["mm_hidden_size"], hidden)?;
        if mm != hidden && mm != hidden * merge * merge {
            return bad(format!(
                "`mm_hidden_size` ({mm}) must equal `vt_hidden_size` ({hidden}) or the merged width ({})",
                hidden * merge * merge
            ));
        }
        let proj_hidden = k.usize(&["projection_hidden_size"], hidden)?;
        if proj_hidden != hidden {
            return bad(format!(
                "`projection_hidden_size` ({proj_hidden}) must equal the tower width `hidden_size` ({hidden})"
            ));
        }
        let text = k.usize(&["text_hidden_size"], text_hidden)?;
        if text != text_hidden {
            return bad(format!(
                "`text_hidden_size` ({text}) must equal the text model's `hidden_size` ({text_hidden})"
            ));
        }
        let placeholder = k.usize(
            &["media_placeholder_token_id", "image_token_id"],
            MEDIA_PAD_ID as usize,
        )?;
        let placeholder_id = u32::try_from(placeholder).map_or_else(
            |_| {
                bad(format!(
                    "`media_placeholder_token_id` must fit in 32 bits, got {placeholder}"
                ))
            },
            Ok,
        )?;
        let rope_theta = match v.get("rope_parameters").and_then(|r| r.get("rope_theta")) {
            None | Some(Value::Null) => 10000.0,
            Some(x) => match x.as_f64() {
                Some(t) if t > 1.0 && t.is_finite() => t as f32,
                _ => {
                    return bad(format!(
                        "`rope_parameters.rope_theta` must be a number > 1, got {x}"
                    ))
                }
            },
        };
        Ok(Some(VisionConfig {
            patch_size: k.positive(&["patch_size"], 14)?,
            pos_emb_height: k.positive(&["init_pos_emb_height", "pos_emb_height"], 64)?,
            pos_emb_width: k.positive(&["init_pos_emb_width", "pos_emb_width"], 64)?,
            pos_emb_time: k.positive(&["init_pos_emb_time", "pos_emb_time"], 4)?,
            hidden,
            layers,
            heads,
            qkv_hidden,
            intermediate: k.positive(&["vt_intermediate_size", "intermediate_size"], 4304)?,
            merge,
            norm,
            norm_eps: 1e-5,
            attn_bias: k.flag("attn_bias", true)?,
            linear_bias: k.flag("linear_bias", true)?,
            patch_bias: k.flag("patch_embed_proj_bias", true)?,
            act: Gelu::parse(
                "activation_func",
                &k.str(&["activation_func", "hidden_act"], "gelu_pytorch_tanh")?,
            )?,
            interpolation,
            rope_theta,
            projector,
            projector_act: Gelu::parse(
                "projector_hidden_act",
                &k.str(&["projector_hidden_act"], "gelu")?,
            )?,
            projector_eps: k.eps(&["projector_ln_eps", "projection_layer_norm_eps"], 1e-5)?,
            text_hidden,
            placeholder_id,
        }))
    }

    /// Per-head width (`qkv_hidden / heads`).
    pub fn head_dim(&self) -> usize {
        self.qkv_hidden / self.heads
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Option<VisionConfig>> {
        VisionConfig::from_config(&v, 64)
    }

    #[test]
    fn both_spellings_give_the_same_config() {
        let published = json!({"media_placeholder_token_id": 7, "vision_config": {
            "vt_hidden_size": 32, "vt_num_hidden_layers": 2, "vt_num_attention_heads": 2,
            "vt_intermediate_size": 64, "init_pos_emb_height": 10, "init_pos_emb_width": 10,
            "init_pos_emb_time": 4, "mm_hidden_size": 32, "text_hidden_size": 64,
            "projector_ln_eps": 1e-5}});
        let hf = json!({"image_token_id": 7, "projection_hidden_size": 32,
            "projection_layer_norm_eps": 1e-5, "vision_config": {
            "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "pos_emb_height": 10, "pos_emb_width": 10, "pos_emb_time": 4,
            "hidden_act": "gelu_pytorch_tanh", "rope_parameters": {"rope_theta": 10000.0}}});
        let a = parse(published).unwrap().unwrap();
        assert_eq!(a, parse(hf).unwrap().unwrap());
        assert_eq!((a.head_dim(), a.placeholder_id, a.merge), (16, 7, 2));
        assert_eq!(parse(json!({})).unwrap(), None);
    }

    #[test]
    fn bad_vision_keys_are_named() {
        for (v, key) in [
            (
                json!({"vt_hidden_size": 32, "vt_num_attention_heads": 16}),
                "qkv_hidden_size",
            ),
            (json!({"vt_hidden_size": 0}), "vt_hidden_size"),
            (json!({"norm_type": "batchnorm"}), "norm_type"),
            (json!({"mm_projector_type": "mlp"}), "mm_projector_type"),
            (json!({"merge_kernel_size": [2, 3]}), "merge_kernel_size"),
            (
                json!({"pos_emb_interpolation_mode": "nearest"}),
                "pos_emb_interpolation_mode",
            ),
            (json!({"text_hidden_size": 65}), "text_hidden_size"),
            (
                json!({"vt_num_hidden_layers": "two"}),
                "vt_num_hidden_layers",
            ),
            (json!({"activation_func": "relu"}), "activation_func"),
            (json!({"merge_type": "avgpool"}), "merge_type"),
        ] {
            let err = parse(json!({ "vision_config": v }))
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
    }
}
