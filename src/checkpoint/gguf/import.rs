//! Import a `llama`-architecture GGUF as a Hugging Face `LlamaForCausalLM` folder.
//!
//! This is a Rust port of the checked Python converter in
//! `shared/reference/offline-models.md`, Appendix A (`gguf_llama_to_hf.py`). It writes
//! into the output folder:
//! - `model.safetensors`: every tensor dequantised (bf16 or f32), HF names, row-major
//!   HF shapes (`[out, in]` for linear weights);
//! - `config.json`: `LlamaForCausalLM` hyper-parameters from the `llama.*` keys;
//! - `tokenizer.json` / `tokenizer_config.json`: see [`super::tokenizer`];
//! - `generation_config.json`: bos/eos/pad ids.
//!
//! Two things differ from a plain rename (the "gotchas" of the reference):
//! - llama.cpp's converter permutes the rows of `attn_q`/`attn_k` (`LlamaModel.permute`,
//!   interleaving the two rotary halves of each head); [`unpermute_rows`] undoes it, with
//!   `n_head` for Q and `n_head_kv` for K, so HF's rotate-half RoPE applies;
//! - `rms_norm_eps` is stored as an f32 (`9.9999997e-06`) and is rounded to 6
//!   significant digits (`1e-05`).
//!
//! A model without `output.weight` has tied embeddings (`tie_word_embeddings: true`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde::Serialize;

use super::reader::{GgufFile, TensorInfo};
use super::tokenizer::build_hf_tokenizer;
use super::{GgufError, Result};

/// Storage dtype of the written `model.safetensors`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OutDtype {
    /// bfloat16, round-to-nearest-even (half the size; the default).
    #[default]
    Bf16,
    /// float32: the dequantised values exactly.
    F32,
}

impl OutDtype {
    /// The `torch_dtype` string of `config.json`.
    pub fn torch_dtype(self) -> &'static str {
        match self {
            OutDtype::Bf16 => "bfloat16",
            OutDtype::F32 => "float32",
        }
    }

    fn safetensors_dtype(self) -> Dtype {
        match self {
            OutDtype::Bf16 => Dtype::BF16,
            OutDtype::F32 => Dtype::F32,
        }
    }
}

/// How [`import_gguf`] writes its output.
#[derive(Debug, Clone, Copy, Default)]
pub struct ImportOptions {
    /// dtype of `model.safetensors`.
    pub dtype: OutDtype,
    /// Draw an indicatif progress bar over tensors on stderr.
    pub progress: bool,
}

/// What [`import_gguf`] did.
#[derive(Debug, Clone)]
pub struct ImportReport {
    /// `general.architecture` of the source.
    pub architecture: String,
    /// Tensors written.
    pub tensors: usize,
    /// Parameters (elements) written.
    pub parameters: u64,
    /// Total bytes of all files written.
    pub bytes_written: u64,
    /// Whether the model ties `lm_head` to the embeddings (no `output.weight`).
    pub tied_embeddings: bool,
    /// dtype of `model.safetensors`.
    pub dtype: OutDtype,
    /// The files written, in write order.
    pub files: Vec<PathBuf>,
    /// Things the output may not reproduce exactly (pre-tokenizer, rope scaling, …).
    pub warnings: Vec<String>,
    /// Wall time of the import.
    pub elapsed: Duration,
}

/// Hyper-parameters of a llama GGUF (keys `llama.*`).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaHparams {
    /// `embedding_length`.
    pub hidden_size: u64,
    /// `feed_forward_length`.
    pub intermediate_size: u64,
    /// `block_count`.
    pub num_hidden_layers: u64,
    /// `attention.head_count`.
    pub num_attention_heads: u64,
    /// `attention.head_count_kv` (defaults to the head count).
    pub num_key_value_heads: u64,
    /// `attention.key_length`, else hidden / heads.
    pub head_dim: u64,
    /// `attention.layer_norm_rms_epsilon` as stored (an f32 widened).
    pub rms_norm_eps: f64,
    /// `rope.freq_base` (default 10000, llama.cpp's default).
    pub rope_theta: f64,
    /// `context_length`.
    pub max_position_embeddings: u64,
}

