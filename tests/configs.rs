//! Checkpoint configs and tensor names as the loaders see them: configs
//! that must be refused at load (each with its message, before anything is
//! allocated or any forward can assert), and the other tensor spellings
//! (transformers 5.x `save_pretrained`, transformers' in-memory modules with
//! fused experts) loading to the same logits as the published names.

use std::collections::BTreeMap;
use std::path::Path;

mod common;

use caracal::generate::{prompt_logits, LoadedModel};
use common::{copy_dir, fixture, max_abs_diff, TempDir as Dir};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

/// Tensors by name: dtype, shape, bytes.
type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

/// An edit of `config.json`.
type Edit = Box<dyn FnOnce(&mut Value)>;

/// A copy of fixture `name` with `config.json` edited by `edit`.
fn with_config(name: &str, edit: impl FnOnce(&mut Value)) -> Dir {
    let dst = copy_dir(&fixture(name), name);
    let p = dst.0.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    dst
}

fn load_error(name: &str, edit: impl FnOnce(&mut Value)) -> String {
    let d = with_config(name, edit);
    match LoadedModel::load(&d.0) {
        Ok(_) => panic!("{name}: the edited config loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_configs_are_refused_at_load_with_the_key_and_value() {
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "tiny-kimi-linear",
            Box::new(|v| v["num_expert_group"] = 0.into()),
            "config.json: `num_expert_group` must be >= 1, got 0",
        ),
        (
            "tiny-deepseek-v3",
            Box::new(|v| v["num_experts_per_tok"] = 12.into()),
            "`num_experts_per_tok` (12) must be <= `n_routed_experts` (8)",
        ),
        (
            "tiny-deepseek-v3",
            Box::new(|v| v["n_group"] = 3.into()),
            "`n_routed_experts` (8) must be divisible by `n_group` (3)",
        ),
        (
            "tiny-deepseek-v3",
            Box::new(|v| v["topk_group"] = 5.into()),
            "`topk_group` must be in 1..=`n_group` (4), got 5",
        ),
        (
            "tiny-llama",
            Box::new(|v| v["num_hidden_layers"] = 1_000_000_000u64.into()),
            "config.json says 1000000000 layers but the checkpoint has tensors for 2",
        ),
        (
            "tiny-llama",
            Box::new(|v| v["hidden_size"] = 4096.into()),
            "config.json says vocab_size 512 and hidden_size 4096 but `model.embed_tokens.weight` is [512, 64]",
        ),
        (
            "tiny-kimi-k3",
            Box::new(|v| v["text_config"]["attn_res_block_size"] = 0.into()),
            "config.json: `attn_res_block_size` must be >= 1, got 0",
        ),
        (
            "tiny-kimi-k3",
            Box::new(|v| v["text_config"]["num_hidden_layers"] = 9.into()),
            "config.json says 9 layers but the checkpoint has tensors for 8",
        ),
        (
            "tiny-kimi-linear",
            Box::new(|v| v["linear_attn_config"]["kda_layers"] = serde_json::json!([1, 2, 3, 9])),
            "`linear_attn_config.kda_layers` entry 9 is outside 1..=4",
        ),
        (
            "tiny-kimi-linear",
            Box::new(|v| v["mlp_layer_types"] = serde_json::json!(["dense", "sparse"])),
            "`mlp_layer_types` has 2 entries but `num_hidden_layers` is 4",
        ),
    ];
    for (name, edit, want) in cases {
        let err = load_error(name, edit);
        assert!(err.contains(want), "{name}: got `{err}`, want `{want}`");
    }
}

/// The tensors of a checkpoint folder (every shard), by name.
fn read_tensors(dir: &Path) -> Tensors {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&p).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            for (name, t) in st.tensors() {
                out.insert(name, (t.dtype(), t.shape().to_vec(), t.data().to_vec()));
            }
        }
    }
    out
}

