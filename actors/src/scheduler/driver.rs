//! The scheduler's thread: drains the command queue, steps, and sleeps
//! only when nothing can run.
//!
//! ```text
//! loop:
//!   drain every queued command (admit / cancel / session closed), never waiting
//!   step (admit → plan → forward → sample → finish → publish → deliver)
//!   Ran    → loop at once
//!   Paused → wait for a command, a blocked client reading (or hanging up),
//!            or PAUSED_RECHECK, whichever comes first
//!   Idle   → wait for a command
//! ```
//!
//! The forward blocks this thread only: submitting, cancelling and reading
//! counters never wait for it. The loop ends when every
//! [`crate::runtime::Engine`] handle (every command sender) is gone; the
//! requests still running then see their stream end.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::mpsc::{self, error::TryRecvError};

use super::{SchedulerState, StepOutcome};
use crate::messages::SchedulerCommand;

/// Longest sleep of a paused scheduler without any wake-up (default 20 ms):
/// a safety net only, since commands and reading clients wake it at once.
pub const PAUSED_RECHECK: Duration = Duration::from_millis(20);

/// Runs `state` on a thread of its own, fed by `commands`.
pub fn spawn(
    state: SchedulerState,
    commands: mpsc::Receiver<SchedulerCommand>,
) -> std::io::Result<JoinHandle<()>> {
    // A timer-only runtime to wait on several channels while paused.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    std::thread::Builder::new()
        .name("caracal-scheduler".into())
        .spawn(move || run(state, commands, rt))
}

/// What woke a paused scheduler.
enum Wake {
    /// A command, or `None` when every sender is gone.
    Command(Option<SchedulerCommand>),
    /// A client read, hung up, or the recheck timer fired.
    Recheck,
}

fn run(
    mut state: SchedulerState,
    mut commands: mpsc::Receiver<SchedulerCommand>,
    rt: tokio::runtime::Runtime,
) {
    let mut outcome = StepOutcome::Idle;
    loop {
        let woke = match outcome {
            StepOutcome::Ran => Wake::Recheck,
            StepOutcome::Idle => Wake::Command(rt.block_on(commands.recv())),
            StepOutcome::Paused => rt.block_on(async {
                let clients = any_ready(
                    state
                        .blocked_clients()
                        .map(|tx| {
                            Box::pin(async move {
                                // The permit is dropped at once: this only waits for room.
                                let _ = tx.reserve().await;
                            }) as Pin<Box<dyn Future<Output = ()> + '_>>
                        })
                        .collect(),
                );
                tokio::select! {
                    c = commands.recv() => Wake::Command(c),
                    () = clients => Wake::Recheck,
                    () = tokio::time::sleep(PAUSED_RECHECK) => Wake::Recheck,
                }
            }),
        };
        match woke {
            Wake::Command(Some(c)) => state.handle(c),
            Wake::Command(None) => break,
            Wake::Recheck => {}
        }
        if !drain(&mut state, &mut commands) {
            break;
        }
        outcome = state.step();
    }
    tracing::debug!("scheduler stopped: every engine handle is gone");
}

/// Applies every queued command without waiting; false once every sender is gone.
fn drain(state: &mut SchedulerState, commands: &mut mpsc::Receiver<SchedulerCommand>) -> bool {
    loop {
        match commands.try_recv() {
            Ok(c) => state.handle(c),
            Err(TryRecvError::Empty) => return true,
            Err(TryRecvError::Disconnected) => return false,
        }
    }
}

/// Resolves when any of `futures` does (never, when there are none).
async fn any_ready(mut futures: Vec<Pin<Box<dyn Future<Output = ()> + '_>>>) {
    std::future::poll_fn(|cx| {
        for f in &mut futures {
            if f.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
        }
        Poll::Pending
    })
    .await
}
