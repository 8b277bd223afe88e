//! `caracal moeify`: turn a dense `llama` checkpoint (e.g. SmolLM2) into a
//! Kimi K2 / DeepSeek-V3 style MoE whose output equals the dense model's.
//!
//! No small trained MoE exists on any registry we can reach, so this builds
//! one out of a trained dense model (`shared/reference/offline-models.md`
//! §3): the MoE path (router, grouped top-k, dispatch, shared expert,
//! weighted combine, `--ep` shards) then runs on real weights, and the
//! expected answer is the dense model's, up to f32 summation order.
//!
//! For every layer `i >= first_k_dense_replace` (default 1: layer 0 stays
//! dense, as in Kimi K2) the SwiGLU MLP (`gate`/`up` `[I, H]`, `down`
//! `[H, I]`) is split by intermediate neuron into a shared set `S` (the first
//! `|S|` neurons) and a routed set `R` (the rest). The MoE layer computes
//! `y = shared(x) + rsf · Σ_{k∈TopK} w_k · E_k(x)` with sigmoid scores
//! renormalised over the top-k (`Σ w_k = 1`), and:
//! - [`Variant::Copy`] (default): every routed expert is a copy of `R` with
//!   `down[:, R] / rsf`; router weights and correction bias are random, so
//!   routing really happens (grouped top-k with `n_group > 1`), and because
//!   `Σ w_k = 1` any choice gives `S(x) + R(x) = dense(x)`;
//! - [`Variant::Split`]: routed expert `j` is the `j`-th of `E` equal,
//!   disjoint slices of `R`, `top_k = E`, router weights 0 ⇒ every score is
//!   `sigmoid(0) = 0.5` ⇒ `w = 1/E`, and `down[:, R_j]` is scaled by
//!   `E / rsf`: exercises per-expert weighting.
//!
//! Exactness of the written weights: copies are byte copies, and the only
//! arithmetic is scaling `down` by `1/rsf` or `E/rsf`. Both are powers of two
//! ([`MoeifyOptions::routed_scaling_factor`] must be one, and so must `E`
//! for `split`), so in bf16/f16/f32 the scaled values are exact unless they
//! leave the normal range; every scaled value is checked by scaling it back.
//! (Kimi K2's own factor, 2.827, would round.)
//!
//! Shared width: DeepSeek-V3 fuses the shared experts into one MLP of width
//! `n_shared_experts · moe_intermediate_size`. When `|S|` is not a multiple
//! of the expert width, the shared MLP is padded with zero neurons (zero
//! `gate`/`up` rows, zero `down` columns): `SiLU(0)·0 = 0`, so padding adds
//! exact zeros. `|S|` is rounded to a multiple of 32 when `I` is one, so
//! expert widths stay MXFP4-quantizable.
//!
//! Output layout (documented choice): attention cannot become MLA exactly,
//! so the checkpoint keeps `model_type: "llama"` and LLaMA's GQA tensor
//! names, and adds the DeepSeek-V3 MoE keys (`n_routed_experts`,
//! `num_experts_per_tok`, `moe_intermediate_size`, `n_shared_experts`,
//! `first_k_dense_replace`, `n_group`, `topk_group`, `routed_scaling_factor`,
//! `norm_topk_prob`, `scoring_func: sigmoid`, `topk_method: noaux_tc`) and
//! the published MoE tensor names (`mlp.gate.weight`,
//! `mlp.gate.e_score_correction_bias` (f32), `mlp.experts.E.{gate,up,down}_proj`,
//! `mlp.shared_experts.*`), which [`crate::models::llama`] loads.
//! `architectures` becomes `["CaracalLlamaMoeForCausalLM"]`, a name no other
//! tool knows, so that they refuse the folder instead of mis-loading it, and
//! `caracal_moeify` in `config.json` records how it was made. Every other
//! file (tokenizer, generation config) is copied; weights go to
//! `model.safetensors` or to shards with `model.safetensors.index.json`.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use safetensors::tensor::TensorView;
use serde_json::{json, Value};

use crate::checkpoint::config::{parse_config, read_json};
use crate::checkpoint::{Checkpoint, StoredDType};
use crate::convert::export::{bad_write, copy_side_files, st_dtype, write_json};
use crate::error::{Error, Result};
use crate::models::llama::{LlamaConfig, LlamaMoeConfig};

