//! Not decoding the frames a file's sampler will not take.
//!
//! The file samplers ([`crate::video::SamplingMode`]) choose frame indices before the
//! first packet is decoded, and a frame's index is its rank in presentation order. A
//! demux-only pass gives every video packet's `pts`; sorted, the `pts` at rank `i` is the
//! presentation time of frame `i`, so each packet can be told, before it goes to the
//! decoder, whether the frame it carries is taken. Packets whose frame is not taken are
//! sent with the codec context's `skip_frame = AVDISCARD_NONREF` (FFmpeg's `-skip_frame
//! noref`): a frame no other frame predicts from is then not decoded at all, while
//! reference frames still are, so every taken frame is decoded from exactly the same
//! references as without the skip and is bit-identical. With libx264's default B-frames
//! about 40% of the frames of a clip are never decoded.
//!
//! The plan applies only where the mapping is certain ([`SkipPlan::new`]): the packets
//! from the first keyframe on carry a `pts` each, no two alike, and there are exactly as
//! many as the frame count the sampler used. While decoding, [`SkipPlan::index_of`]
//! checks every frame that comes out: its `pts` must be in the table, later than the last
//! one, and every frame between the two must have been one sent for skipping (not taken).
//! An interlaced frame (two fields may be two packets) also breaks the plan. The file
//! path ([`crate::video::file`]) then decodes the file again without the plan, as it does
//! after any failure with one, so a file the plan does not fit decodes exactly as before.
//! Reference: FFmpeg's `AVCodecContext.skip_frame` (h264: slices with `nal_ref_idc == 0`
//! are dropped before the picture is started, so they produce no output frame).

/// Which packets of a file may skip decoding, and the frame index of each decoded frame.
#[derive(Debug, Clone)]
pub(crate) struct SkipPlan {
    /// Every video packet's `pts` from the first keyframe on, ascending: the frame
    /// index of a `pts` is its position.
    pts: Vec<i64>,
    /// Frame indices that must be decoded, ascending: the sampler's picks and frame 0
    /// (whose time all others are measured from).
    taken: Vec<u64>,
    /// The index the next decoded frame may have at the earliest.
    next: u64,
}

/// A decoded frame does not fit the plan (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PlanBroken;

impl SkipPlan {
    /// A plan for a file whose video packets, in decode order from the first keyframe on,
    /// carry `pts` (`None` for a packet without one), sampled at `wanted` (ascending) out
    /// of `total` frames; `None` when the mapping is not certain.
    pub(crate) fn new(pts: &[Option<i64>], total: u64, wanted: &[u64]) -> Option<SkipPlan> {
        let mut sorted: Vec<i64> = pts.iter().copied().collect::<Option<Vec<i64>>>()?;
        if sorted.is_empty() || sorted.len() as u64 != total {
            return None;
        }
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return None;
        }
        if wanted.windows(2).any(|w| w[0] >= w[1]) || wanted.last().is_some_and(|&i| i >= total) {
            return None;
        }
        let mut taken = Vec::with_capacity(wanted.len() + 1);
        taken.push(0);
        taken.extend(wanted.iter().copied().filter(|&i| i > 0));
        Some(SkipPlan {
            pts: sorted,
            taken,
            next: 0,
        })
    }

    /// Whether the packet with this `pts` carries a frame that is not taken, so it may
    /// go to the decoder with `skip_frame = nonref`. Unknown packets are decoded.
    pub(crate) fn may_skip(&self, pts: Option<i64>) -> bool {
        let Some(pts) = pts else { return false };
        match self.pts.binary_search(&pts) {
            Ok(rank) => self.taken.binary_search(&(rank as u64)).is_err(),
            Err(_) => false,
        }
    }

    /// The frame index of the decoded frame with presentation time `pts`, checking that
    /// every frame between the previous one and it was one sent for skipping.
    pub(crate) fn index_of(
        &mut self,
        pts: Option<i64>,
        interlaced: bool,
    ) -> Result<u64, PlanBroken> {
        if interlaced {
            return Err(PlanBroken);
        }
        let pts = pts.ok_or(PlanBroken)?;
        let rank = self.pts.binary_search(&pts).map_err(|_| PlanBroken)? as u64;
        if rank < self.next {
            return Err(PlanBroken);
        }
        // A taken frame in [next, rank) did not come out: the decoder dropped it.
        let from = self.taken.partition_point(|&i| i < self.next);
        if self.taken.get(from).is_some_and(|&i| i < rank) {
            return Err(PlanBroken);
        }
        self.next = rank + 1;
        Ok(rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decode order of an IBBBP… stream: pts 0, 4, 1, 2, 3, 8, 5, 6, 7.
    fn ibbbp() -> Vec<Option<i64>> {
        [0, 4, 1, 2, 3, 8, 5, 6, 7].into_iter().map(Some).collect()
    }

    #[test]
    fn packets_of_untaken_frames_may_skip() {
        let plan = SkipPlan::new(&ibbbp(), 9, &[0, 3, 6]).expect("certain");
        let skippable: Vec<i64> = (0..9).filter(|&p| plan.may_skip(Some(p))).collect();
        assert_eq!(skippable, [1, 2, 4, 5, 7, 8]);
        assert!(!plan.may_skip(None));
        assert!(!plan.may_skip(Some(42)));
    }

    #[test]
    fn frame_zero_is_always_decoded() {
        let plan = SkipPlan::new(&ibbbp(), 9, &[3]).expect("certain");
        assert!(!plan.may_skip(Some(0)));
        assert!(!plan.may_skip(Some(3)));
    }

    #[test]
    fn uncertain_mappings_get_no_plan() {
        // A packet without pts, a repeated pts, a count that differs from the sampler's.
        let mut pts = ibbbp();
        pts[3] = None;
        assert!(SkipPlan::new(&pts, 9, &[0]).is_none());
        let mut pts = ibbbp();
        pts[3] = Some(1);
        assert!(SkipPlan::new(&pts, 9, &[0]).is_none());
        assert!(SkipPlan::new(&ibbbp(), 10, &[0]).is_none());
        assert!(SkipPlan::new(&[], 0, &[]).is_none());
        assert!(SkipPlan::new(&ibbbp(), 9, &[0, 9]).is_none());
    }

    #[test]
    fn decoded_frames_get_their_rank_and_dropped_taken_frames_break_the_plan() {
        // Frames 1, 2 skipped (non-reference), 3 taken, 4 a reference frame not taken.
        let mut plan = SkipPlan::new(&ibbbp(), 9, &[0, 3, 6]).expect("certain");
        assert_eq!(plan.index_of(Some(0), false), Ok(0));
        assert_eq!(plan.index_of(Some(3), false), Ok(3));
        assert_eq!(plan.index_of(Some(4), false), Ok(4));
        // Frame 6 is taken: 8 coming out after 4 means 6 was lost.
        assert_eq!(plan.index_of(Some(8), false), Err(PlanBroken));
        let mut plan = SkipPlan::new(&ibbbp(), 9, &[0, 3, 6]).expect("certain");
        assert_eq!(plan.index_of(Some(0), false), Ok(0));
        // Out of order, unknown, without pts, interlaced.
        assert_eq!(plan.index_of(Some(0), false), Err(PlanBroken));
        assert_eq!(plan.index_of(Some(42), false), Err(PlanBroken));
        assert_eq!(plan.index_of(None, false), Err(PlanBroken));
        assert_eq!(plan.index_of(Some(1), true), Err(PlanBroken));
    }
}
