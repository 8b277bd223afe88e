//! The architecture the memory planner counts: [`PlanModel`], built from a
//! checkpoint's `config.json` (`llama`, `deepseek_v3`/`kimi_k2`,
//! `kimi_linear`, or a `kimi_k3`-style wrapper with `text_config` +
//! `vision_config`) or from a built-in preset, and expanded into
//! [`TensorSpec`]s: one per published tensor (experts folded into a count),
//! each tagged with the [`Component`] it belongs to.
//!
//! Tensor names follow the Hugging Face checkpoints (`model.layers.{i}.…`;
//! experts as `experts.{e}.…`), so a tiny checkpoint can be compared name by
//! name. K3's own names are per reference §1.6/§3.2/§4.1 and partly
//! **[uncertain]** (e.g. `mm_projector.post_norm`); counts do not depend on them.

use std::path::Path;

use serde::Serialize;
use serde_json::Value;

use super::parse::{kimi_k2_config, kimi_k3_config, kimi_linear_config, parse_vision, text_arch};
pub use super::shape::{
    AttentionKind, Component, Family, GqaDims, KdaDims, MlaDims, MoeDims, ProjectorArch,
    TensorKind, TensorSpec, TextArch, VisionArch,
};
use super::weights::WeightScheme;
use crate::checkpoint::arch::{Arch, QuantMethod};
use crate::checkpoint::config::read_json;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// Sizes read from the checkpoint's safetensors headers (no weights read).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StoredWeights {
    /// Tensors in all shards.
    pub tensors: usize,
    /// Stored elements (packed formats count bytes/ints, not weights).
    pub elements: u64,
    /// Tensor bytes.
    pub bytes: u64,
    /// Bytes by stored dtype, largest first.
    pub by_dtype: Vec<StoredDtype>,
}

/// Bytes of one stored dtype.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StoredDtype {
    /// The safetensors dtype (`bf16`, `f32`, `u8`, …).
    pub dtype: String,
    /// Tensor bytes in it.
    pub bytes: u64,
}

impl StoredWeights {
    /// Sums the header entries of an opened checkpoint.
    pub fn from_checkpoint(ckpt: &Checkpoint) -> Result<StoredWeights> {
        let mut by: std::collections::BTreeMap<String, u64> = Default::default();
        let (mut elements, mut bytes) = (0u64, 0u64);
        let names = ckpt.names();
        for name in &names {
            let e = ckpt.entry(name)?;
            elements += e.shape.iter().product::<usize>() as u64;
            bytes += e.len as u64;
            *by.entry(e.dtype.name().to_string()).or_default() += e.len as u64;
        }
        let mut by_dtype: Vec<StoredDtype> = by
            .into_iter()
            .map(|(dtype, bytes)| StoredDtype { dtype, bytes })
            .collect();
        by_dtype.sort_by_key(|d| std::cmp::Reverse(d.bytes));
        Ok(StoredWeights {
            tensors: names.len(),
            elements,
            bytes,
            by_dtype,
        })
    }
}

/// A published figure to check against the plan (e.g. an article's size claim).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PublishedFigure {
    /// Where it comes from and what it claims.
    pub label: String,
    /// The scheme it claims to describe.
    pub scheme: WeightScheme,
    /// The claimed whole-model bytes.
    pub bytes: f64,
}

/// Everything the planner needs to know about a model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanModel {
    /// Display name.
    pub name: String,
    /// Where it came from (`preset kimi-k3` or the folder).
    pub source: String,
    /// Top-level `model_type`.
    pub model_type: String,
    /// The text decoder.
    pub text: TextArch,
    /// The vision side, if any.
    pub vision: Option<VisionArch>,
    /// Name of the output projection tensor.
    pub lm_head_name: String,
    /// The scheme the checkpoint ships in (from `quantization_config`).
    pub native_weights: WeightScheme,
    /// Header sizes, when the folder has safetensors.
    pub stored: Option<StoredWeights>,
    /// Published figures to compare with.
    pub published: Vec<PublishedFigure>,
    /// Remarks found while reading the config.
    pub notes: Vec<String>,
}

/// Built-in presets.
pub const PRESETS: &[&str] = &["kimi-k3", "kimi-k2", "kimi-linear-48b"];

