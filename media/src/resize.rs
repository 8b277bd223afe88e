//! Processor configuration and the resize rules of the Kimi image processors.
//!
//! Two processor families are covered (reference: `kimi-architecture.md` §3.3):
//!
//! - **Kimi K2.5 / K3** (`media_utils.navit_resize_image`, MoonViT3d): scale so that the
//!   14-pixel patch count stays within `in_patch_limit` and neither side exceeds
//!   `patch_limit_on_one_side` patches,
//!   `scale = min(1, sqrt(limit / (max(1, W//14) · max(1, H//14))), 512·14/W, 512·14/H)`,
//!   `new = min(max(1, int(dim · scale)), 512·14)`; bicubic resize; zero-pad right/bottom
//!   to multiples of 28 (= patch · merge). Padding can push the count slightly over the
//!   limit (an 8000×8000 photo gives 4225 tokens for a 16384-patch limit); upstream and
//!   vLLM do the same, so no trimming is done here.
//! - **Kimi-VL** (`KimiVLImageProcessor.rescale`, MoonViT): if `(W//14)·(H//14) >
//!   in_token_limit`, resize by `sqrt(limit / that)`; then pad to multiples of 28
//!   (`pad_input`) or center-crop down to them; grids of 512 or more patches on a side are
//!   rejected ("Exceed pos emb").
//!
//! Which arithmetic resizes and normalises is the config's [`Backend`]: transformers'
//! native K2.5 processors ([`Backend::Torchvision`], the K2.5/K3 presets) or the Moonshot
//! remote code ([`Backend::Pillow`], the Kimi-VL preset). Video frames use the same rules
//! with their own patch budget ([`ImageProcessorConfig::frame_patch_limit`]) and are
//! grouped by [`ImageProcessorConfig::temporal_patch_size`] ([`crate::frames`]).
//!
//! [`plan_resize`] needs only the width and height, so the gateway can count an image's
//! tokens from its header ([`crate::probe_image`]) before decoding any pixel.

use crate::decode::{DecodeLimits, DEFAULT_MAX_PIXELS, DEFAULT_MAX_SIDE};
use crate::error::{MediaError, Result};

/// OpenAI CLIP channel means, the Kimi-VL processor's defaults.
pub const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
/// OpenAI CLIP channel standard deviations, the Kimi-VL processor's defaults.
#[allow(clippy::excessive_precision)] // digits as published upstream
pub const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_58, 0.275_777_11];
/// Kimi-VL rejects grids with this many patches (or more) on a side: its 2D RoPE table is
/// 512×512 and the processor raises "Exceed pos emb" at 512.
pub const KIMI_VL_GRID_LIMIT: usize = 512;

/// Which reference processor's resize and normalisation arithmetic to reproduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// transformers' native `Kimi_K25ImageProcessor` / `Kimi_K25VideoProcessor`
    /// (`TorchvisionBackend`): PyTorch's uint8 antialiased bicubic
    /// ([`crate::Bicubic::Torch`]) and the fused `(x − 255·mean) / (255·std)` in `f32`.
    Torchvision,
    /// The Moonshot remote-code processors (Pillow resize, NumPy/torchvision `x/255`
    /// then `(· − mean) / std` in `f32`): [`crate::Bicubic::Pillow`].
    Pillow,
}

impl Backend {
    /// The resampler this backend uses.
    pub fn bicubic(self) -> crate::resample::Bicubic {
        match self {
            Backend::Torchvision => crate::resample::Bicubic::Torch,
            Backend::Pillow => crate::resample::Bicubic::Pillow,
        }
    }
}

/// How an image is brought to a patch-aligned size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResizeRule {
    /// Kimi K2.5 / K3 (`navit_resize_image`): downscale to the patch budget and the
    /// per-side cap, never upscale, then zero-pad to multiples of `patch · merge`.
    NavitPatchLimit {
        /// Most 14-pixel patches before padding (K2.5: 16384, K3: 65536).
        in_patch_limit: u64,
        /// Most patches on one side (512: the position-embedding / RoPE range).
        patch_limit_on_one_side: u32,
    },
    /// Kimi-VL (`KimiVLImageProcessor.rescale`): downscale only when over the budget, then
    /// pad (or center-crop) to multiples of `patch · merge`; grids of
    /// [`KIMI_VL_GRID_LIMIT`] patches on a side are rejected.
    TokenLimit {
        /// Most 14-pixel patches, compared with `(W//14)·(H//14)` (the name is upstream's;
        /// 4096 patches are 1024 LLM tokens).
        in_token_limit: u64,
        /// `true`: zero-pad right/bottom; `false`: center-crop down (floor offsets).
        pad_input: bool,
    },
}

