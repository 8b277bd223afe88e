//! Tests of [`super`] (plan/mod.rs).

use super::*;
use crate::checkpoint::Checkpoint;

const K3_TOTAL: u64 = 2_779_931_834_976;

fn k3(weights: WeightScheme, devices: &str, memory: Option<u64>) -> PlanReport {
    let opts = PlanOptions {
        devices: DeviceSpec::parse(devices, memory).unwrap(),
        weights: Some(weights),
        ..PlanOptions::default()
    };
    plan(&PlanModel::preset("kimi-k3").unwrap(), &opts).unwrap()
}

fn scheme(r: &PlanReport, s: WeightScheme) -> &SchemeTotal {
    r.schemes.iter().find(|t| t.scheme == s).unwrap()
}

/// K3 text parameters by a direct formula (reference §0/§1.6/§2.3/§4.1), independent of the spec walk.
fn k3_reference() -> (u64, u64, u64) {
    let (d, v, h, hd) = (7168u64, 163_840u64, 96u64, 128u64);
    let p = h * hd;
    let kda = 5 * p * d + hd * d + p * hd + h * d + 3 * p * 4 + h + p + hd;
    let mla = 1536 * d + 1536 + h * 192 * 1536 + 576 * d + 512 + h * 256 * 512 + 2 * d * h * 128;
    let routed_layer = 896 * 3 * 3584 * 3072;
    let moe = 896 * d + 896 + routed_layer + 2 * 3584 * d + 3584 + 3 * d * 6144;
    let text = 2 * v * d + 69 * kda + 24 * mla + 93 * 6 * d + 3 * d + 3 * d * 33792 + 92 * moe;
    let active_with_embedding = text - 92 * routed_layer + 92 * 16 * 3 * 3584 * 3072;
    (text, 92 * routed_layer, active_with_embedding)
}

#[test]
fn k3_preset_counts_2779_9b_parameters() {
    let r = k3(WeightScheme::Mxfp4, "8xH200", None);
    let (text, routed, _) = k3_reference();
    // Exact: the spec walk equals the reference's module-by-module count to the parameter
    // (A_log counted as 96 values per KDA layer; TS's 128-slot buffer would add 69·32 = 2,208).
    assert_eq!(r.params.total, K3_TOTAL);
    assert!((r.params.total as f64 - 2_779_931_834_976.0).abs() < 0.05e9);
    assert_eq!(r.params.text, text);
    assert_eq!(r.params.routed_experts, routed);
    assert_eq!(r.params.vision_tower, 401_214_464, "401.2M MoonViT3d tower");
    assert_eq!(r.params.projector, 46_144_512);
    let attn_res = r
        .components
        .iter()
        .find(|c| c.component == Component::AttnRes)
        .unwrap();
    assert_eq!(
        attn_res.params,
        4 * 7168 * 93 + 2 * 7168,
        "4·d per layer + 2·d"
    );
}

#[test]
fn k3_active_params_follow_section_0_definitions() {
    let r = k3(WeightScheme::Mxfp4, "8xH200", None);
    let (_, _, with_embedding) = k3_reference();
    let emb = 163_840 * 7168;
    assert_eq!(r.params.active.with_embedding, with_embedding);
    assert_eq!(r.params.active.without_embedding, with_embedding - emb);
    assert_eq!(
        r.params.active.without_embedding_and_lm_head,
        with_embedding - 2 * emb
    );
    // §0: 104.19B (headline, excl. input embedding), 105.36B incl. it, 103.02B excl. both; ±0.005B.
    let bn = |x: u64| x as f64 / 1e9;
    assert!((bn(r.params.active.without_embedding) - 104.19).abs() < 0.005);
    assert!((bn(r.params.active.with_embedding) - 105.36).abs() < 0.005);
    assert!((bn(r.params.active.without_embedding_and_lm_head) - 103.02).abs() < 0.005);
}

