//! # Intel AMX tiles: detection, the OS permission, tile configurations
//!
//! Sapphire Rapids and later Xeons carry AMX: eight tile registers
//! (`tmm0`–`tmm7`, each up to 16 rows of 64 bytes) and a unit that multiplies
//! them. `tdpbssd c, a, b` (and its signed/unsigned variants `tdpbsud` &c.)
//! adds to the int32 tile `c [M, N]` the products of the int8 tile
//! `a [M, K]` with `b`, which holds `K/4` rows of `N` groups of 4 bytes (the
//! VNNI layout): `c[m][n] += Σ_k a[m][k] · b[k/4][4n + k%4]`. One instruction
//! does up to 16 × 16 × 64 multiply-adds, the work of 256 `vpdpbusd`.
//!
//! The int8 panel GEMMs ([`crate::mxfp4::panel`], [`crate::q8::panel`])
//! already store 16 output rows in exactly that `b` layout, so a block of 32
//! weights of a panel is one `b` tile of 8 rows and the activation rows of
//! the block one `a` tile read in place (`tileloadd` takes a row stride). The
//! integer sums are exact, so an AMX tile gives bit for bit the AVX-512 VNNI
//! tile's result when it applies the same f32 operations per block.
//!
//! Using tiles takes two steps:
//! - Linux leaves the tile data state off: a process asks for it once,
//!   `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`. [`available`]
//!   checks CPUID (AMX-TILE and AMX-INT8) and makes that request on first
//!   call, cached for the process; `CARACAL_DISABLE_AMX=1` answers `false`
//!   (the VNNI kernels then run: for comparing the two on one machine).
//! - Each thread loads a tile configuration (`ldtilecfg`: rows and bytes per
//!   row of each tile) before using tiles; the OS saves it with the thread.
//!   [`configure`] loads one unless the calling thread already holds it.
//!
//! Rust has no stable AMX intrinsics: kernels use `asm!` with the tile
//! registers named in the template (the compiler never allocates them).

use std::sync::OnceLock;

/// A tile configuration (`ldtilecfg`'s 64-byte operand, palette 1): byte 0
/// the palette, bytes `16 + 2t` the bytes per row of tile `t` (u16), byte
/// `48 + t` its rows. Tiles left at zero are unused.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(C, align(64))]
pub(crate) struct TileConfig([u8; 64]);

impl TileConfig {
    /// No tile in use yet.
    pub(crate) const fn new() -> TileConfig {
        let mut b = [0u8; 64];
        b[0] = 1;
        TileConfig(b)
    }

    /// Tile `t` (0..8) with `rows` (≤ 16) rows of `bytes` (≤ 64) bytes.
    pub(crate) const fn tile(mut self, t: usize, rows: usize, bytes: usize) -> TileConfig {
        assert!(t < 8 && rows <= 16 && bytes <= 64);
        self.0[16 + 2 * t] = bytes as u8;
        self.0[48 + t] = rows as u8;
        self
    }
}

/// Whether this CPU and OS run AMX-INT8 tiles for this process (see the
/// [module docs](self)); detected, and permission asked for, on first call.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let disabled = std::env::var("CARACAL_DISABLE_AMX").is_ok_and(|v| v == "1");
        !disabled && detect()
    })
}

/// Whether [`available`] holds and the CPU also multiplies bf16 tiles
/// (AMX-BF16: `tdpbf16ps`, the products of attention over bf16 KV rows).
pub fn bf16_available() -> bool {
    static BF16: OnceLock<bool> = OnceLock::new();
    *BF16.get_or_init(|| available() && detect_bf16())
}

