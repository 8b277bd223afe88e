//! Linear-layer matmuls: `out[n, rows] = x[n, cols] · Wᵀ`, W row-major `[rows, cols]`.
//!
//! Two regimes, chosen by the number of input rows `n`:
//!
//! - **GEMV** (`n <= GEMV_MAX_N`, the decode hot path). The weight is streamed
//!   once; each row of W is dotted with every input row while it is in
//!   registers. Rows of W are split into chunks over the rayon pool. The inner
//!   kernel is picked at run time: AVX-512F (16 lanes), AVX2+FMA (8 lanes), or a
//!   portable scalar loop (the only path off x86-64). Several W rows are
//!   processed together so that there are 8–16 independent FMA chains (ILP),
//!   and bf16/f16 weights are widened in registers (bf16: zero-extend each u16
//!   to u32 and shift left by 16; f16: `vcvtph2ps`).
//! - **GEMM** (`n > GEMV_MAX_N`, prefill). f32 weights go straight to the
//!   `gemm` crate. bf16/f16 weights are widened one row tile at a time (a few
//!   dozen to 256 rows, sized to stay in L2) into a per-thread scratch buffer,
//!   and `gemm` runs on that tile; tiles are spread over the rayon pool. The
//!   whole matrix is never widened at once.
//!
//! The scalar `*_ref` functions accumulate in f64 and are the test oracles.

use half::prelude::{HalfBitsSliceExt, HalfFloatSliceExt};
use rayon::prelude::*;
use std::cell::RefCell;

use crate::cpu::{self, Isa};
use crate::split::OutPtr;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Largest input row count served by the GEMV kernels (decode batches);
/// larger batches use the blocked GEMM path. The kernels are instantiated for
/// 1–4 inputs; 5–16 inputs run in groups of 4 over the same row chunk, so a
/// chunk of weights is read from DRAM once and re-read from L2. Range 1..=16.
pub const GEMV_MAX_N: usize = 16;

/// Inputs one kernel instance handles at once (its accumulators fill the registers).
const GEMV_GROUP: usize = 4;

/// Weight bytes of one row chunk when several input groups re-read it, so the
/// chunk stays in L2 between groups. Default 256 KiB.
const GEMV_L2_BYTES: usize = 256 * 1024;

/// Below this many multiply-adds (`n·rows·cols`) a GEMV runs on the calling
/// thread: splitting costs a few microseconds of rayon wake-up, more than the
/// work itself. Default 64Ki.
const PAR_MIN_WORK: usize = 1 << 16;

/// Row chunks per rayon thread in a GEMV: more than one lets work stealing
/// even out a busy core, few enough to keep task overhead negligible. Default 4.
const CHUNKS_PER_THREAD: usize = 4;

/// Bytes of f32 scratch one GEMM row tile may occupy (the tile is reread for
/// every input row, so it should stay in the 2 MiB L2). Default 1 MiB.
const TILE_BYTES: usize = 1 << 20;

/// Row-tile bounds for the bf16/f16 GEMM path (multiples of 16).
const TILE_MIN_ROWS: usize = 16;
/// See [`TILE_MIN_ROWS`].
const TILE_MAX_ROWS: usize = 256;

/// The best instruction set this CPU runs the GEMV with: as [`Isa::best`],
/// except that the AVX2 build also needs F16C (it widens f16 weights).
fn detected_isa() -> Isa {
    [Isa::Avx512, Isa::Avx2]
        .into_iter()
        .find(|&i| supported(i))
        .unwrap_or(Isa::Portable)
}

/// Whether this CPU can run GEMV kernels of instruction set `isa`.
fn supported(isa: Isa) -> bool {
    isa.supported() && (isa != Isa::Avx2 || cpu::features().f16c)
}

