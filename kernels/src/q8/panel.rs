//! # Q8_0 weights repacked into panels, and their int8-activation GEMM
//!
//! The row kernel of [`super::matmul_q8_0`] (int8 mode) keeps one weight row
//! per register, so every output needs its own f32 scale multiply per
//! 64-element step and a horizontal sum at the end: at a decode batch of 8
//! rows the output layer (SmolLM2: 49,152 × 576) is bound by those vector
//! operations, not by its 30 MB of weights. [`Q8Panels`] is the layout of the
//! MXFP4 panels ([`crate::mxfp4::panel`]) for int8 weights instead:
//!
//! - A panel holds [`PANEL_ROWS`] = 16 consecutive output rows. Per 32-element
//!   block it stores 9 lines of 64 bytes: in line `v < 8`, bytes `4r..4r + 4`
//!   hold elements `4v..4v + 4` of row `r` as `q + 128` (unsigned, the operand
//!   `vpdpbusd` wants; `|q| ≤ 127`, so 1..=255), and line 8 holds the 16 rows'
//!   f32 block scales. One stream per panel, codes and scales interleaved;
//!   the same 9 bits per weight as the row layout. A last, partial panel is
//!   padded with zero weights and scale 0.
//! - Activations are rounded per block as for every int8 product here
//!   (`d = amax/127`, `q = round(x/d)`), with `−128·Σq` per block, which takes
//!   back the +128 of the weights.
//! - The microkernel holds an `MR × 16` tile: per block, one int32 accumulator
//!   per activation row starts at `−128·Σq`, takes 8 `vpdpbusd` (four
//!   activation bytes broadcast against four elements of the 16 rows), and is
//!   added into the row's f32 accumulator as `f32(dot)·(d_w·d_x)`: 11 vector
//!   operations per 16 outputs per block, against 32 in the row kernel.
//!
//! Built where the CPU has AVX-512 VNNI (where it does not, the int8 mode of
//! [`super::matmul_q8_0`] runs its f32 path, and a Q8_0 matrix keeps its row
//! layout); with AMX-INT8 ([`crate::amx`]) tiles of 6 rows or more run on
//! the tile unit, the 8 code lines of a block loaded in place as its `b`
//! tile. The portable tile does the same integer sums and f32 operations
//! per output, so the two builds agree bit for bit; both equal the exact
//! product of the decoded weights and the rounded activations up to f32
//! rounding of the per-block terms (see the tests).

use std::mem::MaybeUninit;

use crate::error::Result;
use crate::int8_rows::{
    as_uninit, product_ready, with_rounded, Line, QuantRows, Scheme, MIN_TASK_MACS,
};
use crate::split::{for_row_ranges, OutPtr};

use super::{check_layout, BLOCK};

/// Output rows per panel: one 512-bit register of int32 lanes.
pub const PANEL_ROWS: usize = 16;

/// Lines per panel block: 8 of codes, 1 of scales.
const LINES: usize = 9;

/// Activation rows per AVX-512 tile (8 int32 and 8 f32 accumulators).
const MR: usize = 8;

/// Activation rows per AMX tile: a tile register's 16 rows.
const MR_AMX: usize = 16;

/// Below this many rows the VNNI tile runs instead of the AMX one (see
/// [`crate::mxfp4::panel`]).
const AMX_MIN_ROWS: usize = 6;

/// A Q8_0 `[rows, cols]` matrix in panel layout (see the [module docs](self)).
#[derive(Clone)]
pub struct Q8Panels {
    /// Output features.
    rows: usize,
    /// Input features (a multiple of 32).
    cols: usize,
    /// Blocks per row.
    nb: usize,
    /// `[panels, nb, 9]` lines.
    lines: Vec<Line>,
}

impl std::fmt::Debug for Q8Panels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Q8Panels([{}, {}])", self.rows, self.cols)
    }
}

