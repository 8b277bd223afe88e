//! ggml tensor types and their dequantisation to f32.
//!
//! Each quantised type packs `block_size` weights into `type_size` bytes. The layouts
//! below follow ggml's `ggml-common.h` field for field, and the arithmetic follows the
//! reference dequantisers `dequantize_row_*` of `ggml-quants.c` operation for operation
//! (same products, same order, no fused multiply-add), so the results are bit-identical
//! to ggml's and to the numpy ones of the PyPI `gguf` package.
//!
//! | type | block | bytes | layout |
//! |---|---|---|---|
//! | Q4_0 | 32 | 18 | f16 d, 16 B nibbles; `y = d·(q−8)` |
//! | Q4_1 | 32 | 20 | f16 d, f16 m, 16 B nibbles; `y = d·q + m` |
//! | Q5_0 | 32 | 22 | f16 d, u32 high bits, 16 B nibbles; `y = d·(q−16)` |
//! | Q5_1 | 32 | 24 | f16 d, f16 m, u32 high bits, nibbles; `y = d·q + m` |
//! | Q8_0 | 32 | 34 | f16 d, 32 × i8; `y = d·q` |
//! | Q8_1 | 32 | 36 | f16 d, f16 s (= d·Σq, unused here), 32 × i8 |
//! | Q2_K | 256 | 84 | 16 B 4-bit scale/min pairs, 64 B 2-bit quants, f16 d, f16 dmin |
//! | Q3_K | 256 | 110 | 32 B high-bit mask, 64 B 2-bit quants, 12 B 6-bit scales, f16 d |
//! | Q4_K | 256 | 144 | f16 d, f16 dmin, 12 B 6-bit scales/mins, 128 B nibbles |
//! | Q5_K | 256 | 176 | as Q4_K plus 32 B high bits |
//! | Q6_K | 256 | 210 | 128 B low nibbles, 64 B high 2 bits, 16 × i8 scales, f16 d |
//! | Q8_K | 256 | 292 | f32 d, 256 × i8, 16 × i16 block sums (unused here) |
//! | MXFP4 | 32 | 17 | e8m0 scale, 16 B of e2m1 nibbles |
//!
//! Plain element types (F32, F16, BF16, F64, I8, I16, I32) are "blocks" of one element.
//! The IQ*, TQ*, NVFP4, Q1_0 and I64 types are recognised (so files holding them can be
//! read and inspected) but [`dequantize`] refuses them with
//! [`GgufError::UnsupportedType`].

use std::fmt;

use rayon::prelude::*;

use super::{GgufError, Result};

/// A ggml tensor element type, with the numeric id GGUF stores for it.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// 4-bit, symmetric, 32 per block.
    Q4_0,
    /// 4-bit with a minimum, 32 per block.
    Q4_1,
    /// 5-bit, symmetric, 32 per block.
    Q5_0,
    /// 5-bit with a minimum, 32 per block.
    Q5_1,
    /// 8-bit, symmetric, 32 per block.
    Q8_0,
    /// 8-bit with a stored block sum (activation format), 32 per block.
    Q8_1,
    /// 2-bit K-quant, 256 per super-block.
    Q2_K,
    /// 3-bit K-quant.
    Q3_K,
    /// 4-bit K-quant.
    Q4_K,
    /// 5-bit K-quant.
    Q5_K,
    /// 6-bit K-quant.
    Q6_K,
    /// 8-bit K-quant (f32 scale, activation format).
    Q8_K,
    /// i-quant, 2.06 bpw (not dequantised here).
    IQ2_XXS,
    /// i-quant, 2.31 bpw (not dequantised here).
    IQ2_XS,
    /// i-quant, 3.06 bpw (not dequantised here).
    IQ3_XXS,
    /// i-quant, 1.56 bpw (not dequantised here).
    IQ1_S,
    /// Non-linear 4-bit, 32 per block (not dequantised here).
    IQ4_NL,
    /// i-quant, 3.44 bpw (not dequantised here).
    IQ3_S,
    /// i-quant, 2.5 bpw (not dequantised here).
    IQ2_S,
    /// Non-linear 4-bit K-style (not dequantised here).
    IQ4_XS,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer (not dequantised: not exact in f32).
    I64,
    /// IEEE binary64.
    F64,
    /// i-quant, 1.75 bpw (not dequantised here).
    IQ1_M,
    /// bfloat16.
    BF16,
    /// Ternary, 1.69 bpw (not dequantised here).
    TQ1_0,
    /// Ternary, 2.06 bpw (not dequantised here).
    TQ2_0,
    /// OCP microscaling FP4: e8m0 scale + 32 e2m1 values.
    MXFP4,
    /// NVIDIA FP4 (not dequantised here).
    NVFP4,
    /// 1-bit, 128 per block (not dequantised here).
    Q1_0,
}

