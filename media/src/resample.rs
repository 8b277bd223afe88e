//! Bicubic resizes that reproduce Pillow's and PyTorch's 8-bit antialiased kernels exactly.
//!
//! Two references resize Kimi images, and they disagree by a level on a few percent of
//! the pixels, so both are ported:
//!
//! - [`Bicubic::Pillow`]: Pillow's `Image.resize(size, Image.BICUBIC)`
//!   (`libImaging/Resample.c`), used by the Moonshot remote-code processors (Kimi-VL
//!   `KimiVLImageProcessor`, K2.5 `media_utils.py`).
//! - [`Bicubic::Torch`]: `torchvision.transforms.v2.functional.resize(uint8 tensor,
//!   BICUBIC, antialias=True)`, which runs PyTorch's uint8 kernel
//!   (`aten/src/ATen/native/cpu/UpSampleKernel.cpp`, `_compute_index_ranges_int16_weights`,
//!   and the AVX2 convolutions of `UpSampleKernelAVXAntialias.h`, themselves derived
//!   from Pillow-SIMD). This is what transformers' native `Kimi_K25ImageProcessor` and
//!   `Kimi_K25VideoProcessor` (a `TorchvisionBackend`) do on CPU.
//!
//! Shared by both:
//! - Keys cubic kernel with `a = -0.5` (the same curve as Catmull-Rom), support 2, widened
//!   by the scale factor `in/out` when downscaling (antialiasing);
//! - window per output pixel `[int(center - support + 0.5), int(center + support + 0.5))`
//!   with `center = (i + 0.5)·scale`, clamped to the image; weights normalised to sum 1
//!   in `f64`;
//! - a horizontal pass first, rounded and clamped to `u8`, then a vertical pass; a pass is
//!   skipped when that side keeps its size.
//!
//! They differ only in the fixed-point weights: Pillow uses 22 fractional bits
//! (`PRECISION_BITS = 32 - 8 - 2`) in `i32`; PyTorch stores `i16` weights and picks, per
//! pass, the largest precision `p < 22` (stopping at the first `p` where
//! `round(w_max · 2^(p+1)) ≥ 2^15`, `w_max` the largest weight of the pass). Both round a
//! weight as `(int)(w·2^p ± 0.5)` (sign-matched), start the sum at `2^(p-1)`, shift right
//! by `p` and saturate to `0..=255`.
//!
//! Pillow's results are bit-exact with Pillow 13 on the golden vectors in the tests
//! (generated with Pillow 13.0.0); PyTorch's are bit-exact with torch 2.15 on the
//! fixtures in `media/tests/fixtures` (made by `tools/make_media_fixtures.py`). The
//! `image` crate's `FilterType::CatmullRom` uses the same kernel but runs the vertical
//! pass first with an unrounded, unclamped `f32` intermediate. Measured on the golden
//! inputs it differs from Pillow by one level on 2-16% of the values when downscaling
//! and by up to 5 levels when upscaling noise (where Pillow clamps the intermediate row),
//! so it is not used.

use image::RgbImage;

/// Fractional bits of Pillow's fixed-point weights (`32 - 8 - 2`); also the cap on
/// PyTorch's adaptive precision.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// Kernel support of the bicubic filter, in source pixels at scale 1.
const BICUBIC_SUPPORT: f64 = 2.0;

/// Which reference implementation's fixed-point arithmetic to reproduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bicubic {
    /// Pillow's `Image.resize(..., BICUBIC)`: `i32` weights with 22 fractional bits.
    Pillow,
    /// PyTorch's uint8 antialiased bicubic (torchvision `resize(..., antialias=True)`):
    /// `i16` weights with the largest precision that fits.
    Torch,
}

