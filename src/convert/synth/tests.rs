//! Tests of [`super`] (synth.rs).

use super::*;

#[test]
fn layer_pattern_is_k3s_three_to_one_with_last_layer_full() {
    let s = K3Shape::tiny();
    assert_eq!(s.full_attn_layers(), vec![4, 7]);
    assert_eq!(s.kda_layers(), vec![1, 2, 3, 5, 6]);
    let k3 = K3Shape {
        num_hidden_layers: 93,
        ..K3Shape::tiny()
    };
    let full = k3.full_attn_layers();
    assert_eq!(full.len(), 24, "K3 has 24 MLA layers of 93");
    assert_eq!((full[0], full[22], full[23]), (4, 92, 93));
    assert!(
        s.num_hidden_layers.div_ceil(s.attn_res_block_size) >= 3,
        "several AttnRes blocks"
    );
}

#[test]
fn draws_do_not_depend_on_thread_count() {
    let n = 3 * DRAW_CHUNK + 17;
    let a = draw(7, "x", n, Init::Normal(1.0));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    let b = pool.install(|| draw(7, "x", n, Init::Normal(1.0)));
    assert_eq!(a, b);
    assert_ne!(
        a,
        draw(7, "y", n, Init::Normal(1.0)),
        "the name changes the stream"
    );
    // Moments of N(0, 1) over ~200k draws: |mean| < 0.01, |var − 1| < 0.02.
    let mean = a.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
    let var = a.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
    assert!(
        mean.abs() < 0.01 && (var - 1.0).abs() < 0.02,
        "mean {mean}, var {var}"
    );
}

#[test]
fn uniform_draws_stay_in_range() {
    let v = draw(1, "u", 10_000, Init::Uniform(-0.5, 0.5));
    assert!(v.iter().all(|x| (-0.5..0.5).contains(x)));
}

#[test]
fn truncated_o200k_keeps_every_byte_and_every_merge_parent() {
    use base64::Engine;
    let text = truncated_o200k_rank_file(KIMI_NUM_RANKS).expect("o200k is embedded");
    let mut ranks: HashMap<Vec<u8>, u32> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let (b64, r) = line.split_once(' ').expect("`base64 rank` lines");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .expect("valid base64");
        assert_eq!(
            r.parse::<usize>().expect("integer rank"),
            i,
            "ranks are dense and in order"
        );
        ranks.insert(bytes, i as u32);
    }
    assert_eq!(
        ranks.len(),
        KIMI_NUM_RANKS as usize,
        "no token appears twice"
    );
    assert!(
        (0..=255u8).all(|b| ranks.contains_key(&vec![b])),
        "all 256 single bytes are kept"
    );
    // Every multi-byte token is the merge of two lower-ranked kept tokens,
    // so BPE over the truncated list can produce each of them.
    for (bytes, &rank) in &ranks {
        if bytes.len() > 1 {
            let reachable = (1..bytes.len()).any(|k| {
                matches!((ranks.get(&bytes[..k]), ranks.get(&bytes[k..])), (Some(&a), Some(&b)) if a < rank && b < rank)
            });
            assert!(reachable, "rank {rank} cannot be formed by a merge");
        }
    }
}

#[test]
fn tiny_shape_is_valid_and_config_has_k3_keys() {
    let s = K3Shape::tiny();
    s.validate().expect("tiny is valid");
    let c = k3_config(&s, 1);
    assert_eq!(c["model_type"], "kimi_k3");
    assert_eq!(
        c["text_config"]["linear_attn_config"]["gate_lower_bound"],
        -5.0
    );
    assert_eq!(c["text_config"]["num_experts"], 896);
    assert_eq!(c["synth_version"], SYNTH_VERSION);
    let bad = K3Shape {
        routed_expert_hidden_size: 48,
        ..K3Shape::tiny()
    };
    assert!(bad.validate().is_err(), "MXFP4 needs multiples of 32");
}

#[test]
fn small_shape_is_valid_and_keeps_k3s_attention_share() {
    let s = K3Shape::small();
    s.validate().expect("small is valid");
    assert_eq!("small".parse::<Preset>().unwrap(), Preset::Small);
    let c = k3_config(&s, 1);
    assert_eq!(c["synth"]["preset"], "small");
    assert_eq!(k3_config(&K3Shape::tiny(), 1)["synth"]["preset"], "tiny");
    // Absorbed-MLA MACs per cached key and token over all MLA layers; K3's
    // figure (24 layers × 96 heads × 1,088) is 0.099 of its 104 G active
    // MACs per token at 4,096 cached tokens.
    let per_key = s.full_attn_layers().len()
        * s.num_attention_heads
        * (2 * s.kv_lora_rank + s.qk_rope_head_dim);
    assert_eq!(per_key, 2 * 8 * 144);
    let k3 = 24.0 * 96.0 * 1088.0 * 4096.0 / 104e9;
    assert!((k3 - 0.099_f64).abs() < 0.002, "{k3}");
}

#[test]
fn unknown_arch_and_preset_are_named_in_the_error() {
    let e = "llama"
        .parse::<Arch>()
        .expect_err("not supported")
        .to_string();
    assert!(e.contains("llama") && e.contains("kimi_k3"), "{e}");
    let e = "huge"
        .parse::<Preset>()
        .expect_err("not supported")
        .to_string();
    assert!(e.contains("huge") && e.contains("tiny"), "{e}");
}
