//! Kimi K3 against the reference forward of `tools/k3_reference.py` on the
//! tiny checkpoint `tests/fixtures/tiny-kimi-k3` (8 layers 3:1 KDA/MLA with
//! the last one MLA, AttnRes blocks of 3, latent MoE with MXFP4 experts,
//! SiTU, gated MLA, bounded KDA gate, full-rank KDA output gate), plus cache,
//! batching, snapshot and checkpoint-layout invariants.

use std::path::{Path, PathBuf};
use std::sync::Arc;

mod common;

use caracal::generate::{generate, prompt_logits, GenerateRequest, LoadedModel};
use caracal::models::{CausalLm, ExpertDispatch, ExpertFfn, LogitsMode, SeqBatch};
use caracal_actors::engine::run_experts_local;
use caracal_kernels::paged::KvPool;
use caracal_kernels::sampling::SamplingParams;
use common::{floats, ids, max_abs_diff, TempDir};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

const FIXTURE: &str = "tiny-kimi-k3";

/// Logits may differ from the f32 reference only by summation order (the
/// chunked KDA form, MXFP4 decoding order, AttnRes's online softmax).
const LOGIT_TOL: f32 = 1e-4;

/// Greedy ids are compared up to the first step whose reference top-1/top-2
/// margin is below this (a near-tie can flip on rounding).
const MARGIN: f64 = 1e-2;

/// Two runs of the same model that differ only in how tokens are split into
/// forward calls (chunked vs recurrent KDA, paged MLA rows): f32 rounding,
/// amplified through 8 layers (measured up to ~6e-5 on logits of |x| ≤ 11).
const SPLIT_TOL: f32 = 3e-4;

fn fixture() -> PathBuf {
    common::fixture(FIXTURE)
}

fn expected() -> Value {
    common::expected(&fixture())
}

fn load(dir: &Path) -> Box<dyn CausalLm> {
    LoadedModel::load(dir).unwrap().model
}

fn last_logits(model: &dyn CausalLm, prompt: &[u32]) -> Vec<f32> {
    let v = model.info().vocab_size;
    let all = prompt_logits(model, prompt).unwrap();
    all[(prompt.len() - 1) * v..].to_vec()
}

fn forward(
    model: &dyn CausalLm,
    cache: &mut KvPool,
    tokens: &[u32],
    state: &mut caracal::models::SeqState,
    mode: LogitsMode,
) -> Vec<f32> {
    model
        .forward(
            cache,
            &mut [SeqBatch {
                tokens,
                state,
                logits: mode,
                embeds: &[],
            }],
        )
        .unwrap()
}

#[test]
fn loads_as_kimi_k3_with_the_hybrid_layout() {
    let m = load(&fixture());
    let info = m.info();
    assert_eq!(info.model_type, "kimi_k3");
    assert_eq!(
        (info.kv_layers, info.linear_layers),
        (2, 6),
        "layers 4 and 8 (1-based) are MLA"
    );
    assert_eq!(info.kv_width, 32 + 8);
    assert_eq!(info.vocab_size, 512);
    assert!(m.as_moe().is_some());
    assert_eq!(
        m.as_moe().unwrap().experts().len(),
        7,
        "layers 1..7 are MoE"
    );
}

#[test]
fn matches_reference_logits() {
    let m = load(&fixture());
    let exp = expected();
    let got = last_logits(m.as_ref(), &ids(&exp["prompt_ids"]));
    let diff = max_abs_diff(&got, &floats(&exp["last_logits"]));
    eprintln!(
        "kimi_k3: max abs logit diff vs reference {diff:e} (max |logit| {})",
        exp["max_abs_logit"]
    );
    assert!(diff < LOGIT_TOL, "last-position logits differ by {diff}");
}