impl LlamaHparams {
    /// Reads the hyper-parameters of a `llama` GGUF.
    pub fn from_gguf(f: &GgufFile) -> Result<LlamaHparams> {
        let hidden = f.require_u64("llama.embedding_length")?;
        let heads = f.require_u64("llama.attention.head_count")?;
        if heads == 0 {
            return Err(GgufError::WrongType {
                key: "llama.attention.head_count".into(),
                expected: "a positive integer",
                found: "0".into(),
            });
        }
        Ok(LlamaHparams {
            hidden_size: hidden,
            intermediate_size: f.require_u64("llama.feed_forward_length")?,
            num_hidden_layers: f.require_u64("llama.block_count")?,
            num_attention_heads: heads,
            num_key_value_heads: f.get_u64("llama.attention.head_count_kv").unwrap_or(heads),
            head_dim: f
                .get_u64("llama.attention.key_length")
                .unwrap_or(hidden / heads),
            rms_norm_eps: f.require_f64("llama.attention.layer_norm_rms_epsilon")?,
            rope_theta: f.get_f64("llama.rope.freq_base").unwrap_or(10000.0),
            max_position_embeddings: f.require_u64("llama.context_length")?,
        })
    }
}

/// Rounds to 6 significant digits (`f"{x:.6g}"`): `9.9999997e-06` → `1e-05`.
pub fn round_6_significant(x: f64) -> f64 {
    format!("{x:.5e}").parse().unwrap_or(x)
}

/// Whether a tensor's rows were permuted by llama.cpp, and with which head count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Permuted {
    /// Not permuted.
    No,
    /// `attn_q`: permuted with `n_head`.
    Query,
    /// `attn_k`: permuted with `n_head_kv`.
    Key,
}

/// Maps a GGUF llama tensor name to its HF name and permutation kind.
fn map_name(name: &str) -> Result<(String, Permuted)> {
    let unknown = || GgufError::UnknownTensorName(name.to_string());
    let parts: Vec<&str> = name.split('.').collect();
    let suffix_ok = |s: &str| s == "weight" || s == "bias";
    match parts.as_slice() {
        [base, suffix] if suffix_ok(suffix) => {
            let hf = match *base {
                "token_embd" => "model.embed_tokens",
                "output_norm" => "model.norm",
                "output" => "lm_head",
                _ => return Err(unknown()),
            };
            Ok((format!("{hf}.{suffix}"), Permuted::No))
        }
        ["blk", layer, base, suffix] if suffix_ok(suffix) && layer.parse::<u64>().is_ok() => {
            let (hf, permuted) = match *base {
                "attn_norm" => ("input_layernorm", Permuted::No),
                "ffn_norm" => ("post_attention_layernorm", Permuted::No),
                "attn_q" => ("self_attn.q_proj", Permuted::Query),
                "attn_k" => ("self_attn.k_proj", Permuted::Key),
                "attn_v" => ("self_attn.v_proj", Permuted::No),
                "attn_output" => ("self_attn.o_proj", Permuted::No),
                "ffn_gate" => ("mlp.gate_proj", Permuted::No),
                "ffn_up" => ("mlp.up_proj", Permuted::No),
                "ffn_down" => ("mlp.down_proj", Permuted::No),
                _ => return Err(unknown()),
            };
            Ok((format!("model.layers.{layer}.{hf}.{suffix}"), permuted))
        }
        _ => Err(unknown()),
    }
}

/// The Hugging Face name of a GGUF llama tensor (`blk.3.attn_q.weight` →
/// `model.layers.3.self_attn.q_proj.weight`).
pub fn hf_llama_name(gguf_name: &str) -> Result<String> {
    map_name(gguf_name).map(|(n, _)| n)
}

