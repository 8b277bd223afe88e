//! Model files from an untrusted source: every mutation is `Ok` or an
//! error, never a panic, a SIGBUS (a mapped byte read past the end of the
//! file) or an unbounded allocation (this test's allocator refuses any one
//! allocation over 1 GiB, which aborts the run with the size).
//!
//! - `config.json`: the committed tiny configs with keys removed, values
//!   of the wrong type, huge, negative, zero or fractional numbers, then
//!   [`Arch::from_config`] and, next to the real weights, a full model load
//!   and one forward when it loads.
//! - safetensors: headers built with wrong, overlapping, reversed or
//!   out-of-file offsets, shapes that overflow, unknown dtypes, header
//!   lengths past the file; and the real fixture files truncated and
//!   corrupted. [`Checkpoint::open`], then every tensor read.
//!
//! GGUF files are fuzzed in `fuzz_gguf.rs`; the fixtures, scratch folders
//! and file damage both use live in `fuzz_support/files.rs`.
//!
//! Long run: `FUZZ_SECS=600 cargo test --release --test fuzz_checkpoint --
//! --ignored --nocapture`.

mod fuzz_support;

use std::path::{Path, PathBuf};

use caracal::checkpoint::arch::Arch;
use caracal::checkpoint::Checkpoint;
use caracal_actors::engine::{LogitsMode, SeqBatch};
use caracal_kernels::paged::KvPool;
use fuzz_support::files::{damage, damaged, fixture, scratch, Damage};
use proptest::prelude::*;
use serde_json::{json, Value};

/// Refuses any single allocation over 1 GiB (the fixtures are kilobytes;
/// an allocation sized by a corrupt header is far larger): the run then
/// aborts with "memory allocation of N bytes failed".
#[global_allocator]
static ALLOC: fuzz_support::LimitAlloc = fuzz_support::LimitAlloc;

const MODELS: &[&str] = &[
    "tiny-llama",
    "tiny-deepseek-v3",
    "tiny-kimi-linear",
    "tiny-kimi-k3",
];

fn config_of(model: &str) -> Value {
    let text = std::fs::read_to_string(fixture(model).join("config.json")).expect("config");
    serde_json::from_str(&text).expect("config json")
}

/// Values that break numeric and structural assumptions.
fn odd_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(-1)),
        Just(json!(3)),
        Just(json!(7)),
        Just(json!(1u64 << 40)),
        Just(json!(u64::MAX)),
        Just(json!(i64::MIN)),
        Just(json!(1e300)),
        Just(json!(-0.5)),
        Just(json!(0.5)),
        Just(json!("64")),
        Just(json!("")),
        Just(json!([])),
        Just(json!([1, 2, 3])),
        Just(json!({})),
        Just(json!(true)),
        Just(json!(["full_attention", "linear_attention"])),
        Just(json!({"rope_type": "yarn", "factor": 0.0})),
        Just(json!({"rope_type": "bogus"})),
        Just(json!({"quant_method": "mxfp4"})),
        any::<i32>().prop_map(|n| json!(n)),
    ]
}

/// One edit of a config: the key path (top level, or one level into an
/// object value) and what happens to it.
#[derive(Debug, Clone)]
enum Edit {
    Remove(usize, Option<usize>),
    Set(usize, Option<usize>, Value),
    Scale(usize, u64),
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let edit = prop_oneof![
        (any::<usize>(), any::<Option<usize>>()).prop_map(|(k, s)| Edit::Remove(k, s)),
        (any::<usize>(), any::<Option<usize>>(), odd_value())
            .prop_map(|(k, s, v)| Edit::Set(k, s, v)),
        (any::<usize>(), 2u64..1_000_000).prop_map(|(k, f)| Edit::Scale(k, f)),
    ];
    prop::collection::vec(edit, 1..5)
}

/// Applies `edits` to a config (keys chosen by index, modulo the count).
fn mutate(mut config: Value, edits: &[Edit]) -> Value {
    for e in edits {
        let Some(obj) = config.as_object_mut() else {
            break;
        };
        let keys: Vec<String> = obj.keys().cloned().collect();
        if keys.is_empty() {
            break;
        }
        let pick = |i: usize| keys[i % keys.len()].clone();
        match e {
            Edit::Remove(k, sub) | Edit::Set(k, sub, _) => {
                let key = pick(*k);
                let value = match e {
                    Edit::Set(_, _, v) => Some(v.clone()),
                    _ => None,
                };
                let target = obj.get_mut(&key);
                match (sub, target) {
                    (Some(s), Some(Value::Object(inner))) if !inner.is_empty() => {
                        let ik: Vec<String> = inner.keys().cloned().collect();
                        let ikey = ik[s % ik.len()].clone();
                        match value {
                            Some(v) => {
                                inner.insert(ikey, v);
                            }
                            None => {
                                inner.remove(&ikey);
                            }
                        }
                    }
                    _ => match value {
                        Some(v) => {
                            obj.insert(key, v);
                        }
                        None => {
                            obj.remove(&key);
                        }
                    },
                }
            }
            Edit::Scale(k, f) => {
                let key = pick(*k);
                if let Some(n) = obj.get(&key).and_then(Value::as_u64) {
                    obj.insert(key, json!(n.saturating_mul(*f)));
                }
            }
        }
    }
    config
}

