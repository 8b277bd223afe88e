//! Live streams pushed in small chunks: MPEG-TS, fragmented MP4, WebM (as MediaRecorder
//! writes it) and raw H.264; frames come out before the stream ends, selected by pts.
#![cfg(feature = "video")]

mod video_common;

use caracal_media::video::{
    decode_video_file, Container, LiveDecoder, LiveSelector, OutputSize, VideoFrame, VideoOptions,
};
use video_common::{bytes, path};

/// Chunk size: far smaller than one GOP, so frames must complete across pushes.
const CHUNK: usize = 700;

/// Pushes `name` in [`CHUNK`]-byte pieces; returns the frames and, per push, how many
/// frames had come out before it.
fn stream(name: &str, container: Container, opts: &VideoOptions) -> (Vec<VideoFrame>, usize) {
    let data = bytes(name);
    let mut live = LiveDecoder::new(container, opts).expect("starts");
    let mut frames = Vec::new();
    let mut before_last_chunk = 0;
    let chunks: Vec<&[u8]> = data.chunks(CHUNK).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        if i + 1 == chunks.len() {
            before_last_chunk = frames.len();
        }
        frames.extend(
            live.push(chunk)
                .unwrap_or_else(|e| panic!("{name} push {i}: {e}")),
        );
        assert_eq!(
            live.buffered_bytes(),
            0,
            "{name}: push {i} left bytes queued"
        );
    }
    frames.extend(
        live.finish()
            .unwrap_or_else(|e| panic!("{name} finish: {e}")),
    );
    assert_eq!(live.decoded_frames(), 60, "{name}: 2 s at 30 fps");
    (frames, before_last_chunk)
}

#[test]
fn every_live_container_yields_frames_as_chunks_arrive() {
    let opts = VideoOptions {
        output: OutputSize::Source,
        ..VideoOptions::default()
    };
    for (name, container) in [
        ("live.ts", Container::MpegTs),
        ("live_frag.mp4", Container::Mp4),
        ("live.webm", Container::WebM),
        ("live.h264", Container::H264),
        ("live.webm", Container::Auto),
    ] {
        let (frames, before_last) = stream(name, container, &opts);
        // 60 frames at 30 fps, 2 fps by pts: slots 0, 0.5, 1.0, 1.5 s.
        let indices: Vec<u64> = frames.iter().map(|f| f.index).collect();
        assert_eq!(indices, [0, 15, 30, 45], "{name} as {container:?}");
        for f in &frames {
            assert!(
                (f.timestamp - f.index as f64 / 30.0).abs() < 1e-3,
                "{name}: {f:?}"
            );
            assert_eq!(f.timestamp, f.pts_time);
            assert_eq!(f.image.dimensions(), (64, 48));
        }
        assert!(
            before_last >= 3,
            "{name}: only {before_last} frames before the last chunk"
        );
    }
}

#[test]
fn live_frames_equal_file_frames_when_the_rate_divides() {
    // 30 fps → 2 fps: the pts rule and the transformers rule pick the same frames, and
    // the exact path gives the same pixels.
    let opts = VideoOptions::default();
    let file = decode_video_file(path("live_frag.mp4"), Container::Mp4, &opts).expect("file");
    let (live, _) = stream("live_frag.mp4", Container::Mp4, &opts);
    assert_eq!(live.len(), file.frames.len());
    for (a, b) in live.iter().zip(&file.frames) {
        assert_eq!(a.index, b.index);
        assert_eq!(a.image, b.image);
    }
}

#[test]
fn live_selection_is_the_live_selector_over_presentation_times() {
    let opts = VideoOptions {
        fps: 3.0,
        output: OutputSize::Source,
        ..VideoOptions::default()
    };
    let (frames, _) = stream("live.ts", Container::MpegTs, &opts);
    let mut sel = LiveSelector::new(3.0);
    let want: Vec<u64> = (0..60u64).filter(|&i| sel.keep(i as f64 / 30.0)).collect();
    assert_eq!(frames.iter().map(|f| f.index).collect::<Vec<_>>(), want);
}

#[test]
fn pushing_after_finish_is_refused() {
    let mut live = LiveDecoder::new(Container::MpegTs, &VideoOptions::default()).expect("new");
    live.push(&bytes("live.ts")).expect("push");
    live.finish().expect("finish");
    let e = live.push(b"more").unwrap_err();
    assert_eq!(e.kind(), "video_closed");
}

#[test]
fn dropping_a_live_decoder_mid_stream_stops_its_thread() {
    let data = bytes("live.webm");
    let mut live = LiveDecoder::new(Container::WebM, &VideoOptions::default()).expect("new");
    live.push(&data[..data.len() / 2]).expect("push");
    drop(live); // joins the demux thread; hanging here would fail the test by timeout
}