/// A weight element type the GEMV kernels can read.
trait Elem: Copy + Send + Sync + 'static {
    /// Widens one element.
    fn to_f32(self) -> f32;

    /// Loads 16 consecutive elements widened to f32.
    ///
    /// # Safety
    /// The CPU supports AVX-512F and `p` points at 16 readable elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> __m512;

    /// Loads 8 consecutive elements widened to f32.
    ///
    /// # Safety
    /// The CPU supports AVX2 and F16C and `p` points at 8 readable elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
}

/// bf16 weight bits.
#[derive(Clone, Copy)]
#[repr(transparent)]
struct Bf16(u16);

impl Elem for Bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Bf16) -> __m512 {
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const Bf16) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
}

/// IEEE binary16 weight bits.
#[derive(Clone, Copy)]
#[repr(transparent)]
struct F16(u16);

impl Elem for F16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::from_bits(self.0).to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const F16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const F16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

/// Views u16 bits as a slice of the element wrapper `T` (`Bf16` or `F16`).
fn bits_as<T: Elem>(w: &[u16]) -> &[T] {
    assert_eq!(std::mem::size_of::<T>(), 2, "wrapper is a transparent u16");
    // SAFETY: T is #[repr(transparent)] over u16 (size checked above).
    unsafe { std::slice::from_raw_parts(w.as_ptr() as *const T, w.len()) }
}

// ---------------------------------------------------------------------------
// Public entry points
// ---------------------------------------------------------------------------

/// `out[n, rows] = x[n, cols] · wᵀ` for an f32 weight `w` `[rows, cols]`.
pub fn matmul_f32(x: &[f32], n: usize, w: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    let gemm = |o: &mut [f32]| gemm_f32(x, n, w, rows, cols, o);
    matmul_with("matmul_f32", x, n, w, rows, cols, out, gemm);
}

/// `out[n, rows] = x[n, cols] · wᵀ` for a bf16 weight given as raw bits.
pub fn matmul_bf16(x: &[f32], n: usize, w: &[u16], rows: usize, cols: usize, out: &mut [f32]) {
    let gemm = |o: &mut [f32]| gemm_tiled(x, n, w, rows, cols, o, widen_bf16);
    matmul_with(
        "matmul_bf16",
        x,
        n,
        bits_as::<Bf16>(w),
        rows,
        cols,
        out,
        gemm,
    );
}

/// `out[n, rows] = x[n, cols] · wᵀ` for an IEEE half weight given as raw bits.
pub fn matmul_f16(x: &[f32], n: usize, w: &[u16], rows: usize, cols: usize, out: &mut [f32]) {
    let gemm = |o: &mut [f32]| gemm_tiled(x, n, w, rows, cols, o, widen_f16);
    matmul_with("matmul_f16", x, n, bits_as::<F16>(w), rows, cols, out, gemm);
}

/// Shared front of the matmuls: shape checks, empty shapes, then GEMV for
/// `n <= GEMV_MAX_N` or the dtype's GEMM path (`gemm`).
#[allow(clippy::too_many_arguments)]
fn matmul_with<E: Elem>(
    op: &str,
    x: &[f32],
    n: usize,
    w: &[E],
    rows: usize,
    cols: usize,
    out: &mut [f32],
    gemm: impl FnOnce(&mut [f32]),
) {
    check_shapes(op, [x.len(), w.len(), out.len()], n, rows, cols);
    if n == 0 || rows == 0 {
        return;
    }
    if cols == 0 {
        out.fill(0.0);
    } else if n <= GEMV_MAX_N {
        gemv(detected_isa(), x, n, w, rows, cols, out);
    } else {
        gemm(out);
    }
}

/// Dot product of two equally long f32 slices (SIMD when available).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32: lengths differ");
    dot_with(detected_isa(), a, b)
}

/// Scalar oracle for [`matmul_f32`]: f64 accumulation, rounded once.
pub fn matmul_f32_ref(x: &[f32], n: usize, w: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    check_shapes(
        "matmul_f32_ref",
        [x.len(), w.len(), out.len()],
        n,
        rows,
        cols,
    );
    matmul_ref_any(x, n, w, rows, cols, out);
}

