//! `caracal synth`: the synthesized tiny Kimi K3 is deterministic, has K3's
//! published names, shapes and dtypes, carries a working Kimi tiktoken
//! tokenizer, loads as a `kimi_k3` model and generates; the default model is
//! made once per synth version.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use caracal::chat::toolcall::{render_k3, K3Options, Message};
use caracal::checkpoint::config::read_json;
use caracal::checkpoint::{Checkpoint, StoredDType};
use caracal::convert::synth::{
    default_model_dir, is_current_synth, synthesize, K3Shape, SynthOptions, DEFAULT_SEED,
    K3_SPECIAL_TOKENS, KIMI_NUM_RANKS, SYNTH_VERSION,
};
use caracal::generate::{generate, prompt_logits, GenerateRequest, LoadedModel};
use caracal::text::tokenizer::{ChatFormat, StreamDecoder, TextTokenizer};
use caracal_kernels::sampling::SamplingParams;

/// A fresh folder under Cargo's per-target temp dir (stale copies are removed).
fn temp_dir(tag: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("synth-{tag}"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("stale temp dir is removable");
    }
    dir
}

fn opts(seed: u64) -> SynthOptions {
    SynthOptions {
        seed,
        progress: false,
        ..SynthOptions::default()
    }
}

/// One synthesized model shared by the tests of this file.
fn model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = temp_dir("shared");
        synthesize(&dir, &opts(DEFAULT_SEED)).expect("synth succeeds");
        dir
    })
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .expect("readable dir")
        .map(|e| {
            let e = e.expect("dir entry");
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).expect("readable file"),
            )
        })
        .collect();
    out.sort();
    out
}

#[test]
fn same_seed_gives_byte_identical_files_and_another_seed_other_weights() {
    let again = temp_dir("again");
    let summary = synthesize(&again, &opts(DEFAULT_SEED)).expect("synth succeeds");
    let (a, b) = (files(model()), files(&again));
    assert_eq!(
        a.iter().map(|f| &f.0).collect::<Vec<_>>(),
        b.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{name} differs between two runs with the same seed");
    }
    assert_eq!(
        summary.bytes,
        a.iter().map(|f| f.1.len() as u64).sum::<u64>()
    );
    assert!(
        summary.bytes < 100_000_000,
        "tiny means tens of MB, got {} bytes",
        summary.bytes
    );
    std::fs::remove_dir_all(&again).ok();

    let other = temp_dir("other");
    synthesize(&other, &opts(DEFAULT_SEED + 1)).expect("synth succeeds");
    let c = files(&other);
    let shard = |v: &[(String, Vec<u8>)]| {
        v.iter()
            .find(|f| f.0 == "model-00002-of-00002.safetensors")
            .expect("expert shard")
            .1
            .clone()
    };
    assert_ne!(shard(&a), shard(&c), "the seed changes the weights");
    std::fs::remove_dir_all(&other).ok();
}