/// Undoes llama.cpp's Q/K row permutation of a row-major `[rows, cols]` matrix (a
/// bias is `cols = 1`).
///
/// llama.cpp stores, within each head of `2d` rows, HF row `t·d + i` (t ∈ {0,1} the
/// rotary half, i < d) at row `2i + t`. This puts it back: numpy
/// `w.reshape(n_head, d, 2, cols).swapaxes(1, 2).reshape(rows, cols)`.
pub fn unpermute_rows(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Result<Vec<f32>> {
    // `n_head` comes from the file's metadata: a huge one is an error, not an overflow.
    let pair_rows = n_head.checked_mul(2).filter(|&m| m > 0);
    if pair_rows.is_none_or(|m| !rows.is_multiple_of(m)) || rows.checked_mul(cols) != Some(w.len())
    {
        return Err(GgufError::BadTensor {
            tensor: "(q/k projection)".into(),
            reason: format!(
                "cannot un-permute {rows}×{cols} ({} values) over {n_head} heads",
                w.len()
            ),
        });
    }
    let d = rows / n_head / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..n_head {
        for t in 0..2 {
            for i in 0..d {
                let dst = (h * 2 + t) * d + i;
                let src = (h * d + i) * 2 + t;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    Ok(out)
}

/// One tensor, converted and ready to serialise.
struct Converted {
    /// HF tensor name.
    name: String,
    /// Row-major HF shape.
    shape: Vec<usize>,
    /// Little-endian bf16 or f32 data.
    bytes: Vec<u8>,
    /// Element count (for the report).
    elements: u64,
}

/// Dequantises, un-permutes and narrows one tensor.
fn convert(
    f: &GgufFile,
    info: &TensorInfo,
    hp: &LlamaHparams,
    dtype: OutDtype,
) -> Result<Converted> {
    let (name, permuted) = map_name(&info.name)?;
    let shape = info.shape();
    let mut w = f.dequantize_tensor(info)?;
    let heads = match permuted {
        Permuted::No => None,
        Permuted::Query => Some(hp.num_attention_heads),
        Permuted::Key => Some(hp.num_key_value_heads),
    };
    if let Some(n) = heads {
        let rows = shape.first().copied().unwrap_or(1);
        let cols = shape.iter().skip(1).product();
        w = unpermute_rows(&w, rows, cols, n as usize).map_err(|e| match e {
            GgufError::BadTensor { reason, .. } => GgufError::BadTensor {
                tensor: info.name.clone(),
                reason,
            },
            other => other,
        })?;
    }
    let bytes = match dtype {
        OutDtype::F32 => w.iter().flat_map(|v| v.to_le_bytes()).collect(),
        OutDtype::Bf16 => w
            .iter()
            .flat_map(|&v| caracal_kernels::dtype::f32_to_bf16(v).to_le_bytes())
            .collect(),
    };
    Ok(Converted {
        name,
        shape,
        bytes,
        elements: info.n_elements(),
    })
}

/// `config.json` of a `LlamaForCausalLM`, in the field order of the reference. Field
/// names are the HF config keys (see `transformers.LlamaConfig`).
#[derive(Serialize)]
struct HfLlamaConfig {
    architectures: [&'static str; 1],
    model_type: &'static str,
    hidden_size: u64,
    intermediate_size: u64,
    num_hidden_layers: u64,
    num_attention_heads: u64,
    num_key_value_heads: u64,
    head_dim: u64,
    rms_norm_eps: f64,
    rope_theta: f64,
    max_position_embeddings: u64,
    vocab_size: u64,
    tie_word_embeddings: bool,
    hidden_act: &'static str,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
    pad_token_id: Option<u32>,
    torch_dtype: &'static str,
    attention_bias: bool,
    mlp_bias: bool,
}

/// `generation_config.json`; field names are the HF keys.
#[derive(Serialize)]
struct GenerationConfig {
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
    pad_token_id: Option<u32>,
}

fn write_file(path: &Path, contents: &[u8]) -> Result<()> {
    std::fs::write(path, contents).map_err(|source| GgufError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Converts the `llama` GGUF at `path` into an HF folder at `out_dir` (created if
/// needed; existing files of the same names are replaced).
pub fn import_gguf(path: &Path, out_dir: &Path, opts: &ImportOptions) -> Result<ImportReport> {
    let start = Instant::now();
    let _span = tracing::info_span!("import_gguf", path = %path.display()).entered();
    let f = GgufFile::open(path)?;
    let arch = f.require_str("general.architecture")?.to_string();
    if arch != "llama" {
        return Err(GgufError::UnsupportedArchitecture(arch));
    }
    let hp = LlamaHparams::from_gguf(&f)?;
    // tokenizer first: it is cheap and fails fast on unsupported vocabularies
    let tok = build_hf_tokenizer(&f, Some(hp.max_position_embeddings))?;
    let mut warnings = tok.warnings.clone();
    if let Some(kind) = f
        .get_str("llama.rope.scaling.type")
        .filter(|k| *k != "none")
    {
        warnings.push(format!(
            "llama.rope.scaling.type = {kind:?} is not written to config.json"
        ));
    }
    // every name must map before any work is done
    for t in f.tensors() {
        map_name(&t.name)?;
    }
    let embd = f
        .tensor("token_embd.weight")
        .ok_or_else(|| GgufError::MissingTensor("token_embd.weight".into()))?;
    let vocab_size = tok.vocab_size as u64;
    if embd.shape() != [vocab_size as usize, hp.hidden_size as usize] {
        return Err(GgufError::BadTensor {
            tensor: embd.name.clone(),
            reason: format!(
                "shape {:?}, expected [{vocab_size}, {}]",
                embd.shape(),
                hp.hidden_size
            ),
        });
    }
    let tied = f.tensor("output.weight").is_none();
    let has_bias = |base: &str| {
        f.tensors()
            .any(|t| t.name.starts_with("blk.") && t.name.ends_with(base))
    };

    std::fs::create_dir_all(out_dir).map_err(|source| GgufError::Io {
        path: out_dir.to_path_buf(),
        source,
    })?;
    let pb = if opts.progress {
        let pb = ProgressBar::new(f.tensor_count() as u64);
        pb.set_style(
            ProgressStyle::with_template("{msg:<24} [{bar:40}] {pos}/{len} tensors {elapsed}")
                .expect("static progress template is valid")
                .progress_chars("=> "),
        );
        pb
    } else {
        ProgressBar::hidden()
    };
    pb.set_message("dequantising");
    let infos: Vec<&TensorInfo> = f.tensors().collect();
    let converted = infos
        .par_iter()
        .map(|info| {
            let c = convert(&f, info, &hp, opts.dtype);
            pb.inc(1);
            c
        })
        .collect::<Result<Vec<Converted>>>()?;
    pb.set_message("writing model.safetensors");

    let mut files = Vec::new();
    let st_path = out_dir.join("model.safetensors");
    let views = converted
        .iter()
        .map(|c| {
            Ok((
                c.name.clone(),
                TensorView::new(opts.dtype.safetensors_dtype(), c.shape.clone(), &c.bytes)?,
            ))
        })
        .collect::<Result<Vec<(String, TensorView)>>>()?;
    let source = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let meta = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("source".to_string(), source),
    ]);
    safetensors::serialize_to_file(views, Some(meta), &st_path)?;
    files.push(st_path);

    let cfg = HfLlamaConfig {
        architectures: ["LlamaForCausalLM"],
        model_type: "llama",
        hidden_size: hp.hidden_size,
        intermediate_size: hp.intermediate_size,
        num_hidden_layers: hp.num_hidden_layers,
        num_attention_heads: hp.num_attention_heads,
        num_key_value_heads: hp.num_key_value_heads,
        head_dim: hp.head_dim,
        rms_norm_eps: round_6_significant(hp.rms_norm_eps),
        rope_theta: hp.rope_theta,
        max_position_embeddings: hp.max_position_embeddings,
        vocab_size,
        tie_word_embeddings: tied,
        hidden_act: "silu",
        bos_token_id: tok.special.bos,
        eos_token_id: tok.special.eos,
        pad_token_id: tok.special.pad,
        torch_dtype: opts.dtype.torch_dtype(),
        attention_bias: has_bias("attn_q.bias"),
        mlp_bias: has_bias("ffn_up.bias"),
    };
    let gen = GenerationConfig {
        bos_token_id: tok.special.bos,
        eos_token_id: tok.special.eos,
        pad_token_id: tok.special.pad,
    };
    let jsons: [(&str, Vec<u8>); 4] = [
        ("config.json", serde_json::to_vec_pretty(&cfg)?),
        ("generation_config.json", serde_json::to_vec_pretty(&gen)?),
        ("tokenizer.json", tok.tokenizer_json.into_bytes()),
        ("tokenizer_config.json", tok.tokenizer_config.into_bytes()),
    ];
    for (name, contents) in jsons {
        let p = out_dir.join(name);
        write_file(&p, &contents)?;
        files.push(p);
    }
    let mut bytes_written = 0;
    for p in &files {
        bytes_written += std::fs::metadata(p)
            .map_err(|source| GgufError::Io {
                path: p.clone(),
                source,
            })?
            .len();
    }
    pb.finish_with_message("done");
    let report = ImportReport {
        architecture: arch,
        tensors: converted.len(),
        parameters: converted.iter().map(|c| c.elements).sum(),
        bytes_written,
        tied_embeddings: tied,
        dtype: opts.dtype,
        files,
        warnings,
        elapsed: start.elapsed(),
    };
    tracing::info!(
        tensors = report.tensors,
        parameters = report.parameters,
        bytes = report.bytes_written,
        seconds = report.elapsed.as_secs_f64(),
        "imported GGUF"
    );
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::gguf::quants::GgmlType;
    use crate::checkpoint::gguf::reader::GgufValue;
    use crate::checkpoint::gguf::test_writer::{temp_path, tiny_tokenizer, GgufWriter};
    use safetensors::SafeTensors;

    /// llama.cpp's `LlamaModel.permute`, written from its numpy definition
    /// `w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)`:
    /// out[h][i][t] = w[h][t][i].
    fn llama_cpp_permute(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
        let d = rows / n_head / 2;
        let mut out = vec![0f32; w.len()];
        for h in 0..n_head {
            for i in 0..d {
                for t in 0..2 {
                    for c in 0..cols {
                        out[((h * d + i) * 2 + t) * cols + c] = w[((h * 2 + t) * d + i) * cols + c];
                    }
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_restores_hand_built_row_order() {
        // 2 heads of 4 rows (d = 2): llama.cpp stores HF rows as [0,2,1,3, 4,6,5,7]
        let stored = [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0];
        let hf = unpermute_rows(&stored, 8, 1, 2).expect("unpermute");
        assert_eq!(hf, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
        assert_eq!(llama_cpp_permute(&hf, 8, 1, 2), stored.to_vec());
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        for (rows, cols, heads) in [(24, 3, 3), (64, 5, 4), (12, 1, 3), (576 / 8, 7, 9)] {
            let w: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let p = llama_cpp_permute(&w, rows, cols, heads);
            assert_ne!(p, w, "{rows}x{cols}/{heads}: permute must move rows");
            assert_eq!(
                unpermute_rows(&p, rows, cols, heads).expect("ok"),
                w,
                "{rows}x{cols}/{heads}"
            );
        }
        assert!(
            unpermute_rows(&[0.0; 6], 6, 1, 2).is_err(),
            "6 rows do not split into 2 heads of even size"
        );
    }

    #[test]
    fn names_map_like_the_reference_converter() {
        let cases = [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output_norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
            (
                "blk.0.attn_norm.weight",
                "model.layers.0.input_layernorm.weight",
            ),
            (
                "blk.12.ffn_norm.weight",
                "model.layers.12.post_attention_layernorm.weight",
            ),
            (
                "blk.3.attn_q.weight",
                "model.layers.3.self_attn.q_proj.weight",
            ),
            ("blk.3.attn_q.bias", "model.layers.3.self_attn.q_proj.bias"),
            (
                "blk.3.attn_k.weight",
                "model.layers.3.self_attn.k_proj.weight",
            ),
            (
                "blk.3.attn_v.weight",
                "model.layers.3.self_attn.v_proj.weight",
            ),
            (
                "blk.3.attn_output.weight",
                "model.layers.3.self_attn.o_proj.weight",
            ),
            (
                "blk.29.ffn_gate.weight",
                "model.layers.29.mlp.gate_proj.weight",
            ),
            ("blk.29.ffn_up.weight", "model.layers.29.mlp.up_proj.weight"),
            (
                "blk.29.ffn_down.weight",
                "model.layers.29.mlp.down_proj.weight",
            ),
        ];
        for (g, hf) in cases {
            assert_eq!(hf_llama_name(g).expect(g), hf);
        }
        for bad in [
            "rope_freqs.weight",
            "blk.x.attn_q.weight",
            "blk.0.attn_q.scale",
            "blk.0.ffn_gate_exps.weight",
        ] {
            assert!(
                matches!(hf_llama_name(bad), Err(GgufError::UnknownTensorName(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn eps_is_rounded_to_six_significant_digits() {
        // the f32 nearest 1e-5 is 9.99999974738e-06
        assert_eq!(round_6_significant(1e-5_f32 as f64), 1e-5);
        assert_eq!(round_6_significant(1e-6_f32 as f64), 1e-6);
        assert_eq!(round_6_significant(0.1234567), 0.123457);
    }

    // ---- a tiny synthetic llama (always runs) ----

    const HIDDEN: usize = 32;
    const HEADS: usize = 4;
    const KV_HEADS: usize = 2;
    const HEAD_DIM: usize = 8;
    const FF: usize = 64;
    const VOCAB: usize = 11; // the tiny tokenizer's vocabulary

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// HF-layout reference weights of the tiny model: name → (shape, values).
    fn tiny_reference(layer: usize) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let p = format!("model.layers.{layer}.");
        let l = layer as f32;
        let fill = |rows: usize, cols: usize, base: f32| -> Vec<f32> {
            (0..rows * cols)
                .map(|i| base + (i / cols) as f32 * 100.0 + (i % cols) as f32)
                .collect()
        };
        vec![
            (
                format!("{p}input_layernorm.weight"),
                vec![HIDDEN],
                fill(1, HIDDEN, 1.0 + l),
            ),
            (
                format!("{p}post_attention_layernorm.weight"),
                vec![HIDDEN],
                fill(1, HIDDEN, 2.0 + l),
            ),
            (
                format!("{p}self_attn.q_proj.weight"),
                vec![HEADS * HEAD_DIM, HIDDEN],
                fill(HEADS * HEAD_DIM, HIDDEN, l),
            ),
            (
                format!("{p}self_attn.q_proj.bias"),
                vec![HEADS * HEAD_DIM],
                fill(HEADS * HEAD_DIM, 1, 0.5),
            ),
            (
                format!("{p}self_attn.k_proj.weight"),
                vec![KV_HEADS * HEAD_DIM, HIDDEN],
                fill(KV_HEADS * HEAD_DIM, HIDDEN, -l),
            ),
            // v: Q8_0 with d = 0.5 and q = ((r·7 + c) mod 255) − 127, exact in f32
            (
                format!("{p}self_attn.v_proj.weight"),
                vec![KV_HEADS * HEAD_DIM, HIDDEN],
                (0..KV_HEADS * HEAD_DIM * HIDDEN)
                    .map(|i| ((((i / HIDDEN) * 7 + i % HIDDEN) % 255) as f32 - 127.0) * 0.5)
                    .collect(),
            ),
            // o: F16 with small multiples of 1/8, exact in f16
            (
                format!("{p}self_attn.o_proj.weight"),
                vec![HIDDEN, HEADS * HEAD_DIM],
                (0..HIDDEN * HEADS * HEAD_DIM)
                    .map(|i| ((i % 97) as f32 - 48.0) / 8.0)
                    .collect(),
            ),
            (
                format!("{p}mlp.gate_proj.weight"),
                vec![FF, HIDDEN],
                fill(FF, HIDDEN, 3.0),
            ),
            (
                format!("{p}mlp.up_proj.weight"),
                vec![FF, HIDDEN],
                fill(FF, HIDDEN, 4.0),
            ),
            (
                format!("{p}mlp.down_proj.weight"),
                vec![HIDDEN, FF],
                fill(HIDDEN, FF, 5.0),
            ),
        ]
    }

    /// Writes the tiny llama GGUF: 2 layers, GQA 4/2, Q/K stored permuted, V as
    /// Q8_0, O as F16, the rest F32; `untied` adds `output.weight`.
    fn write_tiny_llama(path: &Path, untied: bool) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let mut w = GgufWriter::new(3);
        w.kv("general.architecture", GgufValue::String("llama".into()));
        w.kv("llama.block_count", GgufValue::U32(2));
        w.kv("llama.context_length", GgufValue::U32(256));
        w.kv("llama.embedding_length", GgufValue::U32(HIDDEN as u32));
        w.kv("llama.feed_forward_length", GgufValue::U32(FF as u32));
        w.kv("llama.attention.head_count", GgufValue::U32(HEADS as u32));
        w.kv(
            "llama.attention.head_count_kv",
            GgufValue::U32(KV_HEADS as u32),
        );
        w.kv("llama.rope.freq_base", GgufValue::F32(100000.0));
        w.kv(
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(1e-5),
        );
        tiny_tokenizer(&mut w, "smollm");
        let mut all = Vec::new();
        let embd: Vec<f32> = (0..VOCAB * HIDDEN).map(|i| i as f32 * 0.25).collect();
        w.tensor(
            "token_embd.weight",
            GgmlType::F32,
            &[HIDDEN as u64, VOCAB as u64],
            f32_bytes(&embd),
        );
        all.push((
            "model.embed_tokens.weight".to_string(),
            vec![VOCAB, HIDDEN],
            embd,
        ));
        let norm: Vec<f32> = (0..HIDDEN).map(|i| 1.0 + i as f32 / 64.0).collect();
        w.tensor(
            "output_norm.weight",
            GgmlType::F32,
            &[HIDDEN as u64],
            f32_bytes(&norm),
        );
        all.push(("model.norm.weight".to_string(), vec![HIDDEN], norm));
        if untied {
            let out: Vec<f32> = (0..VOCAB * HIDDEN).map(|i| -(i as f32)).collect();
            w.tensor(
                "output.weight",
                GgmlType::F32,
                &[HIDDEN as u64, VOCAB as u64],
                f32_bytes(&out),
            );
            all.push(("lm_head.weight".to_string(), vec![VOCAB, HIDDEN], out));
        }
        for layer in 0..2 {
            for (name, shape, values) in tiny_reference(layer) {
                let base = name.rsplit('.').nth(1).expect("has a base");
                let suffix = name.rsplit('.').next().expect("has a suffix");
                let gguf_base = match base {
                    "input_layernorm" => "attn_norm",
                    "post_attention_layernorm" => "ffn_norm",
                    "q_proj" => "attn_q",
                    "k_proj" => "attn_k",
                    "v_proj" => "attn_v",
                    "o_proj" => "attn_output",
                    "gate_proj" => "ffn_gate",
                    "up_proj" => "ffn_up",
                    "down_proj" => "ffn_down",
                    other => panic!("unmapped {other}"),
                };
                let gname = format!("blk.{layer}.{gguf_base}.{suffix}");
                let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
                let rows = shape[0];
                let cols = shape.iter().skip(1).product();
                match gguf_base {
                    "attn_q" => {
                        let p = llama_cpp_permute(&values, rows, cols, HEADS);
                        w.tensor(&gname, GgmlType::F32, &dims, f32_bytes(&p));
                    }
                    "attn_k" => {
                        let p = llama_cpp_permute(&values, rows, cols, KV_HEADS);
                        w.tensor(&gname, GgmlType::F32, &dims, f32_bytes(&p));
                    }
                    "attn_v" => {
                        let mut bytes = Vec::new();
                        for block in values.chunks(32) {
                            bytes.extend_from_slice(
                                &half::f16::from_f32(0.5).to_bits().to_le_bytes(),
                            );
                            bytes.extend(block.iter().map(|v| ((v / 0.5) as i8) as u8));
                        }
                        w.tensor(&gname, GgmlType::Q8_0, &dims, bytes);
                    }
                    "attn_output" => {
                        let bytes = values
                            .iter()
                            .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
                            .collect();
                        w.tensor(&gname, GgmlType::F16, &dims, bytes);
                    }
                    _ => {
                        w.tensor(&gname, GgmlType::F32, &dims, f32_bytes(&values));
                    }
                }
                all.push((name, shape, values));
            }
        }
        w.write(path);
        all
    }

    fn read_json(path: &Path) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(path).expect("json file")).expect("valid json")
    }

    #[test]
    fn tiny_llama_imports_with_hf_names_unpermuted_qk_and_configs() {
        let src = temp_path("tiny-llama.gguf");
        let out = temp_path("tiny-llama-f32");
        let reference = write_tiny_llama(&src, false);
        let report = import_gguf(
            &src,
            &out,
            &ImportOptions {
                dtype: OutDtype::F32,
                progress: false,
            },
        )
        .expect("imports");
        assert_eq!(report.tensors, reference.len());
        assert_eq!(
            report.parameters,
            reference
                .iter()
                .map(|(_, _, v)| v.len() as u64)
                .sum::<u64>()
        );
        assert!(report.tied_embeddings);
        assert!(report.warnings.is_empty(), "{:?}", report.warnings);
        let on_disk: u64 = report
            .files
            .iter()
            .map(|p| std::fs::metadata(p).expect("written").len())
            .sum();
        assert_eq!(report.bytes_written, on_disk);

        let bytes = std::fs::read(out.join("model.safetensors")).expect("safetensors written");
        let st = SafeTensors::deserialize(&bytes).expect("valid safetensors");
        assert_eq!(st.len(), reference.len());
        for (name, shape, values) in &reference {
            let t = st.tensor(name).unwrap_or_else(|_| panic!("{name} written"));
            assert_eq!(t.dtype(), Dtype::F32, "{name}");
            assert_eq!(t.shape(), shape.as_slice(), "{name}");
            let got: Vec<f32> = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            // exact: every source value is exactly representable in its storage type
            assert_eq!(&got, values, "{name}");
        }

        let cfg = read_json(&out.join("config.json"));
        assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
        assert_eq!(cfg["hidden_size"], HIDDEN);
        assert_eq!(cfg["intermediate_size"], FF);
        assert_eq!(cfg["num_hidden_layers"], 2);
        assert_eq!(cfg["num_attention_heads"], HEADS);
        assert_eq!(cfg["num_key_value_heads"], KV_HEADS);
        assert_eq!(cfg["head_dim"], HEAD_DIM);
        assert_eq!(
            cfg["rms_norm_eps"].as_f64(),
            Some(1e-5),
            "f32 eps rounded to 6 digits"
        );
        assert_eq!(cfg["rope_theta"].as_f64(), Some(100000.0));
        assert_eq!(cfg["max_position_embeddings"], 256);
        assert_eq!(cfg["vocab_size"], VOCAB);
        assert_eq!(cfg["tie_word_embeddings"], true);
        assert_eq!(cfg["torch_dtype"], "float32");
        assert_eq!(cfg["attention_bias"], true);
        assert_eq!(cfg["mlp_bias"], false);
        assert_eq!(
            (cfg["bos_token_id"].clone(), cfg["eos_token_id"].clone()),
            (1.into(), 2.into())
        );
        let gen = read_json(&out.join("generation_config.json"));
        assert_eq!(
            gen,
            serde_json::json!({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
        );
        let tc = read_json(&out.join("tokenizer_config.json"));
        assert_eq!(tc["eos_token"], "<|im_end|>");
        assert_eq!(tc["model_max_length"], 256);
        let tok =
            tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).expect("tokenizer loads");
        assert_eq!(
            tok.encode("ab12", false).expect("encodes").get_ids(),
            &[8, 6, 7]
        );

        std::fs::remove_file(&src).ok();
        std::fs::remove_dir_all(&out).ok();
    }

    #[test]
    fn bf16_import_rounds_to_nearest_even_and_keeps_untied_head() {
        let src = temp_path("tiny-llama-untied.gguf");
        let out = temp_path("tiny-llama-bf16");
        let reference = write_tiny_llama(&src, true);
        let report = import_gguf(&src, &out, &ImportOptions::default()).expect("imports");
        assert!(!report.tied_embeddings);
        assert_eq!(report.dtype, OutDtype::Bf16);
        let bytes = std::fs::read(out.join("model.safetensors")).expect("written");
        let st = SafeTensors::deserialize(&bytes).expect("valid");
        for (name, _, values) in &reference {
            let t = st.tensor(name).expect("present");
            assert_eq!(t.dtype(), Dtype::BF16);
            let want: Vec<u8> = values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
                .collect();
            assert_eq!(t.data(), want.as_slice(), "{name}: bf16 bits");
        }
        let cfg = read_json(&out.join("config.json"));
        assert_eq!(cfg["tie_word_embeddings"], false);
        assert_eq!(cfg["torch_dtype"], "bfloat16");
        std::fs::remove_file(&src).ok();
        std::fs::remove_dir_all(&out).ok();
    }

    #[test]
    fn non_llama_architectures_and_unknown_tensors_are_refused() {
        let src = temp_path("qwen.gguf");
        let mut w = GgufWriter::new(3);
        w.kv("general.architecture", GgufValue::String("qwen2".into()));
        w.write(&src);
        let out = temp_path("qwen-out");
        assert!(matches!(
            import_gguf(&src, &out, &ImportOptions::default()),
            Err(GgufError::UnsupportedArchitecture(a)) if a == "qwen2"
        ));
        assert!(!out.exists(), "nothing is written for a refused file");

        let mut w = GgufWriter::new(3);
        w.kv("general.architecture", GgufValue::String("llama".into()));
        for (k, v) in [
            ("llama.block_count", 1),
            ("llama.context_length", 16),
            ("llama.embedding_length", 32),
            ("llama.feed_forward_length", 32),
            ("llama.attention.head_count", 2),
        ] {
            w.kv(k, GgufValue::U32(v));
        }
        w.kv(
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(1e-6),
        );
        tiny_tokenizer(&mut w, "gpt-2");
        w.tensor("rope_freqs.weight", GgmlType::F32, &[4], vec![0u8; 16]);
        w.write(&src);
        assert!(matches!(
            import_gguf(&src, &out, &ImportOptions::default()),
            Err(GgufError::UnknownTensorName(n)) if n == "rope_freqs.weight"
        ));
        std::fs::remove_file(&src).ok();
    }
}
