//! x86-64 kernels. Callers check CPU features and slice lengths.
use std::arch::x86_64::*;

use super::{BLOCK_BYTES, BLOCK_ELEMS, E2M1_VALUES, E2M1_X2_U8, E8M0_TABLE};

/// How far ahead of the current block the AVX-512 kernels prefetch packed
/// weights. Consecutive weight rows are adjacent, but each row is only a
/// few KiB, too short for the hardware prefetcher to ramp up: without the
/// hint a DRAM-cold [4096 × 4096] GEMV streamed 8.4 GB/s on one thread,
/// with 4–32 KiB ahead 18–23 GB/s. Default 8 KiB.
const PREFETCH_BYTES: usize = 8 * 1024;

/// AVX-512 `rows_dot`. Per block and weight row: the 16-entry value table
/// times the block scale, then two `vpermps` lookups (which read only the
/// low 4 index bits, so the low nibble needs no mask) give the scaled even
/// and odd elements; each (weight row, activation row) pair keeps two
/// accumulators.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn rows_dot_avx512<const MW: usize, const NX: usize>(
    w: [(&[u8], &[u8]); MW],
    xs: [&[f32]; NX],
) -> [[f32; NX]; MW] {
    let nb = w[0].1.len();
    let lut = unsafe { _mm512_loadu_ps(E2M1_VALUES.as_ptr()) };
    let mut acc = [[[_mm512_setzero_ps(); 2]; NX]; MW];
    for b in 0..nb {
        let mut we = [_mm512_setzero_ps(); MW];
        let mut wo = [_mm512_setzero_ps(); MW];
        for (m, (wb, ws)) in w.iter().enumerate() {
            if b % 4 == 0 {
                prefetch(wb.as_ptr().wrapping_add(b * BLOCK_BYTES + PREFETCH_BYTES));
            }
            // SAFETY: every weight row has 16·nb bytes (asserted by the caller).
            let v = _mm512_cvtepu8_epi32(unsafe {
                _mm_loadu_si128(wb.as_ptr().add(b * BLOCK_BYTES).cast())
            });
            let table = _mm512_mul_ps(lut, _mm512_set1_ps(E8M0_TABLE[ws[b] as usize]));
            we[m] = _mm512_permutexvar_ps(v, table);
            wo[m] = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), table);
        }
        for (i, x) in xs.iter().enumerate() {
            // SAFETY: every activation row has 32·nb floats (asserted by the caller).
            let (xe, xo) = unsafe {
                let p = x.as_ptr().add(b * BLOCK_ELEMS);
                (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)))
            };
            for m in 0..MW {
                acc[m][i][0] = _mm512_fmadd_ps(we[m], xe, acc[m][i][0]);
                acc[m][i][1] = _mm512_fmadd_ps(wo[m], xo, acc[m][i][1]);
            }
        }
    }
    // Plain loops, not closures: a closure would not inherit the target
    // features and the reduction would not be inlined.
    let mut y = [[0.0f32; NX]; MW];
    for (ym, am) in y.iter_mut().zip(&acc) {
        for (v, a) in ym.iter_mut().zip(am) {
            *v = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
        }
    }
    y
}

/// Hints the cache line at `p` into L1 (a hint: never faults, any address).
#[inline]
#[target_feature(enable = "sse")]
fn prefetch(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(p.cast());
}

/// Eight codes (i32 lanes) → E2M1 values: 8-entry lookup of the magnitude
/// by the low 3 bits, then code bit 3 moved to the f32 sign.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn codes_avx2(c: __m256i, lut8: __m256) -> __m256 {
    let sign = _mm256_and_si256(_mm256_slli_epi32::<28>(c), _mm256_set1_epi32(i32::MIN));
    _mm256_xor_ps(_mm256_permutevar8x32_ps(lut8, c), _mm256_castsi256_ps(sign))
}

/// Sum of the eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum_avx2(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

/// AVX2+FMA single-row `rows_dot`: one block per step, two accumulators per row.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn row_dot_avx2<const NX: usize>(
    wb: &[u8],
    ws: &[u8],
    xs: [&[f32]; NX],
) -> [f32; NX] {
    let lut8 = unsafe { _mm256_loadu_ps(E2M1_VALUES.as_ptr()) };
    let m4 = _mm256_set1_epi32(0xF);
    let mut acc = [[_mm256_setzero_ps(); 2]; NX];
    for (b, &e) in ws.iter().enumerate() {
        // SAFETY: wb has 16·nb bytes, each xs row 32·nb floats (asserted by the caller).
        let (v0, v1) = unsafe {
            let p = wb.as_ptr().add(b * BLOCK_BYTES);
            (
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())),
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8).cast())),
            )
        };
        let s = _mm256_set1_ps(E8M0_TABLE[e as usize]);
        // Elements 0,2..14 | 16,18..30 | 1,3..15 | 17,19..31: the permuted x order.
        let w = [
            _mm256_mul_ps(codes_avx2(_mm256_and_si256(v0, m4), lut8), s),
            _mm256_mul_ps(codes_avx2(_mm256_and_si256(v1, m4), lut8), s),
            _mm256_mul_ps(codes_avx2(_mm256_srli_epi32::<4>(v0), lut8), s),
            _mm256_mul_ps(codes_avx2(_mm256_srli_epi32::<4>(v1), lut8), s),
        ];
        for (a, x) in acc.iter_mut().zip(&xs) {
            // SAFETY: as above.
            unsafe {
                let p = x.as_ptr().add(b * BLOCK_ELEMS);
                a[0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(p), a[0]);
                a[1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(p.add(8)), a[1]);
                a[0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(p.add(16)), a[0]);
                a[1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(p.add(24)), a[1]);
            }
        }
    }
    let mut y = [0.0f32; NX];
    for (v, a) in y.iter_mut().zip(&acc) {
        *v = hsum_avx2(_mm256_add_ps(a[0], a[1]));
    }
    y
}

