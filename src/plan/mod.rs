//! Memory planner: pure arithmetic over a model's config — parameter counts
//! by module, weight bytes under a storage scheme, KV-cache / KDA-state bytes,
//! and how many long-context sessions fit on a set of devices. No weights are
//! read (a checkpoint folder contributes only its `config.json` and its
//! safetensors headers).
//!
//! Pipeline: [`PlanModel`] (from [`PlanModel::from_dir`] or
//! [`PlanModel::preset`]) + [`PlanOptions`] → [`plan`] → [`PlanReport`] →
//! [`render_table`] (text) or `serde_json` (`--json`). [`run_plan`] does all of
//! it from command-line strings.
//!
//! Definitions (reference `kimi-architecture.md` §0, §2.4, §7):
//! - **active** parameters are those one text token touches: top-k of the
//!   routed experts plus everything else in the decoder; the vision tower and
//!   projector run only on media and count as inactive. Three variants are
//!   reported, as §0 does: with the input embedding, without it (the headline
//!   figure, 104.19B for K3), and without embedding and lm_head. With tied
//!   embeddings the shared matrix stays in "without embedding" (it is the lm_head).
//! - GB = 1e9 B, GiB = 2^30 B, TiB = 2^40 B.
//! - Memory is pooled: weights are stored once across all devices and each
//!   session's cache once (data-parallel attention). With plain tensor
//!   parallelism every rank keeps the whole MLA latent cache; set
//!   [`PlanOptions::mla_cache_replicas`] to the TP degree for that layout.

mod devices;
mod model;
mod parse;
mod render;
mod shape;
mod weights;

use caracal_kernels::paged::KvDtype;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::str::FromStr;

use serde::Serialize;

pub use devices::{parse_bytes, DeviceKind, DeviceSpec};
pub use model::{
    AttentionKind, Component, Family, GqaDims, KdaDims, MlaDims, MoeDims, PlanModel, ProjectorArch,
    PublishedFigure, StoredDtype, StoredWeights, TensorKind, TensorSpec, TextArch, VisionArch,
    PRESETS,
};
pub use render::render_table;
pub use weights::{format_for, tensor_bytes, use_more_bits, StorageFormat, WeightScheme};

use crate::error::{Error, Result};

/// Default context per session: 1,048,576 tokens (K3's `max_position_embeddings`).
pub const DEFAULT_CONTEXT: u64 = 1 << 20;
/// Default fraction of device memory the server may use, as vLLM's `gpu_memory_utilization` (0 < f ≤ 1).
pub const DEFAULT_UTILISATION: f64 = 0.90;
/// Default per-device reserve for activations and workspace, taken from the
/// utilised memory: CUDA graphs and NCCL buffers (~1–2 GB) plus one 8k-token
/// prefill chunk (K3's AttnRes snapshots alone: 8 × 7168 × 2 B × 8192 ≈ 0.94 GB).
pub const DEFAULT_RESERVE_PER_DEVICE: u64 = 4_000_000_000;

/// Element type of the attention KV cache (the KDA recurrent state is always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheDtype {
    /// 2 bytes per value.
    Bf16,
    /// 1 byte per value (TS requires it for K3 on NVIDIA).
    Fp8,
    /// 1 byte per value plus an f32 scale per segment (the CPU runtime's
    /// `--kv-cache-dtype int8`, [`caracal_kernels::paged`]).
    Int8,
    /// 4 bytes per value (the CPU runtime's exact rows).
    F32,
}

impl CacheDtype {
    /// `bf16`, `fp8`, `int8` or `f32`.
    pub fn name(self) -> &'static str {
        match self {
            CacheDtype::Bf16 => "bf16",
            CacheDtype::Fp8 => "fp8",
            CacheDtype::Int8 => "int8",
            CacheDtype::F32 => "f32",
        }
    }

    /// Bytes of one cached row of `values` values in segments of `segment`
    /// (only int8 stores a scale per segment): the KV pool's own count
    /// ([`KvDtype::row_bytes`]) for the dtypes the CPU runtime stores.
    pub fn row_bytes(self, values: u64, segment: u64) -> u64 {
        let pool = match self {
            CacheDtype::Fp8 => return values,
            CacheDtype::Bf16 => KvDtype::Bf16,
            CacheDtype::Int8 => KvDtype::Int8,
            CacheDtype::F32 => KvDtype::F32,
        };
        pool.row_bytes(values as usize, segment as usize) as u64
    }
}

