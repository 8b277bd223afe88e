//! `caracal quantize --to mxfp4`: rewrite a checkpoint folder with its linear
//! weights in MXFP4, in the compressed-tensors layout.
//!
//! Which tensors ([`should_quantize`]): every 2-D `*.weight` in a float dtype
//! whose input width (`cols`) is a multiple of 32: attention and MLP
//! projections (`*_proj`), `w1`/`w2`/`w3`, routed and shared experts. Kept as
//! stored: embeddings (any name with `embed`), `lm_head` (tied embeddings
//! stay tied), norms (any name with `norm`), routers (`*.gate.weight`),
//! biases, 1-D/3-D/4-D tensors (convolutions, `A_log`, …). With
//! `experts_only` only routed experts (`*.experts.*`) are quantized, the way
//! Kimi K3 ships. The token embedding and `lm_head` follow
//! [`QuantizeOptions::embeddings`]: Q8_0 by default (int8 per 32 values with
//! an f32 scale, llama.cpp's choice for the token table of its 4-bit files),
//! MXFP4, or kept as stored; a tied table stays tied. Q8_0 is written as
//! compressed-tensors int-quantized: `{base}.weight` i8 `[rows, cols]` and
//! `{base}.weight_scale` f32 `[rows, cols/32]` (a second config group).
//!
//! Output layout (compressed-tensors `mxfp4-pack-quantized`, which is what
//! Kimi K3's expert tensors use): `{base}.weight` becomes
//! - `{base}.weight_packed` u8 `[rows, cols/2]`: two E2M1 codes per byte, the
//!   even element in the low nibble;
//! - `{base}.weight_scale` u8 `[rows, cols/32]`: one E8M0 exponent per 32
//!   consecutive elements of a row (`2^(e−127)`).
//!
//! `config.json` gets a `quantization_config`:
//!
//! ```json
//! { "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
//!   "quantization_status": "compressed",
//!   "config_groups": { "group_0": {
//!       "targets": ["Linear"],                      // or ["re:.*\\.experts\\..*"]
//!       "format": "mxfp4-pack-quantized",
//!       "weights": { "num_bits": 4, "type": "float", "strategy": "group",
//!                    "group_size": 32, "symmetric": true, "dynamic": false,
//!                    "scale_dtype": "uint8" },
//!       "input_activations": null, "output_activations": null } },
//!   "ignore": ["lm_head", "model.layers.0.mlp.gate", …],  // linear modules left as stored
//!   "kv_cache_scheme": null }
//! ```
//!
//! Every other file of the folder (tokenizer, generation config, templates)
//! is copied. Weights go to `model.safetensors`, or to
//! `model-0000k-of-0000n.safetensors` shards plus
//! `model.safetensors.index.json` when they exceed
//! [`QuantizeOptions::max_shard_bytes`]. Unquantized tensors are copied
//! byte for byte from the memory map.
//!
//! Block scales ([`ScaleRule`]): the OCP reference rule
//! (`floor(log2(amax)) − 2`, what llama.cpp and the kernels crate's
//! [`caracal_kernels::mxfp4::quantize`] use), or, by default, the exponent
//! among that one and its two neighbours with the least squared error on the
//! block. Both write plain MXFP4; the second only picks better scales.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use caracal_kernels::mxfp4::{e2m1_code, floor_log2};
use caracal_kernels::mxfp4::{BLOCK_BYTES, BLOCK_ELEMS, E2M1_VALUES, E8M0_NAN, ZERO_BLOCK_SCALE};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

use crate::checkpoint::config::read_json;
use crate::checkpoint::{Checkpoint, StoredDType};
use crate::convert::export::{bad_write, copy_side_files, st_dtype, write_json};
use crate::error::{Error, Result};

/// How a block's shared exponent is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScaleRule {
    /// OCP MX reference: `floor(log2(amax)) − 2`; bit-identical to
    /// [`caracal_kernels::mxfp4::quantize`].
    Ocp,
    /// The exponent among OCP's `e − 1`, `e`, `e + 1` with the least squared
    /// error over the block (ties keep OCP's). The default.
    #[default]
    MinMse,
}

