//! The `HH:MM:SS.mmm` timestamps that precede each video chunk in a Kimi prompt.
//!
//! The reference processor (Moonshot `kimi_k25_vision_processing.py`, reproduced by
//! vLLM and transformers; `video-anchors.md` §1.1) formats a chunk's first-frame time as
//! `time.strftime("%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}"`:
//!
//! - milliseconds are **truncated**, computed in `f64` exactly as Python does
//!   (`ts % 1 * 1000`, then `int`), so `0.48` gives `.480` and `0.4999` gives `.499`;
//! - `gmtime` keeps only the hour of the day, so hours **wrap past 24**
//!   (`90000.0` s = 25 h → `01:00:00.000`);
//! - negative and non-finite times are clamped to `0` (streams are relative to their
//!   first frame, so a negative time only comes from a broken timestamp).

/// Formats `seconds` as `HH:MM:SS.mmm` the way the Kimi processors do (see the module docs).
pub fn format_timestamp(seconds: f64) -> String {
    let ts = if seconds.is_finite() && seconds > 0.0 {
        seconds
    } else {
        0.0
    };
    // Python's `ts % 1` for positive `ts` is `fmod`, exact in binary floating point.
    let millis = ((ts % 1.0) * 1000.0) as u64;
    let whole = ts.floor() as u64;
    let (h, m, s) = ((whole / 3600) % 24, (whole / 60) % 60, whole % 60);
    format!("{h:02}:{m:02}:{s:02}.{millis:03}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_hours_minutes_seconds_and_truncated_millis() {
        assert_eq!(format_timestamp(0.0), "00:00:00.000");
        assert_eq!(format_timestamp(0.5), "00:00:00.500");
        assert_eq!(format_timestamp(0.4999), "00:00:00.499");
        assert_eq!(format_timestamp(61.25), "00:01:01.250");
        assert_eq!(format_timestamp(3_723.999_9), "01:02:03.999");
    }

    #[test]
    fn float_steps_match_python() {
        // Python: int(0.48 % 1 * 1000) == 480, int(1.48 % 1 * 1000) == 480,
        // int(2.3 % 1 * 1000) == 299 (2.3 % 1 == 0.2999999999999998).
        assert_eq!(format_timestamp(0.48), "00:00:00.480");
        assert_eq!(format_timestamp(1.48), "00:00:01.480");
        assert_eq!(format_timestamp(2.3), "00:00:02.299");
    }

    #[test]
    fn hours_wrap_past_a_day_and_negatives_clamp() {
        assert_eq!(format_timestamp(90_000.0), "01:00:00.000");
        assert_eq!(format_timestamp(86_399.5), "23:59:59.500");
        assert_eq!(format_timestamp(-3.0), "00:00:00.000");
        assert_eq!(format_timestamp(f64::NAN), "00:00:00.000");
    }
}
