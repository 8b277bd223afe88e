//! The vector pieces of the batched decode kernel ([`super`]): stored KV
//! values (f32, bf16 or int8) loaded as f32 vectors ([`KvElem`]; int8 values
//! unscaled, the kernel applies the scales per key), the widenings and the
//! keys-in-lanes score reduction per instruction set ([`DecSimd`]),
//! horizontal max / sum, and the inner QK and PV loops of a piece
//! ([`qk_keys`], [`pv_tile`]).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{DECODE_TILE, PV_ROWS};
#[cfg(target_arch = "x86_64")]
use crate::simd::{Avx2, Avx512};
use crate::simd::{Portable, Simd};

/// Largest lane.
#[inline(always)]
pub(super) unsafe fn hmax<S: Simd>(v: S::V) -> f32 {
    let mut buf = [0.0f32; 16];
    S::store(buf.as_mut_ptr(), v);
    buf[..S::LANES]
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// Sum of the lanes.
#[inline(always)]
pub(super) unsafe fn hsum<S: Simd>(v: S::V) -> f32 {
    let mut buf = [0.0f32; 16];
    S::store(buf.as_mut_ptr(), v);
    buf[..S::LANES].iter().sum()
}

/// A stored KV value type, loaded into f32 vectors.
pub(super) trait KvElem: Copy {
    /// `LANES` values widened to f32.
    unsafe fn load<S: DecSimd>(p: *const Self) -> S::V;
    /// `n < LANES` values widened to f32, the other lanes 0.
    unsafe fn load_part<S: DecSimd>(p: *const Self, n: usize) -> S::V;
}

impl KvElem for f32 {
    #[inline(always)]
    unsafe fn load<S: DecSimd>(p: *const f32) -> S::V {
        S::load(p)
    }
    #[inline(always)]
    unsafe fn load_part<S: DecSimd>(p: *const f32, n: usize) -> S::V {
        let mut buf = [0.0f32; 16];
        std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n);
        S::load(buf.as_ptr())
    }
}

impl KvElem for u16 {
    #[inline(always)]
    unsafe fn load<S: DecSimd>(p: *const u16) -> S::V {
        S::load_bf16(p)
    }
    #[inline(always)]
    unsafe fn load_part<S: DecSimd>(p: *const u16, n: usize) -> S::V {
        let mut buf = [0u16; 16];
        std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n);
        S::load_bf16(buf.as_ptr())
    }
}

impl KvElem for i8 {
    #[inline(always)]
    unsafe fn load<S: DecSimd>(p: *const i8) -> S::V {
        S::load_i8(p)
    }
    #[inline(always)]
    unsafe fn load_part<S: DecSimd>(p: *const i8, n: usize) -> S::V {
        let mut buf = [0i8; 16];
        std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n);
        S::load_i8(buf.as_ptr())
    }
}

/// The operations the decode kernel needs beyond [`Simd`].
pub(in crate::flash) trait DecSimd: Simd {
    /// `LANES` bf16 values widened to f32 (exact: a bf16 is the high half
    /// of an f32).
    unsafe fn load_bf16(p: *const u16) -> Self::V;
    /// `LANES` int8 values converted to f32 (exact).
    unsafe fn load_i8(p: *const i8) -> Self::V;
    /// Reads `LANES` vectors of `LANES` values (vector `j` at
    /// `p + j·LANES`) and returns the vector whose lane `j` is the sum of
    /// vector `j`'s lanes.
    unsafe fn reduce(p: *const f32) -> Self::V;
}

/// Sum of each of 8 vectors into one lane each (lane `j` = Σ `v[j]`).
///
/// # Safety
/// The CPU supports AVX.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx")]
unsafe fn reduce8(v: [__m256; 8]) -> __m256 {
    let t0 = _mm256_hadd_ps(v[0], v[1]);
    let t1 = _mm256_hadd_ps(v[2], v[3]);
    let t2 = _mm256_hadd_ps(v[4], v[5]);
    let t3 = _mm256_hadd_ps(v[6], v[7]);
    // Per 128-bit half: [Σv0, Σv1, Σv2, Σv3] of that half's lanes.
    let u0 = _mm256_hadd_ps(t0, t1);
    let u1 = _mm256_hadd_ps(t2, t3);
    let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
    let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
    _mm256_add_ps(lo, hi)
}

