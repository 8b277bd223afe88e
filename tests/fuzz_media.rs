//! Image bytes from clients: PNG and JPEG files (encoded here from
//! pixels) mutated — bytes flipped, cut short, header sizes and chunk
//! lengths overwritten, chunks spliced — go through caracal-media's
//! decoder and preprocessing. Every input gives patches or a
//! [`MediaError`] with a stable kind, never a panic, and never one
//! allocation over 1 GiB (this test's allocator refuses it, which aborts
//! the run with the size).
//!
//! The decoder runs with tight limits (1024 per side, 2^20 pixels) so a
//! mutated header that passes them costs little, and with the K2.5
//! defaults on the unmutated-size inputs. Long run: `FUZZ_SECS=600 cargo
//! test --release --test fuzz_media -- --ignored --nocapture`.

mod fuzz_support;

use std::io::Cursor;
use std::sync::OnceLock;

use caracal_media::{
    decode_image, preprocess, probe_image, process_image_bytes, DecodeLimits, ImageProcessorConfig,
    MediaError,
};
use image::{ImageFormat, RgbImage, RgbaImage};
use proptest::prelude::*;

#[global_allocator]
static ALLOC: fuzz_support::LimitAlloc = fuzz_support::LimitAlloc;

const KINDS: &[&str] = &[
    "media_empty",
    "image_unknown_format",
    "image_unsupported_format",
    "image_too_large",
    "image_too_many_pixels",
    "image_zero_size",
    "image_too_small",
    "image_grid_too_large",
    "image_decode_failed",
    "image_decoder_limit",
    "media_config_invalid",
];

/// Seed files: PNG (RGB, RGBA, 16-bit grey, palette-free) and JPEG
/// (baseline, grey) of a few small sizes, with content that compresses
/// unevenly.
fn seeds() -> &'static [Vec<u8>] {
    static S: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    S.get_or_init(|| {
        let rgb = |w: u32, h: u32| {
            RgbImage::from_fn(w, h, |x, y| {
                image::Rgb([(x * 37 + y) as u8, (y * 91) as u8, ((x ^ y) * 13) as u8])
            })
        };
        let enc = |img: image::DynamicImage, f: ImageFormat| {
            let mut out = Cursor::new(Vec::new());
            img.write_to(&mut out, f).expect("encode seed");
            out.into_inner()
        };
        let mut v = Vec::new();
        for (w, h) in [(1, 1), (28, 28), (57, 31), (64, 130)] {
            v.push(enc(
                image::DynamicImage::ImageRgb8(rgb(w, h)),
                ImageFormat::Png,
            ));
            v.push(enc(
                image::DynamicImage::ImageRgb8(rgb(w, h)),
                ImageFormat::Jpeg,
            ));
        }
        let rgba = RgbaImage::from_fn(40, 20, |x, y| {
            image::Rgba([x as u8, y as u8, 7, (x * y) as u8])
        });
        v.push(enc(image::DynamicImage::ImageRgba8(rgba), ImageFormat::Png));
        let grey16 = image::ImageBuffer::<image::Luma<u16>, Vec<u16>>::from_fn(30, 30, |x, y| {
            image::Luma([(x * 2000 + y * 7) as u16])
        });
        v.push(enc(
            image::DynamicImage::ImageLuma16(grey16),
            ImageFormat::Png,
        ));
        let grey = image::GrayImage::from_fn(33, 17, |x, y| image::Luma([(x * y) as u8]));
        v.push(enc(
            image::DynamicImage::ImageLuma8(grey),
            ImageFormat::Jpeg,
        ));
        v
    })
}

