//! The decode loop shared by files and live streams: packets in, kept RGB frames out.
//!
//! [`FrameDecoder`] owns one FFmpeg video decoder and applies, per packet and per frame,
//! the keyframe gate, the limits and the [`Picker`]; only kept frames are converted
//! ([`crate::video::convert`]). Frame indices count frames in presentation order as the
//! decoder emits them (what PyAV's `container.decode(video=0)` enumerates, which the
//! transformers sampler indexes), starting at the first keyframe. With a
//! [`SkipPlan`] (files) packets of untaken frames go to the decoder with
//! `skip_frame = nonref`, and a frame's index is the rank of its `pts` instead
//! ([`crate::video::skip`]).

use std::time::Instant;

use ffmpeg::codec::{self, Parameters};
use ffmpeg::format::context::Input;
use ffmpeg::media::Type;
use ffmpeg::util::frame::Video as AvFrame;
use ffmpeg::{Dictionary, Discard, Packet, Rational};
use ffmpeg_next as ffmpeg;

use crate::error::{MediaError, Result};
use crate::resize::plan_resize;
use crate::video::convert::Converter;
use crate::video::sample::LiveSelector;
use crate::video::skip::SkipPlan;
use crate::video::{OutputSize, VideoFrame, VideoInfo, VideoOptions};

/// What the demuxer says about the video stream, read before any packet.
pub(crate) struct StreamHeader {
    /// Index of the video stream in the container.
    pub index: usize,
    /// Codec parameters for the decoder.
    pub params: Parameters,
    /// The stream's time base (`pts` unit).
    pub time_base: Rational,
    /// Stream description handed to callers.
    pub info: VideoInfo,
}

// SAFETY: `Parameters` is `Send` in ffmpeg-next; the rest are plain values. Spelled out
// because the live decoder moves headers from its demux thread.
unsafe impl Send for StreamHeader {}

/// FFmpeg's message for an error, or its code when the message is empty.
pub(crate) fn ff_reason(e: &ffmpeg::Error) -> String {
    let text = e.to_string();
    if text.is_empty() {
        format!("{e:?}")
    } else {
        text
    }
}

/// A rational as `f64`, `None` when it is zero or undefined.
fn ratio(r: Rational) -> Option<f64> {
    (r.numerator() > 0 && r.denominator() > 0)
        .then(|| f64::from(r.numerator()) / f64::from(r.denominator()))
}

/// Finds the best video stream of `input` and checks what its header declares.
pub(crate) fn stream_header(
    input: &Input,
    container: &'static str,
    options: &VideoOptions,
) -> Result<StreamHeader> {
    let stream = input
        .streams()
        .best(Type::Video)
        .ok_or(MediaError::VideoNoStream)?;
    let params = stream.parameters();
    // SAFETY: `params` wraps the stream's live AVCodecParameters; only read here.
    let (width, height) = unsafe {
        let p = params.as_ptr();
        ((*p).width.max(0) as u32, (*p).height.max(0) as u32)
    };
    let codec = params.id();
    let codec_name = codec::decoder::find(codec)
        .map(|c| c.name().to_string())
        .unwrap_or_else(|| format!("{codec:?}"));
    let src_fps = ratio(stream.avg_frame_rate()).or_else(|| ratio(stream.rate()));
    let time_base = stream.time_base();
    let stream_duration = (stream.duration() > 0)
        .then(|| ratio(time_base).map(|tb| stream.duration() as f64 * tb))
        .flatten();
    let container_duration = (input.duration() > 0)
        .then(|| input.duration() as f64 / f64::from(ffmpeg::ffi::AV_TIME_BASE));
    let info = VideoInfo {
        container,
        codec: codec_name,
        width,
        height,
        src_fps,
        declared_frames: u64::try_from(stream.frames()).unwrap_or(0),
        duration: stream_duration.or(container_duration),
    };
    // Declared sizes are checked before any frame is decoded (a tiny file claiming huge
    // frames stops here); 0×0 means "not known yet" (raw streams), checked per frame.
    if width > 0 && height > 0 {
        options.limits.check_frame(width, height)?;
    }
    if let Some(d) = info.duration {
        options.limits.check_duration(d)?;
    }
    Ok(StreamHeader {
        index: stream.index(),
        params,
        time_base,
        info,
    })
}

/// Decides which decoded frames are kept, and their timestamps.
pub(crate) enum Picker {
    /// File modes: a sorted list of wanted source indices.
    Indices {
        /// Wanted indices, ascending.
        wanted: Vec<u64>,
        /// Position of the next wanted index.
        next: usize,
        /// Average source rate: timestamps are `index / src_fps`.
        src_fps: f64,
    },
    /// Live streams: by presentation time.
    Live(LiveSelector),
}

impl Picker {
    /// The prompt timestamp of frame `index` at presentation time `t`, if it is kept.
    fn pick(&mut self, index: u64, t: f64) -> Option<f64> {
        match self {
            Picker::Indices {
                wanted,
                next,
                src_fps,
            } => {
                if wanted.get(*next) == Some(&index) {
                    *next += 1;
                    Some(index as f64 / *src_fps)
                } else {
                    None
                }
            }
            Picker::Live(sel) => sel.keep(t).then_some(t),
        }
    }

