//! Kimi K2.5 (`kimi_k25`) and the MoonViT3d tower against transformers 5.23:
//! the tower + projector output of each media item (alone and packed with
//! the others), and the LM's logits and greedy ids with the media rows
//! spliced over the placeholders, for one image, two images of different
//! sizes and a 3-frame video chunk. Also: both checkpoint spellings load to
//! the same outputs, bad vision configs are named errors, a model without a
//! tower refuses media, `caracal generate --image` reproduces the reference,
//! and the synthesized default Kimi K3's tower matches a plain reference
//! written from the spec.
//!
//! Fixtures: `tests/fixtures/tiny-kimi-k25/` from `tools/make_vision_fixtures.py`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use caracal::convert::synth::{synthesize, SynthOptions, DEFAULT_SEED};
use caracal::generate::{
    generate_with, prompt_logits_with, splice_media, GenerateRequest, LoadedModel,
};
use caracal::models::{CausalLm, VisionInput};
use caracal_kernels::sampling::SamplingParams;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

/// Tower + projector vs transformers (f32 both; differences are summation
/// order in matmuls, attention and the bicubic resampling).
const TOWER_TOL: f32 = 1e-4;
/// LM logits with media vs transformers (the bar the text models meet).
const LOGIT_TOL: f32 = 1e-4;
/// A greedy step counts only while the reference's top-1/top-2 margin is
/// clearly above the logit tolerance.
const CLEAR_MARGIN: f32 = 1e-2;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-kimi-k25")
}

fn expected() -> &'static Value {
    static E: OnceLock<Value> = OnceLock::new();
    E.get_or_init(|| {
        let text = std::fs::read_to_string(fixture().join("expected.json")).expect("expected.json");
        serde_json::from_str(&text).expect("expected.json is JSON")
    })
}

fn load(sub: &str) -> LoadedModel {
    LoadedModel::load(&fixture().join(sub)).expect("fixture loads")
}

fn published() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| load("published"))
}

/// Little-endian f32 (or i64 as usize) values of tensor `name` of a file.
struct Tensors(Vec<u8>);

impl Tensors {
    fn open(path: &Path) -> Tensors {
        Tensors(std::fs::read(path).expect("readable safetensors"))
    }

    fn f32(&self, name: &str) -> Vec<f32> {
        let st = SafeTensors::deserialize(&self.0).expect("valid safetensors");
        let t = st.tensor(name).expect("tensor present");
        assert_eq!(t.dtype(), Dtype::F32, "{name}");
        t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    fn grid(&self, name: &str) -> [usize; 3] {
        let st = SafeTensors::deserialize(&self.0).expect("valid safetensors");
        let t = st.tensor(name).expect("tensor present");
        assert_eq!(t.dtype(), Dtype::I64, "{name}");
        let v: Vec<usize> = t
            .data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
            .collect();
        [v[0], v[1], v[2]]
    }
}

fn media() -> &'static Tensors {
    static T: OnceLock<Tensors> = OnceLock::new();
    T.get_or_init(|| Tensors::open(&fixture().join("media.safetensors")))
}