impl GgmlType {
    /// Every known type, in id order.
    pub const ALL: [GgmlType; 34] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ4_NL,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ4_XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::IQ1_M,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::MXFP4,
        GgmlType::NVFP4,
        GgmlType::Q1_0,
    ];

    /// The id GGUF stores for this type (ggml's `enum ggml_type`).
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2_K => 10,
            Q3_K => 11,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
            IQ2_XXS => 16,
            IQ2_XS => 17,
            IQ3_XXS => 18,
            IQ1_S => 19,
            IQ4_NL => 20,
            IQ3_S => 21,
            IQ2_S => 22,
            IQ4_XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1_M => 29,
            BF16 => 30,
            TQ1_0 => 34,
            TQ2_0 => 35,
            MXFP4 => 39,
            NVFP4 => 40,
            Q1_0 => 41,
        }
    }

    /// The type with GGUF id `id`, if it is a known one (ids 4, 5, 31–33 were removed
    /// from ggml and are not accepted).
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.iter().copied().find(|t| t.id() == id)
    }

    /// Weights per block.
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | F64 | I8 | I16 | I32 | I64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4_NL | MXFP4 => 32,
            NVFP4 => 64,
            Q1_0 => 128,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S
            | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 => 256,
        }
    }

    /// Bytes per block (`sizeof(block_*)` in ggml-common.h).
    pub fn type_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | I32 => 4,
            F16 | BF16 | I16 => 2,
            F64 | I64 => 8,
            I8 => 1,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2_K => 84,
            Q3_K => 110,
            Q4_K => 144,
            Q5_K => 176,
            Q6_K => 210,
            Q8_K => 292,
            IQ2_XXS => 66,
            IQ2_XS => 74,
            IQ3_XXS => 98,
            IQ1_S => 50,
            IQ4_NL => 18,
            IQ3_S => 110,
            IQ2_S => 82,
            IQ4_XS => 136,
            IQ1_M => 56,
            TQ1_0 => 54,
            TQ2_0 => 66,
            MXFP4 => 17,
            NVFP4 => 36,
            Q1_0 => 18,
        }
    }

    /// ggml's name for the type (`Q4_K`, `BF16`, …).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ2_XXS => "IQ2_XXS",
            IQ2_XS => "IQ2_XS",
            IQ3_XXS => "IQ3_XXS",
            IQ1_S => "IQ1_S",
            IQ4_NL => "IQ4_NL",
            IQ3_S => "IQ3_S",
            IQ2_S => "IQ2_S",
            IQ4_XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1_M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
            NVFP4 => "NVFP4",
            Q1_0 => "Q1_0",
        }
    }

    /// Whether [`dequantize`] handles this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16
                | BF16
                | F64
                | I8
                | I16
                | I32
                | Q4_0
                | Q4_1
                | Q5_0
                | Q5_1
                | Q8_0
                | Q8_1
                | Q2_K
                | Q3_K
                | Q4_K
                | Q5_K
                | Q6_K
                | Q8_K
                | MXFP4
        )
    }

    /// Bytes that `n_elements` weights of this type take, or `None` when `n_elements`
    /// is not a whole number of blocks or the byte count does not fit in a u64
    /// (a corrupt file's dims: the reader turns it into an error, not a wrap).
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n_elements.is_multiple_of(bs) {
            return None;
        }
        (n_elements / bs).checked_mul(self.type_size() as u64)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Dequantises `n_elements` weights of type `ggml_type` stored in `bytes` to f32.