impl PlanModel {
    /// Reads `dir/config.json` and, when the folder has safetensors, their headers.
    pub fn from_dir(dir: &Path) -> Result<PlanModel> {
        let config = read_json(&dir.join("config.json"), "config.json")?;
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| dir.display().to_string());
        let mut model = PlanModel::from_config(&config, &name, &dir.display().to_string())?;
        let has_weights = std::fs::read_dir(dir)
            .map_err(|e| Error::io(dir, e))?
            .filter_map(|e| e.ok())
            .any(|e| e.file_name().to_string_lossy().ends_with(".safetensors"));
        if has_weights {
            model.stored = Some(StoredWeights::from_checkpoint(&Checkpoint::open(dir)?)?);
        }
        Ok(model)
    }

    /// A built-in preset (see [`PRESETS`]).
    pub fn preset(name: &str) -> Result<PlanModel> {
        let (config, display) = match name.to_ascii_lowercase().as_str() {
            "kimi-k3" | "k3" => (kimi_k3_config(), "Kimi K3"),
            "kimi-k2" | "k2" => (kimi_k2_config(), "Kimi K2"),
            "kimi-linear-48b" | "kimi-linear" => (kimi_linear_config(), "Kimi-Linear-48B-A3B"),
            _ => {
                return Err(Error::Config(format!(
                    "unknown preset `{name}`; known: {}",
                    PRESETS.join(", ")
                )))
            }
        };
        let mut model = PlanModel::from_config(&config, display, &format!("preset {name}"))?;
        if display == "Kimi K3" {
            model.published = vec![
                PublishedFigure {
                    label: "article: Q4_K_M ≈ 1612.4 GB".into(),
                    scheme: WeightScheme::Q4KM,
                    bytes: 1612.4e9,
                },
                PublishedFigure {
                    label: "article: FP16 ~5.5 TB".into(),
                    scheme: WeightScheme::Bf16,
                    bytes: 5.5e12,
                },
                PublishedFigure {
                    label: "InstantTensor: checkpoint 1.42 TiB".into(),
                    scheme: WeightScheme::Mxfp4,
                    bytes: 1.42 * (1u64 << 40) as f64,
                },
            ];
        }
        Ok(model)
    }

    /// Builds the model from a parsed `config.json` (read once into the
    /// checkpoint's [`Arch`], the description the loaders use too).
    pub fn from_config(config: &Value, name: &str, source: &str) -> Result<PlanModel> {
        let model_type = config
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string();
        let arch = Arch::from_config(config)?;
        let text = text_arch(&arch);
        let vision = match config.get("vision_config").filter(|v| v.is_object()) {
            Some(v) => Some(parse_vision(v, config, text.hidden)?),
            None => None,
        };
        let mut notes = Vec::new();
        if text.mtp_layers > 0 {
            notes.push(format!(
                "{} MTP layer(s) in the checkpoint are not counted (dropped on load)",
                text.mtp_layers
            ));
        }
        let native_weights = match (arch.quantization.method, &arch.quantization.config) {
            (QuantMethod::None, _) => WeightScheme::Bf16,
            (QuantMethod::Mxfp4, _) => WeightScheme::Mxfp4,
            (QuantMethod::Fp8, _) => WeightScheme::Fp8,
            (QuantMethod::Other, q) => {
                let q = q
                    .as_ref()
                    .expect("a recognised-or-not quantization_config is kept");
                notes.push(format!("unrecognised quantization_config {q}; priced as bf16 unless --weights is given"));
                WeightScheme::Bf16
            }
        };
        Ok(PlanModel {
            name: name.to_string(),
            source: source.to_string(),
            model_type,
            text,
            vision,
            lm_head_name: format!("{}lm_head.weight", arch.root),
            native_weights,
            stored: None,
            published: Vec::new(),
            notes,
        })
    }

    /// Every tensor of the model.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        let mut s = Specs(Vec::new());
        let t = &self.text;
        let (d, p) = (t.hidden, t.prefix.as_str());
        s.add(
            Component::Embedding,
            TensorKind::Embedding,
            format!("{p}embed_tokens.weight"),
            t.vocab,
            d,
            None,
        );
        if !t.tie_embeddings {
            s.add(
                Component::LmHead,
                TensorKind::LmHead,
                self.lm_head_name.clone(),
                t.vocab,
                d,
                None,
            );
        }
        s.add(
            Component::LayerNorms,
            TensorKind::Small,
            format!("{p}norm.weight"),
            1,
            d,
            None,
        );
        if t.attn_res_block.is_some() {
            for n in ["output_attn_res_norm", "output_attn_res_proj"] {
                s.add(
                    Component::AttnRes,
                    TensorKind::Small,
                    format!("{p}{n}.weight"),
                    1,
                    d,
                    None,
                );
            }
        }
        for i in 0..t.layers {
            let l = format!("{p}layers.{i}.");
            for n in ["input_layernorm", "post_attention_layernorm"] {
                s.add(
                    Component::LayerNorms,
                    TensorKind::Small,
                    format!("{l}{n}.weight"),
                    1,
                    d,
                    Some(i),
                );
            }
            if t.attn_res_block.is_some() {
                for n in [
                    "self_attention_res_norm",
                    "self_attention_res_proj",
                    "mlp_res_norm",
                    "mlp_res_proj",
                ] {
                    s.add(
                        Component::AttnRes,
                        TensorKind::Small,
                        format!("{l}{n}.weight"),
                        1,
                        d,
                        Some(i),
                    );
                }
            }
            let a = format!("{l}self_attn.");
            match t.attention[i] {
                AttentionKind::Gqa => {
                    s.gqa(t.gqa.as_ref().expect("GQA layers have GQA dims"), d, &a, i)
                }
                AttentionKind::Mla => {
                    s.mla(t.mla.as_ref().expect("MLA layers have MLA dims"), d, &a, i)
                }
                AttentionKind::Kda => {
                    s.kda(t.kda.as_ref().expect("KDA layers have KDA dims"), d, &a, i)
                }
            }
            let moe = t.moe.as_ref().filter(|_| t.moe_layers[i]);
            match moe {
                Some(m) => s.moe(m, t.family, d, &l, i),
                None => s.mlp(
                    Component::DenseMlp,
                    &format!("{l}mlp."),
                    d,
                    t.dense_intermediate,
                    t.mlp_bias,
                    Some(i),
                ),
            }
        }
        if let Some(v) = &self.vision {
            s.vision(v);
        }
        s.0
    }
}

