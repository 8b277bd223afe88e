//! [`VideoLimits`]: what one video may cost before it is refused.
//!
//! Every limit is checked as early as the information exists: the byte count before
//! opening, the declared frame size and duration from the container header (before a
//! frame is decoded; FFmpeg's own `max_pixels` decoder option is set too, so a frame
//! header that lies about its size is refused before its buffers are allocated), and
//! the decoded frame size, media time, output frame count, keyframe wait and wall time
//! while decoding. Each refusal is a [`MediaError`] variant naming the limit.

use std::time::Duration;

use crate::decode::{DEFAULT_MAX_PIXELS, DEFAULT_MAX_SIDE};
use crate::error::{MediaError, Result};

/// Bounds on one video (a file, a byte buffer or one live stream).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VideoLimits {
    /// Longest accepted frame side in pixels (default 16384, as for images).
    pub max_side: u32,
    /// Most pixels per frame (default 2^26 ≈ 67 MP, as for images; 8K is 33 MP).
    pub max_pixels_per_frame: u64,
    /// Most frames the sampler may return (default 14400: two hours at 2 fps).
    pub max_frames: u64,
    /// Longest media time in seconds, declared or reached (default 7200: two hours).
    pub max_duration: f64,
    /// Most encoded bytes: the file size, the buffer length or the sum of live chunks
    /// (default 4 GiB).
    pub max_bytes: u64,
    /// Most video packets read before the first keyframe (default 600: 20 s at 30 fps);
    /// a stream that never sends one is refused instead of being read forever.
    pub max_packets_without_keyframe: u64,
    /// Most wall time spent demuxing and decoding one file or one live push
    /// (default 10 minutes; `None` for no bound).
    pub max_decode_time: Option<Duration>,
}

impl Default for VideoLimits {
    fn default() -> Self {
        VideoLimits {
            max_side: DEFAULT_MAX_SIDE,
            max_pixels_per_frame: DEFAULT_MAX_PIXELS,
            max_frames: 14_400,
            max_duration: 7200.0,
            max_bytes: 4 << 30,
            max_packets_without_keyframe: 600,
            max_decode_time: Some(Duration::from_secs(600)),
        }
    }
}

impl VideoLimits {
    /// Checks every field; each error names the field and the value found.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, reason: String| Err(MediaError::Config { field, reason });
        if self.max_side == 0 {
            return bad("max_side", "must be at least 1, got 0".into());
        }
        if self.max_pixels_per_frame == 0 || self.max_pixels_per_frame > i32::MAX as u64 {
            return bad(
                "max_pixels_per_frame",
                format!(
                    "must be in 1..={} (FFmpeg's max_pixels is an int), got {}",
                    i32::MAX,
                    self.max_pixels_per_frame
                ),
            );
        }
        if self.max_frames == 0 {
            return bad("max_frames", "must be at least 1, got 0".into());
        }
        if self.max_duration.is_nan() || self.max_duration <= 0.0 {
            return bad(
                "max_duration",
                format!("must be positive, got {}", self.max_duration),
            );
        }
        if self.max_bytes == 0 {
            return bad("max_bytes", "must be at least 1, got 0".into());
        }
        Ok(())
    }

    /// Checks one frame size (declared or decoded).
    pub fn check_frame(&self, width: u32, height: u32) -> Result<()> {
        let pixels = u64::from(width) * u64::from(height);
        if width > self.max_side || height > self.max_side || pixels > self.max_pixels_per_frame {
            return Err(MediaError::VideoFrameTooLarge {
                width,
                height,
                pixels,
                max_side: self.max_side,
                max_pixels: self.max_pixels_per_frame,
            });
        }
        if width == 0 || height == 0 {
            return Err(MediaError::ZeroSize { width, height });
        }
        Ok(())
    }

    /// Checks a media time in seconds (declared duration or a frame's time).
    pub fn check_duration(&self, seconds: f64) -> Result<()> {
        if seconds > self.max_duration {
            return Err(MediaError::VideoTooLong {
                seconds,
                limit: self.max_duration,
            });
        }
        Ok(())
    }

    /// Checks an encoded byte count.
    pub fn check_bytes(&self, bytes: u64) -> Result<()> {
        if bytes > self.max_bytes {
            return Err(MediaError::VideoTooManyBytes {
                bytes,
                limit: self.max_bytes,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_check_names_both_limits() {
        let limits = VideoLimits::default();
        assert!(limits.check_frame(1920, 1080).is_ok());
        let e = limits.check_frame(16383, 16383).unwrap_err();
        assert_eq!(e.kind(), "video_frame_too_large");
        assert!(
            e.to_string().contains("16383x16383 = 268402689 pixels"),
            "{e}"
        );
        assert!(e.to_string().contains("max_pixels_per_frame"), "{e}");
        assert_eq!(
            limits.check_frame(20000, 10).unwrap_err().kind(),
            "video_frame_too_large"
        );
        assert_eq!(
            limits.check_frame(0, 10).unwrap_err().kind(),
            "image_zero_size"
        );
    }

    #[test]
    fn validate_rejects_zero_limits() {
        let limits = VideoLimits {
            max_frames: 0,
            ..VideoLimits::default()
        };
        let e = limits.validate().unwrap_err();
        assert!(e.to_string().contains("`max_frames`"), "{e}");
        assert!(VideoLimits::default().validate().is_ok());
    }
}
