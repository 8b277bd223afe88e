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

    /// A video file could not be read from disk.
    #[error("could not read video file {path}: {source}")]
    VideoIo {
        /// The path that was given.
        path: String,
        /// What the operating system reported.
        #[source]
        source: std::io::Error,
    },

    /// The bytes are not the container the client declared (for example PNG bytes sent
    /// as `video/mp4`, or MP4 sent as WebM).
    #[error("media was declared as {declared} but its bytes are {found}")]
    VideoFormatMismatch {
        /// The container the client declared.
        declared: &'static str,
        /// What the leading bytes show.
        found: &'static str,
    },

    /// The demuxer could not open the container (not a video, corrupt or cut header).
    #[error("could not open video container ({container}): {reason}")]
    VideoOpen {
        /// The container that was tried (`auto` when probed).
        container: &'static str,
        /// What FFmpeg reported.
        reason: String,
    },

    /// The container holds no video stream.
    #[error("media has no video stream")]
    VideoNoStream,

    /// This build has no decoder for the stream's codec.
    #[error("unsupported video codec {codec}")]
    VideoUnsupportedCodec {
        /// FFmpeg's codec name.
        codec: String,
    },

    /// Reading packets failed in the middle of the stream.
    #[error("could not read video packets: {reason}")]
    VideoDemux {
        /// What FFmpeg reported.
        reason: String,
    },

    /// The decoder rejected the bitstream (corrupt data).
    #[error("could not decode video frame: {reason}")]
    VideoDecode {
        /// What FFmpeg reported.
        reason: String,
    },

    /// The container promised more frames than the data holds (a cut file).
    #[error("video is truncated: the container declares {declared} frames, {decoded} decoded")]
    VideoTruncated {
        /// Frames the container's index declares.
        declared: u64,
        /// Frames the decoder produced before the data ended.
        decoded: u64,
    },

    /// Nothing decodable: the stream ended before its first frame.
    #[error("video yielded no frames ({packets} packets read)")]
    VideoNoFrames {
        /// Video packets the demuxer delivered.
        packets: u64,
    },

    /// Frame dimensions over [`crate::video::VideoLimits`] (declared or decoded); a
    /// "decompression bomb" stops here before any frame of that size is allocated.
    #[error(
        "video frames are {width}x{height} = {pixels} pixels; the limits are {max_side} per side and {max_pixels} pixels (max_side, max_pixels_per_frame)"
    )]
    VideoFrameTooLarge {
        /// Frame width in pixels.
        width: u32,
        /// Frame height in pixels.
        height: u32,
        /// `width * height`.
        pixels: u64,
        /// The per-side limit.
        max_side: u32,
        /// The per-frame pixel limit.
        max_pixels: u64,
    },

    /// The decoder met a frame header whose size FFmpeg's `max_pixels` (set from
    /// `max_pixels_per_frame`) refused before allocating it: a decompression bomb whose
    /// container declared a small size.
    #[error(
        "video bitstream declares a frame over {max_pixels} pixels (max_pixels_per_frame); refused before decoding it"
    )]
    VideoFrameSizeRefused {
        /// The per-frame pixel limit.
        max_pixels: u64,
    },

    /// More sampled frames than `max_frames`.
    #[error("video yields more than {limit} sampled frames (max_frames)")]
    VideoTooManyFrames {
        /// The frame limit.
        limit: u64,
    },

    /// Media time past `max_duration`.
    #[error("video lasts {seconds:.3} s or more; the limit is {limit:.3} s (max_duration)")]
    VideoTooLong {
        /// The duration found (declared or reached while decoding), in seconds.
        seconds: f64,
        /// The limit in seconds.
        limit: f64,
    },

    /// More encoded bytes than `max_bytes`.
    #[error("video is {bytes} bytes or more; the limit is {limit} bytes (max_bytes)")]
    VideoTooManyBytes {
        /// Bytes received (or the file size).
        bytes: u64,
        /// The limit in bytes.
        limit: u64,
    },

    /// Decoding took longer than `max_decode_time`.
    #[error("video decoding took more than {limit_ms} ms (max_decode_time)")]
    VideoDecodeTimeout {
        /// The limit in milliseconds.
        limit_ms: u64,
    },

    /// The stream sent `limit` packets without a keyframe, so nothing can be decoded.
    #[error(
        "video stream sent {packets} packets without a keyframe; the limit is {limit} (max_packets_without_keyframe)"
    )]
    VideoNoKeyframe {
        /// Packets seen so far without a keyframe.
        packets: u64,
        /// The limit.
        limit: u64,
    },

    /// A live decoder was used after it finished or failed.
    #[error("live video stream is closed")]
    VideoClosed,

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
            MediaError::VideoIo { .. } => "video_io",
            MediaError::VideoFormatMismatch { .. } => "video_format_mismatch",
            MediaError::VideoOpen { .. } => "video_open_failed",
            MediaError::VideoNoStream => "video_no_stream",
            MediaError::VideoUnsupportedCodec { .. } => "video_unsupported_codec",
            MediaError::VideoDemux { .. } => "video_demux_failed",
            MediaError::VideoDecode { .. } => "video_decode_failed",
            MediaError::VideoTruncated { .. } => "video_truncated",
            MediaError::VideoNoFrames { .. } => "video_no_frames",
            MediaError::VideoFrameTooLarge { .. } => "video_frame_too_large",
            MediaError::VideoFrameSizeRefused { .. } => "video_frame_too_large",
            MediaError::VideoTooManyFrames { .. } => "video_too_many_frames",
            MediaError::VideoTooLong { .. } => "video_too_long",
            MediaError::VideoTooManyBytes { .. } => "video_too_many_bytes",
            MediaError::VideoDecodeTimeout { .. } => "video_decode_timeout",
            MediaError::VideoNoKeyframe { .. } => "video_no_keyframe",
            MediaError::VideoClosed => "video_closed",
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
