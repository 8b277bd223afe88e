//! bf16 pieces of the tiled attention, for bf16 pools on CPUs with
//! AVX-512 BF16: the two products of [`super::attend_piece`] as `vdpbf16ps`
//! pair dot products (two bf16 multiply-adds per f32 lane, twice an FMA's
//! work), the online softmax between them unchanged.
//!
//! Layouts stay those of the f32 kernels — rows in the SIMD lanes, `Sᵀ`
//! and `Oᵀ` `mp` floats a key / a value column — with pairs in the dwords:
//!
//! - `Sᵀ[key][row] = Σ_d K[key][d]·Q[row][d]` takes, per dim pair `p`, the
//!   vector of the rows' `(q[2p], q[2p+1])` (packed once per piece from
//!   `scale·q` rounded to bf16) against a broadcast of the key's dword `p`,
//!   read in place from its bf16 row: the rows are never widened to f32.
//! - `Oᵀ[c][row] = α·Oᵀ[c][row] + Σ_key P[key][row]·V[key][c]` takes, per key
//!   pair, the vector of the rows' `(P[2k], P[2k+1])` (the tile's `Pᵀ`
//!   rounded and interleaved, once per tile) against a broadcast of
//!   `(V[2k][c], V[2k+1][c])` from the tile's value rows interleaved word by
//!   word (once per tile; a key past the tile's end is a zero row).
//!
//! Rounding `scale·q` and `P` to bf16 is the only difference from the f32
//! kernels (the rows are bf16 already, products accumulate in f32):
//! relative steps of 2⁻⁹ on the scores' inputs and on the weights, what GPU
//! flash attention does with bf16 inputs. The sums `l` are taken over the
//! f32 `P`. The tests state the tolerance against the f32 kernels.

use std::arch::x86_64::*;

use super::{
    finish_piece, init_rows, row_step, softmax_tile, Call, Piece, Scratch, Sink, KEY_TILE, MAX_NR,
};
use crate::paged::{KvDtype, LayerRows};
use crate::simd::Avx512;

/// f32 lanes of a vector.
const L: usize = 16;

/// The per-thread buffers of bf16 pieces (part of [`Scratch`]).
#[derive(Default)]
pub(super) struct Buffers {
    /// Query pairs `[head_dim / 2][mp]`, pre-scaled.
    q: Vec<u32>,
    /// The tile's weight pairs `[key pair][mp]`.
    p: Vec<u32>,
    /// The tile's value pairs `[key pair][v_dim]`.
    v: Vec<u32>,
    /// The tile's bf16 rows, padded like [`Scratch::krows`].
    rows: Vec<*const u16>,
    /// One query row's pairs.
    row: Vec<u32>,
}

/// Whether `call` runs on bf16 pieces: a bf16 pool, an even `head_dim`,
/// AVX-512 BF16 here, and `CARACAL_ATTENTION_PRODUCTS` not `f32` (that
/// setting keeps every piece on the f32 kernels: for comparing the two on
/// one machine).
pub(super) fn usable(call: &Call<'_>) -> bool {
    enabled() && call.pool.dtype() == KvDtype::Bf16 && call.shape.head_dim.is_multiple_of(2)
}

/// AVX-512 BF16 here and `CARACAL_ATTENTION_PRODUCTS` not `f32`: whether
/// attention may take bf16 pair products at all (read once).
pub(in crate::flash) fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| {
        crate::cpu::features().avx512_bf16
            && std::env::var("CARACAL_ATTENTION_PRODUCTS").map_or(true, |v| v != "f32")
    })
}

/// `acc + Σ` over the 2 pairs of each dword of `a · b` (`vdpbf16ps`).
#[inline(always)]
unsafe fn dot(acc: __m512, a: __m512i, b: __m512i) -> __m512 {
    _mm512_dpbf16_ps(
        acc,
        std::mem::transmute::<__m512i, __m512bh>(a),
        std::mem::transmute::<__m512i, __m512bh>(b),
    )
}