    /// Whether no later frame can be kept (file modes past their last index).
    pub(crate) fn exhausted(&self) -> bool {
        match self {
            Picker::Indices { wanted, next, .. } => *next >= wanted.len(),
            Picker::Live(_) => false,
        }
    }
}

/// One video decoder with the keyframe gate, limits and conversion of kept frames.
pub(crate) struct FrameDecoder {
    /// The opened FFmpeg decoder.
    decoder: codec::decoder::Video,
    /// Options (limits, output size, path, strictness).
    options: VideoOptions,
    /// Seconds per `pts` unit.
    time_base: f64,
    /// Fallback rate for frames without a timestamp.
    src_fps: f64,
    /// Cached scaler for kept frames.
    converter: Option<Converter>,
    /// Whether a keyframe packet has been seen (packets before it are dropped).
    keyframe_seen: bool,
    /// Video packets received.
    pub(crate) packets: u64,
    /// The next frame's index (frames the decoder emitted, when none are skipped).
    pub(crate) decoded: u64,
    /// Frames the decoder emitted.
    pub(crate) produced: u64,
    /// Frames kept.
    kept: u64,
    /// Timestamp of the first frame: times are relative to it.
    first_ts: Option<i64>,
    /// Reused decoder output frame.
    frame: AvFrame,
    /// Whether the codec context started with a known frame size.
    sized: bool,
    /// Files: which packets may skip decoding, and the frames' indices.
    skip: Option<SkipPlan>,
    /// Whether a decoded frame did not fit `skip` (the decode is then redone without).
    pub(crate) plan_broken: bool,
}

// SAFETY: every FFmpeg object here is used only through `&mut FrameDecoder`.
unsafe impl Send for FrameDecoder {}

impl FrameDecoder {
    /// Opens a decoder for `header`'s stream. `live` picks slice threading (no added
    /// delay) over frame threading.
    pub(crate) fn new(header: &StreamHeader, options: &VideoOptions, live: bool) -> Result<Self> {
        let codec_id = header.params.id();
        let codec =
            codec::decoder::find(codec_id).ok_or_else(|| MediaError::VideoUnsupportedCodec {
                codec: header.info.codec.clone(),
            })?;
        let fail = |e: ffmpeg::Error| MediaError::VideoDecode {
            reason: format!(
                "could not open the {} decoder: {}",
                header.info.codec,
                ff_reason(&e)
            ),
        };
        let mut ctx = codec::Context::from_parameters(header.params.clone()).map_err(fail)?;
        // SAFETY: `ctx` is a fresh, unopened codec context; `pkt_timebase` is a plain field.
        unsafe {
            (*ctx.as_mut_ptr()).pkt_timebase = header.time_base.into();
        }
        let mut dict = Dictionary::new();
        // FFmpeg refuses frames over this before allocating them (second line behind the
        // header check, for bitstreams whose frame headers lie about their size).
        dict.set(
            "max_pixels",
            &options.limits.max_pixels_per_frame.to_string(),
        );
        dict.set("threads", &options.threads.to_string());
        dict.set("thread_type", if live { "slice" } else { "frame+slice" });
        if options.strict {
            // Bitstream errors fail the decode instead of being concealed.
            dict.set("err_detect", "explode");
        }
        let decoder = ctx
            .decoder()
            .open_as_with(codec, dict)
            .and_then(|d| d.video())
            .map_err(fail)?;
        Ok(FrameDecoder {
            decoder,
            options: options.clone(),
            time_base: ratio(header.time_base).unwrap_or(1.0 / 90_000.0),
            src_fps: header.info.src_fps.unwrap_or(DEFAULT_FPS),
            converter: None,
            keyframe_seen: false,
            packets: 0,
            decoded: 0,
            produced: 0,
            kept: 0,
            first_ts: None,
            frame: AvFrame::empty(),
            sized: header.info.width > 0 && header.info.height > 0,
            skip: None,
            plan_broken: false,
        })
    }

    /// Whether bitstream errors fail the decode (`VideoOptions::strict`).
    pub(crate) fn strict(&self) -> bool {
        self.options.strict
    }

    /// Decodes with `plan`: packets of untaken frames skip decoding where they can.
    pub(crate) fn with_skip_plan(mut self, plan: SkipPlan) -> Self {
        self.skip = Some(plan);
        self
    }

    /// Feeds one packet of the video stream; kept frames are appended to `out`.
    pub(crate) fn send(
        &mut self,
        packet: &Packet,
        picker: &mut Picker,
        out: &mut Vec<VideoFrame>,
        started: Instant,
    ) -> Result<()> {
        self.check_time(started)?;
        self.packets += 1;
        if !self.keyframe_seen {
            if !packet.is_key() {
                let limit = self.options.limits.max_packets_without_keyframe;
                if self.packets > limit {
                    return Err(MediaError::VideoNoKeyframe {
                        packets: self.packets,
                        limit,
                    });
                }
                return Ok(());
            }
            self.keyframe_seen = true;
        }
        if let Some(plan) = &self.skip {
            // Read by the decoder when it takes this packet (send_packet decodes it, or,
            // with frame threads, copies the setting to the thread that will).
            self.decoder.skip_frame(if plan.may_skip(packet.pts()) {
                Discard::NonReference
            } else {
                Discard::Default
            });
        }
        if let Err(e) = self.decoder.send_packet(packet) {
            if let Some(refused) = self.size_refused() {
                return Err(refused);
            }
            if self.options.strict {
                return Err(MediaError::VideoDecode {
                    reason: ff_reason(&e),
                });
            }
        }
        self.drain(picker, out)
    }

