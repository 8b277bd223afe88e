//! caracal-media: encoded media → vision-tower inputs for Kimi's MoonViT towers.
//!
//! This crate turns the bytes a client sends (a PNG or JPEG today; video frames later)
//! into exactly the tensors the model's Python processor would build, and into the keys
//! under which session memory caches the resulting KV. It is pure computation: no actors,
//! no threads, no I/O beyond the byte slices it is given. The vision actor calls it on
//! its own thread pool (STYLE §4), so the socket side never waits on a resize.
//!
//! Pipeline for one image:
//!
//! ```text
//! bytes ──probe_image──▶ ImageInfo (format, size; limits checked, nothing decoded)
//!       ──decode_image─▶ RgbImage ──preprocess──▶ ImagePatches { pixel_values [N,3,14,14],
//!                                                                grid_thw, num_tokens }
//! bytes ──content_hash─▶ u64 ──placeholder_keys(hash, num_tokens)──▶ radix key span
//! ```
//!
//! # Modules
//! - [`error`]: [`MediaError`] (every variant names the limit it hit) and [`Result`].
//! - [`decode`]: format detection, header-first size checks ([`DecodeLimits`]), decoding
//!   to 8-bit RGB like Pillow's `convert("RGB")`.
//! - [`resize`]: [`ImageProcessorConfig`] (K2.5, K3 and Kimi-VL presets; which
//!   reference's arithmetic, [`Backend`]) and the resize rules ([`plan_resize`]: target
//!   size, padding or crop, grid, token count). [`ImageProcessorConfig::with_kwargs`]
//!   applies `--mm-processor-kwargs`-style JSON options (module `kwargs`).
//! - [`resample`]: bicubic resizes exact to Pillow and to PyTorch's uint8 antialiased
//!   kernel (what transformers' torchvision backend runs).
//! - [`image_proc`]: normalisation and patchify ([`preprocess`],
//!   [`process_image_bytes`]) and the 2×2 patch-merger order ([`merge_order`]).
//! - [`content_key`]: [`content_hash`] (SipHash-2-4, fixed key) and
//!   [`placeholder_keys`] for media spans in the radix cache.
//! - `video` (feature `video`, on by default): FFmpeg decoding of files, buffers and live
//!   chunk streams into sampled RGB frames with timestamps (`video::decode_video_file`,
//!   `video::LiveDecoder`).
//! - [`frames`]: decoded video frames → temporal chunks of `temporal_patch_size` frames
//!   ([`chunk_frames`], [`VideoChunk`]) and the chunk prompt with its `HH:MM:SS.mmm`
//!   timestamp ([`chunk_prompt`]), as transformers' `Kimi_K25VideoProcessor` builds them.
//!
//! Exactness is checked against transformers 5.23's Kimi K2.5 image and video
//! processors on real images and clip frames made with the `ffmpeg` CLI
//! (`media/tests/fixtures`, written by `tools/make_media_fixtures.py`; `media/tests/`).

pub mod content_key;
pub mod decode;
pub mod error;
pub mod frames;
pub mod image_proc;
mod kwargs;
pub mod resample;
pub mod resize;
pub mod timestamp;
#[cfg(feature = "video")]
pub mod video;

pub use content_key::{
    content_hash, content_hash_keyed, is_media_key, placeholder_keys, MEDIA_KEY_BIT,
};
pub use decode::{decode_image, probe_image, DecodeLimits, ImageInfo};
pub use error::{MediaError, Result};
pub use frames::{chunk_frames, chunk_prompt, format_timestamp, frames_hash, VideoChunk};
/// The decoded-frame type of [`chunk_frames`] (the `image` crate's, re-exported so that
/// callers need no direct dependency on it).
pub use image::{Rgb, RgbImage};
pub use image_proc::{merge_order, preprocess, process_image_bytes, ImagePatches};
pub use kwargs::ACCEPTED_KWARGS;
pub use resample::{resize_bicubic, resize_bicubic_with, Bicubic};
pub use resize::{plan_resize, Backend, ImageProcessorConfig, ResizePlan, ResizeRule};