#[test]
fn k3_mxfp4_layout_weighs_1_42_tib() {
    let r = k3(WeightScheme::Mxfp4, "8xH200", None);
    let (_, routed, _) = k3_reference();
    // Routed experts 17 bytes per 32 weights, the rest 2 bytes each.
    let expect = routed / 32 * 17 + (K3_TOTAL - routed) * 2;
    assert_eq!(r.devices.weight_bytes, expect);
    let tib = expect as f64 / (1u64 << 40) as f64;
    assert!((tib - 1.420).abs() < 0.001, "{tib} TiB");
    assert!((expect as f64 / 1e9 - 1561.0).abs() < 0.5, "≈1,561 GB");
    let mx = r
        .weights_by_format
        .iter()
        .find(|f| f.format == StorageFormat::Mxfp4)
        .unwrap();
    assert_eq!(mx.params, routed);
}

#[test]
fn k3_bf16_and_fp8_totals() {
    let r = k3(WeightScheme::Bf16, "8xH200", None);
    assert_eq!(
        scheme(&r, WeightScheme::Bf16).bytes,
        2 * K3_TOTAL,
        "5,559.9 GB"
    );
    let fp8 = scheme(&r, WeightScheme::Fp8);
    // 8 b/w + BF16 for ~3.2B non-linear params (+~2.35B·8 bits) + f32 block scales (32/16384 b/w).
    let gb = fp8.bytes as f64 / 1e9;
    assert!(gb > K3_TOTAL as f64 / 1e9 && gb < 2790.0, "{gb}");
    assert!(
        fp8.bits_per_weight > 8.0 && fp8.bits_per_weight < 8.03,
        "{}",
        fp8.bits_per_weight
    );
}

#[test]
fn k3_q4_k_m_is_about_1685_gb_and_the_article_implies_4_64_bits() {
    let r = k3(WeightScheme::Q4KM, "8xH200", None);
    let q = scheme(&r, WeightScheme::Q4KM);
    // Reference §7: ≈4.84–4.85 b/w, ≈1,685 GB. Band: ±10 GB / ±0.02 b/w around it.
    assert!(
        (q.bytes as f64 / 1e9 - 1682.5).abs() < 10.0,
        "{} GB",
        q.bytes as f64 / 1e9
    );
    assert!(
        (q.bits_per_weight - 4.845).abs() < 0.02,
        "{}",
        q.bits_per_weight
    );
    let article = r
        .published
        .iter()
        .find(|p| p.label.contains("1612.4"))
        .unwrap();
    assert!((article.implied_bits_per_weight - 1612.4e9 * 8.0 / K3_TOTAL as f64).abs() < 1e-12);
    assert!((article.implied_bits_per_weight - 4.64).abs() < 0.001);
    assert!(!article.consistent);
    let tib = r
        .published
        .iter()
        .find(|p| p.label.contains("1.42 TiB"))
        .unwrap();
    assert!(tib.consistent);
    let table = render_table(&r);
    assert!(
        table.contains("corresponds to 4.64 bits/weight, not Q4_K_M's"),
        "{table}"
    );
}

#[test]
fn k3_cache_is_29_0_gb_per_1m_tokens_plus_428_6_mib_state() {
    let r = k3(WeightScheme::Mxfp4, "8xH200", None);
    let c = &r.cache;
    assert_eq!(c.mla_bytes_per_token_bf16, 24 * 576 * 2);
    assert_eq!(c.mla_bytes_per_token_fp8, 13_824);
    assert_eq!(
        c.mla_bytes_per_token_bf16 * (1 << 20),
        28_991_029_248,
        "29.0 GB"
    );
    assert_eq!(c.kda_state_bytes, 69 * 96 * 128 * 128 * 4);
    assert_eq!(c.kda_conv_bytes, 69 * 3 * 12288 * 3 * 2);
    let mib = (c.kda_state_bytes + c.kda_conv_bytes) as f64 / (1u64 << 20) as f64;
    assert!((mib - 428.6).abs() < 0.05, "{mib} MiB");
    assert_eq!(
        c.session_bytes,
        28_991_029_248 + c.kda_state_bytes + c.kda_conv_bytes
    );
    assert_eq!(
        c.attn_res_activation_bytes_per_token,
        8 * 7168 * 2,
        "≈115 KB per token (§2.4)"
    );
}