#[test]
fn synth_refuses_a_non_empty_folder() {
    let dir = temp_dir("nonempty");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("keep.txt"), "user data").expect("write");
    let err = synthesize(&dir, &opts(1))
        .expect_err("non-empty folder")
        .to_string();
    assert!(err.contains("empty"), "{err}");
    assert_eq!(
        std::fs::read_to_string(dir.join("keep.txt")).expect("still there"),
        "user data"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn checkpoint_has_k3_names_shapes_and_dtypes() {
    let s = K3Shape::tiny();
    let ck = Checkpoint::open(model()).expect("opens sharded checkpoint");
    let check = |name: &str, dtype: StoredDType, shape: &[usize]| {
        let e = ck
            .entry(name)
            .unwrap_or_else(|_| panic!("{name} is missing"));
        assert_eq!((e.dtype, e.shape.as_slice()), (dtype, shape), "{name}");
    };
    let (d, v) = (s.hidden_size, s.vocab_size);
    assert_eq!(v, 163_840);
    check(
        "language_model.model.embed_tokens.weight",
        StoredDType::BF16,
        &[v, d],
    );
    check("language_model.lm_head.weight", StoredDType::BF16, &[v, d]);
    check("language_model.model.norm.weight", StoredDType::BF16, &[d]);
    check(
        "language_model.model.output_attn_res_norm.weight",
        StoredDType::BF16,
        &[d],
    );
    check(
        "language_model.model.output_attn_res_proj.weight",
        StoredDType::BF16,
        &[1, d],
    );
    // Layer 0: KDA + dense MLP.
    let p = "language_model.model.layers.0";
    let w = s.kda_num_heads * s.kda_head_dim;
    check(
        &format!("{p}.mlp.gate_proj.weight"),
        StoredDType::BF16,
        &[s.intermediate_size, d],
    );
    check(
        &format!("{p}.mlp.down_proj.weight"),
        StoredDType::BF16,
        &[d, s.intermediate_size],
    );
    check(
        &format!("{p}.self_attn.q_proj.weight"),
        StoredDType::BF16,
        &[w, d],
    );
    check(
        &format!("{p}.self_attn.q_conv1d.weight"),
        StoredDType::BF16,
        &[w, 1, s.short_conv_kernel_size],
    );
    check(
        &format!("{p}.self_attn.g_proj.weight"),
        StoredDType::BF16,
        &[w, d],
    );
    check(
        &format!("{p}.self_attn.f_a_proj.weight"),
        StoredDType::BF16,
        &[s.kda_head_dim, d],
    );
    check(
        &format!("{p}.self_attn.f_b_proj.weight"),
        StoredDType::BF16,
        &[w, s.kda_head_dim],
    );
    check(
        &format!("{p}.self_attn.b_proj.weight"),
        StoredDType::BF16,
        &[s.kda_num_heads, d],
    );
    check(&format!("{p}.self_attn.dt_bias"), StoredDType::F32, &[w]);
    check(
        &format!("{p}.self_attn.A_log"),
        StoredDType::F32,
        &[s.kda_head_dim],
    );
    check(
        &format!("{p}.self_attn.o_norm.weight"),
        StoredDType::BF16,
        &[s.kda_head_dim],
    );
    check(
        &format!("{p}.self_attention_res_proj.weight"),
        StoredDType::BF16,
        &[1, d],
    );
    check(&format!("{p}.mlp_res_norm.weight"), StoredDType::BF16, &[d]);
    assert!(
        !ck.has(&format!("{p}.self_attn.g_a_proj.weight")),
        "K3's KDA gate is full rank"
    );
    // Layer 3 (1-based 4): gated NoPE MLA with q_lora; latent MoE.
    let p = "language_model.model.layers.3";
    let qk = s.qk_nope_head_dim + s.qk_rope_head_dim;
    let h = s.num_attention_heads;
    check(
        &format!("{p}.self_attn.q_a_proj.weight"),
        StoredDType::BF16,
        &[s.q_lora_rank, d],
    );
    check(
        &format!("{p}.self_attn.q_b_proj.weight"),
        StoredDType::BF16,
        &[h * qk, s.q_lora_rank],
    );
    check(
        &format!("{p}.self_attn.kv_a_proj_with_mqa.weight"),
        StoredDType::BF16,
        &[s.kv_lora_rank + s.qk_rope_head_dim, d],
    );
    check(
        &format!("{p}.self_attn.kv_b_proj.weight"),
        StoredDType::BF16,
        &[h * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank],
    );
    check(
        &format!("{p}.self_attn.o_proj.weight"),
        StoredDType::BF16,
        &[d, h * s.v_head_dim],
    );
    check(
        &format!("{p}.self_attn.g_proj.weight"),
        StoredDType::BF16,
        &[h * s.v_head_dim, d],
    );
    let m = format!("{p}.block_sparse_moe");
    let (l, i) = (s.routed_expert_hidden_size, s.moe_intermediate_size);
    check(&format!("{m}.gate.weight"), StoredDType::BF16, &[896, d]);
    check(
        &format!("{m}.gate.e_score_correction_bias"),
        StoredDType::F32,
        &[896],
    );
    check(
        &format!("{m}.routed_expert_down_proj.weight"),
        StoredDType::BF16,
        &[l, d],
    );
    check(
        &format!("{m}.routed_expert_norm.weight"),
        StoredDType::BF16,
        &[l],
    );
    check(
        &format!("{m}.routed_expert_up_proj.weight"),
        StoredDType::BF16,
        &[d, l],
    );
    check(
        &format!("{m}.shared_experts.gate_proj.weight"),
        StoredDType::BF16,
        &[2 * i, d],
    );
    check(
        &format!("{m}.shared_experts.down_proj.weight"),
        StoredDType::BF16,
        &[d, 2 * i],
    );
    // 896 MXFP4 experts in every MoE layer: packed [out, in/2], scales [out, in/32].
    for layer in 1..s.num_hidden_layers {
        for e in [0, 1, 447, 895] {
            let b = format!("language_model.model.layers.{layer}.block_sparse_moe.experts.{e}");
            check(
                &format!("{b}.w1.weight_packed"),
                StoredDType::U8,
                &[i, l / 2],
            );
            check(
                &format!("{b}.w1.weight_scale"),
                StoredDType::U8,
                &[i, l / 32],
            );
            check(
                &format!("{b}.w3.weight_packed"),
                StoredDType::U8,
                &[i, l / 2],
            );
            check(
                &format!("{b}.w2.weight_packed"),
                StoredDType::U8,
                &[l, i / 2],
            );
            check(
                &format!("{b}.w2.weight_scale"),
                StoredDType::U8,
                &[l, i / 32],
            );
        }
        assert!(!ck.has(&format!(
            "language_model.model.layers.{layer}.block_sparse_moe.experts.896.w1.weight_packed"
        )));
    }
    let names = ck.names();
    let experts = names
        .iter()
        .filter(|n| n.contains(".block_sparse_moe.experts."))
        .count();
    assert_eq!(experts, (s.num_hidden_layers - 1) * 896 * 3 * 2);
    // Every MXFP4 scale is a finite E8M0 exponent (0xFF would be NaN).
    let scales = ck
        .bytes("language_model.model.layers.6.block_sparse_moe.experts.895.w2.weight_scale")
        .expect("scale bytes");
    assert!(
        scales
            .iter()
            .all(|&b| b != 0xFF && (100..=140).contains(&b)),
        "{scales:?}"
    );
    // Vision tower and projector.
    let (vd, vq) = (s.vt_hidden_size, s.vt_qkv_hidden_size);
    check(
        "vision_tower.patch_embed.proj.weight",
        StoredDType::BF16,
        &[vd, 3, 14, 14],
    );
    check(
        "vision_tower.patch_embed.pos_emb.weight",
        StoredDType::BF16,
        &[64, 64, vd],
    );
    check(
        "vision_tower.encoder.blocks.1.wqkv.weight",
        StoredDType::BF16,
        &[3 * vq, vd],
    );
    check(
        "vision_tower.encoder.blocks.1.wo.weight",
        StoredDType::BF16,
        &[vd, vq],
    );
    check(
        "vision_tower.encoder.blocks.0.mlp.fc0.weight",
        StoredDType::BF16,
        &[s.vt_intermediate_size, vd],
    );
    check(
        "vision_tower.encoder.final_layernorm.weight",
        StoredDType::BF16,
        &[vd],
    );
    check(
        "mm_projector.proj.0.weight",
        StoredDType::BF16,
        &[4 * vd, 4 * vd],
    );
    check(
        "mm_projector.proj.2.weight",
        StoredDType::BF16,
        &[d, 4 * vd],
    );
    check("mm_projector.post_norm.weight", StoredDType::BF16, &[d]);
    assert!(
        names.iter().all(|n| !n.ends_with(".bias")),
        "K3 has no biases"
    );
    assert!(names.iter().all(|n| n.starts_with("language_model.")
        || n.starts_with("vision_tower.")
        || n.starts_with("mm_projector.")));
}

#[test]
fn config_carries_every_k3_key() {
    let c = read_json(&model().join("config.json"), "config.json").expect("config.json");
    assert_eq!(c["model_type"], "kimi_k3");
    assert_eq!(c["synth_version"], SYNTH_VERSION);
    assert_eq!(c["media_placeholder_token_id"], 163_605);
    assert_eq!(c["quantization_config"]["format"], "mxfp4-pack-quantized");
    let t = &c["text_config"];
    for key in [
        "vocab_size",
        "hidden_size",
        "head_dim",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "mla_use_nope",
        "num_experts",
        "num_experts_per_token",
        "num_shared_experts",
        "moe_intermediate_size",
        "moe_router_activation_func",
        "moe_renormalize",
        "routed_scaling_factor",
        "use_grouped_topk",
        "num_expert_group",
        "topk_group",
        "first_k_dense_replace",
        "moe_layer_freq",
        "num_nextn_predict_layers",
        "linear_attn_config",
        "mla_use_output_gate",
        "attn_res_block_size",
        "activation_situ_beta",
        "activation_situ_linear_beta",
        "routed_expert_hidden_size",
        "latent_moe_use_norm",
        "topk_method",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ] {
        assert!(t.get(key).is_some(), "text_config.{key} is missing");
    }
    assert_eq!(t["model_type"], "kimi_linear");
    assert_eq!(t["hidden_act"], "situ");
    assert_eq!(
        (
            t["activation_situ_beta"].as_f64(),
            t["activation_situ_linear_beta"].as_f64()
        ),
        (Some(4.0), Some(25.0))
    );
    assert_eq!(
        (
            t["num_experts"].as_u64(),
            t["num_experts_per_token"].as_u64(),
            t["num_shared_experts"].as_u64()
        ),
        (Some(896), Some(16), Some(2))
    );
    let lin = &t["linear_attn_config"];
    assert_eq!(lin["full_attn_layers"], serde_json::json!([4, 7]));
    assert_eq!(lin["kda_layers"], serde_json::json!([1, 2, 3, 5, 6]));
    assert_eq!(lin["use_full_rank_gate"], true);
    assert_eq!(lin["gate_lower_bound"].as_f64(), Some(-5.0));
    let blocks = t["num_hidden_layers"]
        .as_u64()
        .expect("layers")
        .div_ceil(t["attn_res_block_size"].as_u64().expect("block"));
    assert!(blocks >= 3, "several AttnRes blocks, got {blocks}");
    let v = &c["vision_config"];
    for key in [
        "patch_size",
        "init_pos_emb_height",
        "init_pos_emb_width",
        "init_pos_emb_time",
        "pos_emb_type",
        "merge_kernel_size",
        "merge_type",
        "video_attn_type",
        "vt_hidden_size",
        "vt_num_hidden_layers",
        "vt_num_attention_heads",
        "vt_intermediate_size",
        "mm_projector_type",
        "mm_hidden_size",
        "projector_hidden_act",
        "projector_ln_eps",
        "text_hidden_size",
        "qkv_hidden_size",
        "norm_type",
        "attn_bias",
        "linear_bias",
        "patch_embed_proj_bias",
        "mlp_type",
        "activation_func",
        "pos_emb_interpolation_mode",
    ] {
        assert!(v.get(key).is_some(), "vision_config.{key} is missing");
    }
    let g = read_json(
        &model().join("generation_config.json"),
        "generation_config.json",
    )
    .expect("generation config");
    assert_eq!(g["eos_token_id"], 163_586);
}

#[test]
fn tokenizer_round_trips_text_and_maps_k3_specials() {
    let tok = TextTokenizer::from_dir(model()).expect("tiktoken tokenizer loads");
    assert_eq!(tok.backend_name(), "tiktoken");
    assert_eq!(
        tok.as_tiktoken().expect("tiktoken").num_ranks(),
        KIMI_NUM_RANKS as usize
    );
    assert_eq!(tok.vocab_size(), 163_842);
    for (id, name) in K3_SPECIAL_TOKENS {
        assert_eq!(tok.token_to_id(name), Some(id), "{name}");
        assert!(tok.is_special(id), "{name} is special");
    }
    assert_eq!(tok.token_to_id("<|reserved_token_163592|>"), Some(163_592));
    for text in [
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.\n\n  fn main() { println!(\"{}\", 42); }",
        "Kimi K3 有 896 个专家。日本語のテキスト, émigré café, Ελληνικά 🦀🦜",
        "numbers 1234567 and   spaces\t\ttabs\r\n",
    ] {
        let ids = tok.encode(text).expect("encode");
        assert!(
            ids.iter().all(|&id| id < KIMI_NUM_RANKS),
            "plain text uses BPE ranks only"
        );
        assert_eq!(tok.decode(&ids, false).expect("decode"), text);
    }
    // The ranks are o200k_base's: where both regexes cut the same pieces, ids agree.
    let o200k = tiktoken_rs::o200k_base().expect("o200k embedded");
    let text = "Hello world, this is a simple sentence";
    assert_eq!(
        tok.encode(text).expect("encode"),
        o200k.encode_ordinary(text)
    );
    // Specials written in text are recognised; skip_special drops them.
    let ids = tok
        .encode("<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>")
        .expect("encode");
    assert_eq!(ids[0], 163_587);
    assert_eq!(*ids.last().expect("non-empty"), 163_586);
    assert_eq!(
        tok.decode(&ids, true).expect("decode"),
        "message role=\"user\"himessage"
    );
    assert_eq!(tok.chat_format(), Some(ChatFormat::KimiK3));
    assert_eq!(tok.eos_token.as_deref(), Some("<|end_of_msg|>"));
}

#[test]
fn stream_decoding_holds_back_split_characters() {
    let tok = TextTokenizer::from_dir(model()).expect("tokenizer loads");
    let tt = tok.as_tiktoken().expect("tiktoken backend");
    let text = "crab 🦀, parrot 🦜, 𓀀 hieroglyph, ꙮ multiocular o";
    let ids = tok.encode(text).expect("encode");
    let partial = ids
        .iter()
        .filter(|&&id| std::str::from_utf8(tt.token_bytes(id).expect("rank")).is_err())
        .count();
    assert!(
        partial >= 2,
        "the sample must split characters across tokens ({partial} partial tokens)"
    );
    let mut dec = StreamDecoder::new();
    let mut out = String::new();
    for &id in &ids {
        let delta = dec.push(&tok, id, true).expect("push");
        assert!(
            !delta.contains('\u{FFFD}'),
            "delta {delta:?} carries a replacement char"
        );
        out.push_str(&delta);
    }
    out.push_str(&dec.flush(&tok, true).expect("flush"));
    assert_eq!(out, text);
}

#[test]
fn synthesized_model_loads_and_generates_greedily() {
    let loaded = LoadedModel::load(model()).expect("kimi_k3 loads");
    let info = loaded.model.info();
    assert_eq!(info.model_type, "kimi_k3");
    assert_eq!(info.vocab_size, 163_840);
    assert_eq!(info.eos_ids, vec![163_586]);
    assert_eq!(
        (info.kv_layers, info.linear_layers),
        (2, 5),
        "2 MLA and 5 KDA layers"
    );
    let tok = TextTokenizer::from_dir(model()).expect("tokenizer loads");
    let prompt = render_k3(
        &[Message::text("user", "Name three colours.")],
        None,
        true,
        &K3Options::default(),
    )
    .expect("render");
    let ids = tok.encode_chat(&prompt).expect("encode");
    assert!(
        ids.contains(&163_587) && ids.contains(&163_589),
        "XTML control tokens are single ids"
    );
    let req = GenerateRequest {
        prompt_ids: ids.clone(),
        max_tokens: 6,
        sampling: SamplingParams {
            temperature: 0.0,
            seed: Some(1),
            ..Default::default()
        },
        stop_ids: Vec::new(),
    };
    let a = generate(loaded.model.as_ref(), &req, |_| {}).expect("generate");
    let b = generate(loaded.model.as_ref(), &req, |_| {}).expect("generate");
    assert_eq!(a.token_ids.len(), 6);
    assert_eq!(a.token_ids, b.token_ids, "greedy decoding is deterministic");
    assert!(a.token_ids.iter().all(|&t| (t as usize) < info.vocab_size));
    // Decode with the cache picks the argmax of the full-prompt logits
    // (teacher forcing over prompt + generated tokens).
    let mut all = ids.clone();
    all.extend_from_slice(&a.token_ids[..5]);
    let logits = prompt_logits(loaded.model.as_ref(), &all).expect("logits");
    assert!(logits.iter().all(|v| v.is_finite()), "logits are finite");
    let v = info.vocab_size;
    for (k, &tok_id) in a.token_ids.iter().enumerate() {
        let row = &logits[(ids.len() - 1 + k) * v..(ids.len() + k) * v];
        let best = row
            .iter()
            .enumerate()
            .fold((0, f32::MIN), |m, (j, &x)| if x > m.1 { (j, x) } else { m });
        // Cached decode and full recompute agree up to f32 reordering; allow a
        // near-tie (|Δlogit| ≤ 1e-3) to pick either token.
        assert!(
            best.0 as u32 == tok_id || (best.1 - row[tok_id as usize]).abs() <= 1e-3,
            "step {k}: {} vs {tok_id}",
            best.0
        );
    }
}

#[test]
fn default_model_is_made_once_and_remade_for_a_new_synth_version() {
    let cache = temp_dir("cache");
    std::env::set_var("CARACAL_CACHE", &cache);
    let dir = default_model_dir().expect("default model is made");
    assert_eq!(dir, cache.join("kimi-k3-tiny"));
    assert!(is_current_synth(&dir));
    let stamp = |p: &Path| {
        std::fs::metadata(p.join("model-00002-of-00002.safetensors"))
            .expect("shard")
            .modified()
            .expect("mtime")
    };
    let first = stamp(&dir);
    assert_eq!(default_model_dir().expect("reused"), dir);
    assert_eq!(stamp(&dir), first, "a current model is not rewritten");
    // An older synth version is remade.
    let cfg_path = dir.join("config.json");
    let mut cfg = read_json(&cfg_path, "config.json").expect("config");
    cfg["synth_version"] = serde_json::json!(SYNTH_VERSION - 1);
    std::fs::write(&cfg_path, cfg.to_string()).expect("rewrite config");
    assert!(!is_current_synth(&dir));
    default_model_dir().expect("remade");
    assert!(is_current_synth(&dir));
    assert_eq!(
        files(&dir),
        files(model()),
        "the default model is the default-seed synth"
    );
    let leftovers: Vec<_> = std::fs::read_dir(&cache)
        .expect("cache")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        leftovers.len(),
        1,
        "no temporary folders are left: {leftovers:?}"
    );
    std::fs::remove_dir_all(&cache).ok();
}
