//! Every architecture against transformers' reference outputs on tiny
//! checkpoints saved in the published layout (tests/fixtures, made by
//! tools/make_fixtures.py), plus cache and batching invariants.

use std::path::Path;

mod common;

use caracal::generate::{generate, prompt_logits, GenerateRequest, LoadedModel};
use caracal::models::{LogitsMode, SeqBatch};
use caracal_kernels::paged::KvPool;
use caracal_kernels::sampling::SamplingParams;
use common::{copy_dir, fixture, floats, ids, max_abs_diff, TempDir};
use serde_json::Value;

const FIXTURES: [&str; 3] = ["tiny-llama", "tiny-deepseek-v3", "tiny-kimi-linear"];

/// Logits may differ from transformers' f32 forward only by summation order.
const LOGIT_TOL: f32 = 1e-4;

/// Greedy ids are compared up to the first step whose reference top-1/top-2
/// margin is below this (a near-tie can flip on rounding).
const MARGIN: f64 = 1e-2;

fn expected(name: &str) -> Value {
    common::expected(&fixture(name))
}

fn copy_fixture(name: &str) -> TempDir {
    copy_dir(&fixture(name), name)
}

fn check_logits(name: &str) {
    let m = LoadedModel::load(&fixture(name)).unwrap();
    let exp = expected(name);
    let prompt = ids(&exp["prompt_ids"]);
    let all = prompt_logits(m.model.as_ref(), &prompt).unwrap();
    let v = m.model.info().vocab_size;
    let last = &all[(prompt.len() - 1) * v..];
    let diff = max_abs_diff(last, &floats(&exp["last_logits"]));
    eprintln!("{name}: max abs logit diff vs transformers {diff:e}");
    assert!(
        diff < LOGIT_TOL,
        "{name}: last-position logits differ by {diff}"
    );
}

fn check_greedy(name: &str) {
    let m = LoadedModel::load(&fixture(name)).unwrap();
    let exp = expected(name);
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
    let got = generate(m.model.as_ref(), &req, |_| {}).unwrap().token_ids;
    let clear = margins
        .iter()
        .position(|&g| g < MARGIN)
        .unwrap_or(want.len());
    assert!(
        clear >= 4,
        "{name}: reference margins too small to test ({margins:?})"
    );
    assert_eq!(
        &got[..clear],
        &want[..clear],
        "{name}: greedy ids differ within the first {clear} clear-margin steps"
    );
}

/// Decoding one token at a time through the cache gives the logits of
/// recomputing the whole sequence.
fn check_incremental(name: &str) {
    let m = LoadedModel::load(&fixture(name)).unwrap();
    let model = m.model.as_ref();
    let exp = expected(name);
    let mut seq = ids(&exp["prompt_ids"]);
    seq.extend(ids(&exp["greedy_ids"]).iter().take(6));
    let v = model.info().vocab_size;
    let full = prompt_logits(model, &seq).unwrap();
    let info = model.info();
    let mut cache = KvPool::new(info.kv_layers, 8, 4, info.kv_width);
    let mut state = model.new_state();
    let split = 5;
    let mut got = model
        .forward(
            &mut cache,
            &mut [SeqBatch {
                tokens: &seq[..split],
                state: &mut state,
                logits: LogitsMode::All,
                embeds: &[],
            }],
        )
        .unwrap();
    for t in &seq[split..] {
        got.extend(
            model
                .forward(
                    &mut cache,
                    &mut [SeqBatch {
                        tokens: &[*t],
                        state: &mut state,
                        logits: LogitsMode::Last,
                        embeds: &[],
                    }],
                )
                .unwrap(),
        );
    }
    assert_eq!(got.len(), seq.len() * v);
    let diff = max_abs_diff(&got, &full);
    assert!(
        diff < 1e-3,
        "{name}: incremental decode differs from recompute by {diff}"
    );
}

/// Two sequences of different lengths in one batched forward give the same
/// logits as each run alone.
fn check_batched(name: &str) {
    let m = LoadedModel::load(&fixture(name)).unwrap();
    let model = m.model.as_ref();
    let exp = expected(name);
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
    assert!(
        max_abs_diff(&both[..a.len() * v], &alone_a) < 1e-3,
        "{name}: batched sequence A differs"
    );
    assert!(
        max_abs_diff(&both[a.len() * v..], &alone_b) < 1e-3,
        "{name}: batched sequence B differs"
    );
    // Then one decode step for both together.
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
    let mut a2 = a.clone();
    a2.push(3);
    let mut b2 = b.clone();
    b2.push(4);
    let ra = prompt_logits(model, &a2).unwrap();
    let rb = prompt_logits(model, &b2).unwrap();
    assert!(
        max_abs_diff(&step[..v], &ra[a.len() * v..]) < 1e-3,
        "{name}: batched decode A differs"
    );
    assert!(
        max_abs_diff(&step[v..], &rb[b.len() * v..]) < 1e-3,
        "{name}: batched decode B differs"
    );
}

