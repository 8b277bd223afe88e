//! # MXFP4: OCP Microscaling FP4 weights, encoded, decoded and multiplied packed
//!
//! Format (OCP MX v1.0, architecture reference §6.1): blocks of [`BLOCK_ELEMS`] = 32
//! elements share one E8M0 scale byte `e` worth `2^(e − 127)` (`0xFF` is NaN and
//! makes its whole block NaN; there is no zero scale). Each element is a 4-bit
//! E2M1 code: codes 0–7 are `0, 0.5, 1, 1.5, 2, 3, 4, 6` ([`E2M1_VALUES`]) and
//! 8–15 their negatives. 4.25 bits per weight.
//!
//! Layout (gpt-oss / compressed-tensors, §6.2): a `[rows, cols]` weight is two
//! tensors, `blocks: u8 [rows, cols/32, 16]` and `scales: u8 [rows, cols/32]`.
//! Byte `j` of a block holds element `2j` in its low nibble and `2j + 1` in its
//! high nibble. `cols` must be a multiple of 32.
//!
//! What lives here:
//! - [`dequantize`] / [`decode_block`]: the plain decoder, the oracle of every
//!   fast path.
//! - [`quantize`] / [`quantize_block`]: the exact encoder (OCP reference rule for
//!   the shared exponent, round-to-nearest-even on the code, saturating at ±6).
//! - [`matmul_mxfp4`]: `y = x · Wᵀ` straight from the packed bytes, in f32.
//!   Weight rows are decoded in registers two at a time and multiplied with
//!   groups of up to four activation rows, so each weight byte is read from
//!   memory once per call whatever `n` is; for very large `n·cols` the input
//!   dimension is cut into slices whose activations stay in cache. The matrix
//!   is never expanded. (Decoding row tiles into an f32 scratch for the `gemm`
//!   crate was measured 2–6× slower at n = 8–64 on the 2-core Zen host, so
//!   there is no such path.)
//! - [`matmul_mxfp4_q8`]: the same product with activations rounded to int8 per
//!   32-element block (llama.cpp's Q8 scheme) and integer dot products
//!   (AVX-512 VNNI); faster, with the error bound stated on the function.
//!
//! Kernels are picked at run time: AVX-512F (16-entry `vpermps` lookup of the
//! E2M1 values), AVX2+FMA (8-entry lookup plus sign bit), and a portable scalar
//! loop. All of them consume activations whose 32-element blocks are reordered
//! to `[even elements, odd elements]`, the order in which nibbles unpack, so no
//! kernel has to interleave decoded values. Work is split over the rayon pool
//! by ranges of weight rows.

use crate::cpu::Isa;
use crate::error::{Error, Result};
use crate::split::{for_row_ranges, OutPtr};

/// Elements that share one E8M0 scale.
pub const BLOCK_ELEMS: usize = 32;
/// Packed bytes per block: 32 four-bit codes.
pub const BLOCK_BYTES: usize = 16;
/// The E8M0 byte that encodes NaN; every element of its block decodes to NaN.
pub const E8M0_NAN: u8 = 0xFF;
/// The scale byte [`quantize`] writes for an all-zero block: `2^0`. Any scale
/// would decode to zeros; 127 is the neutral exponent.
pub const ZERO_BLOCK_SCALE: u8 = 127;

/// E2M1 code → value. Codes 8–15 carry the sign bit (8 is −0.0).
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// E2M1 values doubled (all integers), as int8: the lookup of the int8 kernel.
const E2M1_X2_I8: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// [`E2M1_X2_I8`] + 12: the doubled values made unsigned for `vpdpbusd`'s
/// unsigned operand; the offset is taken back through the activations' sums.
const E2M1_X2_U8: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (E2M1_X2_I8[i] + 12) as u8;
        i += 1;
    }
    t
};

/// Minimum weight bytes one GEMV task streams, so that rayon's per-task cost
/// (~1 µs) stays small. Default 16 KiB.
const MIN_TASK_BYTES: usize = 16 * 1024;

/// Bit pattern of the f32 that E8M0 byte `e` encodes.
const fn e8m0_bits(e: u8) -> u32 {
    match e {
        0 => 0x0040_0000, // 2^-127 is subnormal in f32
        0xFF => 0x7FC0_0000,
        _ => (e as u32) << 23,
    }
}

