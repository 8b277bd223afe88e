//! [`Matrix`]: a weight matrix kept in its stored dtype, and its matmul.
//!
//! Checkpoint tensors are memory-mapped; a [`Storage`] either borrows a
//! range of such a mapping (kept alive by an `Arc`) or owns its bytes. The
//! range is always aligned for its element type: a misaligned range is
//! copied once at load time.
//!
//! How a quantized matrix (MXFP4, Q8_0) meets its activations is a property
//! of the matrix, chosen when it is loaded ([`Matrix::with_activations`]):
//! [`Activations::F32`] (the default) multiplies exactly the decoded weights,
//! what reference tests compare; [`Activations::Int8`] rounds activations to
//! int8 per 32-element block and uses integer dot products, as llama.cpp does
//! (about 2× faster, ~0.5% output error). f32, bf16 and f16 matrices carry the
//! setting but ignore it, so a loader may set it on every matrix it builds.
//!
//! An MXFP4 matrix set to [`Activations::Int8`] is repacked once, at that
//! moment, into [`Panels`] (16 output rows interleaved per block, see
//! [`crate::mxfp4::panel`]) and every product, decode and prefill, runs the
//! panel GEMM: measured 2–5× the row-layout int8 kernel from 1 to 512
//! activation rows on SmolLM2's shapes (`benches/mxfp4_prefill.rs`). The
//! panels then *are* the weight: the row layout is dropped (an owned buffer
//! is freed; a borrowed checkpoint mapping is told, through
//! [`SharedSource::release`], that its pages are no longer needed), so an
//! int8 MXFP4 weight stays at 4.25 bits. [`Matrix::row_f32`] decodes a row
//! from the panels, [`Matrix::row_bytes`] unpacks the row layout on demand
//! (re-encoding, device uploads), and switching the matrix back to
//! [`Activations::F32`] unpacks it into an owned row layout. Because the two
//! layouts must never disagree, they are private ([`Matrix::data`],
//! [`Matrix::scales`] and [`Matrix::panels`] read them).

use std::borrow::Cow;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::Arc;

use crate::dtype::{bf16_to_f32, DType};
use crate::error::{Error, Result};
use crate::mxfp4::panel::Panels;
use crate::q8::panel::{Q8PanelKernel, Q8Panels};
use crate::q8::Activations;

/// Bytes owned elsewhere (a memory map) that a [`Storage`] can borrow.
pub trait SharedSource: AsRef<[u8]> + Send + Sync {
    /// Told when a borrow of `range` (byte offsets into [`AsRef::as_ref`])
    /// will not read it again: an MXFP4 matrix repacked into panels. A memory
    /// map may drop its resident pages lying wholly inside the range (they are
    /// read again from the file should another borrow touch them); the bytes
    /// seen through any borrow must not change. The default does nothing.
    fn release(&self, range: Range<usize>) {
        let _ = range;
    }
}

/// A shared owner of bytes, as [`Storage::borrowed`] takes it.
pub type SharedBytes = Arc<dyn SharedSource>;

/// Raw bytes of a tensor: borrowed from a shared owner or owned here.
#[derive(Clone)]
pub struct Storage {
    /// Keeps the bytes alive (a memory map, or an owned aligned buffer).
    owner: SharedBytes,
    /// Byte offset of the tensor inside `owner`.
    offset: usize,
    /// Length in bytes.
    len: usize,
}

/// An owned buffer whose bytes start on an 8-byte boundary.
struct AlignedBuf(Vec<u64>, usize);

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: u64 storage reinterpreted as bytes; `1` never exceeds 8·len.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr() as *const u8, self.1) }
    }
}

/// Owned bytes are freed with their last [`Storage`], not released early.
impl SharedSource for AlignedBuf {}

impl Storage {
    /// Borrows `len` bytes at `offset` of `owner`; copies them when they are
    /// not aligned to `align` bytes.
    pub fn borrowed(owner: SharedBytes, offset: usize, len: usize, align: usize) -> Storage {
        let ptr = (*owner).as_ref()[offset..offset + len].as_ptr() as usize;
        if ptr.is_multiple_of(align.max(1)) {
            Storage { owner, offset, len }
        } else {
            Storage::from_bytes(&(*owner).as_ref()[offset..offset + len])
        }
    }

