//! bf16 pair products for the keys-in-lanes decode pieces ([`super`]) over
//! bf16 rows, on CPUs with AVX-512 BF16: the `QK` step as `vdpbf16ps`, each
//! instruction two bf16 multiply-adds per f32 lane (twice an FMA's work),
//! with the K rows read in place as 32 bf16 values a vector instead of
//! being widened to f32 16 at a time.
//!
//! A head's query `scale·q` is rounded to bf16 once per piece and packed as
//! dword pairs (`(q[2p], q[2p+1])`, [`pack`]); against a key row's vector
//! `c` (dims `32c .. 32c + 32`, read as 16 dwords) lane `l` accumulates
//! dims `2l` and `2l + 1` of each vector. For groups of up to
//! [`SCORE_HEADS`] heads (SmolLM2's 3) [`qk_scores`] sums each key's lanes
//! in registers as the keys arrive, one transpose tree per 16 keys (the
//! f32 products' [`tree_scores`]), and
//! stores finished score vectors; larger groups store the lanes' partial
//! sums in the f32 loop's `part` layout ([`super::lanes::qk_keys`]) for its
//! transpose reduction. The online softmax and `PV` are the same either way.
//!
//! Rounding `scale·q` to bf16 is the only difference from the f32 kernel
//! (the rows are bf16 already; products and sums are f32): a relative step
//! of 2⁻⁹ on the scores' query inputs, as the prefill kernel's bf16 pieces
//! ([`super::super::bf16`]) take. The tests state the tolerance against the
//! f32 kernel; `CARACAL_ATTENTION_PRODUCTS=f32` turns these products off.

use std::arch::x86_64::*;

use super::lanes::{tree_scores, KeyLanes};
use super::SCORE_HEADS;
use crate::simd::Avx512;

/// Largest head dimension, in 32-value vectors, the unrolled loop takes.
const MAX_VECTORS: usize = 4;

/// Whether keys-in-lanes pieces over bf16 rows of head dimension `hd` take
/// pair products: [`super::super::bf16::enabled`] and `hd` a multiple of 32
/// up to 128 (whole vectors of pairs).
pub(super) fn usable(hd: usize) -> bool {
    super::super::bf16::enabled() && hd.is_multiple_of(32) && hd / 32 <= MAX_VECTORS
}

/// Packs `g` query rows of `hd` values (row `r` at `q + r·hdp`, already
/// scaled) into `dst` as `[g][hd / 2]` bf16 dword pairs, rounded to
/// nearest, ties to even.
///
/// # Safety
/// AVX-512 F and BF16 are here; `q` holds `g` rows of `hdp ≥ hd` values and
/// [`usable`]`(hd)` holds.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn pack(q: *const f32, hdp: usize, hd: usize, g: usize, dst: &mut Vec<u32>) {
    dst.clear();
    dst.resize(g * hd / 2, 0);
    for r in 0..g {
        let (src, out) = (q.add(r * hdp), dst.as_mut_ptr().add(r * hd / 2));
        for c in 0..hd / 32 {
            let lo = _mm512_loadu_ps(src.add(32 * c));
            let hi = _mm512_loadu_ps(src.add(32 * c + 16));
            let w: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(out.add(16 * c).cast(), w);
        }
    }
}

/// Partial dot products of `gb` (1..=8) query heads with each key of
/// `koff` (at most 16): for head `r` and key `kk`, stores the 16 lanes of
/// pair sums at `part + r·stride + kk·16`.
///
/// # Safety
/// AVX-512 F and BF16 are here; [`usable`]`(hd)` holds; `qp` holds `gb`
/// rows of `hd / 2` pairs ([`pack`]); each `base + koff[kk]` has `hd`
/// readable values.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn qk_keys(
    gb: usize,
    qp: *const u32,
    hd: usize,
    base: *const u16,
    koff: &[usize],
    part: *mut f32,
    stride: usize,
) {
    let keys = Keys { base, koff };
    by_shape(&Partials { keys, part, stride }, gb, hd, qp);
}

