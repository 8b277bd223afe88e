//! Hugging Face checkpoint folders: memory-mapped safetensors (single file or
//! sharded with `model.safetensors.index.json`) and typed tensor access.
//!
//! [`Checkpoint`] maps every shard once and indexes every tensor by name. Model
//! files ask for tensors by their published names with the shape the config
//! implies ([`Checkpoint::matrix`], [`Checkpoint::vector`]); a wrong shape or
//! dtype is an error that names the tensor.
//!
//! MXFP4 weights load packed, never expanded: [`Checkpoint::matrix`] falls
//! back to the compressed-tensors pair `{base}.weight_packed` +
//! `{base}.weight_scale` when `{base}.weight` is absent, and
//! [`Checkpoint::fused_expert_matrix`] slices one expert out of gpt-oss style
//! `{base}_blocks` + `{base}_scales` (or a fused float `{base}`) tensors.
//!
//! Children: [`arch`] is the one typed, validated description of a
//! checkpoint's architecture; [`config`] reads `config.json` /
//! `generation_config.json`; [`gguf`] reads llama.cpp's GGUF files and
//! imports them as folders;
//! [`inspect`] reports a checkpoint's tensors, dtypes and MXFP4 scale statistics.

pub mod arch;
pub mod config;
pub mod gguf;
pub mod inspect;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use caracal_kernels::matrix::{SharedBytes, SharedSource};
use caracal_kernels::q8::Activations;
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
    /// i8 (Q8_0 / int-quantized weights).
    I8,
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
            D::I8 => StoredDType::I8,
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
            StoredDType::U8 | StoredDType::I8 => 1,
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
            StoredDType::I8 => "i8",
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

/// A repacked MXFP4 matrix no longer reads its mapped bytes: the pages wholly
/// inside the range leave this process's resident set (they stay in the page
/// cache and are mapped again, unchanged, should another borrow read them),
/// so an int8 model holds its weights once, as panels.
impl SharedSource for MappedFile {
    fn release(&self, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        {
            // SAFETY: sysconf has no preconditions.
            let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
                .unwrap_or(4096)
                .max(1);
            let (start, end) = (range.start.next_multiple_of(page), range.end / page * page);
            if start < end && end <= self.0.len() {
                // SAFETY: the map is read-only and shared, so MADV_DONTNEED only
                // unmaps its pages: a later read faults the same file bytes back
                // in, and no reference into the map sees a change. Advice only:
                // a failure leaves the pages resident.
                let _ = unsafe {
                    self.0.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        start,
                        end - start,
                    )
                };
            }
        }
        #[cfg(not(unix))]
        let _ = range;
    }
}

/// How a checkpoint's weights are loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// How every MXFP4 / Q8_0 matrix built from the checkpoint meets its
    /// activations: [`Activations::F32`] (the default: exactly the decoded
    /// weights' product, what reference tests compare) or
    /// [`Activations::Int8`] (activations rounded to int8 per 32-element
    /// block, faster on VNNI CPUs). Float weights ignore it.
    pub activations: Activations,
}

impl Default for LoadOptions {
    fn default() -> LoadOptions {
        LoadOptions {
            activations: Activations::F32,
        }
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
    /// Set on every quantized matrix built ([`LoadOptions::activations`]).
    activations: Activations,
}

impl Checkpoint {
    /// Maps the safetensors files of `dir` with the default [`LoadOptions`].
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        Checkpoint::open_with(dir, &LoadOptions::default())
    }

