//! Layer-kind rules, defaults and the messages of refused configs.

use serde_json::json;

use super::SUPPORTED_MODEL_TYPES;
use super::*;

fn err(config: Value) -> String {
    Arch::from_config(&config)
        .expect_err("the config is refused")
        .to_string()
}

fn kimi(extra: Value) -> Value {
    let mut v = json!({
        "model_type": "kimi_linear", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_experts": 8, "num_experts_per_token": 2,
        "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 2, "head_dim": 16}
    });
    for (k, x) in extra.as_object().expect("object").clone() {
        v[k] = x;
    }
    v
}

#[test]
fn supported_model_types_come_from_the_enum() {
    assert_eq!(
        SUPPORTED_MODEL_TYPES,
        [
            "llama",
            "deepseek_v3",
            "kimi_k2",
            "kimi_linear",
            "kimi_k3",
            "kimi_k25"
        ]
    );
    for t in ModelType::ALL {
        assert_eq!(ModelType::from_name(t.name()), Some(t));
    }
    let e = err(json!({"model_type": "gpt_neox"}));
    assert!(e.contains("gpt_neox") && e.contains("kimi_k3"), "{e}");
}

#[test]
fn kimi_layer_kinds_follow_the_1_based_lists() {
    let a = Arch::from_config(&kimi(json!({}))).unwrap();
    let kinds: Vec<_> = a.layers.iter().map(|l| (l.attention, l.mlp)).collect();
    assert_eq!(
        kinds,
        [
            (AttentionKind::Kda, MlpKind::Dense),
            (AttentionKind::Kda, MlpKind::Moe),
            (AttentionKind::Kda, MlpKind::Moe),
            (AttentionKind::Mla, MlpKind::Moe),
        ]
    );
    assert_eq!(
        (a.cache_index(2), a.cache_index(3), a.moe_index(3)),
        (2, 0, 2)
    );
    assert_eq!(a.kda.as_ref().unwrap().a_log_layout, ALogLayout::PerHead);
    // Without lists: the complement of full_attn_layers, then transformers' fallback.
    let only_full = kimi(json!({"linear_attn_config": {"full_attn_layers": [2]}}));
    let a = Arch::from_config(&only_full).unwrap();
    assert_eq!(a.count(AttentionKind::Mla), 1);
    assert_eq!(a.layers[1].attention, AttentionKind::Mla);
    let a = Arch::from_config(&kimi(json!({"linear_attn_config": {}}))).unwrap();
    assert_eq!(a.layers[0].attention, AttentionKind::Kda);
    assert_eq!(
        a.count(AttentionKind::Mla),
        0,
        "layer 5 would be the first full one"
    );
}

#[test]
fn mlp_layer_types_and_moe_layer_freq_pick_moe_layers() {
    let v = kimi(json!({"mlp_layer_types": ["sparse", "dense", "sparse", "dense"]}));
    let a = Arch::from_config(&v).unwrap();
    assert_eq!(
        (0..4).map(|i| a.is_moe(i)).collect::<Vec<_>>(),
        [true, false, true, false]
    );
    let v = kimi(json!({"first_k_dense_replace": 0, "moe_layer_freq": 2}));
    let a = Arch::from_config(&v).unwrap();
    assert_eq!(
        (0..4).map(|i| a.is_moe(i)).collect::<Vec<_>>(),
        [true, false, true, false]
    );
    let a = Arch::from_config(&kimi(json!({"num_experts": 0, "first_k_dense_replace": 0})));
    assert!(a.unwrap().moe.is_none(), "no experts: every layer dense");
}

#[test]
fn router_settings_are_validated_with_the_key_names() {
    for (extra, want) in [
        (
            json!({"num_expert_group": 0}),
            "config.json: `num_expert_group` must be >= 1, got 0",
        ),
        (
            json!({"num_experts_per_token": 12}),
            "`num_experts_per_token` (12) must be <= `num_experts` (8)",
        ),
        (
            json!({"num_experts_per_token": 0}),
            "`num_experts_per_token` must be >= 1, got 0",
        ),
        (
            json!({"num_expert_group": 3}),
            "`num_experts` (8) must be divisible by `num_expert_group` (3)",
        ),
        (
            json!({"num_expert_group": 2, "topk_group": 3}),
            "`topk_group` must be in 1..=`num_expert_group` (2), got 3",
        ),
        (
            json!({"num_expert_group": 4, "topk_group": 1, "num_experts_per_token": 3}),
            "`num_experts_per_token` (3) must be <= the 2 experts in the `topk_group` (1) kept groups",
        ),
        (
            json!({"moe_router_activation_func": "relu"}),
            "`moe_router_activation_func` must be `sigmoid` or `softmax`, got `relu`",
        ),
    ] {
        let e = err(kimi(extra.clone()));
        assert!(e.contains(want), "{extra}: {e}");
    }
    let e = err(
        json!({"model_type": "deepseek_v3", "n_routed_experts": 8, "num_experts_per_tok": 12,
        "n_group": 1, "topk_group": 1}),
    );
    assert!(
        e.contains("`num_experts_per_tok` (12) must be <= `n_routed_experts` (8)"),
        "{e}"
    );
}

