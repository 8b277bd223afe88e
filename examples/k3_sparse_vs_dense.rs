//! Decode speed of a K3-shaped sparse model (896 experts, 16 active) against
//! models with the same active parameter count, to check that a sparse
//! model's decode cost follows its active, not its total, parameters.
//!
//! Four random-weight checkpoints are written to a temporary folder and
//! loaded through the normal loader (`caracal::models::load`):
//!
//! 1. `k3-sparse`: `kimi_k3`, 4 layers (3 KDA + 1 MLA, AttnRes), layer 0
//!    dense, 3 latent-MoE layers with 896 MXFP4 experts, top-16, 2 shared;
//! 2. `k3-all-active`: the same with 16 experts, top-16 — every expert runs
//!    for every token, so active = total for the experts; the only active
//!    difference to (1) is the router's 896 vs 16 rows;
//! 3. `kimi-linear-dense`: `kimi_linear` with the same attention stack and
//!    dense bf16 SwiGLU MLPs sized so that its active parameters equal (1)'s;
//! 4. `k3-sparse-pinned`: (1) with a router correction bias that makes every
//!    token pick experts 0–15. It runs all of (1)'s code (the 896-row
//!    router, top-16 of 896, dispatch and combine) but touches only 16
//!    experts' weights, which then stay in cache as (2)'s do where they
//!    fit: pinned / all-active is the cost of routing over 896 experts,
//!    sparse / pinned the cost of fetching 16 different experts a layer for
//!    every token.
//!
//! Each model greedily decodes 64 tokens after an 8-token prompt
//! (`caracal::generate::generate`). The four models are loaded together and
//! timed in interleaved rounds (so that load from other processes hits all
//! of them alike); the best of `--runs` rounds (default [`RUNS`]) is
//! reported, as tokens/s and as ratios. Active parameters exclude the embedding table (a row lookup).
//!
//! Weight bytes read per token are printed too: the sparse model's router
//! has 896 rows against the all-active model's 16, so where cost follows
//! bytes the sparse model's speed is bounded at `all-active bytes / sparse
//! bytes` of the other's.
//!
//! The widths follow `--hidden` ([`Shape::at`]). At the default 512 the
//! all-active model (25 MB a token) fits in a 32 MiB L3 and the router is a
//! tenth of the sparse model's bytes (bound 0.90), so sparse / all-active
//! there compares DRAM with cache more than active parameters. At
//! `--hidden 2048` (382 MB a token, 8.6 GB of experts, ~11 GB resident,
//! two minutes) every model streams from DRAM, as K3's 104B active
//! parameters do, and the router is 2.8% of the bytes (at K3's own widths,
//! 896 × 7,168 against ~1 GB a layer, about 1%).
//! Run:
//!
//! ```text
//! cargo run --release --example k3_sparse_vs_dense [-- [f32] [--hidden N] [--runs N]]
//! ```

use std::path::{Path, PathBuf};

use anyhow::Result;
use caracal::generate::{generate, GenerateRequest};
use caracal_kernels::sampling::SamplingParams;
use caracal_kernels::testing::Rng;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

const VOCAB: usize = 1024;
const LAYERS: usize = 4;
const KDA_DIM: usize = 128;
const NOPE: usize = 64;
const ROPE: usize = 32;
const V_DIM: usize = 64;
const SHARED: usize = 2;
const TOP_K: usize = 16;
const DECODE_TOKENS: usize = 64;
/// Interleaved rounds by default (`--runs`).
const RUNS: usize = 10;

/// The widths of the four models that follow the hidden size, as K3's do
/// (latent and expert width half of it, as K3's 3,584 and 3,072 against
/// 7,168 roughly are); head dims and the vocabulary stay fixed.
struct Shape {
    hidden: usize,
    kda_heads: usize,
    mla_heads: usize,
    q_lora: usize,
    kv_lora: usize,
    dense_inter: usize,
    latent: usize,
    moe_inter: usize,
}

impl Shape {
    /// The shape at hidden size `hidden` (a multiple of 128): 128-wide KDA
    /// and MLA heads, `hidden / 128` of each, low ranks a quarter of it, a
    /// latent MoE of half-width experts, layer 0's dense MLP twice as wide.
    fn at(hidden: usize) -> Shape {
        Shape {
            hidden,
            kda_heads: hidden / 128,
            mla_heads: hidden / 128,
            q_lora: hidden / 4,
            kv_lora: hidden / 4,
            dense_inter: 2 * hidden,
            latent: hidden / 2,
            moe_inter: hidden / 2,
        }
    }
}

