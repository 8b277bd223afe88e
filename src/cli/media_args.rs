//! Media flags of `caracal serve` (as vLLM spells them where it has them):
//! `--allowed-media-dir`, `--limit-mm-per-prompt`, `--max-image-bytes`,
//! `--max-image-pixels`, `--mm-processor-kwargs`, `--mm-cache-bytes`, and
//! for video `--max-video-bytes`, `--max-video-frames`, `--max-video-seconds`,
//! `--max-waiting-videos`.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use caracal::gateway::media::MediaConfig;
use clap::Args;
use serde_json::Value;

use super::engine_args::parse_bytes;

/// How images and videos reach the model.
#[derive(Args, Debug, Clone)]
pub struct MediaArgs {
    /// Folder that `file://` image URLs may point into (symlinks resolved;
    /// anything outside is refused). Without it, only data: URLs are taken.
    #[arg(long, alias = "allowed-local-media-path")]
    pub allowed_media_dir: Option<PathBuf>,
    /// Media items per request, e.g. `{"image": 16, "video": 4}`.
    #[arg(long)]
    pub limit_mm_per_prompt: Option<String>,
    /// Largest encoded image, e.g. 20MiB.
    #[arg(long, default_value = "20MiB", value_parser = parse_bytes)]
    pub max_image_bytes: usize,
    /// Most pixels in one decoded image (width × height).
    #[arg(long, default_value_t = 64 << 20)]
    pub max_image_pixels: u64,
    /// Largest encoded video, e.g. 256MiB.
    #[arg(long, default_value = "256MiB", value_parser = parse_bytes)]
    pub max_video_bytes: usize,
    /// Most frames sampled from one video (at its fps, default 2).
    #[arg(long, default_value_t = 14_400)]
    pub max_video_frames: u64,
    /// Longest video in seconds of media time.
    #[arg(long, default_value_t = 7200.0)]
    pub max_video_seconds: f64,
    /// Videos that may wait for a decode slot (one per Ingest thread);
    /// further ones are refused with 503 `overloaded` and `Retry-After`.
    #[arg(long, default_value_t = 16)]
    pub max_waiting_videos: usize,
    /// Image-processor options as JSON, e.g. `{"max_patches": 256}`.
    #[arg(long)]
    pub mm_processor_kwargs: Option<String>,
    /// Bytes of vision-tower output kept for repeated images, e.g. 512MiB (0 turns it off).
    #[arg(long, default_value = "512MiB", value_parser = parse_bytes)]
    pub mm_cache_bytes: usize,
}

impl MediaArgs {
    /// The gateway's media settings for a model of `model_type`.
    pub fn config(&self, model_type: &str) -> Result<MediaConfig> {
        let mut c = MediaConfig::for_model_type(model_type);
        if let Some(text) = &self.mm_processor_kwargs {
            let v: Value = serde_json::from_str(text)
                .map_err(|e| anyhow!("--mm-processor-kwargs: not JSON: {e}"))?;
            c.processor = c
                .processor
                .with_kwargs(&v)
                .context("--mm-processor-kwargs")?;
        }
        if let Some(text) = &self.limit_mm_per_prompt {
            let v: Value = serde_json::from_str(text)
                .map_err(|e| anyhow!("--limit-mm-per-prompt: not JSON: {e}"))?;
            let o = v
                .as_object()
                .ok_or_else(|| anyhow!("--limit-mm-per-prompt must be a JSON object"))?;
            for (k, n) in o {
                let n = n.as_u64().ok_or_else(|| {
                    anyhow!("--limit-mm-per-prompt: `{k}` must be a non-negative integer")
                })?;
                match k.as_str() {
                    "image" => c.max_images = n as usize,
                    "video" => c.max_videos = n as usize,
                    other => {
                        bail!("--limit-mm-per-prompt: unknown modality `{other}` (known: image, video)")
                    }
                }
            }
        }
        if let Some(dir) = &self.allowed_media_dir {
            if !dir.is_dir() {
                bail!("--allowed-media-dir {} is not a folder", dir.display());
            }
        }
        c.allowed_dir = self.allowed_media_dir.clone();
        c.max_image_bytes = self.max_image_bytes;
        c.decode.max_pixels = self.max_image_pixels;
        c.encoder.cache_bytes = self.mm_cache_bytes;
        if self.max_video_frames == 0 {
            bail!("--max-video-frames must be at least 1");
        }
        if self.max_video_seconds.is_nan() || self.max_video_seconds <= 0.0 {
            bail!(
                "--max-video-seconds must be positive, got {}",
                self.max_video_seconds
            );
        }
        c.max_video_bytes = self.max_video_bytes;
        c.max_waiting_videos = self.max_waiting_videos;
        c.video.max_bytes = self.max_video_bytes as u64;
        c.video.max_frames = self.max_video_frames;
        c.video.max_duration = self.max_video_seconds;
        c.video.max_pixels_per_frame = self.max_image_pixels.clamp(1, i32::MAX as u64);
        Ok(c)
    }
}
