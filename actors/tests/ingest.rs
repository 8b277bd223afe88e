//! The Ingest pool end to end: real fixture images (made with the ffmpeg CLI, see
//! tools/make_media_fixtures.py) and frames through the pool give exactly what the media
//! crate computes inline, with the content hash of the bytes; media errors come back
//! typed; a full pool answers overloaded at once.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use caracal_actors::ingest::{Ingest, IngestConfig, IngestError};
use caracal_media::{
    chunk_frames, content_hash, decode_image, process_image_bytes, DecodeLimits,
    ImageProcessorConfig, MediaError, RgbImage,
};

fn fixture(rel: &str) -> Arc<[u8]> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../media/tests/fixtures")
        .join(rel);
    std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
fn prepared_images_equal_the_media_crate_and_carry_the_byte_hash() {
    let ingest = Ingest::start(IngestConfig::default()).expect("pool");
    let rt = runtime();
    let cfg = ImageProcessorConfig::kimi_k25()
        .with_kwargs(&serde_json::json!({"max_patches": 64}))
        .expect("kwargs");
    for name in ["images/testsrc2_320x240.png", "images/mandelbrot_75x45.jpg"] {
        let bytes = fixture(name);
        let caller = std::thread::current().id();
        let prepared = rt
            .block_on(ingest.prepare_image(bytes.clone(), &cfg, DecodeLimits::default()))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(std::thread::current().id(), caller);
        let direct = process_image_bytes(&bytes, &cfg).expect("media crate");
        assert_eq!(prepared.hash, content_hash(&bytes), "{name}");
        assert_eq!(prepared.input.grid_thw, direct.grid_thw, "{name}");
        assert_eq!(prepared.input.pixel_values, direct.pixel_values, "{name}");
        assert_eq!(prepared.num_tokens, direct.num_tokens, "{name}");
        let image = decode_image(&bytes, &DecodeLimits::default()).expect("decodes");
        assert_eq!(
            (prepared.width, prepared.height),
            image.dimensions(),
            "{name}"
        );
    }
    // The fixture's transformers grid: 320x240 at max_patches 64 → [1, 8, 10], 20 tokens.
    let p = rt
        .block_on(ingest.prepare_image(
            fixture("images/testsrc2_320x240.png"),
            &cfg,
            DecodeLimits::default(),
        ))
        .expect("prepared");
    assert_eq!((p.input.grid_thw, p.num_tokens), ([1, 8, 10], 20));
    assert_eq!(ingest.queued(), 0);
}

#[test]
fn media_errors_come_back_typed() {
    let ingest = Ingest::start(IngestConfig::default()).expect("pool");
    let rt = runtime();
    let cfg = ImageProcessorConfig::kimi_k25();
    let tight = DecodeLimits {
        max_side: 100,
        max_pixels: 1 << 20,
    };
    let err = rt
        .block_on(ingest.prepare_image(fixture("images/testsrc2_320x240.png"), &cfg, tight))
        .unwrap_err();
    assert!(
        matches!(
            err,
            IngestError::Media(MediaError::TooLarge {
                width: 320,
                height: 240,
                limit: 100
            })
        ),
        "{err}"
    );
    assert_eq!(err.kind(), "image_too_large");
    let mut corrupt = fixture("images/testsrc2_320x240.png").to_vec();
    corrupt.truncate(200);
    let err = rt
        .block_on(ingest.prepare_image(corrupt.into(), &cfg, DecodeLimits::default()))
        .unwrap_err();
    assert_eq!(err.kind(), "image_decode_failed", "{err}");
    let frames = vec![RgbImage::new(30, 30), RgbImage::new(31, 30)];
    let err = rt
        .block_on(ingest.prepare_frames(frames, vec![0.0, 0.5], &cfg))
        .unwrap_err();
    assert_eq!(err.kind(), "video_frames_invalid", "{err}");
}

#[test]
fn prepared_frames_are_the_media_crate_chunks_with_prompts() {
    let ingest = Ingest::start(IngestConfig::default()).expect("pool");
    let rt = runtime();
    let cfg = ImageProcessorConfig::kimi_k25()
        .with_kwargs(&serde_json::json!({"max_patches": 16}))
        .expect("kwargs");
    let frames: Vec<RgbImage> = (1..=7)
        .map(|i| {
            let bytes = fixture(&format!("video/testsrc2_160x120/frame_{i:02}.png"));
            decode_image(&bytes, &DecodeLimits::default()).expect("frame decodes")
        })
        .collect();
    let times: Vec<f64> = [0, 13, 26, 39, 52, 65, 78]
        .iter()
        .map(|&i| f64::from(i) / 30.0)
        .collect();
    let chunks = rt
        .block_on(ingest.prepare_frames(frames.clone(), times.clone(), &cfg))
        .expect("chunks");
    let direct = chunk_frames(&frames, &times, &cfg).expect("media crate");
    assert_eq!(chunks.len(), 2);
    for (ours, theirs) in chunks.iter().zip(&direct) {
        assert_eq!(ours.input.grid_thw, theirs.grid_thw);
        assert_eq!(ours.input.pixel_values, theirs.pixel_values);
        assert_eq!(
            (ours.hash, ours.num_tokens, ours.first_frame),
            (theirs.hash, theirs.num_tokens, theirs.first_frame)
        );
    }
    assert_eq!(
        chunks[1].prompt,
        "00:00:01.733<|media_begin|>video<|media_content|><|media_pad|><|media_end|>"
    );
    assert_eq!(
        chunks.iter().map(|c| c.input.grid_thw).collect::<Vec<_>>(),
        [[4, 4, 6], [3, 4, 6]]
    );
}

#[test]
fn a_full_pool_answers_overloaded_at_once() {
    let ingest = Ingest::start(IngestConfig {
        threads: 1,
        queue_capacity: 1,
    })
    .expect("pool");
    // A job that takes a while (tens of milliseconds at least): 4 frames of 1280x720,
    // each resized to 1202x676.
    let frames: Vec<RgbImage> = (0..4)
        .map(|i| RgbImage::from_fn(1280, 720, |x, y| image_pixel(x, y, i)))
        .collect();
    let times: Vec<f64> = (0..4).map(|i| f64::from(i) * 0.5).collect();
    let cfg = ImageProcessorConfig::kimi_k25();
    let busy = ingest
        .submit_frames(frames, times, &cfg)
        .expect("first job takes the slot");
    let started = Instant::now();
    let err = ingest
        .submit_image(
            fixture("images/testsrc2_320x240.png"),
            &cfg,
            DecodeLimits::default(),
        )
        .unwrap_err();
    assert!(
        matches!(err, IngestError::Overloaded { capacity: 1 }),
        "{err}"
    );
    assert_eq!(err.kind(), "overloaded");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "refused without waiting"
    );
    let chunks = runtime().block_on(busy).expect("answered").expect("chunks");
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0].input.grid_thw, [4, 50, 86]);
    // The slot came back: the next job is accepted.
    assert!(ingest
        .submit_image(
            fixture("images/testsrc2_320x240.png"),
            &cfg,
            DecodeLimits::default()
        )
        .is_ok());
}

fn image_pixel(x: u32, y: u32, frame: u32) -> caracal_media::Rgb<u8> {
    caracal_media::Rgb([(x + frame) as u8, (y * 3) as u8, ((x ^ y) + frame) as u8])
}
