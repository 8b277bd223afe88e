//! The vector pieces of the batched decode kernel ([`super`]): stored KV
//! values (f32, bf16 or int8) loaded as f32 vectors ([`KvElem`]; int8 values
//! unscaled, the kernel applies the scales per key), the widenings and the
//! keys-in-lanes score reduction per instruction set ([`DecSimd`]),
//! horizontal max / sum, and the inner QK and PV loops of a piece
//! ([`qk_keys`], [`pv_tile`]). For groups of up to four heads with whole
//! vectors of head dims, [`qk_scores`] sums each key's lanes in registers
//! ([`DecSimd::fold`], the levels of the same transpose tree) instead of
//! storing them for [`DecSimd::reduce`].

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{DECODE_TILE, PV_ROWS, SCORE_HEADS};
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
    /// Whether [`DecSimd::fold`] and [`DecSimd::in_key_order`] sum keys'
    /// lanes in registers ([`qk_scores`]); `false`: only through
    /// [`DecSimd::reduce`].
    const TREE: bool;
    /// Level `L` of the keys' transpose tree (the tree [`DecSimd::reduce`]
    /// runs over a stored tile): `a` and `b` hold the partial sums of two
    /// runs of `2^L` consecutive keys, the result those of both runs.
    unsafe fn fold<const L: u32>(a: Self::V, b: Self::V) -> Self::V;
    /// The tree's last vector with lane `j` holding key `j`'s sum.
    unsafe fn in_key_order(v: Self::V) -> Self::V;
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
    const TREE: bool = true;
    /// [`crate::simd::tree16_level`] with `+`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fold<const L: u32>(a: __m512, b: __m512) -> __m512 {
        let (x, y) = crate::simd::tree16_level::<L>(a, b);
        _mm512_add_ps(x, y)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn in_key_order(v: __m512) -> __m512 {
        crate::simd::tree16_in_order(v)
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
    const TREE: bool = true;
    /// [`reduce8`]'s levels: two horizontal adds, then the 128-bit halves.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn fold<const L: u32>(a: __m256, b: __m256) -> __m256 {
        match L {
            0 | 1 => _mm256_hadd_ps(a, b),
            _ => _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(a, b),
                _mm256_permute2f128_ps::<0x31>(a, b),
            ),
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn in_key_order(v: __m256) -> __m256 {
        v
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
    const TREE: bool = false;
    unsafe fn fold<const L: u32>(_: [f32; 8], _: [f32; 8]) -> [f32; 8] {
        unreachable!("the portable build reduces through memory (TREE is false)")
    }
    unsafe fn in_key_order(v: [f32; 8]) -> [f32; 8] {
        v
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

/// Whether [`qk_scores`] takes `g` heads of dimension `hd` on `S`: a tree
/// build, at most [`SCORE_HEADS`] heads, and 1 to 4 whole vectors a head.
pub(super) fn scores_in_registers<S: DecSimd>(g: usize, hd: usize) -> bool {
    S::TREE && g <= SCORE_HEADS && hd.is_multiple_of(S::LANES) && (1..=4).contains(&(hd / S::LANES))
}

/// The scores of `g` query heads against the keys of `koff` (at most
/// `LANES`): lane `kk` of the vector stored at `s + r·stride` is head `r`'s
/// dot product with key `kk` (unscaled for int8 rows), 0 past the last key.
///
/// [`qk_keys`]' products, summed in registers: each key's lanes enter the
/// transpose tree of [`DecSimd::fold`] as soon as they exist, depth first,
/// so no partial vector goes through memory. The sums associate
/// differently from `qk_keys` + [`DecSimd::reduce`] (f32 rounding only).
///
/// # Safety
/// [`scores_in_registers`]`::<S>(g, hd)`; `q` holds `g` rows of `hdp`
/// values; each `base + koff[kk]` has `hd` readable values; `s + r·stride`
/// is writable for `LANES` values per head.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn qk_scores<S: DecSimd, T: KvElem>(
    g: usize,
    q: *const f32,
    hdp: usize,
    hd: usize,
    base: *const T,
    koff: &[usize],
    s: *mut f32,
    stride: usize,
) {
    macro_rules! rows {
        ($full:literal) => {
            match g {
                1 => tree_scores(
                    &LaneTree::<S, T, 1, $full>::new(q, hdp, base, koff),
                    s,
                    stride,
                ),
                2 => tree_scores(
                    &LaneTree::<S, T, 2, $full>::new(q, hdp, base, koff),
                    s,
                    stride,
                ),
                3 => tree_scores(
                    &LaneTree::<S, T, 3, $full>::new(q, hdp, base, koff),
                    s,
                    stride,
                ),
                _ => tree_scores(
                    &LaneTree::<S, T, 4, $full>::new(q, hdp, base, koff),
                    s,
                    stride,
                ),
            }
        };
    }
    match hd / S::LANES {
        1 => rows!(1),
        2 => rows!(2),
        3 => rows!(3),
        _ => rows!(4),
    }
}

/// One [`qk_scores`] call: `GB` heads' query vectors (`FULL` a head) in
/// registers and the block's keys, the leaves of [`tree_scores`].
struct LaneTree<'a, S: DecSimd, T, const GB: usize, const FULL: usize> {
    qv: [[S::V; FULL]; GB],
    base: *const T,
    koff: &'a [usize],
}

impl<'a, S: DecSimd, T: KvElem, const GB: usize, const FULL: usize> LaneTree<'a, S, T, GB, FULL> {
    #[inline(always)]
    unsafe fn new(q: *const f32, hdp: usize, base: *const T, koff: &'a [usize]) -> Self {
        let mut qv = [[S::zero(); FULL]; GB];
        for (r, row) in qv.iter_mut().enumerate() {
            for (c, v) in row.iter_mut().enumerate() {
                *v = S::load(q.add(r * hdp + c * S::LANES));
            }
        }
        LaneTree { qv, base, koff }
    }
}

impl<S: DecSimd, T: KvElem, const GB: usize, const FULL: usize> KeyLanes<S, GB>
    for LaneTree<'_, S, T, GB, FULL>
{
    #[inline(always)]
    unsafe fn key(&self, kk: usize) -> [S::V; GB] {
        let mut acc = [S::zero(); GB];
        if let Some(&off) = self.koff.get(kk) {
            let k = self.base.add(off);
            for c in 0..FULL {
                let kv = T::load::<S>(k.add(c * S::LANES));
                for (a, row) in acc.iter_mut().zip(&self.qv) {
                    *a = S::fma(kv, row[c], *a);
                }
            }
        }
        acc
    }
}

/// A block's keys as the leaves of the in-register score tree
/// ([`tree_scores`]).
pub(super) trait KeyLanes<S: DecSimd, const GB: usize> {
    /// Key `kk`'s lanes of partial sums for each of `GB` heads (zeros past
    /// the block's last key).
    ///
    /// # Safety
    /// The caller's contract on the block's rows.
    unsafe fn key(&self, kk: usize) -> [S::V; GB];
}

/// Sums each of `keys`' `LANES` keys' lanes with the transpose tree of
/// [`DecSimd::fold`], depth first (a key's lanes enter the tree as soon as
/// they exist, so at most one vector a level waits per head), and stores
/// the `GB` score vectors, lane `j` = key `j`, at `s + r·stride`. Free
/// functions, not closures: `#[inline(always)]` code takes the caller's
/// instruction set when inlined.
///
/// # Safety
/// `S::TREE`; as [`KeyLanes::key`]; `s + r·stride` writable for `LANES`
/// values per head.
#[inline(always)]
pub(super) unsafe fn tree_scores<S: DecSimd, K: KeyLanes<S, GB>, const GB: usize>(
    keys: &K,
    s: *mut f32,
    stride: usize,
) {
    let v = if S::LANES == 16 {
        join::<S, GB, 3>(eight::<S, K, GB>(keys, 0), eight::<S, K, GB>(keys, 8))
    } else {
        eight::<S, K, GB>(keys, 0)
    };
    for (r, &x) in v.iter().enumerate() {
        S::store(s.add(r * stride), S::in_key_order(x));
    }
}

/// Level `L` of the tree for every head.
#[inline(always)]
unsafe fn join<S: DecSimd, const GB: usize, const L: u32>(
    a: [S::V; GB],
    b: [S::V; GB],
) -> [S::V; GB] {
    let mut out = a;
    for r in 0..GB {
        out[r] = S::fold::<L>(a[r], b[r]);
    }
    out
}

/// Keys `kk..kk + 2`, `..+ 4`, `..+ 8` folded.
#[inline(always)]
unsafe fn two<S: DecSimd, K: KeyLanes<S, GB>, const GB: usize>(k: &K, kk: usize) -> [S::V; GB] {
    join::<S, GB, 0>(k.key(kk), k.key(kk + 1))
}
#[inline(always)]
unsafe fn four<S: DecSimd, K: KeyLanes<S, GB>, const GB: usize>(k: &K, kk: usize) -> [S::V; GB] {
    join::<S, GB, 1>(two::<S, K, GB>(k, kk), two::<S, K, GB>(k, kk + 2))
}
#[inline(always)]
unsafe fn eight<S: DecSimd, K: KeyLanes<S, GB>, const GB: usize>(k: &K, kk: usize) -> [S::V; GB] {
    join::<S, GB, 2>(four::<S, K, GB>(k, kk), four::<S, K, GB>(k, kk + 4))
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
