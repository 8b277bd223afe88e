//! Errors raised while decoding and preprocessing media.
//!
//! Every variant names what was wrong and, where a limit was hit, the limit itself, so
//! that the gateway can forward the message to the client unchanged
//! ("image is 40000x30000 pixels; the limit is 16384 per side"). [`MediaError::kind`]
//! gives a stable, machine-readable type string for API error bodies.

/// Everything that can go wrong between encoded media bytes and vision-tower patches.
#[derive(Debug, thiserror::Error)]
pub enum MediaError {
    /// The input held no bytes at all.
    #[error("media is empty (0 bytes)")]
    Empty,

    /// The leading bytes match no image format we know.
    #[error("unrecognised image format (first bytes: {magic}); supported formats: PNG, JPEG")]
    UnknownFormat {
        /// Up to the first 8 bytes, as hex, to help the client see what it sent.
        magic: String,
    },

    /// A known image format that this build cannot decode (for example GIF or WebP).
    #[error("unsupported image format {format}; supported formats: PNG, JPEG")]
    UnsupportedFormat {
        /// The format's name as the `image` crate spells it (`Gif`, `WebP`, ...).
        format: String,
    },

    /// The header declares a side longer than the decode limit.
    #[error("image is {width}x{height} pixels; the limit is {limit} per side")]
    TooLarge {
        /// Declared width in pixels.
        width: u32,
        /// Declared height in pixels.
        height: u32,
        /// The per-side limit that was exceeded.
        limit: u32,
    },

    /// The header declares more pixels in total than the decode limit.
    #[error("image is {width}x{height} = {pixels} pixels; the limit is {limit} pixels")]
    TooManyPixels {
        /// Declared width in pixels.
        width: u32,
        /// Declared height in pixels.
        height: u32,
        /// `width * height`.
        pixels: u64,
        /// The total-pixel limit that was exceeded.
        limit: u64,
    },

    /// The image has no pixels (a zero width or height).
    #[error("image has zero size ({width}x{height} pixels)")]
    ZeroSize {
        /// Width in pixels.
        width: u32,
        /// Height in pixels.
        height: u32,
    },

    /// The image is too small to yield one merged patch cell (center-crop mode only).
    #[error(
        "image of {width}x{height} pixels is smaller than one {cell}x{cell} cell after center crop"
    )]
    TooSmall {
        /// Width in pixels after the token-limit resize.
        width: u32,
        /// Height in pixels after the token-limit resize.
        height: u32,
        /// `patch_size * merge_kernel_size`, the crop quantum.
        cell: u32,
    },

    /// The patch grid exceeds what the vision tower's position embedding covers.
    #[error(
        "image grid is {grid_h}x{grid_w} patches; the vision tower allows at most {limit} per side"
    )]
    GridTooLarge {
        /// Patch rows.
        grid_h: usize,
        /// Patch columns.
        grid_w: usize,
        /// The largest allowed number of patches on one side.
        limit: usize,
    },

    /// The bytes looked like a supported format but could not be decoded.
    #[error("could not decode {format} image: {source}")]
    Decode {
        /// The format that was tried.
        format: String,
        /// What the decoder reported.
        #[source]
        source: image::ImageError,
    },

    /// The decoder refused to allocate more memory than the configured limit.
    #[error("image decoder limit exceeded: {0}")]
    DecoderLimit(String),

    /// A set of video frames that cannot form chunks (none, mismatched sizes, bad times).
    #[error("invalid video frames: {reason}")]
    InvalidFrames {
        /// What is wrong, with the values found.
        reason: String,
    },

    /// The image processor configuration is invalid.
    #[error("invalid image processor config: `{field}` {reason}")]
    Config {
        /// The offending field.
        field: &'static str,
        /// Why it is invalid, with the value found.
        reason: String,
    },
}

impl MediaError {
    /// A stable, machine-readable type string for client error bodies
    /// (for example `"image_too_large"`); it never changes with the message wording.
    pub fn kind(&self) -> &'static str {
        match self {
            MediaError::Empty => "media_empty",
            MediaError::UnknownFormat { .. } => "image_unknown_format",
            MediaError::UnsupportedFormat { .. } => "image_unsupported_format",
            MediaError::TooLarge { .. } => "image_too_large",
            MediaError::TooManyPixels { .. } => "image_too_many_pixels",
            MediaError::ZeroSize { .. } => "image_zero_size",
            MediaError::TooSmall { .. } => "image_too_small",
            MediaError::GridTooLarge { .. } => "image_grid_too_large",
            MediaError::Decode { .. } => "image_decode_failed",
            MediaError::DecoderLimit(_) => "image_decoder_limit",
            MediaError::InvalidFrames { .. } => "video_frames_invalid",
            MediaError::Config { .. } => "media_config_invalid",
        }
    }
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, MediaError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_large_message_names_size_and_limit() {
        let e = MediaError::TooLarge {
            width: 40000,
            height: 30000,
            limit: 16384,
        };
        assert_eq!(
            e.to_string(),
            "image is 40000x30000 pixels; the limit is 16384 per side"
        );
        assert_eq!(e.kind(), "image_too_large");
    }

    #[test]
    fn too_many_pixels_message_names_total_and_limit() {
        let e = MediaError::TooManyPixels {
            width: 10000,
            height: 9000,
            pixels: 90_000_000,
            limit: 67_108_864,
        };
        assert_eq!(
            e.to_string(),
            "image is 10000x9000 = 90000000 pixels; the limit is 67108864 pixels"
        );
    }
}