    /// Copies `bytes` into a new 8-byte aligned buffer.
    pub fn from_bytes(bytes: &[u8]) -> Storage {
        let mut buf = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: the u64 buffer has at least bytes.len() bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.as_mut_ptr() as *mut u8, bytes.len())
        };
        let len = bytes.len();
        Storage {
            owner: Arc::new(AlignedBuf(buf, len)),
            offset: 0,
            len,
        }
    }

    /// Owns a copy of an f32 slice.
    pub fn from_f32(values: &[f32]) -> Storage {
        Storage::from_bytes(as_bytes(values))
    }

    /// Owns a copy of a u16 slice (bf16 or f16 bits).
    pub fn from_u16(values: &[u16]) -> Storage {
        Storage::from_bytes(as_bytes(values))
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.offset..self.offset + self.len]
    }

    /// The bytes as f32 values (the length must be a multiple of 4).
    pub fn as_f32(&self) -> &[f32] {
        cast_slice(self.bytes())
    }

    /// The bytes as u16 values (bf16/f16 bits).
    pub fn as_u16(&self) -> &[u16] {
        cast_slice(self.bytes())
    }

    /// Tells the owner that these bytes will not be read through this
    /// storage again (see [`SharedSource::release`]), and drops the borrow.
    pub fn release(self) {
        self.owner.release(self.offset..self.offset + self.len);
    }
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Storage({} bytes)", self.len)
    }
}

fn as_bytes<T: Copy>(values: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slice viewed as bytes.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values))
    }
}

/// Int8 values stored as bytes.
fn as_i8(bytes: &[u8]) -> &[i8] {
    // SAFETY: i8 and u8 have the same size and alignment.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len()) }
}

/// The row layout of Q8_0 panels as a Q8_0 [`Matrix`] stores it: the int8
/// values' bytes and the f32 scales' bytes.
fn q8_row_bytes(p: &Q8Panels) -> (Vec<u8>, Vec<u8>) {
    let (q, d) = p.unpack();
    (
        q.iter().map(|&v| v as u8).collect(),
        d.iter().flat_map(|v| v.to_le_bytes()).collect(),
    )
}

fn cast_slice<T: Copy>(bytes: &[u8]) -> &[T] {
    let size = std::mem::size_of::<T>();
    assert_eq!(
        bytes.len() % size,
        0,
        "byte length is not a multiple of the element size"
    );
    assert_eq!(
        bytes.as_ptr() as usize % std::mem::align_of::<T>(),
        0,
        "storage is aligned at construction"
    );
    // SAFETY: length and alignment checked above; T is plain old data (f32/u16).
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / size) }
}

/// A weight matrix `[rows = out features, cols = in features]` in its stored dtype.
#[derive(Clone, Debug)]
pub struct Matrix {
    /// Output features (rows as stored in the checkpoint).
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// How the weights are encoded.
    pub dtype: DType,
    /// The weights, in row layout or (int8 MXFP4, int8 Q8_0 with VNNI) in panels.
    weights: Weights,
    /// How [`Matrix::matmul`] treats activations when `dtype` is MXFP4 or
    /// Q8_0 (ignored for f32, bf16 and f16). Default [`Activations::F32`].
    activations: Activations,
}

/// The bytes of a [`Matrix`], in exactly one layout.
#[derive(Clone, Debug)]
enum Weights {
    /// The stored row layout.
    Rows {
        /// Row-major values (MXFP4: packed blocks `[rows, cols/32, 16]`;
        /// Q8_0: int8 `[rows, cols]`).
        data: Storage,
        /// Block scales `[rows, cols/32]`: E8M0 bytes for MXFP4, f32 for
        /// Q8_0; `None` for float dtypes.
        scales: Option<Storage>,
    },
    /// An MXFP4 matrix with [`Activations::Int8`], repacked (shared by clones).
    Panels(Arc<Panels>),
    /// A Q8_0 matrix with [`Activations::Int8`] on a CPU with AVX-512 VNNI,
    /// repacked (shared by clones).
    Q8Panels(Arc<Q8Panels>),
}

impl Matrix {
    /// Wraps storage as a `[rows, cols]` matrix of `dtype`, checking the length.
    pub fn new(rows: usize, cols: usize, dtype: DType, data: Storage) -> Result<Matrix> {
        let elem = match dtype {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::Mxfp4 | DType::Q8_0 => {
                return Err(Error::DType {
                    op: "Matrix::new (use Matrix::mxfp4 or Matrix::q8_0)",
                    dtype: dtype.to_string(),
                });
            }
        };
        if data.bytes().len() != rows * cols * elem {
            return Err(Error::Shape {
                op: "Matrix::new",
                detail: format!(
                    "[{rows}, {cols}] {dtype} needs {} bytes, got {}",
                    rows * cols * elem,
                    data.bytes().len()
                ),
            });
        }
        Ok(Matrix {
            rows,
            cols,
            dtype,
            weights: Weights::Rows { data, scales: None },
            activations: Activations::F32,
        })
    }