/// Every E8M0 byte decoded, so kernels look scales up instead of branching.
static E8M0_TABLE: [f32; 256] = {
    let mut table = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        table[i] = f32::from_bits(e8m0_bits(i as u8));
        i += 1;
    }
    table
};

/// Decodes an E8M0 scale byte: `2^(e − 127)`, NaN for `0xFF`.
#[inline]
pub fn e8m0_to_f32(e: u8) -> f32 {
    E8M0_TABLE[e as usize]
}

/// Checks that `blocks` and `scales` hold a packed `[rows, cols]` matrix.
pub fn check_layout(
    op: &'static str,
    blocks_len: usize,
    scales_len: usize,
    rows: usize,
    cols: usize,
) -> Result<()> {
    if !cols.is_multiple_of(BLOCK_ELEMS) {
        return Err(Error::Shape {
            op,
            detail: format!("cols must be a multiple of {BLOCK_ELEMS}, got {cols}"),
        });
    }
    let nb = rows * (cols / BLOCK_ELEMS);
    if blocks_len != nb * BLOCK_BYTES || scales_len != nb {
        return Err(Error::Shape {
            op,
            detail: format!(
                "[{rows}, {cols}] needs {} block bytes and {nb} scales, got {blocks_len} and {scales_len}",
                nb * BLOCK_BYTES
            ),
        });
    }
    Ok(())
}

/// Decodes one block: `out[2j] = E2M1[block[j] & 15]·s`, `out[2j+1] = E2M1[block[j] >> 4]·s`.
///
/// Exact in f32 except at the top of the E8M0 range: with scale bytes 253/254
/// the values of magnitude ≥ 4·2¹²⁶ exceed f32 and decode to ±∞ (every kernel
/// here does the same).
pub fn decode_block(block: &[u8; BLOCK_BYTES], scale: u8, out: &mut [f32; BLOCK_ELEMS]) {
    let s = e8m0_to_f32(scale);
    for (j, &b) in block.iter().enumerate() {
        out[2 * j] = E2M1_VALUES[(b & 0xF) as usize] * s;
        out[2 * j + 1] = E2M1_VALUES[(b >> 4) as usize] * s;
    }
}

/// The plain decoder: the whole `[rows, cols]` matrix as row-major f32.
/// The oracle of every fused kernel; use it for small weights and tests only.
pub fn dequantize(blocks: &[u8], scales: &[u8], rows: usize, cols: usize) -> Result<Vec<f32>> {
    check_layout("mxfp4::dequantize", blocks.len(), scales.len(), rows, cols)?;
    let mut out = vec![0.0; rows * cols];
    for ((o, b), &s) in out
        .chunks_exact_mut(BLOCK_ELEMS)
        .zip(blocks.chunks_exact(BLOCK_BYTES))
        .zip(scales)
    {
        decode_block(
            b.try_into().expect("chunks_exact yields whole blocks"),
            s,
            o.try_into().expect("chunks_exact yields whole blocks"),
        );
    }
    Ok(out)
}

/// `floor(log2(a))` for a finite `a > 0`, exact for subnormals too.
pub fn floor_log2(a: f32) -> i32 {
    let bits = a.to_bits() & 0x7FFF_FFFF;
    let biased = (bits >> 23) as i32;
    if biased > 0 {
        biased - 127
    } else {
        31 - bits.leading_zeros() as i32 - 149
    }
}

/// Nearest E2M1 code to `v` (already divided by the block scale): ties go to
/// the even code, magnitudes above 6 saturate to ±6, the sign is kept (−0 → 8).
pub fn e2m1_code(v: f32) -> u8 {
    // Midpoints between consecutive magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
    const MID: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let m = v.abs();
    let mut code = 0u8;
    for (k, &t) in MID.iter().enumerate() {
        let up = k as u8 + 1;
        if m > t || (m == t && up.is_multiple_of(2)) {
            code = up;
        } else {
            break;
        }
    }
    code | if v.is_sign_negative() { 8 } else { 0 }
}

