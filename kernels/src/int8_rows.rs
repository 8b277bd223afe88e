//! # Activation rows rounded to int8 for the panel GEMMs
//!
//! The MXFP4 panels ([`crate::mxfp4::panel`]) and the Q8_0 panels
//! ([`crate::q8::panel`]) both multiply unsigned weight bytes (`vpdpbusd`'s
//! unsigned operand) by activations rounded to int8 per 32-element block,
//! llama.cpp's Q8 rule: `d = amax/127`, `q = round(x/d)` with ties to even.
//! What differs is how the weight bytes encode their values, which fixes the
//! two numbers stored with each block ([`Scheme`]). Both layouts stream
//! 64-byte [`Line`]s.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::split::OutPtr;

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
        // Every block is written below; only a width that is not whole
        // blocks leaves values to zero.
        if !cols.is_multiple_of(BLOCK) {
            self.q.clear();
        }
        self.q.resize(n * cols, 0);
        self.d.resize(n * nb, 0.0);
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
/// returns `out` as the kernels' output pointer, or `None` when there is
/// nothing to multiply (an empty width fills `out` with zeros). The products
/// store every output once, so `out` need not be initialised.
///
/// # Panics
/// If `x` is not `n × cols` or `out` not `n × rows` values.
pub(crate) fn product_ready(
    op: &str,
    x: &[f32],
    n: usize,
    out: &mut [MaybeUninit<f32>],
    rows: usize,
    cols: usize,
) -> Option<OutPtr> {
    assert_eq!(x.len(), n * cols, "{op}: x must be [n, cols]");
    assert_eq!(out.len(), n * rows, "{op}: out must be [n, rows]");
    if cols == 0 {
        out.fill(MaybeUninit::new(0.0));
    }
    (n > 0 && rows > 0 && cols > 0).then(|| OutPtr(out.as_mut_ptr().cast()))
}