/// The scores of `gb` (1..=[`SCORE_HEADS`]) query heads against the keys of
/// `koff` (at most 16): lane `kk` of the vector stored at `s + r·stride`
/// is head `r`'s dot product with key `kk`, 0 for `kk ≥ koff.len()`.
///
/// The same pair products as [`qk_keys`], summed in registers: each key's
/// 16 lanes of pair sums enter a transpose tree as soon as they exist
/// (pairs of keys into halves, pairs of those into quarters, …, one
/// permute back to key order at the end), so no partial vector goes
/// through memory and at most four wait per head. The sums associate
/// differently from `qk_keys` + the lanes' `reduce` (f32 rounding only).
///
/// # Safety
/// As [`qk_keys`], with `gb ≤ SCORE_HEADS` and `s + r·stride` writable for
/// 16 values per head.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn qk_scores(
    gb: usize,
    qp: *const u32,
    hd: usize,
    base: *const u16,
    koff: &[usize],
    s: *mut f32,
    stride: usize,
) {
    let keys = Keys { base, koff };
    by_shape(&Scores { keys, s, stride }, gb.min(SCORE_HEADS), hd, qp);
}

/// What a `QK` pass does with the pair sums of `GB` heads of `V` vectors
/// of pairs, given the query vectors (`qv`, in registers across the keys).
trait QkPass {
    /// # Safety
    /// The caller's contract ([`qk_keys`], [`qk_scores`]).
    unsafe fn run<const GB: usize, const V: usize>(&self, qv: &[[__m512i; V]; GB]);
}

/// Loads `gb` heads of `hd / 2` pairs from `qp` and runs `pass` with the
/// constants `GB = gb` (1..=8) and `V = hd / 32` (1..=4).
///
/// # Safety
/// As [`qk_keys`].
#[inline(always)]
unsafe fn by_shape<P: QkPass>(pass: &P, gb: usize, hd: usize, qp: *const u32) {
    macro_rules! rows {
        ($v:literal) => {
            match gb {
                1 => with_queries::<P, 1, $v>(pass, qp),
                2 => with_queries::<P, 2, $v>(pass, qp),
                3 => with_queries::<P, 3, $v>(pass, qp),
                4 => with_queries::<P, 4, $v>(pass, qp),
                5 => with_queries::<P, 5, $v>(pass, qp),
                6 => with_queries::<P, 6, $v>(pass, qp),
                7 => with_queries::<P, 7, $v>(pass, qp),
                _ => with_queries::<P, 8, $v>(pass, qp),
            }
        };
    }
    match hd / 32 {
        1 => rows!(1),
        2 => rows!(2),
        3 => rows!(3),
        _ => rows!(4),
    }
}

/// Runs `pass` on the `GB` heads of `V` vectors of pairs at `qp`.
///
/// # Safety
/// As [`qk_keys`], with `hd = 32·V`.
#[inline(always)]
unsafe fn with_queries<P: QkPass, const GB: usize, const V: usize>(pass: &P, qp: *const u32) {
    let mut qv = [[_mm512_setzero_si512(); V]; GB];
    for (r, row) in qv.iter_mut().enumerate() {
        for (c, v) in row.iter_mut().enumerate() {
            *v = _mm512_loadu_si512(qp.add(r * 16 * V + 16 * c).cast());
        }
    }
    pass.run(&qv);
}

/// The key rows of a block: key `kk` at `base + koff[kk]`.
#[derive(Clone, Copy)]
struct Keys<'a> {
    base: *const u16,
    koff: &'a [usize],
}

