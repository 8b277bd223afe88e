//! caracal-media against transformers 5.23's Kimi K2.5 processors, on real media.
//!
//! `tools/make_media_fixtures.py` rendered images (testsrc2, smptebars and mandelbrot
//! frames as PNG and JPEG, 4:2:0 and 4:4:4) and clip frames (testsrc2 encoded with
//! libx264, decoded to PNG) with the `ffmpeg` CLI, ran `Kimi_K25ImageProcessor` and
//! `Kimi_K25VideoProcessor` (sampling off) on them with the kwargs in `manifest.json`, and
//! stored `pixel_values` as little-endian f32. Here the same files go through this crate.
//!
//! Tolerances: pixel values max |Δ| ≤ 1e-6 (they are in fact bit-identical), grids,
//! resized sizes, token counts and timestamp strings exact.
//!
//! JPEG decoding is checked on its own against the RGB Pillow decoded, so a decoder
//! difference shows as such rather than as a processor difference. The `image` crate
//! decodes JPEG with zune-jpeg, whose IDCT, chroma upsampling and colour conversion are
//! not libjpeg-turbo's: on the fixture JPEGs it differs from Pillow by up to 3 levels on
//! 1-28% of the values (4:4:4 included). So for JPEG the processor is held to 1e-6 on
//! Pillow's decoded pixels, and the decoder gap is bounded separately
//! ([`JPEG_DECODE_TOLERANCE`]); PNG is exact from the bytes.

use std::path::{Path, PathBuf};

use caracal_media::{
    chunk_frames, decode_image, format_timestamp, preprocess, process_image_bytes, DecodeLimits,
    ImageProcessorConfig,
};
use image::RgbImage;
use serde_json::Value;

/// Largest accepted |Δ| between our pixel values and transformers'.
const PIXEL_TOLERANCE: f32 = 1e-6;

/// Largest accepted difference, in 8-bit levels, between zune-jpeg's RGB and
/// libjpeg-turbo's (Pillow's) on the fixture JPEGs (measured: 3).
const JPEG_DECODE_TOLERANCE: u8 = 3;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn manifest() -> Value {
    let text = std::fs::read_to_string(fixtures().join("manifest.json"))
        .expect("media/tests/fixtures/manifest.json (tools/make_media_fixtures.py)");
    serde_json::from_str(&text).expect("manifest is JSON")
}

fn read(rel: &Value) -> Vec<u8> {
    let rel = rel.as_str().expect("path string");
    std::fs::read(fixtures().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn read_f32(rel: &Value) -> Vec<f32> {
    read(rel)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn usizes(v: &Value) -> Vec<usize> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("integer") as usize)
        .collect()
}

/// Max |Δ| and the number of values that are not bit-identical.
fn compare(ours: &[f32], theirs: &[f32]) -> (f32, usize) {
    assert_eq!(ours.len(), theirs.len(), "pixel_values length");
    ours.iter()
        .zip(theirs)
        .fold((0f32, 0usize), |(max, n), (a, b)| {
            (
                (a - b).abs().max(max),
                n + usize::from(a.to_bits() != b.to_bits()),
            )
        })
}

fn decode(bytes: &[u8]) -> RgbImage {
    decode_image(bytes, &DecodeLimits::default()).expect("fixture decodes")
}

#[test]
fn images_match_kimi_k25_image_processor() {
    let manifest = manifest();
    let cases = manifest["images"].as_array().expect("image cases");
    assert!(cases.len() >= 5, "fixture set is complete");
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let cfg = ImageProcessorConfig::kimi_k25()
            .with_kwargs(&case["kwargs"])
            .unwrap_or_else(|e| panic!("{name}: kwargs: {e}"));
        let bytes = read(&case["source"]);
        let theirs = read_f32(&case["pixel_values"]);

        // Our decode must give the recorded size.
        let image = decode(&bytes);
        let (w, h) = (
            case["width"].as_u64().unwrap(),
            case["height"].as_u64().unwrap(),
        );
        assert_eq!(
            (u64::from(image.width()), u64::from(image.height())),
            (w, h),
            "{name}: size"
        );
        let is_png = case["format"] == "PNG";
        let mut paths = Vec::new();
        if is_png {
            // PNG: the whole path from the bytes must match.
            paths.push(("process_image_bytes", process_image_bytes(&bytes, &cfg)));
        } else {
            // JPEG: the decoder gap is bounded on its own, and the processor must match on
            // the pixels Pillow decoded.
            let pillow_rgb = read(&case["decoded_rgb"]);
            let decode_diff = image
                .as_raw()
                .iter()
                .zip(&pillow_rgb)
                .map(|(a, b)| a.abs_diff(*b))
                .max()
                .unwrap_or(0);
            assert!(
                decode_diff <= JPEG_DECODE_TOLERANCE,
                "{name}: JPEG decode differs from Pillow's by {decode_diff} levels"
            );
            let pillow_image =
                RgbImage::from_raw(w as u32, h as u32, pillow_rgb).expect("w*h*3 bytes");
            paths.push(("preprocess(Pillow RGB)", preprocess(&pillow_image, &cfg)));
        }

        // Sizes, grid and tokens depend only on the header: exact from the bytes for JPEG too.
        let from_bytes = process_image_bytes(&bytes, &cfg)
            .unwrap_or_else(|e| panic!("{name}: process_image_bytes: {e}"));
        assert_eq!(
            (
                from_bytes.grid_thw[..].to_vec(),
                from_bytes.num_tokens as u64
            ),
            (
                usizes(&case["grid_thw"]),
                case["num_tokens"].as_u64().unwrap()
            ),
            "{name}: grid and tokens from bytes"
        );
        for (what, out) in paths {
            let out = out.unwrap_or_else(|e| panic!("{name}: {what}: {e}"));
            let resized = usizes(&case["resized"]);
            let padded = usizes(&case["padded"]);
            assert_eq!(
                [
                    out.plan.resized_width as usize,
                    out.plan.resized_height as usize
                ],
                resized[..],
                "{name}: resized size"
            );
            assert_eq!(
                [out.plan.width as usize, out.plan.height as usize],
                padded[..],
                "{name}: padded size"
            );
            assert_eq!(
                out.grid_thw[..],
                usizes(&case["grid_thw"])[..],
                "{name}: grid_thw"
            );
            assert_eq!(
                out.num_tokens as u64,
                case["num_tokens"].as_u64().unwrap(),
                "{name}: tokens"
            );
            assert_eq!(
                usizes(&case["pixel_values_shape"]),
                [out.num_patches(), 3, 14, 14],
                "{name}: shape"
            );
            let (max, differing) = compare(&out.pixel_values, &theirs);
            assert!(
                max <= PIXEL_TOLERANCE,
                "{name}: {what}: max |Δ| {max} ({differing} values differ)"
            );
        }
    }
}

