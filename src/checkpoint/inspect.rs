//! `caracal inspect`: what a checkpoint holds, and how healthy its MXFP4
//! weights look.
//!
//! [`inspect`] takes a checkpoint folder (safetensors, single or sharded) or
//! a `.gguf` file (delegated to [`crate::checkpoint::gguf::gguf_info`]). For a folder it
//! reports every tensor (name, stored dtype, shape, bytes, parameters), a
//! grouped summary where layer and expert indices are folded into `*`
//! (`model.layers.*.mlp.experts.*.w1.weight_packed`), totals per dtype, and
//! for MXFP4 weights the distribution of their E8M0 block scales per expert:
//!
//! - compressed-tensors pairs `{base}.weight_packed` + `{base}.weight_scale`
//!   (an expert is `….experts.{j}.…` in the name);
//! - gpt-oss fused tensors `{base}_blocks` `[E, R, cols/32, 16]` +
//!   `{base}_scales` `[E, R, cols/32]` (an expert is an index of dim 0).
//!
//! Per expert (or per tensor, for weights outside experts): block count,
//! min / median / max exponent (`scale − 127`), a histogram of exponents,
//! NaN scales (`0xFF`, which make a whole block NaN), blocks that use the
//! largest code ±6, and **saturated** blocks: ±6 codes under the largest
//! finite scale (`0xFE`), i.e. values the format could not go beyond.
//! Reading the codes touches every packed byte (a full pass over the
//! weights, in parallel); scales alone are 1/16 of that.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::Serialize;

use crate::checkpoint::config::read_json;
use crate::checkpoint::gguf::{gguf_info, GgufInfo};
use crate::checkpoint::{mxfp4_role, Checkpoint, Mxfp4Role, StoredDType};
use crate::error::{Error, Result};
use caracal_kernels::mxfp4::{BLOCK_BYTES, E8M0_NAN};

/// The largest finite E8M0 scale byte (`2^127`).
const E8M0_MAX_FINITE: u8 = 0xFE;

/// One stored tensor.
#[derive(Debug, Clone, Serialize)]
pub struct TensorRow {
    /// Name in the checkpoint.
    pub name: String,
    /// Stored dtype (`bf16`, `u8`, …).
    pub dtype: String,
    /// Stored shape.
    pub shape: Vec<usize>,
    /// Bytes on disk.
    pub bytes: u64,
    /// Logical parameters (two per packed MXFP4 byte, none for scales).
    pub params: u64,
}

/// Tensors whose names differ only in layer / expert indices.
#[derive(Debug, Clone, Serialize)]
pub struct GroupRow {
    /// The name with every numeric component replaced by `*`.
    pub pattern: String,
    /// Stored dtype.
    pub dtype: String,
    /// Shape of the first tensor of the group.
    pub shape: Vec<usize>,
    /// Tensors in the group.
    pub count: usize,
    /// Bytes of all of them.
    pub bytes: u64,
    /// Parameters of all of them.
    pub params: u64,
}

/// Totals of one stored dtype.
#[derive(Debug, Clone, Serialize)]
pub struct DtypeRow {
    /// Stored dtype.
    pub dtype: String,
    /// Tensors.
    pub count: usize,
    /// Bytes.
    pub bytes: u64,
}

/// The E8M0 block scales of some MXFP4 weights.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleStats {
    /// Blocks of 32 weights.
    pub blocks: u64,
    /// Blocks per scale byte (256 entries; exponent = index − 127).
    pub hist: Vec<u64>,
    /// Blocks whose scale is NaN (`0xFF`).
    pub nan_scales: u64,
    /// Blocks holding at least one ±6 code (the largest E2M1 magnitude).
    pub max_code_blocks: u64,
    /// Blocks holding a ±6 code under the largest finite scale (`0xFE`).
    pub saturated: u64,
}

impl Default for ScaleStats {
    fn default() -> Self {
        ScaleStats {
            blocks: 0,
            hist: vec![0; 256],
            nan_scales: 0,
            max_code_blocks: 0,
            saturated: 0,
        }
    }
}