impl Keys<'_> {
    /// Key `kk`'s 16 lanes of pair sums per head (zeros past the last key).
    /// A method, not a closure: `#[inline(always)]` functions take the
    /// caller's instruction set when inlined.
    #[inline(always)]
    unsafe fn sums<const GB: usize, const V: usize>(
        self,
        qv: &[[__m512i; V]; GB],
        kk: usize,
    ) -> [__m512; GB] {
        let mut acc = [_mm512_setzero_ps(); GB];
        if let Some(&off) = self.koff.get(kk) {
            let k = self.base.add(off);
            for c in 0..V {
                let kv: __m512bh = std::mem::transmute(_mm512_loadu_si512(k.add(32 * c).cast()));
                for (a, row) in acc.iter_mut().zip(qv) {
                    *a = _mm512_dpbf16_ps(*a, std::mem::transmute::<__m512i, __m512bh>(row[c]), kv);
                }
            }
        }
        acc
    }
}

/// [`qk_keys`]' pass: every key's lanes stored as they are.
struct Partials<'a> {
    keys: Keys<'a>,
    part: *mut f32,
    stride: usize,
}

impl QkPass for Partials<'_> {
    #[inline(always)]
    unsafe fn run<const GB: usize, const V: usize>(&self, qv: &[[__m512i; V]; GB]) {
        for kk in 0..self.keys.koff.len() {
            for (r, &a) in self.keys.sums(qv, kk).iter().enumerate() {
                _mm512_storeu_ps(self.part.add(r * self.stride + kk * 16), a);
            }
        }
    }
}

/// [`qk_scores`]' pass: each key's pair sums into the lanes' score tree
/// ([`tree_scores`], AVX-512's levels).
struct Scores<'a> {
    keys: Keys<'a>,
    s: *mut f32,
    stride: usize,
}

impl QkPass for Scores<'_> {
    #[inline(always)]
    unsafe fn run<const GB: usize, const V: usize>(&self, qv: &[[__m512i; V]; GB]) {
        let leaves = PairKeys {
            keys: self.keys,
            qv,
        };
        tree_scores::<Avx512, _, GB>(&leaves, self.s, self.stride);
    }
}

/// A block's keys with the queries' pairs: the leaves of [`Scores`]' tree.
struct PairKeys<'a, const GB: usize, const V: usize> {
    keys: Keys<'a>,
    qv: &'a [[__m512i; V]; GB],
}

impl<const GB: usize, const V: usize> KeyLanes<Avx512, GB> for PairKeys<'_, GB, V> {
    #[inline(always)]
    unsafe fn key(&self, kk: usize) -> [__m512; GB] {
        self.keys.sums(self.qv, kk)
    }
}

/// Most query heads one pair `PV` pass keeps accumulators for (two per
/// 32 value dims each).
const PV_HEADS: usize = 6;

/// `O[r] = α[r]·O[r] + Σ_j P[r][j]·V[j]` over the `nk` keys of a tile for
/// every head `r < g`, on pair products: the tile's probabilities rounded
/// to bf16 as key pairs (`(P[2k], P[2k+1])`, packed into `pp` per head),
/// against each pair of V rows interleaved word by word (`vpunpck[lh]wd`,
/// a zero row after an odd last key). `o` is kept in the pair layout of
/// [`unpermute`] from the first tile to the last.
///
/// # Safety
/// AVX-512 F, BW and BF16 are here; [`usable`]`(vd)` holds; `p` is
/// `[g][tile]` with whole 16-key vectors of probabilities up to `nk`
/// (zeros past it), `o` `[g][vd]`, `alpha` `g`; every `voff` names `vd`
/// readable values of `base`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn pv_tile(
    p: *const f32,
    tile: usize,
    nk: usize,
    base: *const u16,
    voff: &[usize],
    vd: usize,
    g: usize,
    o: *mut f32,
    alpha: *const f32,
    pp: &mut Vec<u32>,
) {
    let pairs = tile / 2;
    // Only the packed vectors (up to `nk`) are read below, so the buffer
    // grows once and is not cleared per tile.
    if pp.len() < g * pairs {
        pp.resize(g * pairs, 0);
    }
    for r in 0..g {
        for v in 0..nk.div_ceil(16) {
            let w = _mm512_cvtneps_pbh(_mm512_loadu_ps(p.add(r * tile + 16 * v)));
            _mm256_storeu_si256(
                pp.as_mut_ptr().add(r * pairs + 8 * v).cast(),
                std::mem::transmute::<__m256bh, __m256i>(w),
            );
        }
    }
    let args = PvPairs {
        pp: pp.as_ptr(),
        pairs,
        nk,
        base,
        voff,
        vd,
        o,
        alpha,
    };
    let mut r0 = 0;
    while r0 < g {
        let gb = PV_HEADS.min(g - r0);
        let mut c = 0;
        while c < vd / 32 {
            let two = vd / 32 - c >= 2;
            macro_rules! heads {
                ($n:literal) => {
                    match gb {
                        1 => pv_block::<1, $n>(&args, r0, c),
                        2 => pv_block::<2, $n>(&args, r0, c),
                        3 => pv_block::<3, $n>(&args, r0, c),
                        4 => pv_block::<4, $n>(&args, r0, c),
                        5 => pv_block::<5, $n>(&args, r0, c),
                        _ => pv_block::<6, $n>(&args, r0, c),
                    }
                };
            }
            if two {
                heads!(2);
                c += 2;
            } else {
                heads!(1);
                c += 1;
            }
        }
        r0 += gb;
    }
}

