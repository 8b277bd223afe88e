//! Which decoded frames a video contributes: the two file samplers and the live one.
//!
//! All three are pure functions of frame counts and times, so they are tested without
//! decoding anything.
//!
//! - [`SamplingMode::Transformers`] (the default) is transformers 5.23's
//!   `BaseVideoProcessor.sample_frames` → `default_sample_indices_fn`, which the
//!   `Kimi_K25VideoProcessor` inherits: `num = max(1, int(total / src_fps * fps))`, indices
//!   `arange(num) * total // num` (integer floor of `i · total / num`; older releases wrote
//!   it `arange(0, total, total / num).int()`, the same values up to float rounding). The
//!   stride is not rounded and the last frame is not forced. Timestamps are
//!   `index / src_fps` (`VideoMetadata.timestamps`). transformers raises when `num >
//!   total` (an fps above the source's); here `num` is clamped to `total`, i.e. every
//!   frame.
//! - [`SamplingMode::Moonshot`] is the reference processor's `split_video_chunks`
//!   (`video-anchors.md` §1.1): `sample_fps = min(fps, src_fps)`,
//!   `n = max(round(total · sample_fps / src_fps), 1)`, indices
//!   `linspace(0, total − 1, n).round()` (both ends included; Python and NumPy round half
//!   to even). Timestamps are `index / src_fps`.
//! - [`LiveSelector`] serves streams whose length is unknown: it keeps a frame when its
//!   presentation time `t` (`pts · time_base`, relative to the first frame) reaches the
//!   next slot `k / fps`, then moves to the first slot after `t`. This is "keep when
//!   `t ≥ next_t`, `next_t += 1/fps`" without accumulated float error, and a pause in the
//!   stream does not release a burst of catch-up frames. On a constant-rate source it
//!   keeps the first frame at or after each `k / fps` (ceiling of `k · src_fps / fps`),
//!   where the transformers sampler takes the floor of `i · total / num`: the two agree
//!   when `src_fps / fps` is a whole number (30 → 2 fps: 0, 15, 30, ...) and otherwise
//!   differ by at most one source frame per pick (25 → 2 fps: live 0, 13, 25, 38;
//!   transformers 0, 12, 25, 37). The Moonshot sampler spreads `n` picks over the whole
//!   clip, including its last frame, which a live stream cannot know in advance.

/// How a video file's frames are chosen; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SamplingMode {
    /// transformers' `BaseVideoProcessor` (floor of `i · total / num`), the default.
    #[default]
    Transformers,
    /// Moonshot's reference processor (`linspace` over both ends, rounded).
    Moonshot,
}

impl SamplingMode {
    /// The stable name of the mode (`"transformers"`, `"moonshot"`).
    pub fn name(self) -> &'static str {
        match self {
            SamplingMode::Transformers => "transformers",
            SamplingMode::Moonshot => "moonshot",
        }
    }

    /// The source frame indices this mode takes from a `total`-frame clip whose average
    /// rate is `src_fps`, at the requested `fps`; sorted, without repeats.
    pub fn indices(self, total: u64, src_fps: f64, fps: f64) -> Vec<u64> {
        match self {
            SamplingMode::Transformers => transformers_indices(total, src_fps, fps),
            SamplingMode::Moonshot => moonshot_indices(total, src_fps, fps),
        }
    }
}

/// transformers' `default_sample_indices_fn` with `fps` (see the module docs).
pub fn transformers_indices(total: u64, src_fps: f64, fps: f64) -> Vec<u64> {
    if total == 0 || src_fps.is_nan() || src_fps <= 0.0 || fps.is_nan() || fps <= 0.0 {
        return Vec::new();
    }
    // Python: max(1, int(total_num_frames / video_fps * fps)), same operation order.
    let num = ((total as f64 / src_fps * fps) as u64).clamp(1, total);
    (0..num)
        .map(|i| (u128::from(i) * u128::from(total) / u128::from(num)) as u64)
        .collect()
}

/// Moonshot's `linspace(0, total − 1, n).round()` sampler (see the module docs).
pub fn moonshot_indices(total: u64, src_fps: f64, fps: f64) -> Vec<u64> {
    if total == 0 || src_fps.is_nan() || src_fps <= 0.0 || fps.is_nan() || fps <= 0.0 {
        return Vec::new();
    }
    let sample_fps = fps.min(src_fps);
    let n = ((total as f64 * sample_fps / src_fps).round_ties_even() as u64).clamp(1, total);
    if n == 1 {
        return vec![0];
    }
    // NumPy's linspace: y_i = i * ((stop - start) / (n - 1)), last element set to stop.
    let stop = (total - 1) as f64;
    let step = stop / (n - 1) as f64;
    let mut out: Vec<u64> = (0..n)
        .map(|i| {
            let y = if i == n - 1 { stop } else { i as f64 * step };
            y.round_ties_even() as u64
        })
        .collect();
    out.dedup();
    out
}

