//! Image → vision-tower patches: normalise, pad or crop, patchify, merge order.
//!
//! After the resize of [`crate::resize`] ([`crate::resample`], with the arithmetic of the
//! config's [`Backend`]), the image is laid on a canvas that is a multiple of
//! `patch · merge` (28) pixels: zero-padded right/bottom, or center-cropped for Kimi-VL
//! with `pad_input = false`. It is normalised per channel (padding happens first, so
//! padded pixels become `(0 − mean) / std`, not 0), and cut into `[N, 3, 14, 14]` patches
//! in row-major order over the patch grid, with `grid_thw = [1, H/14, W/14]` and
//! `num_tokens = (H/14)·(W/14)/4` LLM tokens after the 2×2 patch merger ([`merge_order`]).
//!
//! Normalisation is computed in `f32` exactly as the reference does, so `pixel_values`
//! are bit-identical to the Python processors':
//! - [`Backend::Torchvision`] (transformers' `rescale_and_normalize`, fused): mean and std
//!   are scaled by 255 in `f32` and `(x − 255·mean) / (255·std)` is one subtraction and
//!   one division, `x` the `u8` value as `f32`;
//! - [`Backend::Pillow`] (the remote code): `(x/255 − mean) / std`.
//!
//! For `mean = std = 0.5` the two differ by one ulp on 128 of the 256 byte values.

use std::borrow::Cow;

use image::RgbImage;

use crate::decode::decode_image;
use crate::error::Result;
use crate::resample::resize_bicubic_with;
use crate::resize::{plan_resize, Backend, ImageProcessorConfig, ResizePlan};

/// One image cut into vision-tower patches.
#[derive(Debug, Clone, PartialEq)]
pub struct ImagePatches {
    /// `[num_patches, 3, patch_size, patch_size]` row-major `f32`; patches in row-major
    /// order over the `grid_h × grid_w` grid, channels R, G, B.
    pub pixel_values: Vec<f32>,
    /// `[T, H/patch, W/patch]` with `T = 1` for a still image (MoonViT3d's `grid_thw`).
    pub grid_thw: [usize; 3],
    /// LLM tokens this image occupies after the patch merger (`<|media_pad|>` copies).
    pub num_tokens: usize,
    /// Side of one patch in pixels.
    pub patch_size: usize,
    /// How the image was resized, cropped and padded (to map model coordinates back).
    pub plan: ResizePlan,
}

impl ImagePatches {
    /// Number of patches, `grid_h · grid_w`.
    pub fn num_patches(&self) -> usize {
        self.grid_thw[0] * self.grid_thw[1] * self.grid_thw[2]
    }

    /// The `3 · patch · patch` values of patch `index` (channel-major).
    pub fn patch(&self, index: usize) -> &[f32] {
        let len = 3 * self.patch_size * self.patch_size;
        &self.pixel_values[index * len..(index + 1) * len]
    }
}

/// Resizes, pads (or crops), normalises and patchifies an RGB image.
pub fn preprocess(image: &RgbImage, cfg: &ImageProcessorConfig) -> Result<ImagePatches> {
    let plan = plan_resize(image.width(), image.height(), cfg)?;
    let p = cfg.patch_size as usize;
    let mut pixel_values = vec![0f32; plan.grid_h * plan.grid_w * 3 * p * p];
    write_patches(image, &plan, cfg, &mut pixel_values);
    Ok(ImagePatches {
        pixel_values,
        grid_thw: [1, plan.grid_h, plan.grid_w],
        num_tokens: plan.num_tokens,
        patch_size: p,
        plan,
    })
}