impl FromStr for CacheDtype {
    type Err = Error;
    fn from_str(s: &str) -> Result<CacheDtype> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "fp16" | "auto" => Ok(CacheDtype::Bf16),
            "fp8" | "fp8_e4m3" => Ok(CacheDtype::Fp8),
            "int8" => Ok(CacheDtype::Int8),
            "f32" => Ok(CacheDtype::F32),
            _ => Err(Error::Config(format!(
                "--kv-cache-dtype must be bf16, fp8, int8 or f32, got `{s}`"
            ))),
        }
    }
}

/// What to plan for.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanOptions {
    /// The devices.
    pub devices: DeviceSpec,
    /// Tokens per session (default [`DEFAULT_CONTEXT`]).
    pub context: u64,
    /// Weight scheme; `None` = the checkpoint's own (`quantization_config`).
    pub weights: Option<WeightScheme>,
    /// KV-cache element type (default BF16).
    pub kv_cache: CacheDtype,
    /// Fraction of each device's memory to use, in (0, 1] (default 0.90).
    pub utilisation: f64,
    /// Bytes per device kept for activations and workspace (default [`DEFAULT_RESERVE_PER_DEVICE`]).
    pub reserve_per_device: u64,
    /// Copies of each session's MLA cache (1 = DP attention; TP degree for plain TP). At least 1.
    pub mla_cache_replicas: u64,
}

impl Default for PlanOptions {
    fn default() -> PlanOptions {
        PlanOptions {
            devices: DeviceSpec::parse("8xH200", None).expect("H200 is a known kind"),
            context: DEFAULT_CONTEXT,
            weights: None,
            kv_cache: CacheDtype::Bf16,
            utilisation: DEFAULT_UTILISATION,
            reserve_per_device: DEFAULT_RESERVE_PER_DEVICE,
            mla_cache_replicas: 1,
        }
    }
}

/// Parameters and bytes in one storage format.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FormatBytes {
    /// The format.
    pub format: StorageFormat,
    /// Parameters stored in it.
    pub params: u64,
    /// Their bytes (scales included).
    pub bytes: u64,
}

/// One row of the component table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ComponentRow {
    /// The component.
    pub component: Component,
    /// Its table label.
    pub label: String,
    /// Parameters.
    pub params: u64,
    /// Parameters one text token uses.
    pub active_params: u64,
    /// Bytes under the chosen scheme.
    pub bytes: u64,
    /// Bytes by format.
    pub formats: Vec<FormatBytes>,
}

/// Active-parameter variants (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ActiveParams {
    /// Including the input embedding and lm_head.
    pub with_embedding: u64,
    /// Excluding the input embedding, including lm_head (K3: 104.19B).
    pub without_embedding: u64,
    /// Excluding both.
    pub without_embedding_and_lm_head: u64,
}

/// Parameter totals.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ParamSummary {
    /// Everything.
    pub total: u64,
    /// Text decoder (embedding and lm_head included).
    pub text: u64,
    /// Vision tower.
    pub vision_tower: u64,
    /// Projector.
    pub projector: u64,
    /// Routed experts.
    pub routed_experts: u64,
    /// Active parameters.
    pub active: ActiveParams,
}

/// Whole-model bytes under one scheme.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SchemeTotal {
    /// The scheme.
    pub scheme: WeightScheme,
    /// Bytes.
    pub bytes: u64,
    /// `bytes · 8 / params`.
    pub bits_per_weight: f64,
}

/// A published figure next to this plan's number.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PublishedCheck {
    /// The claim.
    pub label: String,
    /// The scheme it names.
    pub scheme: WeightScheme,
    /// Claimed bytes.
    pub claimed_bytes: f64,
    /// `claimed · 8 / total params`.
    pub implied_bits_per_weight: f64,
    /// This plan's bytes for that scheme.
    pub planned_bytes: u64,
    /// This plan's bits/weight for that scheme.
    pub planned_bits_per_weight: f64,
    /// Within 2% of the plan.
    pub consistent: bool,
}

