//! x86-64 builds of the panel kernels ([`super`]). Callers check CPU
//! features; tiles and activation rows are sized by the caller.
use std::arch::x86_64::*;

use super::{RowsQ, Tile};
use crate::int8_rows::x86::{scale_add, store_rows};
use crate::mxfp4::{BLOCK_ELEMS, E2M1_X2_U8};

/// [`E2M1_X2_U8`] four times: `vpermb` reads 6 index bits, so the high
/// nibble's shifted-in bits need no mask.
static LUT64: [u8; 64] = {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = E2M1_X2_U8[i % 16];
        i += 1;
    }
    t
};

/// How far ahead of the current block the first row tile of a panel
/// prefetches panel codes: one matrix's panels are contiguous, so this runs
/// into the next panel; as in the row-layout kernel, the hardware prefetcher
/// alone ramps up too slowly on DRAM-cold weights. Later row tiles of the
/// same panel (prefill) find it in L1/L2 and do not prefetch: there the
/// hints cost a third of the prefill time. Default 8 KiB.
pub(super) const PREFETCH_BYTES: usize = 8 * 1024;

/// Bits of the f32 that E8M0 byte 0 encodes (2⁻¹²⁷, subnormal).
const E8M0_ZERO_BITS: i32 = 0x0040_0000;
/// Bits of the NaN that E8M0 byte 255 encodes.
const E8M0_NAN_BITS: i32 = 0x7FC0_0000;

/// The 16 rows' E8M0 scales of one panel block (`scales[0..16]`) as f32;
/// with `special`, bytes 0 and 255 decode as 2⁻¹²⁷ and NaN.
///
/// # Safety
/// AVX-512F present; 16 bytes readable at `scales`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn block_scales(scales: *const u8, special: bool) -> __m512 {
    // SAFETY: the caller's contract.
    let e = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(scales.cast()) });
    let mut sbits = _mm512_slli_epi32::<23>(e);
    if special {
        let zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
        sbits = _mm512_mask_mov_epi32(sbits, zero, _mm512_set1_epi32(E8M0_ZERO_BITS));
        let nan = _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255));
        sbits = _mm512_mask_mov_epi32(sbits, nan, _mm512_set1_epi32(E8M0_NAN_BITS));
    }
    _mm512_castsi512_ps(sbits)
}

/// `acc + Σ` of `w`'s unsigned bytes times the four signed bytes at `x`
/// (broadcast), as `_mm512_dpbusd_epi32`, the broadcast embedded in the
/// instruction. In assembly so that the compiler keeps each one where the
/// loop has it: with the intrinsics LLVM hoisted a block's activation
/// broadcasts ahead of their products and spilled them (and the f32
/// accumulators) to the stack.
///
/// # Safety
/// AVX-512 VNNI present; 4 bytes readable at `x`.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn dpbusd_bcast(mut acc: __m512i, w: __m512i, x: *const u8) -> __m512i {
    // SAFETY: the caller's contract; the instruction reads 4 bytes at `x`.
    unsafe {
        std::arch::asm!(
            "vpdpbusd {a}, {w}, dword ptr [{x}]{{1to16}}",
            a = inout(zmm_reg) acc,
            w = in(zmm_reg) w,
            x = in(reg) x,
            options(nostack, readonly, preserves_flags),
        );
    }
    acc
}

/// The int32 accumulators of block `b` for `MR` activation rows, each at its
/// row's `−12·Σq` (`xc`, `nb` blocks a row).
///
/// # Safety
/// AVX-512F present; `xc` holds `MR · nb` values.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn acc_start<const MR: usize>(xc: *const i32, nb: usize, b: usize) -> [__m512i; MR] {
    let mut acc = [_mm512_setzero_si512(); MR];
    for (i, a) in acc.iter_mut().enumerate() {
        // SAFETY: the caller's contract.
        *a = _mm512_set1_epi32(unsafe { *xc.add(i * nb + b) });
    }
    acc
}

