//! # MXFP4 weights repacked into panels, and their int8-activation GEMM
//!
//! [`super::matmul_mxfp4_q8`] reads the checkpoint's row layout and multiplies
//! two weight rows by four activation rows per step: fine for decode, but at
//! prefill every weight byte is unpacked once per four tokens and every
//! activation block once per two weight rows, so the unpacking, not the
//! integer dot products, bounds it. [`Panels`] is the layout a GEMM
//! microkernel wants instead, built once when a matrix is loaded:
//!
//! - A panel holds [`PANEL_ROWS`] = 16 consecutive output rows. Per 32-element
//!   block it stores 4 lines of 64 bytes; byte `4r + j` of line `v` holds, in
//!   its low nibble, the code of element `4v + j` of row `r` and, in its high
//!   nibble, element `16 + 4v + j`. One 64-byte load and a `vpermb` lookup
//!   therefore give the doubled E2M1 values (plus 12, unsigned) of four
//!   consecutive elements for all 16 rows: the unsigned operand of
//!   `vpdpbusd`, whose signed operand is four activation bytes broadcast to
//!   every lane. The E8M0 scales of the 16 rows of a block follow as 16 bytes.
//!   A last, partial panel is padded with zero codes and scale 2⁰.
//!   The panels take as many bytes as the row layout (4.25 bits per weight,
//!   plus the padding of the last panel and a flag byte per panel) and
//!   replace it: [`Panels::row_into`], [`Panels::dequantize_row`] and
//!   [`Panels::unpack`] give the row layout back, exactly, where it is needed.
//! - Activations are rounded to int8 per 32-element block once per call
//!   (llama.cpp's Q8 scheme: `d = amax/127`, `q = round(x/d)`), kept in their
//!   natural order, with `d/2` (the weights are doubled) and `−12·Σq` (which
//!   takes back the +12 offset of the weights) per block.
//! - The microkernel holds an `MR × 16` tile: per block, one int32
//!   accumulator per activation row starts at `−12·Σq`, takes 8 `vpdpbusd`,
//!   is converted to f32 and added into the row's f32 accumulator times
//!   `scale(w) · d/2`. Panels are split over the rayon pool; each task runs
//!   all activation rows against its panels, which stay in L1/L2 while the
//!   rows stream past.
//!
//! Kernels ([`PanelKernel`]): AMX-INT8 tiles for decode batches of
//! [`AMX_MIN_ROWS`]..=16 rows ([`crate::amx`]: a panel block is one `b` tile
//! once looked up, the activation rows the `a` tile in place), AVX-512
//! F/BW/VNNI/VBMI, AVX2 (`vpmaddubsw` + `vpmaddwd`, exact since
//! `24·127·2 < 2¹⁵`) and portable Rust. All of them do the same integer sums
//! and the same f32 operations per output, so their results are
//! bit-identical; the error against the exact product is the bound stated on
//! [`super::matmul_mxfp4_q8`].

use std::mem::MaybeUninit;

use super::{check_layout, BLOCK_BYTES, BLOCK_ELEMS, E2M1_X2_U8, E8M0_TABLE, ZERO_BLOCK_SCALE};
use crate::error::Result;
use crate::int8_rows::{
    as_uninit, product_ready, with_rounded, Line, QuantRows, Scheme, MIN_TASK_MACS,
};

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;
use crate::split::{for_row_ranges, OutPtr};

/// Output rows per panel: one 512-bit register of int32 lanes.
pub const PANEL_ROWS: usize = 16;

/// Packed code bytes of one panel block (16 rows × 16 bytes).
const PANEL_BLOCK_BYTES: usize = PANEL_ROWS * BLOCK_BYTES;

/// Activation rows per AVX-512 tile: 8 int32 and 8 f32 accumulators plus
/// the weights fit the 32 registers. A sweep of 4–12 on the (shared, 2-core)
/// Sapphire Rapids host at 512 rows (`mxfp4_prefill -- sweep`) put 8 at or
/// near the top on every SmolLM2 shape; 12 lost up to 2× at 2 threads.
const MR_AVX512: usize = 8;