#[test]
fn llama_matches_transformers_logits() {
    check_logits("tiny-llama");
}

#[test]
fn deepseek_v3_matches_transformers_logits() {
    check_logits("tiny-deepseek-v3");
}

#[test]
fn kimi_linear_matches_transformers_logits() {
    check_logits("tiny-kimi-linear");
}

#[test]
fn greedy_generation_matches_transformers() {
    for name in FIXTURES {
        check_greedy(name);
    }
}

#[test]
fn prefill_then_decode_equals_recompute() {
    for name in FIXTURES {
        check_incremental(name);
    }
}

#[test]
fn batched_forward_equals_separate_forwards() {
    for name in FIXTURES {
        check_batched(name);
    }
}

#[test]
fn chat_template_renders_like_transformers() {
    for name in FIXTURES {
        let m = LoadedModel::load(&fixture(name)).unwrap();
        let tok = m.tokenizer.as_ref().unwrap();
        let text = caracal::chat::render(
            tok.chat_template.as_deref().unwrap(),
            &[caracal::chat::ChatMessage::new("user", "Hello there")],
            None,
            true,
            tok.bos_token.as_deref(),
            tok.eos_token.as_deref(),
        )
        .unwrap();
        assert_eq!(
            tok.encode_chat(&text).unwrap(),
            ids(&expected(name)["chat_prompt_ids"]),
            "{name}"
        );
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

#[test]
fn kimi_k2_model_type_loads_as_deepseek_v3() {
    let d = copy_fixture("tiny-deepseek-v3");
    edit_config(&d.0, |v| v["model_type"] = "kimi_k2".into());
    let m = LoadedModel::load(&d.0).unwrap();
    assert_eq!(m.model.info().model_type, "kimi_k2");
    let exp = expected("tiny-deepseek-v3");
    let all = prompt_logits(m.model.as_ref(), &ids(&exp["prompt_ids"])).unwrap();
    let v = m.model.info().vocab_size;
    let n = ids(&exp["prompt_ids"]).len();
    assert!(max_abs_diff(&all[(n - 1) * v..], &floats(&exp["last_logits"])) < LOGIT_TOL);
}

#[test]
fn unknown_model_type_is_a_clear_error() {
    let d = copy_fixture("tiny-llama");
    edit_config(&d.0, |v| v["model_type"] = "mamba".into());
    let err = LoadedModel::load(&d.0).err().unwrap().to_string();
    assert!(
        err.contains("unknown model_type `mamba`") && err.contains("deepseek_v3"),
        "{err}"
    );
}

#[test]
fn wrong_tensor_shape_names_the_tensor() {
    let d = copy_fixture("tiny-llama");
    edit_config(&d.0, |v| v["intermediate_size"] = 100.into());
    let err = LoadedModel::load(&d.0).err().unwrap().to_string();
    assert!(
        err.contains("model.layers.0.mlp.gate_proj.weight") && err.contains("[100, 64]"),
        "{err}"
    );
}

#[test]
fn missing_files_are_named() {
    let d = copy_fixture("tiny-llama");
    std::fs::remove_file(d.0.join("model.safetensors")).unwrap();
    let err = LoadedModel::load(&d.0).err().unwrap().to_string();
    assert!(err.contains("safetensors"), "{err}");
    let err = LoadedModel::load(Path::new("/nonexistent/model"))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("/nonexistent/model"), "{err}");
}

#[test]
fn prompt_longer_than_context_is_rejected() {
    let m = LoadedModel::load(&fixture("tiny-llama")).unwrap();
    let ctx = m.model.info().max_position;
    let req = GenerateRequest {
        prompt_ids: vec![5; ctx + 1],
        max_tokens: 4,
        sampling: SamplingParams::greedy(),
        stop_ids: vec![],
    };
    let err = generate(m.model.as_ref(), &req, |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains(&format!("context length is {ctx}")), "{err}");
}
