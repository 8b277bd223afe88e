//! `caracal synth`: deterministic random checkpoints in a published layout,
//! and the embedded default model every `--model` command falls back to.
//!
//! Real Kimi K3 weights (1.42 TiB) do not fit a development machine, so
//! [`synthesize`] writes a **tiny Kimi K3** with K3's real structure and
//! random weights from a fixed seed (same seed ⇒ byte-identical files):
//!
//! - `model_type: "kimi_k3"` wrapper (`KimiK3ForConditionalGeneration`) with a
//!   `text_config` (`kimi_linear`, every key of the reference §1.5) and a
//!   `vision_config` (MoonViT3d keys, §3.2/§3.5);
//! - text: 7 layers, full (NoPE MLA) attention at 1-based layers 4 and 7
//!   (every 4th and the last, as K3's 4, 8, …, 92, 93), KDA elsewhere (3:1);
//!   Block AttnRes with `attn_res_block_size` 3 (blocks at layers 0, 3, 6: a
//!   partial final block, as K3's 93/12); gated MLA with `q_lora_rank`; K3's
//!   KDA (full-rank `g_proj`, `gate_lower_bound` −5); SiTU (β 4, β_lin 25);
//!   layer 0 dense, the rest latent MoE with **896 routed experts, top-16, 2
//!   shared**, routed experts in a 32-wide latent space
//!   (`routed_expert_hidden_size`), stored **MXFP4** in the compressed-tensors
//!   layout (`experts.{e}.{w1,w2,w3}.weight_packed` u8 `[out, in/2]`, even
//!   element in the low nibble, + `weight_scale` u8 E8M0 `[out, in/32]`,
//!   quantized with [`caracal_kernels::mxfp4::quantize`]);
//! - a MoonViT3d tower (RMSNorm, no biases) and a `patchmergerv2` projector;
//! - K3's vocabulary size 163,840 and a real tokenizer: Kimi's tiktoken
//!   format (`tiktoken.model`, Kimi's regex, 258 reserved special ids at
//!   163,584+ with K3's names, [`K3_SPECIAL_TOKENS`]) whose 163,584 BPE ranks
//!   are the first 163,584 ranks of OpenAI's `o200k_base` (the rank file
//!   embedded in `tiktoken-rs`). A prefix of a BPE rank list is itself a
//!   valid BPE: o200k's ranks 0–255 are the 256 single bytes (any text can be
//!   encoded) and every kept token is the merge of two lower-ranked kept
//!   tokens (checked by [`truncated_o200k_rank_file`]'s test).
//!
//! Names carry the multimodal wrapper's prefix:
//! `language_model.model.layers.{i}.…`, `language_model.model.embed_tokens`,
//! `language_model.lm_head.weight`, `vision_tower.…`, `mm_projector.…`.
//! Dtypes: every tensor bf16 except the MXFP4 experts and the three tensors
//! published in f32 (`A_log`, `dt_bias`, `e_score_correction_bias`, §1.6/§4.4).
//!
//! Names and shapes that no published file confirmed (marked where written):
//! `A_log` as a `[head_dim]` buffer whose first `num_heads` entries are used
//! (what TS says of K3; Kimi-Linear stores `[1, 1, H, 1]`); the MLA output
//! gate `self_attn.g_proj` (llama.cpp's K3 converter); the model-level
//! `output_attn_res_*` under `language_model.model.`; K3's vision and
//! projector names (K2.5's without biases, plus `mm_projector.post_norm`).
//!
//! Files: `config.json` (with [`SYNTH_VERSION`]), `generation_config.json`
//! (eos `<|end_of_msg|>` 163586), `tiktoken.model`, `tokenizer_config.json`,
//! `model-00001-of-00002.safetensors` (everything but the routed experts),
//! `model-00002-of-00002.safetensors` (routed experts) and
//! `model.safetensors.index.json`. No chat template: K3 ships none, its
//! prompts are rendered by [`crate::chat::toolcall::render_k3`].
//!
//! [`default_model_dir`] is the model of commands run without `--model`:
//! `$CARACAL_CACHE/kimi-k3-tiny` or `~/.cache/caracal/kimi-k3-tiny`, made on
//! first use and remade when an older synth version wrote it.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use caracal_kernels::mxfp4;
use half::bf16;
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

