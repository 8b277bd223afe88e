//! The GGUF container: header, metadata key/values, tensor table, mapped data.
//!
//! Layout (all little-endian; llama.cpp `docs/gguf.md`):
//! ```text
//! u32 magic "GGUF" | u32 version (2 or 3) | u64 tensor_count | u64 kv_count
//! kv_count × { string key | u32 value_type | value }
//! tensor_count × { string name | u32 n_dims | u64 dims[n_dims] | u32 ggml_type | u64 offset }
//! padding to general.alignment (default 32)
//! tensor data; each tensor at data_start + offset, offset a multiple of the alignment
//! ```
//! A string is `u64 len` + UTF-8 bytes (no NUL). An array value is `u32 elem_type |
//! u64 count | count × value` (arrays may nest). Tensor dims are listed innermost
//! first: `dims[0]` (ggml's `ne0`) is the contiguous one, so a linear weight
//! `[out, in]` is stored with dims `[in, out]`; [`TensorInfo::shape`] gives the
//! row-major `[.., ne1, ne0]`.
//!
//! Every read is bounds-checked against the file length, and every count is checked
//! against the bytes left before anything is allocated, so a corrupt or truncated
//! file gives an error, never a panic or a huge allocation. Metadata is bounded
//! twice more, since each value becomes a [`GgufValue`] of 32 bytes however few
//! bytes it took on disk: at most [`MAX_METADATA_VALUES`] values in all, and
//! arrays nested at most [`MAX_ARRAY_DEPTH`] deep (the parser recurses per level).
//! Tensor byte sizes are computed with checked arithmetic and must lie inside
//! the file.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::quants::{dequantize, GgmlType};
pub use super::value::{GgufArray, GgufValue, GgufValueType};
use super::{GgufError, Result};

/// `"GGUF"` read as a little-endian u32.
const GGUF_MAGIC: u32 = 0x4655_4747;
/// Alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;
/// Most metadata values (array elements included) a file may hold: 4,194,304,
/// about 25 times the largest tokenizer in use (Kimi's 163,840 tokens, their
/// types and merges); at 32 bytes a value that bounds metadata to 128 MiB.
pub const MAX_METADATA_VALUES: usize = 1 << 22;
/// Deepest nesting of metadata arrays (llama.cpp writes at most 2).
pub const MAX_ARRAY_DEPTH: usize = 8;

/// One tensor's description from the tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// GGUF tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Storage type.
    pub ggml_type: GgmlType,
    /// Dims as stored: innermost (contiguous, ggml `ne0`) first.
    pub dims: Vec<u64>,
    /// Offset of the data from the start of the data section, as stored.
    pub offset: u64,
    /// Absolute byte range of the data inside the file.
    pub byte_range: Range<usize>,
}

impl TensorInfo {
    /// Row-major shape `[.., ne1, ne0]` (the dims reversed), the layout HF and numpy use.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Number of data bytes.
    pub fn n_bytes(&self) -> usize {
        self.byte_range.len()
    }
}

/// A memory-mapped GGUF file with its parsed header.
#[derive(Debug)]
pub struct GgufFile {
    /// Where the file was opened from (for messages).
    path: PathBuf,
    /// The mapped file; tensor data is read from it lazily.
    mmap: Mmap,
    /// GGUF version (2 or 3).
    version: u32,
    /// Metadata in file order.
    metadata: Vec<(String, GgufValue)>,
    /// Index of each key in `metadata`.
    metadata_index: HashMap<String, usize>,
    /// Tensor table in file order.
    tensors: Vec<TensorInfo>,
    /// Index of each tensor name in `tensors`.
    tensor_index: HashMap<String, usize>,
    /// Alignment in force (`general.alignment` or 32).
    alignment: u64,
    /// Absolute offset of the data section.
    data_offset: u64,
}

