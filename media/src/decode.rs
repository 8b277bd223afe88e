//! Encoded image bytes → RGB pixels, with size limits checked before any pixel is decoded.
//!
//! Hostile input is the normal case for a server: a 60-byte PNG can claim to be
//! 100000×100000 pixels (30 GB of RGB). [`decode_image`] therefore works in two steps:
//!
//! 1. [`probe_image`] guesses the format from the magic bytes, reads only the header and
//!    checks the declared size against [`DecodeLimits`] (per side and in total). For PNG
//!    the `IHDR` dimensions are read directly from bytes 16..24 first, so even a file that
//!    is nothing but a header is rejected with the size in the message.
//! 2. Only then are the pixels decoded, with the `image` crate's own
//!    [`image::Limits`] also set (dimensions and an allocation cap) as a second line of
//!    defence.
//!
//! Colour handling matches Pillow's `Image.open(...).convert("RGB")`, which the Kimi
//! processors use: alpha is dropped (not composited), grey is replicated to three
//! channels, 16-bit samples are scaled to 8 bits, and EXIF orientation is *not* applied.

use std::io::Cursor;

use image::{ImageFormat, ImageReader, RgbImage};

use crate::error::{MediaError, Result};

/// Largest side accepted by default, in pixels.
pub const DEFAULT_MAX_SIDE: u32 = 16384;

/// Largest total pixel count accepted by default: 2^26 ≈ 67 megapixels (8192×8192),
/// which covers 50 MP phone photos; an RGB8 copy of it is 192 MiB.
pub const DEFAULT_MAX_PIXELS: u64 = 1 << 26;

/// Headroom above the decoded frame that the decoder may allocate for metadata
/// (ICC profiles, text chunks, Huffman tables).
const METADATA_ALLOC_BYTES: u64 = 64 << 20;

/// Worst-case bytes per decoded pixel before conversion to RGB8 (RGBA, 16 bits per sample).
const MAX_BYTES_PER_PIXEL: u64 = 8;

/// Size limits checked against the header before decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Longest accepted width or height in pixels (default [`DEFAULT_MAX_SIDE`]).
    pub max_side: u32,
    /// Most accepted `width * height` (default [`DEFAULT_MAX_PIXELS`]); bounds the memory a
    /// single decode can take.
    pub max_pixels: u64,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits {
            max_side: DEFAULT_MAX_SIDE,
            max_pixels: DEFAULT_MAX_PIXELS,
        }
    }
}

impl DecodeLimits {
    /// Checks a declared size against these limits (zero size is an error too).
    pub fn check(&self, width: u32, height: u32) -> Result<()> {
        if width == 0 || height == 0 {
            return Err(MediaError::ZeroSize { width, height });
        }
        if width > self.max_side || height > self.max_side {
            return Err(MediaError::TooLarge {
                width,
                height,
                limit: self.max_side,
            });
        }
        let pixels = u64::from(width) * u64::from(height);
        if pixels > self.max_pixels {
            return Err(MediaError::TooManyPixels {
                width,
                height,
                pixels,
                limit: self.max_pixels,
            });
        }
        Ok(())
    }

    /// The equivalent `image` crate limits: strict dimensions and an allocation cap.
    fn to_image_limits(self) -> image::Limits {
        let mut limits = image::Limits::default();
        limits.max_image_width = Some(self.max_side);
        limits.max_image_height = Some(self.max_side);
        limits.max_alloc = Some(
            self.max_pixels
                .saturating_mul(MAX_BYTES_PER_PIXEL)
                .saturating_add(METADATA_ALLOC_BYTES),
        );
        limits
    }
}

/// What the header of an encoded image says, read without decoding pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageInfo {
    /// The detected container format (PNG or JPEG in this build).
    pub format: ImageFormat,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
}