/// How routed experts are made from the dense MLP's routed neurons.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Variant {
    /// Every expert copies all routed neurons (down / rsf); random router.
    #[default]
    Copy,
    /// Experts are disjoint slices (down · E / rsf); zero router, top_k = E.
    Split,
}

impl Variant {
    /// `copy` or `split`.
    pub fn name(self) -> &'static str {
        match self {
            Variant::Copy => "copy",
            Variant::Split => "split",
        }
    }
}

/// What [`moeify_checkpoint`] builds.
#[derive(Debug, Clone)]
pub struct MoeifyOptions {
    /// Routed experts per MoE layer (`n_routed_experts`; default 8; a power
    /// of two for `split`).
    pub experts: usize,
    /// Experts per token (`num_experts_per_tok`): default 2 for `copy`; for
    /// `split` it must be `experts` (`None` picks it).
    pub top_k: Option<usize>,
    /// Fraction of the dense MLP's neurons that go to the shared expert, in
    /// `[0, 1)` (default 0.33; rounded, see [`plan_split`]).
    pub shared_fraction: f64,
    /// Copy or split.
    pub variant: Variant,
    /// `routed_scaling_factor`; must be a power of two so the scaled `down`
    /// weights are exact (default 2.0).
    pub routed_scaling_factor: f32,
    /// `n_group`; `None`: 2 for `copy` when `experts` is even, ≥ 4 and
    /// `top_k ≤ experts / 2`, else 1.
    pub n_group: Option<usize>,
    /// `topk_group`; `None`: 1 for `copy`, `n_group` for `split`.
    pub topk_group: Option<usize>,
    /// Layers below this stay dense (default 1).
    pub first_k_dense_replace: usize,
    /// Seed of the random router weights and biases (`copy`).
    pub seed: u64,
    /// Largest output shard in bytes (default 2 GiB).
    pub max_shard_bytes: u64,
}

impl Default for MoeifyOptions {
    fn default() -> Self {
        MoeifyOptions {
            experts: 8,
            top_k: None,
            shared_fraction: 0.33,
            variant: Variant::Copy,
            routed_scaling_factor: 2.0,
            n_group: None,
            topk_group: None,
            first_k_dense_replace: 1,
            seed: 0,
            max_shard_bytes: 2 << 30,
        }
    }
}

/// How one dense MLP of width `intermediate` is cut.
#[derive(Debug, Clone, PartialEq)]
pub struct FfnSplit {
    /// Neurons of the dense MLP.
    pub intermediate: usize,
    /// Neurons `0..shared` form the shared expert.
    pub shared: usize,
    /// Zero neurons appended to the shared expert to reach
    /// `n_shared_experts · moe_intermediate_size`.
    pub shared_padding: usize,
    /// `n_shared_experts` (0 when `shared` is 0).
    pub n_shared_experts: usize,
    /// Width of one routed expert.
    pub moe_intermediate_size: usize,
    /// Source neuron range of each routed expert.
    pub routed: Vec<std::ops::Range<usize>>,
    /// Factor applied to each routed expert's `down` columns.
    pub down_scale: f32,
}

/// Cuts an MLP of width `intermediate` for `opts` (see the module docs).
///
/// `|S| = round(shared_fraction · I)`, to a multiple of 32 when `I` is one.
/// `copy`: `R` = the rest, one expert width `|R|`. `split`: `R` is trimmed to
/// a multiple of `E` (the remainder joins `S`) and cut into `E` slices.
pub fn plan_split(intermediate: usize, opts: &MoeifyOptions) -> Result<FfnSplit> {
    let e = opts.experts;
    let rsf = opts.routed_scaling_factor;
    if e == 0 {
        return Err(Error::Config("moeify: --experts must be at least 1".into()));
    }
    if !is_power_of_two(rsf) {
        return Err(Error::Config(format!(
            "moeify: routed_scaling_factor must be a power of two so the scaled down_proj weights are exact, got {rsf}"
        )));
    }
    if !(0.0..1.0).contains(&opts.shared_fraction) {
        return Err(Error::Config(format!(
            "moeify: --shared-fraction must be in [0, 1), got {}",
            opts.shared_fraction
        )));
    }
    let align = if intermediate.is_multiple_of(32) && intermediate >= 64 {
        32
    } else {
        1
    };
    let units = intermediate / align;
    let mut shared =
        ((opts.shared_fraction * units as f64).round() as usize).min(units - 1) * align;
    let (m, routed, down_scale) = match opts.variant {
        Variant::Copy => {
            let m = intermediate - shared;
            (m, vec![shared..intermediate; e], 1.0 / rsf)
        }
        Variant::Split => {
            if !e.is_power_of_two() {
                return Err(Error::Config(format!("moeify: split needs a power-of-two expert count (down is scaled by E / rsf), got {e}")));
            }
            let m = (intermediate - shared) / e;
            if m == 0 {
                return Err(Error::Config(format!(
                    "moeify: {} routed neurons cannot be split into {e} experts",
                    intermediate - shared
                )));
            }
            shared = intermediate - m * e;
            let routed = (0..e)
                .map(|j| shared + j * m..shared + (j + 1) * m)
                .collect();
            (m, routed, e as f32 / rsf)
        }
    };
    let n_shared_experts = shared.div_ceil(m);
    Ok(FfnSplit {
        intermediate,
        shared,
        shared_padding: n_shared_experts * m - shared,
        n_shared_experts,
        moe_intermediate_size: m,
        routed,
        down_scale,
    })
}