/// One piece of [`super::attend_piece`] on bf16 pair dot products (see the
/// module docs).
///
/// # Safety
/// [`usable`]`(call)` holds (AVX-512 F, BW and BF16 here), `call` passed the
/// checks of `attend_with` and `p` is one of its pieces planned for 16
/// lanes.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn piece(call: &Call<'_>, p: Piece, sc: &mut Scratch, sink: Sink<'_>) {
    let Layout {
        group,
        hd,
        vd,
        rows,
        mp,
        mv,
        kv,
        k_off,
        v_off,
    } = layout(call, p);

    let b = &mut sc.bf16;
    pack_queries(call, p, mp, hd / 2, &mut b.q, &mut b.row);
    let pairs = KEY_TILE.div_ceil(2);
    if b.p.len() < pairs * mp {
        b.p.resize(pairs * mp, 0);
    }
    if b.v.len() < pairs * vd {
        b.v.resize(pairs * vd, 0);
    }
    let (qp, pp, vp) = (b.q.as_ptr(), b.p.as_mut_ptr(), b.v.as_mut_ptr());
    let State {
        st,
        ot,
        m,
        l,
        alpha,
        qoff,
    } = start_state(sc, mp, vd, rows, group);

    let first_query = call.start_pos + p.i0;
    let mut j0 = p.k0;
    while j0 < p.k1 {
        let j1 = (j0 + KEY_TILE).min(p.k1);
        let nk = j1 - j0;
        let rows_at = tile_rows(call, kv, j0..j1, &mut sc.bf16.rows);
        qk_tile(qp, mp, mv, hd / 2, rows_at, k_off, nk, st);
        let mask = (j1 - 1 > first_query).then_some((first_query as isize - j0 as isize) as f32);
        softmax_tile::<Avx512>(st, mp, mv, nk, mask, qoff, m, l, alpha);
        pack_weights(st, mp, mv, nk, pp);
        pack_values(rows_at, v_off, nk, vd, vp);
        pv_tile(pp, mp, mv, nk.div_ceil(2), vd, vp, ot, alpha);
        j0 = j1;
    }

    finish_piece(call, p, mp, m, l, ot, sink);
}

/// Where a bf16 or AMX piece's rows and head values lie.
pub(super) struct Layout<'a> {
    /// Query heads per kv head.
    pub group: usize,
    /// Key and value widths of a head.
    pub hd: usize,
    pub vd: usize,
    /// The piece's real rows, padded to `mp` (`mv` vectors).
    pub rows: usize,
    pub mp: usize,
    pub mv: usize,
    /// The layer's bf16 rows.
    pub kv: &'a [u16],
    /// Offsets of the piece's key and value head inside a row.
    pub k_off: usize,
    pub v_off: usize,
}

/// The [`Layout`] of piece `p` of `call` (a bf16 pool).
pub(super) fn layout<'a>(call: &Call<'a>, p: Piece) -> Layout<'a> {
    let shape = call.shape;
    let group = shape.q_heads / shape.kv_heads;
    let (hd, vd) = (shape.head_dim, shape.v_dim);
    let rows = (p.i1 - p.i0) * group;
    let mp = rows.next_multiple_of(L);
    let LayerRows::Bf16(kv) = call.pool.layer_rows(call.layer) else {
        unreachable!("bf16 and AMX attention pieces read bf16 pools only")
    };
    let (k_off, v_off) = if call.latent {
        (0, 0)
    } else {
        (p.kvh * hd, shape.kv_heads * hd + p.kvh * vd)
    };
    Layout {
        group,
        hd,
        vd,
        rows,
        mp,
        mv: mp / L,
        kv,
        k_off,
        v_off,
    }
}

/// A piece's f32 state in its thread's [`Scratch`] (pointers into it).
pub(super) struct State {
    /// `Sᵀ` then `Pᵀ` of a tile, `[KEY_TILE + MAX_NR][mp]`.
    pub st: *mut f32,
    /// `Oᵀ [v_dim][mp]`.
    pub ot: *mut f32,
    /// Running max, running sum, rescale factor and query offset per row.
    pub m: *mut f32,
    pub l: *mut f32,
    pub alpha: *mut f32,
    pub qoff: *mut f32,
}

/// Sizes `sc`'s f32 buffers for a piece of `rows` real rows (`mp` with
/// padding) of `group` heads per query and `vd` value columns, zeroes `Oᵀ`
/// and starts the per-row state ([`init_rows`]).
pub(super) fn start_state(
    sc: &mut Scratch,
    mp: usize,
    vd: usize,
    rows: usize,
    group: usize,
) -> State {
    let so = super::aligned(&mut sc.st, (KEY_TILE + MAX_NR) * mp);
    let oo = super::aligned(&mut sc.ot, vd * mp);
    let ro = super::aligned(&mut sc.rows, 4 * mp);
    sc.ot[oo..oo + vd * mp].fill(0.0);
    init_rows(&mut sc.rows[ro..ro + 4 * mp], rows, group);
    let rowp = sc.rows[ro..].as_mut_ptr();
    // SAFETY: `rows` holds 4·mp values from `ro` (sized just above).
    let (l, alpha, qoff) = unsafe { (rowp.add(mp), rowp.add(2 * mp), rowp.add(3 * mp)) };
    State {
        st: sc.st[so..].as_mut_ptr(),
        ot: sc.ot[oo..].as_mut_ptr(),
        m: rowp,
        l,
        alpha,
        qoff,
    }
}