/// Collects tensor specs.
struct Specs(Vec<TensorSpec>);

impl Specs {
    fn add(
        &mut self,
        component: Component,
        kind: TensorKind,
        name: String,
        rows: u64,
        cols: u64,
        layer: Option<usize>,
    ) {
        let active = if matches!(component, Component::VisionTower | Component::Projector) {
            0
        } else {
            1
        };
        self.0.push(TensorSpec {
            name,
            component,
            kind,
            rows,
            cols,
            count: 1,
            active_count: active,
            layer,
        });
    }

    fn linear(
        &mut self,
        c: Component,
        name: String,
        out: u64,
        inp: u64,
        bias: bool,
        layer: Option<usize>,
    ) {
        if bias {
            self.add(
                c,
                TensorKind::Small,
                name.replace(".weight", ".bias"),
                1,
                out,
                layer,
            );
        }
        self.add(c, TensorKind::Linear, name, out, inp, layer);
    }

    fn gqa(&mut self, g: &GqaDims, d: u64, a: &str, i: usize) {
        let c = Component::GqaAttention;
        let (q, kv) = (g.heads * g.head_dim, g.kv_heads * g.head_dim);
        self.linear(c, format!("{a}q_proj.weight"), q, d, g.bias, Some(i));
        self.linear(c, format!("{a}k_proj.weight"), kv, d, g.bias, Some(i));
        self.linear(c, format!("{a}v_proj.weight"), kv, d, g.bias, Some(i));
        self.linear(c, format!("{a}o_proj.weight"), d, q, g.bias, Some(i));
    }

