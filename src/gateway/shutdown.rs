//! Graceful shutdown as a protocol (the shape of tokio-rs/mini-redis'
//! server): a broadcast of the shutdown phase that every connection and
//! stream watches, and a completion handle each connection holds a clone
//! of, so the server knows when the last one has finished.
//!
//! Phases: [`Phase::Running`] → [`Phase::Draining`] (stop accepting; open
//! streams finish their response; WebSocket sessions take no new turns and
//! close with 1001 once idle) → [`Phase::Cancel`] (after
//! `--shutdown-timeout`: running generations are cancelled, sessions send a
//! 1012 close frame and end).

use tokio::sync::{mpsc, watch};

/// Where the server is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// Serving.
    Running,
    /// Finishing open work; no new connections or turns.
    Draining,
    /// Out of time: cancel what still runs.
    Cancel,
}

/// The sending side, owned by the server loop.
#[derive(Debug)]
pub struct ShutdownController {
    /// Broadcasts the phase.
    phase: watch::Sender<Phase>,
    /// Cloned into every [`ConnectionGuard`]; the receiver ends when all are gone.
    done_tx: Option<mpsc::Sender<()>>,
    /// Ends when the last guard is dropped.
    done_rx: mpsc::Receiver<()>,
}

/// What connections and streams watch.
#[derive(Debug, Clone)]
pub struct ShutdownSignal {
    /// The phase.
    phase: watch::Receiver<Phase>,
    /// Source of guards (weak: a signal alone does not hold the server open).
    done_tx: mpsc::WeakSender<()>,
}

/// Held by a connection (or stream) while it runs.
#[derive(Debug, Clone)]
pub struct ConnectionGuard {
    /// Never sent on: dropping the last clone closes the channel.
    _done: Option<mpsc::Sender<()>>,
}

impl Default for ShutdownController {
    fn default() -> Self {
        ShutdownController::new()
    }
}

impl ShutdownController {
    /// A controller in [`Phase::Running`].
    pub fn new() -> ShutdownController {
        let (phase, _) = watch::channel(Phase::Running);
        let (done_tx, done_rx) = mpsc::channel(1);
        ShutdownController {
            phase,
            done_tx: Some(done_tx),
            done_rx,
        }
    }

    /// A signal for connections.
    pub fn signal(&self) -> ShutdownSignal {
        ShutdownSignal {
            phase: self.phase.subscribe(),
            done_tx: self
                .done_tx
                .as_ref()
                .expect("signals are handed out before wait_idle")
                .downgrade(),
        }
    }

    /// Moves to `phase` (never backwards).
    pub fn set(&self, phase: Phase) {
        self.phase.send_if_modified(|p| {
            if phase > *p {
                *p = phase;
                true
            } else {
                false
            }
        });
    }

    /// Waits until every guard is dropped.
    pub async fn wait_idle(&mut self) {
        self.done_tx = None;
        let _ = self.done_rx.recv().await;
    }
}

impl ShutdownSignal {
    /// The current phase.
    pub fn phase(&self) -> Phase {
        *self.phase.borrow()
    }

    /// Whether shutdown began.
    pub fn is_shutting_down(&self) -> bool {
        self.phase() != Phase::Running
    }

    /// Resolves once the phase is at least `phase`.
    pub async fn reached(&self, phase: Phase) {
        let mut rx = self.phase.clone();
        // An error means the controller is gone: treat as the last phase.
        let _ = rx.wait_for(|p| *p >= phase).await;
    }

    /// A guard that keeps the server's completion wait open.
    pub fn guard(&self) -> ConnectionGuard {
        ConnectionGuard {
            _done: self.done_tx.upgrade(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn waits_for_every_guard_and_phases_only_advance() {
        let mut c = ShutdownController::new();
        let s = c.signal();
        let g = s.guard();
        c.set(Phase::Cancel);
        c.set(Phase::Draining);
        assert_eq!(s.phase(), Phase::Cancel);
        s.reached(Phase::Draining).await;
        let waiter = tokio::spawn(async move {
            c.wait_idle().await;
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(g);
        waiter.await.unwrap();
    }
}