/// Resizes `image` by `plan` and writes its `grid_h · grid_w` normalised patches into
/// `out` (exactly that many values: `grid_h · grid_w · 3 · patch²`). Shared by still
/// images and the frames of a video chunk, which are laid out frame after frame.
pub(crate) fn write_patches(
    image: &RgbImage,
    plan: &ResizePlan,
    cfg: &ImageProcessorConfig,
    out: &mut [f32],
) {
    let resized: Cow<'_, RgbImage> =
        if (plan.resized_width, plan.resized_height) == image.dimensions() {
            Cow::Borrowed(image)
        } else {
            Cow::Owned(resize_bicubic_with(
                image,
                plan.resized_width,
                plan.resized_height,
                cfg.backend.bicubic(),
            ))
        };
    let p = cfg.patch_size as usize;
    let (rw, rh) = (resized.width() as usize, resized.height() as usize);
    let (left, top) = (plan.crop_left as usize, plan.crop_top as usize);
    let raw = resized.as_raw();

    // Lookup tables: every u8 value per channel, and the value of a padded (black) pixel.
    let table = normalise_table(cfg);
    let pad: [f32; 3] = [table[0][0], table[1][0], table[2][0]];

    let patch_len = 3 * p * p;
    assert_eq!(
        out.len(),
        plan.grid_h * plan.grid_w * patch_len,
        "write_patches: output sized for the plan's grid"
    );
    for (index, patch) in out.chunks_exact_mut(patch_len).enumerate() {
        let (gy, gx) = (index / plan.grid_w, index % plan.grid_w);
        for r in 0..p {
            let y = gy * p + r + top;
            for q in 0..p {
                let x = gx * p + q + left;
                for c in 0..3 {
                    patch[c * p * p + r * p + q] = if y < rh && x < rw {
                        table[c][raw[(y * rw + x) * 3 + c] as usize]
                    } else {
                        pad[c]
                    };
                }
            }
        }
    }
}

/// Decodes encoded PNG/JPEG bytes under `cfg`'s decode limits and preprocesses them.
pub fn process_image_bytes(bytes: &[u8], cfg: &ImageProcessorConfig) -> Result<ImagePatches> {
    cfg.validate()?;
    let image = decode_image(bytes, &cfg.decode_limits())?;
    preprocess(&image, cfg)
}

/// The normalised value of every byte, per channel.
fn normalise_table(cfg: &ImageProcessorConfig) -> [[f32; 256]; 3] {
    let mut table = [[0f32; 256]; 3];
    for (c, row) in table.iter_mut().enumerate() {
        for (v, slot) in row.iter_mut().enumerate() {
            *slot = normalise(v as u8, cfg.image_mean[c], cfg.image_std[c], cfg.backend);
        }
    }
    table
}

/// One byte normalised as the backend's reference computes it in `f32`.
///
/// - Torchvision: `_fuse_mean_std_and_rescale_factor` makes `mean·(1/rescale_factor)` and
///   `std·(1/rescale_factor)` (`f32` tensors times 255.0), then `normalize` subtracts and
///   divides.
/// - Pillow (remote code): `(v/255 − mean) / std`; the NumPy path
///   `(f32(v/255.0) − mean) · f32(1/std)` gives the same bits for `std = 0.5` (a power of
///   two; and `v/255` has no rounding tie to double-round).
fn normalise(v: u8, mean: f32, std: f32, backend: Backend) -> f32 {
    match backend {
        Backend::Torchvision => (f32::from(v) - mean * 255.0) / (std * 255.0),
        Backend::Pillow => (f32::from(v) / 255.0 - mean) / std,
    }
}