/// How [`quantize_checkpoint`] stores the token table (embedding, `lm_head`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TableFormat {
    /// As stored in the source.
    Keep,
    /// Q8_0 (the default).
    #[default]
    Q8_0,
    /// MXFP4, like the linear weights.
    Mxfp4,
}

/// What happens to one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Keep,
    Mxfp4,
    Q8_0,
}

/// Settings of [`quantize_checkpoint`].
#[derive(Debug, Clone)]
pub struct QuantizeOptions {
    /// Quantize only routed expert weights (`*.experts.*`).
    pub experts_only: bool,
    /// Format of the token embedding and `lm_head` (tied or not) when the
    /// whole model is quantized (ignored with `experts_only`). With tied
    /// embeddings the table is the largest weight a small model streams per
    /// token: Q8_0 halves it at almost no quality cost, MXFP4 quarters it.
    pub embeddings: TableFormat,
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// Block-scale rule (default [`ScaleRule::MinMse`]).
    pub scale_rule: ScaleRule,
    /// Largest output shard in bytes before a new one starts (default 4 GiB;
    /// one tensor larger than this gets a shard of its own).
    pub max_shard_bytes: u64,
}

impl Default for QuantizeOptions {
    fn default() -> Self {
        QuantizeOptions {
            experts_only: false,
            embeddings: TableFormat::Q8_0,
            progress: false,
            scale_rule: ScaleRule::MinMse,
            max_shard_bytes: 4 << 30,
        }
    }
}

/// What [`quantize_checkpoint`] did.
#[derive(Debug, Clone)]
pub struct QuantizeReport {
    /// Source folder.
    pub in_dir: PathBuf,
    /// Written folder.
    pub out_dir: PathBuf,
    /// Weights converted to MXFP4.
    pub quantized: usize,
    /// Tensors copied as stored.
    pub kept: usize,
    /// Parameters now in MXFP4 or Q8_0.
    pub params_quantized: u64,
    /// Token tables (embedding, `lm_head`) written as Q8_0.
    pub q8_0_tables: Vec<String>,
    /// Parameters left as stored.
    pub params_kept: u64,
    /// Tensor bytes read from the source.
    pub bytes_in: u64,
    /// Tensor bytes written.
    pub bytes_out: u64,
    /// `‖W − Q(W)‖ / ‖W‖` over all quantized weights together.
    pub relative_rms_error: f64,
    /// Linear modules left unquantized (the config's `ignore` list).
    pub ignored: Vec<String>,
    /// Safetensors files written.
    pub shards: Vec<String>,
    /// Other files copied.
    pub copied_files: Vec<String>,
    /// Wall time.
    pub elapsed: Duration,
}

impl std::fmt::Display for QuantizeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mb = |b: u64| b as f64 / 1e6;
        writeln!(
            f,
            "quantized {} weights to MXFP4{} ({} params); kept {} tensors ({} params)",
            self.quantized,
            if self.q8_0_tables.is_empty() {
                String::new()
            } else {
                format!(" and {} to Q8_0", self.q8_0_tables.join(", "))
            },
            self.params_quantized,
            self.kept,
            self.params_kept
        )?;
        writeln!(
            f,
            "tensor bytes {:.1} MB -> {:.1} MB ({:.2}x); relative RMS weight error {:.4}",
            mb(self.bytes_in),
            mb(self.bytes_out),
            self.bytes_in as f64 / self.bytes_out.max(1) as f64,
            self.relative_rms_error
        )?;
        writeln!(
            f,
            "wrote {} in {:.1} s: {}",
            self.out_dir.display(),
            self.elapsed.as_secs_f64(),
            self.shards.join(", ")
        )?;
        if !self.copied_files.is_empty() {
            writeln!(f, "copied {}", self.copied_files.join(", "))?;
        }
        Ok(())
    }
}