    /// An MXFP4 matrix from packed blocks `[rows, cols/32, 16]` and E8M0
    /// scales `[rows, cols/32]` (cols must be a multiple of 32).
    pub fn mxfp4(rows: usize, cols: usize, blocks: Storage, scales: Storage) -> Result<Matrix> {
        crate::mxfp4::check_layout(
            "Matrix::mxfp4",
            blocks.bytes().len(),
            scales.bytes().len(),
            rows,
            cols,
        )?;
        Ok(Matrix {
            rows,
            cols,
            dtype: DType::Mxfp4,
            weights: Weights::Rows {
                data: blocks,
                scales: Some(scales),
            },
            activations: Activations::F32,
        })
    }

    /// A Q8_0 matrix from int8 values `[rows, cols]` and f32 block scales
    /// `[rows, cols/32]` (cols must be a multiple of 32).
    pub fn q8_0(rows: usize, cols: usize, values: Storage, scales: Storage) -> Result<Matrix> {
        crate::q8::check_layout(
            "Matrix::q8_0",
            values.bytes().len(),
            scales.bytes().len() / 4,
            rows,
            cols,
        )?;
        if !scales.bytes().len().is_multiple_of(4) {
            return Err(Error::Shape {
                op: "Matrix::q8_0",
                detail: "scales are not whole f32 values".into(),
            });
        }
        Ok(Matrix {
            rows,
            cols,
            dtype: DType::Q8_0,
            weights: Weights::Rows {
                data: values,
                scales: Some(scales),
            },
            activations: Activations::F32,
        })
    }

    /// This matrix with quantized products run in mode `activations` (see
    /// the [module docs](self)); f32, bf16 and f16 matrices ignore it. An
    /// MXFP4 matrix set to [`Activations::Int8`] is repacked into panels here
    /// (once: a clone shares them) and its row layout released; set back to
    /// [`Activations::F32`], it unpacks the panels into an owned row layout.
    pub fn with_activations(self, activations: Activations) -> Matrix {
        let Matrix {
            rows,
            cols,
            dtype,
            weights,
            ..
        } = self;
        let weights = match (dtype, activations, weights) {
            (DType::Mxfp4, Activations::Int8, Weights::Rows { data, scales }) => {
                let scales = scales.expect("MXFP4 matrices are built with scales");
                let p = Panels::pack(data.bytes(), scales.bytes(), rows, cols)
                    .expect("MXFP4 layout checked at construction");
                data.release();
                scales.release();
                Weights::Panels(Arc::new(p))
            }
            (DType::Q8_0, Activations::Int8, Weights::Rows { data, scales })
                if Q8PanelKernel::Avx512Vnni.supported() =>
            {
                let scales = scales.expect("Q8_0 matrices are built with scales");
                let p = Q8Panels::pack(as_i8(data.bytes()), scales.as_f32(), rows, cols)
                    .expect("Q8_0 layout checked at construction");
                data.release();
                scales.release();
                Weights::Q8Panels(Arc::new(p))
            }
            (_, Activations::F32, Weights::Q8Panels(p)) => {
                let (values, scales) = q8_row_bytes(&p);
                Weights::Rows {
                    data: Storage::from_bytes(&values),
                    scales: Some(Storage::from_bytes(&scales)),
                }
            }
            (_, Activations::F32, Weights::Panels(p)) => {
                let (blocks, scales) = p.unpack();
                Weights::Rows {
                    data: Storage::from_bytes(&blocks),
                    scales: Some(Storage::from_bytes(&scales)),
                }
            }
            (_, _, w) => w,
        };
        Matrix {
            rows,
            cols,
            dtype,
            weights,
            activations,
        }
    }

    /// How quantized products treat activations (see [`Matrix::with_activations`]).
    pub fn activations(&self) -> Activations {
        self.activations
    }

    /// The panel layout an MXFP4 matrix with [`Activations::Int8`] holds
    /// (instead of the row layout).
    pub fn panels(&self) -> Option<&Panels> {
        match &self.weights {
            Weights::Panels(p) => Some(p),
            Weights::Rows { .. } | Weights::Q8Panels(_) => None,
        }
    }

    /// The panel layout a Q8_0 matrix with [`Activations::Int8`] holds on a
    /// CPU with AVX-512 VNNI (instead of the row layout).
    pub fn q8_panels(&self) -> Option<&Q8Panels> {
        match &self.weights {
            Weights::Q8Panels(p) => Some(p),
            _ => None,
        }
    }

    /// The stored row-major values (MXFP4: blocks `[rows, cols/32, 16]`,
    /// Q8_0: int8 `[rows, cols]`); `None` when the matrix holds
    /// [`Matrix::panels`] instead (see [`Matrix::row_bytes`]).
    pub fn data(&self) -> Option<&Storage> {
        match &self.weights {
            Weights::Rows { data, .. } => Some(data),
            Weights::Panels(_) | Weights::Q8Panels(_) => None,
        }
    }