///
/// `bytes` must hold exactly `n_elements / block_size` blocks. Large tensors are split
/// over the rayon pool. Results are bit-identical to ggml's reference dequantisers.
pub fn dequantize(ggml_type: GgmlType, bytes: &[u8], n_elements: usize) -> Result<Vec<f32>> {
    let mut out = vec![0f32; n_elements];
    dequantize_into(ggml_type, bytes, &mut out)?;
    Ok(out)
}

/// Elements below which [`dequantize_into`] stays on the calling thread.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 16;
/// Elements per rayon task (a multiple of every block size).
const ELEMENTS_PER_TASK: usize = 1 << 14;

/// Like [`dequantize`], writing into `out` (whose length is the element count).
pub fn dequantize_into(ggml_type: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    if !ggml_type.can_dequantize() {
        return Err(GgufError::UnsupportedType(ggml_type));
    }
    let (bs, ts) = (ggml_type.block_size(), ggml_type.type_size());
    if !out.len().is_multiple_of(bs) {
        return Err(GgufError::SizeMismatch {
            ggml_type,
            reason: format!(
                "{} elements is not a multiple of the block size {bs}",
                out.len()
            ),
        });
    }
    let expected = out.len() / bs * ts;
    if bytes.len() != expected {
        return Err(GgufError::SizeMismatch {
            ggml_type,
            reason: format!(
                "{} elements need {expected} bytes, got {}",
                out.len(),
                bytes.len()
            ),
        });
    }
    if out.len() < PARALLEL_MIN_ELEMENTS {
        dequantize_chunk(ggml_type, bytes, out);
    } else {
        let task_bytes = ELEMENTS_PER_TASK / bs * ts;
        out.par_chunks_mut(ELEMENTS_PER_TASK)
            .zip(bytes.par_chunks(task_bytes))
            .for_each(|(o, b)| dequantize_chunk(ggml_type, b, o));
    }
    Ok(())
}

/// Dequantises whole blocks serially; sizes were checked by the caller.
fn dequantize_chunk(t: GgmlType, bytes: &[u8], out: &mut [f32]) {
    fn each(bytes: &[u8], out: &mut [f32], ts: usize, bs: usize, f: impl Fn(&[u8], &mut [f32])) {
        for (b, y) in bytes.chunks_exact(ts).zip(out.chunks_exact_mut(bs)) {
            f(b, y);
        }
    }
    let (bs, ts) = (t.block_size(), t.type_size());
    use GgmlType::*;
    match t {
        F32 => each(bytes, out, ts, bs, |b, y| {
            y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        }),
        F16 => each(bytes, out, ts, bs, |b, y| y[0] = f16_at(b, 0)),
        BF16 => each(bytes, out, ts, bs, |b, y| {
            y[0] = caracal_kernels::dtype::bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))
        }),
        F64 => each(bytes, out, ts, bs, |b, y| {
            let a: [u8; 8] = b.try_into().expect("chunks_exact gives 8 bytes");
            y[0] = f64::from_le_bytes(a) as f32
        }),
        I8 => each(bytes, out, ts, bs, |b, y| y[0] = b[0] as i8 as f32),
        I16 => each(bytes, out, ts, bs, |b, y| {
            y[0] = i16::from_le_bytes([b[0], b[1]]) as f32
        }),
        I32 => each(bytes, out, ts, bs, |b, y| {
            y[0] = i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32
        }),
        Q4_0 => each(bytes, out, ts, bs, block_q4_0),
        Q4_1 => each(bytes, out, ts, bs, block_q4_1),
        Q5_0 => each(bytes, out, ts, bs, block_q5_0),
        Q5_1 => each(bytes, out, ts, bs, block_q5_1),
        Q8_0 => each(bytes, out, ts, bs, block_q8_0),
        Q8_1 => each(bytes, out, ts, bs, block_q8_1),
        Q2_K => each(bytes, out, ts, bs, block_q2_k),
        Q3_K => each(bytes, out, ts, bs, block_q3_k),
        Q4_K => each(bytes, out, ts, bs, block_q4_k),
        Q5_K => each(bytes, out, ts, bs, block_q5_k),
        Q6_K => each(bytes, out, ts, bs, block_q6_k),
        Q8_K => each(bytes, out, ts, bs, block_q8_k),
        MXFP4 => each(bytes, out, ts, bs, block_mxfp4),
        IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S | IQ4_NL | IQ3_S | IQ2_S | IQ4_XS | I64 | IQ1_M
        | TQ1_0 | TQ2_0 | NVFP4 | Q1_0 => {
            unreachable!("dequantize_into rejects types without a dequantiser")
        }
    }
}