/// Activation rows per AMX tile: a tile register's 16 rows.
const MR_AMX: usize = 16;

/// AMX runs a product of `AMX_MIN_ROWS..=MR_AMX` rows (a decode batch) as
/// one tile per panel; other row counts run the VNNI tiles. Below this many
/// rows an AMX tile spends more on storing and reloading its int32 results
/// than it saves on the products. Above 16 (prefill) the kernel alone is
/// 1.0–1.3× VNNI, but end to end the 8 × 128-token prefill of `caracal bench`
/// took 581–606 ms against 504–535 with VNNI (three interleaved pairs), so
/// prefill stays on VNNI
/// (`mxfp4_prefill`, SmolLM2's shapes, 1 and 2 threads: AMX 0.7–1.2× VNNI at
/// 4–5 rows in a first build; this one 1.06–1.53× at 6 rows, 1.28–1.96× at
/// 8, 1.2–1.6× at 16, 1.0–1.24× at 512).
const AMX_MIN_ROWS: usize = 6;

/// The tallest tile [`Panels::matmul_tiled`] runs (the VNNI tile's
/// accumulators then fill the registers).
pub const MAX_TILE_ROWS: usize = 12;

/// Activation rows per AVX2 tile (16 ymm registers: 4 int32 and 4 f32
/// accumulators, two weight halves, constants).
const MR_AVX2: usize = 2;

/// An MXFP4 `[rows, cols]` matrix in panel layout (see the [module docs](self)).
#[derive(Clone)]
pub struct Panels {
    /// Output features.
    rows: usize,
    /// Input features (a multiple of 32).
    cols: usize,
    /// Blocks per row (`cols / 32`).
    nb: usize,
    /// Codes, `[panels, nb, 4 lines]`.
    codes: Vec<Line>,
    /// E8M0 scales, `[panels, nb, 16]`.
    scales: Vec<u8>,
    /// Per panel: whether a scale byte is 0 or 255, which do not decode as
    /// `e << 23` (the kernels then take the exact path for that panel).
    special: Vec<bool>,
}

impl std::fmt::Debug for Panels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Panels([{}, {}])", self.rows, self.cols)
    }
}

/// Code `e` (0..32) of block `b` of a row-layout row.
fn code(row_blocks: &[u8], b: usize, e: usize) -> u8 {
    (row_blocks[b * BLOCK_BYTES + e / 2] >> (4 * (e & 1))) & 0xF
}

impl Panels {
    /// Repacks a row-layout matrix (`blocks [rows, cols/32, 16]`, `scales
    /// [rows, cols/32]`, see [`super`]).
    pub fn pack(blocks: &[u8], scales: &[u8], rows: usize, cols: usize) -> Result<Panels> {
        check_layout("Panels::pack", blocks.len(), scales.len(), rows, cols)?;
        let nb = cols / BLOCK_ELEMS;
        let np = rows.div_ceil(PANEL_ROWS);
        let mut codes = vec![Line([0; 64]); np * nb * 4];
        let mut sc = vec![ZERO_BLOCK_SCALE; np * nb * PANEL_ROWS];
        let mut special = vec![false; np];
        for row in 0..rows {
            let (p, r) = (row / PANEL_ROWS, row % PANEL_ROWS);
            let rb = &blocks[row * nb * BLOCK_BYTES..(row + 1) * nb * BLOCK_BYTES];
            for b in 0..nb {
                let s = scales[row * nb + b];
                sc[(p * nb + b) * PANEL_ROWS + r] = s;
                special[p] |= s == 0 || s == 0xFF;
                for v in 0..4 {
                    let line = &mut codes[(p * nb + b) * 4 + v].0;
                    for j in 0..4 {
                        line[4 * r + j] =
                            code(rb, b, 4 * v + j) | (code(rb, b, 16 + 4 * v + j) << 4);
                    }
                }
            }
        }
        Ok(Panels {
            rows,
            cols,
            nb,
            codes,
            scales: sc,
            special,
        })
    }