/// Everything the image processor needs; field names follow `preprocessor_config.json`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ImageProcessorConfig {
    /// Side of one square patch in pixels (14 for every Kimi vision tower).
    pub patch_size: u32,
    /// Side of the patch-merger window (2: 2×2 patches become one LLM token).
    pub merge_kernel_size: u32,
    /// Per-channel mean subtracted after scaling to `[0, 1]`.
    pub image_mean: [f32; 3],
    /// Per-channel standard deviation divided by after subtracting the mean; nonzero.
    pub image_std: [f32; 3],
    /// The resize/pad policy of the model family.
    pub resize: ResizeRule,
    /// Whose resize and normalisation arithmetic to match bit for bit.
    pub backend: Backend,
    /// Frames per video chunk (transformers' `temporal_patch_size`, Moonshot's
    /// `temporal_merge_kernel_size`): 4 for K2.5/K3, whose tower has 4 time embeddings;
    /// 1..=16 accepted here, the vision tower checks its own maximum.
    pub temporal_patch_size: u32,
    /// Patch budget of each video frame, replacing the image budget of [`Self::resize`]
    /// for frames (transformers' video `max_patches`, Moonshot's
    /// `in_patch_limit_each_frame`; default 4096, about 1024 tokens per chunk).
    pub frame_patch_limit: u64,
    /// Decode safety limit: longest accepted side in pixels (default 16384). Not a model
    /// parameter: it bounds memory before the resize shrinks the image.
    pub max_decoded_side: u32,
    /// Decode safety limit: most accepted pixels in total (default 2^26 ≈ 67 MP).
    pub max_decoded_pixels: u64,
}

impl Default for ImageProcessorConfig {
    /// Kimi K3's processor ([`ImageProcessorConfig::kimi_k3`]).
    fn default() -> Self {
        Self::kimi_k3()
    }
}

impl ImageProcessorConfig {
    /// Kimi K2.5 / K2.6 as transformers' `Kimi_K25ImageProcessor` and
    /// `Kimi_K25VideoProcessor` ship them: patch 14, merge 2, mean = std = 0.5,
    /// `max_patches` 16384 per image and 4096 per video frame, 512 patches per side,
    /// 4 frames per chunk, torchvision arithmetic.
    pub fn kimi_k25() -> Self {
        ImageProcessorConfig {
            patch_size: 14,
            merge_kernel_size: 2,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            resize: ResizeRule::NavitPatchLimit {
                in_patch_limit: 16384,
                patch_limit_on_one_side: 512,
            },
            backend: Backend::Torchvision,
            temporal_patch_size: 4,
            frame_patch_limit: 4096,
            max_decoded_side: DEFAULT_MAX_SIDE,
            max_decoded_pixels: DEFAULT_MAX_PIXELS,
        }
    }

    /// Kimi K3: as K2.5 with `in_patch_limit` 65536 (up to 16384 LLM tokens per image).
    /// K3's processor is not in transformers; it is assumed to share K2.5's arithmetic.
    pub fn kimi_k3() -> Self {
        ImageProcessorConfig {
            resize: ResizeRule::NavitPatchLimit {
                in_patch_limit: 65536,
                patch_limit_on_one_side: 512,
            },
            ..Self::kimi_k25()
        }
    }

    /// Kimi-VL (`preprocessor_config.json`: `in_token_limit` 4096, `pad_input` true),
    /// with the class's CLIP mean/std defaults and the remote code's Pillow arithmetic.
    /// Kimi-VL has no video processor: frames are single-frame chunks under the image
    /// budget.
    pub fn kimi_vl() -> Self {
        ImageProcessorConfig {
            patch_size: 14,
            merge_kernel_size: 2,
            image_mean: CLIP_MEAN,
            image_std: CLIP_STD,
            resize: ResizeRule::TokenLimit {
                in_token_limit: 4096,
                pad_input: true,
            },
            backend: Backend::Pillow,
            temporal_patch_size: 1,
            frame_patch_limit: 4096,
            max_decoded_side: DEFAULT_MAX_SIDE,
            max_decoded_pixels: DEFAULT_MAX_PIXELS,
        }
    }