/// The builds of the panel kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Q8PanelKernel {
    /// AMX-INT8 tiles of [`AMX_MIN_ROWS`] rows or more, the AVX-512 VNNI
    /// tile below that ([`crate::amx`]).
    Amx,
    /// AVX-512 F, BW and VNNI.
    Avx512Vnni,
    /// Portable Rust.
    Portable,
}

impl Q8PanelKernel {
    /// Whether this CPU runs `self`.
    pub fn supported(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Q8PanelKernel::Avx512Vnni => {
                crate::cpu::features().avx512_vnni && std::is_x86_feature_detected!("avx512vl")
            }
            #[cfg(target_arch = "x86_64")]
            Q8PanelKernel::Amx => Q8PanelKernel::Avx512Vnni.supported() && crate::amx::available(),
            #[cfg(not(target_arch = "x86_64"))]
            Q8PanelKernel::Avx512Vnni | Q8PanelKernel::Amx => false,
            Q8PanelKernel::Portable => true,
        }
    }

    /// The widest build this CPU runs.
    pub fn best() -> Q8PanelKernel {
        if Q8PanelKernel::Amx.supported() {
            Q8PanelKernel::Amx
        } else if Q8PanelKernel::Avx512Vnni.supported() {
            Q8PanelKernel::Avx512Vnni
        } else {
            Q8PanelKernel::Portable
        }
    }
}

impl Q8Panels {
    /// Repacks a row-layout Q8_0 matrix (int8 `q [rows, cols]`, f32 `d
    /// [rows, cols/32]`).
    pub fn pack(q: &[i8], d: &[f32], rows: usize, cols: usize) -> Result<Q8Panels> {
        check_layout("Q8Panels::pack", q.len(), d.len(), rows, cols)?;
        let nb = cols / BLOCK;
        let np = rows.div_ceil(PANEL_ROWS);
        let mut lines = vec![Line([0; 64]); np * nb * LINES];
        for p in 0..np {
            for b in 0..nb {
                let blk = &mut lines[(p * nb + b) * LINES..(p * nb + b + 1) * LINES];
                for r in 0..PANEL_ROWS {
                    let row = p * PANEL_ROWS + r;
                    let (vals, s) = if row < rows {
                        (
                            &q[row * cols + b * BLOCK..row * cols + (b + 1) * BLOCK],
                            d[row * nb + b],
                        )
                    } else {
                        (&[0i8; BLOCK][..], 0.0)
                    };
                    for (e, &v) in vals.iter().enumerate() {
                        blk[e / 4].0[4 * r + e % 4] = (v as i32 + 128) as u8;
                    }
                    blk[8].0[4 * r..4 * r + 4].copy_from_slice(&s.to_le_bytes());
                }
            }
        }
        Ok(Q8Panels {
            rows,
            cols,
            nb,
            lines,
        })
    }

    /// Row `row` in the row layout: `cols` int8 values into `q` and `cols/32`
    /// scales into `d`, exactly as packed.
    ///
    /// # Panics
    /// If `row ≥ rows` or the buffers are not `cols` and `cols/32` long.
    pub fn row_into(&self, row: usize, q: &mut [i8], d: &mut [f32]) {
        assert!(
            row < self.rows,
            "Q8Panels::row_into: row {row} of {}",
            self.rows
        );
        assert_eq!(q.len(), self.cols, "Q8Panels::row_into: values");
        assert_eq!(d.len(), self.nb, "Q8Panels::row_into: scales");
        for (b, (qb, db)) in q.chunks_exact_mut(BLOCK).zip(d.iter_mut()).enumerate() {
            let (vals, s) = self.row_block(row, b);
            for (v, x) in qb.iter_mut().zip(vals) {
                *v = x;
            }
            *db = s;
        }
    }

    /// Block `b` of row `row`: its 32 int8 values and its scale.
    fn row_block(&self, row: usize, b: usize) -> (impl Iterator<Item = i8> + '_, f32) {
        let (p, r) = (row / PANEL_ROWS, row % PANEL_ROWS);
        let blk = &self.lines[(p * self.nb + b) * LINES..(p * self.nb + b + 1) * LINES];
        let s = f32::from_le_bytes(blk[8].0[4 * r..4 * r + 4].try_into().expect("four bytes"));
        let vals = (0..BLOCK).map(move |e| (blk[e / 4].0[4 * r + e % 4] as i32 - 128) as i8);
        (vals, s)
    }