/// Cache and recurrent-state sizes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CacheReport {
    /// Tokens per session.
    pub context: u64,
    /// KV element type used for the session figure.
    pub kv_dtype: CacheDtype,
    /// MLA layers.
    pub mla_layers: u64,
    /// Values cached per token and MLA layer (`kv_lora_rank + qk_rope_head_dim`).
    pub mla_values_per_layer: u64,
    /// MLA latent cache per token, BF16.
    pub mla_bytes_per_token_bf16: u64,
    /// MLA latent cache per token, FP8.
    pub mla_bytes_per_token_fp8: u64,
    /// GQA layers.
    pub gqa_layers: u64,
    /// GQA K+V per token, BF16 (`2 · kv_heads · head_dim · layers · 2 B`).
    pub gqa_bytes_per_token_bf16: u64,
    /// KDA layers.
    pub kda_layers: u64,
    /// KDA recurrent state per sequence (`layers · heads · head_dim² · 4 B`).
    pub kda_state_bytes: u64,
    /// KDA conv state per sequence (`layers · 3·P · (W−1) · 2 B`).
    pub kda_conv_bytes: u64,
    /// Attention cache per token in `kv_dtype`, MLA replicas included.
    pub bytes_per_token: u64,
    /// One session: `bytes_per_token · context` + KDA state + conv state.
    pub session_bytes: u64,
    /// Copies of the MLA cache (see [`PlanOptions::mla_cache_replicas`]).
    pub mla_cache_replicas: u64,
    /// AttnRes block snapshots held during a forward, per token (BF16; nothing persists).
    pub attn_res_activation_bytes_per_token: u64,
}

/// Device budget and the verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceReport {
    /// The devices.
    pub spec: DeviceSpec,
    /// `count · bytes_per_device`.
    pub total_bytes: u64,
    /// The utilisation fraction.
    pub utilisation: f64,
    /// Reserve per device.
    pub reserve_per_device: u64,
    /// `total · utilisation − count · reserve`: what weights and caches may use.
    pub budget_bytes: u64,
    /// Weight bytes under the chosen scheme.
    pub weight_bytes: u64,
    /// Budget left after weights (0 when they do not fit).
    pub free_bytes: u64,
    /// Concurrent sessions of `context` tokens that fit.
    pub sessions: u64,
    /// Weights fit and at least one session does.
    pub fits: bool,
    /// One-line answer.
    pub verdict: String,
}

/// Everything [`plan`] computes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanReport {
    /// Model name.
    pub model: String,
    /// Where the model came from.
    pub source: String,
    /// One-line architecture summary.
    pub architecture: String,
    /// The weight scheme used.
    pub scheme: WeightScheme,
    /// What that scheme stores where.
    pub scheme_description: String,
    /// Parameter totals.
    pub params: ParamSummary,
    /// Per-component rows (empty components omitted).
    pub components: Vec<ComponentRow>,
    /// Weight bytes by format under the chosen scheme.
    pub weights_by_format: Vec<FormatBytes>,
    /// Whole-model bytes under every scheme.
    pub schemes: Vec<SchemeTotal>,
    /// Published figures checked against the plan.
    pub published: Vec<PublishedCheck>,
    /// Safetensors header sizes, if a checkpoint was read.
    pub stored: Option<StoredWeights>,
    /// Whether the header element count equals the planned parameter count (unpacked checkpoints only).
    pub stored_matches_plan: Option<bool>,
    /// Cache sizes.
    pub cache: CacheReport,
    /// Devices and verdict.
    pub devices: DeviceReport,
    /// Remarks.
    pub notes: Vec<String>,
}

/// Bytes of the whole model under `scheme`, and parameters.
fn scheme_total(specs: &[TensorSpec], scheme: WeightScheme, n_layers: usize) -> SchemeTotal {
    let params: u64 = specs.iter().map(|s| s.params()).sum();
    let bytes: u64 = specs
        .iter()
        .map(|s| tensor_bytes(scheme, s, n_layers).1)
        .sum();
    SchemeTotal {
        scheme,
        bytes,
        bits_per_weight: bytes as f64 * 8.0 / params.max(1) as f64,
    }
}