    /// The row layout back (`(blocks, scales)`), exactly as packed.
    pub fn unpack(&self) -> (Vec<u8>, Vec<u8>) {
        let nb = self.nb;
        let mut blocks = vec![0u8; self.rows * nb * BLOCK_BYTES];
        let mut scales = vec![0u8; self.rows * nb];
        for row in 0..self.rows {
            self.row_into(
                row,
                &mut blocks[row * nb * BLOCK_BYTES..(row + 1) * nb * BLOCK_BYTES],
                &mut scales[row * nb..(row + 1) * nb],
            );
        }
        (blocks, scales)
    }

    /// Row `row` in the row layout: its `cols/32` blocks of 16 code bytes
    /// into `blocks` and its `cols/32` E8M0 scales into `scales`, exactly as
    /// packed.
    ///
    /// # Panics
    /// If `row ≥ rows` or the buffers are not `cols/2` and `cols/32` bytes.
    pub fn row_into(&self, row: usize, blocks: &mut [u8], scales: &mut [u8]) {
        let nb = self.nb;
        assert!(
            row < self.rows,
            "Panels::row_into: row {row} of {}",
            self.rows
        );
        assert_eq!(blocks.len(), nb * BLOCK_BYTES, "Panels::row_into: blocks");
        assert_eq!(scales.len(), nb, "Panels::row_into: scales");
        let (p, r) = (row / PANEL_ROWS, row % PANEL_ROWS);
        for (b, (out, s)) in blocks
            .chunks_exact_mut(BLOCK_BYTES)
            .zip(scales.iter_mut())
            .enumerate()
        {
            *s = self.scales[(p * nb + b) * PANEL_ROWS + r];
            self.block_into(p, r, b, out.try_into().expect("chunks of BLOCK_BYTES"));
        }
    }

