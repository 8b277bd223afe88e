//! Skipping untaken non-reference frames (`VideoOptions::skip_untaken`) changes nothing
//! that comes out: the same frames, indices, timestamps and pixels, byte for byte, as
//! decoding every frame, on clips with B-frames (libx264 `-bf 3 -b-pyramid normal`, so
//! some B-frames are references), at a constant and a variable frame rate, for both
//! samplers, both scale paths, frame threads, and every other fixture clip (where the
//! plan does not apply, it must fall back to the same answer).
#![cfg(feature = "video")]

mod video_common;

use caracal_media::video::{
    decode_video_bytes, decode_video_file, Container, DecodedVideo, OutputSize, SamplingMode,
    ScalePath, VideoOptions,
};
use video_common::{bytes, path};

/// Rates that take every frame, every few and a handful, whole and fractional strides.
const RATES: [f64; 6] = [0.5, 1.0, 2.0, 3.0, 7.5, 30.0];

fn options(fps: f64, sampling: SamplingMode, skip: bool) -> VideoOptions {
    VideoOptions {
        fps,
        sampling,
        output: OutputSize::Source,
        skip_untaken: skip,
        ..VideoOptions::default()
    }
}

/// Everything but the decoder's own frame count is equal.
fn assert_same(skipped: &DecodedVideo, full: &DecodedVideo, what: &str) {
    assert_eq!(skipped.info, full.info, "{what}: info");
    assert_eq!(skipped.total_frames, full.total_frames, "{what}: total");
    assert_eq!(skipped.src_fps, full.src_fps, "{what}: src_fps");
    assert_eq!(skipped.frames.len(), full.frames.len(), "{what}: frames");
    for (a, b) in skipped.frames.iter().zip(&full.frames) {
        assert_eq!(a.index, b.index, "{what}");
        assert_eq!(a.timestamp.to_bits(), b.timestamp.to_bits(), "{what}");
        assert_eq!(a.pts_time.to_bits(), b.pts_time.to_bits(), "{what}");
        assert_eq!(a.image.dimensions(), b.image.dimensions(), "{what}");
        assert!(
            a.image.as_raw() == b.image.as_raw(),
            "{what}: frame {} pixels differ",
            a.index
        );
    }
}

#[test]
fn taken_frames_are_byte_identical_with_and_without_the_skip_on_b_frame_clips() {
    for clip in ["bframes.mp4", "vfr_bframes.mp4"] {
        for sampling in [SamplingMode::Transformers, SamplingMode::Moonshot] {
            for fps in RATES {
                let what = format!("{clip} {} at {fps} fps", sampling.name());
                let full =
                    decode_video_file(path(clip), Container::Auto, &options(fps, sampling, false))
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                let skipped =
                    decode_video_file(path(clip), Container::Auto, &options(fps, sampling, true))
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_same(&skipped, &full, &what);
                // Without the skip every frame up to the last taken one is decoded.
                let last = full.frames.last().expect("frames").index;
                assert_eq!(full.decoded_frames, last + 1, "{what}");
                assert!(skipped.decoded_frames <= full.decoded_frames, "{what}");
                if full.frames.len() as u64 * 6 <= full.decoded_frames {
                    // The skip applied (no fallback to a full decode): with `-bf 3` and a
                    // B-pyramid half the frames are not references, and at most a sixth
                    // are taken.
                    assert!(
                        skipped.decoded_frames * 10 < full.decoded_frames * 7,
                        "{what}: {} of {} decoded",
                        skipped.decoded_frames,
                        full.decoded_frames
                    );
                }
            }
        }
    }
}

#[test]
fn processor_output_fast_path_bytes_and_frame_threads_are_identical_with_the_skip() {
    let data = bytes("bframes.mp4");
    for scale in [ScalePath::Exact, ScalePath::Fast] {
        let base = VideoOptions {
            scale,
            ..VideoOptions::default()
        };
        let full = decode_video_file(
            path("bframes.mp4"),
            Container::Mp4,
            &VideoOptions {
                skip_untaken: false,
                ..base.clone()
            },
        )
        .expect("full decode");
        let skipped = decode_video_bytes(data.clone(), Container::Mp4, &base).expect("bytes");
        assert_same(&skipped, &full, &format!("{scale:?} bytes"));
        assert!(skipped.decoded_frames < full.decoded_frames);
        // Frame threads: the skip setting travels with each packet to its thread.
        let threaded = VideoOptions {
            threads: 4,
            ..base.clone()
        };
        let skipped =
            decode_video_file(path("bframes.mp4"), Container::Mp4, &threaded).expect("threads");
        assert_same(&skipped, &full, &format!("{scale:?} 4 threads"));
        assert!(skipped.decoded_frames < full.decoded_frames);
    }
}

#[test]
fn every_fixture_clip_decodes_the_same_with_and_without_the_skip() {
    // Fragmented MP4 and MPEG-TS (counted packets), raw H.264 (no pts: no plan), WebM
    // (VP8), plain MP4 at several rates and a variable-rate one.
    let clips = [
        ("cfr24.mp4", Container::Auto),
        ("cfr25.mp4", Container::Auto),
        ("cfr30.mp4", Container::Auto),
        ("cfr60.mp4", Container::Auto),
        ("vfr.mp4", Container::Auto),
        ("faststart.mp4", Container::Auto),
        ("live_frag.mp4", Container::Mp4),
        ("live.ts", Container::MpegTs),
        ("live.h264", Container::H264),
        ("live.webm", Container::WebM),
    ];
    for (clip, container) in clips {
        for fps in [1.0, 2.0, 5.0] {
            let what = format!("{clip} at {fps} fps");
            let full = decode_video_file(
                path(clip),
                container,
                &options(fps, SamplingMode::Transformers, false),
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            let skipped = decode_video_file(
                path(clip),
                container,
                &options(fps, SamplingMode::Transformers, true),
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_same(&skipped, &full, &what);
            assert!(skipped.decoded_frames <= full.decoded_frames, "{what}");
        }
    }
}