#[test]
fn video_chunks_match_kimi_k25_video_processor() {
    let manifest = manifest();
    let cases = manifest["videos"].as_array().expect("video cases");
    assert!(cases.len() >= 2, "fixture set is complete");
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let cfg = ImageProcessorConfig::kimi_k25()
            .with_kwargs(&case["kwargs"])
            .unwrap_or_else(|e| panic!("{name}: kwargs: {e}"));
        let frames: Vec<RgbImage> = case["frames"]
            .as_array()
            .expect("frames")
            .iter()
            .map(|f| decode(&read(f)))
            .collect();
        let timestamps: Vec<f64> = case["timestamps"]
            .as_array()
            .expect("timestamps")
            .iter()
            .map(|t| t.as_f64().expect("seconds"))
            .collect();
        let chunks = chunk_frames(&frames, &timestamps, &cfg)
            .unwrap_or_else(|e| panic!("{name}: chunk_frames: {e}"));
        let expected = case["chunks"].as_array().expect("chunks");
        assert_eq!(chunks.len(), expected.len(), "{name}: chunk count");
        let resized = usizes(&case["resized"]);
        for (i, (ours, theirs)) in chunks.iter().zip(expected).enumerate() {
            assert_eq!(
                ours.grid_thw[..],
                usizes(&theirs["grid_thw"])[..],
                "{name} chunk {i}: grid_thw"
            );
            assert_eq!(
                ours.num_tokens as u64,
                theirs["num_tokens"].as_u64().unwrap(),
                "{name} chunk {i}: tokens"
            );
            assert_eq!(
                ours.timestamp_text(),
                theirs["timestamp_text"].as_str().unwrap(),
                "{name} chunk {i}: timestamp"
            );
            assert!(
                ours.prompt()
                    .starts_with(theirs["timestamp_text"].as_str().unwrap()),
                "{name} chunk {i}: prompt"
            );
            assert_eq!(
                [
                    ours.plan.resized_width as usize,
                    ours.plan.resized_height as usize
                ],
                resized[..],
                "{name} chunk {i}: resized size"
            );
        }
        let ours: Vec<f32> = chunks
            .iter()
            .flat_map(|c| c.pixel_values.iter().copied())
            .collect();
        let total_patches: usize = chunks.iter().map(|c| c.num_patches()).sum();
        assert_eq!(
            usizes(&case["pixel_values_shape"]),
            [total_patches, 3, 14, 14],
            "{name}: shape"
        );
        let (max, differing) = compare(&ours, &read_f32(&case["pixel_values"]));
        assert!(
            max <= PIXEL_TOLERANCE,
            "{name}: max |Δ| {max} ({differing} values differ)"
        );
    }
}

#[test]
fn chunk_timestamps_match_python_strftime() {
    let manifest = manifest();
    for case in manifest["timestamps"].as_array().expect("timestamp cases") {
        let seconds = case["seconds"].as_f64().expect("seconds");
        assert_eq!(
            format_timestamp(seconds),
            case["text"].as_str().expect("text"),
            "{seconds} s"
        );
    }
}