/// Whether weight `name` of `shape` and `dtype` is converted (see the module docs).
pub fn should_quantize(
    name: &str,
    shape: &[usize],
    dtype: StoredDType,
    experts_only: bool,
) -> bool {
    let Some(base) = name.strip_suffix(".weight") else {
        return false;
    };
    let [rows, cols] = shape else { return false };
    if !matches!(
        dtype,
        StoredDType::F32 | StoredDType::BF16 | StoredDType::F16
    ) || *rows == 0
        || !cols.is_multiple_of(BLOCK_ELEMS)
        || *cols == 0
    {
        return false;
    }
    if !is_linear_module(base) {
        return false;
    }
    !experts_only || base.contains(".experts.")
}

/// Whether `name` is the token embedding or the LM head (what
/// [`QuantizeOptions::embeddings`] adds), 2-D float with `cols % 32 == 0`.
pub fn is_token_table(name: &str, shape: &[usize], dtype: StoredDType) -> bool {
    let Some(base) = name.strip_suffix(".weight") else {
        return false;
    };
    let table = base == "lm_head" || base.ends_with(".lm_head") || base.ends_with("embed_tokens");
    table
        && matches!(shape, [r, c] if *r > 0 && *c > 0 && c.is_multiple_of(BLOCK_ELEMS))
        && matches!(
            dtype,
            StoredDType::F32 | StoredDType::BF16 | StoredDType::F16
        )
}

/// Whether module `base` (a name without `.weight`) is a linear layer that
/// quantization may touch: not an embedding, `lm_head`, norm or router.
fn is_linear_module(base: &str) -> bool {
    let last = base.rsplit('.').next().unwrap_or(base);
    !(base.contains("embed")
        || base == "lm_head"
        || base.ends_with(".lm_head")
        || base.contains("norm")
        || last == "gate")
}

/// `2^e` as an f32 for `e` in [−149, 127].
fn pow2(e: i32) -> f32 {
    if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (e + 149))
    }
}

/// Encodes `x` with shared exponent `exp`; returns the codes and the squared error.
fn encode_with(x: &[f32; BLOCK_ELEMS], exp: i32) -> ([u8; BLOCK_BYTES], f64) {
    // Dividing by 2^exp exactly: multiply by 2^-exp when it is a normal f32.
    let (scale, inv) = (pow2(exp), pow2(-exp.clamp(-127, 126)));
    let mut out = [0u8; BLOCK_BYTES];
    let mut err = 0.0f64;
    for (j, o) in out.iter_mut().enumerate() {
        let (a, b) = (x[2 * j], x[2 * j + 1]);
        let (ca, cb) = if exp == 127 {
            (e2m1_code(a / scale), e2m1_code(b / scale))
        } else {
            (e2m1_code(a * inv), e2m1_code(b * inv))
        };
        let da = (E2M1_VALUES[ca as usize] * scale - a) as f64;
        let db = (E2M1_VALUES[cb as usize] * scale - b) as f64;
        err += da * da + db * db;
        *o = ca | (cb << 4);
    }
    (out, err)
}

/// Encodes one block of 32 values: packed codes, scale byte, squared error.
pub fn quantize_block_with(
    x: &[f32; BLOCK_ELEMS],
    rule: ScaleRule,
) -> ([u8; BLOCK_BYTES], u8, f64) {
    if x.iter().any(|v| !v.is_finite()) {
        return ([0; BLOCK_BYTES], E8M0_NAN, 0.0);
    }
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        return ([0; BLOCK_BYTES], ZERO_BLOCK_SCALE, 0.0);
    }
    let e0 = (floor_log2(amax) - 2).clamp(-127, 127);
    let (mut best, mut best_err) = encode_with(x, e0);
    let mut best_e = e0;
    if rule == ScaleRule::MinMse {
        for e in [e0 - 1, e0 + 1] {
            if (-127..=127).contains(&e) {
                let (codes, err) = encode_with(x, e);
                if err < best_err {
                    (best, best_err, best_e) = (codes, err, e);
                }
            }
        }
    }
    (best, (best_e + 127) as u8, best_err)
}