impl GgufFile {
    /// Opens and memory-maps `path`, and parses its header and tensor table.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref().to_path_buf();
        let io = |source| GgufError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        // SAFETY: the map is read-only and private to this struct. Like every mmap
        // reader we rely on no other process truncating or rewriting the file while
        // it is open; a model file being replaced under a running server is outside
        // what this reader defends against.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let parsed = parse(&mmap)?;
        Ok(GgufFile {
            path,
            version: parsed.version,
            metadata_index: parsed
                .metadata
                .iter()
                .enumerate()
                .map(|(i, (k, _))| (k.clone(), i))
                .collect(),
            tensor_index: parsed
                .tensors
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), i))
                .collect(),
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
            mmap,
        })
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data in this file.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset where the data section starts.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Total file size in bytes.
    pub fn file_len(&self) -> usize {
        self.mmap.len()
    }

    /// The value stored under `key`.
    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// All metadata, in file order.
    pub fn metadata_entries(&self) -> impl Iterator<Item = (&str, &GgufValue)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.metadata(key)?.as_str()
    }

    /// An integer value that fits in u64.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.metadata(key)?.as_u64()
    }

    /// A float (or integer) value as f64.
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.metadata(key)?.as_f64()
    }

    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.metadata(key)?.as_bool()
    }

    /// An array of strings (`None` if absent, not an array, or not all strings).
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.metadata(key)?
            .as_array()?
            .values
            .iter()
            .map(|v| v.as_str())
            .collect()
    }

    /// An array of integers as i64 (`None` if absent, not an array, or not all integers).
    pub fn get_i64_array(&self, key: &str) -> Option<Vec<i64>> {
        self.metadata(key)?
            .as_array()?
            .values
            .iter()
            .map(|v| v.as_i64())
            .collect()
    }

    /// A required u64 value: [`GgufError::MissingKey`] / [`GgufError::WrongType`].
    pub fn require_u64(&self, key: &str) -> Result<u64> {
        let v = self
            .metadata(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))?;
        v.as_u64()
            .ok_or_else(|| wrong_type(key, "a non-negative integer", v))
    }

    /// A required float value as f64.
    pub fn require_f64(&self, key: &str) -> Result<f64> {
        let v = self
            .metadata(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))?;
        v.as_f64().ok_or_else(|| wrong_type(key, "a number", v))
    }

    /// A required string value.
    pub fn require_str(&self, key: &str) -> Result<&str> {
        let v = self
            .metadata(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))?;
        v.as_str().ok_or_else(|| wrong_type(key, "a string", v))
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> std::slice::Iter<'_, TensorInfo> {
        self.tensors.iter()
    }

    /// Number of tensors.
    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw (possibly quantised) bytes of `info`, borrowed from the map.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        &self.mmap[info.byte_range.clone()]
    }

    /// `info`'s data dequantised to f32, in row-major order.
    pub fn dequantize_tensor(&self, info: &TensorInfo) -> Result<Vec<f32>> {
        let n = usize::try_from(info.n_elements()).map_err(|_| GgufError::BadTensor {
            tensor: info.name.clone(),
            reason: "too many elements for this machine".into(),
        })?;
        dequantize(info.ggml_type, self.tensor_data(info), n)
    }
}

fn wrong_type(key: &str, expected: &'static str, found: &GgufValue) -> GgufError {
    GgufError::WrongType {
        key: key.to_string(),
        expected,
        found: found.type_name(),
    }
}

/// What [`parse`] extracts from the bytes.
struct Parsed {
    /// GGUF version (2 or 3).
    version: u32,
    /// Metadata in file order.
    metadata: Vec<(String, GgufValue)>,
    /// Validated tensor table.
    tensors: Vec<TensorInfo>,
    /// Alignment in force.
    alignment: u64,
    /// Absolute offset of the data section.
    data_offset: u64,
}