/// Encodes one block of 32 values into packed codes and its scale byte.
///
/// The shared exponent follows the OCP MX reference ("microxcaling"):
/// `floor(log2(amax)) − 2` (2 is E2M1's largest exponent), clamped to the
/// E8M0 range [−127, 127]; elements are divided by `2^exp` (exactly) and
/// rounded to the nearest E2M1 value, ties to the even code, saturating at ±6.
/// An all-zero block gets [`ZERO_BLOCK_SCALE`]; a block with any NaN or ±∞
/// gets [`E8M0_NAN`] and zero codes.
pub fn quantize_block(x: &[f32; BLOCK_ELEMS]) -> ([u8; BLOCK_BYTES], u8) {
    if x.iter().any(|v| !v.is_finite()) {
        return ([0; BLOCK_BYTES], E8M0_NAN);
    }
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let exp = if amax == 0.0 {
        0
    } else {
        (floor_log2(amax) - 2).clamp(-127, 127)
    };
    // 2^-exp with exp in [-127, 125] (finite amax < 2^128) is a normal f32.
    let inv = f32::from_bits(((127 - exp) as u32) << 23);
    let mut out = [0u8; BLOCK_BYTES];
    for (j, o) in out.iter_mut().enumerate() {
        *o = e2m1_code(x[2 * j] * inv) | (e2m1_code(x[2 * j + 1] * inv) << 4);
    }
    (out, (exp + 127) as u8)
}

/// Encodes a row-major `[rows, cols]` f32 matrix into `(blocks, scales)` with
/// [`quantize_block`]. Errors if `cols` is not a multiple of 32 or `w` has the
/// wrong length.
pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Result<(Vec<u8>, Vec<u8>)> {
    let op = "mxfp4::quantize";
    if !cols.is_multiple_of(BLOCK_ELEMS) {
        return Err(Error::Shape {
            op,
            detail: format!("cols must be a multiple of {BLOCK_ELEMS}, got {cols}"),
        });
    }
    if w.len() != rows * cols {
        return Err(Error::Shape {
            op,
            detail: format!(
                "[{rows}, {cols}] needs {} values, got {}",
                rows * cols,
                w.len()
            ),
        });
    }
    let nb = w.len() / BLOCK_ELEMS;
    let mut blocks = Vec::with_capacity(nb * BLOCK_BYTES);
    let mut scales = Vec::with_capacity(nb);
    for chunk in w.chunks_exact(BLOCK_ELEMS) {
        let (b, s) = quantize_block(chunk.try_into().expect("chunks_exact yields whole blocks"));
        blocks.extend_from_slice(&b);
        scales.push(s);
    }
    Ok((blocks, scales))
}

/// `out[n, rows] = x[n, cols] · Wᵀ` with `W` packed MXFP4, computed in f32
/// (FMA, results differ from an f64 dot product only by f32 summation
/// rounding, at most `cols · 2⁻²³ · Σ|w·x|`). A NaN scale makes the outputs of
/// its row NaN.
///
/// # Panics
/// If the packed layout does not match `[rows, cols]` (see [`check_layout`]) or
/// `x`/`out` are not `n` rows long.
pub fn matmul_mxfp4(
    x: &[f32],
    n: usize,
    blocks: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    out: &mut [f32],
) {
    matmul_exact(
        Isa::best(),
        slice_blocks(n, 4 * BLOCK_ELEMS, 1),
        x,
        n,
        blocks,
        scales,
        rows,
        cols,
        out,
    );
}

/// [`matmul_mxfp4`] with activations rounded to int8 per 32-element block
/// (`d = amax/127`, `q = round(x/d)`) and exact integer dot products per block.
///
/// Error: `|y − y_exact| ≤ Σᵢ |wᵢ|·d_b(i)/2 · (1 + 2⁻²⁰)` plus f32 summation
/// rounding, where `d_b` is the activation step of the block holding `i`
/// (about 0.4% of the block's largest activation). Non-finite activations give
/// non-finite outputs. Measured relative RMS error of the outputs: 0.3–0.7% for
/// uniform random activations, ~1.1% with 20× outliers. Uses AVX-512 VNNI; where that is missing the exact
/// [`matmul_mxfp4`] runs instead (which meets the same bound).
///
/// # Panics
/// As [`matmul_mxfp4`].
pub fn matmul_mxfp4_q8(
    x: &[f32],
    n: usize,
    blocks: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    out: &mut [f32],
) {
    if !q8_available() {
        return matmul_mxfp4(x, n, blocks, scales, rows, cols, out);
    }
    matmul_q8(
        slice_blocks(n, 36, 4),
        x,
        n,
        blocks,
        scales,
        rows,
        cols,
        out,
    );
}