/// A copy of fixture `name` whose tensors are `tensors`, in one file.
fn with_tensors(name: &str, tensors: &Tensors) -> Dir {
    let dst = Dir::new(&format!("{name}-renamed"));
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        let n = e.file_name().to_string_lossy().into_owned();
        if !n.ends_with(".safetensors") && n != "model.safetensors.index.json" {
            std::fs::copy(e.path(), dst.0.join(&n)).unwrap();
        }
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dst.0.join("model.safetensors")).unwrap();
    dst
}

fn logits(dir: &Path) -> Vec<f32> {
    let m = LoadedModel::load(dir).unwrap();
    let exp: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ids: Vec<u32> = exp["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    prompt_logits(m.model.as_ref(), &ids).unwrap()
}

/// `{layer}.{from}.{rest}` → `{layer}.{to}.{rest}` for the layers in `layers`.
fn rename_module(t: &Tensors, layers: &[usize], from: &str, to: &str) -> Tensors {
    t.iter()
        .map(|(n, v)| {
            let renamed = layers.iter().find_map(|i| {
                let head = format!("model.layers.{i}.{from}.");
                n.strip_prefix(&head)
                    .map(|rest| format!("model.layers.{i}.{to}.{rest}"))
            });
            (renamed.unwrap_or_else(|| n.clone()), v.clone())
        })
        .collect()
}

/// Per-expert `{moe}.experts.{e}.{gate,up,down}` → transformers' fused
/// `{moe}.experts.gate_up_proj` `[E, 2I, H]` (gate rows, then up rows) and
/// `{moe}.experts.down_proj` `[E, H, I]`.
fn fuse_experts(t: &Tensors, moe: &str, experts: usize, names: [&str; 3]) -> Tensors {
    let mut out = t.clone();
    let (mut gate_up, mut down) = (Vec::new(), Vec::new());
    let (mut gu_shape, mut d_shape, mut dtype) = (vec![], vec![], Dtype::BF16);
    for e in 0..experts {
        let take = |out: &mut BTreeMap<_, _>, n: &str| -> (Dtype, Vec<usize>, Vec<u8>) {
            out.remove(&format!("{moe}.experts.{e}.{n}.weight"))
                .unwrap_or_else(|| panic!("{moe}.experts.{e}.{n}.weight"))
        };
        let (dt, gs, g) = take(&mut out, names[0]);
        let (_, _, u) = take(&mut out, names[1]);
        let (_, ds, d) = take(&mut out, names[2]);
        gate_up.extend(g);
        gate_up.extend(u);
        down.extend(d);
        (gu_shape, d_shape, dtype) = (
            vec![experts, 2 * gs[0], gs[1]],
            vec![experts, ds[0], ds[1]],
            dt,
        );
    }
    out.insert(
        format!("{moe}.experts.gate_up_proj"),
        (dtype, gu_shape, gate_up),
    );
    out.insert(format!("{moe}.experts.down_proj"), (dtype, d_shape, down));
    out
}

#[test]
fn kimi_linear_dense_mlp_saved_by_transformers_5_gives_the_same_logits() {
    // transformers 5.x `save_pretrained` writes the dense layer's MLP as
    // `block_sparse_moe.{gate,up,down}_proj`; the fixture has the published `mlp.*`.
    let name = "tiny-kimi-linear";
    let published = read_tensors(&fixture(name));
    let saved = rename_module(&published, &[0], "mlp", "block_sparse_moe");
    assert!(saved.contains_key("model.layers.0.block_sparse_moe.gate_proj.weight"));
    assert!(!saved.contains_key("model.layers.0.mlp.gate_proj.weight"));
    let d = with_tensors(name, &saved);
    assert_eq!(logits(&d.0), logits(&fixture(name)));
}

#[test]
fn kimi_linear_with_transformers_module_names_and_fused_experts_gives_the_same_logits() {
    // transformers' in-memory modules: every block under `mlp.`, routed
    // experts fused into `experts.gate_up_proj` / `experts.down_proj`.
    let name = "tiny-kimi-linear";
    let mut t = rename_module(
        &read_tensors(&fixture(name)),
        &[1, 2, 3],
        "block_sparse_moe",
        "mlp",
    );
    for i in 1..4 {
        t = fuse_experts(&t, &format!("model.layers.{i}.mlp"), 8, ["w1", "w3", "w2"]);
    }
    assert!(t.contains_key("model.layers.2.mlp.experts.gate_up_proj"));
    let d = with_tensors(name, &t);
    assert_eq!(logits(&d.0), logits(&fixture(name)));
}

#[test]
fn deepseek_v3_with_fused_experts_gives_the_same_logits() {
    let name = "tiny-deepseek-v3";
    let mut t = read_tensors(&fixture(name));
    for i in 1..3 {
        t = fuse_experts(
            &t,
            &format!("model.layers.{i}.mlp"),
            8,
            ["gate_proj", "up_proj", "down_proj"],
        );
    }
    let d = with_tensors(name, &t);
    assert_eq!(logits(&d.0), logits(&fixture(name)));
}

#[test]
fn k3_blocks_under_either_module_name_give_the_same_logits() {
    let name = "tiny-kimi-k3";
    let published = read_tensors(&fixture(name));
    // Dense layer 0 as transformers 5.x saves it, MoE layers under `mlp.`.
    let t: BTreeMap<_, _> = published
        .iter()
        .map(|(n, v)| {
            let n = if n.contains(".layers.0.") {
                n.replace(".mlp.", ".block_sparse_moe.")
            } else {
                n.replace(".block_sparse_moe.", ".mlp.")
            };
            (n, v.clone())
        })
        .collect();
    assert!(t.contains_key("language_model.model.layers.0.block_sparse_moe.gate_proj.weight"));
    assert!(t.contains_key("language_model.model.layers.1.mlp.gate.weight"));
    let d = with_tensors(name, &t);
    assert_eq!(logits(&d.0), logits(&fixture(name)));
}

#[test]
fn load_options_carry_the_activation_mode_to_the_checkpoint() {
    use caracal::checkpoint::{Checkpoint, LoadOptions};
    use caracal_kernels::q8::Activations;
    assert_eq!(LoadOptions::default().activations, Activations::F32);
    let dir = fixture("tiny-kimi-k3");
    assert_eq!(
        Checkpoint::open(&dir).unwrap().activations(),
        Activations::F32
    );
    let int8 = LoadOptions {
        activations: Activations::Int8,
    };
    assert_eq!(
        Checkpoint::open_with(&dir, &int8).unwrap().activations(),
        Activations::Int8
    );
    let m = caracal::models::load_with(&dir, &int8).unwrap();
    assert_eq!(m.info().model_type, "kimi_k3");
    // The mode is on every quantized matrix the checkpoint builds.
    let name = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight";
    for (opts, want) in [
        (LoadOptions::default(), Activations::F32),
        (int8, Activations::Int8),
    ] {
        let ckpt = Checkpoint::open_with(&dir, &opts).unwrap();
        assert_eq!(ckpt.matrix(name, 32, 32).unwrap().activations(), want);
    }
    // Both modes give the model's answer: int8 activations move logits by
    // the rounding of activations to 8 bits per 32 values, well under 5% of
    // their spread (the tiny model's MXFP4 experts are a small part of it).
    let prompt = [1u32, 5, 9, 2];
    let f32_logits = prompt_logits(caracal::models::load(&dir).unwrap().as_ref(), &prompt).unwrap();
    let int8_logits = prompt_logits(m.as_ref(), &prompt).unwrap();
    let spread = f32_logits.iter().cloned().fold(f32::MIN, f32::max)
        - f32_logits.iter().cloned().fold(f32::MAX, f32::min);
    let diff = max_abs_diff(&f32_logits, &int8_logits);
    assert!(
        diff <= 0.05 * spread,
        "int8 vs f32: {diff} (spread {spread})"
    );
}