/// The arguments of one [`pv_block`].
struct PvPairs<'a> {
    /// Probability pairs `[g][pairs]`.
    pp: *const u32,
    /// Pairs a head in `pp`.
    pairs: usize,
    /// Keys in the tile.
    nk: usize,
    /// The layer buffer.
    base: *const u16,
    /// V row offsets of the tile's keys.
    voff: &'a [usize],
    /// Value dims of a head.
    vd: usize,
    /// Outputs `[g][vd]`, pair layout.
    o: *mut f32,
    /// Rescale factors `[g]`.
    alpha: *const f32,
}

/// `C` 32-dim vectors of values from vector `c0` for the `GB` heads from
/// `r0`: two accumulators (the low and high interleaves) per vector and
/// head, in registers across the tile.
///
/// # Safety
/// As [`pv_tile`], with `r0 + GB ≤ g` and `32·(c0 + C) ≤ vd`.
#[inline(always)]
unsafe fn pv_block<const GB: usize, const C: usize>(a: &PvPairs<'_>, r0: usize, c0: usize) {
    let mut acc = [[[_mm512_setzero_ps(); 2]; C]; GB];
    for (r, acc_r) in acc.iter_mut().enumerate() {
        let al = _mm512_set1_ps(*a.alpha.add(r0 + r));
        for (c, x) in acc_r.iter_mut().enumerate() {
            let at = a.o.add((r0 + r) * a.vd + 32 * (c0 + c));
            x[0] = _mm512_mul_ps(_mm512_loadu_ps(at), al);
            x[1] = _mm512_mul_ps(_mm512_loadu_ps(at.add(16)), al);
        }
    }
    for k in 0..a.nk.div_ceil(2) {
        let j = 2 * k;
        let mut lo = [_mm512_setzero_si512(); C];
        let mut hi = [_mm512_setzero_si512(); C];
        let v0 = a.base.add(a.voff[j] + 32 * c0);
        let v1 = (j + 1 < a.nk).then(|| a.base.add(a.voff[j + 1] + 32 * c0));
        for c in 0..C {
            let x0 = _mm512_loadu_si512(v0.add(32 * c).cast());
            let x1 = match v1 {
                Some(v1) => _mm512_loadu_si512(v1.add(32 * c).cast()),
                None => _mm512_setzero_si512(),
            };
            lo[c] = _mm512_unpacklo_epi16(x0, x1);
            hi[c] = _mm512_unpackhi_epi16(x0, x1);
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let pb = _mm512_set1_epi32(*a.pp.add((r0 + r) * a.pairs + k) as i32);
            let pb: __m512bh = std::mem::transmute(pb);
            for (c, x) in acc_r.iter_mut().enumerate() {
                x[0] = _mm512_dpbf16_ps(x[0], std::mem::transmute::<__m512i, __m512bh>(lo[c]), pb);
                x[1] = _mm512_dpbf16_ps(x[1], std::mem::transmute::<__m512i, __m512bh>(hi[c]), pb);
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (c, x) in acc_r.iter().enumerate() {
            let at = a.o.add((r0 + r) * a.vd + 32 * (c0 + c));
            _mm512_storeu_ps(at, x[0]);
            _mm512_storeu_ps(at.add(16), x[1]);
        }
    }
}

/// Puts the `g` output rows of `vd` values at `o` from [`pv_tile`]'s pair
/// layout back into dimension order. In the pair layout each 32 dims are
/// two vectors: the low interleave holds, in 128-bit lane `L`, dims
/// `8L .. 8L + 4`, the high one dims `8L + 4 .. 8L + 8`.
///
/// # Safety
/// AVX-512 F is here; `o` holds `g` rows of `vd` values, `vd` a multiple
/// of 32.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn unpermute(o: *mut f32, g: usize, vd: usize) {
    let first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    let second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for r in 0..g {
        for c in 0..vd / 32 {
            let at = o.add(r * vd + 32 * c);
            let (lo, hi) = (_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(16)));
            _mm512_storeu_ps(at, _mm512_permutex2var_ps(lo, first, hi));
            _mm512_storeu_ps(at.add(16), _mm512_permutex2var_ps(lo, second, hi));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{bf16_to_f32, f32_to_bf16};
    use crate::testing::values;

    /// `qk_scores` against plain dot products of the bf16-rounded queries
    /// with the bf16 keys, in f64: 1 to 16 keys, 1 to 4 heads, head dims of
    /// 1 to 4 vectors of pairs, keys scattered through a buffer. Tolerance
    /// 1e-5 · Σ|q_d·k_d| per score (f32 sums of up to 128 products); lanes
    /// past the last key are 0.
    #[test]
    fn scores_summed_in_registers_are_the_plain_dot_products() {
        if !std::is_x86_feature_detected!("avx512f") || !std::is_x86_feature_detected!("avx512bf16")
        {
            return;
        }
        for hd in [32, 64, 96, 128] {
            let keys: Vec<u16> = values(5, 40 * hd)
                .iter()
                .map(|&v| f32_to_bf16(2.0 * v))
                .collect();
            for gb in 1..=SCORE_HEADS {
                let q = values(6 + gb as u64, gb * hd);
                let mut qp = Vec::new();
                // SAFETY: AVX-512 F and BF16 checked above; `q` holds `gb` rows of `hd`.
                unsafe { pack(q.as_ptr(), hd, hd, gb, &mut qp) };
                for nk in 1..=16 {
                    // Keys in reverse order from row 39, every other row.
                    let koff: Vec<usize> = (0..nk).map(|j| (39 - 2 * j) * hd).collect();
                    let mut s = vec![f32::NAN; gb * 20];
                    // SAFETY: as above; every offset names `hd` values of
                    // `keys`, and each head's 16 lanes fit its 20-value row.
                    unsafe {
                        qk_scores(
                            gb,
                            qp.as_ptr(),
                            hd,
                            keys.as_ptr(),
                            &koff,
                            s.as_mut_ptr(),
                            20,
                        )
                    };
                    for r in 0..gb {
                        for kk in 0..16 {
                            let got = s[r * 20 + kk];
                            let (want, mag) = koff.get(kk).map_or((0.0, 0.0), |&off| {
                                (0..hd).fold((0.0f64, 0.0f64), |(sum, mag), d| {
                                    let qd = bf16_to_f32(f32_to_bf16(q[r * hd + d])) as f64;
                                    let t = qd * bf16_to_f32(keys[off + d]) as f64;
                                    (sum + t, mag + t.abs())
                                })
                            });
                            assert!(
                                (got as f64 - want).abs() <= 1e-5 * mag,
                                "hd {hd} heads {gb} keys {nk}: head {r} key {kk}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