    /// FFmpeg's `ff_set_dimensions` zeroes the context size when `max_pixels` refuses a
    /// frame header; a context that started with a known size and now has none was
    /// refused for its size.
    fn size_refused(&self) -> Option<MediaError> {
        // SAFETY: reads two plain fields of the open codec context.
        let (w, h) = unsafe {
            let ctx = self.decoder.as_ptr();
            ((*ctx).width, (*ctx).height)
        };
        (self.sized && w == 0 && h == 0).then_some(MediaError::VideoFrameSizeRefused {
            max_pixels: self.options.limits.max_pixels_per_frame,
        })
    }

    /// Flushes the decoder at the end of the stream.
    pub(crate) fn finish(&mut self, picker: &mut Picker, out: &mut Vec<VideoFrame>) -> Result<()> {
        if !self.keyframe_seen {
            return Ok(());
        }
        // Errors here mean the decoder is already flushed.
        let _ = self.decoder.send_eof();
        self.drain(picker, out)
    }

    /// Marks the skip plan broken; the error makes the file path decode again without it.
    fn broken(&mut self) -> MediaError {
        self.plan_broken = true;
        MediaError::VideoDecode {
            reason: "decoded frames do not follow the packet index".into(),
        }
    }

    fn check_time(&self, started: Instant) -> Result<()> {
        if let Some(limit) = self.options.limits.max_decode_time {
            if started.elapsed() > limit {
                return Err(MediaError::VideoDecodeTimeout {
                    limit_ms: limit.as_millis() as u64,
                });
            }
        }
        Ok(())
    }

    fn drain(&mut self, picker: &mut Picker, out: &mut Vec<VideoFrame>) -> Result<()> {
        loop {
            match self.decoder.receive_frame(&mut self.frame) {
                Ok(()) => self.take_frame(picker, out)?,
                Err(ffmpeg::Error::Eof) => return Ok(()),
                Err(ffmpeg::Error::Other { errno }) if errno == ffmpeg::util::error::EAGAIN => {
                    return Ok(())
                }
                Err(e) if self.options.strict => {
                    if let Some(refused) = self.size_refused() {
                        return Err(refused);
                    }
                    return Err(MediaError::VideoDecode {
                        reason: ff_reason(&e),
                    });
                }
                Err(_) => return Ok(()),
            }
        }
    }

    fn take_frame(&mut self, picker: &mut Picker, out: &mut Vec<VideoFrame>) -> Result<()> {
        let (w, h) = (self.frame.width(), self.frame.height());
        self.options.limits.check_frame(w, h)?;
        if self.options.strict && self.frame.is_corrupt() {
            return Err(MediaError::VideoDecode {
                reason: format!("frame {} is marked corrupt", self.decoded),
            });
        }
        self.produced += 1;
        let ts = self.frame.timestamp().or(self.frame.pts());
        let interlaced = self.frame.is_interlaced();
        let index = match self.skip.as_mut().map(|plan| plan.index_of(ts, interlaced)) {
            Some(Ok(index)) => index,
            Some(Err(_)) => return Err(self.broken()),
            None => self.decoded,
        };
        self.decoded = index + 1;
        let t = match ts {
            Some(ts) => {
                let first = *self.first_ts.get_or_insert(ts);
                (ts - first) as f64 * self.time_base
            }
            None => index as f64 / self.src_fps,
        };
        self.options.limits.check_duration(t)?;
        if picker.exhausted() {
            return Ok(());
        }
        let Some(timestamp) = picker.pick(index, t) else {
            return Ok(());
        };
        self.kept += 1;
        if self.kept > self.options.limits.max_frames {
            return Err(MediaError::VideoTooManyFrames {
                limit: self.options.limits.max_frames,
            });
        }
        let target = target_size(&self.options.output, w, h)?;
        let image =
            Converter::convert(&mut self.converter, &self.frame, target, self.options.scale)?;
        out.push(VideoFrame {
            image,
            index,
            timestamp,
            pts_time: t,
        });
        Ok(())
    }
}

/// transformers' fallback when a video carries no frame rate (`fps=24`, with a warning).
pub(crate) const DEFAULT_FPS: f64 = 24.0;

/// The output size of a `width`×`height` frame.
pub(crate) fn target_size(output: &OutputSize, width: u32, height: u32) -> Result<(u32, u32)> {
    match output {
        OutputSize::Source => Ok((width, height)),
        OutputSize::Processor(cfg) => {
            let plan = plan_resize(width, height, cfg)?;
            Ok((plan.resized_width, plan.resized_height))
        }
    }
}