#[test]
fn shapes_and_lists_are_validated() {
    for (config, want) in [
        (
            kimi(json!({"linear_attn_config": {"kda_layers": [1, 9]}})),
            "`linear_attn_config.kda_layers` entry 9 is outside 1..=4",
        ),
        (
            kimi(json!({"mlp_layer_types": ["dense", "sparse"]})),
            "`mlp_layer_types` has 2 entries but `num_hidden_layers` is 4",
        ),
        (
            kimi(
                json!({"layer_types": ["linear_attention", "full_attention", "mamba", "full_attention"],
                "linear_attn_config": {}}),
            ),
            "`layer_types` entries must be `linear_attention` or `full_attention`, got `mamba`",
        ),
        (
            kimi(json!({"num_hidden_layers": 1000000000})),
            "`num_hidden_layers` must be <= 4096, got 1000000000",
        ),
        (
            kimi(json!({"hidden_size": 0})),
            "`hidden_size` must be >= 1, got 0",
        ),
        (
            json!({"model_type": "kimi_k3", "text_config": {"attn_res_block_size": 0}}),
            "`attn_res_block_size` must be >= 1, got 0",
        ),
        (
            json!({"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 3}),
            "`num_key_value_heads` must divide `num_attention_heads` (4), got 3",
        ),
        (
            json!({"model_type": "llama", "hidden_size": 60, "num_attention_heads": 4}),
            "`head_dim` must be even and >= 2 (RoPE rotates pairs), got 15",
        ),
        (
            json!({"model_type": "deepseek_v3", "hidden_size": "wide"}),
            "config.json: invalid type: string \"wide\"",
        ),
    ] {
        let e = err(config.clone());
        assert!(e.contains(want), "{config}: {e}");
    }
}

#[test]
fn k3_wrapper_reads_text_config_and_quantization_groups() {
    let v = json!({
        "model_type": "kimi_k3",
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["re:.*\\.experts\\..*"], "weights": {"num_bits": 4}}},
            "ignore": ["lm_head"]},
        "vision_config": {"vt_hidden_size": 32, "vt_num_attention_heads": 2},
        "text_config": {"hidden_size": 64, "num_hidden_layers": 2, "num_experts": 4, "num_experts_per_token": 2,
            "routed_expert_hidden_size": 32, "latent_moe_use_norm": true, "attn_res_block_size": 3,
            "mla_use_output_gate": true, "hidden_act": "situ", "activation_situ_beta": 4.0,
            "linear_attn_config": {"kda_layers": [1], "num_heads": 2, "head_dim": 16,
                "use_full_rank_gate": true, "gate_lower_bound": -5.0}}
    });
    let a = Arch::from_config(&v).unwrap();
    assert_eq!(a.model_type, ModelType::KimiK3);
    assert_eq!(a.root, "language_model.");
    assert!(a.vision);
    assert_eq!(a.vision_config.as_ref().map(|v| v.head_dim()), Some(16));
    assert_eq!(a.attn_res_block_size, Some(3));
    let moe = a.moe.as_ref().unwrap();
    assert_eq!(
        (moe.latent, moe.latent_norm, moe.router.top_k),
        (Some(32), true, 2)
    );
    let kda = a.kda.as_ref().unwrap();
    assert_eq!(
        (kda.full_rank_gate, kda.gate_lower_bound, kda.a_log_layout),
        (true, Some(-5.0), ALogLayout::Auto)
    );
    assert!(a.mla.as_ref().unwrap().output_gate);
    assert_eq!(
        a.act,
        GluAct::Situ {
            beta: 4.0,
            linear_beta: None
        }
    );
    assert_eq!(a.quantization.method, QuantMethod::Mxfp4);
    assert_eq!(a.quantization.ignore, ["lm_head"]);
    assert_eq!(a.quantization.groups[0].num_bits, Some(4));
    assert_eq!(a.router_config().unwrap().top_k, 2);
    // The same keys under kimi_linear are not K3's: no AttnRes, gate or latent.
    let mut text = v["text_config"].clone();
    text["model_type"] = "kimi_linear".into();
    let a = Arch::from_config(&text).unwrap();
    assert_eq!(a.attn_res_block_size, None);
    assert_eq!(a.moe.as_ref().unwrap().latent, None);
}

#[test]
fn llama_is_moe_only_with_the_deepseek_keys() {
    let dense = json!({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3});
    let a = Arch::from_config(&dense).unwrap();
    assert!(a.moe.is_none() && (0..3).all(|i| !a.is_moe(i)));
    assert!(a.router_config().is_err());
    assert_eq!((a.kv_layers(), a.kv_width()), (3, 2 * 64));
    let mut moe = dense.clone();
    for (k, x) in [
        ("n_routed_experts", 4),
        ("num_experts_per_tok", 2),
        ("moe_intermediate_size", 32),
        ("first_k_dense_replace", 1),
    ] {
        moe[k] = x.into();
    }
    let a = Arch::from_config(&moe).unwrap();
    assert_eq!(
        (0..3).map(|i| a.is_moe(i)).collect::<Vec<_>>(),
        [false, true, true]
    );
    assert_eq!(a.moe_index(2), 1);
}
