//! Vector operations of the attention kernels ([`crate::flash`]) and the
//! activations ([`crate::activation`]): the [`Simd`] trait with one
//! implementation per instruction set (AVX-512F, AVX2 + FMA, portable), and
//! the vectorised `exp` the online softmax and SiLU use.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Lowest argument of [`exp`] with a normal result; below it `exp` is 0.
pub(crate) const EXP_LO: f32 = -87.3;
/// Highest argument of [`exp`]; above it the argument is clamped.
pub(crate) const EXP_HI: f32 = 88.0;
/// `log2(e)`.
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
/// High part of ln 2 (exact in 9 bits, so `n·LN2_HI` is exact).
pub(crate) const LN2_HI: f32 = 0.693_359_4;
/// Low part of ln 2: `ln 2 − LN2_HI`.
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes `expf` polynomial, highest degree first: `e^r ≈ 1 + r + r²·P(r)`.
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5, // Cephes: 5.0000001201e-1, which rounds to 0.5 in f32.
];

/// Vectorised `e^x` (see the module docs for the method and its accuracy).
///
/// # Safety
/// `S`'s instruction set is supported by the CPU.
#[inline(always)]
pub(crate) unsafe fn exp<S: Simd>(x: S::V) -> S::V {
    let xc = S::min(S::max(x, S::splat(EXP_LO)), S::splat(EXP_HI));
    let n = S::round(S::mul(xc, S::splat(LOG2E)));
    let r = S::fma(n, S::splat(-LN2_HI), xc);
    let r = S::fma(n, S::splat(-LN2_LO), r);
    let mut p = S::splat(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = S::fma(p, r, S::splat(c));
    }
    let y = S::fma(p, S::mul(r, r), S::add(r, S::splat(1.0)));
    let y = S::scale_pow2(y, n);
    S::select_gt(S::splat(EXP_LO), x, S::zero(), y)
}

/// Level `L` (0..=3) of the 16-vector transpose tree that sums (or maxes)
/// sixteen vectors into one lane each: the two vectors whose lane-wise `op`
/// combines `a` and `b`, each holding the partials of `2^L` items. Halves
/// (lanes 0–7 of `a`'s items, 8–15 of `b`'s), quarters (128-bit lane `k`
/// holds item `k`'s 4 partials), pairs (in 128-bit lane `k`, elements 0–1
/// item `k`, 2–3 item `4 + k`), then single lanes (element `j` of 128-bit
/// lane `k` is item `k + 4j`, see [`tree16_in_order`]).
///
/// # Safety
/// AVX-512 F present.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn tree16_level<const L: u32>(a: __m512, b: __m512) -> (__m512, __m512) {
    match L {
        0 => (
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        ),
        1 => (
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        ),
        2 => (
            _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
        ),
        _ => (
            _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
            _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
        ),
    }
}

/// The last level's vector of [`tree16_level`] with lane `i` holding item `i`.
///
/// # Safety
/// AVX-512 F present.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn tree16_in_order(v: __m512) -> __m512 {
    let back = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(back, v)
}

/// The vector operations the kernels need; one implementation per
/// instruction set. Every method is `unsafe` because it may only run on a
/// CPU with that instruction set.
pub(crate) trait Simd {
    /// f32 lanes in a vector.
    const LANES: usize;
    /// 32 vector registers (larger register blocks) rather than 16.
    const WIDE: bool;
    /// A vector of `LANES` f32.
    type V: Copy;
    /// All lanes 0.
    unsafe fn zero() -> Self::V;
    /// All lanes `x`.
    unsafe fn splat(x: f32) -> Self::V;
    /// Loads `LANES` values (any alignment).
    unsafe fn load(p: *const f32) -> Self::V;
    /// Stores `LANES` values (any alignment).
    unsafe fn store(p: *mut f32, v: Self::V);
    /// `a + b`.
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// `a − b`.
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    /// `a · b`.
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// `a / b` (correctly rounded).
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    /// `a · b + c` (fused where the hardware has it).
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// Lane-wise maximum.
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// Lane-wise minimum.
    unsafe fn min(a: Self::V, b: Self::V) -> Self::V;
    /// Rounds to the nearest integer (ties to even).
    unsafe fn round(a: Self::V) -> Self::V;
    /// `y · 2^n` for integral `n` in `[−126, 127]`.
    unsafe fn scale_pow2(y: Self::V, n: Self::V) -> Self::V;
    /// Lane-wise `if a > b { x } else { y }`.
    unsafe fn select_gt(a: Self::V, b: Self::V, x: Self::V, y: Self::V) -> Self::V;
}