#[cfg(target_arch = "x86_64")]
fn detect_bf16() -> bool {
    // SAFETY: `available` found CPUID leaf 7.
    #[allow(unused_unsafe)]
    let edx = unsafe { std::arch::x86_64::__cpuid_count(7, 0) }.edx;
    edx & (1 << 22) != 0
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_bf16() -> bool {
    false
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::__cpuid_count;
    /// `arch_prctl` code asking for an extended state component.
    const ARCH_REQ_XCOMP_PERM: libc::c_int = 0x1023;
    /// The AMX tile data component.
    const XFEATURE_XTILEDATA: libc::c_ulong = 18;
    // SAFETY: CPUID leaf 0 always exists; leaf 7 exists when leaf 0 says so
    // (`__cpuid_count` is a safe function on newer toolchains).
    #[allow(unused_unsafe)]
    let max_leaf = unsafe { __cpuid_count(0, 0) }.eax;
    if max_leaf < 7 {
        return false;
    }
    #[allow(unused_unsafe)]
    let edx = unsafe { __cpuid_count(7, 0) }.edx;
    let (tile, int8) = (edx & (1 << 24) != 0, edx & (1 << 25) != 0);
    if !(tile && int8 && crate::cpu::features().avx512_vnni) {
        return false;
    }
    // SAFETY: a plain system call with integer arguments; it fails (and
    // changes nothing) where the kernel does not support the component.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    rc == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// Makes `cfg` the calling thread's tile configuration, loading it only when
/// the thread holds another one (loading clears the tiles: callers keep no
/// tile data across calls). `key` names `cfg` (checking a key is a few
/// cycles, comparing the 64 bytes costs a store-forwarding stall):
/// [`panel_config`]`(mr)` is key `mr`, other configurations take keys above
/// 16. No other code in the process loads tile configurations.
///
/// # Safety
/// [`available`] returned `true`; every call with `key` passes the same
/// configuration.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) unsafe fn configure(key: u32, cfg: &TileConfig) {
    use std::cell::Cell;
    thread_local! {
        static LOADED: Cell<u32> = const { Cell::new(u32::MAX) };
    }
    if LOADED.get() != key {
        // SAFETY: AMX is available and its state permitted (the caller's
        // contract); the operand is a valid 64-byte palette-1 configuration.
        unsafe {
            std::arch::asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly))
        };
        LOADED.set(key);
    }
}

/// The tiles of a panel kernel's `mr`-row tile: 0/1/6/7 int32 results
/// `[mr, 16]` (block `b` on the `b % 4`-th), 2/3 activations
/// `[mr, 32 bytes]` and 4/5 weights `[8, 64 bytes]` (even blocks on the
/// first of each pair, odd blocks on the second).
pub(crate) const fn panel_config(mr: usize) -> TileConfig {
    TileConfig::new()
        .tile(0, mr, 64)
        .tile(1, mr, 64)
        .tile(2, mr, 32)
        .tile(3, mr, 32)
        .tile(4, 8, 64)
        .tile(5, 8, 64)
        .tile(6, mr, 64)
        .tile(7, mr, 64)
}

/// Blocks between a block's product and the f32 step that reads its stored
/// int32 results, in the panel kernels (see [`panel_blocks`]).
pub(crate) const LAG: usize = 4;

/// Result buffers in a panel kernel's ring (a power of two above [`LAG`]).
pub(crate) const RING: usize = 8;

/// One block's product in [`panel_blocks`]: zero tile `$c`, load `$a` from
/// `$x` (rows `$cols` bytes apart) and `$w` from `$wb` (rows 64 bytes
/// apart), `$op` them into `$c`.
macro_rules! tile_product {
    ($op:literal, $c:literal, $a:literal, $w:literal, $x:expr, $cols:expr, $wb:expr) => {
        std::arch::asm!(
            concat!("tilezero tmm", $c),
            concat!("tileloadd tmm", $a, ", [{x} + {cols}]"),
            concat!("tileloadd tmm", $w, ", [{w} + {s64}]"),
            concat!($op, " tmm", $c, ", tmm", $a, ", tmm", $w),
            x = in(reg) $x,
            cols = in(reg) $cols,
            w = in(reg) $wb,
            s64 = in(reg) 64usize,
            options(nostack),
        )
    };
}
#[cfg(target_arch = "x86_64")]
pub(crate) use tile_product;

/// Stores tile `$c` to `$cb` (rows 64 bytes apart), in [`panel_blocks`].
macro_rules! tile_store {
    ($c:literal, $cb:expr) => {
        std::arch::asm!(
            concat!("tilestored [{c} + {s64}], tmm", $c),
            c = in(reg) $cb,
            s64 = in(reg) 64usize,
            options(nostack),
        )
    };
}
#[cfg(target_arch = "x86_64")]
pub(crate) use tile_store;

