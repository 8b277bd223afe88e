//! A minimal GGUF writer for tests: enough of the format to build files with any
//! metadata value and raw tensor bytes, independently of the reader's code.

use std::path::{Path, PathBuf};

use super::quants::GgmlType;
use super::reader::{GgufArray, GgufValue, GgufValueType, DEFAULT_ALIGNMENT};

/// One tensor to write: name, type, dims (innermost first), explicit offset or
/// `None` to place it at the next aligned offset, and its bytes.
struct PendingTensor {
    /// Tensor name.
    name: String,
    /// Storage type.
    ggml_type: GgmlType,
    /// Dims, innermost first.
    dims: Vec<u64>,
    /// Explicit data offset, or `None` for the next aligned one.
    offset: Option<u64>,
    /// Raw data bytes.
    data: Vec<u8>,
}

/// Builds a GGUF file in memory.
pub struct GgufWriter {
    /// Version written in the header.
    version: u32,
    /// Metadata in write order.
    kvs: Vec<(String, GgufValue)>,
    /// Tensors in write order.
    tensors: Vec<PendingTensor>,
}

impl GgufWriter {
    /// An empty file of the given version.
    pub fn new(version: u32) -> GgufWriter {
        GgufWriter {
            version,
            kvs: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Adds a metadata key/value (a `general.alignment` U32 changes the alignment).
    pub fn kv(&mut self, key: &str, value: GgufValue) -> &mut Self {
        self.kvs.push((key.to_string(), value));
        self
    }

    /// Adds a tensor placed at the next aligned offset.
    pub fn tensor(&mut self, name: &str, t: GgmlType, dims: &[u64], data: Vec<u8>) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.into(),
            ggml_type: t,
            dims: dims.to_vec(),
            offset: None,
            data,
        });
        self
    }

    /// Adds a tensor with an explicit (possibly invalid) data offset.
    pub fn tensor_at(
        &mut self,
        name: &str,
        t: GgmlType,
        dims: &[u64],
        offset: u64,
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.into(),
            ggml_type: t,
            dims: dims.to_vec(),
            offset: Some(offset),
            data,
        });
        self
    }

    fn alignment(&self) -> u64 {
        self.kvs
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.alignment() as usize;
        let pad = |n: usize| n.div_ceil(align) * align;
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            write_str(&mut out, k);
            out.extend_from_slice(&v.value_type().tag().to_le_bytes());
            write_value(&mut out, v);
        }
        let mut offsets = Vec::new();
        let mut next = 0usize;
        for t in &self.tensors {
            let off = t.offset.map(|o| o as usize).unwrap_or(next);
            offsets.push(off);
            next = pad(off + t.data.len());
        }
        for (t, off) in self.tensors.iter().zip(&offsets) {
            write_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            out.extend_from_slice(&(*off as u64).to_le_bytes());
        }
        out.resize(pad(out.len()), 0);
        let data_start = out.len();
        for (t, off) in self.tensors.iter().zip(&offsets) {
            let at = data_start + off;
            if out.len() < at + t.data.len() {
                out.resize(at + t.data.len(), 0);
            }
            out[at..at + t.data.len()].copy_from_slice(&t.data);
        }
        out
    }

    /// Writes the file to `path`.
    pub fn write(&self, path: &Path) {
        std::fs::write(path, self.to_bytes()).expect("test file is writable");
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.push(*x as u8),
        GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(*x as u8),
        GgufValue::String(s) => write_str(out, s),
        GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Array(a) => {
            out.extend_from_slice(&a.elem_type.tag().to_le_bytes());
            out.extend_from_slice(&(a.values.len() as u64).to_le_bytes());
            for e in &a.values {
                write_value(out, e);
            }
        }
    }
}

/// A fresh path under the system temp dir, unique to this process and `name`.
pub fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("caracal-gguf-test-{}-{name}", std::process::id()))
}

/// A string-array metadata value.
pub fn strings(v: &[&str]) -> GgufValue {
    GgufValue::Array(GgufArray {
        elem_type: GgufValueType::String,
        values: v.iter().map(|s| GgufValue::String(s.to_string())).collect(),
    })
}

/// A tiny byte-level BPE vocabulary: control tokens 0..3, the byte-level
/// alphabet of "ab 12", two merges in rank order, and "12" (reachable only without
/// the Digits pre-tokenizer).
pub fn tiny_tokenizer(w: &mut GgufWriter, pre: &str) {
    let toks = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "a",
        "b",
        "Ġ",
        "1",
        "2",
        "ab",
        "Ġa",
        "12",
    ];
    w.kv("tokenizer.ggml.model", GgufValue::String("gpt2".into()));
    w.kv("tokenizer.ggml.pre", GgufValue::String(pre.into()));
    w.kv("tokenizer.ggml.tokens", strings(&toks));
    w.kv(
        "tokenizer.ggml.token_type",
        GgufValue::Array(GgufArray {
            elem_type: GgufValueType::I32,
            values: [3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1]
                .iter()
                .map(|&t| GgufValue::I32(t))
                .collect(),
        }),
    );
    w.kv("tokenizer.ggml.merges", strings(&["a b", "Ġ a", "1 2"]));
    w.kv("tokenizer.ggml.bos_token_id", GgufValue::U32(1));
    w.kv("tokenizer.ggml.eos_token_id", GgufValue::U32(2));
    w.kv("tokenizer.ggml.padding_token_id", GgufValue::U32(2));
    w.kv("tokenizer.ggml.unknown_token_id", GgufValue::U32(0));
    w.kv("tokenizer.ggml.add_bos_token", GgufValue::Bool(false));
    w.kv(
        "tokenizer.chat_template",
        GgufValue::String("{{ messages }}".into()),
    );
}