/// Scalar oracle for [`matmul_bf16`]: f64 accumulation, rounded once.
pub fn matmul_bf16_ref(x: &[f32], n: usize, w: &[u16], rows: usize, cols: usize, out: &mut [f32]) {
    check_shapes(
        "matmul_bf16_ref",
        [x.len(), w.len(), out.len()],
        n,
        rows,
        cols,
    );
    matmul_ref_any(x, n, bits_as::<Bf16>(w), rows, cols, out);
}

/// Scalar oracle for [`matmul_f16`]: f64 accumulation, rounded once.
pub fn matmul_f16_ref(x: &[f32], n: usize, w: &[u16], rows: usize, cols: usize, out: &mut [f32]) {
    check_shapes(
        "matmul_f16_ref",
        [x.len(), w.len(), out.len()],
        n,
        rows,
        cols,
    );
    matmul_ref_any(x, n, bits_as::<F16>(w), rows, cols, out);
}

/// Panics with a readable message unless the lengths of `[x, w, out]` are
/// `[n·cols, rows·cols, n·rows]`.
fn check_shapes(op: &str, lens: [usize; 3], n: usize, rows: usize, cols: usize) {
    let want = [n * cols, rows * cols, n * rows];
    assert_eq!(
        lens, want,
        "{op}: [x, w, out] lengths for n={n}, rows={rows}, cols={cols}"
    );
}

/// The scalar oracle: f64 accumulation, rounded once per output.
fn matmul_ref_any<E: Elem>(
    x: &[f32],
    n: usize,
    w: &[E],
    rows: usize,
    cols: usize,
    out: &mut [f32],
) {
    for i in 0..n {
        let xi = &x[i * cols..(i + 1) * cols];
        for r in 0..rows {
            let wr = &w[r * cols..(r + 1) * cols];
            let s: f64 = xi
                .iter()
                .zip(wr)
                .map(|(&a, &b)| a as f64 * b.to_f32() as f64)
                .sum();
            out[i * rows + r] = s as f32;
        }
    }
}

// ---------------------------------------------------------------------------
// GEMV
// ---------------------------------------------------------------------------

/// A block kernel: `res[r][j] = Σ_c w[r·cols + c] · x[j·cols + c]` for `R`
/// weight rows and `N` inputs.
/// `(x, w, cols, next, res)`: `next` is the first row of the block the walk
/// runs after this one (null when none), whose lines the x86 kernels hint
/// into the cache while they stream this block.
type BlockFn<E, const N: usize, const R: usize> =
    unsafe fn(*const f32, *const E, usize, *const E, &mut [[f32; N]; R]);

/// One GEMV problem, shared by every row chunk.
struct Gemv<'a, E> {
    /// Input rows `[n, cols]`.
    x: &'a [f32],
    /// Weight `[rows, cols]`.
    w: &'a [E],
    /// Output features.
    rows: usize,
    /// Input features.
    cols: usize,
    /// `out[n, rows]`; each chunk writes its own rows.
    out: OutPtr,
}

/// GEMV over all rows, split over the rayon pool when worth it.
fn gemv<E: Elem>(
    isa: Isa,
    x: &[f32],
    n: usize,
    w: &[E],
    rows: usize,
    cols: usize,
    out: &mut [f32],
) {
    debug_assert!((1..=GEMV_MAX_N).contains(&n));
    let g = Gemv {
        x,
        w,
        rows,
        cols,
        out: OutPtr(out.as_mut_ptr()),
    };
    let threads = rayon::current_num_threads();
    // Rows per L2-sized chunk when input groups re-read the weights.
    let l2_rows = ((GEMV_L2_BYTES / (cols * std::mem::size_of::<E>()).max(1)) / 16 * 16).max(16);
    if threads <= 1 || n * rows * cols < PAR_MIN_WORK || rows < 32 {
        let step = if n > GEMV_GROUP { l2_rows } else { rows };
        for r0 in (0..rows).step_by(step) {
            // SAFETY: shapes checked by the caller; this thread writes everything.
            unsafe { g.run(isa, n, r0, (r0 + step).min(rows)) };
        }
        return;
    }
    let mut chunk = rows
        .div_ceil(threads * CHUNKS_PER_THREAD)
        .next_multiple_of(16)
        .max(16);
    if n > GEMV_GROUP {
        // Input groups re-read the chunk's weights: keep a chunk within L2.
        chunk = chunk.min(l2_rows);
    }
    let run = |c: usize| {
        // SAFETY: chunks cover disjoint row ranges, so the writes are disjoint.
        unsafe { g.run(isa, n, c * chunk, ((c + 1) * chunk).min(rows)) };
    };
    if crate::threads::is_serial() {
        (0..rows.div_ceil(chunk)).for_each(run);
    } else {
        (0..rows.div_ceil(chunk)).into_par_iter().for_each(run);
    }
}

