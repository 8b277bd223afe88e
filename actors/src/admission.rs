//! The admission bound shared by the submitting side and the scheduler.
//!
//! [`AdmissionGate`] counts requests that were accepted but not yet
//! admitted to the running batch (still in the command queue, or in the
//! scheduler's waiting list) and hands out request ids. Submitting takes a
//! waiting slot without waiting for the scheduler: online callers take it
//! with [`AdmissionGate::try_acquire`], and a full gate is answered with
//! [`SubmitError::Overloaded`] at once; offline callers (`caracal batch`)
//! wait for one with [`AdmissionGate::acquire`], first come first served.
//! The scheduler gives the slot back when the request leaves the waiting
//! list (admitted, refused or cancelled). The slots are a semaphore and the
//! ids an atomic: the scheduler's own state stays single-owner.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::{Semaphore, TryAcquireError};

use crate::messages::{RequestId, SubmitError};

/// Waiting-request slots with a limit, and the request id source.
#[derive(Debug)]
pub struct AdmissionGate {
    /// One permit per free waiting slot.
    slots: Semaphore,
    /// Most waiting requests (`--max-waiting-requests`).
    limit: usize,
    /// Next request id (ids start at 1).
    next_id: AtomicU64,
}

impl AdmissionGate {
    /// A gate that lets `limit` requests wait.
    pub fn new(limit: usize) -> AdmissionGate {
        let limit = limit.min(Semaphore::MAX_PERMITS);
        AdmissionGate {
            slots: Semaphore::new(limit),
            limit,
            next_id: AtomicU64::new(1),
        }
    }

    /// Takes a waiting slot, or says the queue is full.
    pub fn try_acquire(&self) -> Result<(), SubmitError> {
        match self.slots.try_acquire() {
            Ok(permit) => {
                permit.forget();
                Ok(())
            }
            Err(TryAcquireError::NoPermits | TryAcquireError::Closed) => {
                Err(SubmitError::Overloaded {
                    waiting: self.waiting(),
                    limit: self.limit,
                })
            }
        }
    }

    /// Waits for a waiting slot (in arrival order). A gate that lets no
    /// request wait refuses at once instead of waiting forever.
    pub async fn acquire(&self) -> Result<(), SubmitError> {
        if self.limit == 0 {
            return self.try_acquire();
        }
        match self.slots.acquire().await {
            Ok(permit) => {
                permit.forget();
                Ok(())
            }
            Err(_) => Err(SubmitError::Stopped),
        }
    }

    /// Gives back `n` slots (requests that left the waiting list).
    pub fn release(&self, n: usize) {
        if n > 0 {
            debug_assert!(
                self.waiting() >= n,
                "released {n} slots of {}",
                self.waiting()
            );
            self.slots.add_permits(n);
        }
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.limit - self.slots.available_permits().min(self.limit)
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
    fn waiting_acquire_gets_the_released_slot() {
        let g = std::sync::Arc::new(AdmissionGate::new(1));
        g.try_acquire().expect("the only slot");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime");
        let g2 = g.clone();
        let waiter = std::thread::spawn(move || rt.block_on(g2.acquire()));
        g.release(1);
        waiter
            .join()
            .expect("waiter thread")
            .expect("the released slot");
        assert_eq!(g.waiting(), 1);
    }

    #[test]
    fn gate_without_slots_refuses_instead_of_waiting() {
        let g = AdmissionGate::new(0);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime");
        assert!(matches!(
            rt.block_on(g.acquire()),
            Err(SubmitError::Overloaded { limit: 0, .. })
        ));
    }

    #[test]
    fn ids_are_distinct_and_start_at_one() {
        let g = AdmissionGate::new(0);
        assert_eq!((g.next_id(), g.next_id()), (1, 2));
    }
}
