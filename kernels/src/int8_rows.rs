//! # Activation rows rounded to int8 for the panel GEMMs
//!
//! The MXFP4 panels ([`crate::mxfp4::panel`]) and the Q8_0 panels
//! ([`crate::q8::panel`]) both multiply unsigned weight bytes (`vpdpbusd`'s
//! unsigned operand) by activations rounded to int8 per 32-element block,
//! llama.cpp's Q8 rule: `d = amax/127`, `q = round(x/d)` with ties to even.
//! What differs is how the weight bytes encode their values, which fixes the
//! two numbers stored with each block ([`Scheme`]). Both layouts stream
//! 64-byte [`Line`]s.

use rayon::prelude::*;

/// Activations per block.
const BLOCK: usize = 32;

/// Round to nearest, ties to even, for `|v| < 2²²` (larger values and NaN
/// pass through unchanged or as NaN): adding and subtracting 1.5·2²³ leaves
/// no fraction bits, so the FPU's own rounding does the work. Unlike
/// `f32::round` this needs no libm call on baseline x86-64 and vectorises.
#[inline(always)]
pub fn round_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    if v.abs() < 4_194_304.0 {
        (v + MAGIC) - MAGIC
    } else {
        v
    }
}

/// One 64-byte, 64-byte-aligned line of panel bytes.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line(pub(crate) [u8; 64]);

/// Minimum multiply-adds per rayon task of a panel GEMM (~1 µs of task
/// overhead is then negligible).
pub(crate) const MIN_TASK_MACS: usize = 1 << 20;

/// How a panel's weight bytes relate to their values, which fixes what the
/// activation rounding stores next to each block: `d · d_mul` and
/// `−offset · Σq`. MXFP4 panels hold doubled E2M1 values plus 12
/// ([`Scheme::MXFP4`]); Q8_0 panels hold the int8 value plus 128
/// ([`Scheme::Q8_0`], see [`crate::q8::panel`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Scheme {
    /// Factor on the block scale `d = amax/127` (exact: a power of two).
    pub(crate) d_mul: f32,
    /// The unsigned offset of the weight bytes.
    pub(crate) offset: i32,
}

impl Scheme {
    /// Doubled E2M1 codes plus 12: `d/2`, `−12·Σq`.
    pub(crate) const MXFP4: Scheme = Scheme {
        d_mul: 0.5,
        offset: 12,
    };
    /// Int8 values plus 128: `d`, `−128·Σq`.
    pub(crate) const Q8_0: Scheme = Scheme {
        d_mul: 1.0,
        offset: 128,
    };
}

/// Activation rows rounded to int8 per block, in the kernels' layout.
#[derive(Default)]
pub(crate) struct QuantRows {
    /// `q` as i8 bits, `[n, cols]`, natural order.
    pub(crate) q: Vec<u8>,
    /// `d · d_mul` per block, `[n, cols/32]` (see [`Scheme`]).
    pub(crate) d: Vec<f32>,
    /// `−offset·Σq` per block, `[n, cols/32]`.
    pub(crate) c: Vec<i32>,
}

impl QuantRows {
    /// Rounds `x [n, cols]` under `scheme`, with the AVX-512 rounding loop
    /// when `avx512` (the caller checked AVX-512 F/BW), on the pool when
    /// there are many rows.
    pub(crate) fn fill_as(
        &mut self,
        scheme: Scheme,
        avx512: bool,
        x: &[f32],
        n: usize,
        cols: usize,
    ) {
        let nb = cols / BLOCK;
        self.q.clear();
        self.q.resize(n * cols, 0);
        self.d.clear();
        self.d.resize(n * nb, 0.0);
        self.c.clear();
        self.c.resize(n * nb, 0);
        let rows_per_task = (65536 / cols.max(1)).max(1);
        let one = |(((x, q), d), c): RowChunk<'_>| quantize_rows(scheme, avx512, x, q, d, c);
        let (xr, qr) = (rows_per_task * cols, rows_per_task * nb);
        if n <= rows_per_task || crate::threads::is_serial() || rayon::current_num_threads() == 1 {
            x.chunks(xr)
                .zip(self.q.chunks_mut(xr))
                .zip(self.d.chunks_mut(qr))
                .zip(self.c.chunks_mut(qr))
                .for_each(one);
        } else {
            x.par_chunks(xr)
                .zip(self.q.par_chunks_mut(xr))
                .zip(self.d.par_chunks_mut(qr))
                .zip(self.c.par_chunks_mut(qr))
                .for_each(one);
        }
    }
}

/// One task's rows of `x`, `q`, `d` and `c`, as zipped chunks.
type RowChunk<'a> = (((&'a [f32], &'a mut [u8]), &'a mut [f32]), &'a mut [i32]);

/// Rounds whole rows (any number of blocks), with AVX-512 when `avx512`.
fn quantize_rows(
    scheme: Scheme,
    avx512: bool,
    x: &[f32],
    q: &mut [u8],
    d: &mut [f32],
    c: &mut [i32],
) {
    #[cfg(target_arch = "x86_64")]
    if avx512 {
        // SAFETY: callers pass `avx512` only where AVX-512 F/BW are present.
        return unsafe { x86::quantize_avx512(scheme, x, q, d, c) };
    }
    let _ = avx512;
    for (((xb, qb), db), cb) in x
        .chunks_exact(BLOCK)
        .zip(q.chunks_exact_mut(BLOCK))
        .zip(d.iter_mut())
        .zip(c.iter_mut())
    {
        (*db, *cb) = quantize_block(scheme, xb, qb);
    }
}