impl<E: Elem> Gemv<'_, E> {
    /// Output rows `r0..r1` for all `n` inputs.
    ///
    /// # Safety
    /// `isa` is supported, `r1 <= rows`, the shapes were checked, and no
    /// other task writes rows `r0..r1` meanwhile.
    unsafe fn run(&self, isa: Isa, n: usize, r0: usize, r1: usize) {
        if n > GEMV_GROUP {
            // Groups of inputs over the same rows: the weight rows stay in cache.
            for g in (0..n).step_by(GEMV_GROUP) {
                let m = GEMV_GROUP.min(n - g);
                let sub = Gemv {
                    x: &self.x[g * self.cols..(g + m) * self.cols],
                    w: self.w,
                    rows: self.rows,
                    cols: self.cols,
                    // SAFETY: input g's outputs start at row g of out[n, rows].
                    out: OutPtr(unsafe { self.out.get().add(g * self.rows) }),
                };
                // SAFETY: same row range, disjoint inputs, caller's guarantees.
                unsafe { sub.run(isa, m, r0, r1) };
            }
            return;
        }
        match n {
            1 => self.run_n::<1>(isa, r0, r1),
            2 => self.run_n::<2>(isa, r0, r1),
            3 => self.run_n::<3>(isa, r0, r1),
            4 => self.run_n::<4>(isa, r0, r1),
            _ => unreachable!("GEMV serves 1..=GEMV_MAX_N inputs"),
        }
    }

    /// [`Gemv::run`] for exactly `N` inputs. Blocks of 8 weight rows for one
    /// input (8 FMA chains), 4 rows for 2–4 inputs (8–16 chains, within the
    /// 32 zmm registers); AVX2 (16 ymm) drops to 2 rows for 3–4 inputs so the
    /// accumulators do not spill.
    ///
    /// # Safety
    /// As [`Gemv::run`].
    unsafe fn run_n<const N: usize>(&self, isa: Isa, r0: usize, r1: usize) {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if N == 1 => {
                self.walk::<N, 8>(r0, r1, block_avx512::<E, N, 8>, block_avx512::<E, N, 1>)
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                self.walk::<N, 4>(r0, r1, block_avx512::<E, N, 4>, block_avx512::<E, N, 1>)
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 if N == 1 => {
                self.walk::<N, 8>(r0, r1, block_avx2::<E, N, 8>, block_avx2::<E, N, 1>)
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 if N == 2 => {
                self.walk::<N, 4>(r0, r1, block_avx2::<E, N, 4>, block_avx2::<E, N, 1>)
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => self.walk::<N, 2>(r0, r1, block_avx2::<E, N, 2>, block_avx2::<E, N, 1>),
            _ => self.walk::<N, 4>(r0, r1, block_scalar::<E, N, 4>, block_scalar::<E, N, 1>),
        }
    }

    /// Walks rows `r0..r1` in blocks of `R` (then single rows) and scatters
    /// each block's `[R][N]` results into `out[n, rows]`.
    ///
    /// # Safety
    /// As [`Gemv::run`], and the kernels' instruction set is supported.
    unsafe fn walk<const N: usize, const R: usize>(
        &self,
        r0: usize,
        r1: usize,
        block: BlockFn<E, N, R>,
        single: BlockFn<E, N, 1>,
    ) {
        let (x, w, out, cols) = (self.x.as_ptr(), self.w.as_ptr(), self.out.get(), self.cols);
        let mut r = r0;
        let mut res = [[0.0f32; N]; R];
        while r + R <= r1 {
            // A block's rows start streams of a few lines each (a 576-wide
            // bf16 row is 18 lines) that the hardware prefetcher picks up
            // late, so the kernel hints the next block's rows as it goes.
            let next = if r + 2 * R <= r1 {
                w.add((r + R) * cols)
            } else {
                std::ptr::null()
            };
            block(x, w.add(r * cols), cols, next, &mut res);
            for (k, row) in res.iter().enumerate() {
                for (j, &v) in row.iter().enumerate() {
                    *out.add(j * self.rows + r + k) = v;
                }
            }
            r += R;
        }
        let mut one = [[0.0f32; N]; 1];
        while r < r1 {
            single(x, w.add(r * cols), cols, std::ptr::null(), &mut one);
            for (j, &v) in one[0].iter().enumerate() {
                *out.add(j * self.rows + r) = v;
            }
            r += 1;
        }
    }
}

/// Defines the block kernel of one x86 instruction set (AVX-512 and AVX2
/// differ only in width and intrinsics):
/// `res[r][j] = Σ_c w[r·cols + c] · x[j·cols + c]`, one accumulator per
/// (row, input) pair, a scalar loop for the last `cols % lanes` values.
macro_rules! block_kernel {
    ($name:ident, $feat:literal, $lanes:literal, $zero:ident, $loadx:ident, $loadw:ident, $fma:ident, $hsum:ident) => {
        #[doc = concat!("Block kernel with `", $feat, "`, ", stringify!($lanes), " lanes.")]
        ///
        /// # Safety
        /// The features are available; `x` has `N·cols` values, `w` has `R·cols`.
        /// `next` (prefetched only, never read) may be null.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feat)]
        unsafe fn $name<E: Elem, const N: usize, const R: usize>(
            x: *const f32,
            w: *const E,
            cols: usize,
            next: *const E,
            res: &mut [[f32; N]; R],
        ) {
            let mut acc = [[$zero(); N]; R];
            let mut c = 0;
            while c + $lanes <= cols {
                if !next.is_null() {
                    for r in 0..R {
                        _mm_prefetch::<_MM_HINT_T0>(next.add(r * cols + c).cast());
                    }
                }
                let mut xv = [$zero(); N];
                for (j, v) in xv.iter_mut().enumerate() {
                    *v = $loadx(x.add(j * cols + c));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let wv = E::$loadw(w.add(r * cols + c));
                    for (a, &xj) in acc_r.iter_mut().zip(&xv) {
                        *a = $fma(wv, xj, *a);
                    }
                }
                c += $lanes;
            }
            for (r, row) in res.iter_mut().enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    let mut s = $hsum(acc[r][j]);
                    for cc in c..cols {
                        s += (*w.add(r * cols + cc)).to_f32() * *x.add(j * cols + cc);
                    }
                    *v = s;
                }
            }
        }
    };
}