    /// Row `row` decoded to f32, bit for bit what [`super::dequantize`]
    /// gives for it from the row layout.
    ///
    /// # Panics
    /// If `row ≥ rows` or `out` is not `cols` values.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let nb = self.nb;
        assert!(
            row < self.rows,
            "Panels::dequantize_row: row {row} of {}",
            self.rows
        );
        assert_eq!(out.len(), self.cols, "Panels::dequantize_row: out");
        let (p, r) = (row / PANEL_ROWS, row % PANEL_ROWS);
        let mut block = [0u8; BLOCK_BYTES];
        for (b, o) in out.chunks_exact_mut(BLOCK_ELEMS).enumerate() {
            self.block_into(p, r, b, &mut block);
            let s = self.scales[(p * nb + b) * PANEL_ROWS + r];
            super::decode_block(&block, s, o.try_into().expect("chunks of BLOCK_ELEMS"));
        }
    }

    /// The 16 row-layout code bytes of block `b` of row `r` of panel `p`.
    fn block_into(&self, p: usize, r: usize, b: usize, out: &mut [u8; BLOCK_BYTES]) {
        let lines = &self.codes[(p * self.nb + b) * 4..(p * self.nb + b + 1) * 4];
        out.fill(0);
        for (v, line) in lines.iter().enumerate() {
            for j in 0..4 {
                let byte = line.0[4 * r + j];
                // Element 4v + j (low nibble) and 16 + 4v + j (high nibble).
                let (lo, hi) = (4 * v + j, 16 + 4 * v + j);
                out[lo / 2] |= (byte & 0xF) << (4 * (lo & 1));
                out[hi / 2] |= (byte >> 4) << (4 * (hi & 1));
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

    /// Hints the first `bytes` of the codes, and the scales read with them,
    /// into the caches ([`crate::cpu::prefetch`]).
    pub fn prefetch(&self, bytes: usize) {
        // SAFETY: Line is 64 plain bytes with no padding.
        let codes = unsafe {
            std::slice::from_raw_parts(self.codes.as_ptr().cast::<u8>(), self.codes.len() * 64)
        };
        crate::cpu::prefetch(codes, bytes);
        // 16 scale bytes per 256 code bytes (a panel block).
        crate::cpu::prefetch(&self.scales, bytes / (PANEL_BLOCK_BYTES / PANEL_ROWS));
    }

    /// Bytes held (codes and scales, padding included).
    pub fn nbytes(&self) -> usize {
        self.codes.len() * 64 + self.scales.len() + self.special.len()
    }

    /// `out[n, rows] = x[n, cols] · Wᵀ` with int8 activations, on the
    /// widest kernel this CPU runs. Error bound: [`super::matmul_mxfp4_q8`].
    ///
    /// # Panics
    /// If `x` is not `n × cols` or `out` not `n × rows` values.
    pub fn matmul(&self, x: &[f32], n: usize, out: &mut [f32]) {
        self.matmul_with(PanelKernel::best(), x, n, out)
    }

    /// [`Panels::matmul`] on a chosen kernel.
    ///
    /// # Panics
    /// As [`Panels::matmul`], and if `kernel` is not supported by this CPU.
    pub fn matmul_with(&self, kernel: PanelKernel, x: &[f32], n: usize, out: &mut [f32]) {
        self.matmul_tiled(kernel, kernel.tile_rows(), x, n, out)
    }

    /// [`Panels::matmul_with`] with tiles of `mr` activation rows (clamped to
    /// `1..=`[`MAX_TILE_ROWS`]; AVX2 uses at most 2), for measuring tile
    /// shapes (a product AMX takes runs as one AMX tile whatever `mr`).
    #[doc(hidden)]
    pub fn matmul_tiled(
        &self,
        kernel: PanelKernel,
        mr: usize,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) {
        assert!(
            kernel.supported(),
            "Panels::matmul: {kernel:?} is not supported here"
        );
        if let Some(o) = product_ready("Panels::matmul", x, n, as_uninit(out), self.rows, self.cols)
        {
            self.product(kernel, mr, x, n, o);
        }
    }

    /// [`Panels::matmul`] into outputs not yet written (each is written
    /// once, so a fresh buffer needs no zeroing).
    ///
    /// # Panics
    /// As [`Panels::matmul`].
    pub fn matmul_uninit(&self, x: &[f32], n: usize, out: &mut [MaybeUninit<f32>]) {
        if let Some(o) = product_ready("Panels::matmul", x, n, out, self.rows, self.cols) {
            let kernel = PanelKernel::best();
            self.product(kernel, kernel.tile_rows(), x, n, o);
        }
    }

    /// The product into `out` (`n × rows` values; `n`, `rows` and `cols`
    /// not 0), every output written once.
    fn product(&self, kernel: PanelKernel, mr: usize, x: &[f32], n: usize, out: OutPtr) {
        let mr = match kernel {
            PanelKernel::Avx2 => mr.clamp(1, MR_AVX2),
            _ => mr.clamp(1, MAX_TILE_ROWS),
        };
        with_rounded(Scheme::MXFP4, kernel.avx512(), x, n, self.cols, |q| {
            self.run(kernel, mr, q, n, out)
        });
    }

    /// `outs[m] = x · mats[m]ᵀ` for matrices of equal width (a layer's q, k
    /// and v, or gate and up): the activations are rounded once and the
    /// panels of all of them are split over the pool as one range, so the
    /// group costs one fork and join instead of one per matrix. Each output is
    /// bit for bit what [`Panels::matmul`] gives.
    ///
    /// # Panics
    /// If the widths differ, `x` is not `n × cols` or `outs[m]` not
    /// `n × mats[m].rows` values.
    pub fn matmul_group(mats: &[&Panels], x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
        let mut outs: Vec<&mut [MaybeUninit<f32>]> =
            outs.iter_mut().map(|o| as_uninit(o)).collect();
        Panels::matmul_group_uninit(mats, x, n, &mut outs);
    }

    /// [`Panels::matmul_group`] into outputs not yet written (each is
    /// written once, so fresh buffers need no zeroing).
    ///
    /// # Panics
    /// As [`Panels::matmul_group`].
    pub fn matmul_group_uninit(
        mats: &[&Panels],
        x: &[f32],
        n: usize,
        outs: &mut [&mut [MaybeUninit<f32>]],
    ) {
        Panels::check_group(mats, x, n, outs.iter().map(|o| o.len()));
        let kernel = PanelKernel::best();
        if n == 0 || mats.is_empty() || mats[0].cols == 0 || kernel == PanelKernel::Avx2 {
            // AVX2 tiles are 2 rows: no gain to share; keep one call each.
            for (m, o) in mats.iter().zip(outs.iter_mut()) {
                m.matmul_uninit(x, n, o);
            }
            return;
        }
        let ptrs: Vec<OutPtr> = outs
            .iter_mut()
            .map(|o| OutPtr(o.as_mut_ptr().cast()))
            .collect();
        Panels::group_product(kernel, mats, x, n, &ptrs);
    }

    /// The shape checks of [`Panels::matmul_group`], given the outputs' lengths.
    fn check_group(
        mats: &[&Panels],
        x: &[f32],
        n: usize,
        outs: impl ExactSizeIterator<Item = usize>,
    ) {
        assert_eq!(
            mats.len(),
            outs.len(),
            "Panels::matmul_group: one output per matrix"
        );
        let Some(first) = mats.first() else { return };
        let cols = first.cols;
        assert!(
            mats.iter().all(|m| m.cols == cols),
            "Panels::matmul_group: matrices of different widths"
        );
        assert_eq!(
            x.len(),
            n * cols,
            "Panels::matmul_group: x must be [n, cols]"
        );
        for (m, len) in mats.iter().zip(outs) {
            assert_eq!(
                len,
                n * m.rows,
                "Panels::matmul_group: out must be [n, rows]"
            );
        }
    }

    /// The grouped product (shapes checked, `n` and the width not 0) into
    /// `ptrs`, every output written once.
    fn group_product(kernel: PanelKernel, mats: &[&Panels], x: &[f32], n: usize, ptrs: &[OutPtr]) {
        let cols = mats[0].cols;
        let mr = kernel.tile_rows();
        // Panel ranges of each matrix within the group's one range.
        let starts: Vec<usize> = mats
            .iter()
            .scan(0, |acc, m| {
                let s = *acc;
                *acc += m.rows.div_ceil(PANEL_ROWS);
                Some(s)
            })
            .collect();
        let total = starts.last().copied().unwrap_or(0)
            + mats.last().map_or(0, |m| m.rows.div_ceil(PANEL_ROWS));
        with_rounded(Scheme::MXFP4, kernel.avx512(), x, n, cols, |q| {
            for_row_ranges(total, PANEL_ROWS * cols * n, MIN_TASK_MACS, |p0, p1| {
                for g in p0..p1 {
                    let m = starts.partition_point(|&s| s <= g) - 1;
                    mats[m].panel(kernel, mr, g - starts[m], q, n, ptrs[m]);
                }
            });
        });
    }

    /// The tiles of the product, split over the pool by ranges of panels.
    fn run(&self, kernel: PanelKernel, mr: usize, q: &QuantRows, n: usize, out: OutPtr) {
        let np = self.rows.div_ceil(PANEL_ROWS);
        let panel_macs = PANEL_ROWS * self.cols * n;
        for_row_ranges(np, panel_macs, MIN_TASK_MACS, |p0, p1| {
            for p in p0..p1 {
                self.panel(kernel, mr, p, q, n, out);
            }
        });
    }

    /// All `n` activation rows against panel `p`.
    fn panel(
        &self,
        kernel: PanelKernel,
        mr: usize,
        p: usize,
        q: &QuantRows,
        n: usize,
        out: OutPtr,
    ) {
        let nb = self.nb;
        let valid = (self.rows - p * PANEL_ROWS).min(PANEL_ROWS);
        let t = Tile {
            codes: &self.codes[p * nb * 4..(p + 1) * nb * 4],
            scales: &self.scales[p * nb * PANEL_ROWS..(p + 1) * nb * PANEL_ROWS],
            special: self.special[p],
            nb,
            rows: self.rows,
            col0: p * PANEL_ROWS,
            valid,
        };
        #[cfg(target_arch = "x86_64")]
        if kernel == PanelKernel::Amx && (AMX_MIN_ROWS..=MR_AMX).contains(&n) {
            return t.rows_amx(q, n, out);
        }
        let mut i = 0;
        while i < n {
            let m = (n - i).min(mr);
            t.rows_tile(kernel, q, i, m, out);
            i += m;
        }
    }
}

/// One panel and what the tile kernels need to write its outputs.
pub(super) struct Tile<'a> {
    /// The panel's code lines, `[nb, 4]`.
    codes: &'a [Line],
    /// The panel's scales, `[nb, 16]`.
    pub(super) scales: &'a [u8],
    /// Whether a scale is 0 or 255 (see [`Panels`]).
    pub(super) special: bool,
    /// Blocks per row.
    pub(super) nb: usize,
    /// Row stride of `out` (output features).
    pub(super) rows: usize,
    /// First output column of the panel.
    pub(super) col0: usize,
    /// Output columns of the panel that exist (16 but in a last panel).
    pub(super) valid: usize,
}

impl Tile<'_> {
    /// The panel's code bytes, `[nb, 256]`.
    pub(super) fn code_bytes(&self) -> &[u8] {
        // SAFETY: Line is 64 plain bytes with no padding.
        unsafe { std::slice::from_raw_parts(self.codes.as_ptr().cast(), self.codes.len() * 64) }
    }

    /// The `n` activation rows (`AMX_MIN_ROWS ≤ n ≤ MR_AMX`) as one AMX tile
    /// against this panel, which it decodes as it goes.
    #[cfg(target_arch = "x86_64")]
    fn rows_amx(&self, q: &QuantRows, n: usize, out: OutPtr) {
        let xs = RowsQ {
            q: &q.q,
            d: &q.d,
            c: &q.c,
        };
        // SAFETY: as in rows_tile (the kernel is supported: asserted by the
        // callers); xs holds the n rows.
        unsafe {
            let o = out.get().add(self.col0);
            macro_rules! by_rows {
                ($($mr:literal)*) => {
                    match n {
                        $($mr => amx::tile_amx::<$mr>(self, &xs, o),)*
                        _ => unreachable!("AMX tiles are {AMX_MIN_ROWS}..={MR_AMX} rows"),
                    }
                };
            }
            by_rows!(16 15 14 13 12 11 10 9 8 7 6)
        }
    }

    /// Activation rows `i0..i0 + m` (`m ≤` the kernel's tile height) against
    /// this panel, written to `out`.
    fn rows_tile(&self, kernel: PanelKernel, q: &QuantRows, i0: usize, m: usize, out: OutPtr) {
        let nb = self.nb;
        let cols = nb * BLOCK_ELEMS;
        let xs = RowsQ {
            q: &q.q[i0 * cols..(i0 + m) * cols],
            d: &q.d[i0 * nb..(i0 + m) * nb],
            c: &q.c[i0 * nb..(i0 + m) * nb],
        };
        // SAFETY (every arm): rows i0..i0+m and columns col0..col0+valid are
        // inside out [n, rows] and belong to this task only; the SIMD kernels
        // run only where supported (asserted by matmul_with).
        let out = unsafe { out.get().add(i0 * self.rows + self.col0) };
        match kernel {
            #[cfg(target_arch = "x86_64")]
            PanelKernel::Avx512Vnni | PanelKernel::Amx => unsafe {
                // The panel's first row tile prefetches its codes ahead.
                macro_rules! by_rows {
                    ($($mr:literal)*) => {
                        match (m, i0 == 0) {
                            $(($mr, true) => x86::tile_avx512::<$mr, true>(self, &xs, out),
                              ($mr, false) => x86::tile_avx512::<$mr, false>(self, &xs, out),)*
                            (_, true) => x86::tile_avx512::<1, true>(self, &xs, out),
                            (_, false) => x86::tile_avx512::<1, false>(self, &xs, out),
                        }
                    };
                }
                by_rows!(12 11 10 9 8 7 6 5 4 3 2)
            },
            #[cfg(target_arch = "x86_64")]
            PanelKernel::Avx2 => unsafe {
                use x86::tile_avx2 as k;
                match m {
                    2 => k::<2>(self, &xs, out),
                    _ => k::<1>(self, &xs, out),
                }
            },
            _ => unsafe { self.tile_portable(&xs, m, out) },
        }
    }

    /// The portable tile: the same integer sums and f32 operations as the
    /// SIMD kernels, one output at a time.
    ///
    /// # Safety
    /// `out` points at row 0, column 0 of the tile inside `[n, rows]`.
    unsafe fn tile_portable(&self, xs: &RowsQ<'_>, m: usize, out: *mut f32) {
        let codes = self.code_bytes();
        let cols = self.nb * BLOCK_ELEMS;
        for i in 0..m {
            for r in 0..self.valid {
                let mut acc = 0.0f32;
                for b in 0..self.nb {
                    let mut dot = xs.c[i * self.nb + b];
                    let xq = &xs.q[i * cols + b * BLOCK_ELEMS..i * cols + (b + 1) * BLOCK_ELEMS];
                    for v in 0..4 {
                        for j in 0..4 {
                            let byte = codes[b * PANEL_BLOCK_BYTES + v * 64 + 4 * r + j];
                            let lo = E2M1_X2_U8[(byte & 0xF) as usize] as i32;
                            let hi = E2M1_X2_U8[(byte >> 4) as usize] as i32;
                            dot += lo * xq[4 * v + j] as i8 as i32;
                            dot += hi * xq[16 + 4 * v + j] as i8 as i32;
                        }
                    }
                    let ws = E8M0_TABLE[self.scales[b * PANEL_ROWS + r] as usize];
                    acc = (dot as f32).mul_add(ws * xs.d[i * self.nb + b], acc);
                }
                // SAFETY: (i, r) is inside the tile (caller's contract).
                unsafe { *out.add(i * self.rows + r) = acc };
            }
        }
    }
}