/// Reads the format and dimensions of an encoded image and checks them against `limits`,
/// without decoding any pixels. Use it to count an image's tokens at admission time.
pub fn probe_image(bytes: &[u8], limits: &DecodeLimits) -> Result<ImageInfo> {
    let format = detect_format(bytes)?;
    if format == ImageFormat::Png {
        if let Some((width, height)) = png_ihdr_dimensions(bytes) {
            limits.check(width, height)?;
        }
    }
    // Only the size limits are ours to report; the metadata allocation cap stays, so a
    // header stuffed with huge chunks cannot exhaust memory while we look for the size.
    let mut probe_limits = image::Limits::default();
    probe_limits.max_alloc = Some(METADATA_ALLOC_BYTES);
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
    reader.limits(probe_limits);
    let (width, height) = reader
        .into_dimensions()
        .map_err(|e| decode_error(format, e))?;
    limits.check(width, height)?;
    Ok(ImageInfo {
        format,
        width,
        height,
    })
}

/// Decodes PNG or JPEG bytes (format guessed from the content) into 8-bit RGB.
///
/// The header is probed and checked against `limits` first ([`probe_image`]), so an
/// oversized image is rejected before its pixels are allocated. Corrupt or truncated
/// data gives [`MediaError::Decode`], never a panic.
pub fn decode_image(bytes: &[u8], limits: &DecodeLimits) -> Result<RgbImage> {
    let info = probe_image(bytes, limits)?;
    let mut reader = ImageReader::with_format(Cursor::new(bytes), info.format);
    reader.limits(limits.to_image_limits());
    let image = reader.decode().map_err(|e| decode_error(info.format, e))?;
    // The header was checked, but the decoder is the authority on what it produced.
    limits.check(image.width(), image.height())?;
    Ok(image.into_rgb8())
}

/// Guesses the format from the magic bytes and keeps only those this build decodes.
fn detect_format(bytes: &[u8]) -> Result<ImageFormat> {
    if bytes.is_empty() {
        return Err(MediaError::Empty);
    }
    match image::guess_format(bytes) {
        Ok(format @ (ImageFormat::Png | ImageFormat::Jpeg)) => Ok(format),
        Ok(other) => Err(MediaError::UnsupportedFormat {
            format: format!("{other:?}"),
        }),
        Err(_) => Err(MediaError::UnknownFormat {
            magic: bytes
                .iter()
                .take(8)
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(" "),
        }),
    }
}

/// Width and height from a PNG's `IHDR` chunk, which the specification requires to be
/// the first chunk, at a fixed offset: signature (8) + length (4) + type (4) + width (4)
/// + height (4). `None` if the bytes are too short or the first chunk is not `IHDR`.
fn png_ihdr_dimensions(bytes: &[u8]) -> Option<(u32, u32)> {
    if bytes.len() < 24 || &bytes[12..16] != b"IHDR" {
        return None;
    }
    let be =
        |at: usize| u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    Some((be(16), be(20)))
}

