//! The session's `video` settings (`session.update {"session": {"video": {...}}}`,
//! echoed as `session.video`): how a live stream on the Realtime socket is read,
//! how much of it stays in context and what is asked of it on a cadence
//! (`docs/protocol.md`, "Live video (Realtime)").
//!
//! Every field is optional in an update; an absent field keeps its value, a
//! `null` `analysis_interval` turns the cadence off. `fps` and `format` decide how
//! an open stream is decoded, so changing them while one is open is refused with
//! `video_stream_active`; the window and the cadence may change at any time.

use caracal_media::video::Container;
use serde_json::{json, Map, Value};

use crate::gateway::error::{ApiError, ApiResult};
use crate::gateway::fields::Fields;
use crate::request::MAX_OUTPUT_TOKENS;

/// Frames taken per second of media time by default (Kimi K2.5's `sample_fps`).
pub const DEFAULT_FPS: f64 = 2.0;
/// The highest `fps` a live stream may ask for.
pub const MAX_FPS: f64 = 30.0;
/// Media seconds kept in context by default.
pub const DEFAULT_WINDOW_SECONDS: f64 = 120.0;
/// The cadence question's text by default.
pub const DEFAULT_ANALYSIS_PROMPT: &str = "Describe what is happening in the video now.";
/// The cadence answer's output budget by default.
pub const DEFAULT_ANALYSIS_MAX_OUTPUT_TOKENS: usize = 128;

/// What the appended bytes of a stream are (`session.video.format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VideoFormat {
    /// Sniffed from the first append of each stream.
    #[default]
    Auto,
    /// One JPEG still per append.
    Jpeg,
    /// One PNG still per append.
    Png,
    /// Fragmented MP4.
    Mp4,
    /// WebM / Matroska (a browser's MediaRecorder).
    WebM,
    /// MPEG transport stream.
    MpegTs,
    /// Raw H.264 Annex B.
    H264,
}

impl VideoFormat {
    /// Every format, in the order the protocol lists them.
    pub const ALL: [VideoFormat; 7] = [
        VideoFormat::Auto,
        VideoFormat::Jpeg,
        VideoFormat::Png,
        VideoFormat::Mp4,
        VideoFormat::WebM,
        VideoFormat::MpegTs,
        VideoFormat::H264,
    ];

    /// The wire spelling.
    pub fn name(self) -> &'static str {
        match self {
            VideoFormat::Auto => "auto",
            VideoFormat::Jpeg => "jpeg",
            VideoFormat::Png => "png",
            VideoFormat::Mp4 => "mp4",
            VideoFormat::WebM => "webm",
            VideoFormat::MpegTs => "mpegts",
            VideoFormat::H264 => "h264",
        }
    }

    /// The format a wire spelling names.
    pub fn parse(s: &str) -> Option<VideoFormat> {
        Self::ALL.into_iter().find(|f| f.name() == s)
    }

    /// Whether each append is one still image.
    pub fn is_still(self) -> bool {
        matches!(self, VideoFormat::Jpeg | VideoFormat::Png)
    }

    /// The container the live decoder is told to expect (`Auto` probes).
    pub fn container(self) -> Container {
        match self {
            VideoFormat::Mp4 => Container::Mp4,
            VideoFormat::WebM => Container::WebM,
            VideoFormat::MpegTs => Container::MpegTs,
            VideoFormat::H264 => Container::H264,
            VideoFormat::Auto | VideoFormat::Jpeg | VideoFormat::Png => Container::Auto,
        }
    }
}

/// The effective `session.video` object.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoSettings {
    /// Frames taken per second of media time, in (0, [`MAX_FPS`]]; default [`DEFAULT_FPS`].
    pub fps: f64,
    /// What appended bytes are; default [`VideoFormat::Auto`].
    pub format: VideoFormat,
    /// Media seconds kept in context (0: no window); default [`DEFAULT_WINDOW_SECONDS`].
    pub window_seconds: f64,
    /// Media seconds between cadence questions; `None` (the default) for none.
    pub analysis_interval: Option<f64>,
    /// The cadence question; default [`DEFAULT_ANALYSIS_PROMPT`].
    pub analysis_prompt: String,
    /// The cadence answer's output budget, in [1, 32768]; default
    /// [`DEFAULT_ANALYSIS_MAX_OUTPUT_TOKENS`].
    pub analysis_max_output_tokens: usize,
}

impl Default for VideoSettings {
    fn default() -> Self {
        VideoSettings {
            fps: DEFAULT_FPS,
            format: VideoFormat::Auto,
            window_seconds: DEFAULT_WINDOW_SECONDS,
            analysis_interval: None,
            analysis_prompt: DEFAULT_ANALYSIS_PROMPT.into(),
            analysis_max_output_tokens: DEFAULT_ANALYSIS_MAX_OUTPUT_TOKENS,
        }
    }
}

/// A number field of `session.video` that must be finite and pass `ok`.
fn number(
    f: &Fields<'_>,
    key: &str,
    ok: impl Fn(f64) -> bool,
    range: &str,
) -> ApiResult<Option<f64>> {
    let Some(x) = f.get::<f64>(key, "a number")? else {
        return Ok(None);
    };
    if !x.is_finite() || !ok(x) {
        let name = f.name(key);
        return Err(ApiError::invalid(
            "invalid_value",
            Some(&name),
            format!("`{name}` must be {range}, got {x}"),
        ));
    }
    Ok(Some(x))
}

