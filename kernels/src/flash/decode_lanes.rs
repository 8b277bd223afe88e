//! The vector pieces of the batched decode kernel ([`super`]): stored KV
//! values (f32, bf16 or int8) loaded as f32 vectors ([`KvElem`]; int8 values
//! unscaled, the kernel applies the scales per key), the widenings and the
//! keys-in-lanes score reduction per instruction set ([`DecSimd`]), and
//! horizontal max / sum.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

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