    /// The settings one video frame is resized with: the image rule with its patch budget
    /// replaced by [`Self::frame_patch_limit`].
    pub fn frame_config(&self) -> Self {
        let resize = match self.resize {
            ResizeRule::NavitPatchLimit {
                patch_limit_on_one_side,
                ..
            } => ResizeRule::NavitPatchLimit {
                in_patch_limit: self.frame_patch_limit,
                patch_limit_on_one_side,
            },
            ResizeRule::TokenLimit { pad_input, .. } => ResizeRule::TokenLimit {
                in_token_limit: self.frame_patch_limit,
                pad_input,
            },
        };
        ImageProcessorConfig { resize, ..*self }
    }

    /// The decode limits these settings ask for.
    pub fn decode_limits(&self) -> DecodeLimits {
        DecodeLimits {
            max_side: self.max_decoded_side,
            max_pixels: self.max_decoded_pixels,
        }
    }

    /// Checks every field; each error names the field and the value found.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, reason: String| Err(MediaError::Config { field, reason });
        if self.patch_size == 0 || self.patch_size > 1024 {
            return bad(
                "patch_size",
                format!("must be in 1..=1024, got {}", self.patch_size),
            );
        }
        if self.merge_kernel_size == 0 || self.merge_kernel_size > 16 {
            return bad(
                "merge_kernel_size",
                format!("must be in 1..=16, got {}", self.merge_kernel_size),
            );
        }
        if let Some(m) = self.image_mean.iter().find(|m| !m.is_finite()) {
            return bad("image_mean", format!("must be finite, got {m}"));
        }
        if let Some(s) = self.image_std.iter().find(|s| !s.is_finite() || **s == 0.0) {
            return bad("image_std", format!("must be finite and nonzero, got {s}"));
        }
        match self.resize {
            ResizeRule::NavitPatchLimit {
                in_patch_limit,
                patch_limit_on_one_side,
            } => {
                if in_patch_limit == 0 {
                    return bad("in_patch_limit", "must be at least 1, got 0".into());
                }
                if patch_limit_on_one_side < self.merge_kernel_size
                    || patch_limit_on_one_side > 65536
                {
                    return bad(
                        "patch_limit_on_one_side",
                        format!(
                            "must be in {}..=65536 (at least one merge window), got {patch_limit_on_one_side}",
                            self.merge_kernel_size
                        ),
                    );
                }
            }
            ResizeRule::TokenLimit { in_token_limit, .. } => {
                if in_token_limit == 0 {
                    return bad("in_token_limit", "must be at least 1, got 0".into());
                }
            }
        }
        if self.temporal_patch_size == 0 || self.temporal_patch_size > 16 {
            return bad(
                "temporal_patch_size",
                format!("must be in 1..=16, got {}", self.temporal_patch_size),
            );
        }
        if self.frame_patch_limit == 0 {
            return bad("frame_patch_limit", "must be at least 1, got 0".into());
        }
        if self.max_decoded_side == 0 {
            return bad("max_decoded_side", "must be at least 1, got 0".into());
        }
        if self.max_decoded_pixels == 0 {
            return bad("max_decoded_pixels", "must be at least 1, got 0".into());
        }
        Ok(())
    }
}

/// How one image of a given size becomes a patch-aligned canvas; computable from the
/// header alone, so token counts are known before any pixel is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResizePlan {
    /// Width of the image the plan was made for.
    pub input_width: u32,
    /// Height of the image the plan was made for.
    pub input_height: u32,
    /// Width after the bicubic resize (the input width when no resize is needed).
    pub resized_width: u32,
    /// Height after the bicubic resize.
    pub resized_height: u32,
    /// Columns cut from the left of the resized image (center-crop mode; 0 otherwise).
    pub crop_left: u32,
    /// Rows cut from the top of the resized image (center-crop mode; 0 otherwise).
    pub crop_top: u32,
    /// Final canvas width, a multiple of `patch_size · merge_kernel_size`.
    pub width: u32,
    /// Final canvas height, a multiple of `patch_size · merge_kernel_size`.
    pub height: u32,
    /// Patch rows, `height / patch_size`.
    pub grid_h: usize,
    /// Patch columns, `width / patch_size`.
    pub grid_w: usize,
    /// LLM tokens after the patch merger, `grid_h · grid_w / merge²`.
    pub num_tokens: usize,
}