/// The Keys cubic convolution kernel with `a = -0.5` (Pillow's `bicubic_filter`,
/// PyTorch's `HelperInterpCubic::aa_filter`).
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Fixed-point weights of one resampling pass (Pillow's `precompute_coeffs` +
/// `normalize_coeffs_8bpc`, or PyTorch's `_compute_index_ranges_int16_weights`).
struct Coeffs {
    /// Weights per output pixel, `ksize` slots each (unused slots are 0).
    weights: Vec<i32>,
    /// First source index and number of source pixels for each output pixel.
    bounds: Vec<(usize, usize)>,
    /// Slots per output pixel.
    ksize: usize,
    /// Fractional bits of `weights`.
    precision: u32,
}

impl Coeffs {
    fn new(in_size: usize, out_size: usize, kind: Bicubic) -> Coeffs {
        let scale = in_size as f64 / out_size as f64;
        let filterscale = scale.max(1.0);
        let support = BICUBIC_SUPPORT * filterscale;
        let ksize = support.ceil() as usize * 2 + 1;
        let mut real = vec![0f64; out_size * ksize];
        let mut bounds = Vec::with_capacity(out_size);
        let ss = 1.0 / filterscale;
        for (xx, slot) in real.chunks_exact_mut(ksize).enumerate() {
            let center = (xx as f64 + 0.5) * scale;
            // C's `(int)` truncates toward zero, as `as i64` does.
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) - xmin;
            let n = xmax.max(0) as usize;
            let mut ww = 0.0;
            for (x, kx) in slot.iter_mut().enumerate().take(n) {
                let w = bicubic(((x as i64 + xmin) as f64 - center + 0.5) * ss);
                *kx = w;
                ww += w;
            }
            if ww != 0.0 {
                for kx in slot.iter_mut().take(n) {
                    *kx /= ww;
                }
            }
            bounds.push((xmin as usize, n));
        }
        let precision = match kind {
            Bicubic::Pillow => PRECISION_BITS,
            Bicubic::Torch => {
                // The scan starts from the first slot, as PyTorch's does (unused slots are 0).
                let w_max = real.iter().copied().fold(real[0], f64::max);
                (0..PRECISION_BITS)
                    .find(|&p| (0.5 + w_max * f64::from(1u32 << (p + 1))) as i64 >= 1 << 15)
                    .unwrap_or(PRECISION_BITS)
            }
        };
        let one = f64::from(1u32 << precision);
        let weights = real
            .iter()
            .map(|&w| {
                let rounding = if w < 0.0 { -0.5 } else { 0.5 };
                (w * one + rounding) as i32
            })
            .collect();
        Coeffs {
            weights,
            bounds,
            ksize,
            precision,
        }
    }

    fn weights(&self, out: usize) -> &[i32] {
        let (_, n) = self.bounds[out];
        &self.weights[out * self.ksize..out * self.ksize + n]
    }

    /// The initial accumulator: one half in fixed point, so the final shift rounds.
    fn half(&self) -> i64 {
        1i64 << (self.precision - 1)
    }

    /// Pillow's `clip8` (PyTorch: `srai`, then saturating packs): drop the fraction with
    /// an arithmetic shift and clamp to `0..=255`.
    fn clip8(&self, acc: i64) -> u8 {
        (acc >> self.precision).clamp(0, 255) as u8
    }
}

/// Resizes `src` to `width`×`height` exactly as Pillow's bicubic `Image.resize` does.
///
/// Both target sides must be at least 1 and the source non-empty; a same-size call
/// returns a copy.
pub fn resize_bicubic(src: &RgbImage, width: u32, height: u32) -> RgbImage {
    resize_bicubic_with(src, width, height, Bicubic::Pillow)
}