// ---------------------------------------------------------------------------
// Dispatch and drivers.

/// Whether the int8 kernel of [`matmul_mxfp4_q8`] runs on this CPU
/// (AVX-512 F, BW and VNNI, as the Q8_0 kernel).
fn q8_available() -> bool {
    crate::cpu::features().avx512_vnni
}

/// Panics unless the arguments describe `out[n, rows] = x[n, cols] · Wᵀ`.
fn check_args(
    x: &[f32],
    n: usize,
    blocks: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    out: &[f32],
) {
    if let Err(e) = check_layout("matmul_mxfp4", blocks.len(), scales.len(), rows, cols) {
        panic!("{e}");
    }
    assert_eq!(x.len(), n * cols, "matmul_mxfp4: x must be [n, cols]");
    assert_eq!(out.len(), n * rows, "matmul_mxfp4: out must be [n, rows]");
}

/// Copies `x` reordering each 32-element block to `[even elements, odd elements]`.
fn permute_blocks(x: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for (o, b) in out
        .chunks_exact_mut(BLOCK_ELEMS)
        .zip(x.chunks_exact(BLOCK_ELEMS))
    {
        for j in 0..BLOCK_ELEMS / 2 {
            o[j] = b[2 * j];
            o[16 + j] = b[2 * j + 1];
        }
    }
    out
}

/// Activation bytes held per K slice by the GEMV driver. The slice of all `n`
/// activation rows is re-read for every pair of weight rows, so for long
/// prefills it must stay in cache. Slices of 128 KiB–1 MiB (L2-sized) measured
/// 10–60% slower than none at n = 64, [4096 × 4096] on the Zen host, so the
/// default 4 MiB only cuts activations that would spill out of L3's reach.
/// Range: 256 KiB up to a share of L3.
const X_SLICE_BYTES: usize = 4 * 1024 * 1024;

/// Blocks per K slice for `n` activation rows of `block_bytes` prepared bytes
/// per block: the slice of all rows fits in [`X_SLICE_BYTES`]; a multiple of
/// `unit`, at least `unit`.
fn slice_blocks(n: usize, block_bytes: usize, unit: usize) -> usize {
    (X_SLICE_BYTES / (block_bytes * n.max(1)) / unit).max(1) * unit
}

/// The exact product with a chosen kernel and K-slice length (in blocks).
#[allow(clippy::too_many_arguments)]
fn matmul_exact(
    isa: Isa,
    slice: usize,
    x: &[f32],
    n: usize,
    blocks: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    out: &mut [f32],
) {
    check_args(x, n, blocks, scales, rows, cols, out);
    if n == 0 || rows == 0 {
        return;
    }
    if cols == 0 {
        out.fill(0.0);
        return;
    }
    let xp = permute_blocks(x);
    let kernel = ExactKernel { isa, xp: &xp, cols };
    Gemv {
        kernel,
        n,
        cols,
        rows,
        slice: slice.max(1),
        out: OutPtr(out.as_mut_ptr()),
    }
    .run(blocks, scales);
}

/// The int8-activation product with a K-slice length (in blocks, a multiple of 4).
/// Only called when [`q8_available`].
#[allow(clippy::too_many_arguments)]
fn matmul_q8(
    slice: usize,
    x: &[f32],
    n: usize,
    blocks: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    out: &mut [f32],
) {
    check_args(x, n, blocks, scales, rows, cols, out);
    assert!(
        slice.is_multiple_of(4) && slice > 0,
        "matmul_q8: slices are whole groups of 4 blocks"
    );
    if n == 0 || rows == 0 {
        return;
    }
    if cols == 0 {
        out.fill(0.0);
        return;
    }
    let ng = (cols / BLOCK_ELEMS).div_ceil(4);
    // Decode calls this a few hundred times per token: reuse this thread's
    // buffers. They are taken out for the call, so a nested call on the same
    // thread (work stealing) simply starts with empty ones.
    thread_local! {
        static SCRATCH: std::cell::RefCell<(Vec<u8>, Vec<f32>, Vec<i32>)> =
            const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
    }
    let (mut xq, mut dx, mut xc) = SCRATCH.with(|cell| cell.take());
    q8_with_buffers(
        slice, x, n, blocks, scales, rows, cols, out, ng, &mut xq, &mut dx, &mut xc,
    );
    SCRATCH.with(|cell| *cell.borrow_mut() = (xq, dx, xc));
}

