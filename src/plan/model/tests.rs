//! Tests of [`super`] (model.rs).

use super::*;
use serde_json::json;
use std::collections::HashMap;

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Expands `{e}` and compares every spec with the checkpoint header entry of the same name.
fn assert_specs_match_checkpoint(dir: &str) {
    let dir = fixture(dir);
    let model = PlanModel::from_dir(&dir).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let mut expected: HashMap<String, u64> = HashMap::new();
    for s in model.tensors() {
        for e in 0..s.count {
            expected.insert(s.name.replace("{e}", &e.to_string()), s.rows * s.cols);
        }
    }
    let mut found: HashMap<String, u64> = HashMap::new();
    for n in ckpt.names() {
        found.insert(
            n.to_string(),
            ckpt.entry(n).unwrap().shape.iter().product::<usize>() as u64,
        );
    }
    let mut missing: Vec<_> = found
        .keys()
        .filter(|n| !expected.contains_key(*n))
        .collect();
    let mut extra: Vec<_> = expected
        .keys()
        .filter(|n| !found.contains_key(*n))
        .collect();
    missing.sort();
    extra.sort();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "not modelled: {missing:?}; not in checkpoint: {extra:?}"
    );
    for (n, elems) in &found {
        assert_eq!(expected[n], *elems, "{n}");
    }
}

#[test]
fn tiny_deepseek_v3_tensors_match_its_checkpoint_name_by_name() {
    assert_specs_match_checkpoint("tiny-deepseek-v3");
}

#[test]
fn tiny_kimi_linear_tensors_match_its_checkpoint_name_by_name() {
    assert_specs_match_checkpoint("tiny-kimi-linear");
}

#[test]
fn tiny_llama_tied_embeddings_have_no_lm_head() {
    assert_specs_match_checkpoint("tiny-llama");
    let m = PlanModel::from_dir(&fixture("tiny-llama")).unwrap();
    assert!(m.tensors().iter().all(|t| t.component != Component::LmHead));
}

#[test]
fn k3_preset_has_69_kda_and_24_mla_layers() {
    let m = PlanModel::preset("kimi-k3").unwrap();
    assert_eq!(
        (
            m.text.count(AttentionKind::Kda),
            m.text.count(AttentionKind::Mla)
        ),
        (69, 24)
    );
    assert_eq!(
        m.text.attention[3],
        AttentionKind::Mla,
        "layer 4 (1-based) is full attention"
    );
    assert_eq!(
        m.text.attention[92],
        AttentionKind::Mla,
        "the last layer is full attention"
    );
    assert_eq!(m.native_weights, WeightScheme::Mxfp4);
    assert_eq!(m.text.moe_layers.iter().filter(|&&x| x).count(), 92);
}

#[test]
fn unknown_model_type_and_preset_are_named() {
    let err = PlanModel::from_config(&json!({"model_type": "gpt_neox"}), "x", "x")
        .unwrap_err()
        .to_string();
    assert!(err.contains("gpt_neox") && err.contains("kimi_k3"), "{err}");
    assert!(PlanModel::preset("kimi-k9")
        .unwrap_err()
        .to_string()
        .contains("kimi-k3"));
}