/// The processor's output for item `name` (`a`, `b`, `clip`).
fn item(name: &str) -> VisionInput {
    VisionInput {
        pixel_values: media().f32(&format!("{name}.pixel_values")),
        grid_thw: media().grid(&format!("{name}.grid_thw")),
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

const ITEMS: [&str; 3] = ["a", "b", "clip"];

#[test]
fn tower_matches_transformers_per_item_and_packed() {
    let tower = published().model.vision().expect("kimi_k25 has a tower");
    assert_eq!(tower.info().placeholder_id, 500);
    let items: Vec<VisionInput> = ITEMS.iter().map(|n| item(n)).collect();
    let packed = tower.encode(&items).expect("packed encode");
    for (i, name) in ITEMS.iter().enumerate() {
        let want = media().f32(&format!("{name}.embeds"));
        let tokens = expected()["media_tokens"][name].as_u64().unwrap() as usize;
        assert_eq!(tower.num_tokens(items[i].grid_thw), tokens, "{name}");
        assert_eq!(want.len(), tokens * tower.info().out_dim, "{name}");
        let alone = tower.encode(&items[i..i + 1]).expect("encode")[0].clone();
        let d = max_diff(&alone, &want);
        assert!(d <= TOWER_TOL, "{name} alone: max |Δ| {d}");
        // Packing changes an item's rows only by matmul rounding (the kernels
        // tile by row count): attention stays within each item.
        let dp = max_diff(&packed[i], &alone);
        assert!(dp <= 1e-5, "{name} packed vs alone: max |Δ| {dp}");
        let dr = max_diff(&packed[i], &want);
        assert!(dr <= TOWER_TOL, "{name} packed: max |Δ| {dr}");
        eprintln!(
            "{name}: grid {:?}, {tokens} tokens, max |Δ| vs transformers {d:.2e}",
            items[i].grid_thw
        );
    }
}

/// The case's media rows spliced into its prompt, the last logits and the
/// greedy ids through the engine's single-sequence path.
fn run_case(model: &dyn CausalLm, case: &Value) -> (Vec<u32>, Vec<f32>, Vec<u32>) {
    let ids: Vec<u32> = case["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let items: Vec<VisionInput> = case["media"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| item(m.as_str().unwrap()))
        .collect();
    let mp = splice_media(model, &ids, &items).expect("splice");
    let vocab = model.info().vocab_size;
    let all = prompt_logits_with(model, &mp.ids, &mp.spans).expect("logits");
    let last = all[all.len() - vocab..].to_vec();
    let req = GenerateRequest {
        prompt_ids: mp.ids.clone(),
        max_tokens: 16,
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        stop_ids: Vec::new(),
    };
    let gen = generate_with(model, &req, &mp.spans, |_| {}).expect("generate");
    (mp.ids, last, gen.token_ids)
}

fn check_greedy(name: &str, got: &[u32], case: &Value) {
    let want = case["greedy_ids"].as_array().unwrap();
    let margins = case["margins"].as_array().unwrap();
    let mut checked = 0;
    for (step, (w, m)) in want.iter().zip(margins).enumerate() {
        if m.as_f64().unwrap() < CLEAR_MARGIN as f64 {
            break;
        }
        assert_eq!(
            got[step] as u64,
            w.as_u64().unwrap(),
            "{name}: greedy step {step}"
        );
        checked += 1;
    }
    assert!(checked >= 8, "{name}: only {checked} clear greedy steps");
}

#[test]
fn logits_with_spliced_media_match_transformers() {
    let model = published().model.as_ref();
    for (name, case) in expected()["cases"].as_object().unwrap() {
        let (ids, last, greedy) = run_case(model, case);
        let want_ids: Vec<u32> = case["expanded_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ids, want_ids, "{name}: expanded prompt");
        let want: Vec<f32> = case["last_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let d = max_diff(&last, &want);
        assert!(d <= LOGIT_TOL, "{name}: max |Δlogit| {d}");
        check_greedy(name, &greedy, case);
        eprintln!("{name}: {} tokens, max |Δlogit| {d:.2e}", ids.len());
    }
}

#[test]
fn media_rows_change_the_logits() {
    // The same prompt with the image rows zeroed gives other logits: the
    // splice is not a no-op.
    let model = published().model.as_ref();
    let case = &expected()["cases"]["one_image"];
    let (ids, last, _) = run_case(model, case);
    let plain = prompt_logits_with(model, &ids, &[]).expect("logits");
    let vocab = model.info().vocab_size;
    assert!(max_diff(&plain[plain.len() - vocab..], &last) > 1e-2);
}

#[test]
fn transformers_saved_names_load_to_the_published_outputs() {
    let hf = load("transformers");
    let a = published().model.as_ref();
    let b = hf.model.as_ref();
    assert_eq!(b.info().model_type, "kimi_k25");
    let items: Vec<VisionInput> = ITEMS.iter().map(|n| item(n)).collect();
    let ra = a.vision().unwrap().encode(&items).unwrap();
    let rb = b.vision().unwrap().encode(&items).unwrap();
    assert_eq!(ra, rb);
    let case = &expected()["cases"]["two_images"];
    assert_eq!(run_case(a, case), run_case(b, case));
}

/// A copy of the published fixture with `edit` applied to its config.
fn edited_copy(tag: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("kimi-k25-{tag}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(fixture().join("published")).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dir.join(f.file_name())).unwrap();
    }
    let path = dir.join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    dir
}

/// A config edit: tag, the edit, and the text the load error must contain.
type ConfigCase = (&'static str, fn(&mut Value), &'static str);

#[test]
fn bad_vision_configs_are_named_errors() {
    let cases: [ConfigCase; 4] = [
        (
            "heads",
            |c| c["vision_config"]["vt_num_attention_heads"] = 3.into(),
            "vt_num_attention_heads",
        ),
        (
            "norm",
            |c| c["vision_config"]["norm_type"] = "groupnorm".into(),
            "norm_type",
        ),
        (
            "text",
            |c| c["vision_config"]["text_hidden_size"] = 63.into(),
            "text_hidden_size",
        ),
        // A projector the checkpoint has no tensors for: the missing tensor is named.
        (
            "v2",
            |c| c["vision_config"]["mm_projector_type"] = "patchmergerv2".into(),
            "mm_projector.post_norm.weight",
        ),
    ];
    for (tag, edit, key) in cases {
        let dir = edited_copy(tag, edit);
        let err = LoadedModel::load(&dir)
            .err()
            .expect("load fails")
            .to_string();
        assert!(err.contains(key), "{tag}: {err}");
    }
    let dir = edited_copy("none", |c| {
        c.as_object_mut().unwrap().remove("vision_config");
    });
    let err = LoadedModel::load(&dir)
        .err()
        .expect("load fails")
        .to_string();
    assert!(err.contains("vision_config"), "{err}");
}

#[test]
fn a_model_without_a_tower_refuses_media() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-deepseek-v3");
    let m = LoadedModel::load(&dir).unwrap();
    assert!(m.model.vision().is_none());
    let err = splice_media(m.model.as_ref(), &[5, 6], &[item("a")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("no vision tower"), "{err}");
    // A placeholder count that does not match the items is refused too.
    let err = splice_media(published().model.as_ref(), &[5, 500, 500], &[item("a")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("2 media placeholders"), "{err}");
}

#[test]
fn media_crate_preprocessing_matches_the_processor() {
    let cfg = caracal_media::ImageProcessorConfig::kimi_k25();
    for name in ["a", "b"] {
        let bytes = std::fs::read(fixture().join(format!("images/{name}.png"))).unwrap();
        let p = caracal_media::process_image_bytes(&bytes, &cfg).expect("preprocess");
        let want = item(name);
        assert_eq!(p.grid_thw, want.grid_thw, "{name}");
        let d = max_diff(&p.pixel_values, &want.pixel_values);
        assert!(d <= 1e-6, "{name}: max |Δpixel| {d}");
    }
}

#[test]
fn cli_generate_with_an_image_reproduces_the_reference() {
    let case = &expected()["cases"]["one_image"];
    let ids: Vec<String> = case["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    let out = Command::new(env!("CARGO_BIN_EXE_caracal"))
        .args(["generate", "--model"])
        .arg(fixture().join("published"))
        .args([
            "--prompt-ids",
            &ids.join(","),
            "--max-tokens",
            "8",
            "--ignore-eos",
            "--json",
            "--image",
        ])
        .arg(fixture().join("images/a.png"))
        .output()
        .expect("caracal runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["media_tokens"], serde_json::json!([6]));
    assert_eq!(
        v["token_ids"].as_array().unwrap()[..8],
        case["greedy_ids"].as_array().unwrap()[..8]
    );

    let out = Command::new(env!("CARGO_BIN_EXE_caracal"))
        .args(["generate", "--model"])
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-deepseek-v3"))
        .args(["--prompt-ids", "5,6", "--image"])
        .arg(fixture().join("images/a.png"))
        .output()
        .expect("caracal runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no vision tower"), "{err}");
}

#[test]
fn default_k3_tower_matches_the_plain_reference() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kimi-k25-k3-synth");
    let _ = std::fs::remove_dir_all(&dir);
    let opts = SynthOptions {
        seed: DEFAULT_SEED,
        progress: false,
        ..SynthOptions::default()
    };
    synthesize(&dir, &opts).expect("synth");
    let m = LoadedModel::load(&dir).expect("default model loads");
    let tower = m.model.vision().expect("the default K3 has a tower");
    let want = Tensors::open(&fixture().join("k3_tower.safetensors"));
    let items: Vec<VisionInput> = ITEMS.iter().map(|n| item(n)).collect();
    let got = tower.encode(&items).expect("encode");
    for (name, g) in ITEMS.iter().zip(&got) {
        let d = max_diff(g, &want.f32(&format!("{name}.embeds")));
        assert!(d <= TOWER_TOL, "{name}: max |Δ| {d}");
        eprintln!("k3 {name}: max |Δ| vs plain reference {d:.2e}");
    }
}
