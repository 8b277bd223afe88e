//! # Q8_0: int8 weights in blocks of 32 with one f32 scale, multiplied packed
//!
//! The format llama.cpp uses for the output layer and token table of its
//! 4-bit model files: each run of [`BLOCK`] = 32 weights along a row stores
//! `q = round(w / d)` as `i8` with `d = max|w| / 127` (so `|q| ≤ 127`), and the
//! block's `d`. Here `q` is a `[rows, cols]` `i8` tensor and `d` a
//! `[rows, cols/32]` f32 tensor — the compressed-tensors "int-quantized" layout
//! with symmetric 8-bit group quantization and group size 32. 9 bits/weight.
//!
//! What lives here:
//! - [`quantize`] / [`dequantize`]: the encoder and the plain decoder (the
//!   oracle of every fast path).
//! - [`matmul_q8_0`]: `y = x · Wᵀ` straight from the int8 blocks. With
//!   [`Activations::F32`] each block is widened in registers and multiplied in
//!   f32 (results differ from an f64 product of the decoded weights only by f32
//!   rounding). With [`Activations::Int8`] the activations are rounded to int8
//!   per 32-element block the same way (llama.cpp's `Q8_0 × Q8_0` dot) and the
//!   block dot products are exact integers (AVX-512 VNNI `vpdpbusd`); where
//!   VNNI is missing the f32 path runs.
//!
//! Work is split over the rayon pool by ranges of weight rows; every weight
//! byte is read once per call whatever the number of activation rows.

use rayon::prelude::*;

pub mod panel;

use crate::cpu::{self, Isa};
use crate::error::{Error, Result};
use crate::split::{for_row_ranges, OutPtr};

/// Weights per block (one scale each).
pub const BLOCK: usize = 32;

/// How activations meet quantized weights in [`matmul_q8_0`] (and the MXFP4
/// kernels' int8 variant). Each quantized [`crate::Matrix`] carries one
/// ([`crate::Matrix::with_activations`]); the default is `F32`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activations {
    /// Activations stay f32: the product equals the decoded weights' f32 GEMM.
    #[default]
    F32,
    /// Activations are rounded to int8 per 32-element block (`d = amax/127`):
    /// integer dot products, about 0.3–1% relative error on the outputs.
    Int8,
}

/// Checks that `q`/`d` describe a `[rows, cols]` Q8_0 matrix.
pub fn check_layout(
    op: &'static str,
    q_len: usize,
    d_len: usize,
    rows: usize,
    cols: usize,
) -> Result<()> {
    if !cols.is_multiple_of(BLOCK) {
        return Err(Error::Shape {
            op,
            detail: format!("Q8_0 needs cols divisible by {BLOCK}, got {cols}"),
        });
    }
    if q_len != rows * cols || d_len != rows * cols / BLOCK {
        return Err(Error::Shape {
            op,
            detail: format!(
                "[{rows}, {cols}] Q8_0 needs {} int8 values and {} scales, got {q_len} and {d_len}",
                rows * cols,
                rows * cols / BLOCK
            ),
        });
    }
    Ok(())
}

/// Rounds one block: `d = max|x| / 127`, `q = round(x / d)` with ties to
/// even (as llama.cpp's SIMD quantizers; its scalar reference rounds ties
/// away from zero, which differs only on exact halves). A zero block gets `d = 0`.
pub fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (o, &v) in q.iter_mut().zip(x) {
        *o = round_even(v * inv).clamp(-127.0, 127.0) as i8;
    }
    d
}

pub use crate::int8_rows::round_even;

/// Quantizes a row-major `[rows, cols]` f32 matrix to Q8_0.
pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Result<(Vec<i8>, Vec<f32>)> {
    check_layout("q8::quantize", w.len(), rows * cols / BLOCK, rows, cols)?;
    let mut q = vec![0i8; w.len()];
    let mut d = vec![0.0f32; w.len() / BLOCK];
    q.par_chunks_mut(BLOCK)
        .zip(d.par_iter_mut())
        .zip(w.par_chunks(BLOCK))
        .for_each(|((qb, db), xb)| *db = quantize_block(xb, qb));
    Ok((q, d))
}