/// The bf16 rows of keys `keys` of `call`'s sequence in `kv` (its layer's
/// buffer) as pointers in `dst`, padded with the last one to
/// `len + MAX_NR` (for whole key blocks); returns them.
pub(super) fn tile_rows(
    call: &Call<'_>,
    kv: &[u16],
    keys: std::ops::Range<usize>,
    dst: &mut Vec<*const u16>,
) -> *const *const u16 {
    let nk = keys.len();
    dst.clear();
    call.pool
        .for_each_row(call.block_table, keys, |_, o, _| dst.push(kv[o..].as_ptr()));
    let last = dst[nk - 1];
    dst.resize(nk + MAX_NR, last);
    dst.as_ptr()
}

/// The piece's query rows as pre-scaled bf16 pairs `[dpp][mp]` in `q`
/// (`q[d][row] = (scale·q[2d], scale·q[2d + 1])`), zero in padding rows and
/// in pairs past `head_dim / 2` (`dpp` is at least that); `row` is scratch.
///
/// # Safety
/// AVX-512 BF16 is here; `p` is a piece of `call` (which passed the checks
/// of `attend_with`) whose rows fit `mp`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn pack_queries(
    call: &Call<'_>,
    p: Piece,
    mp: usize,
    dpp: usize,
    q: &mut Vec<u32>,
    row: &mut Vec<u32>,
) {
    let shape = call.shape;
    let group = shape.q_heads / shape.kv_heads;
    let (hd, qh) = (shape.head_dim, shape.q_heads);
    q.clear();
    q.resize(dpp * mp, 0);
    row.resize(hd / 2, 0);
    for r in 0..(p.i1 - p.i0) * group {
        let (i, h) = (p.i0 + r / group, p.kvh * group + r % group);
        let src = &call.q[(i * qh + h) * hd..(i * qh + h + 1) * hd];
        scaled_pairs(src, call.scale, row);
        for (d, &x) in row.iter().enumerate() {
            q[d * mp + r] = x;
        }
    }
}

/// `a` and `b` rounded to bf16 in one dword, `a` in the low half.
fn pair(a: f32, b: f32) -> u32 {
    crate::dtype::f32_to_bf16(a) as u32 | (crate::dtype::f32_to_bf16(b) as u32) << 16
}

/// `scale·x` rounded to bf16 as dword pairs (`dst[d] = (x[2d], x[2d+1])`),
/// 32 values per `vcvtne2ps2bf16`.
///
/// # Safety
/// AVX-512 BF16 is here; `dst` holds `x.len() / 2` dwords.
#[inline(always)]
unsafe fn scaled_pairs(x: &[f32], scale: f32, dst: &mut [u32]) {
    let s = _mm512_set1_ps(scale);
    let mut c = 0;
    while c + 32 <= x.len() {
        let lo = _mm512_mul_ps(_mm512_loadu_ps(x.as_ptr().add(c)), s);
        let hi = _mm512_mul_ps(_mm512_loadu_ps(x.as_ptr().add(c + 16)), s);
        let w: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
        _mm512_storeu_si512(dst.as_mut_ptr().add(c / 2).cast(), w);
        c += 32;
    }
    while c + 1 < x.len() {
        dst[c / 2] = pair(x[c] * scale, x[c + 1] * scale);
        c += 2;
    }
}

/// `Sᵀ[key][row] = Σ_p Q[p][row] · K[key][p]` over the `dp` dim pairs of
/// the `nk` keys of a tile, keys at `rows_at[key] + k_off` (bf16).
///
/// # Safety
/// `qp` is `[dp][mp]` dwords, `st` has `(nk + MAX_NR)·mp` floats,
/// `rows_at` has `nk + MAX_NR` row pointers with `k_off + 2·dp` readable
/// values each.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn qk_tile(
    qp: *const u32,
    mp: usize,
    mv: usize,
    dp: usize,
    rows_at: *const *const u16,
    k_off: usize,
    nk: usize,
    st: *mut f32,
) {
    let mut v = 0;
    while v < mv {
        let mr = row_step::<Avx512>(mv - v);
        let (q, s) = (qp.add(v * L), st.add(v * L));
        match mr {
            1 => qk_block::<1, 16>(q, mp, dp, rows_at, k_off, nk, s),
            2 => qk_block::<2, 12>(q, mp, dp, rows_at, k_off, nk, s),
            3 => qk_block::<3, 8>(q, mp, dp, rows_at, k_off, nk, s),
            _ => qk_block::<4, 6>(q, mp, dp, rows_at, k_off, nk, s),
        }
        v += mr;
    }
}

