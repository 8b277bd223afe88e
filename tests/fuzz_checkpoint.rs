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
//! - GGUF: the committed `quants.gguf` truncated, byte-flipped and with
//!   its counts and lengths overwritten by absurd values; and headers built
//!   with absurd tensor counts, dims, string lengths and array nesting.
//!   [`GgufFile::open`], then every tensor dequantised; and a tiny llama
//!   GGUF built here with its metadata (hyper-parameters, tokenizer arrays,
//!   types) and tensor table edited, through `import_gguf` and, when that
//!   works, a model load.
//!
//! Long run: `FUZZ_SECS=600 cargo test --release --test fuzz_checkpoint --
//! --ignored --nocapture`.

mod fuzz_support;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use caracal::checkpoint::arch::Arch;
use caracal::checkpoint::gguf::GgufFile;
use caracal::checkpoint::Checkpoint;
use caracal_actors::engine::{LogitsMode, SeqBatch};
use caracal_kernels::paged::KvPool;
use proptest::prelude::*;
use serde_json::{json, Value};

/// Refuses any single allocation over 1 GiB (the fixtures are kilobytes;
/// an allocation sized by a corrupt header is far larger): the run then
/// aborts with "memory allocation of N bytes failed".
#[global_allocator]
static ALLOC: fuzz_support::LimitAlloc = fuzz_support::LimitAlloc;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A fresh scratch folder for one case.
fn scratch() -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "caracal-fuzz-ckpt-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

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
    let dir = scratch();
    let src = fixture(model);
    for entry in std::fs::read_dir(&src).expect("fixture dir") {
        let entry = entry.expect("entry");
        let name = entry.file_name();
        if name != "config.json" {
            std::fs::copy(entry.path(), dir.join(&name)).expect("copy");
        }
    }
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write config");
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

/// How a real file is damaged: cut at a fraction of its length, bytes
/// overwritten (offset as a fraction of the length, value), and little-endian
/// u64s written at offsets (the counts and lengths of a header).
#[derive(Debug, Clone)]
struct Damage {
    cut: Option<u16>,
    bytes: Vec<(u16, u8)>,
    words: Vec<(u16, u64)>,
}

fn damage(header_bias: bool) -> impl Strategy<Value = Damage> {
    let word = prop_oneof![
        Just(u64::MAX),
        Just(u64::MAX / 2),
        Just(1u64 << 32),
        Just(1u64 << 40),
        Just(0u64),
        Just(1u64),
        Just(9u64),
        any::<u64>(),
    ];
    let at = if header_bias {
        0u16..2048
    } else {
        0u16..u16::MAX
    };
    (
        prop::option::of(any::<u16>()),
        prop::collection::vec((at.clone(), any::<u8>()), 0..8),
        prop::collection::vec((at, word), 0..4),
    )
        .prop_map(|(cut, bytes, words)| Damage { cut, bytes, words })
}

