//! Decoded video frames → vision-tower chunks, exactly as transformers'
//! `Kimi_K25VideoProcessor` builds them, and the per-chunk prompt text.
//!
//! Input is frames that were already sampled and decoded (RGB, all the same size) with
//! the time of each frame in seconds; which frames to take, at what fps, and the FFmpeg
//! decode are the job of the video decoder, not of this module.
//!
//! ```text
//! frames [F] + timestamps [F]
//!   ──group by temporal_patch_size (4)──▶ chunks of 4 frames, the last one shorter
//!   ──per frame: plan_resize with frame_patch_limit (4096), bicubic, zero pad to 28,
//!     normalise (crate::image_proc)──▶ [t, gh, gw, 3, 14, 14], frame-major
//!   ──▶ VideoChunk { pixel_values [t·gh·gw, 3, 14, 14], grid_thw [t, gh, gw],
//!                    num_tokens gh·gw/4, timestamp of the chunk's first frame }
//! ```
//!
//! Reference: `video_processing_kimi_k25.py` (`_preprocess`: `video[c : c + temporal]`
//! chunks, `navit_resize` per frame, `patchify` permuting to `[t, gh, gw, C, p, p]`) and
//! `processing_kimi_k25.py` (`replace_video_token`): each chunk becomes
//! `{HH:MM:SS.mmm}<|media_begin|>video<|media_content|>{pad × gh·gw/4}<|media_end|>`,
//! with the chunk's first-frame time formatted by `time.gmtime` (hours wrap at 24) and
//! the milliseconds truncated, `int(t % 1 · 1000)`. The tower mean-pools the `t` frames
//! of a chunk, so a chunk costs one frame's tokens whatever its `t`
//! (`video-anchors.md` §1.3). [`chunk_prompt`] writes one `<|media_pad|>`, as the
//! Moonshot template and vLLM do; the tokenizer side expands it to `num_tokens` copies.

use image::RgbImage;

use crate::content_key::content_hash;
use crate::error::{MediaError, Result};
use crate::image_proc::write_patches;
use crate::resize::{plan_resize, ImageProcessorConfig, ResizePlan};

/// Opens a media item in the prompt (`<|media_begin|>`, id 163602 in K2.5/K3).
pub const MEDIA_BEGIN: &str = "<|media_begin|>";
/// Separates the media kind from its placeholder (`<|media_content|>`, id 163603).
pub const MEDIA_CONTENT: &str = "<|media_content|>";
/// Closes a media item (`<|media_end|>`, id 163604).
pub const MEDIA_END: &str = "<|media_end|>";
/// The placeholder expanded to the item's tokens (`<|media_pad|>`, id 163605).
pub const MEDIA_PAD: &str = "<|media_pad|>";

/// One chunk of up to `temporal_patch_size` consecutive frames, ready for the tower.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoChunk {
    /// `[t·gh·gw, 3, patch, patch]` row-major `f32`: frame after frame, each frame's
    /// patches in row-major order over its grid, channels R, G, B.
    pub pixel_values: Vec<f32>,
    /// `[t, gh, gw]`: frames in this chunk, patch rows, patch columns.
    pub grid_thw: [usize; 3],
    /// LLM tokens after the tower's temporal mean-pool and 2×2 merge, `gh·gw/merge²`.
    pub num_tokens: usize,
    /// Index of the chunk's first frame in the input.
    pub first_frame: usize,
    /// Time of the chunk's first frame in seconds (what the prompt shows).
    pub timestamp: f64,
    /// Identity of the chunk's pixels (frame sizes and RGB bytes), for the encoder cache
    /// and the radix keys of its span; see [`frames_hash`].
    pub hash: u64,
    /// Side of one patch in pixels.
    pub patch_size: usize,
    /// How every frame of the chunk was resized and padded.
    pub plan: ResizePlan,
}

impl VideoChunk {
    /// Number of patches, `t · gh · gw`.
    pub fn num_patches(&self) -> usize {
        self.grid_thw.iter().product()
    }