/// A bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    /// The whole file.
    bytes: &'a [u8],
    /// Offset of the next read.
    pos: usize,
    /// Metadata values that may still be read ([`MAX_METADATA_VALUES`]).
    values_left: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos,
                needed: n,
                len: self.bytes.len(),
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self
            .take(N, what)?
            .try_into()
            .expect("take returns exactly N bytes"))
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// A count of items each at least `min_item_bytes` long, checked against what is
    /// left of the file so a corrupt count cannot trigger a huge allocation.
    fn count(&mut self, min_item_bytes: usize, what: &str) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(what)?;
        let fits = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(min_item_bytes))
            .is_some_and(|b| b <= self.remaining());
        if !fits {
            return Err(GgufError::Truncated {
                what: format!("{n} × {what}"),
                offset: at,
                needed: usize::try_from(n)
                    .unwrap_or(usize::MAX)
                    .saturating_mul(min_item_bytes),
                len: self.bytes.len(),
            });
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.count(1, what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8(what.to_string()))
    }

    /// Reserves `n` of the file's metadata values ([`MAX_METADATA_VALUES`]).
    fn spend_values(&mut self, n: usize, key: &str) -> Result<()> {
        self.values_left = self
            .values_left
            .checked_sub(n)
            .ok_or_else(|| GgufError::Limit {
                what: format!("the metadata values (at key {key:?})"),
                limit: MAX_METADATA_VALUES,
            })?;
        Ok(())
    }

    /// One value of type `t`; `depth` counts the arrays it is nested in.
    fn value(&mut self, t: GgufValueType, key: &str, depth: usize) -> Result<GgufValue> {
        use GgufValueType as T;
        Ok(match t {
            T::U8 => GgufValue::U8(self.u8(key)?),
            T::I8 => GgufValue::I8(self.u8(key)? as i8),
            T::U16 => GgufValue::U16(u16::from_le_bytes(self.array(key)?)),
            T::I16 => GgufValue::I16(i16::from_le_bytes(self.array(key)?)),
            T::U32 => GgufValue::U32(self.u32(key)?),
            T::I32 => GgufValue::I32(i32::from_le_bytes(self.array(key)?)),
            T::F32 => GgufValue::F32(f32::from_le_bytes(self.array(key)?)),
            T::Bool => GgufValue::Bool(self.u8(key)? != 0),
            T::String => GgufValue::String(self.string(key)?),
            T::U64 => GgufValue::U64(self.u64(key)?),
            T::I64 => GgufValue::I64(i64::from_le_bytes(self.array(key)?)),
            T::F64 => GgufValue::F64(f64::from_le_bytes(self.array(key)?)),
            T::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::Limit {
                        what: format!("the array nesting of key {key:?}"),
                        limit: MAX_ARRAY_DEPTH,
                    });
                }
                let tag = self.u32(key)?;
                let elem_type =
                    GgufValueType::from_tag(tag).ok_or(GgufError::UnknownValueType {
                        key: key.to_string(),
                        type_id: tag,
                    })?;
                let min_size = match elem_type {
                    T::U8 | T::I8 | T::Bool => 1,
                    T::U16 | T::I16 => 2,
                    T::U32 | T::I32 | T::F32 => 4,
                    // strings and arrays carry at least an 8-byte (resp. 12-byte) header
                    T::String | T::U64 | T::I64 | T::F64 => 8,
                    T::Array => 12,
                };
                let n = self.count(min_size, key)?;
                self.spend_values(n, key)?;
                let mut values = Vec::with_capacity(n);
                for _ in 0..n {
                    values.push(self.value(elem_type, key, depth + 1)?);
                }
                GgufValue::Array(GgufArray { elem_type, values })
            }
        })
    }
}