/// Resizes `src` to `width`×`height` with the fixed-point arithmetic of `kind`.
///
/// Both target sides must be at least 1 and the source non-empty; a same-size call
/// returns a copy.
pub fn resize_bicubic_with(src: &RgbImage, width: u32, height: u32, kind: Bicubic) -> RgbImage {
    let (in_w, in_h) = (src.width() as usize, src.height() as usize);
    let (out_w, out_h) = (width as usize, height as usize);
    assert!(
        in_w > 0 && in_h > 0 && out_w > 0 && out_h > 0,
        "resize_bicubic needs non-empty sizes"
    );

    // Horizontal pass over the rows the vertical pass will read (all rows if it is skipped).
    let vert = (out_h != in_h).then(|| Coeffs::new(in_h, out_h, kind));
    let (row_first, row_end) = match &vert {
        Some(c) => (c.bounds[0].0, c.bounds[out_h - 1].0 + c.bounds[out_h - 1].1),
        None => (0, in_h),
    };
    let src_raw = src.as_raw();
    let (mid_w, mid): (usize, Vec<u8>) = if out_w != in_w {
        let horiz = Coeffs::new(in_w, out_w, kind);
        let half = horiz.half();
        let mut mid = vec![0u8; out_w * (row_end - row_first) * 3];
        for (row, out_row) in mid.chunks_exact_mut(out_w * 3).enumerate() {
            let in_row = &src_raw[(row_first + row) * in_w * 3..(row_first + row + 1) * in_w * 3];
            for (xx, px) in out_row.chunks_exact_mut(3).enumerate() {
                let xmin = horiz.bounds[xx].0;
                let mut acc = [half; 3];
                for (i, &w) in horiz.weights(xx).iter().enumerate() {
                    let p = &in_row[(xmin + i) * 3..(xmin + i) * 3 + 3];
                    for c in 0..3 {
                        acc[c] += i64::from(p[c]) * i64::from(w);
                    }
                }
                for c in 0..3 {
                    px[c] = horiz.clip8(acc[c]);
                }
            }
        }
        (out_w, mid)
    } else {
        (
            in_w,
            src_raw[row_first * in_w * 3..row_end * in_w * 3].to_vec(),
        )
    };

    let out = match vert {
        None => mid,
        Some(vert) => {
            let half = vert.half();
            let mut out = vec![0u8; mid_w * out_h * 3];
            for (yy, out_row) in out.chunks_exact_mut(mid_w * 3).enumerate() {
                let ymin = vert.bounds[yy].0 - row_first;
                let ws = vert.weights(yy);
                for (x, px) in out_row.iter_mut().enumerate() {
                    let mut acc = half;
                    for (i, &w) in ws.iter().enumerate() {
                        acc += i64::from(mid[(ymin + i) * mid_w * 3 + x]) * i64::from(w);
                    }
                    *px = vert.clip8(acc);
                }
            }
            out
        }
    };
    RgbImage::from_raw(width, height, out).expect("buffer sized width*height*3 above")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use image::Rgb;

    /// Deterministic noise, identical to the Python generator of the golden vectors:
    /// `h = (x*2654435761 + y*40503 + c*97) mod 2^32; h ^= h>>15; h = h*2246822519 mod 2^32;
    /// h ^= h>>13; h & 255`.
    pub(crate) fn noise(width: u32, height: u32) -> RgbImage {
        RgbImage::from_fn(width, height, |x, y| {
            let v = |c: u32| {
                let mut h = x
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(y.wrapping_mul(40503))
                    .wrapping_add(c * 97);
                h ^= h >> 15;
                h = h.wrapping_mul(2_246_822_519);
                h ^= h >> 13;
                (h & 255) as u8
            };
            Rgb([v(0), v(1), v(2)])
        })
    }

    /// Smooth pattern: `((x*255)//(w-1), (y*255)//(h-1), ((x+y)*255)//(w+h-2))`.
    fn smooth(width: u32, height: u32) -> RgbImage {
        RgbImage::from_fn(width, height, |x, y| {
            Rgb([
                (x * 255 / (width - 1)) as u8,
                (y * 255 / (height - 1)) as u8,
                ((x + y) * 255 / (width + height - 2)) as u8,
            ])
        })
    }

    /// 64-bit FNV-1a of the RGB bytes, a compact fingerprint of a whole output.
    pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }

    #[test]
    fn matches_torch_uint8_antialiased_bicubic_golden_vectors() {
        // (in_w, in_h, out_w, out_h, FNV-1a of torchvision 0.29 `resize(uint8, BICUBIC,
        //  antialias=True)` on torch 2.15, its pixel (0,0), its last pixel), on `noise`.
        type Golden = (u32, u32, u32, u32, u64, [u8; 3], [u8; 3]);
        let golden: [Golden; 8] = [
            (
                37,
                23,
                17,
                11,
                0x03bf_3ab7_90e1_f7e6,
                [88, 150, 75],
                [159, 117, 173],
            ),
            (
                10,
                7,
                29,
                31,
                0x6926_1527_a8ea_905c,
                [0, 187, 94],
                [97, 38, 56],
            ),
            (
                100,
                60,
                47,
                60,
                0x78f8_35bc_b85b_aa32,
                [18, 173, 48],
                [144, 200, 138],
            ),
            (
                64,
                64,
                64,
                20,
                0x74af_bfb2_d4c3_8038,
                [48, 116, 64],
                [163, 162, 118],
            ),
            (
                211,
                97,
                13,
                5,
                0x5716_d7a6_b910_c03a,
                [132, 121, 130],
                [133, 127, 127],
            ),
            (
                5,
                3,
                28,
                17,
                0xe903_9185_f85c_d535,
                [0, 187, 95],
                [174, 81, 94],
            ),
            (
                37,
                301,
                22,
                185,
                0x92f0_afc5_8680_0ce6,
                [71, 146, 59],
                [159, 112, 128],
            ),
            (
                1280,
                720,
                1202,
                676,
                0x0b90_578f_6993_6b85,
                [10, 164, 81],
                [114, 17, 180],
            ),
        ];
        for (iw, ih, ow, oh, hash, first, last) in golden {
            let out = resize_bicubic_with(&noise(iw, ih), ow, oh, Bicubic::Torch);
            let what = format!("{iw}x{ih} -> {ow}x{oh}");
            assert_eq!(out.get_pixel(0, 0).0, first, "{what}: first pixel");
            assert_eq!(out.get_pixel(ow - 1, oh - 1).0, last, "{what}: last pixel");
            assert_eq!(fnv1a(out.as_raw()), hash, "{what}: whole output");
        }
        // The two kernels really differ (10x7 → 29x31 above is not Pillow's 0x1b96...).
        let pillow = resize_bicubic(&noise(10, 7), 29, 31);
        assert_ne!(fnv1a(pillow.as_raw()), 0x6926_1527_a8ea_905c);
    }

    #[test]
    fn matches_pillow_bicubic_golden_vectors() {
        // (pattern, in_w, in_h, out_w, out_h, FNV-1a of Pillow 13.0.0's output bytes,
        //  Pillow's pixel (0,0), Pillow's last pixel).
        type Golden = (&'static str, u32, u32, u32, u32, u64, [u8; 3], [u8; 3]);
        let golden: [Golden; 10] = [
            (
                "noise",
                37,
                23,
                17,
                11,
                0x03bf3ab790e1f7e6,
                [88, 150, 75],
                [159, 117, 173],
            ),
            (
                "noise",
                10,
                7,
                29,
                31,
                0x1b96f008d0d3a787,
                [0, 187, 94],
                [97, 38, 56],
            ),
            (
                "noise",
                100,
                60,
                47,
                60,
                0xe0c23453f4db2ecc,
                [18, 173, 48],
                [144, 200, 138],
            ),
            (
                "noise",
                64,
                64,
                64,
                20,
                0x4e3a9fd68416604c,
                [48, 116, 64],
                [163, 162, 118],
            ),
            (
                "smooth",
                300,
                200,
                123,
                77,
                0x61d4d5371a36f597,
                [0, 1, 1],
                [254, 254, 253],
            ),
            (
                "noise",
                211,
                97,
                13,
                5,
                0x13734c7f5a1b66eb,
                [132, 121, 130],
                [133, 127, 127],
            ),
            (
                "smooth",
                40,
                30,
                1,
                1,
                0xa32734196f09ea94,
                [127, 127, 127],
                [127, 127, 127],
            ),
            (
                "noise",
                5,
                3,
                28,
                17,
                0x35f257e0e6d197e5,
                [0, 187, 95],
                [174, 81, 94],
            ),
            (
                "noise",
                1,
                1,
                3,
                2,
                0xce65dc0100dcb81b,
                [0, 170, 85],
                [0, 170, 85],
            ),
            (
                "smooth",
                500,
                375,
                259,
                194,
                0x8919ec2a05aad0dc,
                [0, 0, 0],
                [254, 254, 254],
            ),
        ];
        for (pattern, iw, ih, ow, oh, hash, first, last) in golden {
            let src = if pattern == "noise" {
                noise(iw, ih)
            } else {
                smooth(iw, ih)
            };
            let out = resize_bicubic(&src, ow, oh);
            let what = format!("{pattern} {iw}x{ih} -> {ow}x{oh}");
            assert_eq!(out.get_pixel(0, 0).0, first, "{what}: first pixel");
            assert_eq!(out.get_pixel(ow - 1, oh - 1).0, last, "{what}: last pixel");
            assert_eq!(fnv1a(out.as_raw()), hash, "{what}: whole output");
        }
    }
}
