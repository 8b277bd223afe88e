//! Bad media and limits: every case is a typed error naming what was wrong, never a
//! panic. The bad files are made here from the good fixtures (cut, overwritten,
//! patched, relabelled).
#![cfg(feature = "video")]

mod video_common;

use std::time::Duration;

use caracal_media::video::{
    decode_video_bytes, decode_video_file, Container, LiveDecoder, VideoLimits, VideoOptions,
};
use caracal_media::MediaError;
use video_common::{bytes, path};

fn with_limits(limits: VideoLimits) -> VideoOptions {
    VideoOptions {
        limits,
        ..VideoOptions::default()
    }
}

fn bytes_err(data: Vec<u8>, container: Container, opts: &VideoOptions) -> MediaError {
    match decode_video_bytes(data, container, opts) {
        Ok(v) => panic!("must be refused; decoded {} frames", v.frames.len()),
        Err(e) => e,
    }
}

/// Deterministic noise (a 64-bit LCG), so corrupt files are the same on every run.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed;
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as u8
        })
        .collect()
}

/// Pushes `data` in 700-byte chunks, then finishes; the first error.
fn live_err(data: &[u8], container: Container, opts: &VideoOptions) -> MediaError {
    let mut live = LiveDecoder::new(container, opts).expect("starts");
    for chunk in data.chunks(700) {
        if let Err(e) = live.push(chunk) {
            return e;
        }
    }
    match live.finish() {
        Ok(frames) => panic!("must be refused; finished with {} frames", frames.len()),
        Err(e) => e,
    }
}