    /// The stored block scales `[rows, cols/32]` (E8M0 bytes for MXFP4, f32
    /// for Q8_0); `None` for float dtypes and for a matrix holding panels.
    pub fn scales(&self) -> Option<&Storage> {
        match &self.weights {
            Weights::Rows { scales, .. } => scales.as_ref(),
            Weights::Panels(_) | Weights::Q8Panels(_) => None,
        }
    }

    /// The weights in row layout, `(values, scales)` as [`Matrix::data`] and
    /// [`Matrix::scales`] describe them: borrowed when the matrix holds that
    /// layout, unpacked from the panels (a copy, exact) when it does not.
    pub fn row_bytes(&self) -> (Cow<'_, [u8]>, Option<Cow<'_, [u8]>>) {
        match &self.weights {
            Weights::Rows { data, scales } => (
                Cow::Borrowed(data.bytes()),
                scales.as_ref().map(|s| Cow::Borrowed(s.bytes())),
            ),
            Weights::Panels(p) => {
                let (blocks, scales) = p.unpack();
                (Cow::Owned(blocks), Some(Cow::Owned(scales)))
            }
            Weights::Q8Panels(p) => {
                let (values, scales) = q8_row_bytes(p);
                (Cow::Owned(values), Some(Cow::Owned(scales)))
            }
        }
    }

    /// The lengths of [`Matrix::row_bytes`] (values, scales; 0 without
    /// scales), without unpacking anything.
    pub fn row_bytes_len(&self) -> (usize, usize) {
        match &self.weights {
            Weights::Rows { data, scales } => (
                data.bytes().len(),
                scales.as_ref().map(|s| s.bytes().len()).unwrap_or(0),
            ),
            Weights::Panels(p) => {
                let blocks = p.rows() * (p.cols() / crate::mxfp4::BLOCK_ELEMS);
                (blocks * crate::mxfp4::BLOCK_BYTES, blocks)
            }
            Weights::Q8Panels(p) => (
                p.rows() * p.cols(),
                p.rows() * p.cols() / crate::q8::BLOCK * 4,
            ),
        }
    }

    /// This matrix re-encoded as Q8_0 (the way llama.cpp stores output layers
    /// of 4-bit models), keeping its [`Activations`] mode. A Q8_0 matrix is
    /// returned unchanged.
    pub fn to_q8_0(&self) -> Result<Matrix> {
        if self.dtype == DType::Q8_0 {
            return Ok(self.clone());
        }
        let (q, d) = crate::q8::quantize(&self.to_f32_vec(), self.rows, self.cols)?;
        let bytes: Vec<u8> = q.iter().map(|&v| v as u8).collect();
        Ok(Matrix::q8_0(
            self.rows,
            self.cols,
            Storage::from_bytes(&bytes),
            Storage::from_f32(&d),
        )?
        .with_activations(self.activations))
    }

    /// Quantises an f32 matrix to MXFP4.
    pub fn quantize_mxfp4(rows: usize, cols: usize, values: &[f32]) -> Result<Matrix> {
        let (blocks, scales) = crate::mxfp4::quantize(values, rows, cols)?;
        Matrix::mxfp4(
            rows,
            cols,
            Storage::from_bytes(&blocks),
            Storage::from_bytes(&scales),
        )
    }

    /// The row-layout values (every matrix but one holding panels).
    fn row_data(&self) -> &Storage {
        self.data()
            .expect("matrices holding panels are matched first")
    }

    fn q8_values(&self) -> &[i8] {
        as_i8(self.row_data().bytes())
    }

    fn q8_scales(&self) -> &[f32] {
        self.scales()
            .expect("Q8_0 matrices are built with scales")
            .as_f32()
    }

    fn mx_scales(&self) -> &[u8] {
        self.scales()
            .expect("row-layout MXFP4 matrices are built with scales")
            .bytes()
    }

    /// An f32 matrix that owns a copy of `values`.
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Matrix {
        Matrix::new(rows, cols, DType::F32, Storage::from_f32(values))
            .expect("caller passes rows*cols values")
    }

    /// A bf16 matrix that owns a copy of `bits`.
    pub fn from_bf16(rows: usize, cols: usize, bits: &[u16]) -> Matrix {
        Matrix::new(rows, cols, DType::BF16, Storage::from_u16(bits))
            .expect("caller passes rows*cols values")
    }

