//! Containers: what the client declares, what the bytes show, and opening a demuxer over
//! any byte source.
//!
//! [`Container`] is the client's declaration (`video/mp4`, `video/webm`, `video/mp2t`,
//! raw H.264, or [`Container::Auto`] to let the bytes decide). [`sniff`] reads the magic
//! bytes; a declaration that the bytes contradict (PNG bytes sent as MP4, MP4 sent as
//! WebM) is refused with [`MediaError::VideoFormatMismatch`] before FFmpeg sees them.
//! A declared container forces its demuxer, so FFmpeg never guesses.
//!
//! [`open_input`] builds an FFmpeg demuxer over any `Read` (+ `Seek` for files and
//! buffers) through ffmpeg-next's custom-I/O [`StreamIo`]: files, byte buffers and the
//! live decoder's blocking chunk queue all go through it.

use std::ffi::CString;
use std::io::{Read, Seek};
use std::ptr;

use ffmpeg::format::context::{Input, StreamIo};
use ffmpeg::Dictionary;
use ffmpeg_next as ffmpeg;

use crate::error::{MediaError, Result};

/// The container a client declares for a video.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Container {
    /// Decide from the bytes (magic bytes first, then FFmpeg's probe).
    #[default]
    Auto,
    /// MP4 / QuickTime, plain or fragmented (`video/mp4`).
    Mp4,
    /// WebM or Matroska, as a browser's MediaRecorder sends (`video/webm`).
    WebM,
    /// MPEG transport stream (`video/mp2t`).
    MpegTs,
    /// Raw H.264 Annex B elementary stream (start codes, no container).
    H264,
}

impl Container {
    /// The human name used in messages (`"MP4"`, `"WebM/Matroska"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Container::Auto => "auto",
            Container::Mp4 => "MP4",
            Container::WebM => "WebM/Matroska",
            Container::MpegTs => "MPEG-TS",
            Container::H264 => "H.264 Annex B",
        }
    }

    /// The FFmpeg demuxer forced for this container (`None` for [`Container::Auto`]).
    fn demuxer(self) -> Option<&'static str> {
        match self {
            Container::Auto => None,
            Container::Mp4 => Some("mov"),
            Container::WebM => Some("matroska"),
            Container::MpegTs => Some("mpegts"),
            Container::H264 => Some("h264"),
        }
    }
}

/// What the leading bytes of some media show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sniffed {
    /// A video container (or elementary stream) we can demux.
    Video(Container),
    /// A PNG image.
    Png,
    /// A JPEG image.
    Jpeg,
}

impl Sniffed {
    /// The human name used in messages.
    pub fn name(self) -> &'static str {
        match self {
            Sniffed::Video(c) => c.name(),
            Sniffed::Png => "a PNG image",
            Sniffed::Jpeg => "a JPEG image",
        }
    }
}

/// MPEG-TS packet size; every packet starts with the sync byte 0x47.
const TS_PACKET: usize = 188;

/// Reads the magic bytes: `ftyp`/`styp`/`moov`/`moof` boxes (MP4), the EBML header
/// (WebM/Matroska), TS sync bytes at 0 and 188, an Annex B start code followed by a
/// valid NAL header (H.264), and the PNG and JPEG signatures. `None` when none matches.
pub fn sniff(bytes: &[u8]) -> Option<Sniffed> {
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        return Some(Sniffed::Png);
    }
    if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        return Some(Sniffed::Jpeg);
    }
    if bytes.starts_with(&[0x1A, 0x45, 0xDF, 0xA3]) {
        return Some(Sniffed::Video(Container::WebM));
    }
    if bytes.len() >= 8 && matches!(&bytes[4..8], b"ftyp" | b"styp" | b"moov" | b"moof") {
        return Some(Sniffed::Video(Container::Mp4));
    }
    if bytes.first() == Some(&0x47) && bytes.get(TS_PACKET).is_none_or(|b| *b == 0x47) {
        return Some(Sniffed::Video(Container::MpegTs));
    }
    let nal = if bytes.starts_with(&[0, 0, 0, 1]) {
        bytes.get(4)
    } else if bytes.starts_with(&[0, 0, 1]) {
        bytes.get(3)
    } else {
        None
    };
    // forbidden_zero_bit clear and a NAL type H.264 defines (1..=23).
    if let Some(&h) = nal {
        if h & 0x80 == 0 && (1..=23).contains(&(h & 0x1F)) {
            return Some(Sniffed::Video(Container::H264));
        }
    }
    None
}

/// Checks a declaration against the bytes: `Err` when the bytes are recognisably
/// something else. Returns what the bytes show (if anything).
pub fn check_declared(declared: Container, bytes: &[u8]) -> Result<Option<Sniffed>> {
    let found = sniff(bytes);
    match (declared, found) {
        (Container::Auto, _) | (_, None) => Ok(found),
        (d, Some(Sniffed::Video(c))) if c == d => Ok(found),
        (d, Some(other)) => Err(MediaError::VideoFormatMismatch {
            declared: d.name(),
            found: other.name(),
        }),
    }
}

/// How much a demuxer may read while it opens a stream.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProbeBudget {
    /// Most bytes read to identify the format and the streams (FFmpeg `probesize`).
    pub bytes: u64,
    /// Most media time, in microseconds, read for stream parameters (`analyzeduration`).
    pub micros: u64,
    /// Frames read to estimate a frame rate (`fpsprobesize`); 0 for live streams, whose
    /// first frames should not wait for an estimate.
    pub fps_frames: Option<u32>,
}

