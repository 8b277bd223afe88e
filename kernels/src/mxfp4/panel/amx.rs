//! The AMX build of the panel tile ([`super`], [`crate::amx`]).
//!
//! A panel block's 4 code lines hold, per line `v`, elements `4v..4v + 4`
//! (low nibbles) and `16 + 4v..` (high nibbles) of the 16 rows, 4 bytes per
//! row: looked up by `vpermb` into signed doubled E2M1 values they are the 8
//! rows of an AMX `b` tile for the block's 32 elements (low lines first). The
//! tile's activation rows, 32 bytes each at a stride of `cols`, are the `a`
//! tile as they lie. The tile (a decode batch's one row tile per panel)
//! decodes the codes as it goes, [`LEAD`] blocks ahead, into a small ring.
//! Per block, `tdpbssd` into a zeroed int32 tile, stored to memory, then the
//! f32 step of the VNNI tile (`acc += f32(dot) · (scale(w) · d/2)`), in the
//! pipeline of [`crate::amx::panel_blocks`]. The integer sums are the VNNI
//! tile's (exactly: `Σ w·q` here, `Σ (w + 12)·q − 12·Σq` there), so the
//! outputs are bit for bit its.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::x86::{block_scales, PREFETCH_BYTES};
use super::{RowsQ, Tile};
use crate::amx::{configure, panel_blocks, panel_config, RING};
use crate::int8_rows::x86::{scale_add, store_rows};
use crate::int8_rows::Line;
use crate::mxfp4::{BLOCK_ELEMS, E2M1_X2_I8};

/// [`E2M1_X2_I8`] four times (`vpermb` reads 6 index bits).
static LUT64_I8: [i8; 64] = {
    let mut t = [0i8; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = E2M1_X2_I8[i % 16];
        i += 1;
    }
    t
};

/// Blocks the tile decodes ahead of its products, so that a tile load never
/// waits on the decode's stores.
const LEAD: usize = 2;

/// Decoded-weight buffers of a tile (a power of two above [`LEAD`]).
const WRING: usize = 4;

/// Decodes code block `b` of a panel into `dst` (8 lines: one `b` tile),
/// hinting the codes [`PREFETCH_BYTES`] ahead.
///
/// # Safety
/// AVX-512 F/BW/VBMI present; 256 code bytes at `codes + 256 b`; `dst`
/// writable for 8 lines.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn decode_block(codes: *const u8, b: usize, lut: __m512i, dst: *mut Line) {
    // SAFETY: the caller's contract.
    unsafe {
        let cb = codes.add(b * 256);
        let dst = dst.cast::<u8>();
        for v in 0..4 {
            // A hint: never faults, whatever the address.
            _mm_prefetch::<_MM_HINT_T0>(cb.wrapping_add(PREFETCH_BYTES + 64 * v).cast());
            let pk = _mm512_load_si512(cb.add(64 * v).cast());
            let lo = _mm512_permutexvar_epi8(pk, lut);
            let hi = _mm512_permutexvar_epi8(_mm512_srli_epi16::<4>(pk), lut);
            _mm512_store_si512(dst.add(64 * v).cast(), lo);
            _mm512_store_si512(dst.add(256 + 64 * v).cast(), hi);
        }
    }
}

/// The f32 step of block `b` from its int32 results `c`.
///
/// # Safety
/// AVX-512F present; `c` holds `MR` rows of 16 int32; `xd` the tile's
/// `[MR, nb]` scales; 16 weight scales of block `b` in `t`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn finish<const MR: usize>(
    facc: &mut [__m512; MR],
    c: *const i32,
    t: &Tile<'_>,
    xd: *const f32,
    b: usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let mut acc = [_mm512_setzero_si512(); MR];
        for (i, a) in acc.iter_mut().enumerate() {
            *a = _mm512_load_si512(c.add(16 * i).cast());
        }
        let ws = block_scales(t.scales.as_ptr().add(b * 16), t.special);
        scale_add(facc, &acc, ws, xd, t.nb, b);
    }
}

/// The `MR × 16` AMX tile (see the [module docs](self)): a panel's only row
/// tile, decoding its `b` tiles [`LEAD`] blocks ahead, so that the code loads
/// from memory overlap the products as in the VNNI tile.
///
/// # Safety
/// [`crate::amx::available`] and AVX-512 F/BW/VBMI; `1 ≤ MR ≤ 16`; `xs`
/// holds `MR` rows of the panel's width; `out` points at the tile's first
/// output inside `[n, t.rows]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
pub(super) unsafe fn tile_amx<const MR: usize>(t: &Tile<'_>, xs: &RowsQ<'_>, out: *mut f32) {
    let nb = t.nb;
    let cols = nb * BLOCK_ELEMS;
    debug_assert!(xs.q.len() == MR * cols && xs.d.len() == MR * nb);
    let (xq, xd) = (xs.q.as_ptr(), xs.d.as_ptr());
    let codes = t.code_bytes().as_ptr();
    let mut ring = MaybeUninit::<[[i32; 256]; RING]>::uninit();
    let ring = ring.as_mut_ptr().cast::<i32>();
    let mut wring = MaybeUninit::<[Line; 8 * WRING]>::uninit();
    let wring = wring.as_mut_ptr().cast::<Line>();
    // SAFETY (whole body): AMX is available (the caller's contract) and the
    // configuration matches the tiles used; every offset stays inside the
    // panel's codes and nb·16 scales, the tile's MR
    // activation rows, or the rings (panel_blocks: a result slot is stored
    // two blocks after its product, read LAG after it, reused RING after it);
    // an inline decode of block b is written LEAD blocks before its tile load
    // and not rewritten until WRING − LEAD blocks after.
    unsafe {
        configure(MR as u32, &const { panel_config(MR) });
        let lut = _mm512_loadu_si512(LUT64_I8.as_ptr().cast());
        let mut facc = [_mm512_setzero_ps(); MR];
        let wslot = |b: usize| wring.add((b % WRING) * 8);
        for b in 0..LEAD.min(nb) {
            decode_block(codes, b, lut, wslot(b));
        }
        panel_blocks!(
            "tdpbssd",
            nb,
            xq,
            cols,
            |b| {
                if b + LEAD < nb {
                    decode_block(codes, b + LEAD, lut, wslot(b + LEAD));
                }
                wslot(b).cast()
            },
            ring,
            |f| { finish(&mut facc, ring.add((f % RING) * 256), t, xd, f) }
        );
        store_rows(&facc, out, t.rows, t.valid);
    }
}