#[test]
fn k3_does_not_fit_on_8xh200_but_fits_16_sessions_on_8xb300() {
    let r = k3(WeightScheme::Mxfp4, "8xH200", None);
    let budget = (8.0 * 141e9 * 0.9) as u64 - 8 * DEFAULT_RESERVE_PER_DEVICE;
    assert_eq!(r.devices.budget_bytes, budget);
    assert!(!r.devices.fits);
    assert!(
        r.devices
            .verdict
            .starts_with("does not fit: weights need 1560.8 GB, devices offer 983.2 GB"),
        "{}",
        r.devices.verdict
    );
    let r = k3(WeightScheme::Mxfp4, "8xB300", None);
    let free = (8.0 * 288e9 * 0.9) as u64 - 8 * DEFAULT_RESERVE_PER_DEVICE - r.devices.weight_bytes;
    assert_eq!(r.devices.sessions, free / r.cache.session_bytes);
    assert_eq!(r.devices.sessions, 16);
    assert!(
        r.devices
            .verdict
            .starts_with("fits: 16 concurrent 1M-token sessions"),
        "{}",
        r.devices.verdict
    );
}

#[test]
fn weights_that_fit_without_room_for_one_session_say_so() {
    // 1,770 GB · 0.9 − 4 GB = 1,589 GB: weights (1,560.8 GB) fit, one session (29.4 GB) does not.
    let r = k3(WeightScheme::Mxfp4, "cpu", Some(1_770_000_000_000));
    assert!(!r.devices.fits && r.devices.sessions == 0);
    assert!(
        r.devices
            .verdict
            .contains("but one 1M-token session needs 29.4 GB"),
        "{}",
        r.devices.verdict
    );
}

#[test]
fn fp8_cache_and_mla_replicas_scale_the_session() {
    let model = PlanModel::preset("kimi-k3").unwrap();
    let base = PlanOptions {
        context: 1000,
        ..PlanOptions::default()
    };
    let state = 69 * 96 * 128 * 128 * 4 + 69 * 3 * 12288 * 3 * 2;
    let bf16 = plan(&model, &base).unwrap().cache.session_bytes;
    let fp8 = plan(
        &model,
        &PlanOptions {
            kv_cache: CacheDtype::Fp8,
            ..base.clone()
        },
    )
    .unwrap()
    .cache
    .session_bytes;
    let tp8 = plan(
        &model,
        &PlanOptions {
            mla_cache_replicas: 8,
            ..base
        },
    )
    .unwrap()
    .cache
    .session_bytes;
    assert_eq!(bf16, 27_648 * 1000 + state);
    assert_eq!(fp8, 13_824 * 1000 + state);
    assert_eq!(tp8, 8 * 27_648 * 1000 + state);
}

#[test]
fn k2_config_counts_1026_4b_total_and_32_9b_active() {
    let r = plan(
        &PlanModel::preset("kimi-k2").unwrap(),
        &PlanOptions::default(),
    )
    .unwrap();
    assert_eq!(r.scheme, WeightScheme::Fp8, "K2 ships block FP8");
    // Direct formula: embedding + lm_head + 61 MLA layers + norms + dense layer 0 + 60 MoE layers.
    let (d, h) = (7168u64, 64u64);
    let mla = 1536 * d + 1536 + h * 192 * 1536 + 576 * d + 512 + h * 256 * 512 + d * h * 128;
    let expert = 3 * d * 2048;
    let moe = 384 * d + 384 + 384 * expert + expert;
    let total = 2 * 163_840 * d + 61 * (mla + 2 * d) + d + 3 * d * 18432 + 60 * moe;
    assert_eq!(r.params.total, total);
    assert!((total as f64 / 1e9 - 1026.4).abs() < 0.05);
    // §4.3's 32.9B counts embedding and lm_head.
    assert_eq!(r.params.active.with_embedding, total - 60 * 376 * expert);
    assert!((r.params.active.with_embedding as f64 / 1e9 - 32.9).abs() < 0.05);
    assert_eq!(
        r.cache.mla_bytes_per_token_bf16, 70_272,
        "§7: 61 × 576 × 2 B"
    );
}