use crate::checkpoint::arch::{Arch as ModelArch, AttentionKind, MlpKind};
use crate::checkpoint::config::read_json;
use crate::error::{Error, Result};

/// Version of the synthesized layout and weights. Bump it whenever the
/// output of [`synthesize`] changes, so cached default models are remade.
pub const SYNTH_VERSION: u32 = 1;

/// Seed of the default model (and of `caracal synth` without `--seed`).
pub const DEFAULT_SEED: u64 = 0x004b_335f_7469_6e79;

/// Folder name of the default model inside the cache.
pub const DEFAULT_MODEL_NAME: &str = "kimi-k3-tiny";

/// Kimi's BPE rank count: ids below are merge ranks, ids from here on special.
pub const KIMI_NUM_RANKS: u32 = 163_584;

/// Kimi K3's named special tokens (reference §5.1/§5.3); the other ids of
/// the 258-id reserved range are `<|reserved_token_{id}|>`.
pub const K3_SPECIAL_TOKENS: [(u32, &str); 16] = [
    (163_584, "[BOS]"),
    (163_585, "[EOS]"),
    (163_586, "<|end_of_msg|>"),
    (163_587, "<|open|>"),
    (163_588, "<|close|>"),
    (163_589, "<|sep|>"),
    (163_590, "[start_header_id]"),
    (163_591, "[end_header_id]"),
    (163_593, "[EOT]"),
    (163_602, "<|media_begin|>"),
    (163_603, "<|media_content|>"),
    (163_604, "<|media_end|>"),
    (163_605, "<|media_pad|>"),
    (163_649, "<osagent_mode>"),
    (163_838, "[UNK]"),
    (163_839, "[PAD]"),
];

/// K3's ids used in configs.
const BOS_ID: u32 = 163_584;
const EOS_ID: u32 = 163_586;
const PAD_ID: u32 = 163_839;
const MEDIA_PAD_ID: u32 = 163_605;

/// Architectures `caracal synth` can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Kimi K3 (`model_type: "kimi_k3"`).
    KimiK3,
}

impl FromStr for Arch {
    type Err = Error;
    fn from_str(s: &str) -> Result<Arch> {
        match s {
            "kimi_k3" => Ok(Arch::KimiK3),
            other => Err(Error::Config(format!(
                "synth: unknown --arch `{other}`; supported: kimi_k3"
            ))),
        }
    }
}

/// Size presets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// Tens of MB: [`K3Shape::tiny`].
    Tiny,
    /// About 400 MB with K3's ratio of attention to weight work: [`K3Shape::small`].
    Small,
}

impl FromStr for Preset {
    type Err = Error;
    fn from_str(s: &str) -> Result<Preset> {
        match s {
            "tiny" => Ok(Preset::Tiny),
            "small" => Ok(Preset::Small),
            other => Err(Error::Config(format!(
                "synth: unknown --preset `{other}`; supported: tiny, small"
            ))),
        }
    }
}

/// What to synthesize.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    /// Architecture.
    pub arch: Arch,
    /// Size preset.
    pub preset: Preset,
    /// Seed of every weight (each tensor draws from `seed` and its name).
    pub seed: u64,
    /// Show a progress bar for the expert loop on stderr.
    pub progress: bool,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            arch: Arch::KimiK3,
            preset: Preset::Tiny,
            seed: DEFAULT_SEED,
            progress: true,
        }
    }
}

/// What [`synthesize`] wrote.
#[derive(Debug, Clone)]
pub struct SynthSummary {
    /// File names and sizes in bytes, sorted by name.
    pub files: Vec<(String, u64)>,
    /// Tensors written.
    pub tensors: usize,
    /// Parameters (an MXFP4 weight counts its unpacked elements).
    pub parameters: u64,
    /// Bytes of all files.
    pub bytes: u64,
}