impl ScaleStats {
    /// Adds the blocks of a packed `[n, 16]` slice and its `[n]` scales.
    pub fn add(&mut self, packed: &[u8], scales: &[u8]) {
        for (block, &s) in packed.chunks_exact(BLOCK_BYTES).zip(scales) {
            self.blocks += 1;
            self.hist[s as usize] += 1;
            let max_code = block.iter().any(|&b| b & 7 == 7 || (b >> 4) & 7 == 7);
            if s == E8M0_NAN {
                self.nan_scales += 1;
            } else if max_code {
                self.max_code_blocks += 1;
                if s == E8M0_MAX_FINITE {
                    self.saturated += 1;
                }
            }
        }
    }

    /// Merges `other` into `self`.
    pub fn merge(&mut self, other: &ScaleStats) {
        self.blocks += other.blocks;
        for (a, b) in self.hist.iter_mut().zip(&other.hist) {
            *a += b;
        }
        self.nan_scales += other.nan_scales;
        self.max_code_blocks += other.max_code_blocks;
        self.saturated += other.saturated;
    }

    /// Smallest exponent of a finite scale.
    pub fn min_exp(&self) -> Option<i32> {
        self.hist[..255]
            .iter()
            .position(|&c| c > 0)
            .map(|i| i as i32 - 127)
    }

    /// Largest exponent of a finite scale.
    pub fn max_exp(&self) -> Option<i32> {
        self.hist[..255]
            .iter()
            .rposition(|&c| c > 0)
            .map(|i| i as i32 - 127)
    }

    /// Median exponent of the finite scales (the lower median).
    pub fn median_exp(&self) -> Option<i32> {
        let finite: u64 = self.hist[..255].iter().sum();
        if finite == 0 {
            return None;
        }
        let mut seen = 0;
        for (i, &c) in self.hist[..255].iter().enumerate() {
            seen += c;
            if 2 * seen >= finite {
                return Some(i as i32 - 127);
            }
        }
        None
    }

