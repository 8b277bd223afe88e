//! Video decoding with FFmpeg (ffmpeg-next): files, byte buffers and live chunk streams
//! → sampled RGB frames with their timestamps and source indices.
//!
//! This module ends where the per-chunk preprocessing (temporal groups of 4, patchify)
//! begins: its output is [`VideoFrame`]s (RGB at the processor's per-frame target size,
//! the prompt timestamp, the source frame index). References: `video-anchors.md` §1
//! (Kimi K2.5 sampling and timestamps), §4 (FFmpeg sub-sampling and threads),
//! `rust-deps.md` §2 (ffmpeg-next 9 on FFmpeg 5.1).
//!
//! ```text
//! file / bytes ──sniff + declared Container──▶ demuxer (custom AVIO) ──▶ StreamHeader
//!   (VideoLimits: bytes, declared size, duration)                      │
//!   total frames (declared nb_frames, else a demux-only packet count)  ▼
//!   SamplingMode::indices(total, src_fps, fps) ──▶ Picker ──▶ FrameDecoder ──▶ Vec<VideoFrame>
//!   packet pts (demux-only) ──▶ SkipPlan ──┘  keyframe gate, skip_frame=nonref for untaken
//!                                             frames, limits, convert kept only
//! live chunks ──LiveDecoder::push──▶ demux thread (blocking reader) ──packets──▶
//!   FrameDecoder on the caller's thread, LiveSelector by pts ──▶ frames as they complete
//! PNG / JPEG ──crate::decode_image──▶ one VideoFrame
//! ```
//!
//! # Modules
//! - [`container`] — [`Container`] (the client's declaration), magic-byte [`sniff`]ing and
//!   mismatch errors, the demuxer over any `Read`.
//! - [`sample`] — [`SamplingMode`] (transformers, the default, and Moonshot) and the live
//!   [`LiveSelector`]; how the three relate is written there.
//! - [`limits`] — [`VideoLimits`].
//! - [`convert`] — [`ScalePath`] (exact: RGB at source size then Pillow-exact resize, the
//!   default; fast: one swscale step).
//! - `skip` — the plan that keeps untaken non-reference frames of a file from being
//!   decoded at all (taken frames are bit-identical; [`VideoOptions::skip_untaken`]).
//! - [`file`] — [`decode_video_file`], [`decode_video_bytes`], [`image_frame`].
//! - [`live`] — [`LiveDecoder`].
//! - `crate::timestamp` — [`format_timestamp`] (`HH:MM:SS.mmm`, shared with the chunk prompts).
//!
//! FFmpeg's own log output is limited to fatal messages at first use ([`init`]): every
//! failure is returned as a [`crate::MediaError`] with FFmpeg's reason in it.

pub mod container;
pub mod convert;
mod decoder;
pub mod file;
pub mod limits;
pub mod live;
pub mod sample;
mod skip;

use std::sync::Once;

use image::RgbImage;

pub use crate::timestamp::format_timestamp;
pub use container::{sniff, Container, Sniffed};
pub use convert::ScalePath;
pub use file::{decode_video_bytes, decode_video_file, image_frame};
pub use limits::VideoLimits;
pub use live::LiveDecoder;
pub use sample::{moonshot_indices, transformers_indices, LiveSelector, SamplingMode};

use crate::error::{MediaError, Result};
use crate::resize::{ImageProcessorConfig, ResizeRule};

/// Kimi K2.5's `in_patch_limit_each_frame`: most 14-pixel patches per video frame.
pub const VIDEO_FRAME_PATCH_LIMIT: u64 = 4096;

/// The K2.5 / K3 processor settings for video frames: the image settings with the
/// per-frame patch limit [`VIDEO_FRAME_PATCH_LIMIT`] (512 patches per side still apply).
pub fn video_frame_config() -> ImageProcessorConfig {
    ImageProcessorConfig {
        resize: ResizeRule::NavitPatchLimit {
            in_patch_limit: VIDEO_FRAME_PATCH_LIMIT,
            patch_limit_on_one_side: 512,
        },
        ..ImageProcessorConfig::kimi_k25()
    }
}

/// The size frames come out at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OutputSize {
    /// The decoded size (for a caller that resizes itself).
    Source,
    /// The resized size [`crate::plan_resize`] gives under this config (before the zero
    /// padding, which the patchifier adds): the default is [`video_frame_config`].
    Processor(ImageProcessorConfig),
}

impl Default for OutputSize {
    fn default() -> Self {
        OutputSize::Processor(video_frame_config())
    }
}

