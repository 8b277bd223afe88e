//! The AMX build of the Q8_0 panel tile ([`super`], [`crate::amx`]).
//!
//! A panel block's first 8 lines hold elements `4v..4v + 4` of the 16 rows
//! as `q + 128`, 4 bytes per row: they are an AMX `b` tile as stored, loaded
//! in place, and the tile's activation rows (32 bytes each at a stride of
//! `cols`) the `a` tile. Per block `tdpbsud` (signed activations, unsigned
//! weights) sums `Σ x·(w + 128)` into a zeroed int32 tile, which is stored;
//! [`LAG`](crate::amx::LAG) blocks later ([`crate::amx::panel_blocks`]) the
//! VNNI tile's f32 step follows, on `dot − 128·Σq`:
//! the same integer as the VNNI tile's, so the same outputs bit for bit.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::x86::PREFETCH_BYTES;
use super::{Tile, BLOCK, LINES};
use crate::amx::{configure, panel_blocks, panel_config, RING};
use crate::int8_rows::x86::{scale_add, store_rows};

/// The `MR × 16` AMX tile; with `PREFETCH` (the panel's first row tile) it
/// hints the lines [`PREFETCH_BYTES`] ahead, as the VNNI tile does.
///
/// # Safety
/// [`crate::amx::available`] and AVX-512F; `1 ≤ MR ≤ 16`; `t` holds `MR`
/// activation rows; `out` points at the tile's first output.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn tile_amx<const MR: usize, const PREFETCH: bool>(t: &Tile<'_>, out: *mut f32) {
    let nb = t.nb;
    let cols = nb * BLOCK;
    debug_assert!(t.xq.len() == MR * cols && t.xd.len() == MR * nb);
    let (lines, xq, xd, xc) = (
        t.lines.as_ptr(),
        t.xq.as_ptr(),
        t.xd.as_ptr(),
        t.xc.as_ptr(),
    );
    let mut ring = MaybeUninit::<[[i32; 256]; RING]>::uninit();
    let ring = ring.as_mut_ptr().cast::<i32>();
    // SAFETY (whole body): AMX is available (the caller's contract) and the
    // configuration matches the tiles used; offsets stay inside the panel's
    // nb·9 lines, the tile's MR activation rows, or the ring (panel_blocks: a
    // slot is stored two blocks after its product, read LAG after it, reused
    // RING after it).
    unsafe {
        configure(MR as u32, &const { panel_config(MR) });
        let mut facc = [_mm512_setzero_ps(); MR];
        let blk = |b: usize| lines.add(b * LINES * 64);
        panel_blocks!(
            "tdpbsud",
            nb,
            xq,
            cols,
            |b| {
                if PREFETCH {
                    for v in 0..LINES {
                        // A hint: never faults, whatever the address.
                        _mm_prefetch::<_MM_HINT_T0>(
                            blk(b).wrapping_add(PREFETCH_BYTES + 64 * v).cast(),
                        );
                    }
                }
                blk(b)
            },
            ring,
            |f| {
                let c = ring.add((f % RING) * 256);
                let mut acc = [_mm512_setzero_si512(); MR];
                for (i, a) in acc.iter_mut().enumerate() {
                    let dot = _mm512_load_si512(c.add(16 * i).cast());
                    *a = _mm512_add_epi32(dot, _mm512_set1_epi32(*xc.add(i * nb + f)));
                }
                let ws = _mm512_load_ps(blk(f).add(512).cast());
                scale_add(&mut facc, &acc, ws, xd, nb, f);
            }
        );
        store_rows(&facc, out, t.stride, t.valid);
    }
}
