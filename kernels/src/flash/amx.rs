//! AMX-BF16 pieces of the tiled attention, for bf16 pools on CPUs with
//! AMX-BF16 tiles: the two products of [`super::attend_piece`] as
//! `tdpbf16ps` (one instruction multiplies a 16 × 32 bf16 tile by a
//! 32 × 16 one into a 16 × 16 f32 tile: 8,192 multiply-adds, the work of
//! 512 `vdpbf16ps`), the online softmax between them unchanged.
//!
//! Layouts are those of the f32 and [`super::bf16`] pieces — rows in the
//! SIMD lanes, `Sᵀ` and `Oᵀ` `mp` floats a key / a value column — so an
//! f32 result tile of 16 keys (or value columns) × 16 rows is stored
//! straight into them:
//!
//! - `Sᵀ[key][row] = Σ_p K[key][p] · Q[p][row]`: the `a` tile is 16 keys'
//!   bf16 rows, 32 dims each, **read in place from their page** (a tile
//!   load takes a row stride) when the 16 rows lie one after another and
//!   the head has a whole number of 32-dim steps; other blocks (a tile's
//!   last keys, pages shorter than 16 rows, heads such as 40 dims) are
//!   copied into a zero-padded buffer first. The `b` tile is 16 dim pairs
//!   of the query pairs `[pair][mp]` of [`super::bf16::pack_queries`]
//!   (their VNNI layout already), padded with zero pairs.
//! - `Oᵀ[c][row] += Σ_k Vᵀ[c][k] · P[k][row]`: the `b` tile is 16 key pairs
//!   of the weight pairs of [`super::bf16::pack_weights`]; the `a` tile
//!   holds 16 value columns × 16 key pairs, made from the value rows by
//!   interleaving each pair's two rows and a 16 × 16 dword transpose in
//!   registers (once per tile, shared by every row vector). A tile's
//!   products go to a buffer, then `Oᵀ = α·Oᵀ + O_tile` with the rows in the
//!   lanes.
//!
//! Results are blocked 2 × 2 (two `a` tiles by two `b` tiles into four
//! result tiles per step: four loads for four products). Numerics are the
//! [`super::bf16`] pieces' (bf16 `scale·q` and `P`, f32 sums; the tile unit
//! adds in its own order and flushes denormals), tested against the f32
//! pieces with the same tolerance.

use std::arch::asm;
use std::arch::x86_64::*;

use super::bf16::{
    layout, pack_queries, pack_weights, start_state, tile_rows, Layout, State, INTERLEAVE,
};
use super::{finish_piece, softmax_tile, Call, Piece, Scratch, Sink, KEY_TILE};
use crate::amx::{configure, TileConfig};
use crate::simd::Avx512;

/// f32 lanes of a vector; rows, keys and pairs of a tile.
const L: usize = 16;

/// Every tile 16 rows of 64 bytes: 0–3 results, 4/5 `a`, 6/7 `b`.
const CONFIG: TileConfig = TileConfig::new()
    .tile(0, 16, 64)
    .tile(1, 16, 64)
    .tile(2, 16, 64)
    .tile(3, 16, 64)
    .tile(4, 16, 64)
    .tile(5, 16, 64)
    .tile(6, 16, 64)
    .tile(7, 16, 64);

/// Query-tile rows an AMX piece aims for ([`super::TARGET_ROWS`] for the
/// others): the tile's K copies and value transposes are shared by more
/// rows, and the products cost little next to them (measured on SmolLM2's
/// heads: 8–10% faster than at 64 rows, no gain at 192).
pub(super) const TARGET_ROWS: usize = 128;

/// 16-key blocks of a key tile (the last one may be partial).
const KEY_BLOCKS: usize = KEY_TILE.div_ceil(L);

/// [`configure`] key of [`CONFIG`] (panel kernels use 1..=16).
const CONFIG_KEY: u32 = 32;