/// How a tensor is stored.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// bf16, random values of the given scale.
    Bf16(f32),
    /// f32, constant value.
    F32(f32),
    /// f32 vector: `value` for the first `n` entries, 0 after them.
    F32Head(usize, f32),
    /// MXFP4 `weight_packed` + `weight_scale` (name is the `.weight` base).
    Mxfp4,
}

struct Spec {
    name: String,
    shape: Vec<usize>,
    kind: Kind,
}

fn spec(v: &mut Vec<Spec>, name: String, shape: &[usize], kind: Kind) {
    v.push(Spec {
        name,
        shape: shape.to_vec(),
        kind,
    });
}

/// Router correction bias of the pinned variant: far above any sigmoid
/// score, so experts `0..TOP_K` always win the top-k.
const PIN_BIAS: f32 = 10.0;

/// Tensor list of a model: `experts = Some(E)` for K3, `None` with
/// `dense_inter` for the dense kimi_linear; `pinned` biases the K3 router
/// towards experts `0..TOP_K`.
fn specs(sh: &Shape, experts: Option<usize>, dense_inter: usize, pinned: bool) -> Vec<Spec> {
    let k3 = experts.is_some();
    let root = if k3 { "language_model." } else { "" };
    let mut v = Vec::new();
    let d = sh.hidden;
    let p = sh.kda_heads * KDA_DIM;
    let norm = Kind::F32(1.0);
    let w = Kind::Bf16(0.04);
    spec(
        &mut v,
        format!("{root}model.embed_tokens.weight"),
        &[VOCAB, d],
        Kind::Bf16(1.0),
    );
    spec(&mut v, format!("{root}lm_head.weight"), &[VOCAB, d], w);
    spec(&mut v, format!("{root}model.norm.weight"), &[d], norm);
    if k3 {
        spec(
            &mut v,
            format!("{root}model.output_attn_res_norm.weight"),
            &[d],
            norm,
        );
        spec(
            &mut v,
            format!("{root}model.output_attn_res_proj.weight"),
            &[1, d],
            Kind::Bf16(0.1),
        );
    }
    for i in 0..LAYERS {
        let l = format!("{root}model.layers.{i}");
        for n in ["input_layernorm", "post_attention_layernorm"] {
            spec(&mut v, format!("{l}.{n}.weight"), &[d], norm);
        }
        if k3 {
            for n in ["self_attention_res", "mlp_res"] {
                spec(&mut v, format!("{l}.{n}_norm.weight"), &[d], norm);
                spec(
                    &mut v,
                    format!("{l}.{n}_proj.weight"),
                    &[1, d],
                    Kind::Bf16(0.1),
                );
            }
        }
        let a = format!("{l}.self_attn");
        if i + 1 < LAYERS {
            for n in ["q_proj", "k_proj", "v_proj"] {
                spec(&mut v, format!("{a}.{n}.weight"), &[p, d], w);
            }
            for n in ["q_conv1d", "k_conv1d", "v_conv1d"] {
                spec(
                    &mut v,
                    format!("{a}.{n}.weight"),
                    &[p, 1, 4],
                    Kind::Bf16(0.3),
                );
            }
            spec(&mut v, format!("{a}.f_a_proj.weight"), &[KDA_DIM, d], w);
            spec(&mut v, format!("{a}.f_b_proj.weight"), &[p, KDA_DIM], w);
            spec(&mut v, format!("{a}.dt_bias"), &[p], Kind::F32(-3.0));
            spec(
                &mut v,
                format!("{a}.A_log"),
                &[sh.kda_heads],
                Kind::F32(0.0),
            );
            spec(&mut v, format!("{a}.b_proj.weight"), &[sh.kda_heads, d], w);
            if k3 {
                spec(&mut v, format!("{a}.g_proj.weight"), &[p, d], w);
            } else {
                spec(&mut v, format!("{a}.g_a_proj.weight"), &[KDA_DIM, d], w);
                spec(&mut v, format!("{a}.g_b_proj.weight"), &[p, KDA_DIM], w);
            }
            spec(&mut v, format!("{a}.o_norm.weight"), &[KDA_DIM], norm);
            spec(&mut v, format!("{a}.o_proj.weight"), &[d, p], w);
        } else {
            if k3 {
                spec(&mut v, format!("{a}.q_a_proj.weight"), &[sh.q_lora, d], w);
                spec(
                    &mut v,
                    format!("{a}.q_a_layernorm.weight"),
                    &[sh.q_lora],
                    norm,
                );
                spec(
                    &mut v,
                    format!("{a}.q_b_proj.weight"),
                    &[sh.mla_heads * (NOPE + ROPE), sh.q_lora],
                    w,
                );
                spec(
                    &mut v,
                    format!("{a}.g_proj.weight"),
                    &[sh.mla_heads * V_DIM, d],
                    w,
                );
            } else {
                spec(
                    &mut v,
                    format!("{a}.q_proj.weight"),
                    &[sh.mla_heads * (NOPE + ROPE), d],
                    w,
                );
            }
            spec(
                &mut v,
                format!("{a}.kv_a_proj_with_mqa.weight"),
                &[sh.kv_lora + ROPE, d],
                w,
            );
            spec(
                &mut v,
                format!("{a}.kv_a_layernorm.weight"),
                &[sh.kv_lora],
                norm,
            );
            spec(
                &mut v,
                format!("{a}.kv_b_proj.weight"),
                &[sh.mla_heads * (NOPE + V_DIM), sh.kv_lora],
                w,
            );
            spec(
                &mut v,
                format!("{a}.o_proj.weight"),
                &[d, sh.mla_heads * V_DIM],
                w,
            );
        }
        match experts {
            Some(e) if i > 0 => {
                let m = format!("{l}.block_sparse_moe");
                spec(&mut v, format!("{m}.gate.weight"), &[e, d], w);
                let bias = if pinned {
                    Kind::F32Head(TOP_K, PIN_BIAS)
                } else {
                    Kind::F32(0.0)
                };
                spec(
                    &mut v,
                    format!("{m}.gate.e_score_correction_bias"),
                    &[e],
                    bias,
                );
                spec(
                    &mut v,
                    format!("{m}.routed_expert_down_proj.weight"),
                    &[sh.latent, d],
                    w,
                );
                spec(
                    &mut v,
                    format!("{m}.routed_expert_up_proj.weight"),
                    &[d, sh.latent],
                    w,
                );
                spec(
                    &mut v,
                    format!("{m}.routed_expert_norm.weight"),
                    &[sh.latent],
                    norm,
                );
                for j in 0..e {
                    spec(
                        &mut v,
                        format!("{m}.experts.{j}.w1.weight"),
                        &[sh.moe_inter, sh.latent],
                        Kind::Mxfp4,
                    );
                    spec(
                        &mut v,
                        format!("{m}.experts.{j}.w3.weight"),
                        &[sh.moe_inter, sh.latent],
                        Kind::Mxfp4,
                    );
                    spec(
                        &mut v,
                        format!("{m}.experts.{j}.w2.weight"),
                        &[sh.latent, sh.moe_inter],
                        Kind::Mxfp4,
                    );
                }
                let s = format!("{m}.shared_experts");
                spec(
                    &mut v,
                    format!("{s}.gate_proj.weight"),
                    &[sh.moe_inter * SHARED, d],
                    w,
                );
                spec(
                    &mut v,
                    format!("{s}.up_proj.weight"),
                    &[sh.moe_inter * SHARED, d],
                    w,
                );
                spec(
                    &mut v,
                    format!("{s}.down_proj.weight"),
                    &[d, sh.moe_inter * SHARED],
                    w,
                );
            }
            _ => {
                let inter = if k3 { sh.dense_inter } else { dense_inter };
                spec(&mut v, format!("{l}.mlp.gate_proj.weight"), &[inter, d], w);
                spec(&mut v, format!("{l}.mlp.up_proj.weight"), &[inter, d], w);
                spec(&mut v, format!("{l}.mlp.down_proj.weight"), &[d, inter], w);
            }
        }
    }
    v
}