    /// Maps the safetensors files of `dir`: `model.safetensors`, or the shards
    /// listed in `model.safetensors.index.json`, or every `*.safetensors` file.
    /// Quantized matrices built from it carry `opts.activations`.
    pub fn open_with(dir: &Path, opts: &LoadOptions) -> Result<Checkpoint> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let shard_names: Vec<String> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::BadFile {
                what: "safetensors index",
                path: index.clone(),
                detail: e.to_string(),
            })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::BadFile {
                    what: "safetensors index",
                    path: index.clone(),
                    detail: "no `weight_map` object".into(),
                })?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(String::from))
                .collect();
            names.sort();
            names.dedup();
            // Shards are files beside the index: a name that climbs out of the
            // folder (`../x`, `/etc/x`) is a bad index, not a path to follow.
            if let Some(bad) = names.iter().find(|n| !is_plain_file_name(n)) {
                return Err(Error::BadFile {
                    what: "safetensors index",
                    path: index.clone(),
                    detail: format!("shard {bad:?} is not a file name in the model folder"),
                });
            }
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
                    std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "no *.safetensors files in the model folder",
                    ),
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
            let bad = |detail: String| Error::BadFile {
                what: "safetensors file",
                path: path.clone(),
                detail,
            };
            let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map[..])
                .map_err(|e| bad(e.to_string()))?;
            for (tname, info) in meta.tensors() {
                let entry = tensor_entry(i, header_len, map.len(), info)
                    .map_err(|detail| bad(format!("tensor {tname:?}: {detail}")))?;
                if tensors.contains_key(&tname) {
                    return Err(bad(format!("tensor {tname:?} is also in another shard")));
                }
                tensors.insert(tname, entry);
            }
            shards.push(Arc::new(MappedFile(map)) as SharedBytes);
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shard_names,
            shards,
            tensors,
            activations: opts.activations,
        })
    }

    /// The activation mode quantized matrices of this checkpoint carry.
    pub fn activations(&self) -> Activations {
        self.activations
    }

    /// Whether a tensor exists.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The entry of a tensor.
    pub fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor { name: name.into() })
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
        // In range by construction (`tensor_entry`); `get` keeps it an error
        // rather than a panic should an entry ever be built another way.
        (*self.shards[e.shard])
            .as_ref()
            .get(e.offset..e.offset + e.len)
            .ok_or_else(|| Error::BadFile {
                what: "safetensors file",
                path: self.dir.join(&self.shard_names[e.shard]),
                detail: format!("tensor {name:?} lies outside the file"),
            })
    }

    /// Storage borrowing a tensor's bytes (copied only when misaligned).
    pub fn storage(&self, name: &str) -> Result<Storage> {
        let e = self.entry(name)?;
        Ok(Storage::borrowed(
            self.shards[e.shard].clone(),
            e.offset,
            e.len,
            e.dtype.size().max(1),
        ))
    }

    fn check_shape(&self, name: &str, expected: &[usize]) -> Result<&TensorEntry> {
        let e = self.entry(name)?;
        let numel: usize = e.shape.iter().product();
        let want: usize = expected.iter().product();
        // Accept shapes that differ only by unit dimensions ([1,1,H,1] vs [H]).
        let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if e.shape != expected && !(numel == want && squeeze(&e.shape) == squeeze(expected)) {
            return Err(Error::TensorShape {
                name: name.into(),
                expected: expected.to_vec(),
                found: e.shape.clone(),
            });
        }
        Ok(e)
    }

    /// A `[rows, cols]` weight in its stored dtype (no copy).
    ///
    /// Float tensors (f32, bf16, f16) are returned as stored. When `name` ends
    /// in `.weight`, is absent, and the compressed-tensors MXFP4 pair
    /// `{base}.weight_packed` (u8 `[rows, cols/2]`) + `{base}.weight_scale`
    /// (u8 `[rows, cols/32]`, E8M0) exists instead, an MXFP4 matrix borrowing
    /// the mapped bytes is returned (see [`Checkpoint::mxfp4_pair`]). An i8
    /// `{base}.weight` with an f32 `{base}.weight_scale` `[rows, cols/32]` is
    /// Q8_0 (compressed-tensors int-quantized, symmetric, group size 32).
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        if !self.has(name) {
            if let Some((packed, scale)) = self.mxfp4_pair(name) {
                return self.packed_matrix(&packed, &scale, rows, cols);
            }
        }
        let e = self.check_shape(name, &[rows, cols])?.clone();
        let dtype = match e.dtype {
            StoredDType::F32 => DType::F32,
            StoredDType::BF16 => DType::BF16,
            StoredDType::F16 => DType::F16,
            StoredDType::I8 => return self.q8_0_matrix(name, rows, cols),
            other => {
                return Err(Error::TensorDType {
                    name: name.into(),
                    expected: "f32, bf16, f16, i8 (Q8_0)".into(),
                    found: other.name().into(),
                })
            }
        };
        Ok(Matrix::new(rows, cols, dtype, self.storage(name)?)?)
    }

    /// Whether a `[rows, cols]` weight `name` can be loaded with
    /// [`Checkpoint::matrix`]: stored as is, or as a compressed-tensors MXFP4 pair.
    pub fn has_matrix(&self, name: &str) -> bool {
        self.has(name) || self.mxfp4_pair(name).is_some()
    }

    /// The names `({base}.weight_packed, {base}.weight_scale)` of the
    /// compressed-tensors MXFP4 form of `{base}.weight`, when both exist.
    ///
    /// Layout (compressed-tensors `mxfp4-pack-quantized`, the way Kimi K3 ships
    /// its experts): `weight_packed` is u8 `[rows, cols/2]`, two E2M1 codes per
    /// byte, the even element in the low nibble; `weight_scale` is u8
    /// `[rows, cols/32]`, one E8M0 exponent per 32 consecutive elements of a
    /// row. Byte for byte this is the gpt-oss `[rows, cols/32, 16]` blocks
    /// layout that [`caracal_kernels::mxfp4`] consumes.
    pub fn mxfp4_pair(&self, name: &str) -> Option<(String, String)> {
        let base = name.strip_suffix(".weight")?;
        let packed = format!("{base}.weight_packed");
        let scale = format!("{base}.weight_scale");
        (self.has(&packed) && self.has(&scale)).then_some((packed, scale))
    }

    /// An MXFP4 matrix from a `weight_packed` / `weight_scale` pair, checked
    /// against `[rows, cols]`.
    fn packed_matrix(&self, packed: &str, scale: &str, rows: usize, cols: usize) -> Result<Matrix> {
        if !cols.is_multiple_of(caracal_kernels::mxfp4::BLOCK_ELEMS) {
            return Err(Error::TensorShape {
                name: packed.into(),
                expected: vec![rows, cols / 2],
                found: self.entry(packed)?.shape.clone(),
            });
        }
        for (n, shape) in [
            (packed, [rows, cols / 2]),
            (scale, [rows, cols / caracal_kernels::mxfp4::BLOCK_ELEMS]),
        ] {
            let e = self.check_shape(n, &shape)?;
            if e.dtype != StoredDType::U8 {
                return Err(Error::TensorDType {
                    name: n.into(),
                    expected: "u8".into(),
                    found: e.dtype.name().into(),
                });
            }
        }
        Ok(
            Matrix::mxfp4(rows, cols, self.storage(packed)?, self.storage(scale)?)?
                .with_activations(self.activations),
        )
    }

    /// A Q8_0 matrix: i8 `name` `[rows, cols]` and f32 `{base}.weight_scale`
    /// `[rows, cols/32]`.
    fn q8_0_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let base = name.strip_suffix(".weight").unwrap_or(name);
        let scale = format!("{base}.weight_scale");
        let block = caracal_kernels::q8::BLOCK;
        if !cols.is_multiple_of(block) || !self.has(&scale) {
            return Err(Error::TensorDType {
                name: name.into(),
                expected: format!("i8 with an f32 {scale} [{rows}, {}]", cols / block),
                found: "i8 without group scales".into(),
            });
        }
        let e = self.check_shape(&scale, &[rows, cols / block])?;
        if e.dtype != StoredDType::F32 {
            return Err(Error::TensorDType {
                name: scale,
                expected: "f32".into(),
                found: e.dtype.name().into(),
            });
        }
        Ok(
            Matrix::q8_0(rows, cols, self.storage(name)?, self.storage(&scale)?)?
                .with_activations(self.activations),
        )
    }

    /// One expert's `[rows, cols]` slice of a fused 3-D expert weight.
    ///
    /// Two layouts are read, tried in this order:
    /// - gpt-oss MXFP4: `{base}_blocks` u8 `[E, R, cols/32, 16]` and
    ///   `{base}_scales` u8 `[E, R, cols/32]` (`quant_method: mxfp4`);
    /// - a float tensor `{base}` `[E, R, cols]` (transformers' fused experts).
    ///
    /// Rows `row_start .. row_start + rows` of expert `expert` are returned,
    /// borrowing the mapped bytes. With `base = ….experts.gate_up_proj` and
    /// `R = 2·I`, the gate projection is rows `[0, I)` and the up projection
    /// rows `[I, 2I)`: the two halves are **concatenated**, as in transformers'
    /// fused `gate_up_proj`. gpt-oss itself **interleaves** them (gate = even
    /// rows, up = odd rows); such checkpoints must be de-interleaved before
    /// loading, this function does not do it. `{base} = ….experts.down_proj`
    /// has `R = hidden`.
    pub fn fused_expert_matrix(
        &self,
        base: &str,
        expert: usize,
        row_start: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix> {
        use caracal_kernels::mxfp4::{BLOCK_BYTES, BLOCK_ELEMS};
        let blocks_name = format!("{base}_blocks");
        let scales_name = format!("{base}_scales");
        if self.has(&blocks_name) && self.has(&scales_name) {
            let b = self.entry(&blocks_name)?.clone();
            let s = self.entry(&scales_name)?.clone();
            for (n, e) in [(&blocks_name, &b), (&scales_name, &s)] {
                if e.dtype != StoredDType::U8 {
                    return Err(Error::TensorDType {
                        name: n.clone(),
                        expected: "u8".into(),
                        found: e.dtype.name().into(),
                    });
                }
            }
            let nb = cols / BLOCK_ELEMS;
            let (experts, total_rows) = match b.shape.as_slice() {
                [e, r, c, 16] if cols.is_multiple_of(BLOCK_ELEMS) && *c == nb => (*e, *r),
                _ => {
                    return Err(Error::TensorShape {
                        name: blocks_name,
                        expected: vec![0, row_start + rows, nb, BLOCK_BYTES],
                        found: b.shape.clone(),
                    })
                }
            };
            if s.shape != [experts, total_rows, nb] {
                return Err(Error::TensorShape {
                    name: scales_name,
                    expected: vec![experts, total_rows, nb],
                    found: s.shape.clone(),
                });
            }
            Self::check_expert_range(&blocks_name, expert, experts, row_start, rows, total_rows)?;
            let first_block = (expert * total_rows + row_start) * nb;
            let blocks = Storage::borrowed(
                self.shards[b.shard].clone(),
                b.offset + first_block * BLOCK_BYTES,
                rows * nb * BLOCK_BYTES,
                1,
            );
            let scales = Storage::borrowed(
                self.shards[s.shard].clone(),
                s.offset + first_block,
                rows * nb,
                1,
            );
            return Ok(
                Matrix::mxfp4(rows, cols, blocks, scales)?.with_activations(self.activations)
            );
        }
        let e = self
            .entry(base)
            .map_err(|_| Error::MissingTensor {
                name: format!("{base} (or {blocks_name} + {scales_name})"),
            })?
            .clone();
        let (experts, total_rows) = match e.shape.as_slice() {
            [n, r, c] if *c == cols => (*n, *r),
            _ => {
                return Err(Error::TensorShape {
                    name: base.into(),
                    expected: vec![0, row_start + rows, cols],
                    found: e.shape.clone(),
                })
            }
        };
        Self::check_expert_range(base, expert, experts, row_start, rows, total_rows)?;
        let dtype = match e.dtype {
            StoredDType::F32 => DType::F32,
            StoredDType::BF16 => DType::BF16,
            StoredDType::F16 => DType::F16,
            other => {
                return Err(Error::TensorDType {
                    name: base.into(),
                    expected: "f32, bf16, f16".into(),
                    found: other.name().into(),
                })
            }
        };
        let size = e.dtype.size();
        let start = (expert * total_rows + row_start) * cols * size;
        let data = Storage::borrowed(
            self.shards[e.shard].clone(),
            e.offset + start,
            rows * cols * size,
            size,
        );
        Ok(Matrix::new(rows, cols, dtype, data)?)
    }

    fn check_expert_range(
        name: &str,
        expert: usize,
        experts: usize,
        row_start: usize,
        rows: usize,
        total: usize,
    ) -> Result<()> {
        if expert >= experts || row_start + rows > total {
            return Err(Error::Config(format!(
                "`{name}`: expert {expert}, rows {row_start}..{} is outside its {experts} experts × {total} rows",
                row_start + rows
            )));
        }
        Ok(())
    }

    /// A tensor of any float dtype widened to f32, checked against `shape`.
    ///
    /// A 2-D `{base}.weight` stored as a compressed-tensors MXFP4 pair (see
    /// [`Checkpoint::mxfp4_pair`]) is decoded (weights that a model widens
    /// at load time, like MLA's `kv_b_proj`, load from quantized checkpoints).
    pub fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        if !self.has(name) && shape.len() == 2 {
            if let Some((packed, scale)) = self.mxfp4_pair(name) {
                return Ok(self
                    .packed_matrix(&packed, &scale, shape[0], shape[1])?
                    .to_f32_vec());
            }
        }
        let e = self.check_shape(name, shape)?.clone();
        let bytes = self.bytes(name)?;
        let out = match e.dtype {
            StoredDType::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            StoredDType::BF16 => bytes
                .chunks_exact(2)
                .map(|c| caracal_kernels::dtype::bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            StoredDType::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(Error::TensorDType {
                    name: name.into(),
                    expected: "f32, bf16, f16".into(),
                    found: other.name().into(),
                })
            }
        };
        Ok(out)
    }

    /// A 1-D tensor of length `len` widened to f32 (norm weights, biases).
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        self.tensor_f32(name, &[len])
    }

    /// Total parameters of all tensors. MXFP4 tensors count their logical
    /// weights: two per packed byte (`*.weight_packed`, `*_blocks`), and
    /// their scale tensors (`*.weight_scale`, `*_scales`) count nothing.
    pub fn total_params(&self) -> usize {
        self.tensors
            .iter()
            .map(|(name, e)| {
                let numel = e.shape.iter().product::<usize>();
                match mxfp4_role(name, e.dtype) {
                    Some(Mxfp4Role::Packed) => 2 * numel,
                    Some(Mxfp4Role::Scales) => 0,
                    // Q8_0 group scales of an i8 weight are not parameters either.
                    None if self.is_q8_0_scale(name) => 0,
                    None => numel,
                }
            })
            .sum()
    }

    /// Whether `name` is the f32 `{base}.weight_scale` of an i8 `{base}.weight` (Q8_0).
    fn is_q8_0_scale(&self, name: &str) -> bool {
        name.strip_suffix(".weight_scale").is_some_and(|base| {
            self.tensors
                .get(&format!("{base}.weight"))
                .is_some_and(|w| w.dtype == StoredDType::I8)
        })
    }

    /// Total bytes of all tensors.
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|e| e.len).sum()
    }
}