/// The per-thread buffers of AMX pieces (part of [`Scratch`]).
#[derive(Default)]
pub(super) struct Buffers {
    /// Query pairs `[dpp][mp]`, pre-scaled, zero-padded.
    q: Vec<u32>,
    /// One query row's pairs.
    row: Vec<u32>,
    /// The tile's bf16 row pointers, padded like [`Scratch::krows`].
    rows: Vec<*const u16>,
    /// Copied key blocks `[KEY_BLOCKS · 16][2·dpp]` (for blocks not read in
    /// place).
    k: Vec<u16>,
    /// The tile's weight pairs `[kpp][mp]`.
    p: Vec<u32>,
    /// The tile's value pairs transposed, `[vdp][kpp]`: the PV `a` tiles.
    vt: Vec<u32>,
    /// The tile's PV products `Oᵀ_tile [vdp][mp]`.
    o: Vec<f32>,
}

/// Whether `call` runs on AMX pieces: [`super::bf16::usable`], AMX-BF16
/// here, and `CARACAL_ATTENTION_PRODUCTS` not `bf16` (that setting keeps
/// the `vdpbf16ps` pieces, `f32` the FMA ones: for comparing them on one
/// machine).
pub(super) fn usable(call: &Call<'_>) -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let enabled = *ENABLED.get_or_init(|| {
        crate::amx::bf16_available()
            && std::env::var("CARACAL_ATTENTION_PRODUCTS").map_or(true, |v| v != "bf16")
    });
    enabled && super::bf16::usable(call)
}

/// One piece of [`super::attend_piece`] on AMX-BF16 tiles (see the module
/// docs).
///
/// # Safety
/// [`usable`]`(call)` holds, `call` passed the checks of `attend_with` and
/// `p` is one of its pieces planned for 16 lanes.
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
    let pool = call.pool;
    let dpp = (hd / 2).next_multiple_of(L);
    let vdp = vd.next_multiple_of(L);
    let kpp = KEY_TILE.div_ceil(2).next_multiple_of(L);
    // Keys are read in place when a key block's 16 rows are one after
    // another and the head is a whole number of 32-dim steps.
    let in_place_dims = hd.is_multiple_of(2 * L);
    let row_bytes = pool.width * 2;

    configure(CONFIG_KEY, &CONFIG);
    let b = &mut sc.amx;
    pack_queries(call, p, mp, dpp, &mut b.q, &mut b.row);
    b.k.resize(KEY_BLOCKS * L * 2 * dpp, 0);
    b.p.resize(kpp * mp, 0);
    b.vt.resize(vdp * kpp, 0);
    b.o.resize(vdp * mp, 0.0);
    let (qp, kb, pp, vt, ob) = (
        b.q.as_ptr(),
        b.k.as_mut_ptr(),
        b.p.as_mut_ptr(),
        b.vt.as_mut_ptr(),
        b.o.as_mut_ptr(),
    );
    let State {
        st,
        ot,
        m,
        l,
        alpha,
        qoff,
    } = start_state(sc, mp, vd, rows, group);
    let mp4 = mp * 4;

    let first_query = call.start_pos + p.i0;
    let mut j0 = p.k0;
    while j0 < p.k1 {
        let j1 = (j0 + KEY_TILE).min(p.k1);
        let nk = j1 - j0;
        let rows_at = tile_rows(call, kv, j0..j1, &mut sc.amx.rows);

        // The `a` tile of each 16-key block: in place or copied.
        let nkb = nk.div_ceil(L);
        let mut a_at = [(std::ptr::null::<u8>(), 0usize); KEY_BLOCKS];
        for (kbi, at) in a_at.iter_mut().enumerate().take(nkb) {
            let first = *rows_at.add(kbi * L);
            let whole = kbi * L + L <= nk;
            let contiguous =
                whole && *rows_at.add(kbi * L + L - 1) == first.add((L - 1) * pool.width);
            *at = if in_place_dims && contiguous {
                (first.add(k_off).cast(), row_bytes)
            } else {
                let dst = kb.add(kbi * L * 2 * dpp);
                for r in 0..L {
                    let d = std::slice::from_raw_parts_mut(dst.add(r * 2 * dpp), 2 * dpp);
                    if kbi * L + r < nk {
                        let src = (*rows_at.add(kbi * L + r)).add(k_off);
                        d[..hd].copy_from_slice(std::slice::from_raw_parts(src, hd));
                        d[hd..].fill(0);
                    } else {
                        d.fill(0);
                    }
                }
                (dst.cast_const().cast(), 4 * dpp)
            };
        }
        // Sᵀ = K · Q over dpp / 16 steps of 16 dim pairs.
        for v0 in (0..mv).step_by(2) {
            let nb = (mv - v0).min(2);
            let bq = [qp.add(v0 * L).cast::<u8>(), qp.add(v0 * L + L).cast::<u8>()];
            for k0 in (0..nkb).step_by(2) {
                let na = (nkb - k0).min(2);
                let a = [a_at[k0], a_at[(k0 + 1).min(nkb - 1)]];
                let c = |i: usize, j: usize| st.add((k0 + i) * L * mp + (v0 + j) * L);
                products(
                    [a[0].0, a[1].0],
                    [a[0].1, a[1].1],
                    64,
                    na,
                    bq,
                    mp4,
                    L * mp4,
                    nb,
                    dpp / L,
                    [[c(0, 0), c(0, 1)], [c(1, 0), c(1, 1)]],
                    mp4,
                );
            }
        }
        let mask = (j1 - 1 > first_query).then_some((first_query as isize - j0 as isize) as f32);
        softmax_tile::<Avx512>(st, mp, mv, nk, mask, qoff, m, l, alpha);

        // Oᵀ_tile = Vᵀ · P over kpt / 16 steps of 16 key pairs.
        let kp = nk.div_ceil(2);
        let kpt = kp.next_multiple_of(L);
        pack_weights(st, mp, mv, nk, pp);
        std::ptr::write_bytes(pp.add(kp * mp), 0, (kpt - kp) * mp);
        transpose_values(rows_at, v_off, nk, vd, kpp, vt);
        for v0 in (0..mv).step_by(2) {
            let nb = (mv - v0).min(2);
            let bw = [
                pp.add(v0 * L).cast_const().cast::<u8>(),
                pp.add(v0 * L + L).cast_const().cast::<u8>(),
            ];
            for c0 in (0..vdp / L).step_by(2) {
                let na = (vdp / L - c0).min(2);
                let a = |i: usize| {
                    vt.add((c0 + i).min(vdp / L - 1) * L * kpp)
                        .cast_const()
                        .cast::<u8>()
                };
                let c = |i: usize, j: usize| ob.add((c0 + i) * L * mp + (v0 + j) * L);
                products(
                    [a(0), a(1)],
                    [kpp * 4, kpp * 4],
                    64,
                    na,
                    bw,
                    mp4,
                    L * mp4,
                    nb,
                    kpt / L,
                    [[c(0, 0), c(0, 1)], [c(1, 0), c(1, 1)]],
                    mp4,
                );
            }
        }
        for c in 0..vd {
            for v in 0..mv {
                let (o, t) = (ot.add(c * mp + v * L), ob.add(c * mp + v * L));
                let al = _mm512_loadu_ps(alpha.add(v * L));
                _mm512_storeu_ps(
                    o,
                    _mm512_fmadd_ps(_mm512_loadu_ps(o), al, _mm512_loadu_ps(t)),
                );
            }
        }
        j0 = j1;
    }

    finish_piece(call, p, mp, m, l, ot, sink);
}