/// [`qk_tile`] for `MR` row vectors and `NR` keys per accumulator block
/// (the last block may run past `nk` on padding pointers; those rows of
/// `Sᵀ` are never read).
///
/// # Safety
/// As [`qk_tile`], with `MR` vectors of rows at `qp` and `st`.
#[inline(always)]
unsafe fn qk_block<const MR: usize, const NR: usize>(
    qp: *const u32,
    mp: usize,
    dp: usize,
    rows_at: *const *const u16,
    k_off: usize,
    nk: usize,
    st: *mut f32,
) {
    let mut n0 = 0;
    while n0 < nk {
        let kp: [*const u32; NR] =
            std::array::from_fn(|n| (*rows_at.add(n0 + n)).add(k_off).cast());
        let mut acc = [[_mm512_setzero_ps(); MR]; NR];
        for d in 0..dp {
            let a: [__m512i; MR] =
                std::array::from_fn(|r| _mm512_loadu_si512(qp.add(d * mp + r * L).cast()));
            for (n, acc_n) in acc.iter_mut().enumerate() {
                let k = _mm512_set1_epi32(kp[n].add(d).read_unaligned() as i32);
                for (x, &ar) in acc_n.iter_mut().zip(&a) {
                    *x = dot(*x, ar, k);
                }
            }
        }
        for (n, acc_n) in acc.iter().enumerate() {
            for (r, &x) in acc_n.iter().enumerate() {
                _mm512_storeu_ps(st.add((n0 + n) * mp + r * L), x);
            }
        }
        n0 += NR;
    }
}

/// The tile's `Pᵀ` (`nk` keys of `mp` floats at `pt`) as weight pairs at
/// `dst` (`[key pair][mp]` dwords, `(P[2k], P[2k+1])` rounded; the key
/// past an odd `nk` is zero).
///
/// # Safety
/// `pt` holds `nk·mp` floats, `dst` `nk.div_ceil(2)·mp` dwords.
#[inline(always)]
pub(super) unsafe fn pack_weights(pt: *const f32, mp: usize, mv: usize, nk: usize, dst: *mut u32) {
    for k in 0..nk.div_ceil(2) {
        for v in 0..mv {
            let a = _mm512_loadu_ps(pt.add(2 * k * mp + v * L));
            let b = if 2 * k + 1 < nk {
                _mm512_loadu_ps(pt.add((2 * k + 1) * mp + v * L))
            } else {
                _mm512_setzero_ps()
            };
            _mm512_storeu_si512(dst.add(k * mp + v * L).cast(), pair_bf16(a, b));
        }
    }
}

/// `vpermt2w` indices interleaving two rows' first 16 words: word `2i` from
/// the first row's word `i`, word `2i + 1` from the second's.
pub(super) const INTERLEAVE: [u16; 32] = {
    let mut x = [0u16; 32];
    let mut i = 0;
    while i < 16 {
        x[2 * i] = i as u16;
        x[2 * i + 1] = 32 + i as u16;
        i += 1;
    }
    x
};