/// Implements [`Simd`] for an x86 instruction set: the element-wise methods
/// map one-to-one onto the intrinsics named in brackets, the other three
/// (`round`, `scale_pow2`, `select_gt`) are written out by the caller.
#[cfg(target_arch = "x86_64")]
macro_rules! x86_simd {
    (
        $name:ident, $feat:literal, $v:ty, $lanes:literal, $wide:literal,
        [$zero:ident, $splat:ident, $load:ident, $store:ident, $add:ident,
         $sub:ident, $mul:ident, $div:ident, $fma:ident, $max:ident, $min:ident],
        |$a:ident, $b:ident, $x:ident, $y:ident| round: $round:expr,
        scale_pow2: $scale:expr, select_gt: $select:expr $(,)?
    ) => {
        impl Simd for $name {
            const LANES: usize = $lanes;
            const WIDE: bool = $wide;
            type V = $v;
            x86_simd!(@ $feat, zero() -> $v, $zero());
            x86_simd!(@ $feat, splat(x: f32) -> $v, $splat(x));
            x86_simd!(@ $feat, load(p: *const f32) -> $v, $load(p));
            x86_simd!(@ $feat, store(p: *mut f32, v: $v) -> (), $store(p, v));
            x86_simd!(@ $feat, add(a: $v, b: $v) -> $v, $add(a, b));
            x86_simd!(@ $feat, sub(a: $v, b: $v) -> $v, $sub(a, b));
            x86_simd!(@ $feat, mul(a: $v, b: $v) -> $v, $mul(a, b));
            x86_simd!(@ $feat, div(a: $v, b: $v) -> $v, $div(a, b));
            x86_simd!(@ $feat, fma(a: $v, b: $v, c: $v) -> $v, $fma(a, b, c));
            x86_simd!(@ $feat, max(a: $v, b: $v) -> $v, $max(a, b));
            x86_simd!(@ $feat, min(a: $v, b: $v) -> $v, $min(a, b));
            x86_simd!(@ $feat, round($a: $v) -> $v, $round);
            x86_simd!(@ $feat, scale_pow2($a: $v, $b: $v) -> $v, $scale);
            x86_simd!(@ $feat, select_gt($a: $v, $b: $v, $x: $v, $y: $v) -> $v, $select);
        }
    };
    (@ $feat:literal, $f:ident($($arg:ident: $t:ty),*) -> $r:ty, $body:expr) => {
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn $f($($arg: $t),*) -> $r {
            $body
        }
    };
}

/// AVX-512F kernels.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx512;

#[cfg(target_arch = "x86_64")]
x86_simd!(
    Avx512, "avx512f", __m512, 16, true,
    [_mm512_setzero_ps, _mm512_set1_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_add_ps,
     _mm512_sub_ps, _mm512_mul_ps, _mm512_div_ps, _mm512_fmadd_ps, _mm512_max_ps, _mm512_min_ps],
    |a, b, x, y| round: _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(a),
    // scalef computes a·2^floor(b) with b integral here.
    scale_pow2: _mm512_scalef_ps(a, b),
    select_gt: _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, b), y, x),
);

/// AVX2 + FMA kernels.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx2;

#[cfg(target_arch = "x86_64")]
x86_simd!(
    Avx2, "avx2,fma", __m256, 8, false,
    [_mm256_setzero_ps, _mm256_set1_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_add_ps,
     _mm256_sub_ps, _mm256_mul_ps, _mm256_div_ps, _mm256_fmadd_ps, _mm256_max_ps, _mm256_min_ps],
    |a, b, x, y| round: _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(a),
    // 2^b built in the exponent field: (b + 127) << 23.
    scale_pow2: _mm256_mul_ps(a, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(
        _mm256_add_epi32(_mm256_cvtps_epi32(b), _mm256_set1_epi32(127))
    ))),
    select_gt: _mm256_blendv_ps(y, x, _mm256_cmp_ps::<_CMP_GT_OQ>(a, b)),
);

/// Portable kernels on 8-lane arrays (the compiler vectorises the loops for
/// the baseline target); the path off x86-64 and an oracle for the others.
pub(crate) struct Portable;

/// Defines lane-wise binary methods of [`Portable`] from a scalar body.
macro_rules! portable_binary {
    ($($f:ident: |$x:ident, $y:ident| $e:expr;)*) => {$(
        #[inline(always)]
        unsafe fn $f(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
            std::array::from_fn(|i| {
                let ($x, $y) = (a[i], b[i]);
                $e
            })
        }
    )*};
}

impl Simd for Portable {
    const LANES: usize = 8;
    const WIDE: bool = false;
    type V = [f32; 8];
    portable_binary! {
        add: |x, y| x + y;
        sub: |x, y| x - y;
        mul: |x, y| x * y;
        div: |x, y| x / y;
        max: |x, y| if x > y { x } else { y };
        min: |x, y| if x < y { x } else { y };
        scale_pow2: |y, n| y * f32::from_bits(((n as i32 + 127) as u32) << 23);
    }
    #[inline(always)]
    unsafe fn zero() -> [f32; 8] {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> [f32; 8] {
        [x; 8]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> [f32; 8] {
        p.cast::<[f32; 8]>().read_unaligned()
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: [f32; 8]) {
        p.cast::<[f32; 8]>().write_unaligned(v)
    }
    #[inline(always)]
    unsafe fn fma(a: [f32; 8], b: [f32; 8], c: [f32; 8]) -> [f32; 8] {
        // Unfused: `f32::mul_add` is a slow libm call without hardware FMA.
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    unsafe fn round(a: [f32; 8]) -> [f32; 8] {
        a.map(f32::round_ties_even)
    }
    #[inline(always)]
    unsafe fn select_gt(a: [f32; 8], b: [f32; 8], x: [f32; 8], y: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| if a[i] > b[i] { x[i] } else { y[i] })
    }
}