/// The assembly of one code line of an 8-row block ([`tile8`]): 4 bytes of
/// 16 rows' codes at `[cb + code]`, their low and high nibbles looked up, and
/// 2 `vpdpbusd` per activation row against the row's activation bytes `lo`
/// and `hi` (broadcast). Row `i` of the block starts at `x0 + i·s`, reached
/// from `x0`, `x3 = x0 + 3s` and `x6 = x0 + 6s`.
macro_rules! line8 {
    ($code:literal, $lo:literal, $hi:literal) => {
        concat!(
            "vmovdqa64 {pk}, [{cb} + ",
            $code,
            "]\n",
            "vpsrlw {whi}, {pk}, 4\n",
            "vpermb {wlo}, {pk}, {lut}\n",
            "vpermb {whi}, {whi}, {lut}\n",
            "vpdpbusd {a0}, {wlo}, dword ptr [{x0} + ",
            $lo,
            "]{{1to16}}\n",
            "vpdpbusd {a0}, {whi}, dword ptr [{x0} + ",
            $hi,
            "]{{1to16}}\n",
            "vpdpbusd {a1}, {wlo}, dword ptr [{x0} + {s} + ",
            $lo,
            "]{{1to16}}\n",
            "vpdpbusd {a1}, {whi}, dword ptr [{x0} + {s} + ",
            $hi,
            "]{{1to16}}\n",
            "vpdpbusd {a2}, {wlo}, dword ptr [{x0} + {s}*2 + ",
            $lo,
            "]{{1to16}}\n",
            "vpdpbusd {a2}, {whi}, dword ptr [{x0} + {s}*2 + ",
            $hi,
            "]{{1to16}}\n",
            "vpdpbusd {a3}, {wlo}, dword ptr [{x3} + ",
            $lo,
            "]{{1to16}}\n",
            "vpdpbusd {a3}, {whi}, dword ptr [{x3} + ",
            $hi,
            "]{{1to16}}\n",
            "vpdpbusd {a4}, {wlo}, dword ptr [{x0} + {s}*4 + ",
            $lo,
            "]{{1to16}}\n",
            "vpdpbusd {a4}, {whi}, dword ptr [{x0} + {s}*4 + ",
            $hi,
            "]{{1to16}}\n",
            "vpdpbusd {a5}, {wlo}, dword ptr [{x3} + {s}*2 + ",
            $lo,
            "]{{1to16}}\n",
            "vpdpbusd {a5}, {whi}, dword ptr [{x3} + {s}*2 + ",
            $hi,
            "]{{1to16}}\n",
            "vpdpbusd {a6}, {wlo}, dword ptr [{x6} + ",
            $lo,
            "]{{1to16}}\n",
            "vpdpbusd {a6}, {whi}, dword ptr [{x6} + ",
            $hi,
            "]{{1to16}}\n",
            "vpdpbusd {a7}, {wlo}, dword ptr [{x6} + {s} + ",
            $lo,
            "]{{1to16}}\n",
            "vpdpbusd {a7}, {whi}, dword ptr [{x6} + {s} + ",
            $hi,
            "]{{1to16}}\n",
        )
    };
}

/// One 8-row block of [`tile8`]: the template pieces `$t` (code lines of
/// [`line8`] and hints) with the block's pointers, the lookup table and the
/// 8 accumulators `$a` in registers.
macro_rules! vnni8 {
    ($cb:expr, $x0:expr, $x3:expr, $x6:expr, $s:expr, $lut:expr, $a:expr, $($t:expr),+ $(,)?) => {
        std::arch::asm!(
            concat!($($t),+),
            cb = in(reg) $cb,
            x0 = in(reg) $x0,
            x3 = in(reg) $x3,
            x6 = in(reg) $x6,
            s = in(reg) $s,
            lut = in(zmm_reg) $lut,
            pk = out(zmm_reg) _,
            wlo = out(zmm_reg) _,
            whi = out(zmm_reg) _,
            a0 = inout(zmm_reg) $a[0],
            a1 = inout(zmm_reg) $a[1],
            a2 = inout(zmm_reg) $a[2],
            a3 = inout(zmm_reg) $a[3],
            a4 = inout(zmm_reg) $a[4],
            a5 = inout(zmm_reg) $a[5],
            a6 = inout(zmm_reg) $a[6],
            a7 = inout(zmm_reg) $a[7],
            pf0 = const PREFETCH_BYTES,
            pf1 = const PREFETCH_BYTES + 64,
            pf2 = const PREFETCH_BYTES + 128,
            pf3 = const PREFETCH_BYTES + 192,
            options(nostack, readonly, preserves_flags),
        )
    };
}