block_kernel! {
    block_avx512, "avx512f", 16, _mm512_setzero_ps, _mm512_loadu_ps, load16, _mm512_fmadd_ps, _mm512_reduce_add_ps
}
block_kernel! {
    block_avx2, "avx2,fma,f16c", 8, _mm256_setzero_ps, _mm256_loadu_ps, load8, _mm256_fmadd_ps, hsum256
}

/// Horizontal sum of 8 lanes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Portable block kernel: 4 partial sums per (row, input) pair.
///
/// # Safety
/// `x` has `N·cols` values, `w` has `R·cols`.
unsafe fn block_scalar<E: Elem, const N: usize, const R: usize>(
    x: *const f32,
    w: *const E,
    cols: usize,
    _next: *const E,
    res: &mut [[f32; N]; R],
) {
    let xs = std::slice::from_raw_parts(x, N * cols);
    let ws = std::slice::from_raw_parts(w, R * cols);
    for (r, row) in res.iter_mut().enumerate() {
        let wr = &ws[r * cols..(r + 1) * cols];
        for (j, v) in row.iter_mut().enumerate() {
            let xj = &xs[j * cols..(j + 1) * cols];
            let mut acc = [0.0f32; 4];
            let mut wc = wr.chunks_exact(4);
            let mut xc = xj.chunks_exact(4);
            for (a, b) in (&mut wc).zip(&mut xc) {
                for l in 0..4 {
                    acc[l] += a[l].to_f32() * b[l];
                }
            }
            let mut s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
            for (a, b) in wc.remainder().iter().zip(xc.remainder()) {
                s += a.to_f32() * b;
            }
            *v = s;
        }
    }
}