#[cfg(target_arch = "x86_64")]
impl DecSimd for Avx512 {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_bf16(p: *const u16) -> __m512 {
        let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_i8(p: *const i8) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn reduce(p: *const f32) -> __m512 {
        // Halve each vector to 8 lanes, then two 8-vector reductions.
        let half = |j: usize| {
            let v = _mm512_loadu_ps(p.add(16 * j));
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            _mm256_add_ps(_mm512_castps512_ps256(v), hi)
        };
        let lo = reduce8(std::array::from_fn(half));
        let hi = reduce8(std::array::from_fn(|j| half(j + 8)));
        let wide = _mm512_castps_pd(_mm512_castps256_ps512(lo));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(wide, _mm256_castps_pd(hi)))
    }
}

#[cfg(target_arch = "x86_64")]
impl DecSimd for Avx2 {
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_bf16(p: *const u16) -> __m256 {
        let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_i8(p: *const i8) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn reduce(p: *const f32) -> __m256 {
        reduce8(std::array::from_fn(|j| _mm256_loadu_ps(p.add(8 * j))))
    }
}

impl DecSimd for Portable {
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> [f32; 8] {
        std::array::from_fn(|i| f32::from_bits((*p.add(i) as u32) << 16))
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> [f32; 8] {
        std::array::from_fn(|i| *p.add(i) as f32)
    }
    #[inline(always)]
    unsafe fn reduce(p: *const f32) -> [f32; 8] {
        std::array::from_fn(|j| (0..8).map(|i| *p.add(8 * j + i)).sum())
    }
}

/// Partial dot products of `GB` query heads with each key of `koff` (at
/// most `LANES`): for head `r` and key `kk`, stores the `LANES`-wide vector
/// of per-lane sums at `part + r·stride + kk·LANES`. Keys are the inner
/// loop, so a head dimension of up to 4 vectors keeps the `GB` heads' query
/// values in registers across the keys.
///
/// # Safety
/// `q` holds `GB` rows of `hdp` values; each `base + koff[kk]` has `hd`
/// readable values.
#[inline(always)]
pub(super) unsafe fn qk_keys<S: DecSimd, T: KvElem, const GB: usize>(
    q: *const f32,
    hdp: usize,
    hd: usize,
    base: *const T,
    koff: &[usize],
    part: *mut f32,
    stride: usize,
) {
    let lanes = S::LANES;
    let full = hd / lanes;
    if full * lanes == hd {
        let args = (q, hdp, base, koff, part, stride);
        match full {
            1 => return qk_whole::<S, T, GB, 1>(args),
            2 => return qk_whole::<S, T, GB, 2>(args),
            3 => return qk_whole::<S, T, GB, 3>(args),
            4 => return qk_whole::<S, T, GB, 4>(args),
            _ => {}
        }
    }
    for (kk, &off) in koff.iter().enumerate() {
        let k = base.add(off);
        let mut acc = [S::zero(); GB];
        for c in 0..full {
            let kv = T::load::<S>(k.add(c * lanes));
            for (r, a) in acc.iter_mut().enumerate() {
                *a = S::fma(kv, S::load(q.add(r * hdp + c * lanes)), *a);
            }
        }
        if full * lanes < hd {
            let kv = T::load_part::<S>(k.add(full * lanes), hd - full * lanes);
            for (r, a) in acc.iter_mut().enumerate() {
                *a = S::fma(kv, S::load(q.add(r * hdp + full * lanes)), *a);
            }
        }
        for (r, &a) in acc.iter().enumerate() {
            S::store(part.add(r * stride + kk * lanes), a);
        }
    }
}

/// [`qk_keys`] for a head dimension of `FULL` whole vectors: the loop over
/// them unrolled, so the `GB` heads' query vectors stay in registers across
/// the keys (with a run-time count LLVM kept them on the stack).
///
/// # Safety
/// As [`qk_keys`], with `hd = FULL·LANES`.
#[inline(always)]
unsafe fn qk_whole<S: DecSimd, T: KvElem, const GB: usize, const FULL: usize>(
    (q, hdp, base, koff, part, stride): (*const f32, usize, *const T, &[usize], *mut f32, usize),
) {
    let lanes = S::LANES;
    let mut qv = [[S::zero(); FULL]; GB];
    for (r, row) in qv.iter_mut().enumerate() {
        for (c, v) in row.iter_mut().enumerate() {
            *v = S::load(q.add(r * hdp + c * lanes));
        }
    }
    for (kk, &off) in koff.iter().enumerate() {
        let k = base.add(off);
        let mut acc = [S::zero(); GB];
        for c in 0..FULL {
            let kv = T::load::<S>(k.add(c * lanes));
            for (a, row) in acc.iter_mut().zip(&qv) {
                *a = S::fma(kv, row[c], *a);
            }
        }
        for (r, &a) in acc.iter().enumerate() {
            S::store(part.add(r * stride + kk * lanes), a);
        }
    }
}

/// `O[r] = α[r]·O[r] + Σ_j P[r][j]·V[j]` over the `nk` keys of a tile, for
/// every head `r < g`.
///
/// # Safety
/// `p` is `[g][DECODE_TILE]`, `o` `[g][vdp]`, `alpha` `g`; every `voff`
/// names `vd` readable values of `base`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn pv_tile<S: DecSimd, T: KvElem>(
    p: *const f32,
    nk: usize,
    base: *const T,
    voff: &[usize],
    vd: usize,
    vdp: usize,
    g: usize,
    o: *mut f32,
    alpha: *const f32,
) {
    let lanes = S::LANES;
    let chunks = vd.div_ceil(lanes);
    let nc = if S::WIDE { 4 } else { 2 };
    let mut c = 0;
    while c < chunks {
        let step = nc.min(chunks - c);
        let mut r0 = 0;
        while r0 < g {
            let gb = PV_ROWS.min(g - r0);
            let (pr, or, ar) = (p.add(r0 * DECODE_TILE), o.add(r0 * vdp), alpha.add(r0));
            let args = PvArgs {
                p: pr,
                nk,
                base,
                voff,
                c0: c * lanes,
                vd,
                vdp,
                o: or,
                alpha: ar,
            };
            match step {
                4 => with_rows!(gb, pv_block::<S, T, 4>(&args)),
                3 => with_rows!(gb, pv_block::<S, T, 3>(&args)),
                2 => with_rows!(gb, pv_block::<S, T, 2>(&args)),
                _ => with_rows!(gb, pv_block::<S, T, 1>(&args)),
            }
            r0 += gb;
        }
        c += step;
    }
}

/// The arguments of one [`pv_block`].
struct PvArgs<'a, T> {
    /// Probabilities of the block's first head, rows `DECODE_TILE` apart.
    p: *const f32,
    /// Keys in the tile.
    nk: usize,
    /// The layer buffer.
    base: *const T,
    /// V row offsets of the tile's keys.
    voff: &'a [usize],
    /// First value dim of the block.
    c0: usize,
    /// Value dims of a head.
    vd: usize,
    /// Row stride of `o`.
    vdp: usize,
    /// Output rows of the block's first head.
    o: *mut f32,
    /// Rescale factors of the block's heads.
    alpha: *const f32,
}