    /// The exponent histogram from min to max as a one-line bar chart
    /// (one character per exponent, at most 24; wider ranges are binned).
    pub fn sparkline(&self) -> String {
        const BARS: [char; 9] = [' ', '▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
        let (Some(lo), Some(hi)) = (self.min_exp(), self.max_exp()) else {
            return String::new();
        };
        let span = (hi - lo + 1) as usize;
        let per = span.div_ceil(24);
        let bins: Vec<u64> = (0..span.div_ceil(per))
            .map(|b| {
                (0..per)
                    .map(|k| lo + (b * per + k) as i32)
                    .filter(|&e| e <= hi)
                    .map(|e| self.hist[(e + 127) as usize])
                    .sum()
            })
            .collect();
        let top = *bins.iter().max().unwrap_or(&1) as f64;
        bins.iter()
            .map(|&c| {
                if c == 0 {
                    BARS[0]
                } else {
                    BARS[1 + ((c as f64 / top) * 7.0).round() as usize]
                }
            })
            .collect()
    }
}

/// Scale statistics of one expert (or one non-expert weight).
#[derive(Debug, Clone, Serialize)]
pub struct ExpertScales {
    /// `….experts` for experts, else the weight's base name.
    pub scope: String,
    /// The expert index, when the weights belong to one.
    pub expert: Option<usize>,
    /// MXFP4 matrices counted (gate, up, down, …).
    pub matrices: usize,
    /// The statistics.
    pub stats: ScaleStats,
}

/// Everything [`inspect`] found in a checkpoint folder.
#[derive(Debug, Clone, Serialize)]
pub struct CheckpointReport {
    /// The folder.
    pub dir: PathBuf,
    /// `model_type` of `config.json`, if any.
    pub model_type: Option<String>,
    /// `quantization_config.quant_method` / `format`, if any.
    pub quantization: Option<String>,
    /// Safetensors files.
    pub shards: Vec<String>,
    /// Every tensor, by name.
    pub tensors: Vec<TensorRow>,
    /// Grouped summary, by pattern.
    pub groups: Vec<GroupRow>,
    /// Totals per dtype.
    pub dtypes: Vec<DtypeRow>,
    /// Logical parameters.
    pub params: u64,
    /// Tensor bytes.
    pub bytes: u64,
    /// MXFP4 scale statistics per expert / weight, in name order.
    pub mxfp4: Vec<ExpertScales>,
    /// All MXFP4 scales together.
    pub mxfp4_total: ScaleStats,
}

/// What [`inspect`] returns.
#[derive(Debug, Clone)]
pub enum InspectReport {
    /// A safetensors checkpoint folder.
    Checkpoint(Box<CheckpointReport>),
    /// A GGUF file.
    Gguf(Box<GgufInfo>),
}

/// `name` with every purely numeric dot-separated component replaced by `*`.
pub fn name_pattern(name: &str) -> String {
    name.split('.')
        .map(|c| {
            if !c.is_empty() && c.bytes().all(|b| b.is_ascii_digit()) {
                "*"
            } else {
                c
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// Splits `….experts.{j}.rest` into (`….experts`, j).
fn expert_of(base: &str) -> Option<(String, usize)> {
    let idx = base.find(".experts.")?;
    let rest = &base[idx + ".experts.".len()..];
    let j: usize = rest.split('.').next()?.parse().ok()?;
    Some((base[..idx + ".experts".len()].to_string(), j))
}

/// One MXFP4 piece to scan: (scope, expert, packed bytes, scale bytes).
type Piece<'a> = (String, Option<usize>, &'a [u8], &'a [u8]);

/// Inspects a checkpoint folder or a `.gguf` file.
pub fn inspect(path: &Path) -> Result<InspectReport> {
    if path.is_file() {
        let mut magic = [0u8; 4];
        let is_gguf = std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
            .is_ok()
            && &magic == b"GGUF"
            || path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        if is_gguf {
            let info = gguf_info(path).map_err(|e| Error::BadFile {
                what: "GGUF file",
                path: path.to_path_buf(),
                detail: e.to_string(),
            })?;
            return Ok(InspectReport::Gguf(Box::new(info)));
        }
        return Err(Error::Config(format!(
            "{} is a file but not a GGUF; pass a checkpoint folder",
            path.display()
        )));
    }
    Ok(InspectReport::Checkpoint(Box::new(inspect_checkpoint(
        path,
    )?)))
}

/// Inspects a safetensors checkpoint folder.
pub fn inspect_checkpoint(dir: &Path) -> Result<CheckpointReport> {
    let ckpt = Checkpoint::open(dir)?;
    let cfg_path = dir.join("config.json");
    let config = if cfg_path.exists() {
        Some(read_json(&cfg_path, "config.json")?)
    } else {
        None
    };
    let model_type = config
        .as_ref()
        .and_then(|c| c.get("model_type"))
        .and_then(|v| v.as_str())
        .map(String::from);
    let quantization = config
        .as_ref()
        .and_then(|c| c.get("quantization_config"))
        .filter(|q| !q.is_null())
        .map(|q| {
            let m = q
                .get("quant_method")
                .and_then(|v| v.as_str())
                .unwrap_or("?");
            match q.get("format").and_then(|v| v.as_str()) {
                Some(f) => format!("{m} / {f}"),
                None => m.to_string(),
            }
        });

    let mut tensors = Vec::new();
    let mut groups: BTreeMap<(String, String), GroupRow> = BTreeMap::new();
    let mut dtypes: BTreeMap<String, DtypeRow> = BTreeMap::new();
    for name in ckpt.names() {
        let e = ckpt.entry(name)?;
        let numel = e.shape.iter().product::<usize>() as u64;
        let params = match mxfp4_role(name, e.dtype) {
            Some(Mxfp4Role::Packed) => 2 * numel,
            Some(Mxfp4Role::Scales) => 0,
            None => numel,
        };
        let row = TensorRow {
            name: name.to_string(),
            dtype: e.dtype.name().to_string(),
            shape: e.shape.clone(),
            bytes: e.len as u64,
            params,
        };
        let pattern = name_pattern(name);
        let g = groups
            .entry((pattern.clone(), row.dtype.clone()))
            .or_insert_with(|| GroupRow {
                pattern,
                dtype: row.dtype.clone(),
                shape: row.shape.clone(),
                count: 0,
                bytes: 0,
                params: 0,
            });
        g.count += 1;
        g.bytes += row.bytes;
        g.params += params;
        let d = dtypes.entry(row.dtype.clone()).or_insert_with(|| DtypeRow {
            dtype: row.dtype.clone(),
            count: 0,
            bytes: 0,
        });
        d.count += 1;
        d.bytes += row.bytes;
        tensors.push(row);
    }

    let pieces = mxfp4_pieces(&ckpt)?;
    let per_piece: Vec<(String, Option<usize>, ScaleStats)> = pieces
        .into_par_iter()
        .map(|(scope, expert, packed, scales)| {
            let mut s = ScaleStats::default();
            s.add(packed, scales);
            (scope, expert, s)
        })
        .collect();
    let mut by_expert: BTreeMap<(String, Option<usize>), ExpertScales> = BTreeMap::new();
    let mut total = ScaleStats::default();
    for (scope, expert, s) in per_piece {
        total.merge(&s);
        let x = by_expert
            .entry((scope.clone(), expert))
            .or_insert_with(|| ExpertScales {
                scope,
                expert,
                matrices: 0,
                stats: ScaleStats::default(),
            });
        x.matrices += 1;
        x.stats.merge(&s);
    }

    let params = tensors.iter().map(|t| t.params).sum();
    let bytes = tensors.iter().map(|t| t.bytes).sum();
    Ok(CheckpointReport {
        dir: dir.to_path_buf(),
        model_type,
        quantization,
        shards: ckpt.shard_names.clone(),
        tensors,
        groups: groups.into_values().collect(),
        dtypes: dtypes.into_values().collect(),
        params,
        bytes,
        mxfp4: by_expert.into_values().collect(),
        mxfp4_total: total,
    })
}

/// Every MXFP4 matrix of the checkpoint, split per expert.
fn mxfp4_pieces(ckpt: &Checkpoint) -> Result<Vec<Piece<'_>>> {
    let mut out = Vec::new();
    for name in ckpt.names() {
        let e = ckpt.entry(name)?;
        if e.dtype != StoredDType::U8 {
            continue;
        }
        if let Some(base) = name.strip_suffix(".weight_scale") {
            let packed_name = format!("{base}.weight_packed");
            if !ckpt.has(&packed_name) {
                continue;
            }
            let (packed, scales) = (ckpt.bytes(&packed_name)?, ckpt.bytes(name)?);
            if packed.len() != scales.len() * BLOCK_BYTES {
                return Err(Error::TensorShape {
                    name: packed_name,
                    expected: vec![scales.len() * BLOCK_BYTES],
                    found: ckpt.entry(&format!("{base}.weight_packed"))?.shape.clone(),
                });
            }
            let (scope, expert) = match expert_of(base) {
                Some((s, j)) => (s, Some(j)),
                None => (base.to_string(), None),
            };
            out.push((scope, expert, packed, scales));
        } else if let Some(base) = name.strip_suffix("_scales") {
            let blocks_name = format!("{base}_blocks");
            if !ckpt.has(&blocks_name) {
                continue;
            }
            let (packed, scales) = (ckpt.bytes(&blocks_name)?, ckpt.bytes(name)?);
            if packed.len() != scales.len() * BLOCK_BYTES || e.shape.len() < 2 {
                return Err(Error::TensorShape {
                    name: blocks_name.clone(),
                    expected: [e.shape.as_slice(), &[BLOCK_BYTES]].concat(),
                    found: ckpt.entry(&blocks_name)?.shape.clone(),
                });
            }
            // `[E, R, nb]`: dim 0 indexes experts; the scope is the `experts` module.
            let experts = e.shape[0];
            let per = scales.len() / experts.max(1);
            let scope = base
                .rsplit_once('.')
                .map(|(s, _)| s.to_string())
                .unwrap_or_else(|| base.to_string());
            for j in 0..experts {
                out.push((
                    scope.clone(),
                    Some(j),
                    &packed[j * per * BLOCK_BYTES..(j + 1) * per * BLOCK_BYTES],
                    &scales[j * per..(j + 1) * per],
                ));
            }
        }
    }
    Ok(out)
}

fn human(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

fn opt(v: Option<i32>) -> String {
    v.map(|x| x.to_string()).unwrap_or_else(|| "-".into())
}

fn stats_line(
    f: &mut fmt::Formatter<'_>,
    label: &str,
    matrices: usize,
    s: &ScaleStats,
) -> fmt::Result {
    writeln!(
        f,
        "  {label:<44} {matrices:>4} {:>10} {:>5} {:>5} {:>5} {:>6} {:>6} {:>9}  {}",
        s.blocks,
        opt(s.min_exp()),
        opt(s.median_exp()),
        opt(s.max_exp()),
        s.nan_scales,
        s.saturated,
        s.max_code_blocks,
        s.sparkline()
    )
}

impl CheckpointReport {
    /// Experts (or weights) with NaN scales or saturated blocks.
    pub fn flagged(&self) -> Vec<&ExpertScales> {
        self.mxfp4
            .iter()
            .filter(|x| x.stats.nan_scales > 0 || x.stats.saturated > 0)
            .collect()
    }

    /// The report as text; `all` adds one line per tensor and per expert.
    pub fn render(&self, all: bool) -> String {
        struct R<'a>(&'a CheckpointReport, bool);
        impl fmt::Display for R<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.write(f, self.1)
            }
        }
        R(self, all).to_string()
    }

    fn write(&self, f: &mut fmt::Formatter<'_>, all: bool) -> fmt::Result {
        writeln!(f, "checkpoint    {}", self.dir.display())?;
        writeln!(
            f,
            "model_type    {}",
            self.model_type.as_deref().unwrap_or("(no config.json)")
        )?;
        writeln!(
            f,
            "quantization  {}",
            self.quantization.as_deref().unwrap_or("none")
        )?;
        writeln!(f, "files         {}", self.shards.join(", "))?;
        let bpp = if self.params > 0 {
            self.bytes as f64 * 8.0 / self.params as f64
        } else {
            0.0
        };
        writeln!(
            f,
            "tensors       {} ({} parameters, {} bytes = {}, {bpp:.2} bits/parameter)",
            self.tensors.len(),
            self.params,
            self.bytes,
            human(self.bytes)
        )?;
        for d in &self.dtypes {
            writeln!(
                f,
                "  {:<6} {:>6} tensors {:>14} bytes ({})",
                d.dtype,
                d.count,
                d.bytes,
                human(d.bytes)
            )?;
        }
        if all {
            writeln!(
                f,
                "\n{:<72} {:<6} {:<20} {:>12}",
                "tensor", "dtype", "shape", "bytes"
            )?;
            for t in &self.tensors {
                writeln!(
                    f,
                    "{:<72} {:<6} {:<20} {:>12}",
                    t.name,
                    t.dtype,
                    format!("{:?}", t.shape),
                    t.bytes
                )?;
            }
        } else {
            writeln!(
                f,
                "\n{:>5}  {:<64} {:<6} {:<18} {:>12}",
                "count", "tensor pattern", "dtype", "shape (first)", "bytes"
            )?;
            for g in &self.groups {
                writeln!(
                    f,
                    "{:>5}  {:<64} {:<6} {:<18} {:>12}",
                    g.count,
                    g.pattern,
                    g.dtype,
                    format!("{:?}", g.shape),
                    g.bytes
                )?;
            }
        }
        if self.mxfp4.is_empty() {
            return Ok(());
        }
        writeln!(f, "\nMXFP4 block scales (exponent = E8M0 byte - 127; saturated = ±6 code under scale 0xFE)")?;
        writeln!(
            f,
            "  {:<44} {:>4} {:>10} {:>5} {:>5} {:>5} {:>6} {:>6} {:>9}  histogram (min..max)",
            "scope", "mats", "blocks", "min", "med", "max", "NaN", "satur.", "±6 blocks"
        )?;
        // Per scope (all experts of a layer together) unless every expert is asked for.
        let mut scopes: BTreeMap<&str, (usize, usize, ScaleStats)> = BTreeMap::new();
        for x in &self.mxfp4 {
            if all {
                let label = match x.expert {
                    Some(j) => format!("{}.{j}", x.scope),
                    None => x.scope.clone(),
                };
                stats_line(f, &label, x.matrices, &x.stats)?;
            }
            let s = scopes
                .entry(&x.scope)
                .or_insert_with(|| (0, 0, ScaleStats::default()));
            s.0 += x.matrices;
            s.1 += usize::from(x.expert.is_some());
            s.2.merge(&x.stats);
        }
        if !all {
            for (scope, (mats, experts, s)) in &scopes {
                let label = if *experts > 0 {
                    format!("{scope}.* ({experts} experts)")
                } else {
                    scope.to_string()
                };
                stats_line(f, &label, *mats, s)?;
            }
        }
        stats_line(
            f,
            "all MXFP4 weights",
            self.mxfp4.iter().map(|x| x.matrices).sum(),
            &self.mxfp4_total,
        )?;
        let flagged = self.flagged();
        if flagged.is_empty() {
            writeln!(f, "no NaN scales, no saturated blocks")?;
        } else {
            writeln!(
                f,
                "FLAGGED: {} experts/weights with NaN scales or saturated blocks:",
                flagged.len()
            )?;
            for x in flagged.iter().take(if all { usize::MAX } else { 20 }) {
                let label = match x.expert {
                    Some(j) => format!("{}.{j}", x.scope),
                    None => x.scope.clone(),
                };
                writeln!(
                    f,
                    "  {label}: {} NaN scales, {} saturated blocks",
                    x.stats.nan_scales, x.stats.saturated
                )?;
            }
        }
        Ok(())
    }
}

impl fmt::Display for CheckpointReport {
    /// The grouped summary (see [`CheckpointReport::render`] for every tensor).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f, false)
    }
}

impl fmt::Display for InspectReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InspectReport::Checkpoint(c) => c.fmt(f),
            InspectReport::Gguf(g) => g.fmt(f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folds_layer_and_expert_indices_into_stars() {
        assert_eq!(
            name_pattern("model.layers.12.mlp.experts.7.w1.weight_packed"),
            "model.layers.*.mlp.experts.*.w1.weight_packed"
        );
        assert_eq!(name_pattern("model.norm.weight"), "model.norm.weight");
        assert_eq!(
            expert_of("model.layers.3.mlp.experts.17.gate_proj"),
            Some(("model.layers.3.mlp.experts".into(), 17))
        );
        assert_eq!(
            expert_of("model.layers.3.mlp.shared_experts.gate_proj"),
            None
        );
    }

    #[test]
    fn counts_nan_scales_max_codes_and_saturation() {
        let mut s = ScaleStats::default();
        let mut packed = vec![0u8; 4 * BLOCK_BYTES];
        packed[3] = 0x70; // block 0: +6 in a high nibble
        packed[BLOCK_BYTES + 5] = 0x0F; // block 1: -6 in a low nibble
        packed[2 * BLOCK_BYTES] = 0x66; // block 2: ±4 only
        s.add(&packed, &[127, 0xFE, 0xFE, 0xFF]);
        assert_eq!(s.blocks, 4);
        assert_eq!(s.nan_scales, 1);
        assert_eq!(s.max_code_blocks, 2);
        assert_eq!(s.saturated, 1);
        assert_eq!(
            (s.min_exp(), s.median_exp(), s.max_exp()),
            (Some(0), Some(127), Some(127))
        );
        assert_eq!(
            s.sparkline().chars().count(),
            22,
            "128 exponents in bins of 6 (at most 24 columns)"
        );
    }
}