/// [`matmul_q8`] with the prepared-activation buffers supplied (resized here).
#[allow(clippy::too_many_arguments)]
fn q8_with_buffers(
    slice: usize,
    x: &[f32],
    n: usize,
    blocks: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    out: &mut [f32],
    ng: usize,
    xq: &mut Vec<u8>,
    dx: &mut Vec<f32>,
    xc: &mut Vec<i32>,
) {
    xq.clear();
    xq.resize(n * ng * 128, 0);
    dx.clear();
    dx.resize(n * ng * 4, 0.0);
    xc.clear();
    xc.resize(n * ng * 16, 0);
    for (((xi, q), d), c) in x
        .chunks_exact(cols)
        .zip(xq.chunks_exact_mut(ng * 128))
        .zip(dx.chunks_exact_mut(ng * 4))
        .zip(xc.chunks_exact_mut(ng * 16))
    {
        quantize_activations_q8(xi, q, d, c);
    }
    let kernel = Q8Kernel { xq, dx, xc, ng };
    Gemv {
        kernel,
        n,
        cols,
        rows,
        slice,
        out: OutPtr(out.as_mut_ptr()),
    }
    .run(blocks, scales);
}

/// Packed bytes and scales of one weight row (or of a slice of its blocks).
type Row<'a> = (&'a [u8], &'a [u8]);

/// A fused kernel the GEMV driver runs: packed weight rows against activation
/// rows prepared once per call.
trait DotKernel: Sync {
    /// Whether four weight rows per call fit the registers when at most two
    /// activation rows are multiplied (decode); otherwise two.
    const QUAD_ROWS_FOR_DECODE: bool = false;

    /// `y[m][i] = w_m · x_(i0+i)` over blocks `kb0..kb1` (the span of `w`).
    fn dot<const MW: usize, const NX: usize>(
        &self,
        w: [Row<'_>; MW],
        i0: usize,
        kb0: usize,
        kb1: usize,
    ) -> [[f32; NX]; MW];
}

/// [`matmul_mxfp4`]'s kernel: f32 activations with permuted blocks.
struct ExactKernel<'a> {
    /// Kernel to run.
    isa: Isa,
    /// Activations `[n, cols]`, blocks permuted to `[evens, odds]`.
    xp: &'a [f32],
    /// Input features (the row stride of `xp`).
    cols: usize,
}

impl DotKernel for ExactKernel<'_> {
    fn dot<const MW: usize, const NX: usize>(
        &self,
        w: [Row<'_>; MW],
        i0: usize,
        kb0: usize,
        kb1: usize,
    ) -> [[f32; NX]; MW] {
        let xs = std::array::from_fn(|i| {
            &self.xp
                [(i0 + i) * self.cols + kb0 * BLOCK_ELEMS..(i0 + i) * self.cols + kb1 * BLOCK_ELEMS]
        });
        rows_dot::<MW, NX>(self.isa, w, xs)
    }
}

/// [`matmul_mxfp4_q8`]'s kernel: int8 activations in groups of 4 blocks.
struct Q8Kernel<'a> {
    /// `q` (i8 bits) per activation, `ng · 128` bytes per row ([`quantize_activations_q8`]).
    xq: &'a [u8],
    /// `−12·Σq` per `vpdpbusd` lane, `ng · 16` per row.
    xc: &'a [i32],
    /// `d/2` per block, `ng · 4` per row.
    dx: &'a [f32],
    /// Groups of 4 blocks per row.
    ng: usize,
}