    fn mla(&mut self, m: &MlaDims, d: u64, a: &str, i: usize) {
        let c = Component::MlaAttention;
        let l = Some(i);
        let q_width = m.heads * (m.qk_nope + m.qk_rope);
        match m.q_lora_rank {
            Some(r) => {
                self.linear(c, format!("{a}q_a_proj.weight"), r, d, false, l);
                self.add(
                    c,
                    TensorKind::Small,
                    format!("{a}q_a_layernorm.weight"),
                    1,
                    r,
                    l,
                );
                self.linear(c, format!("{a}q_b_proj.weight"), q_width, r, false, l);
            }
            None => self.linear(c, format!("{a}q_proj.weight"), q_width, d, false, l),
        }
        self.linear(
            c,
            format!("{a}kv_a_proj_with_mqa.weight"),
            m.kv_lora_rank + m.qk_rope,
            d,
            false,
            l,
        );
        self.add(
            c,
            TensorKind::Small,
            format!("{a}kv_a_layernorm.weight"),
            1,
            m.kv_lora_rank,
            l,
        );
        self.linear(
            c,
            format!("{a}kv_b_proj.weight"),
            m.heads * (m.qk_nope + m.v_head),
            m.kv_lora_rank,
            false,
            l,
        );
        self.linear(
            c,
            format!("{a}o_proj.weight"),
            d,
            m.heads * m.v_head,
            false,
            l,
        );
        if m.output_gate {
            self.linear(
                c,
                format!("{a}g_proj.weight"),
                m.heads * m.v_head,
                d,
                false,
                l,
            );
        }
    }

    fn kda(&mut self, k: &KdaDims, d: u64, a: &str, i: usize) {
        let c = Component::KdaAttention;
        let l = Some(i);
        let p = k.heads * k.head_dim;
        for n in ["q", "k", "v"] {
            self.linear(c, format!("{a}{n}_proj.weight"), p, d, false, l);
            self.add(
                c,
                TensorKind::Small,
                format!("{a}{n}_conv1d.weight"),
                p,
                k.conv_kernel,
                l,
            );
        }
        self.linear(c, format!("{a}f_a_proj.weight"), k.head_dim, d, false, l);
        self.linear(c, format!("{a}f_b_proj.weight"), p, k.head_dim, false, l);
        self.linear(c, format!("{a}b_proj.weight"), k.heads, d, false, l);
        if k.full_rank_gate {
            self.linear(c, format!("{a}g_proj.weight"), p, d, false, l);
        } else {
            self.linear(c, format!("{a}g_a_proj.weight"), k.head_dim, d, false, l);
            self.linear(c, format!("{a}g_b_proj.weight"), p, k.head_dim, false, l);
        }
        // A_log is one value per head (checkpoint shape [1, 1, H, 1]); TS says K3 pads it to
        // [head_dim] slots, which would add (128 − 96) values per KDA layer.
        self.add(c, TensorKind::Small, format!("{a}A_log"), 1, k.heads, l);
        self.add(c, TensorKind::Small, format!("{a}dt_bias"), 1, p, l);
        self.add(
            c,
            TensorKind::Small,
            format!("{a}o_norm.weight"),
            1,
            k.head_dim,
            l,
        );
        self.linear(c, format!("{a}o_proj.weight"), d, p, false, l);
    }

    /// A gated MLP `down(act(gate(x)) ⊙ up(x))` with `gate_proj`/`up_proj`/`down_proj` names.
    fn mlp(&mut self, c: Component, m: &str, d: u64, inter: u64, bias: bool, layer: Option<usize>) {
        self.linear(c, format!("{m}gate_proj.weight"), inter, d, bias, layer);
        self.linear(c, format!("{m}up_proj.weight"), inter, d, bias, layer);
        if bias {
            self.add(
                c,
                TensorKind::Small,
                format!("{m}down_proj.bias"),
                1,
                d,
                layer,
            );
        }
        self.add(
            c,
            TensorKind::FfnDown,
            format!("{m}down_proj.weight"),
            d,
            inter,
            layer,
        );
    }

