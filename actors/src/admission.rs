//! The admission bound shared by the submitting side and the scheduler.
//!
//! [`AdmissionGate`] counts requests that were accepted but not yet
//! admitted to the running batch (still in the command queue, or in the
//! scheduler's waiting list) and hands out request ids. Submitting takes a
//! slot with one atomic update, without waiting for the scheduler, and a
//! full gate is answered with [`SubmitError::Overloaded`] at once; the
//! scheduler gives the slot back when the request leaves the waiting list
//! (admitted, refused or cancelled). Two atomics, no lock: the scheduler's
//! own state stays single-owner.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::messages::{RequestId, SubmitError};

/// Waiting-request counter with a limit, and the request id source.
#[derive(Debug)]
pub struct AdmissionGate {
    /// Requests accepted and not yet admitted or refused.
    waiting: AtomicUsize,
    /// Most waiting requests (`--max-waiting-requests`).
    limit: usize,
    /// Next request id (ids start at 1).
    next_id: AtomicU64,
}

impl AdmissionGate {
    /// A gate that lets `limit` requests wait.
    pub fn new(limit: usize) -> AdmissionGate {
        AdmissionGate {
            waiting: AtomicUsize::new(0),
            limit,
            next_id: AtomicU64::new(1),
        }
    }

    /// Takes a waiting slot, or says the queue is full.
    pub fn try_acquire(&self) -> Result<(), SubmitError> {
        self.waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w < self.limit).then_some(w + 1)
            })
            .map(|_| ())
            .map_err(|waiting| SubmitError::Overloaded {
                waiting,
                limit: self.limit,
            })
    }

    /// Gives back `n` slots (requests that left the waiting list).
    pub fn release(&self, n: usize) {
        if n > 0 {
            let before = self.waiting.fetch_sub(n, Ordering::AcqRel);
            debug_assert!(before >= n, "released {n} slots of {before}");
        }
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// The limit.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// A fresh request id.
    pub fn next_id(&self) -> RequestId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_gate_refuses_until_a_slot_is_released() {
        let g = AdmissionGate::new(2);
        g.try_acquire().expect("first slot");
        g.try_acquire().expect("second slot");
        assert_eq!(
            g.try_acquire(),
            Err(SubmitError::Overloaded {
                waiting: 2,
                limit: 2
            })
        );
        g.release(1);
        assert_eq!(g.waiting(), 1);
        g.try_acquire().expect("a slot was released");
    }

    #[test]
    fn ids_are_distinct_and_start_at_one() {
        let g = AdmissionGate::new(0);
        assert_eq!((g.next_id(), g.next_id()), (1, 2));
    }
}