/// `NC` value vectors from `c0` × `GB` heads of [`pv_tile`], accumulators in
/// registers across the tile. The last vector of a head may be partial
/// (`vd` not a multiple of `LANES`): its V values are loaded zero-padded.
///
/// # Safety
/// As [`pv_tile`], with `c0 + (NC − 1)·LANES < vd`.
#[inline(always)]
unsafe fn pv_block<S: DecSimd, T: KvElem, const NC: usize, const GB: usize>(a: &PvArgs<'_, T>) {
    let lanes = S::LANES;
    // Plain loops, not `std::array::from_fn`: its closures do not take the
    // caller's target features, so the vector operations in them became
    // calls (seen in the profile of an 8-sequence decode step).
    let mut acc = [[S::zero(); NC]; GB];
    for (r, acc_r) in acc.iter_mut().enumerate() {
        let al = S::splat(*a.alpha.add(r));
        for (c, x) in acc_r.iter_mut().enumerate() {
            *x = S::mul(S::load(a.o.add(r * a.vdp + a.c0 + c * lanes)), al);
        }
    }
    let tail = a.c0 + NC * lanes > a.vd;
    for jj in 0..a.nk {
        let vp = a.base.add(a.voff[jj] + a.c0);
        let mut v = [S::zero(); NC];
        for (c, vc) in v.iter_mut().enumerate() {
            *vc = if tail && c == NC - 1 {
                T::load_part::<S>(vp.add(c * lanes), a.vd - a.c0 - c * lanes)
            } else {
                T::load::<S>(vp.add(c * lanes))
            };
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let pr = S::splat(*a.p.add(r * DECODE_TILE + jj));
            for (x, &vc) in acc_r.iter_mut().zip(&v) {
                *x = S::fma(pr, vc, *x);
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (c, &x) in acc_r.iter().enumerate() {
            S::store(a.o.add(r * a.vdp + a.c0 + c * lanes), x);
        }
    }
}