/// Parameters used per decoded token: everything but the embedding table
/// and the experts a token does not visit.
fn active_params(sh: &Shape, specs: &[Spec], experts: Option<usize>) -> (usize, usize) {
    let numel = |s: &Spec| s.shape.iter().product::<usize>();
    let total: usize = specs.iter().map(numel).sum();
    let embed: usize = specs
        .iter()
        .filter(|s| s.name.ends_with("embed_tokens.weight"))
        .map(numel)
        .sum();
    let idle = match experts {
        Some(e) => (LAYERS - 1) * e.saturating_sub(TOP_K) * 3 * sh.latent * sh.moe_inter,
        None => 0,
    };
    (total, total - embed - idle)
}

/// Weight bytes read per decoded token, as stored (bf16 2 bytes a value,
/// f32 4, MXFP4 codes and scales): [`active_params`]' tensors, with a
/// token's `TOP_K` of every MoE layer's experts.
fn active_bytes(specs: &[Spec]) -> usize {
    specs
        .iter()
        .filter(|s| !s.name.ends_with("embed_tokens.weight"))
        .filter(|s| {
            // `….experts.{j}.w*`: only experts 0..TOP_K count (every token
            // visits TOP_K experts a layer, of the same size).
            s.name
                .split(".experts.")
                .nth(1)
                .and_then(|rest| rest.split('.').next())
                .and_then(|j| j.parse::<usize>().ok())
                .is_none_or(|j| j < TOP_K)
        })
        .map(|s| {
            let n: usize = s.shape.iter().product();
            match s.kind {
                Kind::Bf16(_) => 2 * n,
                Kind::F32(_) | Kind::F32Head(..) => 4 * n,
                Kind::Mxfp4 => mxfp4_bytes(s.shape[0], s.shape[1]),
            }
        })
        .sum()
}