fn is_power_of_two(x: f32) -> bool {
    x.is_finite() && x > 0.0 && x.to_bits() & 0x007f_ffff == 0 && x.is_normal()
}

/// What [`moeify_checkpoint`] did.
#[derive(Debug, Clone)]
pub struct MoeifyReport {
    /// Source folder.
    pub in_dir: PathBuf,
    /// Written folder.
    pub out_dir: PathBuf,
    /// Copy or split.
    pub variant: Variant,
    /// The MLP cut used by every MoE layer.
    pub split: FfnSplit,
    /// MoE layers written (`num_hidden_layers − first_k_dense_replace`).
    pub moe_layers: usize,
    /// `num_experts_per_tok`.
    pub top_k: usize,
    /// `n_group`.
    pub n_group: usize,
    /// `topk_group`.
    pub topk_group: usize,
    /// `routed_scaling_factor`.
    pub routed_scaling_factor: f32,
    /// Parameters read.
    pub params_in: u64,
    /// Parameters written.
    pub params_out: u64,
    /// Bytes of tensors written.
    pub bytes_out: u64,
    /// Weight files written.
    pub shards: Vec<String>,
    /// Side files copied (tokenizer, generation config, ...).
    pub copied_files: Vec<String>,
    /// Wall time.
    pub elapsed: Duration,
}

impl std::fmt::Display for MoeifyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.split;
        writeln!(
            f,
            "moeify ({}): {} -> {}",
            self.variant.name(),
            self.in_dir.display(),
            self.out_dir.display()
        )?;
        writeln!(
            f,
            "  {} MoE layers: {} routed experts x {} neurons, top-{} (n_group {}, topk_group {}), routed_scaling_factor {}",
            self.moe_layers,
            s.routed.len(),
            s.moe_intermediate_size,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.routed_scaling_factor
        )?;
        writeln!(
            f,
            "  shared expert: {} of {} neurons ({} shared experts, {} zero-padding neurons); down scaled by {}",
            s.shared, s.intermediate, s.n_shared_experts, s.shared_padding, s.down_scale
        )?;
        writeln!(
            f,
            "  parameters {} -> {}, {:.1} MiB written in {:.1?}",
            self.params_in,
            self.params_out,
            self.bytes_out as f64 / (1u64 << 20) as f64,
            self.elapsed
        )?;
        writeln!(f, "  weights: {}", self.shards.join(", "))?;
        write!(f, "  copied: {}", self.copied_files.join(", "))
    }
}

/// Where one output tensor's bytes come from.
#[derive(Debug, Clone)]
enum Source {
    /// A source tensor as stored.
    Copy(String),
    /// Rows `start..start + len` of `[_, cols]` source `src`, then `pad` zero rows.
    Rows {
        src: String,
        cols: usize,
        start: usize,
        len: usize,
        pad: usize,
    },
    /// Columns `start..start + len` of `[rows, cols]` source `src`, times
    /// `scale` (a power of two), then `pad` zero columns per row.
    Cols {
        src: String,
        rows: usize,
        cols: usize,
        start: usize,
        len: usize,
        pad: usize,
        scale: f32,
    },
    /// `[rows, cols]` uniform in `[-amplitude, amplitude)` (zeros when 0), in the output dtype.
    Random {
        rows: usize,
        cols: usize,
        amplitude: f32,
        seed: u64,
    },
}