/// The tile part of a panel kernel ([`panel_config`]) over `$nb` blocks of
/// 32: for block `$b`, zero its result tile, load the activation rows
/// (`$x + 32 b`, stride `$cols`) and the weight tile `$w` (an expression of
/// `$b`: 8 rows of 64 bytes), multiply with `$op` (`"tdpbssd"`,
/// `"tdpbsud"`); store the results to slot `b % RING` of `$ring` (rows of
/// 64 bytes) two blocks later, and run `$finish` for block `$f` once its
/// results are in memory, [`LAG`] blocks later, in block order.
///
/// Why this shape (measured on this Xeon, M = 8, K = 32): a block's product
/// alone issues every ~3 ns, but a store right after its product waits for
/// the product to finish and holds up the tile instructions behind it
/// (~13 ns a block); storing each block's results two products later, with
/// four result tiles in turn, brings it to ~10 ns while staying exact
/// (each block is its own int32 sum).
///
/// # Safety
/// Inside `unsafe` in a function with AVX-512F: AMX available, the
/// configuration [`panel_config`] loaded, and the addresses readable /
/// writable for these shapes.
macro_rules! panel_blocks {
    ($op:literal, $nb:expr, $x:expr, $cols:expr, |$b:ident| $w:expr, $ring:expr, |$f:ident| $finish:block) => {{
        use $crate::amx::{LAG, RING};
        let nb: usize = $nb;
        let (x, cols, ring): (*const u8, usize, *mut i32) = ($x, $cols, $ring);
        let slot = |b: usize| ring.add((b % RING) * 256);
        let store_block = |p: usize| match p % 4 {
            0 => $crate::amx::tile_store!(0, slot(p)),
            1 => $crate::amx::tile_store!(1, slot(p)),
            2 => $crate::amx::tile_store!(6, slot(p)),
            _ => $crate::amx::tile_store!(7, slot(p)),
        };
        for $b in 0..nb {
            let (xb, wb): (*const u8, *const u8) = (x.add($b * 32), $w);
            match $b % 4 {
                0 => $crate::amx::tile_product!($op, 0, 2, 4, xb, cols, wb),
                1 => $crate::amx::tile_product!($op, 1, 3, 5, xb, cols, wb),
                2 => $crate::amx::tile_product!($op, 6, 2, 4, xb, cols, wb),
                _ => $crate::amx::tile_product!($op, 7, 3, 5, xb, cols, wb),
            }
            if $b >= 2 {
                store_block($b - 2);
            }
            if $b >= LAG {
                let $f = $b - LAG;
                $finish
            }
        }
        for p in nb.saturating_sub(2)..nb {
            store_block(p);
        }
        for $f in nb.saturating_sub(LAG)..nb {
            $finish
        }
    }};
}
#[cfg(target_arch = "x86_64")]
pub(crate) use panel_blocks;

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// One `tdpbssd` against the sum it stands for, on odd values.
    #[test]
    fn a_tile_product_is_the_int8_dot_product() {
        if !available() {
            eprintln!("SKIPPED: no AMX-INT8 here");
            return;
        }
        let (m, k) = (5usize, 32usize);
        let a: Vec<i8> = (0..m * 64)
            .map(|i| ((i * 7 % 255) as i32 - 127) as i8)
            .collect();
        let b: Vec<i8> = (0..k / 4 * 64)
            .map(|i| ((i * 13 % 251) as i32 - 125) as i8)
            .collect();
        let mut c = [0i32; 16 * 16];
        let cfg = TileConfig::new()
            .tile(0, m, 64)
            .tile(1, m, k)
            .tile(2, k / 4, 64);
        // SAFETY: AMX available; a is m rows of 64 bytes (k read), b k/4 rows
        // of 64 bytes, c holds m rows of 64 bytes.
        unsafe {
            configure(100, &cfg);
            std::arch::asm!(
                "tilezero tmm0",
                "tileloadd tmm1, [{a} + {s}]",
                "tileloadd tmm2, [{b} + {s}]",
                "tdpbssd tmm0, tmm1, tmm2",
                "tilestored [{c} + {s}], tmm0",
                a = in(reg) a.as_ptr(),
                b = in(reg) b.as_ptr(),
                c = in(reg) c.as_mut_ptr(),
                s = in(reg) 64usize,
                options(nostack),
            );
        }
        for i in 0..m {
            for n in 0..16 {
                let want: i32 = (0..k)
                    .map(|kk| a[i * 64 + kk] as i32 * b[kk / 4 * 64 + 4 * n + kk % 4] as i32)
                    .sum();
                assert_eq!(c[i * 16 + n], want, "({i}, {n})");
            }
        }
    }

    #[test]
    fn configurations_differ_by_their_tiles() {
        let a = TileConfig::new().tile(0, 8, 64);
        assert!(a == TileConfig::new().tile(0, 8, 64));
        assert!(a != TileConfig::new().tile(0, 7, 64));
        assert!(a != TileConfig::new().tile(1, 8, 64));
    }
}