/// The plain decoder: `w = d · q` for every element of `[rows, cols]`.
pub fn dequantize(q: &[i8], d: &[f32], rows: usize, cols: usize) -> Result<Vec<f32>> {
    check_layout("q8::dequantize", q.len(), d.len(), rows, cols)?;
    let mut out = vec![0.0f32; q.len()];
    dequantize_into(q, d, &mut out);
    Ok(out)
}

/// [`dequantize`] into `out` for whole blocks (one row, for embedding
/// lookups): `out[i] = d[i / 32] · q[i]`.
///
/// # Panics
/// Unless `q` and `out` hold `32 · d.len()` values.
pub fn dequantize_into(q: &[i8], d: &[f32], out: &mut [f32]) {
    assert!(
        q.len() == d.len() * BLOCK && out.len() == q.len(),
        "q8::dequantize_into: {} values, {} scales, {} outputs",
        q.len(),
        d.len(),
        out.len()
    );
    for ((o, qb), &s) in out
        .chunks_exact_mut(BLOCK)
        .zip(q.chunks_exact(BLOCK))
        .zip(d)
    {
        for (v, &c) in o.iter_mut().zip(qb) {
            *v = c as f32 * s;
        }
    }
}

/// `out[n, rows] = x[n, cols] · Wᵀ` with `W` in Q8_0 (see the module docs for
/// the two activation modes and their accuracy).
///
/// # Panics
/// If `q`/`d` do not describe `[rows, cols]` or `x`/`out` are not `n` rows.
#[allow(clippy::too_many_arguments)]
pub fn matmul_q8_0(
    x: &[f32],
    n: usize,
    q: &[i8],
    d: &[f32],
    rows: usize,
    cols: usize,
    out: &mut [f32],
    act: Activations,
) {
    if let Err(e) = check_layout("matmul_q8_0", q.len(), d.len(), rows, cols) {
        panic!("{e}");
    }
    assert_eq!(x.len(), n * cols, "matmul_q8_0: x must be [n, cols]");
    assert_eq!(out.len(), n * rows, "matmul_q8_0: out must be [n, rows]");
    if n == 0 || rows == 0 {
        return;
    }
    if act == Activations::Int8 && cpu::features().avx512_vnni {
        return matmul_int8(x, n, q, d, rows, cols, out);
    }
    let out_ptr = OutPtr(out.as_mut_ptr());
    let wide = Isa::Avx2.supported();
    for_row_ranges(rows, cols + cols / BLOCK * 4, MIN_TASK_BYTES, |r0, r1| {
        for r in r0..r1 {
            let (qr, dr) = (
                &q[r * cols..(r + 1) * cols],
                &d[r * cols / BLOCK..(r + 1) * cols / BLOCK],
            );
            for i in 0..n {
                let xi = &x[i * cols..(i + 1) * cols];
                #[cfg(target_arch = "x86_64")]
                let y = if wide {
                    // SAFETY: AVX2 and FMA detected at run time.
                    unsafe { row_dot_f32_avx2(qr, dr, xi) }
                } else {
                    row_dot_f32(qr, dr, xi)
                };
                #[cfg(not(target_arch = "x86_64"))]
                let y = {
                    let _ = wide;
                    row_dot_f32(qr, dr, xi)
                };
                // SAFETY: (i, r) is inside out and row r belongs to this task only.
                unsafe { *out_ptr.get().add(i * rows + r) = y };
            }
        }
    });
}

/// `Σ_b d_b · Σ_j q_bj · x_bj` in f32, eight independent lanes per block so the
/// compiler vectorises it.
#[inline(always)]
fn row_dot_f32(q: &[i8], d: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for ((qb, &s), xb) in q.chunks_exact(BLOCK).zip(d).zip(x.chunks_exact(BLOCK)) {
        let mut t = [0.0f32; 8];
        for (qc, xc) in qb.chunks_exact(8).zip(xb.chunks_exact(8)) {
            for l in 0..8 {
                t[l] += qc[l] as f32 * xc[l];
            }
        }
        for l in 0..8 {
            acc[l] += t[l] * s;
        }
    }
    acc.iter().sum()
}