/// One change to a seed file.
#[derive(Debug, Clone)]
enum Mutation {
    /// Overwrite the byte at a fraction of the length.
    Byte(u16, u8),
    /// Flip one bit.
    Bit(u16, u8),
    /// Overwrite four bytes (a PNG chunk length, an IHDR or SOF size) with a big-endian value.
    Word(u16, u32),
    /// Cut the file at a fraction of its length.
    Cut(u16),
    /// Copy a run of the file over another place (chunks spliced).
    Splice(u16, u16, u8),
    /// Insert bytes.
    Insert(u16, Vec<u8>),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let word = prop_oneof![
        Just(u32::MAX),
        Just(0x7fff_ffff),
        Just(0),
        Just(1),
        Just(65_535),
        Just(16_385),
        Just(1 << 20),
        any::<u32>(),
    ];
    prop_oneof![
        3 => (any::<u16>(), any::<u8>()).prop_map(|(a, b)| Mutation::Byte(a, b)),
        3 => (any::<u16>(), 0u8..8).prop_map(|(a, b)| Mutation::Bit(a, b)),
        3 => (0u16..64, word).prop_map(|(a, w)| Mutation::Word(a, w)),
        1 => any::<u16>().prop_map(Mutation::Cut),
        1 => (any::<u16>(), any::<u16>(), 1u8..64).prop_map(|(a, b, n)| Mutation::Splice(a, b, n)),
        1 => (any::<u16>(), prop::collection::vec(any::<u8>(), 1..32)).prop_map(|(a, v)| Mutation::Insert(a, v)),
    ]
}

/// Applies `m` to `bytes`. Offsets are fractions of the length, except
/// `Word`'s, which is a byte offset into the first 64 bytes (the headers).
fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let at = |x: u16, len: usize| (x as usize * len) / (u16::MAX as usize + 1);
    let len = bytes.len();
    match m {
        Mutation::Byte(a, b) => {
            if len > 0 {
                bytes[at(*a, len)] = *b;
            }
        }
        Mutation::Bit(a, bit) => {
            if len > 0 {
                bytes[at(*a, len)] ^= 1 << bit;
            }
        }
        Mutation::Word(a, w) => {
            let i = *a as usize;
            if i + 4 <= len {
                bytes[i..i + 4].copy_from_slice(&w.to_be_bytes());
            }
        }
        Mutation::Cut(a) => bytes.truncate(at(*a, len)),
        Mutation::Splice(from, to, n) => {
            let (f, t, n) = (at(*from, len), at(*to, len), *n as usize);
            if f + n <= len && t + n <= len {
                let run = bytes[f..f + n].to_vec();
                bytes[t..t + n].copy_from_slice(&run);
            }
        }
        Mutation::Insert(a, v) => {
            let i = at(*a, len);
            bytes.splice(i..i, v.iter().copied());
        }
    }
}

fn tight() -> DecodeLimits {
    DecodeLimits {
        max_side: 1024,
        max_pixels: 1 << 20,
    }
}

fn check_error(e: &MediaError) -> Result<(), TestCaseError> {
    prop_assert!(KINDS.contains(&e.kind()), "unknown kind {} ({e})", e.kind());
    prop_assert!(!e.to_string().is_empty());
    Ok(())
}

/// Decodes `bytes` (tight limits), preprocesses what decodes; checks the
/// shapes of what comes out and the kinds of the errors.
fn media_case(bytes: &[u8]) -> Result<(), TestCaseError> {
    let cfg = ImageProcessorConfig::kimi_k25();
    match probe_image(bytes, &tight()) {
        Ok(info) => prop_assert!(info.width <= 1024 && info.height <= 1024),
        Err(e) => check_error(&e)?,
    }
    match decode_image(bytes, &tight()) {
        Ok(img) => {
            prop_assert!(img.width() <= 1024 && img.height() <= 1024);
            match preprocess(&img, &cfg) {
                Ok(p) => {
                    prop_assert!(p.num_patches() > 0);
                    prop_assert_eq!(p.pixel_values.len(), p.num_patches() * 3 * 14 * 14);
                    prop_assert!(p.pixel_values.iter().all(|v| v.is_finite()));
                }
                Err(e) => check_error(&e)?,
            }
        }
        Err(e) => check_error(&e)?,
    }
    Ok(())
}