impl DotKernel for Q8Kernel<'_> {
    const QUAD_ROWS_FOR_DECODE: bool = true;

    fn dot<const MW: usize, const NX: usize>(
        &self,
        w: [Row<'_>; MW],
        i0: usize,
        kb0: usize,
        kb1: usize,
    ) -> [[f32; NX]; MW] {
        // Slices start on a group boundary; only the last one may end inside a group.
        let (g0, g1) = (kb0 / 4, kb1.div_ceil(4));
        let xs = std::array::from_fn(|i| {
            let row = (i0 + i) * self.ng;
            (
                &self.xq[(row + g0) * 128..(row + g1) * 128],
                &self.dx[(row + g0) * 4..(row + g1) * 4],
                &self.xc[(row + g0) * 16..(row + g1) * 16],
            )
        });
        q8_dot::<MW, NX>(w, xs)
    }
}

/// One GEMV-style product: weight rows stream once per K slice, two at a
/// time, each pair against groups of up to four activation rows.
struct Gemv<K> {
    /// The dot-product kernel and its prepared activations.
    kernel: K,
    /// Activation rows.
    n: usize,
    /// Input features.
    cols: usize,
    /// Output features (the row stride of `out`).
    rows: usize,
    /// Blocks per K slice ([`slice_blocks`]; smaller in tests).
    slice: usize,
    /// `out[n, rows]`; each task writes only its own weight rows' columns.
    out: OutPtr,
}

impl<K: DotKernel> Gemv<K> {
    /// Computes the whole product, split over the rayon pool by weight rows.
    fn run(&self, blocks: &[u8], scales: &[u8]) {
        let nb = self.cols / BLOCK_ELEMS;
        for_row_ranges(
            self.rows,
            nb * (BLOCK_BYTES + 1),
            MIN_TASK_BYTES,
            |r0, r1| self.rows(blocks, scales, r0, r1),
        );
    }

    /// Computes output columns `r0..r1`.
    fn rows(&self, blocks: &[u8], scales: &[u8], r0: usize, r1: usize) {
        let nb = self.cols / BLOCK_ELEMS;
        for kb0 in (0..nb).step_by(self.slice) {
            let kb1 = (kb0 + self.slice).min(nb);
            let row = |r: usize| -> Row<'_> {
                (
                    &blocks[(r * nb + kb0) * BLOCK_BYTES..(r * nb + kb1) * BLOCK_BYTES],
                    &scales[r * nb + kb0..r * nb + kb1],
                )
            };
            let mut r = r0;
            if K::QUAD_ROWS_FOR_DECODE && self.n <= 2 {
                while r + 4 <= r1 {
                    self.x_groups(r, [row(r), row(r + 1), row(r + 2), row(r + 3)], kb0, kb1);
                    r += 4;
                }
            }
            while r < r1 {
                if r + 1 < r1 {
                    self.x_groups(r, [row(r), row(r + 1)], kb0, kb1);
                    r += 2;
                } else {
                    self.x_groups(r, [row(r)], kb0, kb1);
                    r += 1;
                }
            }
        }
    }

    /// Weight rows `r..r+MW` (blocks `kb0..kb1`) against every activation row,
    /// four at a time; the first K slice stores, later ones add.
    fn x_groups<const MW: usize>(&self, r: usize, w: [Row<'_>; MW], kb0: usize, kb1: usize) {
        let k = &self.kernel;
        let mut i = 0;
        while i < self.n {
            let take = (self.n - i).min(4);
            let mut y = [[0.0f32; 4]; MW];
            let mut put = |t: &[[f32; 4]]| y.iter_mut().zip(t).for_each(|(d, s)| *d = *s);
            match take {
                4 => put(&k.dot::<MW, 4>(w, i, kb0, kb1)),
                3 => put(&k
                    .dot::<MW, 3>(w, i, kb0, kb1)
                    .map(|a| [a[0], a[1], a[2], 0.0])),
                2 => put(&k
                    .dot::<MW, 2>(w, i, kb0, kb1)
                    .map(|a| [a[0], a[1], 0.0, 0.0])),
                _ => put(&k
                    .dot::<MW, 1>(w, i, kb0, kb1)
                    .map(|a| [a[0], 0.0, 0.0, 0.0])),
            }
            for (m, ym) in y.iter().enumerate() {
                for (kx, &v) in ym[..take].iter().enumerate() {
                    // SAFETY: (i + kx, r + m) is inside out ([n, rows], checked by the
                    // caller) and weight row r + m belongs to this task only.
                    unsafe {
                        let p = self.out.get().add((i + kx) * self.rows + r + m);
                        *p = if kb0 == 0 { v } else { *p + v };
                    }
                }
            }
            i += take;
        }
    }
}