/// [`row_dot_f32`] compiled for AVX2 + FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_dot_f32_avx2(q: &[i8], d: &[f32], x: &[f32]) -> f32 {
    row_dot_f32(q, d, x)
}

/// Weight bytes a rayon task should stream at least (smaller splits cost more
/// in hand-off than they gain).
const MIN_TASK_BYTES: usize = 64 * 1024;

/// Activation rows rounded to int8 for the VNNI kernel: per row, values as
/// `q + 128` (unsigned, as `vpdpbusd` wants; padded to a whole number of
/// 64-byte steps with `q = 0`) and per lane of each step the block scale `d`
/// (lanes 0–7 hold block `2s`, lanes 8–15 block `2s + 1`).
struct QuantizedRows {
    /// `[n, steps·64]` bytes.
    xq: Vec<u8>,
    /// `[n, steps·16]` lane scales.
    dl: Vec<f32>,
    /// 64-byte steps per row.
    steps: usize,
}

impl QuantizedRows {
    fn new(x: &[f32], n: usize, cols: usize) -> QuantizedRows {
        let steps = cols.div_ceil(2 * BLOCK);
        let mut xq = vec![128u8; n * steps * 64];
        let mut dl = vec![0.0f32; n * steps * 16];
        let mut qb = [0i8; BLOCK];
        for i in 0..n {
            for (b, blk) in x[i * cols..(i + 1) * cols].chunks_exact(BLOCK).enumerate() {
                let d = quantize_block(blk, &mut qb);
                // Non-finite activations must give non-finite outputs.
                let d = if blk.iter().all(|v| v.is_finite()) {
                    d
                } else {
                    f32::NAN
                };
                let o = i * steps * 64 + b * BLOCK;
                for (dst, &v) in xq[o..o + BLOCK].iter_mut().zip(&qb) {
                    *dst = (v as i32 + 128) as u8;
                }
                let l = i * steps * 16 + (b / 2) * 16 + (b % 2) * 8;
                dl[l..l + 8].fill(d);
            }
        }
        QuantizedRows { xq, dl, steps }
    }
}