/// The f16 at `b[off..off + 2]`, widened.
#[inline(always)]
fn f16_at(b: &[u8], off: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// `block_q4_0`: f16 d; qs[16], low nibbles are weights 0..16, high nibbles 16..32.
fn block_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// `block_q4_1`: f16 d, f16 m; qs[16].
fn block_q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// `block_q5_0`: f16 d; u32 qh (bit j is the 5th bit of weight j); qs[16].
fn block_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        let x0 = ((qs[j] & 0x0F) as u32 | xh0) as i32 - 16;
        let x1 = ((qs[j] >> 4) as u32 | xh1) as i32 - 16;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

/// `block_q5_1`: f16 d, f16 m; u32 qh; qs[16].
fn block_q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        let x0 = (qs[j] & 0x0F) as u32 | xh0;
        let x1 = (qs[j] >> 4) as u32 | xh1;
        y[j] = x0 as f32 * d + m;
        y[j + 16] = x1 as f32 * d + m;
    }
}

/// `block_q8_0`: f16 d; i8 qs[32].
fn block_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (yj, &q) in y.iter_mut().zip(&b[2..34]) {
        *yj = q as i8 as f32 * d;
    }
}

/// `block_q8_1`: f16 d, f16 s; i8 qs[32].
fn block_q8_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (yj, &q) in y.iter_mut().zip(&b[4..36]) {
        *yj = q as i8 as f32 * d;
    }
}

/// `block_q2_K`: scales[16] (low nibble scale, high nibble min), qs[64], f16 d, f16 dmin.
/// Each 128-weight half uses 32 bytes of qs, read 4 times at shifts 0, 2, 4, 6; each
/// run of 16 weights has its own scale byte.
fn block_q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    let mut is = 0;
    let mut yi = 0;
    for half in 0..2 {
        let q = &b[16 + 32 * half..16 + 32 * half + 32];
        for shift in [0u32, 2, 4, 6] {
            for part in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * (sc & 0x0F) as f32;
                let ml = dmin * (sc >> 4) as f32;
                for l in 0..16 {
                    y[yi] = dl * ((q[l + 16 * part] >> shift) & 3) as i8 as f32 - ml;
                    yi += 1;
                }
            }
        }
    }
}

/// `block_q3_K`: hmask[32], qs[64], scales[12] (sixteen 6-bit scales), f16 d.
/// Weight = d·(scale−32)·(2-bit quant − (hmask bit clear ? 4 : 0)).
fn block_q3_k(b: &[u8], y: &mut [f32]) {
    let hm = &b[0..32];
    let packed = &b[96..108];
    let d_all = f16_at(b, 108);
    let mut scales = [0i32; 16];
    for (i, s) in scales.iter_mut().enumerate() {
        let low = if i < 8 {
            packed[i] & 0x0F
        } else {
            packed[i - 8] >> 4
        };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        *s = (low | (high << 4)) as i32 - 32;
    }
    let mut is = 0;
    let mut yi = 0;
    let mut m = 1u8;
    for half in 0..2 {
        let q = &b[32 + 32 * half..32 + 32 * half + 32];
        for shift in [0u32, 2, 4, 6] {
            for part in 0..2 {
                let dl = d_all * scales[is] as f32;
                is += 1;
                for l in 0..16 {
                    let idx = l + 16 * part;
                    let lo = ((q[idx] >> shift) & 3) as i8;
                    let hi = if hm[idx] & m != 0 { 0 } else { 4 };
                    y[yi] = dl * (lo - hi) as f32;
                    yi += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// ggml's `get_scale_min_k4`: the j-th 6-bit (scale, min) pair of a Q4_K/Q5_K block.
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `block_q4_K`: f16 d, f16 dmin, scales[12], qs[128]; 8 sub-blocks of 32 weights.
fn block_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    for chunk in 0..4 {
        let q = &b[16 + 32 * chunk..16 + 32 * chunk + 32];
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let y = &mut y[64 * chunk..64 * chunk + 64];
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// `block_q5_K`: f16 d, f16 dmin, scales[12], qh[32], qs[128].
fn block_q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    for chunk in 0..4 {
        let ql = &b[48 + 32 * chunk..48 + 32 * chunk + 32];
        let (u1, u2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let y = &mut y[64 * chunk..64 * chunk + 64];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - m1;
            y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
    }
}

/// `block_q6_K`: ql[128], qh[64], i8 scales[16], f16 d; weight = d·scale·(q−32).
fn block_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let y = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            y[l] = d * sc[is] as i8 as f32 * q1 as f32;
            y[l + 32] = d * sc[is + 2] as i8 as f32 * q2 as f32;
            y[l + 64] = d * sc[is + 4] as i8 as f32 * q3 as f32;
            y[l + 96] = d * sc[is + 6] as i8 as f32 * q4 as f32;
        }
    }
}

/// `block_q8_K`: f32 d, i8 qs[256], i16 bsums[16].
fn block_q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (yj, &q) in y.iter_mut().zip(&b[4..260]) {
        *yj = d * q as i8 as f32;
    }
}

/// e2m1 values doubled (`kvalues_mxfp4`); the scale below is halved to match.
const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// ggml's `ggml_e8m0_to_fp32_half`: 2^(e − 128), subnormal for e < 2.
#[inline(always)]
fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        ((e - 1) as u32) << 23
    };
    f32::from_bits(bits)
}