/// Rounds one block to int8 into `q` (i8 bits); returns `(d·d_mul,
/// −offset·Σq)` ([`Scheme`]). A block holding NaN or ±∞ gets `d = NaN`, so
/// its outputs are NaN.
pub(crate) fn quantize_block(scheme: Scheme, x: &[f32], q: &mut [u8]) -> (f32, i32) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (o, &v) in q.iter_mut().zip(x) {
        let r = round_even(v * inv).clamp(-127.0, 127.0) as i8;
        sum += r as i32;
        *o = r as u8;
    }
    let finite = x.iter().all(|v| v.is_finite());
    (
        if finite { d * scheme.d_mul } else { f32::NAN },
        -scheme.offset * sum,
    )
}

/// Runs `f` on `x [n, cols]` rounded under `scheme` (with AVX-512 when
/// `avx512`) into this thread's buffer, which is kept for the next call, so
/// a warm thread allocates nothing.
pub(crate) fn with_rounded<R>(
    scheme: Scheme,
    avx512: bool,
    x: &[f32],
    n: usize,
    cols: usize,
    f: impl FnOnce(&QuantRows) -> R,
) -> R {
    thread_local! {
        static BUF: std::cell::Cell<QuantRows> = std::cell::Cell::new(QuantRows::default());
    }
    crate::threads::with_local(&BUF, |q| {
        q.fill_as(scheme, avx512, x, n, cols);
        f(q)
    })
}

/// Checks the operands of `out[n, rows] = x[n, cols] · Wᵀ` for `op` and
/// says whether there is anything to multiply (an empty width gives zeros).
///
/// # Panics
/// If `x` is not `n × cols` or `out` not `n × rows` values.
pub(crate) fn product_ready(
    op: &str,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    rows: usize,
    cols: usize,
) -> bool {
    assert_eq!(x.len(), n * cols, "{op}: x must be [n, cols]");
    assert_eq!(out.len(), n * rows, "{op}: out must be [n, rows]");
    if cols == 0 {
        out.fill(0.0);
    }
    n > 0 && rows > 0 && cols > 0
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! The AVX-512 rounding loop, and the block epilogue and tile store the
    //! panel tiles share. Callers check CPU features.
    use std::arch::x86_64::*;

    /// The end of a panel block for `MR` activation rows:
    /// `facc[i] += f32(acc[i]) · (ws · d_i)` with `d_i = xd[i·nb + b]`.
    ///
    /// # Safety
    /// AVX-512F present; `xd` holds `MR` rows of `nb` scales.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn scale_add<const MR: usize>(
        facc: &mut [__m512; MR],
        acc: &[__m512i; MR],
        ws: __m512,
        xd: *const f32,
        nb: usize,
        b: usize,
    ) {
        for (i, (f, a)) in facc.iter_mut().zip(acc).enumerate() {
            // SAFETY: the caller's contract.
            let s = _mm512_mul_ps(ws, _mm512_set1_ps(unsafe { *xd.add(i * nb + b) }));
            *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*a), s, *f);
        }
    }

    /// Stores the first `valid` (≤ 16) lanes of each row's accumulator, rows
    /// `stride` apart from `out`.
    ///
    /// # Safety
    /// AVX-512F present; those `MR × valid` outputs are writable.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn store_rows<const MR: usize>(
        facc: &[__m512; MR],
        out: *mut f32,
        stride: usize,
        valid: usize,
    ) {
        let mask: u16 = if valid >= 16 {
            0xFFFF
        } else {
            (1u16 << valid) - 1
        };
        for (i, f) in facc.iter().enumerate() {
            // SAFETY: the caller's contract.
            unsafe { _mm512_mask_storeu_ps(out.add(i * stride), mask, *f) };
        }
    }

    use super::{Scheme, BLOCK};

    /// [`super::quantize_block`] under `scheme` over whole rows with AVX-512: max |x| by
    /// a vector reduction, round-to-nearest-even, saturating packs to bytes.
    /// Bit-identical to the plain loop for finite blocks; non-finite blocks get
    /// `d = NaN` in both.
    ///
    /// # Safety
    /// AVX-512 F/BW present; `q` as long as `x`, `d` and `c` one per block.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn quantize_avx512(
        scheme: Scheme,
        x: &[f32],
        q: &mut [u8],
        d: &mut [f32],
        c: &mut [i32],
    ) {
        let (lo_c, hi_c) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        for (((blk, qb), db), cb) in x
            .chunks_exact(BLOCK)
            .zip(q.chunks_exact_mut(BLOCK))
            .zip(d.iter_mut())
            .zip(c.iter_mut())
        {
            // SAFETY: a block is 32 floats and 32 bytes.
            unsafe {
                let lo = _mm512_loadu_ps(blk.as_ptr());
                let hi = _mm512_loadu_ps(blk.as_ptr().add(16));
                let zero = _mm512_setzero_ps();
                // x·0 is NaN exactly for ±∞ and NaN, and the sum of two
                // such products is NaN when either is: a lane compare, not
                // a horizontal sum.
                let z = _mm512_add_ps(_mm512_mul_ps(lo, zero), _mm512_mul_ps(hi, zero));
                let finite = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(z, z) == 0xFFFF;
                let amax =
                    _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
                let dd = amax / 127.0;
                let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                *db = if finite { dd * scheme.d_mul } else { f32::NAN };
                let inv = _mm512_set1_ps(inv);
                let round = |v: __m512| {
                    let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                        _mm512_mul_ps(v, inv),
                    );
                    _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo_c), hi_c))
                };
                let (ql, qh) = (round(lo), round(hi));
                _mm_storeu_si128(qb.as_mut_ptr().cast(), _mm512_cvtsepi32_epi8(ql));
                _mm_storeu_si128(qb.as_mut_ptr().add(16).cast(), _mm512_cvtsepi32_epi8(qh));
                *cb = -scheme.offset * _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
            }
        }
    }
}