/// AVX-512 VNNI int8 dot: four blocks (64 bytes) per step.
///
/// Codes become doubled weights plus 12 (unsigned, as `vpdpbusd` wants)
/// via `vpshufb`; activations are signed int8. Each lane's sum starts at
/// the activations' `−12·Σq` for that lane (prepared once per activation
/// row), which cancels the offset, so no per-weight correction is needed.
/// Lane `l` of a step belongs to block `l / 4`; its float weight is the
/// E8M0 scale (exponent bits shifted into place) times the activation's `d/2`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn q8_dot_avx512<const MW: usize, const NX: usize>(
    w: [(&[u8], &[u8]); MW],
    xs: [(&[u8], &[f32], &[i32]); NX],
) -> [[f32; NX]; MW] {
    let nb = w[0].1.len();
    let lut = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(E2M1_X2_U8.as_ptr().cast()) });
    let m4 = _mm512_set1_epi8(0x0F);
    // pshufb pattern: in 128-bit lane k every dword takes byte k, zero-extended.
    let sidx = _mm512_set_epi32(
        0x8080_8003u32 as i32,
        0x8080_8003u32 as i32,
        0x8080_8003u32 as i32,
        0x8080_8003u32 as i32,
        0x8080_8002u32 as i32,
        0x8080_8002u32 as i32,
        0x8080_8002u32 as i32,
        0x8080_8002u32 as i32,
        0x8080_8001u32 as i32,
        0x8080_8001u32 as i32,
        0x8080_8001u32 as i32,
        0x8080_8001u32 as i32,
        0x8080_8000u32 as i32,
        0x8080_8000u32 as i32,
        0x8080_8000u32 as i32,
        0x8080_8000u32 as i32,
    );
    let lane4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    let mut acc = [[_mm512_setzero_ps(); NX]; MW];
    for g in 0..nb.div_ceil(4) {
        let k = (nb - 4 * g).min(4);
        let mut wl = [_mm512_setzero_si512(); MW];
        let mut wh = [_mm512_setzero_si512(); MW];
        let mut wscale = [_mm512_setzero_ps(); MW];
        for (m, (wb, ws)) in w.iter().enumerate() {
            let e4 = if k == 4 {
                u32::from_le_bytes([ws[4 * g], ws[4 * g + 1], ws[4 * g + 2], ws[4 * g + 3]])
            } else {
                // Padding blocks get scale 2^0: finite (their activations are zero).
                let mut e = [127u8; 4];
                for (j, v) in e.iter_mut().enumerate().take(k) {
                    *v = ws[4 * g + j];
                }
                u32::from_le_bytes(e)
            };
            prefetch(
                wb.as_ptr()
                    .wrapping_add(g * 4 * BLOCK_BYTES + PREFETCH_BYTES),
            );
            // SAFETY: the masked load reads only the 16·k bytes of blocks 4g..4g+k.
            let wv = unsafe {
                let p = wb.as_ptr().add(g * 4 * BLOCK_BYTES);
                if k == 4 {
                    _mm512_loadu_si512(p.cast())
                } else {
                    _mm512_maskz_loadu_epi8((1u64 << (16 * k)) - 1, p.cast())
                }
            };
            wl[m] = _mm512_shuffle_epi8(lut, _mm512_and_si512(wv, m4));
            wh[m] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(wv), m4));
            let e = _mm512_shuffle_epi8(_mm512_set1_epi32(e4 as i32), sidx);
            let mut sbits = _mm512_slli_epi32::<23>(e);
            // Bytes 0 (2^-127, subnormal) and 255 (NaN) do not follow e << 23:
            // a zero byte in e4 or in !e4 sends them down the slow path.
            let has_zero = |v: u32| v.wrapping_sub(0x0101_0101) & !v & 0x8080_8080 != 0;
            if has_zero(e4) || has_zero(!e4) {
                let zero = _mm512_setzero_si512();
                sbits = _mm512_mask_mov_epi32(
                    sbits,
                    _mm512_cmpeq_epi32_mask(e, zero),
                    _mm512_set1_epi32(0x0040_0000),
                );
                sbits = _mm512_mask_mov_epi32(
                    sbits,
                    _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)),
                    _mm512_set1_epi32(0x7FC0_0000),
                );
            }
            wscale[m] = _mm512_castsi512_ps(sbits);
        }
        for (i, (q, d, c)) in xs.iter().enumerate() {
            // SAFETY: q has 128 bytes, d 4 floats and c 16 sums per group
            // (asserted by the caller).
            let (xe, xo, dv, base) = unsafe {
                (
                    _mm512_loadu_si512(q.as_ptr().add(g * 128).cast()),
                    _mm512_loadu_si512(q.as_ptr().add(g * 128 + 64).cast()),
                    _mm512_castps128_ps512(_mm_loadu_ps(d.as_ptr().add(g * 4))),
                    _mm512_loadu_si512(c.as_ptr().add(g * 16).cast()),
                )
            };
            let dv = _mm512_permutexvar_ps(lane4, dv);
            for m in 0..MW {
                let dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(base, wl[m], xe), wh[m], xo);
                acc[m][i] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(dot),
                    _mm512_mul_ps(wscale[m], dv),
                    acc[m][i],
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