/// One tensor of the output.
#[derive(Debug, Clone)]
struct OutTensor {
    name: String,
    dtype: StoredDType,
    shape: Vec<usize>,
    source: Source,
}

impl OutTensor {
    fn bytes(&self) -> u64 {
        (self.shape.iter().product::<usize>() * self.dtype.size()) as u64
    }
}

fn read_elem(d: StoredDType, b: &[u8]) -> f32 {
    match d {
        StoredDType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        StoredDType::BF16 => caracal_kernels::dtype::bf16_to_f32(u16::from_le_bytes([b[0], b[1]])),
        _ => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
    }
}

fn write_elem(d: StoredDType, x: f32, out: &mut Vec<u8>) {
    match d {
        StoredDType::F32 => out.extend_from_slice(&x.to_le_bytes()),
        StoredDType::BF16 => {
            out.extend_from_slice(&caracal_kernels::dtype::f32_to_bf16(x).to_le_bytes())
        }
        _ => out.extend_from_slice(&half::f16::from_f32(x).to_le_bytes()),
    }
}

/// SplitMix64: a small, seedable generator for the random router.
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    fn symmetric(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Produces the bytes of `t`.
fn materialize<'a>(ckpt: &'a Checkpoint, t: &OutTensor) -> Result<Cow<'a, [u8]>> {
    let size = t.dtype.size();
    match &t.source {
        Source::Copy(name) => Ok(Cow::Borrowed(ckpt.bytes(name)?)),
        Source::Rows {
            src,
            cols,
            start,
            len,
            pad,
        } => {
            let b = ckpt.bytes(src)?;
            let row = cols * size;
            let mut out = b[start * row..(start + len) * row].to_vec();
            out.resize(out.len() + pad * row, 0);
            Ok(Cow::Owned(out))
        }
        Source::Cols {
            src,
            rows,
            cols,
            start,
            len,
            pad,
            scale,
        } => {
            let b = ckpt.bytes(src)?;
            let mut out = Vec::with_capacity(rows * (len + pad) * size);
            for r in 0..*rows {
                let row = &b[(r * cols + start) * size..(r * cols + start + len) * size];
                if *scale == 1.0 {
                    out.extend_from_slice(row);
                } else {
                    for (c, x) in row.chunks_exact(size).enumerate() {
                        let v = read_elem(t.dtype, x);
                        let before = out.len();
                        write_elem(t.dtype, v * scale, &mut out);
                        // Powers of two are exact unless the value leaves the normal range.
                        if read_elem(t.dtype, &out[before..]) / scale != v {
                            return Err(Error::Config(format!(
                                "moeify: `{src}`[{r}, {}] = {v:e} times {scale} is not exact in {}",
                                start + c,
                                t.dtype.name()
                            )));
                        }
                    }
                }
                out.resize(out.len() + pad * size, 0);
            }
            Ok(Cow::Owned(out))
        }
        Source::Random {
            rows,
            cols,
            amplitude,
            seed,
        } => {
            let mut rng = SplitMix(*seed);
            let mut out = Vec::with_capacity(rows * cols * size);
            for _ in 0..rows * cols {
                let v = if *amplitude == 0.0 {
                    0.0
                } else {
                    amplitude * rng.symmetric()
                };
                write_elem(t.dtype, v, &mut out);
            }
            Ok(Cow::Owned(out))
        }
    }
}

/// The layer index of `model.layers.{i}.…`.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// The float dtype of a dense MLP weight, checked against `shape`.
fn ffn_dtype(ckpt: &Checkpoint, name: &str, shape: [usize; 2]) -> Result<StoredDType> {
    let e = ckpt.entry(name)?;
    if e.shape != shape {
        return Err(Error::TensorShape {
            name: name.into(),
            expected: shape.to_vec(),
            found: e.shape.clone(),
        });
    }
    match e.dtype {
        d @ (StoredDType::F32 | StoredDType::BF16 | StoredDType::F16) => Ok(d),
        other => Err(Error::TensorDType {
            name: name.into(),
            expected: "f32, bf16, f16".into(),
            found: other.name().into(),
        }),
    }
}