/// `out` as outputs for the products above, which only store finished
/// values into it.
pub(crate) fn as_uninit(out: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has the layout of `f32`, and every writer
    // of the result stores initialised values only, so `out` stays
    // initialised.
    unsafe { &mut *(out as *mut [f32] as *mut [MaybeUninit<f32>]) }
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
        let nb = (x.len() / BLOCK).min(d.len()).min(c.len());
        let mut b0 = 0;
        while b0 + 16 <= nb {
            // SAFETY: blocks `b0..b0 + 16` lie in `x`, `q`, `d` and `c`.
            unsafe {
                quantize16(
                    scheme,
                    x.as_ptr().add(b0 * BLOCK),
                    q.as_mut_ptr().add(b0 * BLOCK),
                    d.as_mut_ptr().add(b0),
                    c.as_mut_ptr().add(b0),
                )
            };
            b0 += 16;
        }
        for (((blk, qb), db), cb) in x[b0 * BLOCK..]
            .chunks_exact(BLOCK)
            .zip(q[b0 * BLOCK..].chunks_exact_mut(BLOCK))
            .zip(d[b0..].iter_mut())
            .zip(c[b0..].iter_mut())
        {
            // SAFETY: a block is 32 floats and 32 bytes.
            unsafe {
                let (finite, abs) = block_abs(blk.as_ptr());
                let amax = _mm512_reduce_max_ps(abs);
                let dd = amax / 127.0;
                let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                *db = if finite { dd * scheme.d_mul } else { f32::NAN };
                let sum = round_block(blk.as_ptr(), _mm512_set1_ps(inv), qb.as_mut_ptr());
                *cb = -scheme.offset * _mm512_reduce_add_epi32(sum);
            }
        }
    }

    /// Whether a block's 32 values are all finite, and their lane-wise
    /// `max(|lo|, |hi|)` (its horizontal max is the block's `amax`).
    ///
    /// # Safety
    /// AVX-512 F present; `x` holds a block.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn block_abs(x: *const f32) -> (bool, __m512) {
        // SAFETY: the caller's contract.
        let (lo, hi) = unsafe { (_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16))) };
        let zero = _mm512_setzero_ps();
        // x·0 is NaN exactly for ±∞ and NaN, and the sum of two such
        // products is NaN when either is: a lane compare, not a horizontal sum.
        let z = _mm512_add_ps(_mm512_mul_ps(lo, zero), _mm512_mul_ps(hi, zero));
        let finite = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(z, z) == 0xFFFF;
        (finite, _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)))
    }

    /// Rounds a block `x·inv` to nearest-even int8 (clamped to ±127) into
    /// `q`'s 32 bytes; returns the lane-wise sum of its two int32 halves.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL present; `x` holds a block and `q` 32 bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn round_block(x: *const f32, inv: __m512, q: *mut u8) -> __m512i {
        let (lo_c, hi_c) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        let round = |v: __m512| {
            let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(v, inv),
            );
            _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo_c), hi_c))
        };
        // SAFETY: the caller's contract.
        unsafe {
            let ql = round(_mm512_loadu_ps(x));
            let qh = round(_mm512_loadu_ps(x.add(16)));
            _mm_storeu_si128(q.cast(), _mm512_cvtsepi32_epi8(ql));
            _mm_storeu_si128(q.add(16).cast(), _mm512_cvtsepi32_epi8(qh));
            _mm512_add_epi32(ql, qh)
        }
    }

    /// Sixteen blocks of [`quantize_avx512`] at once: their 16 maxima and 16
    /// sums are reduced together by one transpose tree ([`reduce16`]) and
    /// their scales divided as one vector, instead of two horizontal
    /// reductions and two scalar divisions per block (each a chain of
    /// dependent shuffles; the rounding of a decode step's activations, on
    /// the step's own thread, was 4% of its time). Same values: max and
    /// integer sums do not depend on the order, the divisions are the same
    /// IEEE operations.
    ///
    /// # Safety
    /// AVX-512 F/BW present; `x`, `q` hold 16 blocks, `d`, `c` 16 values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn quantize16(scheme: Scheme, x: *const f32, q: *mut u8, d: *mut f32, c: *mut i32) {
        // SAFETY (whole body): the caller's contract on the pointers.
        unsafe {
            let zero = _mm512_setzero_ps();
            let mut amax = [zero; 16];
            let mut bad = 0u16;
            for (b, m) in amax.iter_mut().enumerate() {
                let (finite, abs) = block_abs(x.add(b * BLOCK));
                if !finite {
                    bad |= 1 << b;
                }
                *m = abs;
            }
            let amax = reduce16::<false>(amax);
            let dd = _mm512_div_ps(amax, _mm512_set1_ps(127.0));
            let pos = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(amax, zero);
            let inv = _mm512_maskz_div_ps(pos, _mm512_set1_ps(127.0), amax);
            let dm = _mm512_mul_ps(dd, _mm512_set1_ps(scheme.d_mul));
            _mm512_storeu_ps(d, _mm512_mask_mov_ps(dm, bad, _mm512_set1_ps(f32::NAN)));
            let mut invs = [0.0f32; 16];
            _mm512_storeu_ps(invs.as_mut_ptr(), inv);
            // Loops, not `from_fn` / `map` closures: those were left as
            // calls (they do not inherit this function's target features),
            // a third of the rounding's time in a decode step's profile.
            let mut sums = [zero; 16];
            for (b, sum) in sums.iter_mut().enumerate() {
                *sum = _mm512_castsi512_ps(round_block(
                    x.add(b * BLOCK),
                    _mm512_set1_ps(invs[b]),
                    q.add(b * BLOCK),
                ));
            }
            let sums = reduce16::<true>(sums);
            let c_v =
                _mm512_mullo_epi32(_mm512_castps_si512(sums), _mm512_set1_epi32(-scheme.offset));
            _mm512_storeu_si512(c.cast(), c_v);
        }
    }

    /// Lane `b` of the result is the 16 lanes of `v[b]` folded by max
    /// (`ADD = false`) or by int32 addition of their bits (`ADD = true`):
    /// sixteen horizontal reductions as one transpose tree
    /// ([`crate::simd::tree16_level`]: 15 folds and 30 shuffles), then one
    /// permute back to block order. Both folds are associative and
    /// commutative on the values they meet.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn reduce16<const ADD: bool>(v: [__m512; 16]) -> __m512 {
        use crate::simd::{tree16_in_order, tree16_level};
        let mut w = [_mm512_setzero_ps(); 8];
        for (i, o) in w.iter_mut().enumerate() {
            *o = fold::<ADD>(tree16_level::<0>(v[2 * i], v[2 * i + 1]));
        }
        let mut x = [_mm512_setzero_ps(); 4];
        for (i, o) in x.iter_mut().enumerate() {
            *o = fold::<ADD>(tree16_level::<1>(w[2 * i], w[2 * i + 1]));
        }
        let y0 = fold::<ADD>(tree16_level::<2>(x[0], x[1]));
        let y1 = fold::<ADD>(tree16_level::<2>(x[2], x[3]));
        tree16_in_order(fold::<ADD>(tree16_level::<3>(y0, y1)))
    }

    /// One fold of [`reduce16`]: lane-wise max, or int32 sum of the bits.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn fold<const ADD: bool>((a, b): (__m512, __m512)) -> __m512 {
        if ADD {
            _mm512_castsi512_ps(_mm512_add_epi32(
                _mm512_castps_si512(a),
                _mm512_castps_si512(b),
            ))
        } else {
            _mm512_max_ps(a, b)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX-512 rounding (16-block batches and the one-block loop after
    /// them) gives the plain loop's bytes, scales and sums for every finite
    /// block and `d = NaN` for the others, under both schemes.
    #[test]
    fn avx512_rounding_is_the_plain_loop() {
        if !crate::cpu::Isa::Avx512.supported() || !std::is_x86_feature_detected!("avx512bw") {
            eprintln!("skipped: no AVX-512 BW on this CPU");
            return;
        }
        let mut rng = crate::testing::Rng::seeded(5);
        for scheme in [Scheme::MXFP4, Scheme::Q8_0] {
            for blocks in [1, 15, 16, 17, 18, 31, 32, 33, 48, 75] {
                let mut x: Vec<f32> = (0..blocks * BLOCK)
                    .map(|_| (rng.next_f32() - 0.5) * 8.0)
                    .collect();
                // An all-zero block, ties at ±0.5 steps, and non-finite blocks.
                x[..BLOCK].fill(0.0);
                if blocks > 2 {
                    let b = BLOCK;
                    x[b] = 127.0;
                    x[b + 1] = 0.5;
                    x[b + 2] = 1.5;
                    x[b + 3] = -2.5;
                    x[2 * b + 5] = f32::INFINITY;
                }
                if blocks > 20 {
                    x[20 * BLOCK + 7] = f32::NAN;
                }
                let (mut q, mut d, mut c) =
                    (vec![0u8; x.len()], vec![0f32; blocks], vec![0i32; blocks]);
                // SAFETY: checked above.
                unsafe { x86::quantize_avx512(scheme, &x, &mut q, &mut d, &mut c) };
                for b in 0..blocks {
                    let xb = &x[b * BLOCK..(b + 1) * BLOCK];
                    let mut qb = [0u8; BLOCK];
                    let (db, cb) = quantize_block(scheme, xb, &mut qb);
                    if xb.iter().all(|v| v.is_finite()) {
                        assert_eq!(d[b].to_bits(), db.to_bits(), "{blocks} blocks: d of {b}");
                        assert_eq!(c[b], cb, "{blocks} blocks: c of {b}");
                        assert_eq!(
                            &q[b * BLOCK..(b + 1) * BLOCK],
                            &qb,
                            "{blocks} blocks: q of {b}"
                        );
                    } else {
                        assert!(
                            d[b].is_nan() && db.is_nan(),
                            "{blocks} blocks: block {b} is not finite"
                        );
                    }
                }
            }
        }
    }
}