/// A custom-I/O context over a seekable source (a file, a buffer in memory).
pub(crate) fn seekable_io<R: Read + Seek + Send + 'static>(source: R) -> Result<StreamIo> {
    StreamIo::from_read_seek(source).map_err(|e| MediaError::VideoOpen {
        container: Container::Auto.name(),
        reason: e.to_string(),
    })
}

/// A custom-I/O context over a forward-only source (the live chunk queue).
pub(crate) fn forward_io<R: Read + Send + 'static>(source: R) -> Result<StreamIo> {
    StreamIo::from_read(source).map_err(|e| MediaError::VideoOpen {
        container: Container::Auto.name(),
        reason: e.to_string(),
    })
}

/// Opens `container`'s demuxer (or FFmpeg's probe for [`Container::Auto`]) over `io`
/// and reads the stream parameters.
pub(crate) fn open_input(
    mut io: StreamIo,
    container: Container,
    budget: ProbeBudget,
) -> Result<Input> {
    let open_err = |reason: String| MediaError::VideoOpen {
        container: container.name(),
        reason,
    };
    let mut options = Dictionary::new();
    options.set("probesize", &budget.bytes.max(32).to_string());
    options.set("analyzeduration", &budget.micros.to_string());
    if let Some(frames) = budget.fps_frames {
        options.set("fpsprobesize", &frames.to_string());
    }
    let demuxer = container
        .demuxer()
        .map(|name| CString::new(name).expect("demuxer names have no NUL"));
    // SAFETY: the context is allocated here and either handed to `Input` (which owns and
    // closes it, and keeps `io` alive for as long as the demuxer may read) or freed on
    // every error path. `AVFMT_FLAG_CUSTOM_IO` keeps FFmpeg from freeing our `pb`.
    unsafe {
        let mut ps = ffmpeg::ffi::avformat_alloc_context();
        if ps.is_null() {
            return Err(open_err("out of memory".into()));
        }
        (*ps).pb = io.as_mut_ptr();
        (*ps).flags |= ffmpeg::ffi::AVFMT_FLAG_CUSTOM_IO;
        let fmt = match &demuxer {
            Some(name) => {
                let f = ffmpeg::ffi::av_find_input_format(name.as_ptr());
                if f.is_null() {
                    ffmpeg::ffi::avformat_free_context(ps);
                    return Err(open_err("this FFmpeg build has no such demuxer".into()));
                }
                f
            }
            None => ptr::null(),
        };
        let mut opts = options.disown();
        // On failure avformat_open_input frees `ps` and sets it to null.
        let ret = ffmpeg::ffi::avformat_open_input(&mut ps, ptr::null(), fmt as _, &mut opts);
        drop(Dictionary::own(opts));
        if ret < 0 {
            return Err(open_err(ffmpeg::Error::from(ret).to_string()));
        }
        let ret = ffmpeg::ffi::avformat_find_stream_info(ps, ptr::null_mut());
        if ret < 0 {
            ffmpeg::ffi::avformat_close_input(&mut ps);
            return Err(open_err(ffmpeg::Error::from(ret).to_string()));
        }
        Ok(Input::wrap_with_custom_io(ps, io))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sniffs_containers_and_images() {
        assert_eq!(
            sniff(b"\0\0\0\x20ftypisom"),
            Some(Sniffed::Video(Container::Mp4))
        );
        assert_eq!(
            sniff(&[0x1A, 0x45, 0xDF, 0xA3, 0x9F]),
            Some(Sniffed::Video(Container::WebM))
        );
        assert_eq!(
            sniff(&[0, 0, 0, 1, 0x67, 0x64]),
            Some(Sniffed::Video(Container::H264))
        );
        assert_eq!(sniff(b"\x89PNG\r\n\x1a\n...."), Some(Sniffed::Png));
        assert_eq!(sniff(&[0xFF, 0xD8, 0xFF, 0xE0]), Some(Sniffed::Jpeg));
        let mut ts = vec![0u8; 400];
        ts[0] = 0x47;
        ts[188] = 0x47;
        assert_eq!(sniff(&ts), Some(Sniffed::Video(Container::MpegTs)));
        ts[188] = 0;
        assert_eq!(sniff(&ts), None);
        assert_eq!(sniff(b"hello"), None);
    }

    #[test]
    fn declaration_contradicted_by_bytes_is_refused() {
        let e = check_declared(Container::Mp4, b"\x89PNG\r\n\x1a\n....").unwrap_err();
        assert_eq!(e.kind(), "video_format_mismatch");
        assert_eq!(
            e.to_string(),
            "media was declared as MP4 but its bytes are a PNG image"
        );
        let e = check_declared(Container::WebM, b"\0\0\0\x20ftypisom").unwrap_err();
        assert_eq!(
            e.to_string(),
            "media was declared as WebM/Matroska but its bytes are MP4"
        );
        assert!(check_declared(Container::Mp4, b"\0\0\0\x20ftypisom").is_ok());
        assert!(check_declared(Container::Auto, b"\x89PNG\r\n\x1a\n").is_ok());
        assert!(check_declared(Container::MpegTs, b"unknown").is_ok());
    }
}