/// Dot products of `MW` packed weight rows with `NX` permuted activation rows:
/// `y[m][i] = w_m · x_i`.
fn rows_dot<const MW: usize, const NX: usize>(
    isa: Isa,
    w: [Row<'_>; MW],
    xs: [&[f32]; NX],
) -> [[f32; NX]; MW] {
    for (wb, ws) in w {
        assert_eq!(
            wb.len(),
            ws.len() * BLOCK_BYTES,
            "rows_dot: one scale per block"
        );
        assert!(
            xs.iter().all(|x| x.len() == ws.len() * BLOCK_ELEMS),
            "rows_dot: activations span the row"
        );
    }
    match isa {
        // SAFETY: Avx512/Avx2 are only chosen when the CPU has them (Isa::best,
        // or tests that check first); lengths asserted above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::rows_dot_avx512(w, xs) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => w.map(|(wb, ws)| unsafe { x86::row_dot_avx2(wb, ws, xs) }),
        _ => w.map(|(wb, ws)| row_dot_scalar(wb, ws, xs)),
    }
}

/// Portable single-row [`rows_dot`]: block sums in f32, then scaled.
fn row_dot_scalar<const NX: usize>(wb: &[u8], ws: &[u8], xs: [&[f32]; NX]) -> [f32; NX] {
    let mut acc = [0.0f32; NX];
    for (b, (blk, &e)) in wb.chunks_exact(BLOCK_BYTES).zip(ws).enumerate() {
        let mut t = [0.0f32; NX];
        for (j, &byte) in blk.iter().enumerate() {
            let (lo, hi) = (
                E2M1_VALUES[(byte & 0xF) as usize],
                E2M1_VALUES[(byte >> 4) as usize],
            );
            for (ti, x) in t.iter_mut().zip(&xs) {
                *ti += lo * x[32 * b + j] + hi * x[32 * b + 16 + j];
            }
        }
        let s = e8m0_to_f32(e);
        for (a, ti) in acc.iter_mut().zip(t) {
            *a += ti * s;
        }
    }
    acc
}

/// Rounds one activation row to int8 per block, in the int8 kernel's layout:
/// groups of 4 blocks as `[evens of b0..b3 (16 each), odds of b0..b3]`, each
/// value stored as the bits of `q: i8`; `dx[b]` gets `d/2` (the weights are
/// doubled); `xc[16g + l]` gets `−12·Σq` over the activations lane `l` of
/// group `g` meets (bytes `4l..4l+4` of both halves), which takes back the
/// +12 that makes the weights unsigned. Padding blocks of the last group keep
/// `q = 0` and `d = 0`.
fn quantize_activations_q8(x: &[f32], xq: &mut [u8], dx: &mut [f32], xc: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    if q8_available() {
        // SAFETY: AVX-512 F/BW are present (checked just above).
        return unsafe { quantize_activations_q8_avx512(x, xq, dx, xc) };
    }
    quantize_activations_q8_body(x, xq, dx, xc)
}

/// [`quantize_activations_q8`] with AVX-512 (the only CPUs that run the int8
/// kernel): per block, evens and odds split with two permutes, max |x| by a
/// vector reduction, round-to-nearest-even and saturating packs to bytes.
/// Bit-identical to [`quantize_activations_q8_body`] (same products, same
/// rounding), except that a block holding NaN gets `d = NaN` here (the plain
/// loop's `f32::max` skips NaN) — both give non-finite outputs for ∞.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn quantize_activations_q8_avx512(x: &[f32], xq: &mut [u8], dx: &mut [f32], xc: &mut [i32]) {
    use std::arch::x86_64::*;
    let even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    let odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    let (lo_c, hi_c) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    for (b, blk) in x.chunks_exact(BLOCK_ELEMS).enumerate() {
        // SAFETY: a block is 32 floats.
        let (lo, hi) = unsafe {
            (
                _mm512_loadu_ps(blk.as_ptr()),
                _mm512_loadu_ps(blk.as_ptr().add(16)),
            )
        };
        let zero = _mm512_setzero_ps();
        // x·0 is NaN exactly for ±∞ and NaN.
        let finite = _mm512_reduce_add_ps(_mm512_add_ps(
            _mm512_mul_ps(lo, zero),
            _mm512_mul_ps(hi, zero),
        )) == 0.0;
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        let d = amax / 127.0;
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        dx[b] = if finite { d * 0.5 } else { f32::NAN };
        let inv = _mm512_set1_ps(inv);
        let q = |v: __m512| {
            let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(v, inv),
            );
            _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo_c), hi_c))
        };
        let qe = q(_mm512_permutex2var_ps(lo, even, hi));
        let qo = q(_mm512_permutex2var_ps(lo, odd, hi));
        let (g, k) = (b / 4, b % 4);
        let base = g * 128 + k * 16;
        // SAFETY: xq holds whole groups of 128 bytes; base + 64 + 16 ≤ 128·(g + 1).
        unsafe {
            _mm_storeu_si128(xq.as_mut_ptr().add(base).cast(), _mm512_cvtsepi32_epi8(qe));
            _mm_storeu_si128(
                xq.as_mut_ptr().add(base + 64).cast(),
                _mm512_cvtsepi32_epi8(qo),
            );
        }
        let mut sums = [0i32; 16];
        // SAFETY: 16 i32 lanes into a 16-element array.
        unsafe { _mm512_storeu_si512(sums.as_mut_ptr().cast(), _mm512_add_epi32(qe, qo)) };
        for l in 0..4 {
            xc[g * 16 + k * 4 + l] -=
                12 * (sums[4 * l] + sums[4 * l + 1] + sums[4 * l + 2] + sums[4 * l + 3]);
        }
    }
}

