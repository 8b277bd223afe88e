//! Events on their way to one client.
//!
//! A request's channel is bounded (its credit). The scheduler only plans a
//! decode token for a client with room for it, but a final event
//! (`Finished` or `Error`) can meet a full channel; it then waits here and
//! is retried at every step instead of being dropped, so a client always
//! learns how its request ended, however slowly it reads.

use std::collections::VecDeque;

use tokio::sync::mpsc::{self, error::TrySendError};

use crate::messages::TokenEvent;

/// What a delivery attempt achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// Everything queued was sent.
    Done,
    /// The channel is full; some events still wait.
    Blocked,
    /// The client hung up; the events are dropped with it.
    Closed,
}

/// One client's channel and the events not yet delivered to it, in order.
#[derive(Debug)]
pub(crate) struct Outbox {
    /// The request's own bounded channel.
    pub(crate) events: mpsc::Sender<TokenEvent>,
    /// Events that found the channel full.
    unsent: VecDeque<TokenEvent>,
}

impl Outbox {
    /// An outbox over `events`.
    pub(crate) fn new(events: mpsc::Sender<TokenEvent>) -> Outbox {
        Outbox {
            events,
            unsent: VecDeque::new(),
        }
    }

    /// Queues `event` after the ones still waiting, to go out at the next
    /// [`Outbox::flush`].
    pub(crate) fn push(&mut self, event: TokenEvent) {
        self.unsent.push_back(event);
    }

    /// Queues `event` after the ones still waiting and sends what fits.
    pub(crate) fn send(&mut self, event: TokenEvent) -> Delivery {
        self.push(event);
        self.flush()
    }

    /// Sends waiting events until the channel is full.
    pub(crate) fn flush(&mut self) -> Delivery {
        while let Some(event) = self.unsent.pop_front() {
            match self.events.try_send(event) {
                Ok(()) => {}
                Err(TrySendError::Full(event)) => {
                    self.unsent.push_front(event);
                    return Delivery::Blocked;
                }
                Err(TrySendError::Closed(_)) => {
                    self.unsent.clear();
                    return Delivery::Closed;
                }
            }
        }
        if self.events.is_closed() {
            Delivery::Closed
        } else {
            Delivery::Done
        }
    }

    /// Whether a new token could be sent now (nothing waiting, room left).
    pub(crate) fn has_room(&self) -> bool {
        self.unsent.is_empty() && self.events.capacity() > 0
    }

    /// Whether the client hung up.
    pub(crate) fn is_closed(&self) -> bool {
        self.events.is_closed()
    }

    /// Whether the scheduler waits for this client to read.
    pub(crate) fn is_blocked(&self) -> bool {
        self.events.capacity() == 0 && !self.events.is_closed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_event_waits_for_room_instead_of_being_dropped() {
        let (tx, mut rx) = mpsc::channel(1);
        let mut out = Outbox::new(tx);
        assert_eq!(
            out.send(TokenEvent::Token {
                id: 1,
                logprob: None
            }),
            Delivery::Done
        );
        let fin = TokenEvent::Token {
            id: 2,
            logprob: None,
        };
        assert_eq!(out.send(fin.clone()), Delivery::Blocked);
        assert!(!out.has_room());
        assert_eq!(
            rx.try_recv().ok(),
            Some(TokenEvent::Token {
                id: 1,
                logprob: None
            })
        );
        assert_eq!(out.flush(), Delivery::Done);
        assert_eq!(rx.try_recv().ok(), Some(fin));
    }

    #[test]
    fn hung_up_client_drops_its_events() {
        let (tx, rx) = mpsc::channel(1);
        let mut out = Outbox::new(tx);
        drop(rx);
        assert_eq!(
            out.send(TokenEvent::Token {
                id: 1,
                logprob: None
            }),
            Delivery::Closed
        );
        assert!(out.is_closed());
    }
}