mod shape;
pub use shape::{k3_config, k3_text_config, k3_vision_config, K3Shape};

// ---------------------------------------------------------------------------
// Deterministic random numbers
// ---------------------------------------------------------------------------

/// SplitMix64: tiny, fast, and fixed forever (the synthesized bytes depend
/// on it; changing it needs a [`SYNTH_VERSION`] bump).
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal (Box–Muller, one value per draw pair).
    fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// FNV-1a of a tensor name: each tensor's stream depends on the seed and its
/// name only, so tensors can be drawn in any order and in parallel.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Values drawn per parallel chunk (each chunk has its own stream).
const DRAW_CHUNK: usize = 1 << 16;

/// How a tensor's values are drawn.
#[derive(Debug, Clone, Copy)]
enum Init {
    /// `N(0, std²)`.
    Normal(f32),
    /// `1 + N(0, std²)`: norm weights near one, distinguishable from each other.
    NearOne(f32),
    /// Uniform in `[lo, hi)`.
    Uniform(f32, f32),
}

/// `n` values of `init`, drawn from `(seed, name)`; identical for any thread count.
fn draw(seed: u64, name: &str, n: usize, init: Init) -> Vec<f32> {
    let base = seed ^ name_hash(name);
    let mut out = vec![0f32; n];
    out.par_chunks_mut(DRAW_CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut rng =
                SplitMix64(base.wrapping_add((c as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)));
            for v in chunk.iter_mut() {
                *v = match init {
                    Init::Normal(std) => (rng.normal() * std as f64) as f32,
                    Init::NearOne(std) => (1.0 + rng.normal() * std as f64) as f32,
                    Init::Uniform(lo, hi) => (lo as f64 + rng.uniform() * (hi - lo) as f64) as f32,
                };
            }
        });
    out
}

// ---------------------------------------------------------------------------
// Tensors
// ---------------------------------------------------------------------------

/// One tensor ready to write.
struct Stored {
    /// Element type.
    dtype: Dtype,
    /// Shape.
    shape: Vec<usize>,
    /// Little-endian bytes.
    data: Vec<u8>,
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Collects named tensors drawn from one seed.
struct Tensors {
    /// Seed of every draw.
    seed: u64,
    /// Name → tensor, sorted (the index and shards list them in this order).
    map: BTreeMap<String, Stored>,
}

impl Tensors {
    /// A bf16 tensor of `init` values.
    fn bf16(&mut self, name: &str, shape: &[usize], init: Init) {
        let n = shape.iter().product();
        let data = bf16_bytes(&draw(self.seed, name, n, init));
        self.map.insert(
            name.to_string(),
            Stored {
                dtype: Dtype::BF16,
                shape: shape.to_vec(),
                data,
            },
        );
    }

    /// A bf16 linear weight `[out, inp]` with `N(0, 1/inp)` entries (unit-scale outputs).
    fn linear(&mut self, name: &str, out: usize, inp: usize) {
        self.bf16(name, &[out, inp], Init::Normal(1.0 / (inp as f32).sqrt()));
    }