/// Quantizes a row-major `[rows, cols]` matrix (cols a multiple of 32) in
/// parallel over rows: `(packed [rows, cols/2], scales [rows, cols/32], squared error)`.
pub fn quantize_matrix(
    w: &[f32],
    rows: usize,
    cols: usize,
    rule: ScaleRule,
) -> Result<(Vec<u8>, Vec<u8>, f64)> {
    if !cols.is_multiple_of(BLOCK_ELEMS) || w.len() != rows * cols {
        return Err(Error::Config(format!(
            "cannot quantize [{rows}, {cols}] from {} values (cols must be a multiple of 32)",
            w.len()
        )));
    }
    let nb = cols / BLOCK_ELEMS;
    let mut packed = vec![0u8; rows * nb * BLOCK_BYTES];
    let mut scales = vec![0u8; rows * nb];
    let err: f64 = packed
        .par_chunks_mut(nb * BLOCK_BYTES)
        .zip(scales.par_chunks_mut(nb))
        .zip(w.par_chunks(cols))
        .map(|((p, s), row)| {
            let mut e = 0.0;
            for (k, x) in row.chunks_exact(BLOCK_ELEMS).enumerate() {
                let (codes, scale, err) = quantize_block_with(
                    x.try_into().expect("chunks_exact yields whole blocks"),
                    rule,
                );
                p[k * BLOCK_BYTES..(k + 1) * BLOCK_BYTES].copy_from_slice(&codes);
                s[k] = scale;
                e += err;
            }
            e
        })
        .sum();
    Ok((packed, scales, err))
}

/// One output tensor: borrowed from the source map or newly encoded.
enum OutData<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
}

/// One planned output tensor.
struct Planned<'a> {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: OutData<'a>,
}

/// Q8_0 encoding of a `[rows, cols]` f32 weight
/// ([`caracal_kernels::q8::quantize`]): the int8 values and the f32 block
/// scales as little-endian bytes, and the summed squared error `Σ (w − d·q)²`.
pub fn quantize_q8_0_matrix(
    w: &[f32],
    rows: usize,
    cols: usize,
) -> Result<(Vec<u8>, Vec<u8>, f64)> {
    use caracal_kernels::q8;
    let (qv, d) = q8::quantize(w, rows, cols)?;
    let err = w
        .par_chunks(q8::BLOCK)
        .zip(qv.par_chunks(q8::BLOCK))
        .zip(d.par_iter())
        .map(|((wb, qb), &s)| {
            wb.iter()
                .zip(qb)
                .map(|(&a, &c)| (a as f64 - c as f64 * s as f64).powi(2))
                .sum::<f64>()
        })
        .sum::<f64>();
    Ok((
        qv.iter().map(|&v| v as u8).collect(),
        d.iter().flat_map(|v| v.to_le_bytes()).collect(),
        err,
    ))
}

/// The `quantization_config` written into `config.json`; `q8_tables` lists
/// the token tables stored as Q8_0 (a second, int-quantized group).
pub fn quantization_config(experts_only: bool, ignore: &[String], q8_tables: &[String]) -> Value {
    let targets = if experts_only {
        json!(["re:.*\\.experts\\..*"])
    } else {
        json!(["Linear"])
    };
    let mut cfg = json!({
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": targets,
                "format": "mxfp4-pack-quantized",
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": 32,
                    "symmetric": true,
                    "dynamic": false,
                    "scale_dtype": "uint8"
                },
                "input_activations": null,
                "output_activations": null
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": null
    });
    if !q8_tables.is_empty() {
        cfg["format"] = json!("mixed-precision");
        cfg["config_groups"]["group_1"] = json!({
            "targets": q8_tables,
            "format": "int-quantized",
            "weights": {
                "num_bits": 8,
                "type": "int",
                "strategy": "group",
                "group_size": 32,
                "symmetric": true,
                "dynamic": false,
                "scale_dtype": "float32"
            },
            "input_activations": null,
            "output_activations": null
        });
    }
    cfg
}