    /// `out[n, rows] = x[n, cols] · selfᵀ`, where `n = x.len() / cols`; MXFP4
    /// and Q8_0 matrices run the kernel of their [`Matrix::activations`] mode.
    pub fn matmul(&self, x: &[f32], out: &mut [f32]) {
        let n = x.len() / self.cols;
        assert_eq!(
            x.len(),
            n * self.cols,
            "matmul: input is not a whole number of rows"
        );
        assert_eq!(
            out.len(),
            n * self.rows,
            "matmul: output has the wrong size"
        );
        match &self.weights {
            Weights::Panels(p) => return p.matmul(x, n, out),
            Weights::Q8Panels(p) => return p.matmul(x, n, out),
            Weights::Rows { .. } => {}
        }
        let data = self.row_data();
        match self.dtype {
            DType::F32 => crate::gemm::matmul_f32(x, n, data.as_f32(), self.rows, self.cols, out),
            DType::BF16 => crate::gemm::matmul_bf16(x, n, data.as_u16(), self.rows, self.cols, out),
            DType::F16 => crate::gemm::matmul_f16(x, n, data.as_u16(), self.rows, self.cols, out),
            DType::Mxfp4 => {
                let f = match self.activations {
                    Activations::F32 => crate::mxfp4::matmul_mxfp4,
                    Activations::Int8 => crate::mxfp4::matmul_mxfp4_q8,
                };
                f(
                    x,
                    n,
                    data.bytes(),
                    self.mx_scales(),
                    self.rows,
                    self.cols,
                    out,
                )
            }
            DType::Q8_0 => crate::q8::matmul_q8_0(
                x,
                n,
                self.q8_values(),
                self.q8_scales(),
                self.rows,
                self.cols,
                out,
                self.activations,
            ),
        }
    }

    /// `outs[m] = x · mats[m]ᵀ` for every matrix of a group that reads the
    /// same input (a layer's q, k and v, or gate and up), each output
    /// exactly what [`Matrix::matmul`] gives. When all hold MXFP4 panels of
    /// one width they run as one grouped product ([`Panels::matmul_group`]:
    /// the input rounded once, one fork and join); otherwise one call each.
    ///
    /// # Panics
    /// As [`Matrix::matmul`] for any member.
    pub fn matmul_group(mats: &[&Matrix], x: &[f32], outs: &mut [&mut [f32]]) {
        assert_eq!(
            mats.len(),
            outs.len(),
            "matmul_group: one output per matrix"
        );
        let panels: Option<Vec<&Panels>> = mats.iter().map(|m| m.panels()).collect();
        match panels {
            Some(p) if !p.is_empty() && mats.iter().all(|m| m.cols == mats[0].cols) => {
                // A partial last row fails Panels::matmul_group's shape check.
                Panels::matmul_group(&p, x, x.len() / mats[0].cols.max(1), outs)
            }
            _ => {
                for (m, o) in mats.iter().zip(outs.iter_mut()) {
                    m.matmul(x, o);
                }
            }
        }
    }

    /// Allocating form of [`Matrix::matmul_group`]. Panel products write
    /// into fresh buffers without zeroing them first.
    pub fn forward_group<const N: usize>(mats: [&Matrix; N], x: &[f32]) -> [Vec<f32>; N] {
        let n = mats.first().map_or(0, |m| x.len() / m.cols.max(1));
        let panels: Option<Vec<&Panels>> = mats.iter().map(|m| m.panels()).collect();
        let whole = mats
            .iter()
            .all(|m| m.cols == mats[0].cols && x.len() == n * m.cols);
        let mut outs: [Vec<f32>; N] = std::array::from_fn(|i| Vec::with_capacity(n * mats[i].rows));
        match panels {
            Some(p) if whole => {
                let mut refs: Vec<&mut [MaybeUninit<f32>]> = outs
                    .iter_mut()
                    .zip(&mats)
                    .map(|(o, m)| &mut o.spare_capacity_mut()[..n * m.rows])
                    .collect();
                Panels::matmul_group_uninit(&p, x, n, &mut refs);
                for (o, m) in outs.iter_mut().zip(&mats) {
                    // SAFETY: the grouped product wrote each of the n × rows
                    // outputs (Panels::matmul_group_uninit).
                    unsafe { o.set_len(n * m.rows) };
                }
            }
            _ => {
                for (o, m) in outs.iter_mut().zip(&mats) {
                    o.resize(n * m.rows, 0.0);
                }
                let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                Matrix::matmul_group(&mats, x, &mut refs);
            }
        }
        outs
    }