/// `orig` with `d` applied; `header_bias` places offsets in the first
/// 2048 bytes (where the header is) rather than anywhere.
fn damaged(orig: &[u8], d: &Damage, header_bias: bool) -> Vec<u8> {
    let mut b = orig.to_vec();
    let pos = |x: u16, len: usize| {
        if header_bias {
            x as usize % len.max(1)
        } else {
            (x as usize * len) / (u16::MAX as usize + 1)
        }
    };
    for &(at, v) in &d.bytes {
        let i = pos(at, b.len());
        if i < b.len() {
            b[i] = v;
        }
    }
    for &(at, w) in &d.words {
        let i = pos(at, b.len());
        if i + 8 <= b.len() {
            b[i..i + 8].copy_from_slice(&w.to_le_bytes());
        }
    }
    if let Some(c) = d.cut {
        let keep = (c as usize * b.len()) / (u16::MAX as usize + 1);
        b.truncate(keep);
    }
    b
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

/// Opens a GGUF and dequantises every tensor it lists.
fn read_gguf(path: &Path) -> Result<(), TestCaseError> {
    let Ok(f) = GgufFile::open(path) else {
        return Ok(());
    };
    let infos: Vec<_> = f.tensors().cloned().collect();
    for t in &infos {
        prop_assert!(
            t.byte_range.end <= f.file_len(),
            "{} lies inside the file",
            t.name
        );
        let _ = f.tensor_data(t);
        if t.ggml_type.can_dequantize() {
            let _ = f.dequantize_tensor(t);
        }
    }
    let _ = caracal::checkpoint::gguf::gguf_info(path);
    Ok(())
}

fn gguf_damage_case(d: &Damage, header_bias: bool) -> Result<(), TestCaseError> {
    let orig = std::fs::read(fixture("gguf/quants.gguf")).expect("fixture");
    let dir = scratch();
    let path = dir.join("m.gguf");
    std::fs::write(&path, damaged(&orig, d, header_bias)).expect("write");
    let r = read_gguf(&path);
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// A GGUF header built from parts: counts and lengths as given (absurd or
/// not), then whatever bytes follow.
#[derive(Debug, Clone)]
struct GgufParts {
    version: u32,
    n_tensors: u64,
    kvs: Vec<(u64, u32, Vec<u8>)>,
    tensors: Vec<(u64, u32, Vec<u64>, u32, u64)>,
    tail: usize,
}

fn gguf_parts() -> impl Strategy<Value = GgufParts> {
    let count = prop_oneof![4 => 0u64..8, 1 => Just(u64::MAX), 1 => Just(1u64 << 40), 1 => Just(u64::MAX / 24)];
    let len = prop_oneof![4 => 0u64..12, 1 => Just(u64::MAX), 1 => Just(1u64 << 50)];
    let value = prop::collection::vec(any::<u8>(), 0..40);
    let kv = (
        len.clone(),
        prop_oneof![4 => 0u32..13, 1 => any::<u32>()],
        value,
    );
    let dim =
        prop_oneof![4 => 1u64..64, 1 => Just(0u64), 1 => Just(u64::MAX), 1 => Just(1u64 << 31)];
    let tensor = (
        len,
        prop_oneof![4 => 0u32..5, 1 => Just(u32::MAX)],
        prop::collection::vec(dim, 0..5),
        prop_oneof![4 => 0u32..42, 1 => any::<u32>()],
        prop_oneof![3 => Just(0u64), 1 => (0u64..8).prop_map(|k| k * 32), 1 => any::<u64>()],
    );
    (
        prop_oneof![4 => Just(3u32), 1 => Just(2u32), 1 => any::<u32>()],
        count,
        prop::collection::vec(kv, 0..4),
        prop::collection::vec(tensor, 0..4),
        0usize..4096,
    )
        .prop_map(|(version, n_tensors, kvs, tensors, tail)| GgufParts {
            version,
            n_tensors,
            kvs,
            tensors,
            tail,
        })
}

fn gguf_bytes(p: &GgufParts) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&p.version.to_le_bytes());
    let n_tensors = if p.n_tensors < 8 {
        p.tensors.len() as u64
    } else {
        p.n_tensors
    };
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&(p.kvs.len() as u64).to_le_bytes());
    for (i, (len, tag, value)) in p.kvs.iter().enumerate() {
        let key = format!("k{i}");
        let len = if *len < 12 { key.len() as u64 } else { *len };
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(key.as_bytes());
        b.extend_from_slice(&tag.to_le_bytes());
        b.extend_from_slice(value);
    }
    for (i, (len, n_dims, dims, ty, offset)) in p.tensors.iter().enumerate() {
        let name = format!("t{i}");
        let len = if *len < 12 { name.len() as u64 } else { *len };
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(name.as_bytes());
        let n = if *n_dims < 5 {
            dims.len() as u32
        } else {
            *n_dims
        };
        b.extend_from_slice(&n.to_le_bytes());
        for d in dims {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend_from_slice(&offset.to_le_bytes());
    }
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.extend((0..p.tail).map(|i| (i * 7) as u8));
    b
}