/// Maps an `image` error to ours, keeping allocation-limit refusals distinguishable.
fn decode_error(format: ImageFormat, error: image::ImageError) -> MediaError {
    match error {
        image::ImageError::Limits(limit) => MediaError::DecoderLimit(limit.to_string()),
        source => MediaError::Decode {
            format: format!("{format:?}"),
            source,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{DynamicImage, GrayImage, Rgb, RgbaImage};

    /// A smooth colour pattern (JPEG-friendly) of the given size.
    fn gradient(width: u32, height: u32) -> RgbImage {
        RgbImage::from_fn(width, height, |x, y| {
            Rgb([
                (x * 255 / width.max(2)) as u8,
                (y * 255 / height.max(2)) as u8,
                ((x + y) % 64 + 96) as u8,
            ])
        })
    }

    fn encode(image: DynamicImage, format: ImageFormat) -> Vec<u8> {
        let mut out = Cursor::new(Vec::new());
        image
            .write_to(&mut out, format)
            .expect("encoding into memory cannot fail");
        out.into_inner()
    }

    /// CRC-32 (IEEE, reflected, poly 0xEDB88320), as PNG chunks require.
    fn crc32(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    fn png_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let start = out.len();
        out.extend_from_slice(kind);
        out.extend_from_slice(data);
        let crc = crc32(&out[start..]);
        out.extend_from_slice(&crc.to_be_bytes());
    }

    /// A syntactically valid PNG header claiming `width`×`height` RGB8 pixels, with an
    /// empty `IDAT` and `IEND` when `with_body` (57 bytes), or the `IHDR` alone (33 bytes).
    fn crafted_png(width: u32, height: u32, with_body: bool) -> Vec<u8> {
        let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
        let mut ihdr = Vec::new();
        ihdr.extend_from_slice(&width.to_be_bytes());
        ihdr.extend_from_slice(&height.to_be_bytes());
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit, RGB, deflate, adaptive, no interlace
        png_chunk(&mut out, b"IHDR", &ihdr);
        if with_body {
            png_chunk(&mut out, b"IDAT", &[]);
            png_chunk(&mut out, b"IEND", &[]);
        }
        out
    }

    #[test]
    fn png_round_trip_is_exact() {
        let original = gradient(37, 23);
        let bytes = encode(DynamicImage::ImageRgb8(original.clone()), ImageFormat::Png);
        let decoded = decode_image(&bytes, &DecodeLimits::default()).expect("valid PNG");
        assert_eq!(decoded, original);
        let info = probe_image(&bytes, &DecodeLimits::default()).expect("valid PNG");
        assert_eq!(
            info,
            ImageInfo {
                format: ImageFormat::Png,
                width: 37,
                height: 23
            }
        );
    }

    #[test]
    fn jpeg_round_trip_is_close() {
        let original = gradient(64, 48);
        let bytes = encode(DynamicImage::ImageRgb8(original.clone()), ImageFormat::Jpeg);
        assert_eq!(
            probe_image(&bytes, &DecodeLimits::default())
                .expect("JPEG")
                .format,
            ImageFormat::Jpeg
        );
        let decoded = decode_image(&bytes, &DecodeLimits::default()).expect("valid JPEG");
        assert_eq!(decoded.dimensions(), (64, 48));
        // Lossy codec (quality 75, 4:2:0): mean error under 3 levels, none over 40.
        let diffs: Vec<i32> = decoded
            .as_raw()
            .iter()
            .zip(original.as_raw())
            .map(|(&a, &b)| (i32::from(a) - i32::from(b)).abs())
            .collect();
        let mean = diffs.iter().sum::<i32>() as f64 / diffs.len() as f64;
        let max = *diffs.iter().max().expect("non-empty");
        assert!(mean < 3.0 && max <= 40, "mean {mean}, max {max}");
    }

    #[test]
    fn alpha_is_dropped_and_grey_replicated_like_pil_convert_rgb() {
        let rgba = RgbaImage::from_fn(5, 4, |x, y| {
            image::Rgba([x as u8 * 40, y as u8 * 50, 7, (x * y) as u8])
        });
        let bytes = encode(DynamicImage::ImageRgba8(rgba.clone()), ImageFormat::Png);
        let decoded = decode_image(&bytes, &DecodeLimits::default()).expect("RGBA PNG");
        for (x, y, p) in decoded.enumerate_pixels() {
            let q = rgba.get_pixel(x, y);
            assert_eq!(p.0, [q[0], q[1], q[2]], "alpha must not be composited");
        }
        let grey = GrayImage::from_fn(3, 3, |x, y| image::Luma([(x * 3 + y) as u8 * 20]));
        let bytes = encode(DynamicImage::ImageLuma8(grey.clone()), ImageFormat::Png);
        let decoded = decode_image(&bytes, &DecodeLimits::default()).expect("grey PNG");
        for (x, y, p) in decoded.enumerate_pixels() {
            let v = grey.get_pixel(x, y)[0];
            assert_eq!(p.0, [v, v, v]);
        }
    }

    #[test]
    fn empty_and_unknown_bytes_are_clear_errors() {
        assert!(matches!(
            decode_image(&[], &DecodeLimits::default()),
            Err(MediaError::Empty)
        ));
        let err =
            decode_image(b"hello, this is not an image", &DecodeLimits::default()).unwrap_err();
        assert!(matches!(err, MediaError::UnknownFormat { .. }), "{err}");
        assert!(err.to_string().contains("68 65 6c 6c 6f"), "{err}");
    }

    #[test]
    fn known_but_disabled_formats_are_unsupported() {
        let err = decode_image(
            b"GIF89a\x01\x00\x01\x00\x00\x00\x00;",
            &DecodeLimits::default(),
        )
        .unwrap_err();
        assert!(
            matches!(&err, MediaError::UnsupportedFormat { format } if format == "Gif"),
            "{err}"
        );
    }

    #[test]
    fn truncated_and_corrupt_files_are_decode_errors_not_panics() {
        let png = encode(DynamicImage::ImageRgb8(gradient(40, 30)), ImageFormat::Png);
        for cut in [9, 20, 33, png.len() / 2, png.len() - 13] {
            let err = decode_image(&png[..cut], &DecodeLimits::default()).unwrap_err();
            assert!(
                matches!(err, MediaError::Decode { .. }),
                "cut at {cut}: {err}"
            );
        }
        let mut bad_crc = png.clone();
        bad_crc[29] ^= 0xff; // inside the IHDR CRC
        assert!(decode_image(&bad_crc, &DecodeLimits::default()).is_err());

        let jpeg = encode(DynamicImage::ImageRgb8(gradient(40, 30)), ImageFormat::Jpeg);
        for cut in [3, 10, 40] {
            let err = decode_image(&jpeg[..cut], &DecodeLimits::default()).unwrap_err();
            assert!(
                matches!(err, MediaError::Decode { .. }),
                "cut at {cut}: {err}"
            );
        }
        // Scrambled entropy-coded data: any outcome but a panic is acceptable.
        let mut scrambled = jpeg.clone();
        let n = scrambled.len();
        for b in &mut scrambled[n / 2..n - 2] {
            *b = b.wrapping_mul(31).wrapping_add(7);
        }
        let _ = decode_image(&scrambled, &DecodeLimits::default());
    }

    #[test]
    fn oversized_png_header_is_rejected_before_decoding() {
        // 57 bytes claiming 100000x100000 RGB (30 GB). Were the pixels decoded, the empty
        // IDAT would make this a Decode error; TooLarge proves the header check came first.
        let bytes = crafted_png(100_000, 100_000, true);
        assert_eq!(bytes.len(), 57);
        let err = decode_image(&bytes, &DecodeLimits::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "image is 100000x100000 pixels; the limit is 16384 per side"
        );
        // The header alone (no IDAT, no IEND) is rejected the same way.
        let err = decode_image(
            &crafted_png(40_000, 30_000, false),
            &DecodeLimits::default(),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "image is 40000x30000 pixels; the limit is 16384 per side"
        );
    }

    #[test]
    fn total_pixel_limit_is_enforced_from_the_header() {
        let bytes = crafted_png(16000, 16000, true);
        let err = decode_image(&bytes, &DecodeLimits::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "image is 16000x16000 = 256000000 pixels; the limit is 67108864 pixels"
        );
        let tight = DecodeLimits {
            max_side: 64,
            max_pixels: 1000,
        };
        let png = encode(DynamicImage::ImageRgb8(gradient(40, 30)), ImageFormat::Png);
        assert!(matches!(
            decode_image(&png, &tight),
            Err(MediaError::TooManyPixels { pixels: 1200, .. })
        ));
    }

    #[test]
    fn zero_size_header_is_rejected() {
        let err = decode_image(&crafted_png(0, 10, true), &DecodeLimits::default()).unwrap_err();
        assert!(
            matches!(
                err,
                MediaError::ZeroSize {
                    width: 0,
                    height: 10
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn oversized_jpeg_header_is_rejected_before_decoding() {
        // Patch the SOF0 frame header of a real 16x16 JPEG to claim 60000x50000.
        let mut jpeg = encode(DynamicImage::ImageRgb8(gradient(16, 16)), ImageFormat::Jpeg);
        let sof = jpeg
            .windows(2)
            .position(|w| w == [0xFF, 0xC0])
            .expect("baseline JPEG has SOF0");
        jpeg[sof + 5..sof + 7].copy_from_slice(&50_000u16.to_be_bytes()); // height
        jpeg[sof + 7..sof + 9].copy_from_slice(&60_000u16.to_be_bytes()); // width
        let err = decode_image(&jpeg, &DecodeLimits::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "image is 60000x50000 pixels; the limit is 16384 per side"
        );
    }
}
