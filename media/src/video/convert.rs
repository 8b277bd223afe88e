//! Decoded frame (YUV, any FFmpeg pixel format) → 8-bit RGB at the output size.
//!
//! Only frames the sampler keeps come here, so conversion and resizing are never spent
//! on frames that are thrown away. Two paths ([`ScalePath`]):
//!
//! - [`ScalePath::Exact`] (the default): `sws_scale` to RGB24 at the source size with
//!   the flags PyAV's `to_ndarray(format="rgb24")` uses (`SWS_BILINEAR`, which at equal
//!   sizes only upsamples chroma), then the Pillow-exact bicubic resize of
//!   [`crate::resize_bicubic`] to the target size. The reference processors decode to
//!   RGB at the source size and then resize with their own resampler (Moonshot: Pillow
//!   bicubic per frame; transformers: its torch bicubic), so pixel fidelity to them needs
//!   the RGB frame at the source size first; one swscale step cannot reproduce Pillow's
//!   antialiased kernel.
//! - [`ScalePath::Fast`]: one `sws_scale` straight from the decoder's format to RGB24 at
//!   the target size (`SWS_BICUBIC | SWS_ACCURATE_RND`): no full-size RGB copy, a
//!   different (non-antialiased when shrinking a lot) kernel, so pixels differ from the
//!   reference by more than rounding.
//!
//! Colour: the frame's matrix (BT.601 when untagged, BT.709, BT.2020, ...) and range
//! (limited, or full for JPEG-range/`yuvj*` formats) are passed to swscale, as PyAV does
//! from the frame's tags. The output is full-range RGB.

use ffmpeg::format::Pixel;
use ffmpeg::software::scaling::{self, Flags};
use ffmpeg::util::color;
use ffmpeg::util::frame::Video as AvFrame;
use ffmpeg_next as ffmpeg;
use image::RgbImage;

use crate::error::{MediaError, Result};
use crate::resample::resize_bicubic;

/// How a kept frame is brought to the output size; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScalePath {
    /// RGB at the source size, then the Pillow-exact bicubic resize (the default).
    #[default]
    Exact,
    /// One swscale bicubic step from the decoded format to RGB at the target size.
    Fast,
}

/// What a cached swscale context was built for.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Key {
    format: Pixel,
    width: u32,
    height: u32,
    matrix: i32,
    full_range: bool,
    target: (u32, u32),
    path: ScalePath,
}

/// A swscale context and its output frame, rebuilt only when the input changes.
pub(crate) struct Converter {
    /// The input the context was built for.
    key: Key,
    /// The scaler.
    sws: scaling::Context,
    /// Reused RGB24 output frame.
    rgb: AvFrame,
}

// SAFETY: the swscale context is used only through `&mut Converter`, from one thread at a
// time; it holds no thread-local state.
unsafe impl Send for Converter {}

impl Converter {
    /// Converts `frame` to RGB at `target` (width, height) along `path`, reusing the
    /// scaler from `cache` when the input is unchanged.
    pub(crate) fn convert(
        cache: &mut Option<Converter>,
        frame: &AvFrame,
        target: (u32, u32),
        path: ScalePath,
    ) -> Result<RgbImage> {
        let key = Key {
            format: frame.format(),
            width: frame.width(),
            height: frame.height(),
            matrix: swscale_matrix(frame.color_space()),
            full_range: frame.color_range() == color::Range::JPEG
                || matches!(
                    frame.format(),
                    Pixel::YUVJ420P | Pixel::YUVJ422P | Pixel::YUVJ444P | Pixel::YUVJ440P
                ),
            target,
            path,
        };
        if cache.as_ref().is_none_or(|c| c.key != key) {
            *cache = Some(Converter::new(key)?);
        }
        let conv = cache.as_mut().expect("built just above");
        conv.sws
            .run(frame, &mut conv.rgb)
            .map_err(|e| MediaError::VideoDecode {
                reason: format!("pixel conversion failed: {e}"),
            })?;
        let (w, h) = (conv.sws.output().width, conv.sws.output().height);
        let rgb = copy_rows(&conv.rgb, w, h);
        Ok(if (w, h) == target {
            rgb
        } else {
            resize_bicubic(&rgb, target.0, target.1)
        })
    }

    fn new(key: Key) -> Result<Converter> {
        let (out, flags) = match key.path {
            ScalePath::Exact => ((key.width, key.height), Flags::BILINEAR),
            ScalePath::Fast => (key.target, Flags::BICUBIC | Flags::ACCURATE_RND),
        };
        let mut sws = scaling::Context::get(
            key.format,
            key.width,
            key.height,
            Pixel::RGB24,
            out.0,
            out.1,
            flags,
        )
        .map_err(|e| MediaError::VideoDecode {
            reason: format!(
                "no pixel conversion from {:?} {}x{}: {e}",
                key.format, key.width, key.height
            ),
        })?;
        // SAFETY: `sws` is a valid context; the coefficient tables are static in swscale.
        // The call fails harmlessly (returns -1) for RGB inputs, where there is no matrix.
        unsafe {
            let inv = ffmpeg::ffi::sws_getCoefficients(key.matrix);
            let fwd = ffmpeg::ffi::sws_getCoefficients(ffmpeg::ffi::SWS_CS_DEFAULT);
            ffmpeg::ffi::sws_setColorspaceDetails(
                sws.as_mut_ptr(),
                inv,
                i32::from(key.full_range),
                fwd,
                1,
                0,
                1 << 16,
                1 << 16,
            );
        }
        Ok(Converter {
            key,
            sws,
            rgb: AvFrame::empty(),
        })
    }
}

/// The swscale matrix id for a frame's colour-space tag (BT.601 when untagged).
fn swscale_matrix(space: color::Space) -> i32 {
    use ffmpeg::ffi;
    match space {
        color::Space::BT709 => ffi::SWS_CS_ITU709,
        color::Space::FCC => ffi::SWS_CS_FCC,
        color::Space::SMPTE240M => ffi::SWS_CS_SMPTE240M,
        color::Space::BT2020NCL | color::Space::BT2020CL => ffi::SWS_CS_BT2020,
        _ => ffi::SWS_CS_DEFAULT,
    }
}

/// Copies an RGB24 frame into a tightly packed image, row by row: FFmpeg pads each row
/// to its stride.
fn copy_rows(rgb: &AvFrame, width: u32, height: u32) -> RgbImage {
    let stride = rgb.stride(0);
    let row = width as usize * 3;
    let data = rgb.data(0);
    let mut out = Vec::with_capacity(row * height as usize);
    for y in 0..height as usize {
        out.extend_from_slice(&data[y * stride..y * stride + row]);
    }
    RgbImage::from_raw(width, height, out).expect("buffer holds width*height*3 bytes")
}