/// The router settings implied by `opts`, validated like the loader does.
fn router_keys(opts: &MoeifyOptions, split: &FfnSplit) -> Result<LlamaMoeConfig> {
    let e = opts.experts;
    let top_k = match (opts.variant, opts.top_k) {
        (Variant::Copy, k) => k.unwrap_or(2),
        (Variant::Split, None) => e,
        (Variant::Split, Some(k)) if k == e => k,
        (Variant::Split, Some(k)) => {
            return Err(Error::Config(format!(
                "moeify: split needs top_k = experts ({e}) so that every slice runs, got {k}"
            )));
        }
    };
    let n_group = opts.n_group.unwrap_or(match opts.variant {
        Variant::Copy if e >= 4 && e.is_multiple_of(2) && top_k <= e / 2 => 2,
        _ => 1,
    });
    let topk_group = opts.topk_group.unwrap_or(match opts.variant {
        Variant::Copy => 1,
        Variant::Split => n_group,
    });
    let keys = LlamaMoeConfig {
        n_routed_experts: e,
        num_experts_per_tok: top_k,
        moe_intermediate_size: split.moe_intermediate_size,
        n_shared_experts: split.n_shared_experts,
        first_k_dense_replace: opts.first_k_dense_replace,
        moe_layer_freq: 1,
        n_group,
        topk_group,
        routed_scaling_factor: opts.routed_scaling_factor,
        norm_topk_prob: true,
        scoring_func: "sigmoid".into(),
    };
    keys.router()?;
    if opts.variant == Variant::Split && top_k != topk_group * (e / n_group) {
        return Err(Error::Config(format!("moeify: split needs every group kept (topk_group = n_group = {n_group}), got topk_group {topk_group}")));
    }
    Ok(keys)
}

/// The output tensors of MoE layer prefix `p`, replacing its dense MLP.
fn moe_tensors(
    p: &str,
    d: usize,
    dt: StoredDType,
    split: &FfnSplit,
    opts: &MoeifyOptions,
    layer: usize,
) -> Vec<OutTensor> {
    let inter = split.intermediate;
    let (g, u, dn) = (
        format!("{p}.mlp.gate_proj.weight"),
        format!("{p}.mlp.up_proj.weight"),
        format!("{p}.mlp.down_proj.weight"),
    );
    let mut out = Vec::new();
    let e = split.routed.len();
    let seed = opts
        .seed
        .wrapping_mul(0x1000_0000_01b3)
        .wrapping_add(layer as u64);
    // Copy: random router (logit std ≈ rms(x)) and a small random selection bias,
    // so choices differ per token. Split: zero router, every score 0.5.
    let (w_amp, b_amp) = match opts.variant {
        Variant::Copy => ((3.0 / d as f32).sqrt(), 0.05),
        Variant::Split => (0.0, 0.0),
    };
    out.push(OutTensor {
        name: format!("{p}.mlp.gate.weight"),
        dtype: dt,
        shape: vec![e, d],
        source: Source::Random {
            rows: e,
            cols: d,
            amplitude: w_amp,
            seed: seed.wrapping_mul(2),
        },
    });
    out.push(OutTensor {
        name: format!("{p}.mlp.gate.e_score_correction_bias"),
        dtype: StoredDType::F32,
        shape: vec![e],
        source: Source::Random {
            rows: 1,
            cols: e,
            amplitude: b_amp,
            seed: seed.wrapping_mul(2).wrapping_add(1),
        },
    });
    let m = split.moe_intermediate_size;
    let mut mlp = |prefix: String, start: usize, len: usize, pad: usize, scale: f32| {
        for (name, src) in [("gate_proj", &g), ("up_proj", &u)] {
            out.push(OutTensor {
                name: format!("{prefix}.{name}.weight"),
                dtype: dt,
                shape: vec![len + pad, d],
                source: Source::Rows {
                    src: src.clone(),
                    cols: d,
                    start,
                    len,
                    pad,
                },
            });
        }
        out.push(OutTensor {
            name: format!("{prefix}.down_proj.weight"),
            dtype: dt,
            shape: vec![d, len + pad],
            source: Source::Cols {
                src: dn.clone(),
                rows: d,
                cols: inter,
                start,
                len,
                pad,
                scale,
            },
        });
    };
    for (j, r) in split.routed.iter().enumerate() {
        mlp(
            format!("{p}.mlp.experts.{j}"),
            r.start,
            m,
            0,
            split.down_scale,
        );
    }
    if split.n_shared_experts > 0 {
        mlp(
            format!("{p}.mlp.shared_experts"),
            0,
            split.shared,
            split.shared_padding,
            1.0,
        );
    }
    out
}