/// A scratch folder with `model`'s fixture files and `config` as its
/// `config.json`.
fn beside_weights(model: &str, config: &Value) -> PathBuf {
    let dir = scratch();
    for entry in std::fs::read_dir(fixture(model)).expect("fixture dir") {
        let entry = entry.expect("entry");
        let name = entry.file_name();
        if name != "config.json" {
            std::fs::copy(entry.path(), dir.join(&name)).expect("copy");
        }
    }
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write config");
    dir
}

/// A mutated config: parsed into an Arch; beside the real weights, loaded
/// as a model and, when that works, run for one short prompt.
fn config_case(model: &str, edits: &[Edit], load: bool) -> Result<(), TestCaseError> {
    let config = mutate(config_of(model), edits);
    if let Ok(arch) = Arch::from_config(&config) {
        let _ = (arch.num_layers(), arch.kv_layers(), arch.kv_width());
        let _ = arch.router_config();
    }
    if !load {
        return Ok(());
    }
    let dir = beside_weights(model, &config);
    if let Ok(m) = caracal::models::load(&dir) {
        let info = m.info().clone();
        if info.kv_layers * info.kv_width <= 1 << 20 && info.vocab_size <= 1 << 20 {
            let mut pool = KvPool::new(info.kv_layers, 4, 16, info.kv_width);
            let mut state = m.new_state();
            state.block_table = vec![0, 1, 2, 3];
            let tokens = [1u32, 5, 9];
            let mut batch = [SeqBatch {
                tokens: &tokens,
                state: &mut state,
                logits: LogitsMode::Last,
                embeds: &[],
            }];
            if let Ok(logits) = m.forward(&mut pool, &mut batch) {
                prop_assert_eq!(logits.len(), info.vocab_size);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// One tensor entry of a built safetensors header.
#[derive(Debug, Clone)]
struct StEntry {
    dtype: &'static str,
    shape: Vec<u64>,
    offsets: (u64, u64),
}

fn st_entries() -> impl Strategy<Value = (Vec<StEntry>, i64, i64)> {
    let dtype = prop::sample::select(vec![
        "F32", "BF16", "F16", "U8", "I8", "I32", "I64", "F64", "BOOL", "F8_E4M3", "Q4", "",
    ]);
    let dim = prop_oneof![4 => 0u64..6, 1 => Just(u64::MAX), 1 => Just(1u64 << 33)];
    let entry = (
        dtype,
        prop::collection::vec(dim, 0..4),
        any::<bool>(),
        0u64..64,
        0u64..64,
    )
        .prop_map(|(dtype, shape, consistent, a, b)| StEntry {
            dtype,
            shape,
            offsets: if consistent { (0, 0) } else { (a, b) },
        });
    // Extra data bytes (negative: cut the file short) and header-length skew.
    (
        prop::collection::vec(entry, 0..5),
        -16i64..16,
        prop_oneof![4 => Just(0i64), 1 => -20i64..20, 1 => Just(i64::MAX / 2)],
    )
}

fn dtype_size(d: &str) -> u64 {
    match d {
        "F64" | "I64" => 8,
        "F32" | "I32" => 4,
        "BF16" | "F16" => 2,
        _ => 1,
    }
}

/// Writes a safetensors file from `entries` (consistent ones get offsets
/// that follow each other), `extra` data bytes more or fewer than the
/// offsets need, and a header length off by `skew`.
fn st_bytes(entries: &[StEntry], extra: i64, skew: i64) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for (i, e) in entries.iter().enumerate() {
        let (start, end) = if e.offsets == (0, 0) {
            let n = e
                .shape
                .iter()
                .try_fold(dtype_size(e.dtype), |a, &d| a.checked_mul(d))
                .unwrap_or(u64::MAX)
                .min(4096);
            let s = (at, at + n);
            at += n;
            s
        } else {
            e.offsets
        };
        at = at.max(end.min(4096));
        header.insert(
            format!("t{i}"),
            json!({"dtype": e.dtype, "shape": e.shape, "data_offsets": [start, end]}),
        );
    }
    let text = Value::Object(header).to_string();
    let len = (text.len() as i64).saturating_add(skew).max(0) as u64;
    let mut out = len.to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    let data = (at as i64 + extra).max(0) as usize;
    out.extend((0..data).map(|i| i as u8));
    out
}

/// Opens `dir` as a checkpoint and reads every tensor it lists.
fn read_checkpoint(dir: &Path) -> Result<(), TestCaseError> {
    let Ok(ck) = Checkpoint::open(dir) else {
        return Ok(());
    };
    for name in ck.names() {
        let e = ck.entry(name).expect("listed").clone();
        let bytes = ck.bytes(name);
        prop_assert!(bytes.is_ok(), "a listed tensor reads: {name}");
        prop_assert_eq!(bytes.map(<[u8]>::len).unwrap_or(0), e.len);
        let _ = ck.tensor_f32(name, &e.shape);
        let _ = ck.storage(name);
    }
    let _ = (ck.total_params(), ck.total_bytes());
    Ok(())
}

fn safetensors_case(entries: &[StEntry], extra: i64, skew: i64) -> Result<(), TestCaseError> {
    let dir = scratch();
    std::fs::write(
        dir.join("model.safetensors"),
        st_bytes(entries, extra, skew),
    )
    .expect("write");
    let r = read_checkpoint(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// A real checkpoint folder with one safetensors file damaged; opened,
/// every tensor read, and the model loaded.
fn real_safetensors_case(model: &str, d: &Damage) -> Result<(), TestCaseError> {
    let src = fixture(model);
    let dir = scratch();
    let mut shards = Vec::new();
    for entry in std::fs::read_dir(&src).expect("fixture dir") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), dir.join(entry.file_name())).expect("copy");
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".safetensors") {
            shards.push(name);
        }
    }
    shards.sort();
    let victim = &shards[d.bytes.len() % shards.len()];
    let orig = std::fs::read(src.join(victim)).expect("read");
    std::fs::write(dir.join(victim), damaged(&orig, d, true)).expect("write");
    read_checkpoint(&dir)?;
    let _ = caracal::models::load(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

proptest! {
    #![proptest_config(fuzz_support::config(96))]

    #[test]
    fn mutated_configs_give_an_arch_or_an_error(
        model in prop::sample::select(MODELS.to_vec()), e in edits()
    ) {
        config_case(model, &e, false)?;
    }

    #[test]
    fn safetensors_headers_with_bad_offsets_sizes_and_dtypes_are_errors(
        (entries, extra, skew) in st_entries()
    ) {
        safetensors_case(&entries, extra, skew)?;
    }
}

proptest! {
    // Model loads copy a fixture folder per case: fewer cases.
    #![proptest_config(fuzz_support::config(16))]

    #[test]
    fn mutated_configs_beside_real_weights_load_or_fail(
        model in prop::sample::select(MODELS.to_vec()), e in edits()
    ) {
        config_case(model, &e, true)?;
    }

    #[test]
    fn truncated_and_corrupted_real_safetensors_are_errors(
        model in prop::sample::select(MODELS.to_vec()), d in damage(true)
    ) {
        real_safetensors_case(model, &d)?;
    }
}

#[test]
fn every_truncation_of_real_files_is_an_error_not_a_crash() {
    for model in MODELS {
        let src = fixture(model);
        let mut shards: Vec<PathBuf> = std::fs::read_dir(&src)
            .expect("fixture")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        shards.sort();
        let orig = std::fs::read(&shards[0]).expect("read");
        for cut in [0, 1, 7, 8, 9, 100, orig.len() / 2, orig.len() - 1] {
            let dir = scratch();
            for e in std::fs::read_dir(&src).expect("fixture") {
                let e = e.expect("entry");
                std::fs::copy(e.path(), dir.join(e.file_name())).expect("copy");
            }
            let name = shards[0].file_name().expect("name");
            std::fs::write(dir.join(name), &orig[..cut]).expect("write");
            assert!(
                Checkpoint::open(&dir).is_err(),
                "{model}: a file cut at {cut} of {} bytes opens",
                orig.len()
            );
            assert!(caracal::models::load(&dir).is_err());
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

#[test]
fn a_shard_index_cannot_point_outside_the_model_folder() {
    let dir = scratch();
    let src = fixture("tiny-deepseek-v3");
    for e in std::fs::read_dir(&src).expect("fixture") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), dir.join(e.file_name())).expect("copy");
    }
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).expect("index");
    for bad in [
        "../tiny-llama/model.safetensors",
        "/etc/passwd",
        "sub/../../x.safetensors",
        "..",
    ] {
        let mut v: Value = serde_json::from_str(&text).expect("json");
        let map = v["weight_map"].as_object_mut().expect("weight_map");
        let first = map.keys().next().expect("a tensor").clone();
        map.insert(first, json!(bad));
        std::fs::write(&index, v.to_string()).expect("write");
        let err = Checkpoint::open(&dir).err().expect("refused");
        assert!(err.to_string().contains("not a file name"), "{bad}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_tensor_in_two_shards_is_an_error() {
    let dir = scratch();
    let one = st_bytes(
        &[StEntry {
            dtype: "F32",
            shape: vec![2],
            offsets: (0, 0),
        }],
        0,
        0,
    );
    std::fs::write(dir.join("a.safetensors"), &one).expect("write");
    std::fs::write(dir.join("b.safetensors"), &one).expect("write");
    let err = Checkpoint::open(&dir).err().expect("refused");
    assert!(err.to_string().contains("also in another shard"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

// Findings, kept as named regressions.

/// Found by `mutated_configs_give_an_arch_or_an_error`: a DeepSeek-V3
/// config with `kv_lora_rank` near u64::MAX parsed, and `Arch::kv_width`
/// (`kv_lora_rank + qk_rope_head_dim`) overflowed. Dims are now bounded
/// when the config is read.
#[test]
fn huge_config_dims_are_refused_when_the_config_is_read() {
    for (model, key) in [
        ("tiny-deepseek-v3", "kv_lora_rank"),
        ("tiny-deepseek-v3", "qk_rope_head_dim"),
        ("tiny-llama", "head_dim"),
        ("tiny-llama", "vocab_size"),
        ("tiny-kimi-linear", "hidden_size"),
        ("tiny-llama", "max_position_embeddings"),
    ] {
        let mut c = config_of(model);
        c[key] = json!(u64::MAX / 2);
        let e = Arch::from_config(&c)
            .err()
            .unwrap_or_else(|| panic!("{model} {key} accepted"));
        assert!(e.to_string().contains(key), "{model}: {e}");
    }
    let mut c = config_of("tiny-deepseek-v3");
    c["kv_lora_rank"] = json!(1u64 << 24);
    let a = Arch::from_config(&c).expect("a large but bounded dim parses");
    assert_eq!(
        a.kv_width(),
        (1 << 24) + c["qk_rope_head_dim"].as_u64().unwrap() as usize
    );
}

/// Found by `mutated_configs_beside_real_weights_load_or_fail`: a Llama
/// config with `rope_parameters.rope_theta = -1` loaded, its rotary
/// frequencies were NaN, and the first forward panicked when it checked that
/// the step's rotary table was made by the layer's own rotary embedding (NaN
/// is not equal to itself). Rotary settings are now checked when the config
/// is read, and the table check compares bits.
#[test]
fn rotary_settings_that_give_no_frequencies_are_refused() {
    for (key, value) in [
        ("rope_theta", json!(-1)),
        ("rope_theta", json!(0.5)),
        ("rope_theta", json!(1.0)),
    ] {
        let mut c = config_of("tiny-llama");
        c["rope_parameters"][key] = value.clone();
        let e = Arch::from_config(&c)
            .err()
            .unwrap_or_else(|| panic!("{key} = {value} accepted"));
        assert!(e.to_string().contains(key), "{e}");
    }
    let mut c = config_of("tiny-llama");
    c["rope_parameters"] = json!({"rope_type": "linear", "factor": -2.0, "rope_theta": 10000.0});
    let Err(e) = Arch::from_config(&c) else {
        panic!("a negative factor is accepted")
    };
    assert!(e.to_string().contains("factor"), "{e}");
    // The case as found: beside the real weights, a clear load error.
    let mut c = config_of("tiny-llama");
    c["rope_parameters"]["rope_theta"] = json!(-1);
    let dir = beside_weights("tiny-llama", &c);
    let e = caracal::models::load(&dir)
        .err()
        .expect("the model is refused");
    assert!(e.to_string().contains("rope_theta"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "long run: FUZZ_SECS=600 cargo test --release --test fuzz_checkpoint -- --ignored"]
fn soak_model_files() {
    #[derive(Debug, Clone)]
    enum Case {
        Config(&'static str, Vec<Edit>),
        St(Vec<StEntry>, i64, i64),
        Real(&'static str, Damage),
    }
    let case = prop_oneof![
        (prop::sample::select(MODELS.to_vec()), edits()).prop_map(|(m, e)| Case::Config(m, e)),
        st_entries().prop_map(|(e, x, s)| Case::St(e, x, s)),
        (prop::sample::select(MODELS.to_vec()), damage(true)).prop_map(|(m, d)| Case::Real(m, d)),
    ];
    fuzz_support::soak("model files", case, |c| match c {
        Case::Config(m, e) => config_case(m, &e, true),
        Case::St(e, x, s) => safetensors_case(&e, x, s),
        Case::Real(m, d) => real_safetensors_case(m, &d),
    });
}