/// The VNNI product: weight rows four at a time against activation rows four
/// at a time. Only called when the CPU has AVX-512 VNNI
/// ([`cpu::Features::avx512_vnni`]).
fn matmul_int8(
    x: &[f32],
    n: usize,
    q: &[i8],
    d: &[f32],
    rows: usize,
    cols: usize,
    out: &mut [f32],
) {
    let xr = QuantizedRows::new(x, n, cols);
    let out_ptr = OutPtr(out.as_mut_ptr());
    let nb = cols / BLOCK;
    for_row_ranges(rows, cols + nb * 4, MIN_TASK_BYTES, |r0, r1| {
        let row = |r: usize| (&q[r * cols..(r + 1) * cols], &d[r * nb..(r + 1) * nb]);
        let mut r = r0;
        while r < r1 {
            let mw = (r1 - r).min(4);
            let mut i = 0;
            while i < n {
                let nx = (n - i).min(4);
                let mut y = [[0.0f32; 4]; 4];
                #[cfg(target_arch = "x86_64")]
                // SAFETY: VNNI checked by the caller; lengths follow from check_layout.
                unsafe {
                    // Weight rows r + m0 .. r + m0 + MW against activation rows i .. i + NX.
                    macro_rules! call {
                        ($mw:literal, $nx:literal, $m0:expr) => {{
                            let m0 = $m0;
                            let w: [(&[i8], &[f32]); $mw] =
                                std::array::from_fn(|m| row(r + m0 + m));
                            let t = x86::dot_int8::<$mw, $nx>(w, &xr, i);
                            for (ym, tm) in y[m0..].iter_mut().zip(&t) {
                                ym[..$nx].copy_from_slice(tm);
                            }
                        }};
                    }
                    match (mw, nx) {
                        (4, 4) => call!(4, 4, 0),
                        (4, 3) => call!(4, 3, 0),
                        (4, 2) => call!(4, 2, 0),
                        (4, 1) => call!(4, 1, 0),
                        // The last rows of a range, one at a time.
                        _ => {
                            for m in 0..mw {
                                match nx {
                                    4 => call!(1, 4, m),
                                    3 => call!(1, 3, m),
                                    2 => call!(1, 2, m),
                                    _ => call!(1, 1, m),
                                }
                            }
                        }
                    }
                }
                for (m, ym) in y.iter().enumerate().take(mw) {
                    for (k, &v) in ym.iter().enumerate().take(nx) {
                        // SAFETY: (i + k, r + m) is inside out; row r + m is this task's.
                        unsafe { *out_ptr.get().add((i + k) * rows + r + m) = v };
                    }
                }
                i += nx;
            }
            r += mw;
        }
    });
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("matmul_int8 is only reached with AVX-512 VNNI");
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! AVX-512 VNNI kernel. Callers check CPU features and lengths.
    use std::arch::x86_64::*;

    use super::{QuantizedRows, BLOCK};

    /// How far ahead of the current step the weight rows are prefetched.
    const PREFETCH_BYTES: usize = 8192;

    /// `y[m][k] = w_m · x_(i+k)` for `MW` weight rows and `NX` quantized
    /// activation rows, 64 weights (two blocks) per step.
    ///
    /// Activations are stored as `q + 128`, so each lane's `vpdpbusd` sum is
    /// corrected by `−128·Σw` (one more `vpdpbusd` per weight step, shared by
    /// all `NX` rows). The lane sums, exact integers below 2²⁴, become f32 and
    /// are multiplied by `d_w · d_x` of their block.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn dot_int8<const MW: usize, const NX: usize>(
        w: [(&[i8], &[f32]); MW],
        xr: &QuantizedRows,
        i: usize,
    ) -> [[f32; NX]; MW] {
        let cols = w[0].0.len();
        let nb = cols / BLOCK;
        let c128 = _mm512_set1_epi8(-128);
        let zero = _mm512_setzero_si512();
        let lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        let mut acc = [[_mm512_setzero_ps(); NX]; MW];
        for s in 0..xr.steps {
            let two = nb - 2 * s >= 2;
            let mut wv = [zero; MW];
            let mut base = [zero; MW];
            let mut ws = [_mm512_setzero_ps(); MW];
            for (m, (wq, wd)) in w.iter().enumerate() {
                // SAFETY: a step covers blocks 2s and (when `two`) 2s + 1 of the row.
                unsafe {
                    let p = wq.as_ptr().add(s * 2 * BLOCK);
                    // Rows are short (a few hundred bytes): without a hint the
                    // hardware prefetcher does not ramp up within one row.
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES).cast());
                    wv[m] = if two {
                        _mm512_loadu_si512(p.cast())
                    } else {
                        _mm512_maskz_loadu_epi8(u32::MAX as u64, p.cast())
                    };
                    let dv = if two {
                        _mm_castsi128_ps(_mm_loadl_epi64(wd.as_ptr().add(2 * s).cast()))
                    } else {
                        _mm_set_ss(*wd.get_unchecked(2 * s))
                    };
                    ws[m] = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(dv));
                }
                base[m] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, c128, wv[m]));
            }
            // `k` names the activation row as well as the accumulator.
            #[allow(clippy::needless_range_loop)]
            for k in 0..NX {
                let row = i + k;
                // SAFETY: activation rows hold `steps` 64-byte steps and 16 lane scales each.
                let (xv, xd) = unsafe {
                    (
                        _mm512_loadu_si512(xr.xq.as_ptr().add((row * xr.steps + s) * 64).cast()),
                        _mm512_loadu_ps(xr.dl.as_ptr().add((row * xr.steps + s) * 16)),
                    )
                };
                for m in 0..MW {
                    let dot = _mm512_dpbusd_epi32(base[m], xv, wv[m]);
                    acc[m][k] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(dot),
                        _mm512_mul_ps(ws[m], xd),
                        acc[m][k],
                    );
                }
            }
        }
        let mut y = [[0.0f32; NX]; MW];
        for (ym, am) in y.iter_mut().zip(&acc) {
            for (v, a) in ym.iter_mut().zip(am) {
                *v = _mm512_reduce_add_ps(*a);
            }
        }
        y
    }
}

#[cfg(test)]
mod tests;
