//! The constrained side of sampling: masks lent to the [`MaskPool`] during
//! the forward and joined before sampling, and [`accept`], which appends one
//! sampled or forced token to a sequence (grammar, client, stop checks).

use std::sync::Arc;

use super::outbox::Delivery;
use super::{Running, SchedulerState, Work};
use crate::constraint::{
    guarded_mask, ConstraintError, MaskJob, MaskPool, PendingMasks, TokenMask,
};
use crate::engine::{Detokenize, LogitsMode};
use crate::messages::{FinishReason, TokenEvent, TokenLogprob};

/// How a sequence leaves the running batch after sampling.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum End {
    /// Normally.
    Finished(FinishReason),
    /// Its grammar cannot go on; the message says why.
    ConstraintFailed(String),
}

impl SchedulerState {
    /// Lends the constraints of the sequences this plan samples to the
    /// [`MaskPool`], which computes their masks during the forward.
    pub(super) fn start_masks(&mut self, plan: &[Work]) -> Option<PendingMasks> {
        let mut jobs = Vec::new();
        for w in plan {
            if self.logits_mode(w) != LogitsMode::Last {
                continue;
            }
            let seq = w.seq();
            if let Some(constraint) = self.running[seq].constraint.take() {
                jobs.push(MaskJob {
                    seq,
                    constraint,
                    mask: None,
                });
            }
        }
        if jobs.is_empty() {
            return None;
        }
        match MaskPool::shared() {
            Some(pool) => Some(pool.start(jobs)),
            None => {
                // No pool could start: compute here, before the forward.
                for j in &mut jobs {
                    j.mask = Some(guarded_mask(j));
                }
                Some(PendingMasks::ready(jobs))
            }
        }
    }

    /// Gives the lent constraints back; the masks by running index.
    pub(super) fn join_masks(&mut self, pending: Option<PendingMasks>) -> Vec<Option<MaskResult>> {
        let mut masks: Vec<Option<MaskResult>> = (0..self.running.len()).map(|_| None).collect();
        let Some(pending) = pending else {
            return masks;
        };
        for j in pending.join() {
            self.running[j.seq].constraint = Some(j.constraint);
            masks[j.seq] = j.mask;
        }
        masks
    }
}

/// A mask computed for one sequence.
pub(super) type MaskResult = Result<TokenMask, ConstraintError>;

/// What appending one token did to its sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Appended {
    /// It goes on.
    Continue,
    /// It ends, and why.
    Ended(FinishReason),
    /// Its client hung up (reaped at the next step).
    Closed,
    /// Its grammar failed (already listed).
    Failed,
}

/// Appends token `tok` (sampled, or `forced` by the grammar) to `r`: the
/// grammar consumes it, the client gets it, then stop ids, stop strings,
/// the grammar's completion and the length limits are checked. `Err` when
/// the grammar rejects it (nothing is sent then).
pub(super) fn accept(
    r: &mut Running,
    tok: u32,
    logprob: Option<Box<TokenLogprob>>,
    detok: &Option<Arc<dyn Detokenize>>,
    max_pos: usize,
    forced: bool,
) -> Result<Appended, String> {
    if let Some(c) = r.constraint.as_mut() {
        c.consume(tok).map_err(|e| {
            if forced {
                format!("forced token: {e}")
            } else {
                e.to_string()
            }
        })?;
    }
    r.generated.push(tok);
    r.key.push(tok as u64);
    if r.out.send(TokenEvent::Token { id: tok, logprob }) == Delivery::Closed {
        return Ok(Appended::Closed);
    }
    let stop_id = r.req.stop.ids.contains(&tok);
    let stop_str = match (&mut r.stop, detok) {
        (Some(m), Some(d)) => m.push(d.as_ref(), &r.generated),
        _ => false,
    };
    let done = r.constraint.as_ref().is_some_and(|c| c.is_done());
    if stop_id || stop_str || done {
        return Ok(Appended::Ended(FinishReason::Stop));
    }
    if r.generated.len() >= r.req.max_tokens || r.req.prompt.len() + r.generated.len() >= max_pos {
        return Ok(Appended::Ended(FinishReason::Length));
    }
    Ok(Appended::Continue)
}