    /// The chunk's first-frame time as the prompt shows it, `HH:MM:SS.mmm`.
    pub fn timestamp_text(&self) -> String {
        format_timestamp(self.timestamp)
    }

    /// The chunk's prompt text with a single `<|media_pad|>` ([`chunk_prompt`]).
    pub fn prompt(&self) -> String {
        chunk_prompt(self.timestamp)
    }
}

/// Cuts `frames` (with their times in seconds) into chunks of
/// `cfg.temporal_patch_size` frames and preprocesses each frame under
/// [`ImageProcessorConfig::frame_config`], as `Kimi_K25VideoProcessor` does.
///
/// Errors: no frames, a timestamp count that differs from the frame count, frames of
/// different sizes, a timestamp that is negative or not finite, and every error of
/// [`plan_resize`] (invalid config, oversized grid).
pub fn chunk_frames(
    frames: &[RgbImage],
    timestamps: &[f64],
    cfg: &ImageProcessorConfig,
) -> Result<Vec<VideoChunk>> {
    let invalid = |reason: String| Err(MediaError::InvalidFrames { reason });
    let Some(first) = frames.first() else {
        return invalid("no frames were given".into());
    };
    if timestamps.len() != frames.len() {
        return invalid(format!(
            "{} frames but {} timestamps",
            frames.len(),
            timestamps.len()
        ));
    }
    if let Some((i, frame)) = frames
        .iter()
        .enumerate()
        .find(|(_, f)| f.dimensions() != first.dimensions())
    {
        return invalid(format!(
            "frame {i} is {}x{} pixels but frame 0 is {}x{}",
            frame.width(),
            frame.height(),
            first.width(),
            first.height()
        ));
    }
    if let Some((i, t)) = timestamps
        .iter()
        .enumerate()
        .find(|(_, t)| !t.is_finite() || **t < 0.0)
    {
        return invalid(format!(
            "timestamp {i} must be a finite number of seconds >= 0, got {t}"
        ));
    }
    let frame_cfg = cfg.frame_config();
    let plan = plan_resize(first.width(), first.height(), &frame_cfg)?;
    let p = cfg.patch_size as usize;
    let frame_len = plan.grid_h * plan.grid_w * 3 * p * p;
    let merge = cfg.merge_kernel_size as usize;
    let temporal = cfg.temporal_patch_size as usize;
    let mut chunks = Vec::with_capacity(frames.len().div_ceil(temporal));
    for (c, group) in frames.chunks(temporal).enumerate() {
        let mut pixel_values = vec![0f32; group.len() * frame_len];
        for (frame, out) in group.iter().zip(pixel_values.chunks_exact_mut(frame_len)) {
            write_patches(frame, &plan, &frame_cfg, out);
        }
        chunks.push(VideoChunk {
            pixel_values,
            grid_thw: [group.len(), plan.grid_h, plan.grid_w],
            num_tokens: plan.grid_h * plan.grid_w / (merge * merge),
            first_frame: c * temporal,
            timestamp: timestamps[c * temporal],
            hash: frames_hash(group),
            patch_size: p,
            plan,
        });
    }
    Ok(chunks)
}

/// A stable identity for a run of frames: [`content_hash`] of a little-endian record
/// `"rgb-frames-v1", count, then per frame width, height and content_hash(RGB bytes)`.
/// Like [`content_hash`] of encoded bytes it identifies the pixels, not the
/// preprocessing.
pub fn frames_hash(frames: &[RgbImage]) -> u64 {
    let mut record = Vec::with_capacity(13 + 8 + frames.len() * 16);
    record.extend_from_slice(b"rgb-frames-v1");
    record.extend_from_slice(&(frames.len() as u64).to_le_bytes());
    for frame in frames {
        record.extend_from_slice(&frame.width().to_le_bytes());
        record.extend_from_slice(&frame.height().to_le_bytes());
        record.extend_from_slice(&content_hash(frame.as_raw()).to_le_bytes());
    }
    content_hash(&record)
}