#[test]
fn kimi_linear_48b_is_in_its_class() {
    let r = plan(
        &PlanModel::preset("kimi-linear-48b").unwrap(),
        &PlanOptions::default(),
    )
    .unwrap();
    let bn = |x: u64| x as f64 / 1e9;
    // Published as "48B total, 3B active"; the derived count is 49.12B / 3.11B excl. embedding.
    assert!(
        (bn(r.params.total) - 49.12).abs() < 0.01,
        "{}",
        bn(r.params.total)
    );
    assert!((bn(r.params.active.without_embedding) - 3.11).abs() < 0.01);
    assert_eq!(
        r.cache.mla_bytes_per_token_bf16, 8064,
        "§7: 7 layers × 576 × 2 B"
    );
    let state = r.cache.kda_state_bytes + r.cache.kda_conv_bytes;
    assert!(
        (state as f64 / (1u64 << 20) as f64 - 41.4).abs() < 0.05,
        "§7: 41.4 MiB"
    );
}

fn checkpoint_elements(dir: &str) -> u64 {
    let ckpt = Checkpoint::open(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(dir),
    )
    .unwrap();
    ckpt.names()
        .iter()
        .map(|n| ckpt.entry(n).unwrap().shape.iter().product::<usize>() as u64)
        .sum()
}

fn fixture_report(dir: &str) -> PlanReport {
    let args = PlanArgs {
        model_dir: Some(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures")
                .join(dir),
        ),
        ..PlanArgs::default()
    };
    let json = run_plan(&PlanArgs {
        json: true,
        ..args.clone()
    })
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let model = PlanModel::from_dir(args.model_dir.as_ref().unwrap()).unwrap();
    let report = plan(&model, &PlanOptions::default()).unwrap();
    assert_eq!(
        v["params"]["total"].as_u64(),
        Some(report.params.total),
        "--json carries the same numbers"
    );
    report
}

#[test]
fn tiny_deepseek_v3_count_equals_its_safetensors_elements() {
    let r = fixture_report("tiny-deepseek-v3");
    assert_eq!(r.params.total, checkpoint_elements("tiny-deepseek-v3"));
    assert_eq!(r.stored_matches_plan, Some(true));
    // Actual bytes: bf16 everywhere except the f32 router weight and bias.
    let stored = r.stored.as_ref().unwrap();
    assert_eq!(stored.bytes, 2 * r.params.total + 2 * 2 * (8 * 64 + 8));
}

#[test]
fn tiny_kimi_linear_and_llama_counts_equal_their_safetensors_elements() {
    let r = fixture_report("tiny-kimi-linear");
    assert_eq!(r.params.total, checkpoint_elements("tiny-kimi-linear"));
    assert_eq!(r.cache.kda_state_bytes, 3 * 2 * 32 * 32 * 4);
    let r = fixture_report("tiny-llama");
    assert_eq!(r.params.total, checkpoint_elements("tiny-llama"));
    assert_eq!(
        r.cache.gqa_bytes_per_token_bf16,
        2 * 2 * 16 * 2 * 2,
        "2·kv_heads·head_dim·layers·2 B"
    );
    assert_eq!(
        r.params.active.without_embedding, r.params.active.with_embedding,
        "tied: the matrix is the lm_head"
    );
}

#[test]
fn table_has_units_components_and_the_verdict_last() {
    let table = render_table(&k3(WeightScheme::Mxfp4, "8xH200", None));
    for needle in [
        "params (B)",
        "weights GB",
        "weights GiB",
        "attention (KDA)",
        "routed experts",
        "vision tower",
        "428.6 MiB",
    ] {
        assert!(table.contains(needle), "missing {needle}:\n{table}");
    }
    assert!(table
        .trim_end()
        .lines()
        .last()
        .unwrap()
        .starts_with("verdict: does not fit"));
}

