//! GGUF files from an untrusted source: every mutation is `Ok` or an
//! error, never a panic or an unbounded allocation (this test's allocator
//! refuses any one allocation over 1 GiB, which aborts the run with the size).
//!
//! - The committed `quants.gguf` truncated, byte-flipped and with its counts
//!   and lengths overwritten by absurd values; and headers built with absurd
//!   tensor counts, dims, string lengths and array nesting: [`GgufFile::open`],
//!   then every tensor dequantised.
//! - A tiny llama GGUF built here with its metadata (hyper-parameters,
//!   tokenizer arrays, types) and tensor table edited, through `import_gguf`
//!   and, when that works, a model load.
//!
//! Long run: `FUZZ_SECS=600 cargo test --release --test fuzz_gguf --
//! --ignored --nocapture`.

mod fuzz_support;

use std::path::Path;

use caracal::checkpoint::gguf::GgufFile;
use fuzz_support::files::{damage, damaged, fixture, scratch, Damage};
use proptest::prelude::*;

/// Refuses any single allocation over 1 GiB (the fixtures are kilobytes;
/// an allocation sized by a corrupt header is far larger): the run then
/// aborts with "memory allocation of N bytes failed".
#[global_allocator]
static ALLOC: fuzz_support::LimitAlloc = fuzz_support::LimitAlloc;

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
    fn truncated_and_corrupted_gguf_files_are_errors(d in damage(false), header in any::<bool>()) {
        gguf_damage_case(&d, header)?;
    }

    #[test]
    fn gguf_headers_with_absurd_counts_and_lengths_are_errors(p in gguf_parts()) {
        gguf_parts_case(&p)?;
    }
}

proptest! {
    // Imports write a checkpoint folder per case: fewer cases.
    #![proptest_config(fuzz_support::config(16))]

    #[test]
    fn mutated_llama_ggufs_import_or_fail(e in llama_edits()) {
        gguf_import_case(&e)?;
    }
}

#[test]
fn every_truncation_of_a_gguf_is_an_error_not_a_crash() {
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

/// Found by the model-files long run: a llama GGUF whose
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
#[ignore = "long run: FUZZ_SECS=600 cargo test --release --test fuzz_gguf -- --ignored"]
fn soak_gguf_files() {
    #[derive(Debug, Clone)]
    enum Case {
        Gguf(Damage, bool),
        Parts(GgufParts),
        Import(Vec<LlamaEdit>),
    }
    let case = prop_oneof![
        (damage(false), any::<bool>()).prop_map(|(d, h)| Case::Gguf(d, h)),
        gguf_parts().prop_map(Case::Parts),
        llama_edits().prop_map(Case::Import),
    ];
    fuzz_support::soak("gguf files", case, |c| match c {
        Case::Gguf(d, h) => gguf_damage_case(&d, h),
        Case::Parts(p) => gguf_parts_case(&p),
        Case::Import(e) => gguf_import_case(&e),
    });
}