/// [`tile_avx512`] for 8 activation rows, its block in assembly: LLVM
/// hoisted the block's 64 activation broadcasts ahead of their `vpdpbusd`s
/// and spilled them, and the f32 accumulators, to the stack (half the
/// instructions of the loop were spill traffic). Here each `vpdpbusd` takes
/// its four activation bytes as an embedded broadcast, and the codes, the
/// lookups and the 8 int32 accumulators stay in registers. Tiles of 2–7
/// rows issue each `vpdpbusd` as its own one-instruction `asm!`
/// ([`dpbusd_bcast`]), which keeps them in order too; at 8 rows the whole
/// block as one template measured faster. Same integer sums and f32 steps
/// as the intrinsics, so the same bits.
///
/// # Safety
/// As [`tile_avx512`] with `MR = 8`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
unsafe fn tile8<const PREFETCH: bool>(t: &Tile<'_>, xs: &RowsQ<'_>, out: *mut f32) {
    const MR: usize = 8;
    let nb = t.nb;
    let cols = nb * BLOCK_ELEMS;
    debug_assert!(xs.q.len() == MR * cols && xs.d.len() == MR * nb && xs.c.len() == MR * nb);
    let codes = t.code_bytes().as_ptr();
    let (xq, xd, xc) = (xs.q.as_ptr(), xs.d.as_ptr(), xs.c.as_ptr());
    // SAFETY (whole body): every address below stays inside the panel's
    // nb·256 code bytes and nb·16 scales, or the tile's 8 activation rows
    // (row i of block b at xq + i·cols + 32·b, 32 bytes); prefetches never
    // fault.
    unsafe {
        let lut = _mm512_loadu_si512(LUT64.as_ptr().cast());
        let mut facc = [_mm512_setzero_ps(); MR];
        for b in 0..nb {
            let cb = codes.add(b * 256);
            let x0 = xq.add(b * BLOCK_ELEMS);
            let (x3, x6) = (x0.add(3 * cols), x0.add(6 * cols));
            let mut a = acc_start::<MR>(xc, nb, b);
            if PREFETCH {
                vnni8!(
                    cb,
                    x0,
                    x3,
                    x6,
                    cols,
                    lut,
                    a,
                    "prefetcht0 [{cb} + {pf0}]\n",
                    line8!("0", "0", "16"),
                    "prefetcht0 [{cb} + {pf1}]\n",
                    line8!("64", "4", "20"),
                    "prefetcht0 [{cb} + {pf2}]\n",
                    line8!("128", "8", "24"),
                    "prefetcht0 [{cb} + {pf3}]\n",
                    line8!("192", "12", "28"),
                );
            } else {
                vnni8!(
                    cb,
                    x0,
                    x3,
                    x6,
                    cols,
                    lut,
                    a,
                    // The hint offsets are operands of both variants.
                    "# no hints: {pf0} {pf1} {pf2} {pf3}\n",
                    line8!("0", "0", "16"),
                    line8!("64", "4", "20"),
                    line8!("128", "8", "24"),
                    line8!("192", "12", "28"),
                );
            }
            let ws = block_scales(t.scales.as_ptr().add(b * 16), t.special);
            scale_add(&mut facc, &a, ws, xd, nb, b);
        }
        store_rows(&facc, out, t.rows, t.valid);
    }
}

/// The `MR × 16` AVX-512 tile: per block, `MR` int32 accumulators start at
/// `−12·Σq` and take 8 `vpdpbusd` each (four activation bytes broadcast
/// against 16 rows × 4 codes looked up by `vpermb`), then
/// `acc_f32 += f32(dot) · (scale(w) · d/2)`. With `PREFETCH` (the panel's
/// first row tile) it also hints the codes [`PREFETCH_BYTES`] ahead.
///
/// # Safety
/// AVX-512 F/BW/VNNI/VBMI present; `xs` holds `MR` rows of the panel's
/// width; `out` points at the tile's first output inside `[n, t.rows]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
pub(super) unsafe fn tile_avx512<const MR: usize, const PREFETCH: bool>(
    t: &Tile<'_>,
    xs: &RowsQ<'_>,
    out: *mut f32,
) {
    if MR == 8 {
        // SAFETY: the caller's contract, with MR = 8.
        return unsafe { tile8::<PREFETCH>(t, xs, out) };
    }
    let nb = t.nb;
    let cols = nb * BLOCK_ELEMS;
    debug_assert!(xs.q.len() == MR * cols && xs.d.len() == MR * nb && xs.c.len() == MR * nb);
    let codes = t.code_bytes().as_ptr();
    let (xq, xd, xc) = (xs.q.as_ptr(), xs.d.as_ptr(), xs.c.as_ptr());
    // SAFETY (whole body): every offset below stays inside the panel's
    // nb·256 code bytes and nb·16 scales, or the tile's MR activation rows.
    unsafe {
        let lut = _mm512_loadu_si512(LUT64.as_ptr().cast());
        let mut facc = [_mm512_setzero_ps(); MR];
        for b in 0..nb {
            let cb = codes.add(b * 256);
            let mut acc = acc_start::<MR>(xc, nb, b);
            for v in 0..4 {
                if PREFETCH {
                    // A hint: never faults, whatever the address.
                    _mm_prefetch::<_MM_HINT_T0>(cb.wrapping_add(PREFETCH_BYTES + 64 * v).cast());
                }
                let pk = _mm512_load_si512(cb.add(64 * v).cast());
                let wlo = _mm512_permutexvar_epi8(pk, lut);
                let whi = _mm512_permutexvar_epi8(_mm512_srli_epi16::<4>(pk), lut);
                for (i, a) in acc.iter_mut().enumerate() {
                    let xr = xq.add(i * cols + b * BLOCK_ELEMS);
                    if MR == 1 {
                        // One row (single-sequence decode): nothing to
                        // hoist, and the intrinsics fold the broadcasts
                        // into the address modes of the loop.
                        let lo = _mm512_set1_epi32(xr.add(4 * v).cast::<i32>().read_unaligned());
                        let hi =
                            _mm512_set1_epi32(xr.add(16 + 4 * v).cast::<i32>().read_unaligned());
                        *a = _mm512_dpbusd_epi32(*a, wlo, lo);
                        *a = _mm512_dpbusd_epi32(*a, whi, hi);
                    } else {
                        *a = dpbusd_bcast(*a, wlo, xr.add(4 * v));
                        *a = dpbusd_bcast(*a, whi, xr.add(16 + 4 * v));
                    }
                }
            }
            let ws = block_scales(t.scales.as_ptr().add(b * 16), t.special);
            scale_add(&mut facc, &acc, ws, xd, nb, b);
        }
        store_rows(&facc, out, t.rows, t.valid);
    }
}

