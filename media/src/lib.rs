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
//! - [`resize`]: [`ImageProcessorConfig`] (K2.5, K3 and Kimi-VL presets) and the resize
//!   rules ([`plan_resize`]: target size, padding or crop, grid, token count).
//! - [`resample`]: Pillow-exact bicubic resize.
//! - [`image_proc`]: normalisation and patchify ([`preprocess`],
//!   [`process_image_bytes`]) and the 2×2 patch-merger order ([`merge_order`]).
//! - [`content_key`]: [`content_hash`] (SipHash-2-4, fixed key) and
//!   [`placeholder_keys`] for media spans in the radix cache.
//! - `video` (feature `video`, on by default): FFmpeg decoding of files, buffers and live
//!   chunk streams into sampled RGB frames with timestamps (`video::decode_video_file`,
//!   `video::LiveDecoder`).
//!
//! Temporal chunks of sampled frames (groups of up to four frames per media item, §3.4
//! of the architecture reference) are built from `video`'s frames by the image path.

pub mod content_key;
pub mod decode;
pub mod error;
pub mod image_proc;
pub mod resample;
pub mod resize;
#[cfg(feature = "video")]
pub mod video;

pub use content_key::{
    content_hash, content_hash_keyed, is_media_key, placeholder_keys, MEDIA_KEY_BIT,
};
pub use decode::{decode_image, probe_image, DecodeLimits, ImageInfo};
pub use error::{MediaError, Result};
pub use image_proc::{merge_order, preprocess, process_image_bytes, ImagePatches};
pub use resample::resize_bicubic;
pub use resize::{plan_resize, ImageProcessorConfig, ResizePlan, ResizeRule};