fn text_config(sh: &Shape, experts: Option<usize>, dense_inter: usize) -> Value {
    let mut c = json!({
        "vocab_size": VOCAB, "hidden_size": sh.hidden, "num_hidden_layers": LAYERS,
        "num_attention_heads": sh.mla_heads, "num_key_value_heads": sh.mla_heads, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "tie_word_embeddings": false, "kv_lora_rank": sh.kv_lora,
        "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V_DIM, "mla_use_nope": true,
        "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": sh.kda_heads,
            "head_dim": KDA_DIM, "short_conv_kernel_size": 4},
        "bos_token_id": 1, "eos_token_id": 2,
    });
    match experts {
        Some(e) => {
            let extra = json!({
                "model_type": "kimi_linear", "hidden_act": "situ", "activation_situ_beta": 4.0,
                "activation_situ_linear_beta": 25.0, "intermediate_size": sh.dense_inter, "q_lora_rank": sh.q_lora,
                "mla_use_output_gate": true, "num_experts": e, "num_experts_per_token": TOP_K,
                "num_shared_experts": SHARED, "moe_intermediate_size": sh.moe_inter,
                "routed_expert_hidden_size": sh.latent, "latent_moe_use_norm": true,
                "moe_router_activation_func": "sigmoid", "moe_renormalize": true, "routed_scaling_factor": 1.0,
                "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "attn_res_block_size": 2,
            });
            merge(&mut c, extra);
            c["linear_attn_config"]["use_full_rank_gate"] = true.into();
            c["linear_attn_config"]["gate_lower_bound"] = (-5.0).into();
            json!({"model_type": "kimi_k3", "text_config": c, "vision_config": {}})
        }
        None => {
            let extra = json!({
                "model_type": "kimi_linear", "hidden_act": "silu", "intermediate_size": dense_inter,
                "q_lora_rank": null, "num_experts": 0, "first_k_dense_replace": LAYERS,
                "mlp_layer_types": vec!["dense"; LAYERS],
            });
            merge(&mut c, extra);
            c
        }
    }
}

fn merge(dst: &mut Value, src: Value) {
    if let (Some(d), Value::Object(s)) = (dst.as_object_mut(), src) {
        d.extend(s);
    }
}

fn write_checkpoint(dir: &Path, config: &Value, specs: &[Spec]) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config)?,
    )?;
    let mut rng = Rng::new(0x9E37_79B9_7F4A_7C15);
    let mut blobs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for s in specs {
        let n: usize = s.shape.iter().product();
        match s.kind {
            Kind::Bf16(scale) => {
                let data = (0..n)
                    .flat_map(|_| {
                        caracal_kernels::dtype::f32_to_bf16(rng.next_f32() * scale).to_le_bytes()
                    })
                    .collect();
                blobs.push((s.name.clone(), Dtype::BF16, s.shape.clone(), data));
            }
            Kind::F32(value) => {
                blobs.push((
                    s.name.clone(),
                    Dtype::F32,
                    s.shape.clone(),
                    (0..n).flat_map(|_| value.to_le_bytes()).collect(),
                ));
            }
            Kind::F32Head(head, value) => {
                blobs.push((
                    s.name.clone(),
                    Dtype::F32,
                    s.shape.clone(),
                    (0..n)
                        .flat_map(|i| if i < head { value } else { 0.0 }.to_le_bytes())
                        .collect(),
                ));
            }
            Kind::Mxfp4 => {
                let base = s
                    .name
                    .strip_suffix(".weight")
                    .expect("MXFP4 specs name a .weight");
                let (rows, cols) = (s.shape[0], s.shape[1]);
                // Eight random codes' bytes a draw: the 896-expert files run to GBs.
                let packed: Vec<u8> = (0..rows * cols / 16)
                    .flat_map(|_| rng.next_u64().to_le_bytes())
                    .collect();
                // E8M0 2^-6: elements of magnitude ≤ 6/64, like a trained layer's.
                let scales = vec![121u8; rows * cols / 32];
                blobs.push((
                    format!("{base}.weight_packed"),
                    Dtype::U8,
                    vec![rows, cols / 2],
                    packed,
                ));
                blobs.push((
                    format!("{base}.weight_scale"),
                    Dtype::U8,
                    vec![rows, cols / 32],
                    scales,
                ));
            }
        }
    }
    let views: Vec<(String, TensorView)> = blobs
        .iter()
        .map(|(n, d, s, b)| Ok((n.clone(), TensorView::new(*d, s.clone(), b)?)))
        .collect::<Result<_>>()?;
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))?;
    Ok(())
}