/// Whether `name` names a file directly inside a folder (no separators, not
/// `.` or `..`, not absolute).
fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\'])
        && Path::new(name).file_name() == Some(std::ffi::OsStr::new(name))
}

/// The entry of one tensor of shard `shard`, checked against the file before
/// any of its bytes is read: its data lies inside the file (`file_len`
/// bytes, with `header_len` bytes of JSON after the 8-byte length), and
/// its byte length is its shape's element count times its dtype's size.
/// The safetensors crate checks the same on parsing; the checks are
/// repeated here because the mapped bytes are read on the strength of
/// them, and an out-of-range read of a map is a SIGBUS, not an error.
fn tensor_entry(
    shard: usize,
    header_len: usize,
    file_len: usize,
    info: &safetensors::tensor::TensorInfo,
) -> std::result::Result<TensorEntry, String> {
    let (start, end) = info.data_offsets;
    let base = header_len
        .checked_add(8)
        .ok_or("the header length overflows")?;
    let (offset, stop) = match (base.checked_add(start), base.checked_add(end)) {
        (Some(o), Some(s)) if start <= end && s <= file_len => (o, s),
        _ => {
            return Err(format!(
                "data offsets [{start}, {end}) after the {base}-byte header run past the end of the file ({file_len} bytes)"
            ))
        }
    };
    let dtype = StoredDType::from_safetensors(info.dtype);
    let numel = info
        .shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| format!("shape {:?} overflows", info.shape))?;
    if dtype.size() > 0 && numel.checked_mul(dtype.size()) != Some(stop - offset) {
        return Err(format!(
            "shape {:?} of {} needs {} bytes, the offsets give {}",
            info.shape,
            dtype.name(),
            numel.saturating_mul(dtype.size()),
            stop - offset
        ));
    }
    Ok(TensorEntry {
        shard,
        dtype,
        shape: info.shape.clone(),
        offset,
        len: stop - offset,
    })
}

/// What a u8 tensor of an MXFP4 checkpoint holds, judged by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mxfp4Role {
    /// Packed E2M1 codes: `*.weight_packed` (compressed-tensors) or `*_blocks` (gpt-oss).
    Packed,
    /// E8M0 block scales: `*.weight_scale` (compressed-tensors) or `*_scales` (gpt-oss).
    Scales,
}

/// The MXFP4 role of tensor `name` stored as `dtype`, if it has one (only u8
/// tensors with the suffixes above do).
pub fn mxfp4_role(name: &str, dtype: StoredDType) -> Option<Mxfp4Role> {
    if dtype != StoredDType::U8 {
        return None;
    }
    if name.ends_with(".weight_packed") || name.ends_with("_blocks") {
        Some(Mxfp4Role::Packed)
    } else if name.ends_with(".weight_scale") || name.ends_with("_scales") {
        Some(Mxfp4Role::Scales)
    } else {
        None
    }
}