#[test]
fn truncated_files_are_refused() {
    // Index first: the cut file still declares 60 frames.
    let mut data = bytes("faststart.mp4");
    data.truncate(data.len() * 6 / 10);
    let e = bytes_err(data, Container::Mp4, &VideoOptions::default());
    assert!(
        matches!(e, MediaError::VideoTruncated { declared: 60, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("declares 60 frames"), "{e}");
    // Index last (FFmpeg's default layout): the cut removes it.
    let mut data = bytes("cfr25.mp4");
    data.truncate(data.len() / 2);
    assert_eq!(
        bytes_err(data, Container::Mp4, &VideoOptions::default()).kind(),
        "video_open_failed"
    );
}

#[test]
fn corrupt_payload_fails_in_strict_mode_and_is_concealed_otherwise() {
    let mut data = bytes("faststart.mp4");
    // Past the first keyframe: later frames lose their data, the first decodes.
    let (from, to) = (data.len() * 7 / 10, data.len() * 85 / 100);
    data[from..to].copy_from_slice(&noise(to - from, 7));
    let e = bytes_err(data.clone(), Container::Mp4, &VideoOptions::default());
    assert_eq!(e.kind(), "video_decode_failed", "{e}");
    let lenient = VideoOptions {
        strict: false,
        ..VideoOptions::default()
    };
    let video = decode_video_bytes(data, Container::Mp4, &lenient).expect("concealed");
    assert!(!video.frames.is_empty());
    assert_eq!(video.frames[0].index, 0);
}

#[test]
fn corrupt_header_and_garbage_fail_to_open() {
    let mut data = bytes("cfr25.mp4");
    data[..64].copy_from_slice(&noise(64, 3));
    assert_eq!(
        bytes_err(data, Container::Auto, &VideoOptions::default()).kind(),
        "video_open_failed"
    );
    let e = bytes_err(noise(5000, 11), Container::Auto, &VideoOptions::default());
    assert_eq!(e.kind(), "video_open_failed", "{e}");
    let e = bytes_err(Vec::new(), Container::Auto, &VideoOptions::default());
    assert_eq!(e.kind(), "media_empty");
}

#[test]
fn mislabelled_media_is_refused_before_demuxing() {
    let opts = VideoOptions::default();
    let e = bytes_err(bytes("frame.png"), Container::Mp4, &opts);
    assert_eq!(
        e.to_string(),
        "media was declared as MP4 but its bytes are a PNG image"
    );
    let e = decode_video_file(path("cfr25.mp4"), Container::WebM, &opts).unwrap_err();
    assert_eq!(
        e.to_string(),
        "media was declared as WebM/Matroska but its bytes are MP4"
    );
    let e = live_err(&bytes("live_frag.mp4"), Container::WebM, &opts);
    assert_eq!(e.kind(), "video_format_mismatch");
    let e = live_err(&bytes("frame.jpg"), Container::MpegTs, &opts);
    assert_eq!(
        e.to_string(),
        "media was declared as MPEG-TS but its bytes are a JPEG image"
    );
}

/// Overwrites the width and height of the MP4's `avc1` sample entry (the one after
/// `stsd`; the `ftyp` brands also spell `avc1`).
fn patch_avc1_size(data: &mut [u8], width: u16, height: u16) {
    let stsd = data
        .windows(4)
        .position(|w| w == b"stsd")
        .expect("stsd box");
    let at = stsd
        + data[stsd..]
            .windows(4)
            .position(|w| w == b"avc1")
            .expect("avc1 entry");
    // fourcc, 6 reserved, data_reference_index, 16 bytes pre_defined/reserved.
    let off = at + 4 + 24;
    data[off..off + 2].copy_from_slice(&width.to_be_bytes());
    data[off + 2..off + 4].copy_from_slice(&height.to_be_bytes());
}

#[test]
fn declared_dimensions_are_checked_and_lies_do_not_allocate() {
    // A real size over a lowered limit is refused from the header and names the limit.
    let e = decode_video_file(
        path("cfr25.mp4"),
        Container::Auto,
        &with_limits(VideoLimits {
            max_side: 32,
            ..VideoLimits::default()
        }),
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("64x48") && e.to_string().contains("32 per side"),
        "{e}"
    );
    // A 6 kB MP4 whose sample entry claims 65535x65535 (12.9 GB of RGB per frame):
    // FFmpeg takes the size from the H.264 parameter sets while probing, so the claim
    // allocates nothing and the real 64x48 frames decode.
    let mut data = bytes("cfr25.mp4");
    patch_avc1_size(&mut data, 65535, 65535);
    let video = decode_video_bytes(data, Container::Mp4, &VideoOptions::default()).expect("ok");
    assert_eq!((video.info.width, video.info.height), (64, 48));
    assert!(video
        .frames
        .iter()
        .all(|f| f.image.dimensions() == (64, 48)));
}

#[test]
fn bitstream_claiming_huge_frames_is_refused_before_allocation() {
    // Decompression bomb: the WebM track still says 64x48, but the first VP8 keyframe
    // header now claims 16383x16383 (268 MP). FFmpeg's max_pixels (set from
    // max_pixels_per_frame) refuses the size before allocating any frame buffer.
    let mut data = bytes("live.webm");
    let start = data
        .windows(3)
        .position(|w| w == [0x9D, 0x01, 0x2A])
        .expect("VP8 keyframe start code");
    data[start + 3..start + 7].copy_from_slice(&[0xFF, 0x3F, 0xFF, 0x3F]);
    for e in [
        bytes_err(data.clone(), Container::WebM, &VideoOptions::default()),
        live_err(&data, Container::WebM, &VideoOptions::default()),
    ] {
        assert!(
            matches!(
                e,
                MediaError::VideoFrameSizeRefused {
                    max_pixels: 67_108_864
                }
            ),
            "{e}"
        );
        assert_eq!(e.kind(), "video_frame_too_large");
    }
}

/// Raw H.264 with every IDR slice (NAL type 5) removed: parameter sets and P slices only.
fn without_keyframes(annexb: &[u8]) -> Vec<u8> {
    let mut starts = Vec::new();
    let mut i = 0;
    while i + 3 <= annexb.len() {
        if annexb[i..i + 3] == [0, 0, 1] {
            starts.push(i + 3);
            i += 3;
        } else {
            i += 1;
        }
    }
    let mut out = Vec::new();
    for (k, &s) in starts.iter().enumerate() {
        let end = starts.get(k + 1).map_or(annexb.len(), |&n| n - 3);
        let nal = &annexb[s..end];
        if nal.first().is_some_and(|h| h & 0x1F != 5) {
            out.extend_from_slice(&[0, 0, 0, 1]);
            out.extend_from_slice(nal.strip_suffix(&[0]).unwrap_or(nal));
        }
    }
    out
}

#[test]
fn stream_without_keyframe_is_refused_after_the_limit() {
    let data = without_keyframes(&bytes("live.h264"));
    let opts = with_limits(VideoLimits {
        max_packets_without_keyframe: 10,
        ..VideoLimits::default()
    });
    let e = live_err(&data, Container::H264, &opts);
    assert!(
        matches!(
            e,
            MediaError::VideoNoKeyframe {
                packets: 11,
                limit: 10
            }
        ),
        "{e}"
    );
    let e = bytes_err(data, Container::H264, &opts);
    assert_eq!(e.kind(), "video_no_keyframe", "{e}");
}

#[test]
fn frame_duration_byte_and_time_limits_name_the_limit() {
    let e = decode_video_file(
        path("cfr25.mp4"),
        Container::Auto,
        &with_limits(VideoLimits {
            max_frames: 2,
            ..VideoLimits::default()
        }),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "video yields more than 2 sampled frames (max_frames)"
    );
    let live_frames = with_limits(VideoLimits {
        max_frames: 2,
        ..VideoLimits::default()
    });
    assert_eq!(
        live_err(&bytes("live.ts"), Container::MpegTs, &live_frames).kind(),
        "video_too_many_frames"
    );

    let short = with_limits(VideoLimits {
        max_duration: 1.0,
        ..VideoLimits::default()
    });
    let e = decode_video_file(path("cfr25.mp4"), Container::Auto, &short).unwrap_err();
    assert!(e.to_string().contains("(max_duration)"), "{e}");
    assert_eq!(
        live_err(&bytes("live.ts"), Container::MpegTs, &short).kind(),
        "video_too_long"
    );

    let small = with_limits(VideoLimits {
        max_bytes: 1000,
        ..VideoLimits::default()
    });
    let e = bytes_err(bytes("cfr25.mp4"), Container::Auto, &small);
    assert!(
        e.to_string()
            .contains("the limit is 1000 bytes (max_bytes)"),
        "{e}"
    );
    assert_eq!(
        live_err(&bytes("live.ts"), Container::MpegTs, &small).kind(),
        "video_too_many_bytes"
    );

    let instant = with_limits(VideoLimits {
        max_decode_time: Some(Duration::ZERO),
        ..VideoLimits::default()
    });
    let e = bytes_err(bytes("cfr25.mp4"), Container::Auto, &instant);
    assert_eq!(
        e.to_string(),
        "video decoding took more than 0 ms (max_decode_time)"
    );
}

#[test]
fn invalid_options_are_refused_with_the_field() {
    let opts = VideoOptions {
        fps: 0.0,
        ..VideoOptions::default()
    };
    let e = decode_video_file(path("cfr25.mp4"), Container::Auto, &opts).unwrap_err();
    assert!(e.to_string().contains("`fps`"), "{e}");
    assert!(LiveDecoder::new(Container::Auto, &opts).is_err());
}