    /// Allocating form of [`Matrix::matmul`]. Panel products write into a
    /// fresh buffer without zeroing it first.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let n = x.len() / self.cols;
        let len = n * self.rows;
        let mut out = Vec::with_capacity(len);
        let o = &mut out.spare_capacity_mut()[..len];
        match &self.weights {
            Weights::Panels(p) if x.len() == n * self.cols => p.matmul_uninit(x, n, o),
            Weights::Q8Panels(p) if x.len() == n * self.cols => p.matmul_uninit(x, n, o),
            _ => {
                out.resize(len, 0.0);
                self.matmul(x, &mut out);
                return out;
            }
        }
        // SAFETY: the panel product wrote each of the n × rows outputs
        // (`matmul_uninit`).
        unsafe { out.set_len(len) };
        out
    }

    /// Row `r` widened to f32 (used for embedding lookups).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        assert_eq!(
            out.len(),
            self.cols,
            "row_f32: output length must equal cols"
        );
        match &self.weights {
            Weights::Panels(p) => return p.dequantize_row(r, out),
            Weights::Q8Panels(p) => return p.dequantize_row(r, out),
            Weights::Rows { .. } => {}
        }
        let range = r * self.cols..(r + 1) * self.cols;
        let data = self.row_data();
        match self.dtype {
            DType::F32 => out.copy_from_slice(&data.as_f32()[range]),
            DType::BF16 => {
                for (o, &b) in out.iter_mut().zip(&data.as_u16()[range]) {
                    *o = bf16_to_f32(b);
                }
            }
            DType::F16 => {
                for (o, &b) in out.iter_mut().zip(&data.as_u16()[range]) {
                    *o = half::f16::from_bits(b).to_f32();
                }
            }
            DType::Mxfp4 => {
                let nb = self.cols / crate::mxfp4::BLOCK_ELEMS;
                let blocks = &data.bytes()
                    [r * nb * crate::mxfp4::BLOCK_BYTES..(r + 1) * nb * crate::mxfp4::BLOCK_BYTES];
                let scales = &self.mx_scales()[r * nb..(r + 1) * nb];
                let vals = crate::mxfp4::dequantize(blocks, scales, 1, self.cols)
                    .expect("row layout checked at construction");
                out.copy_from_slice(&vals);
            }
            DType::Q8_0 => {
                let nb = self.cols / crate::q8::BLOCK;
                crate::q8::dequantize_into(
                    &self.q8_values()[range],
                    &self.q8_scales()[r * nb..(r + 1) * nb],
                    out,
                );
            }
        }
    }

    /// The whole matrix widened to f32 (for small weights and tests only).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for r in 0..self.rows {
            self.row_f32(r, &mut out[r * self.cols..(r + 1) * self.cols]);
        }
        out
    }

    /// Hints the first `bytes` of the weights (and of their block scales)
    /// into the caches, ahead of a product that will stream them.
    pub fn prefetch(&self, bytes: usize) {
        match &self.weights {
            Weights::Panels(p) => p.prefetch(bytes),
            Weights::Q8Panels(p) => p.prefetch(bytes),
            Weights::Rows { data, scales } => {
                crate::cpu::prefetch(data.bytes(), bytes);
                if let Some(s) = scales {
                    // The scales of the same leading rows (1 byte per 16 for
                    // MXFP4, 4 per 32 for Q8_0).
                    let share = bytes.min(data.len) * s.len / data.len.max(1);
                    crate::cpu::prefetch(s.bytes(), share);
                }
            }
        }
    }

    /// Bytes the weight holds: its row layout (blocks and scales for MXFP4),
    /// or for an int8 MXFP4 matrix its [`Panels::nbytes`], and nothing else.
    pub fn nbytes(&self) -> usize {
        match &self.weights {
            Weights::Rows { .. } => {
                let (data, scales) = self.row_bytes_len();
                data + scales
            }
            Weights::Panels(p) => p.nbytes(),
            Weights::Q8Panels(p) => p.nbytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mxfp4_matrix_matmul_equals_dense_matmul_of_its_decoded_values() {
        let (rows, cols) = (5, 64);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let q = Matrix::quantize_mxfp4(rows, cols, &w).unwrap();
        let dense = Matrix::from_f32(rows, cols, &q.to_f32_vec());
        let x: Vec<f32> = (0..2 * cols).map(|i| (i as f32 * 0.1).sin()).collect();
        let (a, b) = (q.forward(&x), dense.forward(&x));
        for (u, v) in a.iter().zip(&b) {
            assert!((u - v).abs() <= 1e-4 * (1.0 + v.abs()), "{u} vs {v}");
        }
        assert_eq!(q.nbytes(), rows * cols / 2 + rows * cols / 32);
    }

    #[test]
    fn q8_0_matrix_matmul_and_rows_equal_its_decoded_values() {
        let (rows, cols) = (6, 96);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 13.0)
            .collect();
        let q = Matrix::from_f32(rows, cols, &w).to_q8_0().unwrap();
        assert_eq!(q.dtype, DType::Q8_0);
        let decoded = q.to_f32_vec();
        // Q8_0 rounds each value to within half a step of its block (amax/254).
        for (a, b) in w.iter().zip(&decoded) {
            assert!((a - b).abs() <= 48.0 / 13.0 / 254.0 * 1.0001, "{a} vs {b}");
        }
        let dense = Matrix::from_f32(rows, cols, &decoded);
        let x: Vec<f32> = (0..3 * cols).map(|i| (i as f32 * 0.1).sin()).collect();
        // The default (f32 activations) is the decoded weights' product up to f32 rounding.
        let (a, b) = (q.forward(&x), dense.forward(&x));
        for (u, v) in a.iter().zip(&b) {
            assert!((u - v).abs() <= 1e-4 * (1.0 + v.abs()), "{u} vs {v}");
        }
        assert_eq!(q.nbytes(), rows * cols + rows * cols / 32 * 4);
    }

    /// `[rows, cols]` weights and `n` activation rows of deterministic values.
    fn weights_and_inputs(rows: usize, cols: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        let w = (0..rows * cols)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 13.0)
            .collect();
        let x = (0..n * cols)
            .map(|i| (i as f32 * 0.37).sin() * 2.0)
            .collect();
        (w, x)
    }

    #[test]
    fn each_quantized_matrix_runs_the_kernel_of_its_own_activation_mode() {
        let (rows, cols, n) = (7, 128, 3);
        let (w, x) = weights_and_inputs(rows, cols, n);
        let mx = Matrix::quantize_mxfp4(rows, cols, &w).unwrap();
        assert_eq!(mx.activations(), Activations::F32, "the default is f32");
        // Two matrices over the same blocks, one per mode, used side by side.
        let mx8 = mx.clone().with_activations(Activations::Int8);
        let (blocks, scales) = (mx.data().unwrap().bytes(), mx.mx_scales());
        let mut exact = vec![0.0; n * rows];
        crate::mxfp4::matmul_mxfp4(&x, n, blocks, scales, rows, cols, &mut exact);
        let mut int8 = vec![0.0; n * rows];
        let panels = Panels::pack(blocks, scales, rows, cols).unwrap();
        panels.matmul(&x, n, &mut int8);
        assert!(mx.panels().is_none(), "f32 activations read the row layout");
        assert_eq!(mx.forward(&x), exact, "MXFP4, f32 activations");
        assert_eq!(mx8.forward(&x), int8, "MXFP4, int8 activations: the panels");
        assert_eq!(mx8.panels().map(|p| p.unpack()), Some(panels.unpack()));
        let back = mx8.clone().with_activations(Activations::F32);
        assert!(back.panels().is_none(), "back to f32 unpacks the panels");
        assert_eq!(back.data().unwrap().bytes(), blocks);
        assert_eq!(back.mx_scales(), scales);
        assert_eq!(back.forward(&x), exact);

        let q8 = Matrix::from_f32(rows, cols, &w).to_q8_0().unwrap();
        assert_eq!(q8.activations(), Activations::F32, "the default is f32");
        let q88 = q8.clone().with_activations(Activations::Int8);
        let mut want = vec![0.0; n * rows];
        let (q, d) = (q8.q8_values(), q8.q8_scales());
        crate::q8::matmul_q8_0(&x, n, q, d, rows, cols, &mut want, Activations::F32);
        assert_eq!(q8.forward(&x), want, "Q8_0, f32 activations");
        if Q8PanelKernel::Avx512Vnni.supported() {
            // Int8 activations with VNNI: the panels, and no row layout kept.
            let p = crate::q8::panel::Q8Panels::pack(q, d, rows, cols).unwrap();
            p.matmul(&x, n, &mut want);
            assert_eq!(q88.q8_panels().map(|p| p.unpack()), Some(p.unpack()));
            assert!(q88.data().is_none() && q88.scales().is_none());
            assert_eq!(q88.row_bytes(), q8.row_bytes());
            assert_eq!(q88.row_bytes_len(), q8.row_bytes_len());
            assert_eq!(q88.nbytes(), p.nbytes());
            assert_eq!(q88.to_f32_vec(), q8.to_f32_vec());
            let back = q88.clone().with_activations(Activations::F32);
            assert_eq!(back.q8_values(), q);
            assert_eq!(back.q8_scales(), d);
            assert_eq!(back.forward(&x), q8.forward(&x));
        } else {
            // Without VNNI the int8 mode keeps the row layout and its f32 path.
            crate::q8::matmul_q8_0(&x, n, q, d, rows, cols, &mut want, Activations::Int8);
            assert!(q88.q8_panels().is_none());
        }
        assert_eq!(q88.forward(&x), want, "Q8_0, int8 activations");
        if crate::cpu::features().avx512_vnni {
            // With VNNI the int8 kernels run, and rounding shows in the outputs.
            assert_ne!(mx8.forward(&x), mx.forward(&x));
            assert_ne!(q88.forward(&x), q8.forward(&x));
        }
    }

    #[test]
    fn activation_mode_survives_re_encoding_and_dense_matrices_ignore_it() {
        let (rows, cols, n) = (4, 64, 2);
        let (w, x) = weights_and_inputs(rows, cols, n);
        let dense = Matrix::from_f32(rows, cols, &w);
        let dense8 = dense.clone().with_activations(Activations::Int8);
        assert_eq!(
            dense8.forward(&x),
            dense.forward(&x),
            "f32 ignores the mode"
        );
        let bits: Vec<u16> = w.iter().map(|&v| crate::dtype::f32_to_bf16(v)).collect();
        let bf = Matrix::from_bf16(rows, cols, &bits);
        let bf8 = bf.clone().with_activations(Activations::Int8);
        assert_eq!(bf8.forward(&x), bf.forward(&x), "bf16 ignores the mode");
        let q = dense8.to_q8_0().unwrap();
        assert_eq!(dense8.activations(), Activations::Int8);
        assert_eq!(q.activations(), Activations::Int8);
        assert_eq!(q.to_q8_0().unwrap().activations(), Activations::Int8);
    }

    /// A source that records the ranges it is told to release.
    struct Recording(Vec<u8>, std::sync::Mutex<Vec<Range<usize>>>);

    impl AsRef<[u8]> for Recording {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }

    impl SharedSource for Recording {
        fn release(&self, range: Range<usize>) {
            self.1.lock().unwrap().push(range);
        }
    }

    #[test]
    fn int8_mxfp4_matrix_holds_only_its_panels_and_reads_rows_from_them() {
        // 37 rows: two whole panels and a partial one; 96 columns: 3 blocks.
        let (rows, cols, n) = (37, 96, 5);
        let (w, x) = weights_and_inputs(rows, cols, n);
        let mx = Matrix::quantize_mxfp4(rows, cols, &w).unwrap();
        let (blocks, scales) = (mx.data().unwrap().bytes().to_vec(), mx.mx_scales().to_vec());
        // The row layout borrowed from a shared source (as from a memory map),
        // at an offset, between other bytes.
        let mut file = vec![0xAAu8; 8];
        file.extend_from_slice(&blocks);
        file.extend_from_slice(&scales);
        let src = Arc::new(Recording(file, Default::default()));
        let owner: SharedBytes = src.clone();
        let (b0, s0) = (8, 8 + blocks.len());
        let mapped = Matrix::mxfp4(
            rows,
            cols,
            Storage::borrowed(owner.clone(), b0, blocks.len(), 1),
            Storage::borrowed(owner, s0, scales.len(), 1),
        )
        .unwrap();
        let rows_f32 = mapped.to_f32_vec();
        let q8 = mapped.to_q8_0().unwrap();
        assert!(src.1.lock().unwrap().is_empty());

        let m8 = mapped.with_activations(Activations::Int8);
        let p = m8.panels().expect("int8 MXFP4 packs panels");
        assert!(
            m8.data().is_none() && m8.scales().is_none(),
            "no row layout kept"
        );
        assert_eq!(
            m8.nbytes(),
            p.nbytes(),
            "resident bytes are the panels' only"
        );
        // Panels of 16 rows: the row layout's bytes plus the last panel's
        // padding and one flag byte per panel.
        let panels = rows.div_ceil(16);
        assert_eq!(
            p.nbytes(),
            (panels * 16) * (cols / 2 + cols / 32) + panels,
            "panel bytes"
        );
        assert_eq!(
            *src.1.lock().unwrap(),
            vec![b0..b0 + blocks.len(), s0..s0 + scales.len()],
            "both borrowed ranges are released"
        );
        // Owners of the mapping: the test's handle only (the borrows are gone).
        assert_eq!(Arc::strong_count(&src), 1);

        // Rows, re-encoding and the row layout read from the panels are what
        // they were before packing, bit for bit.
        assert_eq!(m8.to_f32_vec(), rows_f32);
        let mut row = vec![0.0; cols];
        m8.row_f32(rows - 1, &mut row);
        assert_eq!(row, rows_f32[(rows - 1) * cols..]);
        let q8_after = m8.to_q8_0().unwrap();
        assert_eq!(q8_after.row_bytes(), q8.row_bytes());
        assert_eq!(q8_after.activations(), Activations::Int8);
        let (rb, rs) = m8.row_bytes();
        assert_eq!((&*rb, rs.as_deref()), (&blocks[..], Some(&scales[..])));
        assert_eq!(m8.row_bytes_len(), (blocks.len(), scales.len()));

        // Products: the panel GEMM; back in f32 mode, the exact kernel again.
        let mut want = vec![0.0; n * rows];
        Panels::pack(&blocks, &scales, rows, cols)
            .unwrap()
            .matmul(&x, n, &mut want);
        assert_eq!(m8.forward(&x), want);
        let f = m8.with_activations(Activations::F32);
        assert_eq!(f.row_bytes_len(), (blocks.len(), scales.len()));
        assert_eq!(f.nbytes(), blocks.len() + scales.len());
        let mut exact = vec![0.0; n * rows];
        crate::mxfp4::matmul_mxfp4(&x, n, &blocks, &scales, rows, cols, &mut exact);
        assert_eq!(f.forward(&x), exact);
    }
}
