//! Storage dtypes and bf16 conversion helpers.
//!
//! bf16 is the upper half of an IEEE f32, so widening is a shift; narrowing
//! rounds to nearest-even exactly as PyTorch's `tensor.to(torch.bfloat16)`.

use std::fmt;

/// The dtype a weight is stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// bfloat16: the top 16 bits of an f32.
    BF16,
    /// IEEE binary16.
    F16,
    /// OCP MXFP4: 32 E2M1 values sharing one E8M0 scale (4.25 bits/weight).
    Mxfp4,
    /// Q8_0: 32 int8 values sharing one f32 scale (9 bits/weight).
    Q8_0,
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::Mxfp4 => "mxfp4",
            DType::Q8_0 => "q8_0",
        };
        f.write_str(s)
    }
}

/// Widens one bf16 (as raw bits) to f32.
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Narrows an f32 to bf16 bits with round-to-nearest-even (NaN stays NaN).
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// Widens a bf16 slice into an f32 slice of the same length.
pub fn bf16_slice_to_f32(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "bf16_slice_to_f32: lengths differ");
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16_to_f32(s);
    }
}

/// Rounds every value of `x` through bf16 and back, the way a bf16 tensor
/// would hold it.
pub fn round_to_bf16(x: &mut [f32]) {
    for v in x {
        *v = bf16_to_f32(f32_to_bf16(*v));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_is_exact_for_representable_values() {
        for &v in &[0.0f32, 1.0, -2.5, 0.15625, 65280.0, f32::INFINITY] {
            assert_eq!(bf16_to_f32(f32_to_bf16(v)), v);
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties go to even (1.0).
        let halfway = f32::from_bits(0x3F80_8000);
        assert_eq!(bf16_to_f32(f32_to_bf16(halfway)), 1.0);
        let above = f32::from_bits(0x3F80_8001);
        assert_eq!(bf16_to_f32(f32_to_bf16(above)), f32::from_bits(0x3F81_0000));
    }
}