/// Dot product with an explicit instruction set.
fn dot_with(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is only Avx512 when the CPU supports it.
        Isa::Avx512 => unsafe { dot_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is only Avx2 when the CPU supports AVX2+FMA.
        Isa::Avx2 => unsafe { dot_avx2(a, b) },
        _ => dot_scalar(a, b),
    }
}

/// Defines the dot product of one x86 instruction set: 4 accumulators
/// (4·lanes values per step), then single vectors, then a scalar tail.
macro_rules! dot_kernel {
    ($name:ident, $feat:literal, $lanes:literal, $zero:ident, $load:ident, $fma:ident, $add:ident, $hsum:ident) => {
        #[doc = concat!("Dot product with `", $feat, "`, ", stringify!($lanes), " lanes.")]
        ///
        /// # Safety
        /// The features are available.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feat)]
        unsafe fn $name(a: &[f32], b: &[f32]) -> f32 {
            let n = a.len().min(b.len());
            let (pa, pb) = (a.as_ptr(), b.as_ptr());
            let mut acc = [$zero(); 4];
            let mut i = 0;
            while i + 4 * $lanes <= n {
                for (k, s) in acc.iter_mut().enumerate() {
                    let o = i + $lanes * k;
                    *s = $fma($load(pa.add(o)), $load(pb.add(o)), *s);
                }
                i += 4 * $lanes;
            }
            while i + $lanes <= n {
                acc[0] = $fma($load(pa.add(i)), $load(pb.add(i)), acc[0]);
                i += $lanes;
            }
            let mut s = $hsum($add($add(acc[0], acc[1]), $add(acc[2], acc[3])));
            while i < n {
                s += *pa.add(i) * *pb.add(i);
                i += 1;
            }
            s
        }
    };
}

dot_kernel! {
    dot_avx512, "avx512f", 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps, _mm512_add_ps, _mm512_reduce_add_ps
}
dot_kernel! {
    dot_avx2, "avx2,fma", 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, _mm256_add_ps, hsum256
}

/// Portable dot product with 8 partial sums (auto-vectorisable).
fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut ac = a.chunks_exact(8);
    let mut bc = b.chunks_exact(8);
    for (x, y) in (&mut ac).zip(&mut bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (x, y) in ac.remainder().iter().zip(bc.remainder()) {
        s += x * y;
    }
    s
}

// ---------------------------------------------------------------------------
// GEMM
// ---------------------------------------------------------------------------