pub use crate::timestamp::format_timestamp;

/// The prompt of one video chunk:
/// `{HH:MM:SS.mmm}<|media_begin|>video<|media_content|><|media_pad|><|media_end|>`.
pub fn chunk_prompt(timestamp: f64) -> String {
    format!(
        "{}{MEDIA_BEGIN}video{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}",
        format_timestamp(timestamp)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image_proc::preprocess;
    use image::Rgb;

    fn frame(w: u32, h: u32, seed: u8) -> RgbImage {
        RgbImage::from_fn(w, h, |x, y| {
            Rgb([
                (x as u8).wrapping_mul(7).wrapping_add(seed),
                (y as u8).wrapping_mul(3),
                seed,
            ])
        })
    }

    #[test]
    fn chunks_are_frame_major_images_of_the_frame_budget() {
        let cfg = ImageProcessorConfig {
            frame_patch_limit: 16,
            ..ImageProcessorConfig::kimi_k25()
        };
        let frames: Vec<RgbImage> = (0..6).map(|i| frame(90, 60, i * 40)).collect();
        let times: Vec<f64> = (0..6).map(|i| f64::from(i) * 0.5).collect();
        let chunks = chunk_frames(&frames, &times, &cfg).expect("valid frames");
        // 6 frames in chunks of 4 → [4, 2]; 6x4 = 24 patches > 16 → scale sqrt(16/24):
        // 73x48 → padded 84x56 → grid 4x6, 6 tokens per chunk whatever t.
        let grids: Vec<_> = chunks.iter().map(|c| (c.grid_thw, c.num_tokens)).collect();
        assert_eq!(grids, [([4, 4, 6], 6), ([2, 4, 6], 6)]);
        assert_eq!((chunks[1].first_frame, chunks[1].timestamp), (4, 2.0));
        // Each frame's slice equals the still-image preprocess under the frame budget.
        let frame_cfg = cfg.frame_config();
        let per_frame = 24 * 3 * 14 * 14;
        for (i, f) in frames.iter().enumerate() {
            let still = preprocess(f, &frame_cfg).expect("valid frame");
            let chunk = &chunks[i / 4];
            let slice = &chunk.pixel_values[(i % 4) * per_frame..(i % 4 + 1) * per_frame];
            assert_eq!(slice, &still.pixel_values[..], "frame {i}");
        }
        assert_ne!(chunks[0].hash, chunks[1].hash);
        assert_eq!(chunks[0].hash, frames_hash(&frames[..4]));
    }

    #[test]
    fn bad_frame_sets_are_rejected_with_the_reason() {
        let cfg = ImageProcessorConfig::kimi_k25();
        let two = [frame(30, 30, 0), frame(30, 31, 0)];
        let err = chunk_frames(&two, &[0.0, 1.0], &cfg).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid video frames: frame 1 is 30x31 pixels but frame 0 is 30x30"
        );
        assert_eq!(err.kind(), "video_frames_invalid");
        let err = chunk_frames(&two[..1], &[0.0, 1.0], &cfg).unwrap_err();
        assert!(
            err.to_string().contains("1 frames but 2 timestamps"),
            "{err}"
        );
        let err = chunk_frames(&two[..1], &[f64::NAN], &cfg).unwrap_err();
        assert!(err.to_string().contains("timestamp 0"), "{err}");
        assert!(chunk_frames(&[], &[], &cfg).is_err());
    }

    #[test]
    fn timestamps_truncate_milliseconds_and_wrap_hours() {
        assert_eq!(format_timestamp(0.0), "00:00:00.000");
        assert_eq!(format_timestamp(1.7333333333333334), "00:00:01.733");
        assert_eq!(format_timestamp(3599.9996), "00:59:59.999");
        assert_eq!(format_timestamp(90061.25), "01:01:01.250");
        assert_eq!(
            chunk_prompt(2.0),
            "00:00:02.000<|media_begin|>video<|media_content|><|media_pad|><|media_end|>"
        );
    }
}