/// Bytes of one `rows × cols` MXFP4 matrix (codes and E8M0 scales).
fn mxfp4_bytes(rows: usize, cols: usize) -> usize {
    rows * cols / 2 + rows * cols / 32
}

/// Decode tokens/s of one greedy run.
fn decode_speed(model: &dyn caracal::models::CausalLm) -> Result<f64> {
    let req = GenerateRequest {
        prompt_ids: (1..=8).collect(),
        max_tokens: DECODE_TOKENS + 1,
        sampling: SamplingParams::greedy(),
        stop_ids: Vec::new(),
    };
    Ok(generate(model, &req, |_| {})?.decode_tokens_per_s)
}

/// Command line: `[f32] [--hidden N] [--runs N]`.
struct Args {
    activations: caracal_kernels::Activations,
    hidden: usize,
    runs: usize,
}

fn args() -> Result<Args> {
    let mut out = Args {
        activations: caracal_kernels::Activations::Int8,
        hidden: 512,
        runs: RUNS,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "f32" => out.activations = caracal_kernels::Activations::F32,
            "--hidden" => {
                let v = it.next().unwrap_or_default();
                out.hidden = v
                    .parse()
                    .ok()
                    .filter(|h| h % 128 == 0 && *h >= 256)
                    .ok_or_else(|| {
                        anyhow::anyhow!("--hidden takes a multiple of 128 from 256 up, got {v:?}")
                    })?;
            }
            "--runs" => {
                let v = it.next().unwrap_or_default();
                out.runs =
                    v.parse().ok().filter(|r| *r > 0).ok_or_else(|| {
                        anyhow::anyhow!("--runs takes a positive count, got {v:?}")
                    })?;
            }
            other => {
                anyhow::bail!("unknown argument {other:?} (usage: [f32] [--hidden N] [--runs N])")
            }
        }
    }
    Ok(out)
}