    /// The row layout back (`(q, d)`), exactly as packed.
    pub fn unpack(&self) -> (Vec<i8>, Vec<f32>) {
        let mut q = vec![0i8; self.rows * self.cols];
        let mut d = vec![0.0f32; self.rows * self.nb];
        for row in 0..self.rows {
            self.row_into(
                row,
                &mut q[row * self.cols..(row + 1) * self.cols],
                &mut d[row * self.nb..(row + 1) * self.nb],
            );
        }
        (q, d)
    }

    /// Row `row` decoded to f32, bit for bit what [`super::dequantize_into`]
    /// gives for it from the row layout.
    ///
    /// # Panics
    /// If `row ≥ rows` or `out` is not `cols` values.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(
            row < self.rows,
            "Q8Panels::dequantize_row: row {row} of {}",
            self.rows
        );
        assert_eq!(out.len(), self.cols, "Q8Panels::dequantize_row: out");
        for (b, ob) in out.chunks_exact_mut(BLOCK).enumerate() {
            let (q, s) = self.row_block(row, b);
            for (o, v) in ob.iter_mut().zip(q) {
                *o = v as f32 * s;
            }
        }
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held (codes and scales, the last panel's padding included).
    pub fn nbytes(&self) -> usize {
        self.lines.len() * 64
    }

    /// Hints the first `bytes` of the panels into the caches.
    pub fn prefetch(&self, bytes: usize) {
        crate::cpu::prefetch(self.bytes(), bytes);
    }

    /// All lines as bytes.
    fn bytes(&self) -> &[u8] {
        // SAFETY: Line is 64 plain bytes with no padding.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.lines.len() * 64) }
    }

    /// `out[n, rows] = x[n, cols] · Wᵀ` with int8 activations, on the widest
    /// kernel this CPU runs.
    ///
    /// # Panics
    /// If `x` is not `n × cols` or `out` not `n × rows` values.
    pub fn matmul(&self, x: &[f32], n: usize, out: &mut [f32]) {
        self.matmul_with(Q8PanelKernel::best(), x, n, out)
    }

    /// [`Q8Panels::matmul`] on a chosen kernel.
    ///
    /// # Panics
    /// As [`Q8Panels::matmul`], and if `kernel` is not supported here.
    pub fn matmul_with(&self, kernel: Q8PanelKernel, x: &[f32], n: usize, out: &mut [f32]) {
        let out = as_uninit(out);
        if let Some(o) = product_ready("Q8Panels::matmul", x, n, out, self.rows, self.cols) {
            self.product(kernel, x, n, o);
        }
    }

    /// [`Q8Panels::matmul`] into outputs not yet written (each is written
    /// once, so a fresh buffer needs no zeroing).
    ///
    /// # Panics
    /// As [`Q8Panels::matmul`].
    pub fn matmul_uninit(&self, x: &[f32], n: usize, out: &mut [MaybeUninit<f32>]) {
        if let Some(o) = product_ready("Q8Panels::matmul", x, n, out, self.rows, self.cols) {
            self.product(Q8PanelKernel::best(), x, n, o);
        }
    }

    /// The product into `out` (`n × rows` values, `n`, `rows` and `cols`
    /// not 0), every output written once.
    fn product(&self, kernel: Q8PanelKernel, x: &[f32], n: usize, outp: OutPtr) {
        assert!(
            kernel.supported(),
            "Q8Panels::matmul: {kernel:?} is not supported here"
        );
        let avx512 = kernel != Q8PanelKernel::Portable;
        let mr = match kernel {
            Q8PanelKernel::Amx if n >= AMX_MIN_ROWS => MR_AMX,
            _ => MR,
        };
        with_rounded(Scheme::Q8_0, avx512, x, n, self.cols, |q| {
            let np = self.rows.div_ceil(PANEL_ROWS);
            for_row_ranges(np, PANEL_ROWS * self.cols * n, MIN_TASK_MACS, |p0, p1| {
                for p in p0..p1 {
                    let mut i = 0;
                    while i < n {
                        let m = (n - i).min(mr);
                        // SAFETY: rows i..i+m and the panel's columns are inside
                        // out and belong to this task only; the AVX-512 tile runs
                        // only where supported (asserted above).
                        unsafe { self.tile(kernel, p, q, i, m, outp) };
                        i += m;
                    }
                }
            });
        });
    }

    /// Activation rows `i0..i0 + m` against panel `p`.
    ///
    /// # Safety
    /// As in [`Q8Panels::matmul_with`].
    unsafe fn tile(
        &self,
        kernel: Q8PanelKernel,
        p: usize,
        q: &QuantRows,
        i0: usize,
        m: usize,
        out: OutPtr,
    ) {
        let (nb, cols) = (self.nb, self.cols);
        let t = Tile {
            lines: &self.bytes()[p * nb * LINES * 64..(p + 1) * nb * LINES * 64],
            nb,
            xq: &q.q[i0 * cols..(i0 + m) * cols],
            xd: &q.d[i0 * nb..(i0 + m) * nb],
            xc: &q.c[i0 * nb..(i0 + m) * nb],
            stride: self.rows,
            valid: (self.rows - p * PANEL_ROWS).min(PANEL_ROWS),
        };
        // SAFETY: the caller's contract.
        let out = unsafe { out.get().add(i0 * self.rows + p * PANEL_ROWS) };
        match kernel {
            #[cfg(target_arch = "x86_64")]
            Q8PanelKernel::Amx if m >= AMX_MIN_ROWS => unsafe {
                macro_rules! by_rows {
                    ($($mr:literal)*) => {
                        match (m, i0 == 0) {
                            $(($mr, true) => amx::tile_amx::<$mr, true>(&t, out),
                              ($mr, false) => amx::tile_amx::<$mr, false>(&t, out),)*
                            _ => unreachable!("AMX tiles are {AMX_MIN_ROWS}..={MR_AMX} rows"),
                        }
                    };
                }
                by_rows!(16 15 14 13 12 11 10 9 8 7 6)
            },
            #[cfg(target_arch = "x86_64")]
            Q8PanelKernel::Avx512Vnni | Q8PanelKernel::Amx => unsafe {
                macro_rules! by_rows {
                    ($($mr:literal)*) => {
                        match (m, i0 == 0) {
                            $(($mr, true) => x86::tile::<$mr, true>(&t, out),
                              ($mr, false) => x86::tile::<$mr, false>(&t, out),)*
                            (_, true) => x86::tile::<1, true>(&t, out),
                            (_, false) => x86::tile::<1, false>(&t, out),
                        }
                    };
                }
                by_rows!(8 7 6 5 4 3 2)
            },
            _ => unsafe { t.portable(m, out) },
        }
    }
}