/// `c[i][j] = Σ_s a_i(s) · b_j(s)` for `na` (1 or 2) `a` tiles and `nb`
/// (1 or 2) `b` tiles over `steps` steps, stored as f32 rows `c_stride`
/// bytes apart. Step `s` of `a_i` is 16 rows `a_stride[i]` bytes apart from
/// `a[i] + s·a_step`, of `b_j` 16 rows `b_stride` apart from
/// `b[j] + s·b_step`.
///
/// # Safety
/// AMX-BF16 is here and [`CONFIG`] loaded; every tile address is readable
/// (`na`/`nb` select which are read) and every result writable.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn products(
    a: [*const u8; 2],
    a_stride: [usize; 2],
    a_step: usize,
    na: usize,
    b: [*const u8; 2],
    b_stride: usize,
    b_step: usize,
    nb: usize,
    steps: usize,
    c: [[*mut f32; 2]; 2],
    c_stride: usize,
) {
    asm!(
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        options(nostack)
    );
    for s in 0..steps {
        let (a0, a1) = (a[0].add(s * a_step), a[1].add(s * a_step));
        let (b0, b1) = (b[0].add(s * b_step), b[1].add(s * b_step));
        match (na, nb) {
            (2, 2) => asm!(
                "tileloadd tmm4, [{a0} + {sa0}]",
                "tileloadd tmm6, [{b0} + {sb}]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b1} + {sb}]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a1} + {sa1}]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a0, sa0 = in(reg) a_stride[0],
                a1 = in(reg) a1, sa1 = in(reg) a_stride[1],
                b0 = in(reg) b0, b1 = in(reg) b1, sb = in(reg) b_stride,
                options(nostack),
            ),
            (2, _) => asm!(
                "tileloadd tmm4, [{a0} + {sa0}]",
                "tileloadd tmm6, [{b0} + {sb}]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm5, [{a1} + {sa1}]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                a0 = in(reg) a0, sa0 = in(reg) a_stride[0],
                a1 = in(reg) a1, sa1 = in(reg) a_stride[1],
                b0 = in(reg) b0, sb = in(reg) b_stride,
                options(nostack),
            ),
            (_, 2) => asm!(
                "tileloadd tmm4, [{a0} + {sa0}]",
                "tileloadd tmm6, [{b0} + {sb}]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b1} + {sb}]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                a0 = in(reg) a0, sa0 = in(reg) a_stride[0],
                b0 = in(reg) b0, b1 = in(reg) b1, sb = in(reg) b_stride,
                options(nostack),
            ),
            _ => asm!(
                "tileloadd tmm4, [{a0} + {sa0}]",
                "tileloadd tmm6, [{b0} + {sb}]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                a0 = in(reg) a0, sa0 = in(reg) a_stride[0],
                b0 = in(reg) b0, sb = in(reg) b_stride,
                options(nostack),
            ),
        }
    }
    asm!("tilestored [{c} + {s}], tmm0", c = in(reg) c[0][0], s = in(reg) c_stride, options(nostack));
    if nb == 2 {
        asm!("tilestored [{c} + {s}], tmm1", c = in(reg) c[0][1], s = in(reg) c_stride, options(nostack));
    }
    if na == 2 {
        asm!("tilestored [{c} + {s}], tmm2", c = in(reg) c[1][0], s = in(reg) c_stride, options(nostack));
        if nb == 2 {
            asm!("tilestored [{c} + {s}], tmm3", c = in(reg) c[1][1], s = in(reg) c_stride, options(nostack));
        }
    }
}