fn main() -> Result<()> {
    let args = args()?;
    let sh = &Shape::at(args.hidden);
    let root: PathBuf =
        std::env::temp_dir().join(format!("caracal-k3-bench-{}", std::process::id()));
    let sparse = specs(sh, Some(896), 0, false);
    let pinned = specs(sh, Some(896), 0, true);
    let all_active = specs(sh, Some(TOP_K), 0, false);
    let (sparse_total, target) = active_params(sh, &sparse, Some(896));
    let (aa_total, aa_active) = active_params(sh, &all_active, Some(TOP_K));
    // The dense model's parameters are linear in its MLP width: solve for it.
    let (_, a32) = active_params(sh, &specs(sh, None, 32, false), None);
    let (_, a64) = active_params(sh, &specs(sh, None, 64, false), None);
    let per32 = a64 - a32;
    let inter =
        ((32.0 + (target as f64 - a32 as f64) / per32 as f64 * 32.0) / 32.0).round() as usize * 32;
    let dense = specs(sh, None, inter, false);
    let (dense_total, dense_active) = active_params(sh, &dense, None);

    let rows = [
        (
            "k3-sparse (896 experts, top-16)",
            "sparse",
            text_config(sh, Some(896), 0),
            &sparse,
            sparse_total,
            target,
        ),
        (
            "k3-all-active (16 experts, top-16)",
            "all-active",
            text_config(sh, Some(TOP_K), 0),
            &all_active,
            aa_total,
            aa_active,
        ),
        (
            "kimi-linear-dense (bf16 MLP)",
            "dense",
            text_config(sh, None, inter),
            &dense,
            dense_total,
            dense_active,
        ),
        (
            "k3-sparse-pinned (896, routed to 0-15)",
            "pinned",
            text_config(sh, Some(896), 0),
            &pinned,
            sparse_total,
            target,
        ),
    ];
    let threads = rayon::current_num_threads();
    println!("K3 sparse vs dense decode: hidden {}, {LAYERS} layers (3 KDA + 1 MLA), latent {}, expert inter {}, MXFP4 experts, dense MLP width {inter}; {threads} threads, greedy {DECODE_TOKENS} tokens after an 8-token prompt, best of {}", sh.hidden, sh.latent, sh.moe_inter, args.runs);
    // MXFP4 experts meet int8 activations, as under `caracal serve` and `caracal
    // generate` (their `--quantized-activations` default); `f32` as the first
    // argument measures the exact-product path instead.
    let activations = args.activations;
    let opts = caracal::checkpoint::LoadOptions { activations };
    println!("quantized activations: {activations:?}");
    let mut models = Vec::new();
    for (_, tag, config, specs, _, _) in rows.iter() {
        let dir = root.join(tag);
        write_checkpoint(&dir, config, specs)?;
        models.push(caracal::models::load_with(&dir, &opts)?);
    }
    // As `caracal serve` does once its model is loaded.
    let huge = caracal::malloc::huge_pages_for_resident_memory();
    println!(
        "huge pages: {} MiB advised, {} MiB collapsed (CARACAL_HUGE_PAGES=0 skips)",
        huge.advised >> 20,
        huge.collapsed >> 20
    );
    let mut speeds = vec![0.0f64; rows.len()];
    for _ in 0..args.runs {
        for (s, m) in speeds.iter_mut().zip(&models) {
            *s = s.max(decode_speed(m.as_ref())?);
        }
    }
    for ((label, _, _, _, total, active), tps) in rows.iter().zip(&speeds) {
        println!(
            "{label:38} total {:>7.1}M  active {:>6.2}M  decode {tps:>8.1} tok/s",
            *total as f64 / 1e6,
            *active as f64 / 1e6
        );
    }
    println!(
        "ratio sparse/all-active speed {:.3} (total params ×{:.1}, active ×{:.3}); sparse/dense speed {:.3} (active ×{:.3})",
        speeds[0] / speeds[1],
        sparse_total as f64 / aa_total as f64,
        target as f64 / aa_active as f64,
        speeds[0] / speeds[2],
        target as f64 / dense_active as f64,
    );
    // What the 896-expert model adds to a token: routing (pinned vs
    // all-active) and fetching distinct experts (sparse vs pinned).
    let routed_bytes = (LAYERS - 1) * TOP_K * 3 * mxfp4_bytes(sh.moe_inter, sh.latent);
    // Cost per token that follows bytes read: the 896-row router reads more
    // than the 16-row one, so at equal bytes/s the sparse model reaches
    // this fraction of the all-active model's speed, and no more.
    let (sparse_bytes, aa_bytes) = (active_bytes(&sparse), active_bytes(&all_active));
    println!(
        "weight bytes a token: sparse {:.2} MB, all-active {:.2} MB: at equal bytes/s sparse/all-active is {:.3}; sparse/all-active speed {:.3} is {:.1}% of that",
        sparse_bytes as f64 / 1e6,
        aa_bytes as f64 / 1e6,
        aa_bytes as f64 / sparse_bytes as f64,
        speeds[0] / speeds[1],
        100.0 * speeds[0] / speeds[1] * sparse_bytes as f64 / aa_bytes as f64,
    );
    let fetch_s = 1.0 / speeds[0] - 1.0 / speeds[3];
    // Where the pinned experts do not stay in cache either (a large
    // `--hidden`), fetching them costs nothing measurable: no rate to print.
    let rate = if fetch_s > 0.0 {
        format!(", {:.1} GB/s", routed_bytes as f64 / fetch_s / 1e9)
    } else {
        String::new()
    };
    println!(
        "ratio pinned/all-active speed {:.3} (routing over 896 experts); sparse/pinned speed {:.3} (distinct experts: {:.2} MB of MXFP4 weights a token, {:+.1} µs a token{rate})",
        speeds[3] / speeds[1],
        speeds[0] / speeds[3],
        routed_bytes as f64 / 1e6,
        fetch_s * 1e6,
    );
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