    fn moe(&mut self, m: &MoeDims, family: Family, d: u64, l: &str, i: usize) {
        let layer = Some(i);
        let b = if family == Family::KimiLinear {
            format!("{l}block_sparse_moe.")
        } else {
            format!("{l}mlp.")
        };
        self.add(
            Component::Router,
            TensorKind::Router,
            format!("{b}gate.weight"),
            m.experts,
            d,
            layer,
        );
        self.add(
            Component::Router,
            TensorKind::Small,
            format!("{b}gate.e_score_correction_bias"),
            1,
            m.experts,
            layer,
        );
        let inner = m.latent.unwrap_or(d);
        let names = if family == Family::KimiLinear {
            ["w1", "w3", "w2"]
        } else {
            ["gate_proj", "up_proj", "down_proj"]
        };
        for (j, n) in names.iter().enumerate() {
            let (rows, cols, kind) = if j < 2 {
                (m.intermediate, inner, TensorKind::Linear)
            } else {
                (inner, m.intermediate, TensorKind::FfnDown)
            };
            self.0.push(TensorSpec {
                name: format!("{b}experts.{{e}}.{n}.weight"),
                component: Component::RoutedExperts,
                kind,
                rows,
                cols,
                count: m.experts,
                active_count: m.top_k,
                layer,
            });
        }
        if let Some(lat) = m.latent {
            let c = Component::LatentProjections;
            self.linear(
                c,
                format!("{b}routed_expert_down_proj.weight"),
                lat,
                d,
                false,
                layer,
            );
            self.linear(
                c,
                format!("{b}routed_expert_up_proj.weight"),
                d,
                lat,
                false,
                layer,
            );
            if m.latent_norm {
                self.add(
                    c,
                    TensorKind::Small,
                    format!("{b}routed_expert_norm.weight"),
                    1,
                    lat,
                    layer,
                );
            }
        }
        if m.shared > 0 {
            self.mlp(
                Component::SharedExperts,
                &format!("{b}shared_experts."),
                d,
                m.intermediate * m.shared,
                false,
                layer,
            );
        }
    }

    fn vision(&mut self, v: &VisionArch) {
        let (c, h) = (Component::VisionTower, v.hidden);
        let norm = |s: &mut Specs, name: String, width: u64, comp: Component, rms: bool| {
            if !rms {
                s.add(
                    comp,
                    TensorKind::Small,
                    name.replace(".weight", ".bias"),
                    1,
                    width,
                    None,
                );
            }
            s.add(comp, TensorKind::Small, name, 1, width, None);
        };
        self.linear(
            c,
            "vision_tower.patch_embed.proj.weight".into(),
            h,
            3 * v.patch * v.patch,
            v.patch_bias,
            None,
        );
        self.add(
            c,
            TensorKind::Small,
            "vision_tower.patch_embed.pos_emb.weight".into(),
            v.pos_cells,
            h,
            None,
        );
        for i in 0..v.layers {
            let b = format!("vision_tower.encoder.blocks.{i}.");
            norm(self, format!("{b}norm0.weight"), h, c, v.rms_norm);
            norm(self, format!("{b}norm1.weight"), h, c, v.rms_norm);
            self.linear(
                c,
                format!("{b}wqkv.weight"),
                3 * v.qkv_hidden,
                h,
                v.attn_bias,
                None,
            );
            self.linear(
                c,
                format!("{b}wo.weight"),
                h,
                v.qkv_hidden,
                v.attn_bias,
                None,
            );
            self.linear(
                c,
                format!("{b}mlp.fc0.weight"),
                v.mlp,
                h,
                v.linear_bias,
                None,
            );
            self.linear(
                c,
                format!("{b}mlp.fc1.weight"),
                h,
                v.mlp,
                v.linear_bias,
                None,
            );
        }
        norm(
            self,
            "vision_tower.encoder.final_layernorm.weight".into(),
            h,
            c,
            v.rms_norm,
        );
        let (pc, pr) = (Component::Projector, &v.projector);
        if pr.pre_norm {
            norm(self, "mm_projector.pre_norm.weight".into(), h, pc, false);
        }
        self.linear(
            pc,
            "mm_projector.proj.0.weight".into(),
            pr.input,
            pr.input,
            pr.bias,
            None,
        );
        self.linear(
            pc,
            "mm_projector.proj.2.weight".into(),
            pr.output,
            pr.input,
            pr.bias,
            None,
        );
        if pr.post_norm {
            norm(
                self,
                "mm_projector.post_norm.weight".into(),
                pr.output,
                pc,
                true,
            );
        }
    }
}

#[cfg(test)]
mod tests;