/// The tile's value rows (`rows_at[key] + v_off`, bf16) as the PV `a`
/// tiles `vt` (`[vdp][kpp]` dwords, `vt[c][k] = (V[2k][c], V[2k+1][c])`),
/// zero past the tile's `nk` keys and `vd` columns up to the next multiples
/// of 16: per 16 key pairs × 16 columns, each pair's two rows interleaved
/// word by word into one vector, then one 16 × 16 dword transpose, all in
/// registers.
///
/// # Safety
/// AVX-512 F/BW are here; `rows_at` has `nk` row pointers with
/// `v_off + vd` readable values each; `vt` holds
/// `vd.next_multiple_of(16) · kpp` dwords with
/// `kpp ≥ nk.div_ceil(2).next_multiple_of(16)`.
#[inline(always)]
unsafe fn transpose_values(
    rows_at: *const *const u16,
    v_off: usize,
    nk: usize,
    vd: usize,
    kpp: usize,
    vt: *mut u32,
) {
    let idx = _mm512_loadu_si512(INTERLEAVE.as_ptr().cast());
    let kp = nk.div_ceil(2);
    for k0 in (0..kp).step_by(L) {
        for c0 in (0..vd).step_by(L) {
            let cols: u32 = if c0 + L <= vd {
                0xffff
            } else {
                (1u32 << (vd - c0)) - 1
            };
            let load = |key: usize| {
                if key < nk {
                    _mm512_maskz_loadu_epi16(cols, (*rows_at.add(key)).add(v_off + c0).cast())
                } else {
                    _mm512_setzero_si512()
                }
            };
            let mut r = [_mm512_setzero_si512(); L];
            for (i, x) in r.iter_mut().enumerate().take((kp - k0).min(L)) {
                let k = 2 * (k0 + i);
                *x = _mm512_permutex2var_epi16(load(k), idx, load(k + 1));
            }
            transpose16(&mut r);
            for (c, &x) in r.iter().enumerate() {
                _mm512_storeu_si512(vt.add((c0 + c) * kpp + k0).cast(), x);
            }
        }
    }
}