/// Computes the [`ResizePlan`] of a `width`×`height` image under `cfg` (integer and `f64`
/// arithmetic identical to the Python references, so sizes match exactly).
pub fn plan_resize(width: u32, height: u32, cfg: &ImageProcessorConfig) -> Result<ResizePlan> {
    cfg.validate()?;
    if width == 0 || height == 0 {
        return Err(MediaError::ZeroSize { width, height });
    }
    let patch = u64::from(cfg.patch_size);
    let cell = patch * u64::from(cfg.merge_kernel_size);
    let (w, h) = (u64::from(width), u64::from(height));
    let round_up = |v: u64| v.div_ceil(cell) * cell;
    let (rw, rh, crop_left, crop_top, cw, ch, grid_limit) = match cfg.resize {
        ResizeRule::NavitPatchLimit {
            in_patch_limit,
            patch_limit_on_one_side,
        } => {
            let side = u64::from(patch_limit_on_one_side);
            let patches = (w / patch).max(1) * (h / patch).max(1);
            let s1 = (in_patch_limit as f64 / patches as f64).sqrt();
            let s2 = (side * patch) as f64 / w as f64;
            let s3 = (side * patch) as f64 / h as f64;
            let scale = 1f64.min(s1).min(s2).min(s3);
            let rw = ((w as f64 * scale) as u64).max(1).min(side * patch);
            let rh = ((h as f64 * scale) as u64).max(1).min(side * patch);
            (rw, rh, 0, 0, round_up(rw), round_up(rh), side as usize)
        }
        ResizeRule::TokenLimit {
            in_token_limit,
            pad_input,
        } => {
            let patches = (w / patch) * (h / patch);
            let (rw, rh) = if patches > in_token_limit {
                let scale = (in_token_limit as f64 / patches as f64).sqrt();
                // Upstream has no max(1); PIL would raise on a zero side instead.
                (
                    ((w as f64 * scale) as u64).max(1),
                    ((h as f64 * scale) as u64).max(1),
                )
            } else {
                (w, h)
            };
            let limit = KIMI_VL_GRID_LIMIT - 1;
            if pad_input {
                (rw, rh, 0, 0, round_up(rw), round_up(rh), limit)
            } else {
                let (cw, ch) = (rw - rw % cell, rh - rh % cell);
                if cw == 0 || ch == 0 {
                    let narrow =
                        |v: u64| u32::try_from(v).expect("never larger than the input side");
                    return Err(MediaError::TooSmall {
                        width: narrow(rw),
                        height: narrow(rh),
                        cell: narrow(cell),
                    });
                }
                (rw, rh, (rw - cw) / 2, (rh - ch) / 2, cw, ch, limit)
            }
        }
    };
    let (grid_h, grid_w) = ((ch / patch) as usize, (cw / patch) as usize);
    if grid_h > grid_limit || grid_w > grid_limit {
        return Err(MediaError::GridTooLarge {
            grid_h,
            grid_w,
            limit: grid_limit,
        });
    }
    let merge = cfg.merge_kernel_size as usize;
    // Resized sides never exceed the input's (u32); the canvas is at most
    // grid_limit (<= 65536) patches of <= 1024 pixels, checked just above.
    let px = |v: u64| u32::try_from(v).expect("bounded by the input side or the grid limit");
    Ok(ResizePlan {
        input_width: width,
        input_height: height,
        resized_width: px(rw),
        resized_height: px(rh),
        crop_left: px(crop_left),
        crop_top: px(crop_top),
        width: px(cw),
        height: px(ch),
        grid_h,
        grid_w,
        num_tokens: (grid_h / merge) * (grid_w / merge),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Asserts the plan's (resized, canvas, grid, tokens) against hand-computed values.
    fn check_plan(
        w: u32,
        h: u32,
        cfg: &ImageProcessorConfig,
        resized: (u32, u32),
        canvas: (u32, u32),
        grid: (usize, usize),
        tokens: usize,
    ) {
        let plan = plan_resize(w, h, cfg).expect("valid size");
        assert_eq!(
            (plan.resized_width, plan.resized_height),
            resized,
            "{w}x{h}: resized"
        );
        assert_eq!((plan.width, plan.height), canvas, "{w}x{h}: canvas");
        assert_eq!((plan.grid_h, plan.grid_w), grid, "{w}x{h}: grid");
        assert_eq!(plan.num_tokens, tokens, "{w}x{h}: tokens");
    }

    #[test]
    fn k25_and_k3_resize_a_4000x3000_photo() {
        // W//14 = 285, H//14 = 214 → 60990 patches. K2.5: scale = sqrt(16384/60990)
        // = 0.518299 → int(2073.19) x int(1554.89) = 2073x1554 → pad 2100x1568.
        check_plan(
            4000,
            3000,
            &ImageProcessorConfig::kimi_k25(),
            (2073, 1554),
            (2100, 1568),
            (112, 150),
            4200,
        );
        // K3: sqrt(65536/60990) > 1 → no resize; pad 4004x3024 → 143x108 cells.
        check_plan(
            4000,
            3000,
            &ImageProcessorConfig::kimi_k3(),
            (4000, 3000),
            (4004, 3024),
            (216, 286),
            15444,
        );
    }

    #[test]
    fn tiny_icon_is_padded_not_upscaled() {
        // W//14 = 0 → max(1, 0) = 1 patch; scale = min(1, 128, ...) = 1.
        for cfg in [
            ImageProcessorConfig::kimi_k25(),
            ImageProcessorConfig::kimi_k3(),
            ImageProcessorConfig::kimi_vl(),
        ] {
            check_plan(10, 10, &cfg, (10, 10), (28, 28), (2, 2), 1);
        }
    }

    #[test]
    fn extreme_strip_is_capped_at_512_patches_on_the_long_side() {
        // s2 = 7168/20000 = 0.3584 wins; 20000·0.3584 = 7168, 50·0.3584 = 17.92 → 17 → pad 28.
        let cfg = ImageProcessorConfig::kimi_k25();
        check_plan(20000, 50, &cfg, (7168, 17), (7168, 28), (2, 512), 256);
        check_plan(50, 20000, &cfg, (17, 7168), (28, 7168), (512, 2), 256);
        check_plan(
            20000,
            50,
            &ImageProcessorConfig::kimi_k3(),
            (7168, 17),
            (7168, 28),
            (2, 512),
            256,
        );
    }

    #[test]
    fn padding_may_exceed_the_patch_limit_as_upstream_does() {
        // 8000x8000 under K2.5: 1793x1793 → padded 1820 = 65 cells a side → 4225 > 16384/4.
        check_plan(
            8000,
            8000,
            &ImageProcessorConfig::kimi_k25(),
            (1793, 1793),
            (1820, 1820),
            (130, 130),
            4225,
        );
        // 2800x2800 under K3 costs 10000 tokens (the figure vLLM's K3 profile reports).
        check_plan(
            2800,
            2800,
            &ImageProcessorConfig::kimi_k3(),
            (2800, 2800),
            (2800, 2800),
            (200, 200),
            10000,
        );
    }

    #[test]
    fn kimi_vl_rule_pads_crops_and_rejects_huge_grids() {
        let pad = ImageProcessorConfig::kimi_vl();
        // 60990 > 4096: s = sqrt(4096/60990) → int(1036.6) x int(777.45) = 1036x777.
        check_plan(4000, 3000, &pad, (1036, 777), (1036, 784), (56, 74), 1036);
        let crop = ImageProcessorConfig {
            resize: ResizeRule::TokenLimit {
                in_token_limit: 4096,
                pad_input: false,
            },
            ..pad
        };
        let plan = plan_resize(4000, 3000, &crop).expect("fits");
        assert_eq!(
            (plan.width, plan.height, plan.crop_left, plan.crop_top),
            (1036, 756, 0, 10)
        );
        let err = plan_resize(20000, 50, &pad).unwrap_err();
        assert!(
            matches!(
                err,
                MediaError::GridTooLarge {
                    grid_h: 4,
                    grid_w: 1398,
                    limit: 511
                }
            ),
            "{err}"
        );
        let err = plan_resize(10, 10, &crop).unwrap_err();
        assert!(
            matches!(
                err,
                MediaError::TooSmall {
                    width: 10,
                    height: 10,
                    cell: 28
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn invalid_config_names_the_field() {
        let cfg = ImageProcessorConfig {
            image_std: [0.5, 0.0, 0.5],
            ..ImageProcessorConfig::kimi_k25()
        };
        let err = plan_resize(10, 10, &cfg).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid image processor config: `image_std` must be finite and nonzero, got 0"
        );
        let cfg = ImageProcessorConfig {
            patch_size: 0,
            ..ImageProcessorConfig::kimi_k3()
        };
        assert!(matches!(
            cfg.validate(),
            Err(MediaError::Config {
                field: "patch_size",
                ..
            })
        ));
    }
}