/// Cache sizes of `model` for `opts`.
fn cache_report(model: &PlanModel, opts: &PlanOptions) -> CacheReport {
    let t = &model.text;
    let (mla_layers, gqa_layers, kda_layers) = (
        t.count(AttentionKind::Mla) as u64,
        t.count(AttentionKind::Gqa) as u64,
        t.count(AttentionKind::Kda) as u64,
    );
    let mla_values = t.mla.as_ref().map_or(0, |m| m.kv_lora_rank + m.qk_rope);
    let gqa_values = t.gqa.as_ref().map_or(0, |g| 2 * g.kv_heads * g.head_dim);
    // Values per int8 scale, as the runtime cuts its rows
    // (`Arch::kv_segment`): the latent and rope parts apart, a GQA head.
    let mla_segment = t.mla.as_ref().map_or(1, |m| {
        caracal_kernels::paged::common_segment(m.kv_lora_rank as usize, m.qk_rope as usize) as u64
    });
    let gqa_segment = t.gqa.as_ref().map_or(1, |g| g.head_dim);
    let (kda_state, kda_conv) = t.kda.as_ref().map_or((0, 0), |k| {
        let p = k.heads * k.head_dim;
        (
            kda_layers * k.heads * k.head_dim * k.head_dim * 4,
            kda_layers * 3 * p * k.conv_kernel.saturating_sub(1) * 2,
        )
    });
    let replicas = opts.mla_cache_replicas.max(1);
    let per_token = mla_layers * replicas * opts.kv_cache.row_bytes(mla_values, mla_segment)
        + gqa_layers * opts.kv_cache.row_bytes(gqa_values, gqa_segment);
    let blocks = t
        .attn_res_block
        .map_or(0, |b| t.layers.div_ceil(b.max(1)) as u64);
    CacheReport {
        context: opts.context,
        kv_dtype: opts.kv_cache,
        mla_layers,
        mla_values_per_layer: mla_values,
        mla_bytes_per_token_bf16: mla_layers * mla_values * 2,
        mla_bytes_per_token_fp8: mla_layers * mla_values,
        gqa_layers,
        gqa_bytes_per_token_bf16: gqa_layers * gqa_values * 2,
        kda_layers,
        kda_state_bytes: kda_state,
        kda_conv_bytes: kda_conv,
        bytes_per_token: per_token,
        session_bytes: per_token * opts.context + kda_state + kda_conv,
        mla_cache_replicas: replicas,
        attn_res_activation_bytes_per_token: blocks * t.hidden * 2,
    }
}

/// `1M`, `128K` or the plain number.
fn context_label(ctx: u64) -> String {
    if ctx >= 1 << 20 && ctx.is_multiple_of(1 << 20) {
        format!("{}M", ctx >> 20)
    } else if ctx >= 1024 && ctx.is_multiple_of(1024) {
        format!("{}K", ctx >> 10)
    } else {
        ctx.to_string()
    }
}

/// Device budget, sessions and verdict.
fn device_report(opts: &PlanOptions, weight_bytes: u64, session_bytes: u64) -> DeviceReport {
    let d = &opts.devices;
    let total = d.count * d.bytes_per_device;
    let usable = (total as f64 * opts.utilisation).floor() as u64;
    let budget = usable.saturating_sub(d.count * opts.reserve_per_device);
    let gb = |b: u64| format!("{:.1} GB", b as f64 / 1e9);
    let ctx = context_label(opts.context);
    let (free, sessions, fits, verdict) = if weight_bytes > budget {
        let why = format!(
            "{}×{} {:.0} GB × {:.2} − {} reserve",
            d.count,
            d.kind.name(),
            d.bytes_per_device as f64 / 1e9,
            opts.utilisation,
            gb(d.count * opts.reserve_per_device)
        );
        (
            0,
            0,
            false,
            format!(
                "does not fit: weights need {}, devices offer {} ({why})",
                gb(weight_bytes),
                gb(budget)
            ),
        )
    } else {
        let free = budget - weight_bytes;
        let n = free / session_bytes.max(1);
        if n == 0 {
            let v = format!(
                "does not fit: weights fit ({} of {}), but one {ctx}-token session needs {} and {} is left",
                gb(weight_bytes),
                gb(budget),
                gb(session_bytes),
                gb(free)
            );
            (free, 0, false, v)
        } else {
            let v = format!(
                "fits: {n} concurrent {ctx}-token session{} ({} each; {} free after {} of weights)",
                if n == 1 { "" } else { "s" },
                gb(session_bytes),
                gb(free),
                gb(weight_bytes)
            );
            (free, n, true, v)
        }
    };
    DeviceReport {
        spec: d.clone(),
        total_bytes: total,
        utilisation: opts.utilisation,
        reserve_per_device: opts.reserve_per_device,
        budget_bytes: budget,
        weight_bytes,
        free_bytes: free,
        sessions,
        fits,
        verdict,
    }
}

