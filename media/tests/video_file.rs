//! Whole-file decoding: frame selection against transformers 5.23 (decoding with PyAV),
//! the Moonshot sampler, timestamps, pixels of both scale paths, and image frames.
#![cfg(feature = "video")]

mod video_common;

use caracal_media::video::{
    decode_video_bytes, decode_video_file, moonshot_indices, Container, OutputSize, SamplingMode,
    ScalePath, VideoOptions,
};
use caracal_media::{ImageProcessorConfig, ResizeRule};
use video_common::{bytes, diff, f64s, path, reference, u64s};

/// Source-size frames at `fps` in `mode`.
fn options(fps: f64, mode: SamplingMode) -> VideoOptions {
    VideoOptions {
        fps,
        sampling: mode,
        output: OutputSize::Source,
        ..VideoOptions::default()
    }
}

#[test]
fn transformers_mode_selects_the_reference_indices_and_timestamps() {
    let reference = reference();
    let mut checked = 0;
    for (clip, entry) in reference["clips"].as_object().expect("clips") {
        let Some(by_fps) = entry["transformers"].as_object() else {
            continue;
        };
        for (fps, want) in by_fps {
            let fps: f64 = fps.parse().expect("fps key");
            let video = decode_video_file(
                path(clip),
                Container::Auto,
                &options(fps, SamplingMode::Transformers),
            )
            .unwrap_or_else(|e| panic!("{clip} at {fps} fps: {e}"));
            let indices: Vec<u64> = video.frames.iter().map(|f| f.index).collect();
            assert_eq!(indices, u64s(&want["indices"]), "{clip} at {fps} fps");
            let stamps: Vec<f64> = video.frames.iter().map(|f| f.timestamp).collect();
            for (got, want) in stamps.iter().zip(f64s(&want["timestamps"])) {
                // index / fps computed the same way in f64: equal up to one rounding.
                assert!(
                    (got - want).abs() < 1e-9,
                    "{clip} at {fps}: {got} vs {want}"
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 5 * 5, "five clips at five rates");
}

#[test]
fn moonshot_mode_selects_the_reference_linspace_indices() {
    let reference = reference();
    for (clip, entry) in reference["clips"].as_object().expect("clips") {
        for (fps, want) in entry["moonshot"].as_object().expect("moonshot") {
            let fps: f64 = fps.parse().expect("fps key");
            let video = decode_video_file(
                path(clip),
                Container::Auto,
                &options(fps, SamplingMode::Moonshot),
            )
            .unwrap_or_else(|e| panic!("{clip}: {e}"));
            let indices: Vec<u64> = video.frames.iter().map(|f| f.index).collect();
            assert_eq!(indices, u64s(want), "{clip} at {fps} fps");
            let src_fps = entry["fps"].as_f64().expect("fps");
            for f in &video.frames {
                assert!((f.timestamp - f.index as f64 / src_fps).abs() < 1e-9);
            }
        }
    }
}

#[test]
fn frames_taken_equal_duration_times_fps_within_one_frame() {
    for clip in [
        "cfr24.mp4",
        "cfr25.mp4",
        "cfr30.mp4",
        "cfr60.mp4",
        "vfr.mp4",
    ] {
        for fps in [0.5, 1.0, 2.0, 3.0, 5.0] {
            for mode in [SamplingMode::Transformers, SamplingMode::Moonshot] {
                let video = decode_video_file(path(clip), Container::Auto, &options(fps, mode))
                    .expect("decodes");
                let duration = video.total_frames as f64 / video.src_fps;
                let expected = duration * fps;
                let taken = video.frames.len() as f64;
                assert!(
                    (taken - expected).abs() <= 1.0,
                    "{clip} {mode:?} at {fps}: {taken} frames for {duration} s"
                );
                for pair in video.frames.windows(2) {
                    assert!(pair[0].timestamp < pair[1].timestamp, "{clip}");
                    assert!(pair[0].pts_time < pair[1].pts_time, "{clip}");
                    assert!(pair[0].index < pair[1].index, "{clip}");
                }
            }
        }
    }
}

#[test]
fn variable_rate_clip_reports_presentation_times_as_pyav() {
    let reference = reference();
    let entry = &reference["clips"]["vfr.mp4"];
    let times = f64s(&entry["frame_times"]);
    let video = decode_video_file(
        path("vfr.mp4"),
        Container::Auto,
        &options(2.0, SamplingMode::Transformers),
    )
    .expect("decodes");
    for f in &video.frames {
        let want = times[f.index as usize] - times[0];
        assert!(
            (f.pts_time - want).abs() < 1e-6,
            "frame {}: {} vs {want}",
            f.index,
            f.pts_time
        );
    }
    // The prompt timestamp is index / average rate, which drifts from the presentation
    // time on a variable-rate clip (transformers' VideoMetadata.timestamps).
    let last = video.frames.last().expect("frames");
    assert!((last.timestamp - last.pts_time).abs() > 0.1);
}

#[test]
fn fragmented_mp4_without_frame_count_is_counted_by_packets() {
    // transformers' PyAV loader finds stream.frames == 0 and refuses this file.
    let reference = reference();
    let entry = &reference["clips"]["live_frag.mp4"];
    assert!(entry["transformers"].is_null());
    let video = decode_video_file(
        path("live_frag.mp4"),
        Container::Mp4,
        &options(2.0, SamplingMode::Transformers),
    )
    .expect("decodes");
    assert_eq!(video.info.declared_frames, 0);
    assert_eq!(
        video.total_frames,
        entry["decoded_frames"].as_u64().expect("count")
    );
    let indices: Vec<u64> = video.frames.iter().map(|f| f.index).collect();
    // Same frame count and rate as cfr30.mp4, so the same picks.
    assert_eq!(
        indices,
        u64s(&reference["clips"]["cfr30.mp4"]["transformers"]["2.0"]["indices"])
    );
}

#[test]
fn bytes_and_path_decode_identically() {
    let opts = VideoOptions::default();
    let a = decode_video_file(path("cfr25.mp4"), Container::Mp4, &opts).expect("file");
    let b = decode_video_bytes(bytes("cfr25.mp4"), Container::Mp4, &opts).expect("bytes");
    assert_eq!(a, b);
    assert_eq!(a.info.codec, "h264");
    assert_eq!((a.info.width, a.info.height), (64, 48));
}

/// Picked indices, source RGB, its size, Pillow-resized RGB, its size, the patch limit.
type PixelReference = (Vec<u64>, Vec<u8>, (u32, u32), Vec<u8>, (u32, u32), u64);

/// The reference RGB frames (PyAV `to_ndarray("rgb24")`) of cfr25.mp4 at 2 fps.
fn pixel_reference() -> PixelReference {
    let r = reference();
    let p = &r["pixels"];
    let dims = |w: &str, h: &str| {
        (
            p[w].as_u64().expect("w") as u32,
            p[h].as_u64().expect("h") as u32,
        )
    };
    (
        u64s(&p["indices"]),
        bytes(p["rgb"].as_str().expect("name")),
        dims("width", "height"),
        bytes(p["resized"].as_str().expect("name")),
        dims("resized_width", "resized_height"),
        p["resize_patch_limit"].as_u64().expect("limit"),
    )
}

#[test]
fn exact_path_rgb_matches_pyav_within_tolerance() {
    let (indices, rgb, (w, h), _, _, _) = pixel_reference();
    let video = decode_video_file(
        path("cfr25.mp4"),
        Container::Auto,
        &options(2.0, SamplingMode::Transformers),
    )
    .expect("decodes");
    assert_eq!(
        video.frames.iter().map(|f| f.index).collect::<Vec<_>>(),
        indices
    );
    let ours: Vec<u8> = video
        .frames
        .iter()
        .flat_map(|f| {
            assert_eq!(f.image.dimensions(), (w, h));
            f.image.as_raw().clone()
        })
        .collect();
    // Same H.264 decode (bit-exact by the standard) and the same swscale flags and
    // matrix as PyAV. FFmpeg 5.1 here and the wheel's FFmpeg 8.1 agreed bit for bit when
    // the fixture was made; the tolerance (mean ≤ 0.05, max ≤ 2 levels) leaves room only
    // for swscale's CPU-specific SIMD rounding.
    let (mean, max) = diff(&ours, &rgb);
    assert!(mean <= 0.05 && max <= 2, "mean {mean}, max {max}");
}

#[test]
fn exact_and_fast_paths_give_the_processor_size() {
    let (_, _, _, resized, (rw, rh), limit) = pixel_reference();
    let cfg = ImageProcessorConfig {
        resize: ResizeRule::NavitPatchLimit {
            in_patch_limit: limit,
            patch_limit_on_one_side: 512,
        },
        ..ImageProcessorConfig::kimi_k25()
    };
    for (scale, mean_tol, max_tol) in [(ScalePath::Exact, 0.05, 2), (ScalePath::Fast, 4.0, 80)] {
        let opts = VideoOptions {
            output: OutputSize::Processor(cfg),
            scale,
            ..VideoOptions::default()
        };
        let video = decode_video_file(path("cfr25.mp4"), Container::Auto, &opts).expect("decodes");
        let ours: Vec<u8> = video
            .frames
            .iter()
            .flat_map(|f| {
                assert_eq!(f.image.dimensions(), (rw, rh), "{scale:?}");
                f.image.as_raw().clone()
            })
            .collect();
        // Against Pillow's bicubic of the PyAV frames. Exact: the same RGB and the
        // Pillow-exact resize (bit-exact when made; mean ≤ 0.05, max ≤ 2 for SIMD
        // rounding). Fast: swscale's bicubic is another kernel without Pillow's
        // antialiasing, on a sharp test pattern (measured mean 2.36, max 54; tolerance
        // mean ≤ 4, max ≤ 80).
        let (mean, max) = diff(&ours, &resized);
        assert!(
            mean <= mean_tol && max <= max_tol,
            "{scale:?}: mean {mean}, max {max}"
        );
    }
}

#[test]
fn default_output_is_the_k25_per_frame_target() {
    // 64x48 is far under 4096 patches, so the default keeps the size.
    let video = decode_video_file(path("cfr30.mp4"), Container::Auto, &VideoOptions::default())
        .expect("ok");
    assert!(video
        .frames
        .iter()
        .all(|f| f.image.dimensions() == (64, 48)));
    assert_eq!(
        video.frames.iter().map(|f| f.index).collect::<Vec<_>>(),
        [0, 15, 30, 45]
    );
}

#[test]
fn png_and_jpeg_bytes_are_one_frame() {
    for name in ["frame.png", "frame.jpg"] {
        let video = decode_video_bytes(bytes(name), Container::Auto, &VideoOptions::default())
            .expect("image decodes");
        assert_eq!(video.frames.len(), 1, "{name}");
        let f = &video.frames[0];
        assert_eq!((f.index, f.timestamp), (0, 0.0));
        assert_eq!(f.image.dimensions(), (64, 48));
    }
    let png = caracal_media::decode_image(&bytes("frame.png"), &Default::default()).expect("png");
    let frame = decode_video_file(path("frame.png"), Container::Auto, &VideoOptions::default())
        .expect("file");
    assert_eq!(frame.frames[0].image, png);
}

#[test]
fn moonshot_formula_is_the_reference_formula() {
    // The Python reference values, recomputed from the fixture metadata.
    let reference = reference();
    for (clip, entry) in reference["clips"].as_object().expect("clips") {
        let total = entry["total_num_frames"].as_u64().expect("total");
        let src_fps = entry["fps"].as_f64().expect("fps");
        for (fps, want) in entry["moonshot"].as_object().expect("moonshot") {
            let fps: f64 = fps.parse().expect("fps");
            assert_eq!(moonshot_indices(total, src_fps, fps), u64s(want), "{clip}");
        }
    }
}