#[test]
fn greedy_generation_matches_reference() {
    let m = load(&fixture());
    let exp = expected();
    let want = ids(&exp["greedy_ids"]);
    let margins: Vec<f64> = exp["margins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let req = GenerateRequest {
        prompt_ids: ids(&exp["prompt_ids"]),
        max_tokens: want.len(),
        sampling: SamplingParams::greedy(),
        stop_ids: Vec::new(),
    };
    let got = generate(m.as_ref(), &req, |_| {}).unwrap().token_ids;
    let clear = margins
        .iter()
        .position(|&g| g < MARGIN)
        .unwrap_or(want.len());
    assert!(
        clear >= 8,
        "reference margins too small to test ({margins:?})"
    );
    assert_eq!(
        &got[..clear],
        &want[..clear],
        "greedy ids differ within the first {clear} clear-margin steps"
    );
    // Every clear step's top-1 logit matches the reference too (recomputed over the growing sequence).
    let tops = exp["step_logits_top"].as_array().unwrap();
    let mut seq = ids(&exp["prompt_ids"]);
    for (step, top) in tops.iter().enumerate().take(clear) {
        let want_logit = top[0][1].as_f64().unwrap() as f32;
        let got_logits = last_logits(m.as_ref(), &seq);
        assert!(
            (got_logits[want[step] as usize] - want_logit).abs() < LOGIT_TOL,
            "step {step}"
        );
        seq.push(want[step]);
    }
}

/// Prefill in chunks (5 tokens, then 7, then one at a time) gives the logits
/// of one full forward: KDA states, conv histories and MLA rows carry over,
/// and AttnRes needs no cross-call state.
#[test]
fn prefill_then_decode_equals_recompute() {
    let m = load(&fixture());
    let model = m.as_ref();
    let exp = expected();
    let mut seq = ids(&exp["prompt_ids"]);
    seq.extend(ids(&exp["greedy_ids"]).iter().take(8));
    let v = model.info().vocab_size;
    let full = prompt_logits(model, &seq).unwrap();
    let info = model.info();
    let mut cache = KvPool::new(info.kv_layers, 8, 4, info.kv_width);
    let mut state = model.new_state();
    let mut got = forward(model, &mut cache, &seq[..5], &mut state, LogitsMode::All);
    got.extend(forward(
        model,
        &mut cache,
        &seq[5..12],
        &mut state,
        LogitsMode::All,
    ));
    for t in &seq[12..] {
        got.extend(forward(
            model,
            &mut cache,
            &[*t],
            &mut state,
            LogitsMode::Last,
        ));
    }
    assert_eq!(got.len(), seq.len() * v);
    let diff = max_abs_diff(&got, &full);
    eprintln!("kimi_k3: chunked/decode vs recompute {diff:e}");
    assert!(
        diff < SPLIT_TOL,
        "incremental decode differs from recompute by {diff}"
    );
}

#[test]
fn batched_forward_equals_separate_forwards() {
    let m = load(&fixture());
    let model = m.as_ref();
    let exp = expected();
    let a = ids(&exp["prompt_ids"]);
    let b: Vec<u32> = a.iter().rev().take(7).copied().collect();
    let alone_a = prompt_logits(model, &a).unwrap();
    let alone_b = prompt_logits(model, &b).unwrap();
    let info = model.info();
    let mut cache = KvPool::new(info.kv_layers, 16, 4, info.kv_width);
    let (mut sa, mut sb) = (model.new_state(), model.new_state());
    let both = model
        .forward(
            &mut cache,
            &mut [
                SeqBatch {
                    tokens: &a,
                    state: &mut sa,
                    logits: LogitsMode::All,
                    embeds: &[],
                },
                SeqBatch {
                    tokens: &b,
                    state: &mut sb,
                    logits: LogitsMode::All,
                    embeds: &[],
                },
            ],
        )
        .unwrap();
    let v = info.vocab_size;
    let (da, db) = (
        max_abs_diff(&both[..a.len() * v], &alone_a),
        max_abs_diff(&both[a.len() * v..], &alone_b),
    );
    eprintln!("kimi_k3: batched vs separate {da:e} / {db:e}");
    assert!(
        da < SPLIT_TOL && db < SPLIT_TOL,
        "batched sequences differ: {da} / {db}"
    );
    let step = model
        .forward(
            &mut cache,
            &mut [
                SeqBatch {
                    tokens: &[3],
                    state: &mut sa,
                    logits: LogitsMode::Last,
                    embeds: &[],
                },
                SeqBatch {
                    tokens: &[4],
                    state: &mut sb,
                    logits: LogitsMode::Last,
                    embeds: &[],
                },
            ],
        )
        .unwrap();
    let ra = prompt_logits(model, &[a.clone(), vec![3]].concat()).unwrap();
    let rb = prompt_logits(model, &[b.clone(), vec![4]].concat()).unwrap();
    assert!(
        max_abs_diff(&step[..v], &ra[a.len() * v..]) < SPLIT_TOL,
        "batched decode A differs"
    );
    assert!(
        max_abs_diff(&step[v..], &rb[b.len() * v..]) < SPLIT_TOL,
        "batched decode B differs"
    );
}