/// Tolerance when comparing a frame time with a slot time: far below any frame interval,
/// above the rounding of `pts · time_base` in `f64`.
const SLOT_EPSILON: f64 = 1e-6;

/// Picks frames of a stream of unknown length by presentation time (see the module docs).
#[derive(Debug, Clone)]
pub struct LiveSelector {
    /// Requested output rate in frames per second; positive and finite.
    fps: f64,
    /// The next slot: a frame at `t ≥ next_slot / fps` is kept.
    next_slot: u64,
}

impl LiveSelector {
    /// A selector for `fps` output frames per second (positive and finite; checked by
    /// [`crate::video::VideoOptions::validate`]).
    pub fn new(fps: f64) -> LiveSelector {
        LiveSelector { fps, next_slot: 0 }
    }

    /// Whether the frame at `t` seconds (relative to the first frame) is kept; advances
    /// the slot when it is.
    pub fn keep(&mut self, t: f64) -> bool {
        let slot_time = self.next_slot as f64 / self.fps;
        if t + SLOT_EPSILON < slot_time {
            return false;
        }
        let reached = ((t + SLOT_EPSILON) * self.fps).floor().max(0.0) as u64;
        self.next_slot = (self.next_slot + 1).max(reached + 1);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transformers_floors_the_unrounded_stride() {
        // 75 frames at 25 fps, 2 fps: num = int(3 * 2) = 6, stride 12.5.
        assert_eq!(transformers_indices(75, 25.0, 2.0), [0, 12, 25, 37, 50, 62]);
        // 60 frames at 30 fps: stride 15.
        assert_eq!(transformers_indices(60, 30.0, 2.0), [0, 15, 30, 45]);
        // Very short clip: at least one frame.
        assert_eq!(transformers_indices(3, 30.0, 2.0), [0]);
    }

    #[test]
    fn transformers_clamps_fps_above_the_source_to_every_frame() {
        assert_eq!(transformers_indices(5, 10.0, 60.0), [0, 1, 2, 3, 4]);
        assert!(transformers_indices(0, 30.0, 2.0).is_empty());
    }

    #[test]
    fn moonshot_includes_both_ends_and_rounds_half_to_even() {
        // 75 frames at 25 fps, 2 fps: n = round(6.0) = 6, linspace(0, 74, 6) =
        // 0, 14.8, 29.6, 44.4, 59.2, 74.
        assert_eq!(moonshot_indices(75, 25.0, 2.0), [0, 15, 30, 44, 59, 74]);
        // n = round(2.5) = 2 (half to even): 0 and the last frame.
        assert_eq!(moonshot_indices(5, 2.0, 1.0), [0, 4]);
        // sample_fps = min(fps, src_fps): asking for more than the source gives all.
        assert_eq!(moonshot_indices(4, 2.0, 30.0), [0, 1, 2, 3]);
        assert_eq!(moonshot_indices(1, 30.0, 2.0), [0]);
    }

    #[test]
    fn live_selector_keeps_first_frame_at_or_after_each_slot() {
        let mut sel = LiveSelector::new(2.0);
        let kept: Vec<u64> = (0..75u64).filter(|&i| sel.keep(i as f64 / 25.0)).collect();
        assert_eq!(kept, [0, 13, 25, 38, 50, 63]);
        let mut sel = LiveSelector::new(2.0);
        let kept: Vec<u64> = (0..60u64).filter(|&i| sel.keep(i as f64 / 30.0)).collect();
        assert_eq!(kept, transformers_indices(60, 30.0, 2.0));
    }

    #[test]
    fn live_selector_does_not_burst_after_a_gap() {
        let mut sel = LiveSelector::new(2.0);
        assert!(sel.keep(0.0));
        assert!(!sel.keep(0.2));
        // A 10 s pause: one frame kept, then the normal cadence resumes.
        assert!(sel.keep(10.2));
        assert!(!sel.keep(10.3));
        assert!(!sel.keep(10.45));
        assert!(sel.keep(10.5));
    }
}