/// The 2×2 patch-merger order: for merged cell `(i, j)` (row-major over the
/// `grid_h/2 × grid_w/2` cells), the row-major indices of patches `(2i, 2j)`,
/// `(2i, 2j+1)`, `(2i+1, 2j)`, `(2i+1, 2j+1)`, whose vectors are concatenated in that
/// order (MoonViT `patch_merger`, §3.1/§3.2).
///
/// # Panics
/// If either side is odd; [`preprocess`] always produces even grids (it pads or crops to
/// multiples of the merge window), so an odd grid here is a caller bug.
pub fn merge_order(grid_h: usize, grid_w: usize) -> Vec<[usize; 4]> {
    assert!(
        grid_h.is_multiple_of(2) && grid_w.is_multiple_of(2),
        "merge_order needs an even grid, got {grid_h}x{grid_w}"
    );
    let mut order = Vec::with_capacity(grid_h / 2 * grid_w / 2);
    for i in 0..grid_h / 2 {
        for j in 0..grid_w / 2 {
            let top = 2 * i * grid_w + 2 * j;
            order.push([top, top + 1, top + grid_w, top + grid_w + 1]);
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::MediaError;
    use crate::resize::{ResizeRule, CLIP_MEAN, CLIP_STD};
    use image::{DynamicImage, ImageFormat, Rgb};
    use std::io::Cursor;

    /// The value at (channel `c`, canvas row `y`, column `x`) of preprocessed patches.
    fn canvas_value(out: &ImagePatches, c: usize, y: usize, x: usize) -> f32 {
        let p = out.patch_size;
        let index = (y / p) * out.grid_thw[2] + x / p;
        out.patch(index)[c * p * p + (y % p) * p + x % p]
    }

    #[test]
    fn padding_happens_before_normalisation() {
        let color = [200u8, 100, 50];
        let image = RgbImage::from_pixel(10, 10, Rgb(color));
        for cfg in [
            ImageProcessorConfig::kimi_k25(),
            ImageProcessorConfig::kimi_vl(),
        ] {
            let out = preprocess(&image, &cfg).expect("small image");
            assert_eq!(
                (out.grid_thw, out.num_tokens, out.pixel_values.len()),
                ([1, 2, 2], 1, 4 * 3 * 14 * 14)
            );
            for (c, &value) in color.iter().enumerate() {
                let (mean, std) = (f64::from(cfg.image_mean[c]), f64::from(cfg.image_std[c]));
                let inside = (f64::from(value) / 255.0 - mean) / std;
                let padded = -mean / std;
                for y in 0..28 {
                    for x in 0..28 {
                        let want = if y < 10 && x < 10 { inside } else { padded };
                        let got = f64::from(canvas_value(&out, c, y, x));
                        // f32 arithmetic on values of magnitude <= 2.2: within 1e-6.
                        assert!((got - want).abs() < 1e-6, "c{c} ({y},{x}): {got} vs {want}");
                    }
                }
            }
        }
        // K2.5/K3: padded pixels are exactly (0 - 0.5) / 0.5 = -1.
        let out = preprocess(&image, &ImageProcessorConfig::kimi_k3()).expect("small image");
        assert_eq!(canvas_value(&out, 1, 27, 27), -1.0);
    }

    #[test]
    fn normalisation_matches_f64_reference_for_every_byte() {
        for v in 0..=255u8 {
            for (mean, std) in CLIP_MEAN.iter().zip(CLIP_STD.iter()).chain([(&0.5, &0.5)]) {
                let want = (f64::from(v) / 255.0 - f64::from(*mean)) / f64::from(*std);
                for backend in [Backend::Torchvision, Backend::Pillow] {
                    let got = f64::from(normalise(v, *mean, *std, backend));
                    assert!(
                        (got - want).abs() < 1e-6,
                        "{v} {backend:?}: {got} vs {want}"
                    );
                }
            }
            // mean = std = 0.5: f32(v/255) * 2 - 1 exactly, as NumPy's f32 path gives.
            assert_eq!(
                normalise(v, 0.5, 0.5, Backend::Pillow),
                ((f64::from(v) / 255.0) as f32 - 0.5) * 2.0
            );
            // torchvision's fused form: (v - 127.5) / 127.5, one rounding.
            assert_eq!(
                normalise(v, 0.5, 0.5, Backend::Torchvision),
                ((f64::from(v) - 127.5) / 127.5) as f32
            );
        }
    }

    #[test]
    fn patch_layout_puts_every_pixel_where_expected() {
        // Each pixel encodes its coordinates: R = x, G = y, B = (3x + 5y) mod 256.
        let (w, h) = (70u32, 30u32);
        let image = RgbImage::from_fn(w, h, |x, y| {
            Rgb([x as u8, y as u8, ((3 * x + 5 * y) % 256) as u8])
        });
        let out = preprocess(&image, &ImageProcessorConfig::kimi_k25()).expect("small image");
        // 70x30 → padded 84x56: grid 4 rows x 6 columns, 6 tokens, no resize.
        assert_eq!(
            (out.grid_thw, out.num_tokens, out.num_patches()),
            ([1, 4, 6], 6, 24)
        );
        let p = 14;
        for (n, patch) in out.pixel_values.chunks_exact(3 * p * p).enumerate() {
            for c in 0..3 {
                for r in 0..p {
                    for q in 0..p {
                        let (y, x) = ((n / 6) * p + r, (n % 6) * p + q);
                        let got = patch[c * p * p + r * p + q];
                        if x < w as usize && y < h as usize {
                            let want = [x, y, (3 * x + 5 * y) % 256][c];
                            // Invert (v - 127.5)/127.5; exact after rounding.
                            let v = ((got * 0.5 + 0.5) * 255.0).round() as usize;
                            assert_eq!(v, want, "patch {n} c{c} r{r} q{q}");
                        } else {
                            assert_eq!(got, -1.0, "pad at patch {n} c{c} r{r} q{q}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn center_crop_takes_the_middle() {
        // Kimi-VL crop mode: 34x31 → crop 28x28 at offset ((34-28)/2, (31-28)/2) = (3, 1).
        let image = RgbImage::from_fn(34, 31, |x, y| Rgb([x as u8, y as u8, 0]));
        let cfg = ImageProcessorConfig {
            image_mean: [0.0; 3],
            image_std: [1.0; 3],
            resize: ResizeRule::TokenLimit {
                in_token_limit: 4096,
                pad_input: false,
            },
            ..ImageProcessorConfig::kimi_vl()
        };
        let out = preprocess(&image, &cfg).expect("crop fits");
        assert_eq!(out.grid_thw, [1, 2, 2]);
        for y in 0..28 {
            for x in 0..28 {
                assert_eq!(canvas_value(&out, 0, y, x), (x + 3) as f32 / 255.0);
                assert_eq!(canvas_value(&out, 1, y, x), (y + 1) as f32 / 255.0);
            }
        }
    }

    #[test]
    fn resized_images_use_the_backends_resampler() {
        let image = RgbImage::from_fn(300, 200, |x, y| {
            Rgb([
                (x * 255 / 299) as u8,
                (y * 255 / 199) as u8,
                ((x * y) % 251) as u8,
            ])
        });
        for backend in [Backend::Torchvision, Backend::Pillow] {
            let cfg = ImageProcessorConfig {
                resize: ResizeRule::NavitPatchLimit {
                    in_patch_limit: 64,
                    patch_limit_on_one_side: 512,
                },
                backend,
                ..ImageProcessorConfig::kimi_k25()
            };
            // 21x14 = 294 patches; scale sqrt(64/294) = 0.46657 → 139x93 → padded 140x112.
            let out = preprocess(&image, &cfg).expect("fits");
            assert_eq!(
                (
                    out.plan.resized_width,
                    out.plan.resized_height,
                    out.grid_thw,
                    out.num_tokens
                ),
                (139, 93, [1, 8, 10], 20)
            );
            let resized = resize_bicubic_with(&image, 139, 93, backend.bicubic());
            for y in 0..112 {
                for x in 0..140 {
                    for c in 0..3 {
                        let want = if y < 93 && x < 139 {
                            normalise(resized.get_pixel(x as u32, y as u32)[c], 0.5, 0.5, backend)
                        } else {
                            -1.0
                        };
                        assert_eq!(canvas_value(&out, c, y, x), want, "({y},{x}) c{c}");
                    }
                }
            }
        }
    }

    #[test]
    fn matches_the_python_k25_processors_bit_for_bit() {
        // Golden FNV-1a hashes of the little-endian f32 `pixel_values` produced on the
        // resampler goldens' noise image by
        // - the remote-code K2.5 path (navit_resize_image, Pillow 13.0.0 bicubic, np.pad,
        //   NumPy f32 normalise, navit_patchify): Backend::Pillow;
        // - transformers 5.23 `Kimi_K25ImageProcessor(max_patches=limit)` (torch 2.15):
        //   Backend::Torchvision.
        use crate::resample::tests::{fnv1a, noise};
        for (backend, w, h, limit, grid, hash) in [
            (
                Backend::Pillow,
                300,
                200,
                64,
                [1, 8, 10],
                0xc5b3_078d_d00a_34b2_u64,
            ),
            (
                Backend::Pillow,
                97,
                61,
                16384,
                [1, 6, 8],
                0xd4ab_6f8e_4a79_9d2a,
            ),
            (
                Backend::Torchvision,
                300,
                200,
                64,
                [1, 8, 10],
                0xbfea_b8e0_84a5_5781,
            ),
            (
                Backend::Torchvision,
                97,
                61,
                16384,
                [1, 6, 8],
                0x62ef_2235_64dd_fd06,
            ),
        ] {
            let cfg = ImageProcessorConfig {
                resize: ResizeRule::NavitPatchLimit {
                    in_patch_limit: limit,
                    patch_limit_on_one_side: 512,
                },
                backend,
                ..ImageProcessorConfig::kimi_k25()
            };
            let out = preprocess(&noise(w, h), &cfg).expect("fits");
            assert_eq!(out.grid_thw, grid, "{w}x{h}");
            let bytes: Vec<u8> = out
                .pixel_values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            assert_eq!(
                fnv1a(&bytes),
                hash,
                "{backend:?} {w}x{h}: pixel_values differ from Python"
            );
        }
    }

    #[test]
    fn merge_order_concatenates_2x2_windows_row_major() {
        let order = merge_order(4, 6);
        assert_eq!(order.len(), 6);
        assert_eq!(order[0], [0, 1, 6, 7]);
        assert_eq!(order[1], [2, 3, 8, 9]);
        assert_eq!(order[3], [12, 13, 18, 19]);
        assert_eq!(order[5], [16, 17, 22, 23]);
        // Every patch appears exactly once, and cell (i, j) holds rows 2i..2i+2, cols 2j..2j+2.
        let mut seen = [0; 24];
        for (cell, quad) in order.iter().enumerate() {
            let (i, j) = (cell / 3, cell % 3);
            let want = [
                (2 * i, 2 * j),
                (2 * i, 2 * j + 1),
                (2 * i + 1, 2 * j),
                (2 * i + 1, 2 * j + 1),
            ];
            for (k, &patch) in quad.iter().enumerate() {
                seen[patch] += 1;
                assert_eq!((patch / 6, patch % 6), want[k]);
            }
        }
        assert!(seen.iter().all(|&n| n == 1));
        let out =
            preprocess(&RgbImage::new(70, 30), &ImageProcessorConfig::kimi_k3()).expect("small");
        assert_eq!(
            merge_order(out.grid_thw[1], out.grid_thw[2]).len(),
            out.num_tokens
        );
    }

    #[test]
    #[should_panic(expected = "even grid")]
    fn merge_order_rejects_odd_grids() {
        merge_order(3, 4);
    }

    fn encode(image: &RgbImage, format: ImageFormat) -> Vec<u8> {
        let mut out = Cursor::new(Vec::new());
        DynamicImage::ImageRgb8(image.clone())
            .write_to(&mut out, format)
            .expect("in-memory encode");
        out.into_inner()
    }

    #[test]
    fn png_and_jpeg_bytes_round_trip_through_the_processor() {
        let image = RgbImage::from_fn(120, 90, |x, y| Rgb([(x * 2) as u8, (y * 2) as u8, 128]));
        let cfg = ImageProcessorConfig::kimi_k25();
        let direct = preprocess(&image, &cfg).expect("fits");
        let from_png = process_image_bytes(&encode(&image, ImageFormat::Png), &cfg).expect("PNG");
        assert_eq!(from_png, direct, "lossless PNG must give identical patches");
        let from_jpeg =
            process_image_bytes(&encode(&image, ImageFormat::Jpeg), &cfg).expect("JPEG");
        assert_eq!(
            (from_jpeg.grid_thw, from_jpeg.num_tokens),
            (direct.grid_thw, direct.num_tokens)
        );
        // JPEG (quality 75) on a smooth ramp: mean error under 3/255 levels, i.e. 0.024 in
        // normalised units (x2 for std 0.5); padded values identical.
        let mean_err = from_jpeg
            .pixel_values
            .iter()
            .zip(&direct.pixel_values)
            .map(|(a, b)| f64::from((a - b).abs()))
            .sum::<f64>()
            / direct.pixel_values.len() as f64;
        assert!(mean_err < 0.024, "mean error {mean_err}");
        let err = process_image_bytes(b"\x89PNG\r\n\x1a\ngarbage", &cfg).unwrap_err();
        assert!(matches!(err, MediaError::Decode { .. }), "{err}");
    }
}