/// `block_mxfp4`: u8 e; qs[16], low nibbles weights 0..16, high nibbles 16..32.
fn block_mxfp4(b: &[u8], y: &mut [f32]) {
    let d = e8m0_to_f32_half(b[0]);
    for j in 0..16 {
        let q = b[1 + j];
        y[j] = d * KVALUES_MXFP4[(q & 0x0F) as usize] as f32;
        y[j + 16] = d * KVALUES_MXFP4[(q >> 4) as usize] as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::gguf::reader::GgufFile;
    use std::path::PathBuf;

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/gguf")
            .join(name)
    }

    /// Tolerance: none. Every dequantiser must reproduce `gguf.quants.dequantize`
    /// (numpy, float32) bit for bit, since both do the same f32 operations in the
    /// same order as ggml.
    #[test]
    fn dequantize_matches_python_gguf_fixtures_bit_exactly() {
        let text = std::fs::read_to_string(fixture("quants.json")).expect("fixture json");
        let reference: serde_json::Value = serde_json::from_str(&text).expect("valid json");
        let tensors = reference["tensors"].as_object().expect("tensors object");
        let file = GgufFile::open(fixture("quants.gguf")).expect("fixture gguf opens");
        let mut checked = Vec::new();
        for (name, entry) in tensors {
            let info = file
                .tensor(name)
                .unwrap_or_else(|| panic!("tensor {name} in gguf"));
            assert_eq!(
                info.ggml_type.id() as u64,
                entry["ggml_type"].as_u64().expect("type id")
            );
            let shape: Vec<usize> = entry["shape"]
                .as_array()
                .expect("shape")
                .iter()
                .map(|v| v.as_u64().expect("dim") as usize)
                .collect();
            assert_eq!(info.shape(), shape, "{name}: row-major shape");
            let want: Vec<f32> = entry["values"]
                .as_array()
                .expect("values")
                .iter()
                .map(|v| v.as_f64().expect("finite value") as f32)
                .collect();
            let got = file.dequantize_tensor(info).expect("dequantize");
            assert_eq!(got.len(), want.len(), "{name}: element count");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{name}[{i}]: got {g}, python {w}");
            }
            checked.push(name.clone());
        }
        assert_eq!(checked.len(), 14, "fixture covers 14 types: {checked:?}");
    }

    /// Q8_K has no numpy dequantiser; check it against `d * q` computed directly
    /// (exact: one f32 product per weight).
    #[test]
    fn q8_k_is_f32_scale_times_int8() {
        let mut block = vec![0u8; 292];
        let d = 0.037_f32;
        block[..4].copy_from_slice(&d.to_le_bytes());
        let qs: Vec<i8> = (0..256).map(|i| ((i * 37) % 256) as u8 as i8).collect();
        for (i, q) in qs.iter().enumerate() {
            block[4 + i] = *q as u8;
        }
        block[260..].fill(0xAB); // bsums are not read
        let y = dequantize(GgmlType::Q8_K, &block, 256).expect("q8_k");
        for i in 0..256 {
            assert_eq!(y[i].to_bits(), (d * qs[i] as f32).to_bits(), "weight {i}");
        }
    }

    /// Q8_1 dequantises like Q8_0 with the block sum skipped (exact).
    #[test]
    fn q8_1_ignores_block_sum() {
        let mut block = vec![0u8; 36];
        block[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        block[2..4].copy_from_slice(&half::f16::from_f32(99.0).to_bits().to_le_bytes());
        for i in 0..32 {
            block[4 + i] = (i as i8 - 16) as u8;
        }
        let y = dequantize(GgmlType::Q8_1, &block, 32).expect("q8_1");
        let want: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.5).collect();
        assert_eq!(y, want);
    }

    /// Plain element types are exact casts.
    #[test]
    fn integer_and_f64_elements_cast_exactly() {
        let y = dequantize(GgmlType::I8, &[0x80, 0x7F, 0xFF], 3).expect("i8");
        assert_eq!(y, vec![-128.0, 127.0, -1.0]);
        let bytes: Vec<u8> = [-300i16, 12345]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(
            dequantize(GgmlType::I16, &bytes, 2).expect("i16"),
            vec![-300.0, 12345.0]
        );
        let bytes: Vec<u8> = [-70000i32, 1 << 20]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(
            dequantize(GgmlType::I32, &bytes, 2).expect("i32"),
            vec![-70000.0, 1048576.0]
        );
        let bytes: Vec<u8> = [0.25f64, -3.5]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(
            dequantize(GgmlType::F64, &bytes, 2).expect("f64"),
            vec![0.25, -3.5]
        );
    }

    /// The parallel path (≥ 2^16 elements) gives the same bits as block-by-block
    /// serial dequantisation.
    #[test]
    fn parallel_dequantize_equals_serial_blocks() {
        let n_blocks = 600; // 153,600 weights: above the parallel threshold
        let mut bytes = vec![0u8; n_blocks * 144];
        let mut rng = caracal_kernels::testing::Rng::new(0x2545_F491_4F6C_DD1D);
        for b in bytes.iter_mut() {
            *b = rng.next_u64() as u8;
        }
        for blk in bytes.chunks_exact_mut(144) {
            blk[..2].copy_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
            blk[2..4].copy_from_slice(&half::f16::from_f32(0.02).to_bits().to_le_bytes());
        }
        let par = dequantize(GgmlType::Q4_K, &bytes, n_blocks * 256).expect("q4_k");
        let mut serial = vec![0f32; n_blocks * 256];
        for (b, y) in bytes.chunks_exact(144).zip(serial.chunks_exact_mut(256)) {
            block_q4_k(b, y);
        }
        assert!(par
            .iter()
            .zip(&serial)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn size_mismatches_and_unsupported_types_are_errors() {
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0u8; 18], 31),
            Err(GgufError::SizeMismatch { .. })
        ));
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0u8; 17], 32),
            Err(GgufError::SizeMismatch { .. })
        ));
        assert!(matches!(
            dequantize(GgmlType::IQ2_XXS, &[0u8; 66], 256),
            Err(GgufError::UnsupportedType(GgmlType::IQ2_XXS))
        ));
    }

    #[test]
    fn type_ids_round_trip_and_sizes_match_ggml() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        assert_eq!(GgmlType::from_id(4), None);
        assert_eq!(GgmlType::from_id(31), None);
        // bits per weight of a few well-known types
        assert_eq!(GgmlType::Q4_1.bytes_for(32), Some(20));
        assert_eq!(GgmlType::Q4_K.bytes_for(256), Some(144));
        assert_eq!(GgmlType::Q6_K.bytes_for(512), Some(420));
        assert_eq!(GgmlType::Q8_0.bytes_for(33), None);
        assert_eq!(GgmlType::F32.bytes_for(1 << 62), None, "overflow is None");
    }
}