impl VideoSettings {
    /// The settings as `session.video` shows them.
    pub fn to_json(&self) -> Value {
        json!({"fps": self.fps, "format": self.format.name(), "window_seconds": self.window_seconds,
               "analysis_interval": self.analysis_interval, "analysis_prompt": self.analysis_prompt,
               "analysis_max_output_tokens": self.analysis_max_output_tokens})
    }

    /// These settings with the fields of `obj` applied; nothing changes when any field
    /// is invalid. `stream_open` refuses a change of `fps` or `format`.
    pub fn updated(&self, obj: &Map<String, Value>, stream_open: bool) -> ApiResult<VideoSettings> {
        let f = Fields::nested(obj, "session.video");
        let mut next = self.clone();
        if let Some(fps) = number(&f, "fps", |x| x > 0.0 && x <= MAX_FPS, "in (0, 30]")? {
            next.fps = fps;
        }
        if let Some(s) = f.str("format")? {
            next.format = VideoFormat::parse(&s).ok_or_else(|| {
                let names: Vec<&str> = VideoFormat::ALL.iter().map(|f| f.name()).collect();
                ApiError::invalid(
                    "invalid_value",
                    Some("session.video.format"),
                    format!(
                        "`session.video.format` must be one of {}, got `{s}`",
                        names.join(", ")
                    ),
                )
            })?;
        }
        if let Some(w) = number(&f, "window_seconds", |x| x >= 0.0, "a number >= 0")? {
            next.window_seconds = w;
        }
        if obj.contains_key("analysis_interval") {
            next.analysis_interval =
                number(&f, "analysis_interval", |x| x > 0.0, "a number > 0 or null")?;
        }
        if let Some(p) = f.str("analysis_prompt")? {
            if p.trim().is_empty() {
                return Err(ApiError::invalid(
                    "invalid_value",
                    Some("session.video.analysis_prompt"),
                    "`session.video.analysis_prompt` must not be empty",
                ));
            }
            next.analysis_prompt = p;
        }
        if let Some(n) = f.int_in("analysis_max_output_tokens", 1, MAX_OUTPUT_TOKENS as i64)? {
            next.analysis_max_output_tokens = n as usize;
        }
        if stream_open && (next.fps != self.fps || next.format != self.format) {
            return Err(ApiError::invalid(
                "video_stream_active",
                Some("session.video"),
                "`fps` and `format` cannot change while a video stream is open: send input_video_buffer.commit or .clear first",
            ));
        }
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("an object")
    }

    #[test]
    fn updates_apply_field_by_field_and_echo() {
        let s = VideoSettings::default();
        let next = s
            .updated(
                &obj(
                    json!({"fps": 4, "window_seconds": 0, "analysis_interval": 10,
                "analysis_prompt": "What now?", "format": "mpegts"}),
                ),
                false,
            )
            .expect("valid");
        assert_eq!(next.fps, 4.0);
        assert_eq!(next.format, VideoFormat::MpegTs);
        assert_eq!(next.analysis_interval, Some(10.0));
        let echo = next.to_json();
        assert_eq!(echo["format"], "mpegts");
        assert_eq!(echo["analysis_max_output_tokens"], 128);
        let off = next
            .updated(&obj(json!({"analysis_interval": null})), true)
            .unwrap();
        assert_eq!(off.analysis_interval, None, "null turns the cadence off");
        assert_eq!(off.window_seconds, 0.0, "absent fields keep their value");
    }

    #[test]
    fn bad_values_name_the_field_and_change_nothing() {
        let s = VideoSettings::default();
        for (v, param) in [
            (json!({"fps": 0}), "session.video.fps"),
            (json!({"fps": 31}), "session.video.fps"),
            (json!({"format": "avi"}), "session.video.format"),
            (
                json!({"window_seconds": -1}),
                "session.video.window_seconds",
            ),
            (
                json!({"analysis_interval": 0}),
                "session.video.analysis_interval",
            ),
            (
                json!({"analysis_max_output_tokens": 0}),
                "session.video.analysis_max_output_tokens",
            ),
            (
                json!({"analysis_prompt": " "}),
                "session.video.analysis_prompt",
            ),
        ] {
            let e = s.updated(&obj(v.clone()), false).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{v}: {}", e.message);
        }
    }

    #[test]
    fn fps_and_format_are_fixed_while_a_stream_is_open() {
        let s = VideoSettings::default();
        let e = s.updated(&obj(json!({"fps": 1})), true).unwrap_err();
        assert_eq!(e.code, "video_stream_active");
        let e = s
            .updated(&obj(json!({"format": "webm"})), true)
            .unwrap_err();
        assert_eq!(e.code, "video_stream_active");
        let ok = s
            .updated(
                &obj(json!({"fps": 2, "window_seconds": 30, "analysis_interval": 5})),
                true,
            )
            .expect("window and cadence change at once; the same fps is no change");
        assert_eq!(ok.window_seconds, 30.0);
    }
}