/// Runs `gemm` for `out[:, col0..col0+m] = x · wᵀ` where `w` is `[m, cols]` f32
/// and `out` rows are `out_stride` apart.
///
/// # Safety
/// `out` points at an `[n, out_stride]` buffer with `col0 + m <= out_stride`
/// whose columns `col0..col0+m` no other thread writes meanwhile; `x` is
/// `[n, cols]`, `w` is `[m, cols]`.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_into(
    x: &[f32],
    n: usize,
    w: &[f32],
    m: usize,
    cols: usize,
    out: *mut f32,
    out_stride: usize,
    par: gemm::Parallelism,
) {
    debug_assert!(x.len() >= n * cols && w.len() >= m * cols);
    // dst (i, j) = out[i·stride + j]; lhs (i, p) = x[i·cols + p];
    // rhs (p, j) = w[j·cols + p], i.e. Wᵀ read in place.
    gemm::gemm(
        n,
        m,
        cols,
        out,
        1,
        out_stride as isize,
        false,
        x.as_ptr(),
        1,
        cols as isize,
        w.as_ptr(),
        cols as isize,
        1,
        0.0f32,
        1.0f32,
        false,
        false,
        false,
        par,
    );
}

/// f32 GEMM through the `gemm` crate, threaded over the rayon pool.
fn gemm_f32(x: &[f32], n: usize, w: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    let par = match rayon::current_num_threads() {
        0 | 1 => gemm::Parallelism::None,
        t => gemm::Parallelism::Rayon(t),
    };
    // SAFETY: shapes checked by the caller; the single call owns `out`.
    unsafe { gemm_into(x, n, w, rows, cols, out.as_mut_ptr(), rows, par) };
}

/// Widens bf16 bits into f32 (a shift per value; auto-vectorised).
fn widen_bf16(src: &[u16], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s as u32) << 16);
    }
}

/// Widens IEEE half bits into f32 (`half` uses F16C when the CPU has it).
fn widen_f16(src: &[u16], dst: &mut [f32]) {
    src.reinterpret_cast::<half::f16>()
        .convert_to_f32_slice(dst);
}

thread_local! {
    /// Per-thread f32 scratch for one widened row tile, reused across calls.
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Rows per widened tile: fills about [`TILE_BYTES`], within
/// [`TILE_MIN_ROWS`]..=[`TILE_MAX_ROWS`], and gives every thread at least
/// two tiles when the matrix is large enough.
fn tile_rows(rows: usize, cols: usize, threads: usize) -> usize {
    let by_cache = (TILE_BYTES / (4 * cols.max(1))) / 16 * 16;
    let by_balance = rows.div_ceil(2 * threads.max(1)).next_multiple_of(16);
    by_cache.min(by_balance).clamp(TILE_MIN_ROWS, TILE_MAX_ROWS)
}

/// GEMM for 16-bit weights: widen one row tile at a time into per-thread
/// scratch and run single-threaded `gemm` on it; tiles run in parallel.
fn gemm_tiled(
    x: &[f32],
    n: usize,
    w: &[u16],
    rows: usize,
    cols: usize,
    out: &mut [f32],
    widen: fn(&[u16], &mut [f32]),
) {
    let threads = rayon::current_num_threads();
    let tile = tile_rows(rows, cols, threads);
    let tiles = rows.div_ceil(tile);
    let ptr = OutPtr(out.as_mut_ptr());
    let run = |t: usize| {
        let r0 = t * tile;
        let m = tile.min(rows - r0);
        TILE.with(|buf| {
            let mut buf = buf.borrow_mut();
            if buf.len() < m * cols {
                buf.resize(m * cols, 0.0);
            }
            let scratch = &mut buf[..m * cols];
            widen(&w[r0 * cols..(r0 + m) * cols], scratch);
            // SAFETY: tile `t` owns output columns r0..r0+m; `gemm` runs
            // single-threaded here, so the RefCell borrow is not re-entered.
            unsafe {
                gemm_into(
                    x,
                    n,
                    scratch,
                    m,
                    cols,
                    ptr.get().add(r0),
                    rows,
                    gemm::Parallelism::None,
                )
            };
        });
    };
    if threads <= 1 || tiles == 1 || crate::threads::is_serial() {
        (0..tiles).for_each(run);
    } else {
        (0..tiles).into_par_iter().for_each(run);
    }
}

#[cfg(test)]
mod tests;
