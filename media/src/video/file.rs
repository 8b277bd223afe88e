//! Whole videos: a file on disk or a buffer in memory → [`DecodedVideo`].
//!
//! Both go through the same custom-AVIO demuxer ([`crate::video::container`]), so a
//! path and the same bytes in memory decode identically. The file samplers need the
//! frame count before decoding: the container's `nb_frames` when it has one (MP4), as
//! PyAV's `stream.frames` gives transformers; otherwise (fragmented MP4, WebM, MPEG-TS,
//! raw H.264, where transformers' PyAV loader finds 0 frames and refuses the video) a
//! demux-only pass counts the video packets, which costs no decoding. The same pass reads
//! the packets' pts for the `video::skip` plan: packets of untaken frames skip
//! decoding where the decoder allows (non-reference frames), and a file the plan does not
//! fit is decoded again in full. Decoding stops after the last wanted index, as
//! transformers' loader does.
//!
//! PNG and JPEG bytes (sniffed, with [`Container::Auto`]) become one frame through
//! [`crate::decode_image`].

use std::fs::File;
use std::io::{Cursor, Read};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use ffmpeg::format::context::{Input, StreamIo};
use ffmpeg::Packet;
use ffmpeg_next as ffmpeg;

use crate::decode::{decode_image, DecodeLimits};
use crate::error::{MediaError, Result};
use crate::resample::resize_bicubic;
use crate::video::container::{check_declared, open_input, seekable_io, ProbeBudget};
use crate::video::decoder::{
    ff_reason, stream_header, target_size, FrameDecoder, Picker, StreamHeader, DEFAULT_FPS,
};
use crate::video::skip::SkipPlan;
use crate::video::{init, Container, DecodedVideo, Sniffed, VideoFrame, VideoOptions};

/// Bytes read to sniff the format.
const SNIFF_BYTES: usize = 512;

/// FFmpeg's defaults for files: 5 MB and 5 s of probing.
const FILE_BUDGET: ProbeBudget = ProbeBudget {
    bytes: 5_000_000,
    micros: 5_000_000,
    fps_frames: None,
};

/// Where a whole video's bytes come from; opened once per pass.
enum Origin<'a> {
    /// A file on disk.
    Path(&'a Path),
    /// A buffer in memory.
    Bytes(Arc<[u8]>),
}

impl Origin<'_> {
    fn io(&self) -> Result<StreamIo> {
        match self {
            Origin::Path(p) => seekable_io(File::open(p).map_err(|e| io_error(p, e))?),
            Origin::Bytes(b) => seekable_io(Cursor::new(Arc::clone(b))),
        }
    }
}

fn io_error(path: &Path, source: std::io::Error) -> MediaError {
    MediaError::VideoIo {
        path: path.display().to_string(),
        source,
    }
}

/// Decodes and samples the video file at `path` (see the module docs). `container`
/// is the client's declaration ([`Container::Auto`] to trust the bytes).
pub fn decode_video_file(
    path: impl AsRef<Path>,
    container: Container,
    options: &VideoOptions,
) -> Result<DecodedVideo> {
    let path = path.as_ref();
    options.validate()?;
    let mut file = File::open(path).map_err(|e| io_error(path, e))?;
    let len = file.metadata().map_err(|e| io_error(path, e))?.len();
    if len == 0 {
        return Err(MediaError::Empty);
    }
    options.limits.check_bytes(len)?;
    let mut head = Vec::with_capacity(SNIFF_BYTES);
    (&mut file)
        .take(SNIFF_BYTES as u64)
        .read_to_end(&mut head)
        .map_err(|e| io_error(path, e))?;
    let sniffed = check_declared(container, &head)?;
    if matches!(sniffed, Some(Sniffed::Png | Sniffed::Jpeg)) {
        let bytes = std::fs::read(path).map_err(|e| io_error(path, e))?;
        return single_image(&bytes, options);
    }
    decode_whole(Origin::Path(path), container, sniffed, options)
}