/// One panel against one tile of activation rows.
struct Tile<'a> {
    /// The panel's bytes, `[nb, 9 lines]`.
    lines: &'a [u8],
    /// Blocks per row.
    nb: usize,
    /// The tile's rounded activations `[m, cols]` (i8 bits).
    xq: &'a [u8],
    /// Their block scales `[m, nb]`.
    xd: &'a [f32],
    /// Their `−128·Σq` per block `[m, nb]`.
    xc: &'a [i32],
    /// Row stride of the output.
    stride: usize,
    /// Columns of the panel that exist.
    valid: usize,
}

impl Tile<'_> {
    /// The portable tile: the integer sums and f32 operations of the SIMD
    /// tile, one output at a time.
    ///
    /// # Safety
    /// `out` points at row 0, column 0 of the tile inside the output.
    unsafe fn portable(&self, m: usize, out: *mut f32) {
        let cols = self.nb * BLOCK;
        for i in 0..m {
            for r in 0..self.valid {
                let mut acc = 0.0f32;
                for b in 0..self.nb {
                    let blk = &self.lines[b * LINES * 64..(b + 1) * LINES * 64];
                    let xq = &self.xq[i * cols + b * BLOCK..i * cols + (b + 1) * BLOCK];
                    let mut dot = self.xc[i * self.nb + b];
                    for (e, &x) in xq.iter().enumerate() {
                        dot += blk[(e / 4) * 64 + 4 * r + e % 4] as i32 * x as i8 as i32;
                    }
                    let s = &blk[8 * 64 + 4 * r..8 * 64 + 4 * r + 4];
                    let ws = f32::from_le_bytes(s.try_into().expect("four bytes"));
                    acc = (dot as f32).mul_add(ws * self.xd[i * self.nb + b], acc);
                }
                // SAFETY: (i, r) is inside the tile (caller's contract).
                unsafe { *out.add(i * self.stride + r) = acc };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[path = "panel_amx.rs"]
mod amx;

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The AVX-512 VNNI tile. Callers check CPU features and sizes.
    use std::arch::x86_64::*;

    use super::{Tile, BLOCK, LINES};
    use crate::int8_rows::x86::{scale_add, store_rows};

    /// How far ahead the panel's first row tile hints its lines: one
    /// matrix's panels are contiguous, so this runs into the next panel.
    pub(super) const PREFETCH_BYTES: usize = 8 * 1024;

    /// The `MR × 16` tile: per block, `MR` int32 accumulators start at
    /// `−128·Σq` and take 8 `vpdpbusd` each, then
    /// `acc_f32 += f32(dot)·(d_w·d_x)`. With `PREFETCH` (the panel's first
    /// row tile) it also hints the lines [`PREFETCH_BYTES`] ahead.
    ///
    /// # Safety
    /// AVX-512 F/BW/VNNI present; `t` holds `MR` activation rows; `out`
    /// points at the tile's first output.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn tile<const MR: usize, const PREFETCH: bool>(t: &Tile<'_>, out: *mut f32) {
        let nb = t.nb;
        let cols = nb * BLOCK;
        debug_assert!(t.xq.len() == MR * cols && t.xd.len() == MR * nb);
        let (lines, xq, xd, xc) = (
            t.lines.as_ptr(),
            t.xq.as_ptr(),
            t.xd.as_ptr(),
            t.xc.as_ptr(),
        );
        // SAFETY (whole body): offsets stay inside the panel's nb·9 lines and
        // the tile's MR activation rows.
        unsafe {
            let mut facc = [_mm512_setzero_ps(); MR];
            for b in 0..nb {
                let blk = lines.add(b * LINES * 64);
                let mut acc: [__m512i; MR] =
                    std::array::from_fn(|i| _mm512_set1_epi32(*xc.add(i * nb + b)));
                for v in 0..8 {
                    if PREFETCH {
                        // A hint: never faults, whatever the address.
                        _mm_prefetch::<_MM_HINT_T0>(
                            blk.wrapping_add(PREFETCH_BYTES + 64 * v).cast(),
                        );
                    }
                    let w = _mm512_load_si512(blk.add(64 * v).cast());
                    for (i, a) in acc.iter_mut().enumerate() {
                        let xr = xq.add(i * cols + b * BLOCK + 4 * v);
                        *a = _mm512_dpbusd_epi32(
                            *a,
                            w,
                            _mm512_set1_epi32(xr.cast::<i32>().read_unaligned()),
                        );
                    }
                }
                if PREFETCH {
                    _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH_BYTES + 512).cast());
                }
                let ws = _mm512_load_ps(blk.add(512).cast());
                scale_add(&mut facc, &acc, ws, xd, nb, b);
            }
            store_rows(&facc, out, t.stride, t.valid);
        }
    }
}

#[cfg(test)]
#[path = "panel_tests.rs"]
mod tests;