/// The value rows of the tile's keys (`rows_at[key] + v_off`, bf16) as
/// value pairs at `dst` (`[key pair][vd]` dwords, `(V[2k][c], V[2k+1][c])`;
/// the key past an odd `nk` is zero).
///
/// # Safety
/// `rows_at` has `nk` row pointers with `v_off + vd` readable values each,
/// `dst` has room for `nk.div_ceil(2)·vd` dwords.
#[inline(always)]
unsafe fn pack_values(
    rows_at: *const *const u16,
    v_off: usize,
    nk: usize,
    vd: usize,
    dst: *mut u32,
) {
    let lo = _mm512_loadu_si512(INTERLEAVE.as_ptr().cast());
    let hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for k in 0..nk.div_ceil(2) {
        let r0 = (*rows_at.add(2 * k)).add(v_off);
        let r1 = (2 * k + 1 < nk).then(|| (*rows_at.add(2 * k + 1)).add(v_off));
        let out = dst.add(k * vd);
        let mut c = 0;
        while c + 32 <= vd {
            let a = _mm512_loadu_si512(r0.add(c).cast());
            let b = match r1 {
                Some(r1) => _mm512_loadu_si512(r1.add(c).cast()),
                None => _mm512_setzero_si512(),
            };
            _mm512_storeu_si512(out.add(c).cast(), _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(out.add(c + 16).cast(), _mm512_permutex2var_epi16(a, hi, b));
            c += 32;
        }
        for c in c..vd {
            let b = r1.map_or(0, |r1| *r1.add(c) as u32);
            *out.add(c) = *r0.add(c) as u32 | b << 16;
        }
    }
}

/// `Oᵀ[c][row] = α[row]·Oᵀ[c][row] + Σ_k W[k][row]·V[k][c]` over the tile's
/// `kp` key pairs (weight pairs `W` at `pp`, value pairs at `vp`).
///
/// # Safety
/// `pp` holds `kp·mp` dwords, `vp` `kp·vd`, `ot` `[vd][mp]` floats, `alpha`
/// `mp`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn pv_tile(
    pp: *const u32,
    mp: usize,
    mv: usize,
    kp: usize,
    vd: usize,
    vp: *const u32,
    ot: *mut f32,
    alpha: *const f32,
) {
    let mut v = 0;
    while v < mv {
        let mr = row_step::<Avx512>(mv - v);
        let o = v * L;
        let (w, out, a) = (pp.add(o), ot.add(o), alpha.add(o));
        match mr {
            1 => pv_rows::<1, 16>(w, mp, kp, vd, vp, out, a),
            2 => pv_rows::<2, 8>(w, mp, kp, vd, vp, out, a),
            3 => pv_rows::<3, 8>(w, mp, kp, vd, vp, out, a),
            _ => pv_rows::<4, 4>(w, mp, kp, vd, vp, out, a),
        }
        v += mr;
    }
}

/// [`pv_tile`] for `MR` row vectors: value columns in blocks of `NC`, then
/// the remaining `vd % NC` one at a time.
///
/// # Safety
/// As [`pv_tile`], with `MR` vectors of rows at `pp`, `ot` and `alpha`.
#[inline(always)]
unsafe fn pv_rows<const MR: usize, const NC: usize>(
    pp: *const u32,
    mp: usize,
    kp: usize,
    vd: usize,
    vp: *const u32,
    ot: *mut f32,
    alpha: *const f32,
) {
    let mut c0 = 0;
    while c0 + NC <= vd {
        pv_block::<MR, NC>(pp, mp, kp, vd, c0, vp, ot, alpha);
        c0 += NC;
    }
    while c0 < vd {
        pv_block::<MR, 1>(pp, mp, kp, vd, c0, vp, ot, alpha);
        c0 += 1;
    }
}

/// Columns `c0..c0 + NC` of [`pv_tile`] for `MR` row vectors, accumulators
/// in registers across the tile.
///
/// # Safety
/// As [`pv_rows`], with `c0 + NC <= vd`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn pv_block<const MR: usize, const NC: usize>(
    pp: *const u32,
    mp: usize,
    kp: usize,
    vd: usize,
    c0: usize,
    vp: *const u32,
    ot: *mut f32,
    alpha: *const f32,
) {
    let al: [__m512; MR] = std::array::from_fn(|r| _mm512_loadu_ps(alpha.add(r * L)));
    let mut acc: [[__m512; MR]; NC] = std::array::from_fn(|c| {
        std::array::from_fn(|r| {
            _mm512_mul_ps(_mm512_loadu_ps(ot.add((c0 + c) * mp + r * L)), al[r])
        })
    });
    for k in 0..kp {
        let vk = vp.add(k * vd + c0);
        let a: [__m512i; MR] =
            std::array::from_fn(|r| _mm512_loadu_si512(pp.add(k * mp + r * L).cast()));
        for (c, acc_c) in acc.iter_mut().enumerate() {
            let b = _mm512_set1_epi32(*vk.add(c) as i32);
            for (x, &ar) in acc_c.iter_mut().zip(&a) {
                *x = dot(*x, ar, b);
            }
        }
    }
    for (c, acc_c) in acc.iter().enumerate() {
        for (r, &x) in acc_c.iter().enumerate() {
            _mm512_storeu_ps(ot.add((c0 + c) * mp + r * L), x);
        }
    }
}