/// Decodes and samples a video held in memory (see the module docs). The buffer is
/// shared, not copied, with the demuxer.
pub fn decode_video_bytes(
    bytes: impl Into<Arc<[u8]>>,
    container: Container,
    options: &VideoOptions,
) -> Result<DecodedVideo> {
    let bytes: Arc<[u8]> = bytes.into();
    options.validate()?;
    if bytes.is_empty() {
        return Err(MediaError::Empty);
    }
    options.limits.check_bytes(bytes.len() as u64)?;
    let sniffed = check_declared(container, &bytes[..bytes.len().min(SNIFF_BYTES)])?;
    if matches!(sniffed, Some(Sniffed::Png | Sniffed::Jpeg)) {
        return single_image(&bytes, options);
    }
    decode_whole(Origin::Bytes(bytes), container, sniffed, options)
}

/// One PNG or JPEG as a frame at `timestamp` seconds: decoded by
/// [`crate::decode_image`] under the video frame limits, resized with the Pillow-exact
/// bicubic to the output size (both scale paths; there is no YUV to convert).
pub fn image_frame(bytes: &[u8], timestamp: f64, options: &VideoOptions) -> Result<VideoFrame> {
    let limits = DecodeLimits {
        max_side: options.limits.max_side,
        max_pixels: options.limits.max_pixels_per_frame,
    };
    let rgb = decode_image(bytes, &limits)?;
    let (w, h) = target_size(&options.output, rgb.width(), rgb.height())?;
    let image = if (w, h) == rgb.dimensions() {
        rgb
    } else {
        resize_bicubic(&rgb, w, h)
    };
    Ok(VideoFrame {
        image,
        index: 0,
        timestamp,
        pts_time: timestamp,
    })
}

fn single_image(bytes: &[u8], options: &VideoOptions) -> Result<DecodedVideo> {
    let frame = image_frame(bytes, 0.0, options)?;
    let format = match crate::video::sniff(bytes) {
        Some(Sniffed::Png) => "png",
        _ => "mjpeg",
    };
    let info = crate::video::VideoInfo {
        container: format,
        codec: format.to_string(),
        width: frame.image.width(),
        height: frame.image.height(),
        src_fps: None,
        declared_frames: 1,
        duration: None,
    };
    Ok(DecodedVideo {
        info,
        total_frames: 1,
        src_fps: DEFAULT_FPS,
        frames: vec![frame],
        decoded_frames: 1,
    })
}

/// The demuxer to force: the declaration, else what the magic bytes show.
fn effective(container: Container, sniffed: Option<Sniffed>) -> Container {
    match (container, sniffed) {
        (Container::Auto, Some(Sniffed::Video(c))) => c,
        (c, _) => c,
    }
}

fn decode_whole(
    origin: Origin<'_>,
    container: Container,
    sniffed: Option<Sniffed>,
    options: &VideoOptions,
) -> Result<DecodedVideo> {
    init();
    let started = Instant::now();
    let container = effective(container, sniffed);
    let mut input = open_input(origin.io()?, container, FILE_BUDGET)?;
    let header = stream_header(&input, container.name(), options)?;
    let src_fps = header.info.src_fps.unwrap_or(DEFAULT_FPS);
    let declared = header.info.declared_frames;
    let planned = options.skip_untaken && options.strict;
    // One demux-only pass: the frame count where the container declares none, and the
    // packets' pts for the skip plan. Where the count is declared, a failed pass only
    // means no plan (the decoding pass reports what is wrong with the file).
    let scan = if declared == 0 {
        let mut scanning = open_input(origin.io()?, container, FILE_BUDGET)?;
        Some(scan_packets(&mut scanning, header.index, options, started)?)
    } else if planned {
        open_input(origin.io()?, container, FILE_BUDGET)
            .and_then(|mut scanning| scan_packets(&mut scanning, header.index, options, started))
            .ok()
    } else {
        None
    };
    let total = match (&scan, declared) {
        (_, 0) => scan.as_ref().map_or(0, |s| s.count),
        _ => declared,
    };
    let wanted = options.sampling.indices(total, src_fps, options.fps);
    if wanted.len() as u64 > options.limits.max_frames {
        return Err(MediaError::VideoTooManyFrames {
            limit: options.limits.max_frames,
        });
    }
    let plan = scan
        .filter(|_| planned)
        .and_then(|s| SkipPlan::new(&s.pts, total, &wanted));
    if let Some(plan) = plan {
        let mut picker = Picker::Indices {
            wanted: wanted.clone(),
            next: 0,
            src_fps,
        };
        let mut decoder = FrameDecoder::new(&header, options, false)?.with_skip_plan(plan);
        let done = decode_packets(&mut input, &header, &mut decoder, &mut picker, started);
        match done {
            Ok(frames) if picker.exhausted() && !decoder.plan_broken => {
                return Ok(DecodedVideo {
                    info: header.info,
                    total_frames: total,
                    src_fps,
                    frames,
                    decoded_frames: decoder.produced,
                })
            }
            // The plan did not fit, or the file failed: decoding every frame gives the
            // answer (or the error) the file has without the plan.
            _ => input = open_input(origin.io()?, container, FILE_BUDGET)?,
        }
    }
    let mut picker = Picker::Indices {
        wanted,
        next: 0,
        src_fps,
    };
    let mut decoder = FrameDecoder::new(&header, options, false)?;
    let frames = decode_packets(&mut input, &header, &mut decoder, &mut picker, started)?;
    if decoder.decoded == 0 {
        return Err(MediaError::VideoNoFrames {
            packets: decoder.packets,
        });
    }
    if options.strict && !picker.exhausted() && declared > 0 && decoder.decoded < declared {
        return Err(MediaError::VideoTruncated {
            declared,
            decoded: decoder.decoded,
        });
    }
    Ok(DecodedVideo {
        info: header.info,
        total_frames: total,
        src_fps,
        frames,
        decoded_frames: decoder.produced,
    })
}