/// Reads `in_dir`, writes the MXFP4 checkpoint to `out_dir` (created; files
/// of the same names are replaced). See the module docs for what changes.
pub fn quantize_checkpoint(
    in_dir: &Path,
    out_dir: &Path,
    opts: &QuantizeOptions,
) -> Result<QuantizeReport> {
    let start = Instant::now();
    let _span = tracing::info_span!("quantize_checkpoint", in_dir = %in_dir.display()).entered();
    let cfg_path = in_dir.join("config.json");
    let mut config = read_json(&cfg_path, "config.json")?;
    if config
        .get("quantization_config")
        .is_some_and(|q| !q.is_null())
    {
        return Err(Error::Config(format!(
            "{} is already quantized (it has a quantization_config)",
            cfg_path.display()
        )));
    }
    if in_dir.canonicalize().ok() == out_dir.canonicalize().ok() {
        return Err(Error::Config(
            "the output folder must differ from the input folder".into(),
        ));
    }
    let ckpt = Checkpoint::open(in_dir)?;
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;

    // Plan: which tensors become MXFP4, in name order, and their output sizes.
    let names = ckpt.names();
    let table = if opts.experts_only {
        TableFormat::Keep
    } else {
        opts.embeddings
    };
    let mut ignored = if table == TableFormat::Mxfp4 {
        Vec::new()
    } else {
        vec!["lm_head".to_string()]
    };
    let mut q8_tables = Vec::new();
    let mut todo: Vec<(&str, Action, u64)> = Vec::with_capacity(names.len());
    let (mut quantized, mut kept, mut pq, mut pk, mut bytes_in) =
        (0usize, 0usize, 0u64, 0u64, 0u64);
    for &name in &names {
        let e = ckpt.entry(name)?;
        bytes_in += e.len as u64;
        let numel = e.shape.iter().product::<usize>() as u64;
        let is_table = is_token_table(name, &e.shape, e.dtype);
        let action = if should_quantize(name, &e.shape, e.dtype, opts.experts_only)
            || (is_table && table == TableFormat::Mxfp4)
        {
            Action::Mxfp4
        } else if is_table && table == TableFormat::Q8_0 {
            Action::Q8_0
        } else {
            Action::Keep
        };
        if action == Action::Mxfp4 {
            quantized += 1;
            pq += numel;
            todo.push((name, action, numel / 2 + numel / BLOCK_ELEMS as u64));
        } else if action == Action::Q8_0 {
            pq += numel;
            if let Some(base) = name.strip_suffix(".weight") {
                q8_tables.push(base.to_string());
            }
            todo.push((name, action, numel + numel / BLOCK_ELEMS as u64 * 4));
        } else {
            kept += 1;
            pk += numel;
            if let Some(base) = name.strip_suffix(".weight") {
                if e.shape.len() == 2 && is_linear_module(base) {
                    ignored.push(base.to_string());
                }
            }
            todo.push((name, action, e.len as u64));
        }
    }
    ignored.sort();
    ignored.dedup();
    let mut shards: Vec<Vec<(&str, Action)>> = vec![Vec::new()];
    let mut cur = 0u64;
    for &(name, q, size) in &todo {
        if cur > 0 && cur + size > opts.max_shard_bytes {
            shards.push(Vec::new());
            cur = 0;
        }
        shards
            .last_mut()
            .expect("starts with one shard")
            .push((name, q));
        cur += size;
    }

    let pb = if opts.progress {
        let pb = ProgressBar::new(bytes_in);
        pb.set_style(
            ProgressStyle::with_template(
                "{msg:<12} [{bar:40}] {bytes}/{total_bytes} {elapsed} (eta {eta})",
            )
            .expect("static progress template is valid")
            .progress_chars("=> "),
        );
        pb.set_message("quantizing");
        pb
    } else {
        ProgressBar::hidden()
    };
    let n_shards = shards.len();
    let shard_name = |k: usize| {
        if n_shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n_shards:05}.safetensors", k + 1)
        }
    };
    let (mut bytes_out, mut sq_err, mut sq_norm) = (0u64, 0.0f64, 0.0f64);
    let mut weight_map = BTreeMap::new();
    let mut shard_names = Vec::new();
    for (k, shard) in shards.iter().enumerate() {
        let mut planned = Vec::with_capacity(shard.len() * 2);
        for &(name, q) in shard {
            let e = ckpt.entry(name)?.clone();
            if q != Action::Keep {
                let (rows, cols) = (e.shape[0], e.shape[1]);
                let w = ckpt.tensor_f32(name, &e.shape)?;
                sq_norm += w.par_iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>();
                let base = name
                    .strip_suffix(".weight")
                    .expect("should_quantize and is_token_table checked the suffix");
                // The values tensor, the scales' bytes and dtype, the squared error.
                let (values, scales, scale_dtype, err) = if q == Action::Q8_0 {
                    let (v, d, err) = quantize_q8_0_matrix(&w, rows, cols)?;
                    let values = Planned {
                        name: name.to_string(),
                        dtype: Dtype::I8,
                        shape: vec![rows, cols],
                        data: OutData::Owned(v),
                    };
                    (values, d, Dtype::F32, err)
                } else {
                    let (packed, scales, err) = quantize_matrix(&w, rows, cols, opts.scale_rule)?;
                    let values = Planned {
                        name: format!("{base}.weight_packed"),
                        dtype: Dtype::U8,
                        shape: vec![rows, cols / 2],
                        data: OutData::Owned(packed),
                    };
                    (values, scales, Dtype::U8, err)
                };
                sq_err += err;
                planned.push(values);
                planned.push(Planned {
                    name: format!("{base}.weight_scale"),
                    dtype: scale_dtype,
                    shape: vec![rows, cols / BLOCK_ELEMS],
                    data: OutData::Owned(scales),
                });
            } else {
                planned.push(Planned {
                    name: name.to_string(),
                    dtype: st_dtype(e.dtype, name)?,
                    shape: e.shape.clone(),
                    data: OutData::Borrowed(ckpt.bytes(name)?),
                });
            }
            pb.inc(e.len as u64);
        }
        let file = shard_name(k);
        let path = out_dir.join(&file);
        let views = planned
            .iter()
            .map(|p| {
                let bytes: &[u8] = match &p.data {
                    OutData::Borrowed(b) => b,
                    OutData::Owned(v) => v,
                };
                weight_map.insert(p.name.clone(), file.clone());
                bytes_out += bytes.len() as u64;
                TensorView::new(p.dtype, p.shape.clone(), bytes)
                    .map(|v| (p.name.clone(), v))
                    .map_err(|e| bad_write(&path, e))
            })
            .collect::<Result<Vec<_>>>()?;
        let meta = HashMap::from([
            ("format".to_string(), "pt".to_string()),
            (
                "quantized_by".to_string(),
                "caracal quantize --to mxfp4".to_string(),
            ),
            ("scale_rule".to_string(), format!("{:?}", opts.scale_rule)),
        ]);
        pb.set_message(format!("writing {file}"));
        safetensors::serialize_to_file(views, Some(meta), &path)
            .map_err(|e| bad_write(&path, e))?;
        shard_names.push(file);
    }
    pb.finish_and_clear();

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
    if let Some(obj) = config.as_object_mut() {
        obj.insert(
            "quantization_config".into(),
            quantization_config(opts.experts_only, &ignored, &q8_tables),
        );
    }
    write_json(&out_dir.join("config.json"), &config)?;
    let copied_files = copy_side_files(in_dir, out_dir)?;

    Ok(QuantizeReport {
        in_dir: in_dir.to_path_buf(),
        out_dir: out_dir.to_path_buf(),
        quantized,
        kept,
        params_quantized: pq,
        params_kept: pk,
        bytes_in,
        bytes_out,
        q8_0_tables: q8_tables,
        relative_rms_error: if sq_norm > 0.0 {
            (sq_err / sq_norm).sqrt()
        } else {
            0.0
        },
        ignored,
        shards: shard_names,
        copied_files,
        elapsed: start.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic weights in [-0.1, 0.1).
    fn lcg_values(n: usize, seed: u64) -> Vec<f32> {
        caracal_kernels::testing::Rng::seeded(seed).vec(n, 0.1)
    }

    #[test]
    fn ocp_rule_is_bit_identical_to_the_kernels_encoder() {
        let (rows, cols) = (7, 96);
        let mut w = lcg_values(rows * cols, 3);
        w[5] = 0.0;
        w[40] = 1e-30; // deep subnormal-range block member
        for v in &mut w[64..96] {
            *v = 0.0; // an all-zero block
        }
        let (p, s, _) = quantize_matrix(&w, rows, cols, ScaleRule::Ocp).unwrap();
        let (kp, ks) = caracal_kernels::mxfp4::quantize(&w, rows, cols).unwrap();
        assert_eq!(p, kp);
        assert_eq!(s, ks);
    }

    #[test]
    fn min_mse_error_is_never_above_ocp_and_matches_decoded_error() {
        let (rows, cols) = (16, 256);
        let w = lcg_values(rows * cols, 11);
        let (_, _, e_ocp) = quantize_matrix(&w, rows, cols, ScaleRule::Ocp).unwrap();
        let (p, s, e_mse) = quantize_matrix(&w, rows, cols, ScaleRule::MinMse).unwrap();
        assert!(e_mse <= e_ocp, "{e_mse} > {e_ocp}");
        // The reported error is the squared error of the decoded values (f64 sum; rel. tol 1e-9).
        let d = caracal_kernels::mxfp4::dequantize(&p, &s, rows, cols).unwrap();
        let direct: f64 = d
            .iter()
            .zip(&w)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        assert!(
            (direct - e_mse).abs() <= 1e-9 * direct.max(1e-30),
            "{direct} vs {e_mse}"
        );
    }

    #[test]
    fn min_mse_picks_a_larger_scale_when_saturation_costs_more() {
        // amax = 5.5 in a block whose other values are 5.5 too: OCP's exponent
        // (floor(log2 5.5) - 2 = 0) rounds 5.5 to 6 (error 0.5 each), exponent 1
        // gives 3·2 = 6 as well, so the choice stays OCP's. With 7.9 OCP (e = 0)
        // saturates to 6 (error 1.9) while e = 1 encodes 4·2 = 8 (error 0.1).
        let x = [7.9f32; BLOCK_ELEMS];
        let (_, s_ocp, _) = quantize_block_with(&x, ScaleRule::Ocp);
        let (_, s_mse, err) = quantize_block_with(&x, ScaleRule::MinMse);
        assert_eq!(s_ocp, 127);
        assert_eq!(s_mse, 128);
        assert!((err - 32.0 * 0.01).abs() < 1e-4, "{err}");
        let same = [5.5f32; BLOCK_ELEMS];
        assert_eq!(quantize_block_with(&same, ScaleRule::MinMse).1, 127);
    }

    #[test]
    fn selects_linear_weights_and_skips_embeddings_norms_routers() {
        let f = StoredDType::BF16;
        assert!(should_quantize(
            "model.layers.0.self_attn.q_proj.weight",
            &[64, 64],
            f,
            false
        ));
        assert!(should_quantize(
            "model.layers.1.block_sparse_moe.experts.3.w2.weight",
            &[64, 32],
            f,
            false
        ));
        assert!(!should_quantize(
            "model.layers.0.self_attn.q_proj.weight",
            &[64, 64],
            f,
            true
        ));
        assert!(should_quantize(
            "model.layers.1.mlp.experts.0.down_proj.weight",
            &[64, 32],
            f,
            true
        ));
        assert!(!should_quantize(
            "model.layers.1.mlp.shared_experts.down_proj.weight",
            &[64, 32],
            f,
            true
        ));
        assert!(!should_quantize(
            "model.embed_tokens.weight",
            &[512, 64],
            f,
            false
        ));
        assert!(!should_quantize("lm_head.weight", &[512, 64], f, false));
        assert!(!should_quantize(
            "model.layers.1.mlp.gate.weight",
            &[8, 64],
            StoredDType::F32,
            false
        ));
        assert!(!should_quantize(
            "model.layers.0.input_layernorm.weight",
            &[64],
            f,
            false
        ));
        assert!(!should_quantize(
            "model.layers.0.self_attn.kv_a_layernorm.weight",
            &[32],
            f,
            false
        ));
        assert!(
            !should_quantize("model.layers.0.self_attn.x.weight", &[64, 48], f, false),
            "48 is not a multiple of 32"
        );
        assert!(!should_quantize(
            "model.layers.0.self_attn.q_conv1d.weight",
            &[64, 1, 4],
            f,
            false
        ));
        assert!(!should_quantize(
            "model.layers.0.mlp.up_proj.bias",
            &[64],
            f,
            false
        ));
    }
}
