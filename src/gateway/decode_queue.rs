//! The bounded line of videos waiting to be decoded.
//!
//! Video decoding runs on tokio's blocking pool, a few at a time (the
//! decode slots, as many as the Ingest pool has threads). Without a bound
//! on the line in front of those slots, a flood of video requests would
//! park any number of tasks there, each holding its encoded bytes. So a
//! video first takes a place in the line (slots + `--max-waiting-videos`
//! places, taken without waiting); when none is free the request is
//! refused with `overloaded` (503, `Retry-After: 1`), as a full engine
//! queue is. The place and the slot are held until the decode itself
//! ends — also when the request that asked for it is gone — so no more
//! decodes run than there are slots.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::ApiError;

/// Places in the line and decode slots.
#[derive(Debug, Clone)]
pub struct DecodeQueue {
    /// Videos decoding or waiting to: slots + waiting places.
    places: Arc<Semaphore>,
    /// Videos decoding at once.
    slots: Arc<Semaphore>,
    /// Places beyond the slots, for the refusal's message.
    max_waiting: usize,
    /// Places in all (slots + waiting).
    capacity: usize,
}

/// A video's right to decode: hold it for the whole decode.
#[derive(Debug)]
pub struct DecodeTurn {
    /// Its place in the line.
    _place: OwnedSemaphorePermit,
    /// Its decode slot.
    _slot: OwnedSemaphorePermit,
}

impl DecodeQueue {
    /// `slots` decodes at once (at least 1) and `max_waiting` videos waiting.
    pub fn new(slots: usize, max_waiting: usize) -> DecodeQueue {
        let slots = slots.max(1);
        let capacity = slots
            .saturating_add(max_waiting)
            .min(Semaphore::MAX_PERMITS);
        DecodeQueue {
            places: Arc::new(Semaphore::new(capacity)),
            slots: Arc::new(Semaphore::new(slots)),
            max_waiting,
            capacity,
        }
    }

    /// A place in the line, at once, or `overloaded` when the line is full.
    pub fn enter(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        self.places.clone().try_acquire_owned().map_err(|_| {
            ApiError::overloaded(format!(
                "{} videos are already waiting to be decoded (--max-waiting-videos); retry later",
                self.max_waiting
            ))
        })
    }

    /// Waits for a decode slot, holding `place`.
    pub async fn turn(&self, place: OwnedSemaphorePermit) -> Result<DecodeTurn, ApiError> {
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::internal("video decoding has stopped"))?;
        Ok(DecodeTurn {
            _place: place,
            _slot: slot,
        })
    }

    /// Videos decoding or waiting now.
    pub fn in_line(&self) -> usize {
        self.capacity - self.places.available_permits()
    }
}

#[cfg(test)]
mod tests {
    use super::DecodeQueue;

    #[tokio::test]
    async fn a_full_line_refuses_with_overloaded_until_a_decode_ends() {
        let q = DecodeQueue::new(2, 1);
        let a = q.turn(q.enter().expect("a slot")).await.expect("a turn");
        let b = q.turn(q.enter().expect("a slot")).await.expect("a turn");
        // The third waits for a slot; the fourth finds no place.
        let waiting = q.enter().expect("a waiting place");
        let err = q.enter().expect_err("the line is full");
        assert_eq!((err.status, err.code), (503, "overloaded"));
        assert!(
            err.message.contains("--max-waiting-videos"),
            "{}",
            err.message
        );
        assert_eq!(q.in_line(), 3);
        let pending = {
            let q = q.clone();
            tokio::spawn(async move { q.turn(waiting).await.map(|_| ()) })
        };
        tokio::task::yield_now().await;
        assert!(!pending.is_finished(), "no slot is free");
        drop(a);
        pending
            .await
            .expect("the task")
            .expect("a turn once a decode ends");
        assert_eq!(q.in_line(), 1, "the finished turn left the line");
        let again = q.enter().expect("a place again");
        drop((b, again));
        assert_eq!(q.in_line(), 0);
    }

    #[test]
    fn at_least_one_decode_runs_and_no_line_means_slots_only() {
        let q = DecodeQueue::new(0, 0);
        let first = q.enter().expect("one slot even when 0 is asked");
        assert!(q.enter().is_err(), "no waiting places");
        drop(first);
        assert!(q.enter().is_ok());
    }
}