/// Everything a decode needs besides the bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoOptions {
    /// Requested frames per second (default 2.0, the K2.5 `sample_fps`); in `(0, 1000]`.
    pub fps: f64,
    /// File sampler (default [`SamplingMode::Transformers`]); live streams always use
    /// [`LiveSelector`].
    pub sampling: SamplingMode,
    /// Conversion path for kept frames (default [`ScalePath::Exact`]).
    pub scale: ScalePath,
    /// Output frame size (default: the K2.5 per-frame target).
    pub output: OutputSize,
    /// Resource limits.
    pub limits: VideoLimits,
    /// Decoder threads (default 1; 0 lets FFmpeg choose one per core). Files use frame
    /// and slice threads, live streams slice threads only (frame threads add a frame of
    /// delay each); in `0..=64`.
    pub threads: u32,
    /// Refuse bitstream errors (FFmpeg `err_detect=explode`), frames marked corrupt and
    /// files with fewer frames than their index declares (default true). When false,
    /// errors are concealed and whatever decodes is returned (frames the decoder drops
    /// shift the indices after them).
    pub strict: bool,
    /// Files and buffers in strict mode: packets whose frame the sampler does not take
    /// go to the decoder with `skip_frame = nonref`, so untaken frames that no other
    /// frame references are never decoded (default true). Taken frames, their indices
    /// and timestamps are identical either way; a file where the packet index does not
    /// map to frame indices with certainty is decoded in full. One difference: a
    /// bitstream error inside a skipped frame is not seen, so strict mode refuses only
    /// errors in the frames it decodes. Live streams decode every frame.
    pub skip_untaken: bool,
}

impl Default for VideoOptions {
    fn default() -> Self {
        VideoOptions {
            fps: 2.0,
            sampling: SamplingMode::default(),
            scale: ScalePath::default(),
            output: OutputSize::default(),
            limits: VideoLimits::default(),
            threads: 1,
            strict: true,
            skip_untaken: true,
        }
    }
}

impl VideoOptions {
    /// Checks every field; each error names the field and the value found.
    pub fn validate(&self) -> Result<()> {
        if self.fps.is_nan() || self.fps <= 0.0 || self.fps > 1000.0 {
            return Err(MediaError::Config {
                field: "fps",
                reason: format!("must be in (0, 1000], got {}", self.fps),
            });
        }
        if self.threads > 64 {
            return Err(MediaError::Config {
                field: "threads",
                reason: format!("must be in 0..=64, got {}", self.threads),
            });
        }
        if let OutputSize::Processor(cfg) = &self.output {
            cfg.validate()?;
        }
        self.limits.validate()
    }
}

/// One kept frame.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoFrame {
    /// 8-bit RGB at the output size.
    pub image: RgbImage,
    /// Source frame index in presentation order, counted from the first keyframe.
    pub index: u64,
    /// The time the prompt uses, in seconds: `index / src_fps` in the file modes (as
    /// transformers' `VideoMetadata.timestamps` and Moonshot do), the presentation time
    /// in live streams.
    pub timestamp: f64,
    /// Presentation time `pts · time_base`, relative to the first frame, in seconds.
    pub pts_time: f64,
}

/// What the container says about the video stream.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoInfo {
    /// The container (`"MP4"`, `"WebM/Matroska"`, ..., `"auto"` when probed).
    pub container: &'static str,
    /// FFmpeg's decoder name (`h264`, `vp8`, ...).
    pub codec: String,
    /// Declared frame width (0 when the header does not say).
    pub width: u32,
    /// Declared frame height (0 when the header does not say).
    pub height: u32,
    /// Average frame rate (`avg_frame_rate`, else `r_frame_rate`), what PyAV's
    /// `stream.average_rate` gives; `None` when unknown.
    pub src_fps: Option<f64>,
    /// Frame count from the container's index (`nb_frames`, PyAV's `stream.frames`);
    /// 0 when it has none (fragmented MP4, WebM, MPEG-TS, raw streams).
    pub declared_frames: u64,
    /// Declared duration in seconds, when known.
    pub duration: Option<f64>,
}

/// A decoded file or buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedVideo {
    /// The stream description.
    pub info: VideoInfo,
    /// The frame count the sampler used: the declared count, else the counted packets.
    pub total_frames: u64,
    /// The average rate the sampler used (24 when the file carries none, as transformers).
    pub src_fps: f64,
    /// Kept frames, in presentation order.
    pub frames: Vec<VideoFrame>,
    /// Frames the decoder produced: with [`VideoOptions::skip_untaken`], untaken
    /// non-reference frames are not decoded and not counted (1 for a PNG or JPEG).
    pub decoded_frames: u64,
}

/// Limits FFmpeg's log to fatal messages, once per process: failures reach callers as
/// typed errors, so FFmpeg's warnings on hostile input would only flood the log.
pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| ffmpeg_next::util::log::set_level(ffmpeg_next::util::log::Level::Fatal));
}