/// CRC-32 (IEEE, as PNG chunks use).
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0xEDB8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// Rewrites the CRC of every whole PNG chunk, so that a mutation inside a
/// chunk reaches the decoder's parsing instead of failing its checksum.
fn fix_png_crcs(b: &mut [u8]) {
    if !b.starts_with(b"\x89PNG\r\n\x1a\n") {
        return;
    }
    let mut at = 8;
    while at + 12 <= b.len() {
        let len = u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize;
        let Some(end) = (at + 8).checked_add(len).filter(|&e| e + 4 <= b.len()) else {
            return;
        };
        let crc = crc32(&b[at + 4..end]);
        b[end..end + 4].copy_from_slice(&crc.to_be_bytes());
        at = end + 4;
    }
}

/// Seed `seed` with `muts` applied; PNG checksums are fixed up unless `raw`.
fn mutated(seed: usize, muts: &[Mutation]) -> Vec<u8> {
    let s = seeds();
    let mut b = s[seed % s.len()].clone();
    for m in muts {
        apply(&mut b, m);
    }
    if !seed.is_multiple_of(4) {
        fix_png_crcs(&mut b);
    }
    b
}

proptest! {
    #![proptest_config(fuzz_support::config(1000))]

    #[test]
    fn mutated_images_decode_or_fail_with_a_typed_error(
        seed in any::<usize>(), muts in prop::collection::vec(mutation(), 1..6)
    ) {
        media_case(&mutated(seed, &muts))?;
    }

    #[test]
    fn arbitrary_bytes_behind_an_image_magic_fail_cleanly(
        png in any::<bool>(), tail in prop::collection::vec(any::<u8>(), 0..512)
    ) {
        let mut b: Vec<u8> = if png {
            b"\x89PNG\r\n\x1a\n".to_vec()
        } else {
            vec![0xFF, 0xD8, 0xFF]
        };
        b.extend(tail);
        media_case(&b)?;
    }
}

#[test]
fn every_seed_decodes_and_preprocesses_with_the_default_limits() {
    let cfg = ImageProcessorConfig::kimi_k25();
    for (i, s) in seeds().iter().enumerate() {
        let p = process_image_bytes(s, &cfg).unwrap_or_else(|e| panic!("seed {i}: {e}"));
        assert!(p.num_patches() > 0, "seed {i}");
    }
}

#[test]
fn fixed_up_png_mutations_reach_the_decoder() {
    // With checksums fixed, changed pixels of an uncompressed-size-preserving
    // mutation still decode: the fuzzing reaches past the chunk checks.
    let png = seeds()[2].clone();
    let crc_ok = (0..png.len()).filter(|&i| {
        let mut b = png.clone();
        b[i] ^= 0x01;
        fix_png_crcs(&mut b);
        decode_image(&b, &tight()).is_ok()
    });
    assert!(
        crc_ok.count() > 0,
        "some one-bit mutations decode once checksums are fixed"
    );
    let mut b = png.clone();
    fix_png_crcs(&mut b);
    assert_eq!(
        b, png,
        "fixing the checksums of an intact file changes nothing"
    );
}

#[test]
fn header_sizes_past_the_limits_are_refused_before_decoding() {
    // PNG IHDR width at byte 16, height at 20; each seed cut to its header.
    let png = &seeds()[0];
    for (w, h) in [
        (u32::MAX, 1),
        (1, u32::MAX),
        (16_385, 16_385),
        (1 << 20, 1 << 20),
        (0, 5),
    ] {
        let mut b = png.clone();
        b[16..20].copy_from_slice(&w.to_be_bytes());
        b[20..24].copy_from_slice(&h.to_be_bytes());
        let Err(e) = process_image_bytes(&b, &ImageProcessorConfig::kimi_k25()) else {
            panic!("a {w}x{h} header is accepted");
        };
        assert!(KINDS.contains(&e.kind()), "{e}");
    }
}

#[test]
#[ignore = "long run: FUZZ_SECS=600 cargo test --release --test fuzz_media -- --ignored"]
fn soak_media_decoder() {
    fuzz_support::soak(
        "media decoder",
        (any::<usize>(), prop::collection::vec(mutation(), 1..8)),
        |(seed, muts)| media_case(&mutated(seed, &muts)),
    );
}