#[test]
fn run_plan_rejects_bad_arguments() {
    assert!(run_plan(&PlanArgs::default())
        .unwrap_err()
        .to_string()
        .contains("--preset"));
    let bad = PlanArgs {
        preset: Some("kimi-k3".into()),
        weights: Some("int2".into()),
        ..PlanArgs::default()
    };
    assert!(run_plan(&bad)
        .unwrap_err()
        .to_string()
        .contains("--weights"));
    let ctx = PlanArgs {
        preset: Some("kimi-k2".into()),
        context: Some(1 << 20),
        ..PlanArgs::default()
    };
    assert!(run_plan(&ctx)
        .unwrap()
        .contains("exceeds the model's max_position_embeddings 131072"));
    let util = PlanOptions {
        utilisation: 1.5,
        ..PlanOptions::default()
    };
    assert!(plan(&PlanModel::preset("kimi-k3").unwrap(), &util).is_err());
}

/// The plan's attention-cache bytes per token, at the bf16 default, equal a
/// bf16 KV pool's for the same model (K3's `small` synth preset: MLA latent
/// rows; SmolLM2-135M: GQA rows).
#[test]
fn plan_kv_bytes_per_token_equal_the_bf16_pools() {
    use caracal_kernels::paged::{KvDtype, KvPool};
    let k3_small = crate::convert::synth::k3_config(&crate::convert::synth::K3Shape::small(), 0);
    let smollm2 = serde_json::json!({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "hidden_act": "silu", "tie_word_embeddings": true
    });
    for (name, config, want) in [
        ("k3-small", &k3_small, None),
        // 30 layers · 2 · 3 kv heads · 64 · 2 bytes.
        ("smollm2", &smollm2, Some(30 * 2 * 3 * 64 * 2)),
    ] {
        let arch = crate::checkpoint::arch::Arch::from_config(config).unwrap();
        let pool = KvPool::with_dtype(arch.kv_layers(), 1, 1, arch.kv_width(), KvDtype::Bf16);
        let model = PlanModel::from_config(config, name, "test").unwrap();
        // `--kv-cache-dtype int8` and `f32`: the pool the runtime builds
        // (segments from the architecture) and the plan agree too.
        for (dtype, cache) in [
            (KvDtype::Int8, CacheDtype::Int8),
            (KvDtype::F32, CacheDtype::F32),
        ] {
            let (w, seg) = (arch.kv_width(), arch.kv_segment());
            let p = KvPool::with_layout(arch.kv_layers(), 1, 1, w, seg, dtype);
            let opts = PlanOptions {
                kv_cache: cache,
                ..PlanOptions::default()
            };
            let r = plan(&model, &opts).unwrap();
            assert_eq!(
                r.cache.bytes_per_token,
                p.bytes_per_token() as u64,
                "{name} {cache:?}"
            );
        }
        let r = plan(&model, &PlanOptions::default()).unwrap();
        assert_eq!(r.cache.kv_dtype, CacheDtype::Bf16);
        assert_eq!(
            r.cache.bytes_per_token,
            pool.bytes_per_token() as u64,
            "{name}"
        );
        if let Some(w) = want {
            assert_eq!(pool.bytes_per_token(), w, "{name}");
            // int8: 64 one-byte values and one f32 scale per head's K or V.
            let int8 = KvPool::with_layout(30, 1, 1, 384, 64, KvDtype::Int8);
            assert_eq!(int8.bytes_per_token(), 30 * (384 + 6 * 4), "{name} int8");
        }
        // The f32 pool (`--kv-cache-dtype f32`) holds twice the bytes.
        let f32_pool = KvPool::new(arch.kv_layers(), 1, 1, arch.kv_width());
        assert_eq!(f32_pool.bytes_per_token(), 2 * pool.bytes_per_token());
    }
}