/// The body of [`quantize_activations_q8`]: each block is split into its
/// even and odd elements first, so every loop below is a plain lane-wise loop.
#[inline(always)]
fn quantize_activations_q8_body(x: &[f32], xq: &mut [u8], dx: &mut [f32], xc: &mut [i32]) {
    const H: usize = BLOCK_ELEMS / 2;
    for (b, blk) in x.chunks_exact(BLOCK_ELEMS).enumerate() {
        let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        // NaN/∞ activations make d non-finite, so their outputs are non-finite too.
        dx[b] = if amax.is_finite() { d * 0.5 } else { f32::NAN };
        let (mut ev, mut od) = ([0.0f32; H], [0.0f32; H]);
        for j in 0..H {
            ev[j] = blk[2 * j];
            od[j] = blk[2 * j + 1];
        }
        let q = |v: f32| crate::q8::round_even(v * inv).clamp(-127.0, 127.0) as i8;
        let (mut qe, mut qo) = ([0i8; H], [0i8; H]);
        for j in 0..H {
            qe[j] = q(ev[j]);
            qo[j] = q(od[j]);
        }
        let (g, k) = (b / 4, b % 4);
        let base = g * 128 + k * 16;
        for j in 0..H {
            xq[base + j] = qe[j] as u8;
            xq[base + 64 + j] = qo[j] as u8;
        }
        for l in 0..H / 4 {
            let s: i32 = (0..4)
                .map(|t| qe[4 * l + t] as i32 + qo[4 * l + t] as i32)
                .sum();
            xc[g * 16 + k * 4 + l] -= 12 * s;
        }
    }
}

/// Int8 dot products of `MW` packed rows with `NX` quantised activation rows.
fn q8_dot<const MW: usize, const NX: usize>(
    w: [Row<'_>; MW],
    xs: [(&[u8], &[f32], &[i32]); NX],
) -> [[f32; NX]; MW] {
    let ng = w[0].1.len().div_ceil(4);
    for (wb, ws) in w {
        assert!(
            wb.len() == ws.len() * BLOCK_BYTES && ws.len().div_ceil(4) == ng,
            "q8_dot: one scale per block"
        );
    }
    assert!(
        xs.iter()
            .all(|(q, d, c)| q.len() == ng * 128 && d.len() == ng * 4 && c.len() == ng * 16),
        "q8_dot: activations span the row"
    );
    #[cfg(target_arch = "x86_64")]
    {
        assert!(q8_available(), "q8_dot: needs AVX-512 VNNI");
        // SAFETY: features checked just above; lengths asserted.
        unsafe { x86::q8_dot_avx512(w, xs) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("q8_dot is only reached when q8_available()")
}

pub mod panel;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