    /// An f32 tensor of given values.
    fn f32(&mut self, name: &str, shape: &[usize], values: &[f32]) {
        self.map.insert(
            name.to_string(),
            Stored {
                dtype: Dtype::F32,
                shape: shape.to_vec(),
                data: f32_bytes(values),
            },
        );
    }
}

/// The MXFP4 pair of one routed-expert weight `[rows, cols]`, `N(0, 1/cols)`
/// before quantisation.
fn mxfp4_weight(seed: u64, base: &str, rows: usize, cols: usize) -> Result<[(String, Stored); 2]> {
    let w = draw(
        seed,
        &format!("{base}.weight"),
        rows * cols,
        Init::Normal(1.0 / (cols as f32).sqrt()),
    );
    let (packed, scales) = mxfp4::quantize(&w, rows, cols)?;
    Ok([
        (
            format!("{base}.weight_packed"),
            Stored {
                dtype: Dtype::U8,
                shape: vec![rows, cols / 2],
                data: packed,
            },
        ),
        (
            format!("{base}.weight_scale"),
            Stored {
                dtype: Dtype::U8,
                shape: vec![rows, cols / mxfp4::BLOCK_ELEMS],
                data: scales,
            },
        ),
    ])
}

/// Attention tensors of one KDA layer (§1.6, K3 variant).
fn kda_layer(t: &mut Tensors, p: &str, s: &K3Shape) {
    let (d, h, hd, k) = (
        s.hidden_size,
        s.kda_num_heads,
        s.kda_head_dim,
        s.short_conv_kernel_size,
    );
    let w = h * hd;
    for proj in ["q_proj", "k_proj", "v_proj"] {
        t.linear(&format!("{p}.self_attn.{proj}.weight"), w, d);
    }
    for conv in ["q_conv1d", "k_conv1d", "v_conv1d"] {
        // Depthwise Conv1d, PyTorch's default bound 1/sqrt(fan_in = kernel).
        let b = 1.0 / (k as f32).sqrt();
        t.bf16(
            &format!("{p}.self_attn.{conv}.weight"),
            &[w, 1, k],
            Init::Uniform(-b, b),
        );
    }
    t.linear(&format!("{p}.self_attn.f_a_proj.weight"), hd, d);
    t.linear(&format!("{p}.self_attn.f_b_proj.weight"), w, hd);
    // dt_bias = softplus⁻¹(dt), dt log-uniform in [1e-3, 1e-1] (FLA's init); f32 as published.
    let dt = draw(
        t.seed,
        &format!("{p}.self_attn.dt_bias"),
        w,
        Init::Uniform((1e-3f32).ln(), (1e-1f32).ln()),
    );
    let dt_bias: Vec<f32> = dt
        .iter()
        .map(|x| x.exp())
        .map(|dt| dt + (-(-dt).exp_m1()).ln())
        .collect();
    t.f32(&format!("{p}.self_attn.dt_bias"), &[w], &dt_bias);
    // A_log = ln(A), A uniform in [1, 16] (FLA's init), f32. [uncertain] K3's
    // [head_dim] buffer with the first num_heads entries used (TS); the rest zero.
    let a = draw(
        t.seed,
        &format!("{p}.self_attn.A_log"),
        h,
        Init::Uniform(1.0, 16.0),
    );
    let mut a_log = vec![0f32; hd];
    for (slot, a) in a_log.iter_mut().zip(&a) {
        *slot = a.ln();
    }
    t.f32(&format!("{p}.self_attn.A_log"), &[hd], &a_log);
    t.linear(&format!("{p}.self_attn.b_proj.weight"), h, d);
    // K3: full-rank output gate instead of g_a_proj/g_b_proj.
    t.linear(&format!("{p}.self_attn.g_proj.weight"), w, d);
    t.bf16(
        &format!("{p}.self_attn.o_norm.weight"),
        &[hd],
        Init::NearOne(0.1),
    );
    t.linear(&format!("{p}.self_attn.o_proj.weight"), d, w);
}

/// Attention tensors of one gated NoPE MLA layer with `q_lora_rank` (§4.2, §4.4).
fn mla_layer(t: &mut Tensors, p: &str, s: &K3Shape) {
    let d = s.hidden_size;
    let h = s.num_attention_heads;
    let qk = s.qk_nope_head_dim + s.qk_rope_head_dim;
    t.linear(&format!("{p}.self_attn.q_a_proj.weight"), s.q_lora_rank, d);
    t.bf16(
        &format!("{p}.self_attn.q_a_layernorm.weight"),
        &[s.q_lora_rank],
        Init::NearOne(0.1),
    );
    t.linear(
        &format!("{p}.self_attn.q_b_proj.weight"),
        h * qk,
        s.q_lora_rank,
    );
    t.linear(
        &format!("{p}.self_attn.kv_a_proj_with_mqa.weight"),
        s.kv_lora_rank + s.qk_rope_head_dim,
        d,
    );
    t.bf16(
        &format!("{p}.self_attn.kv_a_layernorm.weight"),
        &[s.kv_lora_rank],
        Init::NearOne(0.1),
    );
    t.linear(
        &format!("{p}.self_attn.kv_b_proj.weight"),
        h * (s.qk_nope_head_dim + s.v_head_dim),
        s.kv_lora_rank,
    );
    t.linear(&format!("{p}.self_attn.o_proj.weight"), d, h * s.v_head_dim);
    // [uncertain] name of K3's MLA output gate (llama.cpp's K3 converter: `self_attn.g_proj`).
    t.linear(&format!("{p}.self_attn.g_proj.weight"), h * s.v_head_dim, d);
}

/// Everything but the routed experts of the text model; which layers are
/// MLA or KDA, dense or MoE, is read from `arch` (the description parsed
/// from the config being written, as the loader will parse it).
fn text_trunk(t: &mut Tensors, s: &K3Shape, arch: &ModelArch) {
    let d = s.hidden_size;
    t.bf16(
        "language_model.model.embed_tokens.weight",
        &[s.vocab_size, d],
        Init::Normal(1.0),
    );
    t.linear("language_model.lm_head.weight", s.vocab_size, d);
    t.bf16("language_model.model.norm.weight", &[d], Init::NearOne(0.1));
    // [uncertain] prefix of the model-level AttnRes pair (`language_model.model.`).
    t.bf16(
        "language_model.model.output_attn_res_norm.weight",
        &[d],
        Init::NearOne(0.1),
    );
    t.bf16(
        "language_model.model.output_attn_res_proj.weight",
        &[1, d],
        Init::Normal(1.0 / (d as f32).sqrt()),
    );
    for (i, kind) in arch.layers.iter().enumerate() {
        let p = format!("language_model.model.layers.{i}");
        t.bf16(
            &format!("{p}.input_layernorm.weight"),
            &[d],
            Init::NearOne(0.1),
        );
        t.bf16(
            &format!("{p}.post_attention_layernorm.weight"),
            &[d],
            Init::NearOne(0.1),
        );
        // Block AttnRes pseudo-queries (§2.3).
        for res in ["self_attention_res", "mlp_res"] {
            t.bf16(&format!("{p}.{res}_norm.weight"), &[d], Init::NearOne(0.1));
            t.bf16(
                &format!("{p}.{res}_proj.weight"),
                &[1, d],
                Init::Normal(1.0 / (d as f32).sqrt()),
            );
        }
        if kind.attention == AttentionKind::Mla {
            mla_layer(t, &p, s);
        } else {
            kda_layer(t, &p, s);
        }
        if kind.mlp == MlpKind::Dense {
            // first_k_dense_replace = 1: a dense SiTU MLP.
            t.linear(&format!("{p}.mlp.gate_proj.weight"), s.intermediate_size, d);
            t.linear(&format!("{p}.mlp.up_proj.weight"), s.intermediate_size, d);
            t.linear(&format!("{p}.mlp.down_proj.weight"), d, s.intermediate_size);
        } else {
            let m = format!("{p}.block_sparse_moe");
            t.linear(&format!("{m}.gate.weight"), s.num_experts, d);
            let bias = draw(
                t.seed,
                &format!("{m}.gate.e_score_correction_bias"),
                s.num_experts,
                Init::Normal(0.01),
            );
            t.f32(
                &format!("{m}.gate.e_score_correction_bias"),
                &[s.num_experts],
                &bias,
            );
            let l = s.routed_expert_hidden_size;
            t.linear(&format!("{m}.routed_expert_down_proj.weight"), l, d);
            t.bf16(
                &format!("{m}.routed_expert_norm.weight"),
                &[l],
                Init::NearOne(0.1),
            );
            t.linear(&format!("{m}.routed_expert_up_proj.weight"), d, l);
            let shared = s.moe_intermediate_size * s.num_shared_experts;
            t.linear(&format!("{m}.shared_experts.gate_proj.weight"), shared, d);
            t.linear(&format!("{m}.shared_experts.up_proj.weight"), shared, d);
            t.linear(&format!("{m}.shared_experts.down_proj.weight"), d, shared);
        }
    }
}

/// Routed experts of every MoE layer, MXFP4, drawn in parallel per layer.
fn routed_experts(t: &mut Tensors, s: &K3Shape, arch: &ModelArch, progress: bool) -> Result<()> {
    let moe_layers: Vec<usize> = (0..arch.num_layers()).filter(|&i| arch.is_moe(i)).collect();
    let pb = if progress {
        let pb = ProgressBar::new((moe_layers.len() * s.num_experts) as u64);
        pb.set_style(
            ProgressStyle::with_template("{msg:<16} [{bar:40}] {pos}/{len} experts {elapsed}")
                .expect("the progress template is valid")
                .progress_chars("=> "),
        );
        pb
    } else {
        ProgressBar::hidden()
    };
    let (l, i) = (s.routed_expert_hidden_size, s.moe_intermediate_size);
    for layer in moe_layers {
        pb.set_message(format!("layer {layer} MXFP4"));
        let seed = t.seed;
        let made: Vec<Result<Vec<(String, Stored)>>> = (0..s.num_experts)
            .into_par_iter()
            .map(|e| {
                let base =
                    format!("language_model.model.layers.{layer}.block_sparse_moe.experts.{e}");
                // w1 = gate, w3 = up: [I, latent]; w2 = down: [latent, I].
                let mut out = Vec::with_capacity(6);
                out.extend(mxfp4_weight(seed, &format!("{base}.w1"), i, l)?);
                out.extend(mxfp4_weight(seed, &format!("{base}.w2"), l, i)?);
                out.extend(mxfp4_weight(seed, &format!("{base}.w3"), i, l)?);
                pb.inc(1);
                Ok(out)
            })
            .collect();
        for expert in made {
            t.map.extend(expert?);
        }
    }
    pb.finish_and_clear();
    Ok(())
}

/// MoonViT3d tower and patchmergerv2 projector (§3.2; K3: RMSNorm, no biases).
/// **[uncertain]** K3 names: K2.5's without biases, plus `mm_projector.post_norm`.
fn vision(t: &mut Tensors, s: &K3Shape) {
    let (d, q, m, g) = (
        s.vt_hidden_size,
        s.vt_qkv_hidden_size,
        s.vt_intermediate_size,
        s.vt_pos_emb_size,
    );
    t.bf16(
        "vision_tower.patch_embed.proj.weight",
        &[d, 3, 14, 14],
        Init::Normal(1.0 / (3.0f32 * 14.0 * 14.0).sqrt()),
    );
    t.bf16(
        "vision_tower.patch_embed.pos_emb.weight",
        &[g, g, d],
        Init::Normal(0.02),
    );
    for b in 0..s.vt_num_hidden_layers {
        let p = format!("vision_tower.encoder.blocks.{b}");
        t.bf16(&format!("{p}.norm0.weight"), &[d], Init::NearOne(0.1));
        t.bf16(&format!("{p}.norm1.weight"), &[d], Init::NearOne(0.1));
        t.linear(&format!("{p}.wqkv.weight"), 3 * q, d);
        t.linear(&format!("{p}.wo.weight"), d, q);
        t.linear(&format!("{p}.mlp.fc0.weight"), m, d);
        t.linear(&format!("{p}.mlp.fc1.weight"), d, m);
    }
    t.bf16(
        "vision_tower.encoder.final_layernorm.weight",
        &[d],
        Init::NearOne(0.1),
    );
    t.linear("mm_projector.proj.0.weight", 4 * d, 4 * d);
    t.linear("mm_projector.proj.2.weight", s.hidden_size, 4 * d);
    t.bf16(
        "mm_projector.post_norm.weight",
        &[s.hidden_size],
        Init::NearOne(0.1),
    );
}

// ---------------------------------------------------------------------------
// Tokenizer
// ---------------------------------------------------------------------------

/// The first `n` ranks of tiktoken's `o200k_base` (embedded in `tiktoken-rs`)
/// as a tiktoken rank file: `base64(bytes) rank` per line, by rank.
pub fn truncated_o200k_rank_file(n: u32) -> Result<String> {
    use base64::Engine;
    let bpe = tiktoken_rs::o200k_base()
        .map_err(|e| Error::Tokenizer(format!("loading tiktoken-rs o200k_base: {e}")))?;
    let mut out = String::with_capacity(n as usize * 16);
    for rank in 0..n {
        let bytes = bpe
            .decode_bytes(&[rank])
            .map_err(|e| Error::Tokenizer(format!("o200k_base has no rank {rank}: {e}")))?;
        writeln!(
            out,
            "{} {rank}",
            base64::engine::general_purpose::STANDARD.encode(&bytes)
        )
        .expect("writing to a String cannot fail");
    }
    Ok(out)
}

/// `tokenizer_config.json` of K3's tiktoken tokenizer (names of
/// [`K3_SPECIAL_TOKENS`]; no chat template, as K3 ships none).
pub fn k3_tokenizer_config() -> Value {
    let mut added = serde_json::Map::new();
    for (id, name) in K3_SPECIAL_TOKENS {
        added.insert(
            id.to_string(),
            json!({"content": name, "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": true}),
        );
    }
    json!({
        "added_tokens_decoder": Value::Object(added),
        "additional_special_tokens": ["<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>",
                                      "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]},
        "bos_token": "[BOS]",
        "eos_token": "<|end_of_msg|>",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": false,
        "model_max_length": 1_048_576,
        "tokenizer_class": "TikTokenTokenizer",
    })
}

// ---------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| Error::BadFile {
        what: "json output",
        path: path.into(),
        detail: e.to_string(),
    })?;
    std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
}

