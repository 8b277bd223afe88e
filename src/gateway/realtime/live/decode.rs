//! The decode job of a live stream: the stream's source (a container decoder,
//! or the selector of a still-image stream) fed the queued appends on tokio's
//! blocking pool, off the session task (STYLE §4). Stills are sniffed (JPEG or
//! PNG, as the session's `format` says), taken by presentation time — their
//! `timestamp_ms` relative to the stream's first, else their arrival — and
//! decoded only when taken, as images under the image limits
//! ([`caracal_media::video::image_frame`]); containers go through
//! [`caracal_media::video::LiveDecoder`], which samples by PTS.

use std::time::Instant;

use caracal_media::video::{image_frame, sniff, LiveDecoder, LiveSelector, Sniffed, VideoOptions};
use caracal_media::{MediaError, RgbImage};

use super::super::video_settings::VideoFormat;

/// Where the open stream's frames come from.
pub(super) enum Source {
    /// One JPEG or PNG per append, taken by its presentation time.
    Still {
        /// Picks frames at `fps`.
        selector: LiveSelector,
        /// The first append's `timestamp_ms` (later ones are relative to it).
        first_ms: Option<f64>,
        /// When the stream's first append arrived (the clock without `timestamp_ms`).
        started: Instant,
        /// Bytes appended so far (checked against `--max-video-bytes`).
        bytes: u64,
    },
    /// An encoded container or elementary stream.
    Container(Box<LiveDecoder>),
}

/// A client append or the end of a stream, in arrival order.
pub(super) enum Op {
    /// The next bytes of the stream (or one still).
    Append {
        /// The bytes.
        bytes: Vec<u8>,
        /// The still's presentation time as the client gave it.
        timestamp_ms: Option<f64>,
        /// When the session received them.
        arrival: Instant,
    },
    /// `input_video_buffer.commit`.
    Commit,
}

/// A decoded frame: RGB, seconds since the stream's zero, arrival.
pub(super) type Decoded = (RgbImage, f64, Instant);

/// The decode job (blocking): feeds `batch` to `source`; returns the source (unless
/// the stream ended or failed), the frames taken, the error and whether the batch
/// ends with a commit (which ends the stream, failed or not).
pub(super) fn decode(
    mut source: Source,
    batch: Vec<Op>,
    format: VideoFormat,
    options: &VideoOptions,
) -> (Option<Source>, Vec<Decoded>, Option<MediaError>, bool) {
    let commit = matches!(batch.last(), Some(Op::Commit));
    let mut frames = Vec::new();
    for op in batch {
        let step = match op {
            Op::Append {
                bytes,
                timestamp_ms,
                arrival,
            } => decode_append(
                &mut source,
                &bytes,
                timestamp_ms,
                arrival,
                format,
                options,
                &mut frames,
            ),
            Op::Commit => {
                let flushed = match &mut source {
                    Source::Container(d) => d.finish().map(|fs| {
                        let now = Instant::now();
                        frames.extend(fs.into_iter().map(|f| (f.image, f.timestamp, now)));
                    }),
                    Source::Still { .. } => Ok(()),
                };
                return (None, frames, flushed.err(), true);
            }
        };
        if let Err(e) = step {
            return (None, frames, Some(e), commit);
        }
    }
    (Some(source), frames, None, false)
}

/// One append through the stream's source.
fn decode_append(
    source: &mut Source,
    bytes: &[u8],
    timestamp_ms: Option<f64>,
    arrival: Instant,
    format: VideoFormat,
    options: &VideoOptions,
    frames: &mut Vec<Decoded>,
) -> Result<(), MediaError> {
    match source {
        Source::Container(d) => {
            for f in d.push(bytes)? {
                frames.push((f.image, f.timestamp, arrival));
            }
            Ok(())
        }
        Source::Still {
            selector,
            first_ms,
            started,
            bytes: total,
        } => {
            let found = sniff(bytes);
            let ok = match format {
                VideoFormat::Jpeg => found == Some(Sniffed::Jpeg),
                VideoFormat::Png => found == Some(Sniffed::Png),
                _ => matches!(found, Some(Sniffed::Jpeg | Sniffed::Png)),
            };
            if !ok {
                return Err(MediaError::VideoFormatMismatch {
                    declared: match format {
                        VideoFormat::Png => "a PNG image",
                        VideoFormat::Jpeg => "a JPEG image",
                        _ => "a still image (this stream began with one)",
                    },
                    found: found.map_or("unknown bytes", Sniffed::name),
                });
            }
            *total += bytes.len() as u64;
            options.limits.check_bytes(*total)?;
            let t = match timestamp_ms {
                Some(at) => (at - *first_ms.get_or_insert(at)) / 1000.0,
                None => arrival.duration_since(*started).as_secs_f64(),
            };
            if selector.keep(t) {
                let f = image_frame(bytes, t, options)?;
                frames.push((f.image, t, arrival));
            }
            Ok(())
        }
    }
}
