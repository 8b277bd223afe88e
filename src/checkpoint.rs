//! Hugging Face checkpoint folders: memory-mapped safetensors (single file or
//! sharded with `model.safetensors.index.json`) and typed tensor access.
//!
//! [`Checkpoint`] maps every shard once and indexes every tensor by name. Model
//! files ask for tensors by their published names with the shape the config
//! implies ([`Checkpoint::matrix`], [`Checkpoint::vector`]); a wrong shape or
//! dtype is an error that names the tensor.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use caracal_kernels::matrix::SharedBytes;
use caracal_kernels::{DType, Matrix, Storage};
use memmap2::Mmap;

use crate::error::{Error, Result};

/// Stored element type of a checkpoint tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredDType {
    /// f32.
    F32,
    /// bf16.
    BF16,
    /// f16.
    F16,
    /// u8 (packed MXFP4 blocks, E8M0 scales).
    U8,
    /// i32 (packed int formats, shapes).
    I32,
    /// Anything else (named).
    Other(&'static str),
}

impl StoredDType {
    fn from_safetensors(d: safetensors::Dtype) -> StoredDType {
        use safetensors::Dtype as D;
        match d {
            D::F32 => StoredDType::F32,
            D::BF16 => StoredDType::BF16,
            D::F16 => StoredDType::F16,
            D::U8 => StoredDType::U8,
            D::I32 => StoredDType::I32,
            D::F64 => StoredDType::Other("f64"),
            D::I64 => StoredDType::Other("i64"),
            D::I8 => StoredDType::Other("i8"),
            D::I16 => StoredDType::Other("i16"),
            D::BOOL => StoredDType::Other("bool"),
            _ => StoredDType::Other("unsupported"),
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            StoredDType::F32 | StoredDType::I32 => 4,
            StoredDType::BF16 | StoredDType::F16 => 2,
            StoredDType::U8 => 1,
            StoredDType::Other(_) => 0,
        }
    }

    /// Short name (`bf16`, `f32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            StoredDType::F32 => "f32",
            StoredDType::BF16 => "bf16",
            StoredDType::F16 => "f16",
            StoredDType::U8 => "u8",
            StoredDType::I32 => "i32",
            StoredDType::Other(s) => s,
        }
    }
}

/// Where one tensor lives.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    /// Index of the shard in [`Checkpoint::shards`].
    pub shard: usize,
    /// Stored dtype.
    pub dtype: StoredDType,
    /// Row-major shape.
    pub shape: Vec<usize>,
    /// Absolute byte offset inside the shard file.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// A memory map that can be shared by many tensors.
struct MappedFile(Mmap);