fn write_shard(path: &Path, tensors: &[(&String, &Stored)]) -> Result<()> {
    let bad = |e: safetensors::SafeTensorError| Error::BadFile {
        what: "safetensors output",
        path: path.into(),
        detail: e.to_string(),
    };
    let views = tensors
        .iter()
        .map(|(name, t)| {
            TensorView::new(t.dtype, t.shape.clone(), &t.data)
                .map(|v| (name.as_str(), v))
                .map_err(bad)
        })
        .collect::<Result<Vec<_>>>()?;
    // One metadata key: a HashMap of several would be written in random order.
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), path).map_err(bad)
}

/// Writes a synthesized checkpoint into `out_dir`, which must not exist or
/// be empty. Same options ⇒ byte-identical files.
pub fn synthesize(out_dir: &Path, opts: &SynthOptions) -> Result<SynthSummary> {
    let Arch::KimiK3 = opts.arch;
    let shape = K3Shape::of(opts.preset);
    shape.validate()?;
    if out_dir.exists() {
        let mut entries = std::fs::read_dir(out_dir).map_err(|e| Error::io(out_dir, e))?;
        if entries.next().is_some() {
            return Err(Error::Config(format!(
                "{} is not empty; synth writes into a new or empty folder only",
                out_dir.display()
            )));
        }
    }
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;

    let mut t = Tensors {
        seed: opts.seed,
        map: BTreeMap::new(),
    };
    let config = k3_config(&shape, opts.seed);
    let arch = ModelArch::from_config(&config)?;
    text_trunk(&mut t, &shape, &arch);
    vision(&mut t, &shape);
    routed_experts(&mut t, &shape, &arch, opts.progress)?;

    let shard_names = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let is_expert = |name: &str| name.contains(".block_sparse_moe.experts.");
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    let mut parameters = 0u64;
    for (k, file) in shard_names.iter().enumerate() {
        let part: Vec<(&String, &Stored)> = t
            .map
            .iter()
            .filter(|(n, _)| is_expert(n) == (k == 1))
            .collect();
        for (name, st) in &part {
            weight_map.insert(name.to_string(), file.to_string());
            total += st.data.len() as u64;
            let elems: u64 = st.shape.iter().map(|&x| x as u64).product();
            // A packed MXFP4 byte holds two weights; scales are not parameters.
            parameters += if name.ends_with(".weight_packed") {
                2 * elems
            } else if name.ends_with(".weight_scale") {
                0
            } else {
                elems
            };
        }
        write_shard(&out_dir.join(file), &part)?;
    }
    write_json(
        &out_dir.join("model.safetensors.index.json"),
        &json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
    )?;
    write_json(&out_dir.join("config.json"), &config)?;
    write_json(
        &out_dir.join("generation_config.json"),
        &json!({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}),
    )?;
    let ranks = truncated_o200k_rank_file(KIMI_NUM_RANKS)?;
    let rank_path = out_dir.join("tiktoken.model");
    std::fs::write(&rank_path, ranks).map_err(|e| Error::io(&rank_path, e))?;
    write_json(
        &out_dir.join("tokenizer_config.json"),
        &k3_tokenizer_config(),
    )?;

    let mut files = Vec::new();
    for entry in std::fs::read_dir(out_dir).map_err(|e| Error::io(out_dir, e))? {
        let entry = entry.map_err(|e| Error::io(out_dir, e))?;
        let len = entry
            .metadata()
            .map_err(|e| Error::io(entry.path(), e))?
            .len();
        files.push((entry.file_name().to_string_lossy().into_owned(), len));
    }
    files.sort();
    let bytes = files.iter().map(|(_, n)| n).sum();
    Ok(SynthSummary {
        files,
        tensors: t.map.len(),
        parameters,
        bytes,
    })
}