fn gguf_parts_case(p: &GgufParts) -> Result<(), TestCaseError> {
    let dir = scratch();
    let path = dir.join("m.gguf");
    std::fs::write(&path, gguf_bytes(p)).expect("write");
    let r = read_gguf(&path);
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// A GGUF metadata value, for the llama files built below.
#[derive(Debug, Clone)]
enum Kv {
    U32(u32),
    U64(u64),
    F32(f32),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

impl Kv {
    fn write(&self, b: &mut Vec<u8>) {
        let string = |b: &mut Vec<u8>, s: &str| {
            b.extend_from_slice(&(s.len() as u64).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        };
        match self {
            Kv::U32(v) => {
                b.extend_from_slice(&4u32.to_le_bytes());
                b.extend_from_slice(&v.to_le_bytes());
            }
            Kv::U64(v) => {
                b.extend_from_slice(&10u32.to_le_bytes());
                b.extend_from_slice(&v.to_le_bytes());
            }
            Kv::F32(v) => {
                b.extend_from_slice(&6u32.to_le_bytes());
                b.extend_from_slice(&v.to_le_bytes());
            }
            Kv::Str(s) => {
                b.extend_from_slice(&8u32.to_le_bytes());
                string(b, s);
            }
            Kv::Strs(list) => {
                b.extend_from_slice(&9u32.to_le_bytes());
                b.extend_from_slice(&8u32.to_le_bytes());
                b.extend_from_slice(&(list.len() as u64).to_le_bytes());
                for s in list {
                    string(b, s);
                }
            }
            Kv::I32s(list) => {
                b.extend_from_slice(&9u32.to_le_bytes());
                b.extend_from_slice(&5u32.to_le_bytes());
                b.extend_from_slice(&(list.len() as u64).to_le_bytes());
                for v in list {
                    b.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
}

/// Metadata key/values in file order.
type Metadata = Vec<(String, Kv)>;
/// F32 tensors: name and dims (innermost first).
type Tensors = Vec<(String, Vec<u64>)>;

/// The metadata and F32 tensors of a tiny llama GGUF: hidden 4, 2 heads,
/// 1 layer, feed-forward 8, 8 tokens.
fn llama_gguf() -> (Metadata, Tensors) {
    let s = |v: &str| Kv::Str(v.into());
    let tokens: Vec<String> = ["a", "b", "c", "ab", "Ġ", "Ġa", "<s>", "</s>"]
        .map(String::from)
        .to_vec();
    let kv = vec![
        ("general.architecture", s("llama")),
        ("llama.block_count", Kv::U32(1)),
        ("llama.context_length", Kv::U32(64)),
        ("llama.embedding_length", Kv::U32(4)),
        ("llama.feed_forward_length", Kv::U32(8)),
        ("llama.attention.head_count", Kv::U32(2)),
        ("llama.attention.head_count_kv", Kv::U32(2)),
        ("llama.attention.layer_norm_rms_epsilon", Kv::F32(1e-5)),
        ("llama.rope.freq_base", Kv::F32(10000.0)),
        ("tokenizer.ggml.model", s("gpt2")),
        ("tokenizer.ggml.tokens", Kv::Strs(tokens)),
        (
            "tokenizer.ggml.token_type",
            Kv::I32s(vec![1, 1, 1, 1, 1, 1, 3, 3]),
        ),
        (
            "tokenizer.ggml.merges",
            Kv::Strs(vec!["a b".into(), "Ġ a".into()]),
        ),
        ("tokenizer.ggml.bos_token_id", Kv::U32(6)),
        ("tokenizer.ggml.eos_token_id", Kv::U32(7)),
        (
            "tokenizer.chat_template",
            s("{% for m in messages %}{{ m.content }}{% endfor %}"),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let t = |n: &str, d: &[u64]| (n.to_string(), d.to_vec());
    let tensors = vec![
        t("token_embd.weight", &[4, 8]),
        t("output_norm.weight", &[4]),
        t("blk.0.attn_norm.weight", &[4]),
        t("blk.0.ffn_norm.weight", &[4]),
        t("blk.0.attn_q.weight", &[4, 4]),
        t("blk.0.attn_k.weight", &[4, 4]),
        t("blk.0.attn_v.weight", &[4, 4]),
        t("blk.0.attn_output.weight", &[4, 4]),
        t("blk.0.ffn_gate.weight", &[4, 8]),
        t("blk.0.ffn_up.weight", &[4, 8]),
        t("blk.0.ffn_down.weight", &[8, 4]),
    ];
    (kv, tensors)
}

/// The file bytes of `kv` and F32 `tensors` (32-byte aligned data).
fn llama_gguf_bytes(kv: &[(String, Kv)], tensors: &[(String, Vec<u64>)]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    b.extend_from_slice(&(kv.len() as u64).to_le_bytes());
    for (k, v) in kv {
        b.extend_from_slice(&(k.len() as u64).to_le_bytes());
        b.extend_from_slice(k.as_bytes());
        v.write(&mut b);
    }
    let mut offset = 0u64;
    let mut sizes = Vec::new();
    for (name, dims) in tensors {
        b.extend_from_slice(&(name.len() as u64).to_le_bytes());
        b.extend_from_slice(name.as_bytes());
        b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&offset.to_le_bytes());
        let n = dims.iter().product::<u64>().min(1 << 20) * 4;
        sizes.push(n);
        offset += n.div_ceil(32) * 32;
    }
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    for n in sizes {
        let start = b.len();
        b.extend((0..n / 4).flat_map(|i| (((i % 13) as f32 - 6.0) * 0.05).to_le_bytes()));
        b.resize(start + (n as usize).div_ceil(32) * 32, 0);
    }
    b
}

/// One change to the tiny llama GGUF's metadata or tensor table.
#[derive(Debug, Clone)]
enum LlamaEdit {
    /// Key (by index) set to a value of another type or range.
    Set(usize, Kv),
    /// Key removed.
    Remove(usize),
    /// A tensor's dims replaced.
    Dims(usize, Vec<u64>),
    /// A tensor removed.
    Drop(usize),
}

fn llama_edits() -> impl Strategy<Value = Vec<LlamaEdit>> {
    let kv = prop_oneof![
        prop_oneof![
            Just(0u32),
            Just(1),
            Just(3),
            Just(7),
            Just(64),
            Just(u32::MAX)
        ]
        .prop_map(Kv::U32),
        prop_oneof![Just(0u64), Just(u64::MAX), Just(1 << 40)].prop_map(Kv::U64),
        prop_oneof![
            Just(0.0f32),
            Just(-1.0),
            Just(f32::NAN),
            Just(f32::INFINITY),
            Just(1e30)
        ]
        .prop_map(Kv::F32),
        prop::sample::select(vec![
            "", "llama", "gpt2", "llama ", "bpe", "a", "a b c", "{{ bogus"
        ])
        .prop_map(|s| Kv::Str(s.into())),
        prop::collection::vec(
            prop::sample::select(vec!["", "a", "a b", "Ġ", "ab c", " ", "a  b", "zz"]),
            0..12
        )
        .prop_map(|v| Kv::Strs(v.into_iter().map(String::from).collect())),
        prop::collection::vec(
            prop_oneof![
                Just(-1i32),
                Just(0),
                Just(1),
                Just(3),
                Just(6),
                Just(i32::MAX)
            ],
            0..12
        )
        .prop_map(Kv::I32s),
    ];
    let dims = prop::collection::vec(
        prop_oneof![Just(0u64), Just(1), Just(2), Just(4), Just(8), Just(3)],
        0..4,
    );
    let edit = prop_oneof![
        4 => (any::<usize>(), kv).prop_map(|(k, v)| LlamaEdit::Set(k, v)),
        2 => any::<usize>().prop_map(LlamaEdit::Remove),
        2 => (any::<usize>(), dims).prop_map(|(t, d)| LlamaEdit::Dims(t, d)),
        1 => any::<usize>().prop_map(LlamaEdit::Drop),
    ];
    prop::collection::vec(edit, 1..4)
}

/// The tiny llama GGUF with `edits`, imported; what imports is loaded as a
/// model with its tokenizer.
fn gguf_import_case(edits: &[LlamaEdit]) -> Result<(), TestCaseError> {
    let (mut kv, mut tensors) = llama_gguf();
    for e in edits {
        match e {
            LlamaEdit::Set(k, v) => {
                let n = kv.len();
                kv[k % n].1 = v.clone();
            }
            LlamaEdit::Remove(k) => {
                if !kv.is_empty() {
                    let n = kv.len();
                    kv.remove(k % n);
                }
            }
            LlamaEdit::Dims(t, d) => {
                if !tensors.is_empty() {
                    let n = tensors.len();
                    tensors[t % n].1 = d.clone();
                }
            }
            LlamaEdit::Drop(t) => {
                if !tensors.is_empty() {
                    let n = tensors.len();
                    tensors.remove(t % n);
                }
            }
        }
    }
    let dir = scratch();
    let path = dir.join("m.gguf");
    std::fs::write(&path, llama_gguf_bytes(&kv, &tensors)).expect("write");
    let out = dir.join("out");
    let opts = caracal::checkpoint::gguf::ImportOptions {
        dtype: caracal::checkpoint::gguf::OutDtype::F32,
        progress: false,
    };
    if caracal::checkpoint::gguf::import_gguf(&path, &out, &opts).is_ok() {
        let _ = caracal::generate::LoadedModel::load(&out);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[test]
fn the_tiny_llama_gguf_imports_and_loads() {
    let (kv, tensors) = llama_gguf();
    let dir = scratch();
    let path = dir.join("m.gguf");
    std::fs::write(&path, llama_gguf_bytes(&kv, &tensors)).expect("write");
    let out = dir.join("out");
    let opts = caracal::checkpoint::gguf::ImportOptions {
        dtype: caracal::checkpoint::gguf::OutDtype::F32,
        progress: false,
    };
    let r = caracal::checkpoint::gguf::import_gguf(&path, &out, &opts).expect("imports");
    assert_eq!(r.tensors, tensors.len());
    let loaded = caracal::generate::LoadedModel::load(&out).expect("the import loads");
    assert_eq!(loaded.model.info().vocab_size, 8);
    assert!(loaded.tokenizer.is_some());
    let _ = std::fs::remove_dir_all(&dir);
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

    #[test]
    fn truncated_and_corrupted_gguf_files_are_errors(d in damage(false), header in any::<bool>()) {
        gguf_damage_case(&d, header)?;
    }

    #[test]
    fn gguf_headers_with_absurd_counts_and_lengths_are_errors(p in gguf_parts()) {
        gguf_parts_case(&p)?;
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
    fn mutated_llama_ggufs_import_or_fail(e in llama_edits()) {
        gguf_import_case(&e)?;
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
    // A GGUF opens exactly when every tensor's data is inside what is left
    // (the padding after the last tensor is not needed).
    let full = GgufFile::open(fixture("gguf/quants.gguf")).expect("fixture opens");
    let data_end = full
        .tensors()
        .map(|t| t.byte_range.end)
        .max()
        .expect("tensors");
    let orig = std::fs::read(fixture("gguf/quants.gguf")).expect("fixture");
    // Every cut through the header and tensor table, then every 61st byte
    // of the data and the last bytes.
    let header = full.data_offset() as usize;
    let cuts = (0..=header + 64)
        .chain((header + 64..orig.len()).step_by(61))
        .chain(data_end.saturating_sub(2)..orig.len());
    for cut in cuts {
        let dir = scratch();
        let path = dir.join("m.gguf");
        std::fs::write(&path, &orig[..cut]).expect("write");
        let opened = GgufFile::open(&path);
        assert_eq!(
            opened.is_ok(),
            cut >= data_end,
            "a GGUF cut at {cut} (data ends at {data_end})"
        );
        if let Ok(f) = opened {
            for t in f.tensors() {
                assert!(f.dequantize_tensor(t).is_ok() || !t.ggml_type.can_dequantize());
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
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

/// Found by `soak_model_files`: a llama GGUF whose
/// `llama.attention.head_count` is u32::MAX-scale overflowed `2 * n_head`
/// while un-permuting the q/k rows at import.
#[test]
fn a_huge_head_count_in_a_gguf_is_an_import_error() {
    for key in [
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
    ] {
        let (mut kv, tensors) = llama_gguf();
        for (k, v) in &mut kv {
            if k == key {
                *v = Kv::U64(u64::MAX);
            }
        }
        let dir = scratch();
        let path = dir.join("m.gguf");
        std::fs::write(&path, llama_gguf_bytes(&kv, &tensors)).expect("write");
        let opts = caracal::checkpoint::gguf::ImportOptions {
            dtype: caracal::checkpoint::gguf::OutDtype::F32,
            progress: false,
        };
        let r = caracal::checkpoint::gguf::import_gguf(&path, &dir.join("out"), &opts);
        assert!(r.is_err(), "{key} = u64::MAX imports");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
#[ignore = "long run: FUZZ_SECS=600 cargo test --release --test fuzz_checkpoint -- --ignored"]
fn soak_model_files() {
    #[derive(Debug, Clone)]
    enum Case {
        Config(&'static str, Vec<Edit>),
        St(Vec<StEntry>, i64, i64),
        Gguf(Damage, bool),
        Parts(GgufParts),
        Real(&'static str, Damage),
        Import(Vec<LlamaEdit>),
    }
    let case = prop_oneof![
        (prop::sample::select(MODELS.to_vec()), edits()).prop_map(|(m, e)| Case::Config(m, e)),
        st_entries().prop_map(|(e, x, s)| Case::St(e, x, s)),
        (damage(false), any::<bool>()).prop_map(|(d, h)| Case::Gguf(d, h)),
        gguf_parts().prop_map(Case::Parts),
        (prop::sample::select(MODELS.to_vec()), damage(true)).prop_map(|(m, d)| Case::Real(m, d)),
        llama_edits().prop_map(Case::Import),
    ];
    fuzz_support::soak("model files", case, |c| match c {
        Case::Config(m, e) => config_case(m, &e, true),
        Case::St(e, x, s) => safetensors_case(&e, x, s),
        Case::Gguf(d, h) => gguf_damage_case(&d, h),
        Case::Parts(p) => gguf_parts_case(&p),
        Case::Real(m, d) => real_safetensors_case(m, &d),
        Case::Import(e) => gguf_import_case(&e),
    });
}