/// A `SeqState` cloned after a prefix (KDA states and conv histories copied,
/// MLA pages shared up to a page boundary) continues exactly like an
/// uninterrupted run, and so does the original, with different tokens.
#[test]
fn kda_snapshot_continues_like_an_uninterrupted_run() {
    let m = load(&fixture());
    let model = m.as_ref();
    let exp = expected();
    let prompt = ids(&exp["prompt_ids"]);
    let page = 4;
    let cut = prompt.len() / page * page; // a page boundary: the branches never share a written page
    let (head, tail_a) = (&prompt[..cut], &prompt[cut..]);
    let tail_b: Vec<u32> = vec![7, 8, 9, 10, 11];
    let info = model.info();
    let mut cache = KvPool::new(info.kv_layers, 32, page, info.kv_width);
    let mut state = model.new_state();
    forward(model, &mut cache, head, &mut state, LogitsMode::None);
    let mut snapshot = state.clone();
    let a = forward(model, &mut cache, tail_a, &mut state, LogitsMode::All);
    let mut b = forward(
        model,
        &mut cache,
        &tail_b[..2],
        &mut snapshot,
        LogitsMode::All,
    );
    for t in &tail_b[2..] {
        b.extend(forward(
            model,
            &mut cache,
            &[*t],
            &mut snapshot,
            LogitsMode::Last,
        ));
    }
    let v = info.vocab_size;
    let full_a = prompt_logits(model, &prompt).unwrap();
    let full_b = prompt_logits(model, &[head.to_vec(), tail_b.clone()].concat()).unwrap();
    let da = max_abs_diff(&a, &full_a[cut * v..]);
    let db = max_abs_diff(&b, &full_b[cut * v..]);
    eprintln!("kimi_k3: snapshot continuations vs uninterrupted {da:e} / {db:e}");
    assert!(
        da < SPLIT_TOL && db < SPLIT_TOL,
        "continuations differ from uninterrupted runs: {da} / {db}"
    );
}

#[test]
fn expert_dispatch_runs_the_latent_experts_identically() {
    struct Local(Vec<Vec<Arc<dyn ExpertFfn>>>);
    impl ExpertDispatch for Local {
        fn run(
            &self,
            moe_layer: usize,
            x: &[f32],
            hidden: usize,
            choices: &[Vec<(usize, f32)>],
        ) -> Vec<f32> {
            assert_eq!(
                hidden, 32,
                "experts see the latent width (routed_expert_hidden_size)"
            );
            run_experts_local(&self.0[moe_layer], x, hidden, choices)
        }
    }
    let m = load(&fixture());
    let prompt = ids(&expected()["prompt_ids"]);
    let before = last_logits(m.as_ref(), &prompt);
    let moe = m.as_moe().unwrap();
    moe.set_expert_dispatch(Arc::new(Local(moe.experts())));
    assert_eq!(last_logits(m.as_ref(), &prompt), before);
}

// ---------------------------------------------------------------------------
// Checkpoint variants, rewritten from the fixture into a scratch folder.

struct Tensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn read_tensors(dir: &Path) -> Vec<Tensor> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<Tensor> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| Tensor {
            name: n,
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            data: t.data().to_vec(),
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// A copy of the fixture with its tensors replaced by `tensors` and its
/// config edited by `edit`.
fn variant(tag: &str, tensors: Vec<Tensor>, edit: impl FnOnce(&mut Value)) -> TempDir {
    let dir = TempDir::new(tag);
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(fixture().join(f), dir.0.join(f)).unwrap();
    }
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap())
            .unwrap();
    edit(&mut cfg);
    std::fs::write(
        dir.0.join("config.json"),
        serde_json::to_string_pretty(&cfg).unwrap(),
    )
    .unwrap();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.0.join("model.safetensors")).unwrap();
    dir
}

#[test]
fn text_only_layout_loads_the_same_model() {
    let tensors: Vec<Tensor> = read_tensors(&fixture())
        .into_iter()
        .map(|t| Tensor {
            name: t.name.strip_prefix("language_model.").unwrap().to_string(),
            ..t
        })
        .collect();
    let d = variant("k3-text-only", tensors, |cfg| {
        let mut text = cfg["text_config"].clone();
        text["model_type"] = "kimi_k3".into();
        *cfg = text;
    });
    let prompt = ids(&expected()["prompt_ids"]);
    assert_eq!(
        last_logits(load(&d.0).as_ref(), &prompt),
        last_logits(load(&fixture()).as_ref(), &prompt)
    );
}