impl AsRef<[u8]> for MappedFile {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// A checkpoint folder with all its safetensors shards mapped.
pub struct Checkpoint {
    /// The folder.
    pub dir: PathBuf,
    /// Shard file names, in index order.
    pub shard_names: Vec<String>,
    /// The mapped shards.
    shards: Vec<SharedBytes>,
    /// Every tensor by name.
    tensors: HashMap<String, TensorEntry>,
}

impl Checkpoint {
    /// Maps the safetensors files of `dir`: `model.safetensors`, or the shards
    /// listed in `model.safetensors.index.json`, or every `*.safetensors` file.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let shard_names: Vec<String> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::BadFile {
                what: "safetensors index",
                path: index.clone(),
                detail: e.to_string(),
            })?;
            let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| Error::BadFile {
                what: "safetensors index",
                path: index.clone(),
                detail: "no `weight_map` object".into(),
            })?;
            let mut names: Vec<String> = map.values().filter_map(|f| f.as_str().map(String::from)).collect();
            names.sort();
            names.dedup();
            names
        } else if single.exists() {
            vec!["model.safetensors".into()]
        } else {
            let mut names: Vec<String> = std::fs::read_dir(dir)
                .map_err(|e| Error::io(dir, e))?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".safetensors"))
                .collect();
            names.sort();
            if names.is_empty() {
                return Err(Error::io(
                    &single,
                    std::io::Error::new(std::io::ErrorKind::NotFound, "no *.safetensors files in the model folder"),
                ));
            }
            names
        };
        let mut shards = Vec::new();
        let mut tensors = HashMap::new();
        for (i, name) in shard_names.iter().enumerate() {
            let path = dir.join(name);
            let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
            // SAFETY: checkpoint files are not modified while a model is loaded.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
            let bad = |detail: String| Error::BadFile { what: "safetensors file", path: path.clone(), detail };
            let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map[..]).map_err(|e| bad(e.to_string()))?;
            let base = 8 + header_len;
            for (tname, info) in meta.tensors() {
                let (start, end) = info.data_offsets;
                let entry = TensorEntry {
                    shard: i,
                    dtype: StoredDType::from_safetensors(info.dtype),
                    shape: info.shape.clone(),
                    offset: base + start,
                    len: end - start,
                };
                tensors.insert(tname, entry);
            }
            shards.push(Arc::new(MappedFile(map)) as SharedBytes);
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), shard_names, shards, tensors })
    }

    /// Whether a tensor exists.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The entry of a tensor.
    pub fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.tensors.get(name).ok_or_else(|| Error::MissingTensor { name: name.into() })
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.tensors.keys().map(|s| s.as_str()).collect();
        v.sort();
        v
    }

    /// The raw bytes of a tensor.
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let e = self.entry(name)?;
        Ok(&(*self.shards[e.shard]).as_ref()[e.offset..e.offset + e.len])
    }

    /// Storage borrowing a tensor's bytes (copied only when misaligned).
    pub fn storage(&self, name: &str) -> Result<Storage> {
        let e = self.entry(name)?;
        Ok(Storage::borrowed(self.shards[e.shard].clone(), e.offset, e.len, e.dtype.size().max(1)))
    }

    fn check_shape(&self, name: &str, expected: &[usize]) -> Result<&TensorEntry> {
        let e = self.entry(name)?;
        let numel: usize = e.shape.iter().product();
        let want: usize = expected.iter().product();
        // Accept shapes that differ only by unit dimensions ([1,1,H,1] vs [H]).
        let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if e.shape != expected && !(numel == want && squeeze(&e.shape) == squeeze(expected)) {
            return Err(Error::TensorShape { name: name.into(), expected: expected.to_vec(), found: e.shape.clone() });
        }
        Ok(e)
    }

    /// A `[rows, cols]` weight in its stored float dtype (no copy).
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let e = self.check_shape(name, &[rows, cols])?.clone();
        let dtype = match e.dtype {
            StoredDType::F32 => DType::F32,
            StoredDType::BF16 => DType::BF16,
            StoredDType::F16 => DType::F16,
            other => {
                return Err(Error::TensorDType { name: name.into(), expected: "f32, bf16, f16".into(), found: other.name().into() })
            }
        };
        Ok(Matrix::new(rows, cols, dtype, self.storage(name)?)?)
    }

    /// A tensor of any float dtype widened to f32, checked against `shape`.
    pub fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let e = self.check_shape(name, shape)?.clone();
        let bytes = self.bytes(name)?;
        let out = match e.dtype {
            StoredDType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            StoredDType::BF16 => bytes
                .chunks_exact(2)
                .map(|c| caracal_kernels::dtype::bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            StoredDType::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            other => {
                return Err(Error::TensorDType { name: name.into(), expected: "f32, bf16, f16".into(), found: other.name().into() })
            }
        };
        Ok(out)
    }

    /// A 1-D tensor of length `len` widened to f32 (norm weights, biases).
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        self.tensor_f32(name, &[len])
    }

    /// Total elements of all tensors (parameters).
    pub fn total_params(&self) -> usize {
        self.tensors.values().map(|e| e.shape.iter().product::<usize>()).sum()
    }

    /// Total bytes of all tensors.
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|e| e.len).sum()
    }
}