/// The `MR × 16` AVX2 tile, two 8-row halves: codes looked up by `vpshufb`,
/// products summed by `vpmaddubsw` (pairs, exact: at most 2·24·127 per
/// pair, 4·24·127 after adding the low and high halves) and `vpmaddwd`,
/// then the same f32 operations per output as [`tile_avx512`].
///
/// # Safety
/// AVX2 and FMA present; otherwise as [`tile_avx512`].
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile_avx2<const MR: usize>(t: &Tile<'_>, xs: &RowsQ<'_>, out: *mut f32) {
    let nb = t.nb;
    let cols = nb * BLOCK_ELEMS;
    debug_assert!(xs.q.len() == MR * cols && xs.d.len() == MR * nb && xs.c.len() == MR * nb);
    let codes = t.code_bytes().as_ptr();
    let (xq, xd, xc) = (xs.q.as_ptr(), xs.d.as_ptr(), xs.c.as_ptr());
    // SAFETY (whole body): as in tile_avx512.
    unsafe {
        let lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(E2M1_X2_U8.as_ptr().cast()));
        let m4 = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut facc = [[_mm256_setzero_ps(); 2]; MR];
        for b in 0..nb {
            let cb = codes.add(b * 256);
            let mut acc = [[_mm256_setzero_si256(); 2]; MR];
            for (i, a) in acc.iter_mut().enumerate() {
                let c = _mm256_set1_epi32(*xc.add(i * nb + b));
                *a = [c, c];
            }
            for v in 0..4 {
                for h in 0..2 {
                    let pk = _mm256_load_si256(cb.add(64 * v + 32 * h).cast());
                    let wlo = _mm256_shuffle_epi8(lut, _mm256_and_si256(pk, m4));
                    let whi =
                        _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16::<4>(pk), m4));
                    for (i, a) in acc.iter_mut().enumerate() {
                        let xr = xq.add(i * cols + b * BLOCK_ELEMS);
                        let lo = _mm256_set1_epi32(xr.add(4 * v).cast::<i32>().read_unaligned());
                        let hi =
                            _mm256_set1_epi32(xr.add(16 + 4 * v).cast::<i32>().read_unaligned());
                        let p = _mm256_add_epi16(
                            _mm256_maddubs_epi16(wlo, lo),
                            _mm256_maddubs_epi16(whi, hi),
                        );
                        a[h] = _mm256_add_epi32(a[h], _mm256_madd_epi16(p, ones));
                    }
                }
            }
            for h in 0..2 {
                let e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                    t.scales.as_ptr().add(b * 16 + 8 * h).cast(),
                ));
                let mut sbits = _mm256_slli_epi32::<23>(e);
                if t.special {
                    let zero = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
                    sbits = _mm256_blendv_epi8(sbits, _mm256_set1_epi32(E8M0_ZERO_BITS), zero);
                    let nan = _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255));
                    sbits = _mm256_blendv_epi8(sbits, _mm256_set1_epi32(E8M0_NAN_BITS), nan);
                }
                let ws = _mm256_castsi256_ps(sbits);
                for (i, (f, a)) in facc.iter_mut().zip(&acc).enumerate() {
                    let s = _mm256_mul_ps(ws, _mm256_set1_ps(*xd.add(i * nb + b)));
                    f[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[h]), s, f[h]);
                }
            }
        }
        for (i, f) in facc.iter().enumerate() {
            let mut y = [0.0f32; 16];
            _mm256_storeu_ps(y.as_mut_ptr(), f[0]);
            _mm256_storeu_ps(y.as_mut_ptr().add(8), f[1]);
            std::ptr::copy_nonoverlapping(y.as_ptr(), out.add(i * t.rows), t.valid.min(16));
        }
    }
}