/// Transposes 16 vectors of 16 dwords in place (`r[i][j] ↔ r[j][i]`).
#[inline(always)]
unsafe fn transpose16(r: &mut [__m512i; L]) {
    // Dwords within 128-bit lanes, then qwords, then lanes across vectors.
    let mut t = [_mm512_setzero_si512(); L];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for i in 0..4 {
        let (a, b, c, d) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
        r[4 * i] = _mm512_unpacklo_epi64(a, c);
        r[4 * i + 1] = _mm512_unpackhi_epi64(a, c);
        r[4 * i + 2] = _mm512_unpacklo_epi64(b, d);
        r[4 * i + 3] = _mm512_unpackhi_epi64(b, d);
    }
    // r[4i + j] now holds, in 128-bit lane q, row 4i..4i+4's column 4q + j.
    for i in 0..2 {
        for j in 0..4 {
            let (a, b) = (r[8 * i + j], r[8 * i + 4 + j]);
            t[8 * i + j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(a, b);
            t[8 * i + 4 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(a, b);
        }
    }
    for j in 0..8 {
        let (a, b) = (t[j], t[8 + j]);
        r[j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(a, b);
        r[8 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(a, b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose16_transposes() {
        if !crate::cpu::features().avx512_bf16 {
            eprintln!("SKIPPED: no AVX-512 here");
            return;
        }
        let m: Vec<u32> = (0..256).collect();
        let mut got = [0u32; 256];
        // SAFETY: AVX-512F is here; m and got hold 16 × 16 dwords.
        unsafe {
            #[target_feature(enable = "avx512f")]
            unsafe fn run(m: &[u32], got: &mut [u32; 256]) {
                let mut r = [_mm512_setzero_si512(); L];
                for (i, x) in r.iter_mut().enumerate() {
                    *x = _mm512_loadu_si512(m.as_ptr().add(16 * i).cast());
                }
                transpose16(&mut r);
                for (i, x) in r.iter().enumerate() {
                    _mm512_storeu_si512(got.as_mut_ptr().add(16 * i).cast(), *x);
                }
            }
            run(&m, &mut got);
        }
        for i in 0..16 {
            for j in 0..16 {
                assert_eq!(got[16 * i + j], m[16 * j + i], "({i}, {j})");
            }
        }
    }

    #[test]
    fn value_tiles_are_the_value_pairs_transposed_and_padded() {
        if !crate::cpu::features().avx512_bf16 {
            eprintln!("SKIPPED: no AVX-512 here");
            return;
        }
        // 37 keys (19 pairs, the last one half empty: a partial second
        // block) of 21 columns (a partial second column block) at offset 5.
        let (nk, vd, off, kpp) = (37usize, 21usize, 5usize, 48usize);
        let rows: Vec<Vec<u16>> = (0..nk)
            .map(|k| (0..off + vd).map(|c| (1 + 100 * k + c) as u16).collect())
            .collect();
        let ptrs: Vec<*const u16> = rows.iter().map(|r| r.as_ptr()).collect();
        let vdp = vd.next_multiple_of(16);
        let mut vt = vec![u32::MAX; vdp * kpp];
        // SAFETY: AVX-512 F/BW are here; every row holds off + vd values and
        // vt vdp·kpp dwords.
        unsafe {
            #[target_feature(enable = "avx512f,avx512bw")]
            unsafe fn run(
                p: *const *const u16,
                off: usize,
                nk: usize,
                vd: usize,
                kpp: usize,
                vt: &mut [u32],
            ) {
                transpose_values(p, off, nk, vd, kpp, vt.as_mut_ptr())
            }
            run(ptrs.as_ptr(), off, nk, vd, kpp, &mut vt);
        }
        let kp = nk.div_ceil(2);
        for c in 0..vdp {
            for k in 0..kp.next_multiple_of(16) {
                let word = |key: usize| {
                    if c < vd && key < nk {
                        rows[key][off + c] as u32
                    } else {
                        0
                    }
                };
                let want = word(2 * k) | word(2 * k + 1) << 16;
                assert_eq!(vt[c * kpp + k], want, "column {c} pair {k}");
            }
        }
    }
}
