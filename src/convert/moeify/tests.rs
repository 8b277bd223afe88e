//! Tests of [`super`] (moeify.rs).

use super::*;
use crate::generate::prompt_logits;

/// Logits of the MoE may differ from the dense model's only by f32
/// summation order (shared + routed partial sums instead of one sum).
const LOGIT_TOL: f32 = 1e-4;

fn tiny_llama() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama")
}

fn temp(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("caracal-moeify-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

fn opts(variant: Variant, experts: usize) -> MoeifyOptions {
    MoeifyOptions {
        experts,
        variant,
        ..MoeifyOptions::default()
    }
}

#[test]
fn smollm2_geometry_gives_512_shared_and_1024_routed_neurons() {
    let c = plan_split(1536, &opts(Variant::Copy, 8)).unwrap();
    assert_eq!(
        (
            c.shared,
            c.moe_intermediate_size,
            c.n_shared_experts,
            c.shared_padding
        ),
        (512, 1024, 1, 512)
    );
    assert_eq!(c.routed, vec![512..1536; 8]);
    assert_eq!(c.down_scale, 0.5);
    let s = plan_split(1536, &opts(Variant::Split, 8)).unwrap();
    assert_eq!(
        (
            s.shared,
            s.moe_intermediate_size,
            s.n_shared_experts,
            s.shared_padding
        ),
        (512, 128, 4, 0)
    );
    assert_eq!(s.routed.first(), Some(&(512..640)));
    assert_eq!(s.routed.last(), Some(&(1408..1536)));
    assert_eq!(s.down_scale, 4.0);
}

#[test]
fn inexact_scalings_are_refused() {
    let mut o = opts(Variant::Copy, 8);
    o.routed_scaling_factor = 2.827;
    assert!(plan_split(1536, &o)
        .unwrap_err()
        .to_string()
        .contains("power of two"));
    let err = plan_split(1536, &opts(Variant::Split, 6))
        .unwrap_err()
        .to_string();
    assert!(err.contains("power-of-two expert count"), "{err}");
    let mut o = opts(Variant::Split, 8);
    o.top_k = Some(2);
    let split = plan_split(1536, &o).unwrap();
    assert!(router_keys(&o, &split)
        .unwrap_err()
        .to_string()
        .contains("top_k = experts"));
}

#[test]
fn copy_variant_defaults_to_grouped_top2() {
    let o = opts(Variant::Copy, 8);
    let k = router_keys(&o, &plan_split(1536, &o).unwrap()).unwrap();
    assert_eq!((k.num_experts_per_tok, k.n_group, k.topk_group), (2, 2, 1));
    let o = opts(Variant::Split, 8);
    let k = router_keys(&o, &plan_split(1536, &o).unwrap()).unwrap();
    assert_eq!((k.num_experts_per_tok, k.n_group, k.topk_group), (8, 1, 1));
}

/// Builds both variants of the tiny llama fixture (bf16, 2 layers, MLP
/// 128): checks the written experts against the dense weights element by
/// element, and the MoE logits against the dense logits.
#[test]
fn moeified_tiny_llama_has_the_dense_weights_and_logits() {
    let dense_dir = tiny_llama();
    let dense = crate::models::load(&dense_dir).unwrap();
    let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 512).collect();
    let want = prompt_logits(dense.as_ref(), &prompt).unwrap();
    let src = Checkpoint::open(&dense_dir).unwrap();
    let down = src
        .tensor_f32("model.layers.1.mlp.down_proj.weight", &[64, 128])
        .unwrap();
    let gate = src
        .tensor_f32("model.layers.1.mlp.gate_proj.weight", &[128, 64])
        .unwrap();
    for variant in [Variant::Copy, Variant::Split] {
        let out = temp(variant.name());
        let o = opts(variant, 4);
        let report = moeify_checkpoint(&dense_dir, &out, &o).unwrap();
        assert_eq!(report.moe_layers, 1);
        assert!(report.copied_files.iter().any(|f| f == "tokenizer.json"));
        let s = &report.split;
        let ck = Checkpoint::open(&out).unwrap();
        // Layer 0 stays dense and byte-identical.
        assert_eq!(
            ck.bytes("model.layers.0.mlp.down_proj.weight").unwrap(),
            src.bytes("model.layers.0.mlp.down_proj.weight").unwrap()
        );
        assert!(!ck.has("model.layers.1.mlp.down_proj.weight"));
        let m = s.moe_intermediate_size;
        for (j, r) in s.routed.iter().enumerate() {
            let ed = ck
                .tensor_f32(
                    &format!("model.layers.1.mlp.experts.{j}.down_proj.weight"),
                    &[64, m],
                )
                .unwrap();
            let eg = ck
                .tensor_f32(
                    &format!("model.layers.1.mlp.experts.{j}.gate_proj.weight"),
                    &[m, 64],
                )
                .unwrap();
            for h in 0..64 {
                for (c, n) in r.clone().enumerate() {
                    assert_eq!(
                        ed[h * m + c],
                        down[h * 128 + n] * s.down_scale,
                        "expert {j} down[{h}, {n}]"
                    );
                }
            }
            assert_eq!(eg[..], gate[r.start * 64..r.end * 64]);
        }
        let width = s.n_shared_experts * m;
        let sd = ck
            .tensor_f32(
                "model.layers.1.mlp.shared_experts.down_proj.weight",
                &[64, width],
            )
            .unwrap();
        for h in 0..64 {
            assert_eq!(
                sd[h * width..h * width + s.shared],
                down[h * 128..h * 128 + s.shared]
            );
            assert!(
                sd[h * width + s.shared..(h + 1) * width]
                    .iter()
                    .all(|&v| v == 0.0),
                "padding is zero"
            );
        }
        let router = ck
            .tensor_f32("model.layers.1.mlp.gate.weight", &[4, 64])
            .unwrap();
        assert_eq!(router.iter().all(|&v| v == 0.0), variant == Variant::Split);

        let moe = crate::models::load(&out).unwrap();
        assert!(moe.as_moe().is_some());
        let got = prompt_logits(moe.as_ref(), &prompt).unwrap();
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        eprintln!(
            "tiny-llama {}: max abs logit diff MoE vs dense {diff:e}",
            variant.name()
        );
        assert!(
            diff < LOGIT_TOL,
            "{}: logits differ by {diff}",
            variant.name()
        );
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn non_llama_and_already_moe_inputs_are_refused() {
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-deepseek-v3");
    let err = moeify_checkpoint(&fx, &temp("dsv3"), &MoeifyOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("model_type `deepseek_v3`"), "{err}");
    let out = temp("twice");
    moeify_checkpoint(&tiny_llama(), &out, &opts(Variant::Copy, 4)).unwrap();
    let err = moeify_checkpoint(&out, &temp("twice2"), &opts(Variant::Copy, 4))
        .unwrap_err()
        .to_string();
    assert!(err.contains("already an MoE"), "{err}");
    let _ = std::fs::remove_dir_all(&out);
}