/// One-line architecture summary.
fn architecture_line(m: &PlanModel) -> String {
    let t = &m.text;
    let mut parts = vec![format!("{} layers", t.layers)];
    let kinds: Vec<String> = [
        (AttentionKind::Kda, "KDA"),
        (AttentionKind::Mla, "MLA"),
        (AttentionKind::Gqa, "GQA"),
    ]
    .iter()
    .filter(|(k, _)| t.count(*k) > 0)
    .map(|(k, n)| format!("{} {n}", t.count(*k)))
    .collect();
    parts[0] += &format!(" ({})", kinds.join(" + "));
    parts.push(format!("d {}", t.hidden));
    parts.push(format!("vocab {}", t.vocab));
    if let Some(moe) = &t.moe {
        let mut s = format!(
            "MoE {} experts top-{} + {} shared in {} layers",
            moe.experts,
            moe.top_k,
            moe.shared,
            t.moe_layers.iter().filter(|&&x| x).count()
        );
        if let Some(l) = moe.latent {
            s += &format!(", latent {l}");
        }
        parts.push(s);
    }
    if let Some(b) = t.attn_res_block {
        parts.push(format!("AttnRes block {b}"));
    }
    if let Some(v) = &m.vision {
        parts.push(format!(
            "vision {}×{} ({})",
            v.layers, v.hidden, v.projector.kind
        ));
    }
    parts.join(" | ")
}

/// Plans `model` on `opts`: counts, bytes, caches and the verdict.
pub fn plan(model: &PlanModel, opts: &PlanOptions) -> Result<PlanReport> {
    if !(opts.utilisation > 0.0 && opts.utilisation <= 1.0) {
        return Err(Error::Config(format!(
            "utilisation must be in (0, 1], got {}",
            opts.utilisation
        )));
    }
    if opts.context == 0 {
        return Err(Error::Config("--context must be at least 1 token".into()));
    }
    let specs = model.tensors();
    let n_layers = model.text.layers;
    let scheme = opts.weights.unwrap_or(model.native_weights);
    let mut rows: BTreeMap<Component, ComponentRow> = BTreeMap::new();
    for s in &specs {
        let (format, bytes) = tensor_bytes(scheme, s, n_layers);
        let row = rows.entry(s.component).or_insert_with(|| ComponentRow {
            component: s.component,
            label: s.component.label().to_string(),
            params: 0,
            active_params: 0,
            bytes: 0,
            formats: Vec::new(),
        });
        row.params += s.params();
        row.active_params += s.active_params();
        row.bytes += bytes;
        match row.formats.iter_mut().find(|f| f.format == format) {
            Some(f) => {
                f.params += s.params();
                f.bytes += bytes;
            }
            None => row.formats.push(FormatBytes {
                format,
                params: s.params(),
                bytes,
            }),
        }
    }
    let components: Vec<ComponentRow> = rows.into_values().collect();
    let sum = |c: Component| {
        components
            .iter()
            .find(|r| r.component == c)
            .map_or(0, |r| r.params)
    };
    let mut by_format: BTreeMap<StorageFormat, FormatBytes> = BTreeMap::new();
    for f in components.iter().flat_map(|r| r.formats.iter()) {
        let e = by_format.entry(f.format).or_insert(FormatBytes {
            format: f.format,
            params: 0,
            bytes: 0,
        });
        e.params += f.params;
        e.bytes += f.bytes;
    }
    let mut weights_by_format: Vec<FormatBytes> = by_format.into_values().collect();
    weights_by_format.sort_by_key(|f| std::cmp::Reverse(f.bytes));
    let total: u64 = components.iter().map(|r| r.params).sum();
    let (vision_tower, projector) = (sum(Component::VisionTower), sum(Component::Projector));
    let with_embedding: u64 = components.iter().map(|r| r.active_params).sum();
    let (emb, lm) = (sum(Component::Embedding), sum(Component::LmHead));
    let active = ActiveParams {
        with_embedding,
        without_embedding: with_embedding - if model.text.tie_embeddings { 0 } else { emb },
        without_embedding_and_lm_head: with_embedding - emb - lm,
    };
    let params = ParamSummary {
        total,
        text: total - vision_tower - projector,
        vision_tower,
        projector,
        routed_experts: sum(Component::RoutedExperts),
        active,
    };
    let schemes: Vec<SchemeTotal> = WeightScheme::ALL
        .iter()
        .map(|&s| scheme_total(&specs, s, n_layers))
        .collect();
    let published = model
        .published
        .iter()
        .map(|p| {
            let planned = schemes
                .iter()
                .find(|s| s.scheme == p.scheme)
                .expect("ALL covers every scheme");
            PublishedCheck {
                label: p.label.clone(),
                scheme: p.scheme,
                claimed_bytes: p.bytes,
                implied_bits_per_weight: p.bytes * 8.0 / total as f64,
                planned_bytes: planned.bytes,
                planned_bits_per_weight: planned.bits_per_weight,
                consistent: (p.bytes / planned.bytes as f64 - 1.0).abs() <= 0.02,
            }
        })
        .collect();
    let packed = |s: &StoredWeights| {
        s.by_dtype
            .iter()
            .any(|d| d.dtype == "u8" || d.dtype == "i32")
    };
    let stored_matches_plan = model
        .stored
        .as_ref()
        .filter(|s| !packed(s))
        .map(|s| s.elements == total);
    let cache = cache_report(model, opts);
    let weight_bytes = components.iter().map(|r| r.bytes).sum();
    let devices = device_report(opts, weight_bytes, cache.session_bytes);
    let mut notes = model.notes.clone();
    if model.text.max_position > 0 && opts.context > model.text.max_position {
        notes.push(format!(
            "context {} exceeds the model's max_position_embeddings {}",
            opts.context, model.text.max_position
        ));
    }
    Ok(PlanReport {
        model: model.name.clone(),
        source: model.source.clone(),
        architecture: architecture_line(model),
        scheme,
        scheme_description: scheme.describe().to_string(),
        params,
        components,
        weights_by_format,
        schemes,
        published,
        stored: model.stored.clone(),
        stored_matches_plan,
        cache,
        devices,
        notes,
    })
}