/// Feeds the video packets of `input` to `decoder` until `picker` has every frame it
/// wants or the stream ends (then the decoder is flushed); returns the kept frames.
fn decode_packets(
    input: &mut Input,
    header: &StreamHeader,
    decoder: &mut FrameDecoder,
    picker: &mut Picker,
    started: Instant,
) -> Result<Vec<VideoFrame>> {
    let declared = header.info.declared_frames;
    let strict = decoder.strict();
    let mut frames = Vec::new();
    let mut packet = Packet::empty();
    loop {
        match packet.read(input) {
            Ok(()) if packet.stream() == header.index => {
                match decoder.send(&packet, picker, &mut frames, started) {
                    Ok(()) => {}
                    // A bitstream error on the last packet of a file whose index promises
                    // more frames is a cut file, not a corrupt one.
                    Err(MediaError::VideoDecode { .. })
                        if declared > decoder.decoded && at_end(input) =>
                    {
                        return Err(MediaError::VideoTruncated {
                            declared,
                            decoded: decoder.decoded,
                        });
                    }
                    Err(e) => return Err(e),
                }
                if picker.exhausted() {
                    break;
                }
            }
            Ok(()) => {}
            Err(ffmpeg::Error::Eof) => break,
            Err(ffmpeg::Error::InvalidData) if !strict => {}
            Err(e) => {
                return Err(MediaError::VideoDemux {
                    reason: ff_reason(&e),
                })
            }
        }
    }
    if !picker.exhausted() {
        decoder.finish(picker, &mut frames)?;
    }
    Ok(frames)
}

/// Whether the demuxer has nothing after the current packet.
fn at_end(input: &mut Input) -> bool {
    matches!(Packet::empty().read(input), Err(ffmpeg::Error::Eof))
}

/// What a demux-only pass finds out about the video stream.
struct Scan {
    /// Video packets.
    count: u64,
    /// Their pts in decode order, from the first keyframe on (packets before it are
    /// never decoded).
    pts: Vec<Option<i64>>,
}

/// Counts the video packets of stream `index` and reads their pts, without decoding.
fn scan_packets(
    input: &mut Input,
    index: usize,
    options: &VideoOptions,
    started: Instant,
) -> Result<Scan> {
    let mut packet = Packet::empty();
    let mut scan = Scan {
        count: 0,
        pts: Vec::new(),
    };
    loop {
        match packet.read(input) {
            Ok(()) if packet.stream() == index => {
                scan.count += 1;
                if !scan.pts.is_empty() || packet.is_key() {
                    scan.pts.push(packet.pts());
                }
            }
            Ok(()) => {}
            Err(ffmpeg::Error::Eof) => return Ok(scan),
            Err(ffmpeg::Error::InvalidData) if !options.strict => {}
            Err(e) => {
                return Err(MediaError::VideoDemux {
                    reason: ff_reason(&e),
                })
            }
        }
        if let Some(limit) = options.limits.max_decode_time {
            if started.elapsed() > limit {
                return Err(MediaError::VideoDecodeTimeout {
                    limit_ms: limit.as_millis() as u64,
                });
            }
        }
    }
}