#[test]
fn bf16_experts_give_the_same_logits_as_mxfp4() {
    let all = read_tensors(&fixture());
    let mut out = Vec::new();
    let mut converted = 0;
    for t in &all {
        if let Some(base) = t.name.strip_suffix(".weight_packed") {
            let scale = all
                .iter()
                .find(|s| s.name == format!("{base}.weight_scale"))
                .unwrap();
            let (rows, cols) = (t.shape[0], t.shape[1] * 2);
            let vals =
                caracal_kernels::mxfp4::dequantize(&t.data, &scale.data, rows, cols).unwrap();
            // MXFP4 values (2 mantissa bits, scale 2^e) are exact in bf16.
            let bits: Vec<u8> = vals
                .iter()
                .flat_map(|&x| caracal_kernels::dtype::f32_to_bf16(x).to_le_bytes())
                .collect();
            out.push(Tensor {
                name: format!("{base}.weight"),
                dtype: Dtype::BF16,
                shape: vec![rows, cols],
                data: bits,
            });
            converted += 1;
        } else if !t.name.ends_with(".weight_scale") {
            out.push(Tensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                data: t.data.clone(),
            });
        }
    }
    assert_eq!(converted, 7 * 16 * 3);
    let d = variant("k3-bf16-experts", out, |_| {});
    let prompt = ids(&expected()["prompt_ids"]);
    let diff = max_abs_diff(
        &last_logits(load(&d.0).as_ref(), &prompt),
        &floats(&expected()["last_logits"]),
    );
    eprintln!("kimi_k3: bf16 experts vs reference {diff:e}");
    assert!(
        diff < LOGIT_TOL,
        "bf16 experts differ from the reference by {diff}"
    );
}

#[test]
fn a_log_shapes_and_layout_switch() {
    let prompt = ids(&expected()["prompt_ids"]);
    let want = last_logits(load(&fixture()).as_ref(), &prompt);
    let heads = 2;
    for (tag, shape) in [
        ("k3-alog-h", vec![heads]),
        ("k3-alog-11h1", vec![1, 1, heads, 1]),
    ] {
        let tensors = read_tensors(&fixture())
            .into_iter()
            .map(|t| {
                if t.name.ends_with(".A_log") {
                    Tensor {
                        data: t.data[..heads * 4].to_vec(),
                        shape: shape.clone(),
                        ..t
                    }
                } else {
                    t
                }
            })
            .collect();
        let d = variant(tag, tensors, |_| {});
        assert_eq!(
            last_logits(load(&d.0).as_ref(), &prompt),
            want,
            "A_log stored as {shape:?}"
        );
    }
    // The padded [head_dim] buffer read per channel is a different model.
    let d = variant("k3-alog-per-channel", read_tensors(&fixture()), |cfg| {
        cfg["text_config"]["linear_attn_config"]["a_log_layout"] = "per_channel".into();
    });
    let other = last_logits(load(&d.0).as_ref(), &prompt);
    assert!(
        max_abs_diff(&other, &want) > 1e-3,
        "a_log_layout=per_channel must change the gate"
    );
    // A per-head layout cannot read a [heads] tensor per channel.
    let tensors = read_tensors(&fixture())
        .into_iter()
        .map(|t| {
            if t.name.ends_with(".A_log") {
                Tensor {
                    data: t.data[..heads * 4].to_vec(),
                    shape: vec![heads],
                    ..t
                }
            } else {
                t
            }
        })
        .collect();
    let d = variant("k3-alog-bad", tensors, |cfg| {
        cfg["text_config"]["linear_attn_config"]["a_log_layout"] = "per_channel".into();
    });
    let err = LoadedModel::load(&d.0).err().unwrap().to_string();
    assert!(err.contains("A_log"), "{err}");
}

#[test]
fn unsupported_activation_is_a_clear_error() {
    let d = variant("k3-bad-act", read_tensors(&fixture()), |cfg| {
        cfg["text_config"]["hidden_act"] = "gelu".into()
    });
    let err = LoadedModel::load(&d.0).err().unwrap().to_string();
    assert!(err.contains("gelu") && err.contains("situ"), "{err}");
}