/// Reads the dense `llama` checkpoint in `in_dir` and writes the MoE
/// checkpoint to `out_dir` (created; files of the same names are replaced).
/// See the module docs for the construction and the layout.
pub fn moeify_checkpoint(
    in_dir: &Path,
    out_dir: &Path,
    opts: &MoeifyOptions,
) -> Result<MoeifyReport> {
    let start = Instant::now();
    let _span = tracing::info_span!("moeify_checkpoint", in_dir = %in_dir.display(), variant = opts.variant.name()).entered();
    let cfg_path = in_dir.join("config.json");
    let mut config = read_json(&cfg_path, "config.json")?;
    let mt = config
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("(missing)");
    if mt != "llama" {
        return Err(Error::Config(format!(
            "moeify: needs a dense `llama` checkpoint, {} has model_type `{mt}`",
            cfg_path.display()
        )));
    }
    if config.get("n_routed_experts").is_some_and(|v| !v.is_null()) {
        return Err(Error::Config(format!(
            "moeify: {} is already an MoE (it has n_routed_experts)",
            cfg_path.display()
        )));
    }
    if config
        .get("mlp_bias")
        .and_then(Value::as_bool)
        .unwrap_or(false)
    {
        return Err(Error::Config(
            "moeify: mlp_bias = true is not supported".into(),
        ));
    }
    if in_dir.canonicalize().ok() == out_dir.canonicalize().ok() {
        return Err(Error::Config(
            "moeify: the output folder must differ from the input folder".into(),
        ));
    }
    let c: LlamaConfig = parse_config(&config, &cfg_path)?;
    if opts.first_k_dense_replace >= c.num_hidden_layers {
        return Err(Error::Config(format!(
            "moeify: first_k_dense_replace {} leaves no MoE layer in {} layers",
            opts.first_k_dense_replace, c.num_hidden_layers
        )));
    }
    let (d, inter) = (c.hidden_size, c.intermediate_size);
    let split = plan_split(inter, opts)?;
    let keys = router_keys(opts, &split)?;
    let ckpt = Checkpoint::open(in_dir)?;

    // Plan every output tensor, in name order with each MoE layer's MLP replaced.
    let mut plan: Vec<OutTensor> = Vec::new();
    let mut params_in = 0u64;
    let mut replaced_layers = std::collections::BTreeSet::new();
    for name in ckpt.names() {
        let e = ckpt.entry(name)?;
        params_in += e.shape.iter().product::<usize>() as u64;
        let layer =
            layer_of(name).filter(|&i| i >= opts.first_k_dense_replace && i < c.num_hidden_layers);
        match layer {
            Some(i) if name.starts_with(&format!("model.layers.{i}.mlp.")) => {
                let p = format!("model.layers.{i}");
                let known =
                    ["gate_proj", "up_proj", "down_proj"].map(|n| format!("{p}.mlp.{n}.weight"));
                if !known.iter().any(|k| k == name) {
                    return Err(Error::Config(format!("moeify: unexpected MLP tensor `{name}` (only dense float gate/up/down_proj are supported)")));
                }
                if replaced_layers.insert(i) {
                    let dt = ffn_dtype(&ckpt, &known[0], [inter, d])?;
                    for (k, shape) in known.iter().zip([[inter, d], [inter, d], [d, inter]]) {
                        if ffn_dtype(&ckpt, k, shape)? != dt {
                            return Err(Error::Config(format!(
                                "moeify: `{k}` has another dtype than `{}`",
                                known[0]
                            )));
                        }
                    }
                    plan.extend(moe_tensors(&p, d, dt, &split, opts, i));
                }
            }
            _ => plan.push(OutTensor {
                name: name.to_string(),
                dtype: e.dtype,
                shape: e.shape.clone(),
                source: Source::Copy(name.to_string()),
            }),
        }
    }
    let moe_layers = c.num_hidden_layers - opts.first_k_dense_replace;
    if replaced_layers.len() != moe_layers {
        let missing = (opts.first_k_dense_replace..c.num_hidden_layers)
            .find(|i| !replaced_layers.contains(i))
            .unwrap_or(0);
        return Err(Error::MissingTensor {
            name: format!("model.layers.{missing}.mlp.gate_proj.weight"),
        });
    }

    // Shards of at most max_shard_bytes (a single tensor may exceed it).
    let mut shards: Vec<Vec<&OutTensor>> = vec![Vec::new()];
    let mut cur = 0u64;
    for t in &plan {
        if cur > 0 && cur + t.bytes() > opts.max_shard_bytes {
            shards.push(Vec::new());
            cur = 0;
        }
        shards.last_mut().expect("starts with one shard").push(t);
        cur += t.bytes();
    }
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;
    let n_shards = shards.len();
    let shard_name = |k: usize| {
        if n_shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n_shards:05}.safetensors", k + 1)
        }
    };
    let mut weight_map = BTreeMap::new();
    let (mut bytes_out, mut params_out) = (0u64, 0u64);
    let mut shard_names = Vec::new();
    for (k, shard) in shards.iter().enumerate() {
        let file = shard_name(k);
        let path = out_dir.join(&file);
        let data = shard
            .par_iter()
            .map(|t| materialize(&ckpt, t))
            .collect::<Result<Vec<_>>>()?;
        let views = shard
            .iter()
            .zip(&data)
            .map(|(t, b)| {
                weight_map.insert(t.name.clone(), file.clone());
                bytes_out += b.len() as u64;
                params_out += t.shape.iter().product::<usize>() as u64;
                TensorView::new(st_dtype(t.dtype, &t.name)?, t.shape.clone(), b)
                    .map(|v| (t.name.clone(), v))
                    .map_err(|e| bad_write(&path, e))
            })
            .collect::<Result<Vec<_>>>()?;
        let meta = HashMap::from([
            ("format".to_string(), "pt".to_string()),
            (
                "moeified_by".to_string(),
                format!("caracal moeify --variant {}", opts.variant.name()),
            ),
        ]);
        safetensors::serialize_to_file(views, Some(meta), &path)
            .map_err(|e| bad_write(&path, e))?;
        shard_names.push(file);
    }
    // Stale weights of an earlier run would be picked up by the loader.
    for stale in ["model.safetensors", "model.safetensors.index.json"] {
        let p = out_dir.join(stale);
        if p.exists() && !shard_names.iter().any(|s| s == stale) {
            std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
        }
    }
    if n_shards > 1 {
        let index = json!({ "metadata": { "total_size": bytes_out }, "weight_map": weight_map });
        write_json(&out_dir.join("model.safetensors.index.json"), &index)?;
    }

    let obj = config
        .as_object_mut()
        .ok_or_else(|| Error::Config(format!("{} is not a JSON object", cfg_path.display())))?;
    obj.insert(
        "architectures".into(),
        json!(["CaracalLlamaMoeForCausalLM"]),
    );
    for (k, v) in [
        ("n_routed_experts", json!(keys.n_routed_experts)),
        ("num_experts_per_tok", json!(keys.num_experts_per_tok)),
        ("moe_intermediate_size", json!(keys.moe_intermediate_size)),
        ("n_shared_experts", json!(keys.n_shared_experts)),
        ("first_k_dense_replace", json!(keys.first_k_dense_replace)),
        ("moe_layer_freq", json!(1)),
        ("n_group", json!(keys.n_group)),
        ("topk_group", json!(keys.topk_group)),
        ("routed_scaling_factor", json!(keys.routed_scaling_factor)),
        ("norm_topk_prob", json!(true)),
        ("scoring_func", json!("sigmoid")),
        ("topk_method", json!("noaux_tc")),
        (
            "caracal_moeify",
            json!({
                "variant": opts.variant.name(),
                "seed": opts.seed,
                "shared_neurons": split.shared,
                "shared_padding_neurons": split.shared_padding,
                "note": "dense llama MLPs split into a shared and routed experts so that the output equals the dense model's; \
                         GQA attention is kept (MLA cannot be derived exactly); see caracal src/moeify.rs",
            }),
        ),
    ] {
        obj.insert(k.into(), v);
    }
    write_json(&out_dir.join("config.json"), &config)?;
    let copied_files = copy_side_files(in_dir, out_dir)?;
    Ok(MoeifyReport {
        in_dir: in_dir.to_path_buf(),
        out_dir: out_dir.to_path_buf(),
        variant: opts.variant,
        split,
        moe_layers,
        top_k: keys.num_experts_per_tok,
        n_group: keys.n_group,
        topk_group: keys.topk_group,
        routed_scaling_factor: keys.routed_scaling_factor,
        params_in,
        params_out,
        bytes_out,
        shards: shard_names,
        copied_files,
        elapsed: start.elapsed(),
    })
}

#[cfg(test)]
mod tests;