/// `a` and `b` rounded to bf16 (to nearest, ties to even) and interleaved:
/// dword `i` holds `a[i]` in its low half and `b[i]` in its high half.
#[inline(always)]
unsafe fn pair_bf16(a: __m512, b: __m512) -> __m512i {
    let round = |x: __m512| {
        let x = _mm512_castps_si512(x);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
        _mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd))
    };
    let hi = _mm512_and_si512(round(b), _mm512_set1_epi32(0xffff_0000u32 as i32));
    _mm512_or_si512(_mm512_srli_epi32::<16>(round(a)), hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` where AVX-512 BF16 is here.
    fn with_bf16(f: impl FnOnce()) {
        if crate::cpu::features().avx512_bf16 {
            f()
        } else {
            eprintln!("SKIPPED: no AVX-512 BF16 here");
        }
    }

    #[test]
    fn pairs_round_like_the_bf16_conversion() {
        with_bf16(|| {
            let a: Vec<f32> = crate::testing::values(1, 16)
                .iter()
                .map(|x| x * 3.7)
                .collect();
            let mut b: Vec<f32> = crate::testing::values(2, 16);
            // Ties: exactly halfway between two bf16 values, both parities.
            b[0] = f32::from_bits(0x3f80_8000);
            b[1] = f32::from_bits(0x3f81_8000);
            let mut got = [0u32; 16];
            // SAFETY: AVX-512F is here; a, b, got hold 16 values.
            unsafe {
                #[target_feature(enable = "avx512f")]
                unsafe fn run(a: &[f32], b: &[f32], got: &mut [u32; 16]) {
                    let w = pair_bf16(_mm512_loadu_ps(a.as_ptr()), _mm512_loadu_ps(b.as_ptr()));
                    _mm512_storeu_si512(got.as_mut_ptr().cast(), w);
                }
                run(&a, &b, &mut got);
            }
            for i in 0..16 {
                assert_eq!(got[i], pair(a[i], b[i]), "lane {i}");
            }
        });
    }

    #[test]
    fn scaled_query_pairs_round_like_the_bf16_conversion() {
        with_bf16(|| {
            // 70 values: two 32-value blocks and a tail of 6.
            let x: Vec<f32> = crate::testing::values(3, 70)
                .iter()
                .map(|v| v * 5.0)
                .collect();
            let mut got = vec![0u32; 35];
            // SAFETY: AVX-512 BF16 is here; got holds 35 dwords.
            unsafe {
                #[target_feature(enable = "avx512f,avx512bf16")]
                unsafe fn run(x: &[f32], got: &mut [u32]) {
                    scaled_pairs(x, 0.3, got)
                }
                run(&x, &mut got);
            }
            for (d, &g) in got.iter().enumerate() {
                assert_eq!(g, pair(x[2 * d] * 0.3, x[2 * d + 1] * 0.3), "pair {d}");
            }
        });
    }

    #[test]
    fn value_pairs_interleave_two_rows() {
        with_bf16(|| {
            // 3 keys (an odd count: the last pair's second key is zero) of 45
            // values (one 32-value block and a 13-value tail).
            let (nk, vd, off) = (3usize, 45usize, 5usize);
            let rows: Vec<Vec<u16>> = (0..nk)
                .map(|k| (0..off + vd).map(|c| (1000 * k + c) as u16).collect())
                .collect();
            let ptrs: Vec<*const u16> = rows.iter().map(|r| r.as_ptr()).collect();
            let mut out = vec![0u32; nk.div_ceil(2) * vd];
            // SAFETY: AVX-512 BW is here; every row holds off + vd values and
            // out nk.div_ceil(2)·vd dwords.
            unsafe {
                #[target_feature(enable = "avx512f,avx512bw")]
                unsafe fn run(
                    p: *const *const u16,
                    off: usize,
                    nk: usize,
                    vd: usize,
                    out: *mut u32,
                ) {
                    pack_values(p, off, nk, vd, out)
                }
                run(ptrs.as_ptr(), off, nk, vd, out.as_mut_ptr());
            }
            for k in 0..nk.div_ceil(2) {
                for c in 0..vd {
                    let lo = rows[2 * k][off + c] as u32;
                    let hi = rows.get(2 * k + 1).map_or(0, |r| r[off + c] as u32);
                    assert_eq!(out[k * vd + c], lo | hi << 16, "pair {k} column {c}");
                }
            }
        });
    }
}