// ---------------------------------------------------------------------------
// Default model
// ---------------------------------------------------------------------------

/// Whether `dir` holds a complete synthesized model of this [`SYNTH_VERSION`].
pub fn is_current_synth(dir: &Path) -> bool {
    let Ok(config) = read_json(&dir.join("config.json"), "config.json") else {
        return false;
    };
    if config.get("synth_version").and_then(Value::as_u64) != Some(SYNTH_VERSION as u64) {
        return false;
    }
    let Ok(index) = read_json(
        &dir.join("model.safetensors.index.json"),
        "model.safetensors.index.json",
    ) else {
        return false;
    };
    let shards_present = index
        .get("weight_map")
        .and_then(Value::as_object)
        .is_some_and(|m| {
            m.values()
                .filter_map(Value::as_str)
                .all(|f| dir.join(f).is_file())
        });
    shards_present
        && [
            "tiktoken.model",
            "tokenizer_config.json",
            "generation_config.json",
        ]
        .iter()
        .all(|f| dir.join(f).is_file())
}

/// Makes sure `dir` holds the synthesized model of `opts`: returns `false`
/// if a current one was already there, `true` if it was (re)made. The model
/// is written to a sibling temporary folder and renamed into place, so a
/// crash never leaves a half-written model, and concurrent callers agree.
pub fn ensure_synth_model(dir: &Path, opts: &SynthOptions) -> Result<bool> {
    if is_current_synth(dir) {
        return Ok(false);
    }
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| DEFAULT_MODEL_NAME.into());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let tmp = parent.join(format!(".{name}.tmp-{}-{nanos}", std::process::id()));
    tracing::info!(dir = %dir.display(), "synthesizing the default model");
    if let Err(e) = synthesize(&tmp, opts) {
        std::fs::remove_dir_all(&tmp).ok();
        return Err(e);
    }
    if dir.exists() {
        if is_current_synth(dir) {
            // Another process finished first.
            std::fs::remove_dir_all(&tmp).ok();
            return Ok(false);
        }
        std::fs::remove_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    if let Err(e) = std::fs::rename(&tmp, dir) {
        std::fs::remove_dir_all(&tmp).ok();
        if is_current_synth(dir) {
            return Ok(false);
        }
        return Err(Error::io(dir, e));
    }
    Ok(true)
}

/// The default model's folder (`cache_root()/kimi-k3-tiny`), synthesized on
/// first use and remade when an older synth version wrote it.
pub fn default_model_dir() -> Result<PathBuf> {
    let dir = crate::paths::cache_root()?.join(DEFAULT_MODEL_NAME);
    ensure_synth_model(&dir, &SynthOptions::default())?;
    Ok(dir)
}

#[cfg(test)]
mod tests;