/// Parses header, metadata and tensor table out of the whole file's bytes.
fn parse(bytes: &[u8]) -> Result<Parsed> {
    let mut c = Cursor {
        bytes,
        pos: 0,
        values_left: MAX_METADATA_VALUES,
    };
    let magic = c.u32("magic")?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic(magic));
    }
    let version = c.u32("version")?;
    if version & 0xFFFF == 0 && version != 0 {
        // a small version number written big-endian reads as n << 24
        return Err(GgufError::BigEndian);
    }
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion(version));
    }
    // a tensor-table entry is at least 8 (name) + 4 + 4 + 8 bytes; a KV at least 8 + 4 + 1
    let n_tensors_at = c.pos;
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.count(13, "metadata key/value")?;
    c.spend_values(n_kv, "(the key/value count)")?;
    let mut metadata = Vec::with_capacity(n_kv);
    for _ in 0..n_kv {
        let key = c.string("metadata key")?;
        let tag = c.u32(&key)?;
        let t = GgufValueType::from_tag(tag).ok_or(GgufError::UnknownValueType {
            key: key.clone(),
            type_id: tag,
        })?;
        let value = c.value(t, &key, 0)?;
        metadata.push((key, value));
    }
    let n_tensors = usize::try_from(n_tensors)
        .ok()
        .filter(|n| n.checked_mul(24).is_some_and(|b| b <= c.remaining()))
        .ok_or(GgufError::Truncated {
            what: format!("{n_tensors} tensor infos"),
            offset: n_tensors_at,
            needed: usize::try_from(n_tensors)
                .unwrap_or(usize::MAX)
                .saturating_mul(24),
            len: bytes.len(),
        })?;

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => {
            let a = v.as_u64().ok_or(GgufError::BadAlignment(0))?;
            if a == 0 || !a.is_power_of_two() {
                return Err(GgufError::BadAlignment(a));
            }
            a
        }
    };

    /// A tensor-table entry before its offset is checked against the data section.
    struct Raw {
        /// Tensor name.
        name: String,
        /// Storage type.
        ggml_type: GgmlType,
        /// Dims, innermost first.
        dims: Vec<u64>,
        /// Offset relative to the data section.
        offset: u64,
    }
    let mut raws = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        let n_dims = c.u32(&name)?;
        if n_dims > MAX_DIMS {
            return Err(GgufError::BadTensor {
                tensor: name,
                reason: format!("{n_dims} dims (max {MAX_DIMS})"),
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&name)?);
        }
        let type_id = c.u32(&name)?;
        let ggml_type = GgmlType::from_id(type_id).ok_or(GgufError::UnknownGgmlType {
            tensor: name.clone(),
            type_id,
        })?;
        let offset = c.u64(&name)?;
        raws.push(Raw {
            name,
            ggml_type,
            dims,
            offset,
        });
    }
    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;

    let mut tensors = Vec::with_capacity(n_tensors);
    let mut seen = HashMap::with_capacity(n_tensors);
    for r in raws {
        let bad = |reason: String| GgufError::BadTensor {
            tensor: r.name.clone(),
            reason,
        };
        if seen.insert(r.name.clone(), ()).is_some() {
            return Err(bad("duplicate tensor name".into()));
        }
        let n_elements = r
            .dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(format!("dims {:?} overflow", r.dims)))?;
        let ne0 = r.dims.first().copied().unwrap_or(1);
        if ne0 % r.ggml_type.block_size() as u64 != 0 {
            return Err(bad(format!(
                "ne0 = {ne0} is not a multiple of the {} block size {}",
                r.ggml_type,
                r.ggml_type.block_size()
            )));
        }
        let n_bytes = r.ggml_type.bytes_for(n_elements).ok_or_else(|| {
            bad(format!(
                "dims {:?} of {} take more bytes than a u64 counts",
                r.dims, r.ggml_type
            ))
        })?;
        if r.offset % alignment != 0 {
            return Err(bad(format!(
                "offset {} is not a multiple of the alignment {alignment}",
                r.offset
            )));
        }
        let start = data_offset.checked_add(r.offset);
        let end = start.and_then(|s| s.checked_add(n_bytes));
        let range = match (start, end) {
            (Some(s), Some(e)) if e <= bytes.len() as u64 => s as usize..e as usize,
            _ => {
                return Err(bad(format!(
                    "data [{} + {}, +{n_bytes}) runs past the end of the file ({} bytes)",
                    data_offset,
                    r.offset,
                    bytes.len()
                )))
            }
        };
        tensors.push(TensorInfo {
            name: r.name,
            ggml_type: r.ggml_type,
            dims: r.dims,
            offset: r.offset,
            byte_range: range,
        });
    }
    Ok(Parsed {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::gguf::test_writer::{temp_path, GgufWriter};

    fn sample_values() -> Vec<(&'static str, GgufValue)> {
        let strings = |v: &[&str]| {
            GgufValue::Array(GgufArray {
                elem_type: GgufValueType::String,
                values: v.iter().map(|s| GgufValue::String(s.to_string())).collect(),
            })
        };
        vec![
            ("t.u8", GgufValue::U8(250)),
            ("t.i8", GgufValue::I8(-7)),
            ("t.u16", GgufValue::U16(65_000)),
            ("t.i16", GgufValue::I16(-30_000)),
            ("t.u32", GgufValue::U32(4_000_000_000)),
            ("t.i32", GgufValue::I32(-2_000_000_000)),
            ("t.f32", GgufValue::F32(1e-5)),
            ("t.bool", GgufValue::Bool(true)),
            ("t.string", GgufValue::String("héllo 🦙".into())),
            ("t.u64", GgufValue::U64(u64::MAX - 1)),
            ("t.i64", GgufValue::I64(i64::MIN + 3)),
            ("t.f64", GgufValue::F64(-1.25e300)),
            ("t.strings", strings(&["<s>", "Ġt", ""])),
            (
                "t.i32s",
                GgufValue::Array(GgufArray {
                    elem_type: GgufValueType::I32,
                    values: vec![GgufValue::I32(3), GgufValue::I32(-1)],
                }),
            ),
            (
                "t.empty",
                GgufValue::Array(GgufArray {
                    elem_type: GgufValueType::F32,
                    values: vec![],
                }),
            ),
            (
                "t.nested",
                GgufValue::Array(GgufArray {
                    elem_type: GgufValueType::Array,
                    values: vec![strings(&["a"]), strings(&["b", "c"])],
                }),
            ),
        ]
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn reads_every_metadata_type_and_aligned_tensors() {
        let mut w = GgufWriter::new(3);
        for (k, v) in sample_values() {
            w.kv(k, v);
        }
        w.kv("general.alignment", GgufValue::U32(64));
        let a: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
        w.tensor("a", GgmlType::F32, &[3, 2], f32_bytes(&a));
        w.tensor(
            "b",
            GgmlType::F32,
            &[5],
            f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0]),
        );
        let path = temp_path("all-types.gguf");
        w.write(&path);
        let f = GgufFile::open(&path).expect("opens");
        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), 64);
        assert_eq!(f.data_offset() % 64, 0);
        for (k, v) in sample_values() {
            assert_eq!(f.metadata(k), Some(&v), "{k}");
        }
        assert_eq!(f.metadata_entries().count(), sample_values().len() + 1);
        assert_eq!(f.get_u64("t.u32"), Some(4_000_000_000));
        assert_eq!(
            f.get_u64("t.i8"),
            None,
            "negative integers have no u64 view"
        );
        assert_eq!(f.get_f64("t.f32"), Some(1e-5f32 as f64));
        assert_eq!(f.get_bool("t.bool"), Some(true));
        assert_eq!(f.get_str("t.string"), Some("héllo 🦙"));
        assert_eq!(f.get_str_array("t.strings"), Some(vec!["<s>", "Ġt", ""]));
        assert_eq!(f.get_i64_array("t.i32s"), Some(vec![3, -1]));
        assert!(matches!(
            f.require_u64("t.string"),
            Err(GgufError::WrongType { .. })
        ));
        assert!(matches!(
            f.require_u64("nope"),
            Err(GgufError::MissingKey(_))
        ));

        let names: Vec<&str> = f.tensors().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        let ta = f.tensor("a").expect("a");
        assert_eq!(ta.dims, vec![3, 2]);
        assert_eq!(ta.shape(), vec![2, 3]);
        assert_eq!(ta.byte_range.start as u64, f.data_offset());
        let tb = f.tensor("b").expect("b");
        assert_eq!(
            tb.offset, 64,
            "second tensor is padded to the 64-byte alignment"
        );
        assert_eq!(tb.byte_range.start % 64, 0);
        assert_eq!(f.dequantize_tensor(ta).expect("f32"), a);
        assert_eq!(
            f.dequantize_tensor(tb).expect("f32"),
            vec![1.0, 2.0, 3.0, 4.0, 5.0]
        );
        std::fs::remove_file(&path).ok();
    }

    #[test]
    fn version_2_files_parse_like_version_3() {
        let mut w = GgufWriter::new(2);
        w.kv("general.architecture", GgufValue::String("llama".into()));
        w.tensor("x", GgmlType::F32, &[4], f32_bytes(&[1.0, -1.0, 0.5, 2.0]));
        let path = temp_path("v2.gguf");
        w.write(&path);
        let f = GgufFile::open(&path).expect("v2 opens");
        assert_eq!(f.version(), 2);
        assert_eq!(f.alignment(), DEFAULT_ALIGNMENT);
        assert_eq!(f.get_str("general.architecture"), Some("llama"));
        assert_eq!(
            f.dequantize_tensor(f.tensor("x").expect("x")).expect("x"),
            vec![1.0, -1.0, 0.5, 2.0]
        );
        std::fs::remove_file(&path).ok();
    }

    #[test]
    fn bad_magic_version_endianness_and_truncation_are_errors() {
        let mut w = GgufWriter::new(3);
        for (k, v) in sample_values() {
            w.kv(k, v);
        }
        w.tensor("x", GgmlType::F32, &[8], f32_bytes(&[0.0; 8]));
        let good = w.to_bytes();
        assert!(parse(&good).is_ok());

        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(matches!(parse(&bad), Err(GgufError::BadMagic(_))));
        let mut v1 = good.clone();
        v1[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(matches!(parse(&v1), Err(GgufError::UnsupportedVersion(1))));
        let mut be = good.clone();
        be[4..8].copy_from_slice(&3u32.to_be_bytes());
        assert!(matches!(parse(&be), Err(GgufError::BigEndian)));
        // every proper prefix fails cleanly (no panic, no giant allocation)
        for cut in (0..good.len()).step_by(7) {
            assert!(parse(&good[..cut]).is_err(), "prefix of {cut} bytes parsed");
        }
        // a corrupt, huge KV count is caught before allocating
        let mut huge = good.clone();
        huge[16..24].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        assert!(matches!(parse(&huge), Err(GgufError::Truncated { .. })));
    }

    #[test]
    fn deep_array_nesting_is_refused_before_recursing() {
        let mut v = GgufValue::Array(GgufArray {
            elem_type: GgufValueType::U8,
            values: vec![],
        });
        for _ in 0..MAX_ARRAY_DEPTH {
            v = GgufValue::Array(GgufArray {
                elem_type: GgufValueType::Array,
                values: vec![v],
            });
        }
        let mut w = GgufWriter::new(3);
        w.kv("deep", v);
        assert!(matches!(
            parse(&w.to_bytes()),
            Err(GgufError::Limit {
                limit: MAX_ARRAY_DEPTH,
                ..
            })
        ));
        // Hand-written: a million nested one-element arrays (12 bytes a level)
        // would overflow the stack of a parser that only checked bytes left.
        let mut bytes = Vec::new();
        bytes.extend_from_slice(b"GGUF");
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.push(b'k');
        bytes.extend_from_slice(&9u32.to_le_bytes());
        for _ in 0..1_000_000 {
            bytes.extend_from_slice(&9u32.to_le_bytes());
            bytes.extend_from_slice(&1u64.to_le_bytes());
        }
        assert!(matches!(parse(&bytes), Err(GgufError::Limit { .. })));
    }

    #[test]
    fn metadata_value_count_is_bounded_before_allocating() {
        // 5M one-byte values fit the file's bytes but not the value budget.
        let n = MAX_METADATA_VALUES + 1;
        let mut bytes = Vec::new();
        bytes.extend_from_slice(b"GGUF");
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.push(b'k');
        bytes.extend_from_slice(&9u32.to_le_bytes());
        bytes.extend_from_slice(&0u32.to_le_bytes());
        bytes.extend_from_slice(&(n as u64).to_le_bytes());
        bytes.resize(bytes.len() + n, 0);
        assert!(matches!(
            parse(&bytes),
            Err(GgufError::Limit {
                limit: MAX_METADATA_VALUES,
                ..
            })
        ));
    }

    #[test]
    fn tensor_dims_whose_byte_size_overflows_are_errors() {
        let mut w = GgufWriter::new(3);
        w.tensor("x", GgmlType::F32, &[1 << 31, 1 << 31], vec![0u8; 32]);
        assert!(matches!(
            parse(&w.to_bytes()),
            Err(GgufError::BadTensor { .. })
        ));
    }

    #[test]
    fn misaligned_or_out_of_bounds_tensors_are_rejected() {
        let mut w = GgufWriter::new(3);
        w.tensor_at("x", GgmlType::F32, &[8], 4, vec![0u8; 40]);
        assert!(matches!(
            parse(&w.to_bytes()),
            Err(GgufError::BadTensor { .. })
        ));
        let mut w = GgufWriter::new(3);
        w.tensor("x", GgmlType::F32, &[8], vec![0u8; 32]);
        let bytes = w.to_bytes();
        assert!(matches!(
            parse(&bytes[..bytes.len() - 1]),
            Err(GgufError::BadTensor { .. })
        ));
        let mut w = GgufWriter::new(3);
        w.tensor("q", GgmlType::Q8_0, &[16, 2], vec![0u8; 34]);
        assert!(
            matches!(parse(&w.to_bytes()), Err(GgufError::BadTensor { .. })),
            "ne0 not a block multiple"
        );
    }
}