/// The arguments of `caracal plan`, as strings from the command line.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PlanArgs {
    /// `--model DIR`: a checkpoint folder (config.json, optional safetensors).
    pub model_dir: Option<PathBuf>,
    /// `--preset NAME`: one of [`PRESETS`].
    pub preset: Option<String>,
    /// `--devices`, e.g. `8xH200` (default `8xH200`).
    pub devices: Option<String>,
    /// `--memory`: per-device memory override, e.g. `139GiB` (required for `cpu`).
    pub memory: Option<String>,
    /// `--context` tokens (default 1,048,576).
    pub context: Option<u64>,
    /// `--weights mxfp4|bf16|fp8|q4_k_m` (default: the checkpoint's own).
    pub weights: Option<String>,
    /// `--kv-cache-dtype bf16|fp8|int8|f32` (default bf16).
    pub kv_cache: Option<String>,
    /// `--utilisation` fraction (default 0.90).
    pub utilisation: Option<f64>,
    /// `--reserve` per device, e.g. `4GB` (default 4 GB).
    pub reserve: Option<String>,
    /// `--mla-replicas` (default 1).
    pub mla_cache_replicas: Option<u64>,
    /// `--json`: print the report as JSON instead of the table.
    pub json: bool,
}

/// Runs `caracal plan`: returns the text table or the JSON report for stdout.
pub fn run_plan(args: &PlanArgs) -> Result<String> {
    let model = match (&args.model_dir, &args.preset) {
        (Some(dir), None) => PlanModel::from_dir(dir)?,
        (None, Some(p)) => PlanModel::preset(p)?,
        _ => {
            return Err(Error::Config(format!(
                "give exactly one of --model DIR or --preset ({})",
                PRESETS.join(", ")
            )))
        }
    };
    let memory = args.memory.as_deref().map(parse_bytes).transpose()?;
    let defaults = PlanOptions::default();
    let opts = PlanOptions {
        devices: DeviceSpec::parse(args.devices.as_deref().unwrap_or("8xH200"), memory)?,
        context: args.context.unwrap_or(DEFAULT_CONTEXT),
        weights: args
            .weights
            .as_deref()
            .map(WeightScheme::from_str)
            .transpose()?,
        kv_cache: args
            .kv_cache
            .as_deref()
            .map(CacheDtype::from_str)
            .transpose()?
            .unwrap_or(CacheDtype::Bf16),
        utilisation: args.utilisation.unwrap_or(DEFAULT_UTILISATION),
        reserve_per_device: args
            .reserve
            .as_deref()
            .map(parse_bytes)
            .transpose()?
            .unwrap_or(defaults.reserve_per_device),
        mla_cache_replicas: args.mla_cache_replicas.unwrap_or(1).max(1),
    };
    let report = plan(&model, &opts)?;
    Ok(if args.json {
        serde_json::to_string_pretty(&report)
            .expect("the report holds only plain numbers and strings")
    } else {
        render_table(&report)
    })
}

#[cfg(test)]
mod tests;