/// The quantized activation rows of one tile.
pub(super) struct RowsQ<'a> {
    /// `[m, cols]` int8 bits.
    pub(super) q: &'a [u8],
    /// `[m, nb]` `d/2`.
    pub(super) d: &'a [f32],
    /// `[m, nb]` `−12·Σq`.
    pub(super) c: &'a [i32],
}

/// The builds of the panel kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PanelKernel {
    /// AMX-INT8 tiles for products of [`AMX_MIN_ROWS`]..=16 rows, the
    /// AVX-512 VNNI tiles for others (see [`crate::amx`]).
    Amx,
    /// AVX-512 F, BW, VNNI and VBMI (`vpdpbusd`, `vpermb`).
    Avx512Vnni,
    /// AVX2 (`vpmaddubsw`, `vpmaddwd`).
    Avx2,
    /// Portable Rust.
    Portable,
}

impl PanelKernel {
    /// Every build, widest first.
    pub const ALL: [PanelKernel; 4] = [
        PanelKernel::Amx,
        PanelKernel::Avx512Vnni,
        PanelKernel::Avx2,
        PanelKernel::Portable,
    ];

    /// Whether this CPU runs `self`.
    pub fn supported(self) -> bool {
        let f = crate::cpu::features();
        match self {
            #[cfg(target_arch = "x86_64")]
            PanelKernel::Avx512Vnni => f.avx512_vnni && std::is_x86_feature_detected!("avx512vbmi"),
            #[cfg(target_arch = "x86_64")]
            PanelKernel::Amx => PanelKernel::Avx512Vnni.supported() && crate::amx::available(),
            #[cfg(not(target_arch = "x86_64"))]
            PanelKernel::Avx512Vnni | PanelKernel::Amx => false,
            PanelKernel::Avx2 => f.avx2_fma,
            PanelKernel::Portable => true,
        }
    }

    /// Activation rows per tile.
    fn tile_rows(self) -> usize {
        match self {
            // Products AMX does not take run the VNNI tiles.
            PanelKernel::Amx | PanelKernel::Avx512Vnni => MR_AVX512,
            PanelKernel::Avx2 => MR_AVX2,
            PanelKernel::Portable => 4,
        }
    }

    /// Whether activations are rounded by the AVX-512 build (same values).
    fn avx512(self) -> bool {
        matches!(self, PanelKernel::Amx | PanelKernel::Avx512Vnni)
    }

    /// The widest build this CPU runs.
    pub fn best() -> PanelKernel {
        PanelKernel::ALL
            .into_iter()
            .find(|k| k.supported())
            .expect("Portable is always supported")
    }
}
