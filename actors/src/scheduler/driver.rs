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
//!
//! **Panics are isolated here.** A panic is a bug, but one bad request must
//! not take every other stream (and the server) down with it:
//!
//! - in a step's **forward** ([`SchedulerState::forward_isolated`]): each
//!   sequence of the plan is rolled back to where the step found it and
//!   run again alone; the ones that panic again (or fail) end with
//!   [`ErrorKind::InternalError`] naming the panic, the others go on with
//!   the logits of their own forward, exactly as if they had run alone.
//!   Models with recurrent (KDA) layers cannot roll a state back, so there
//!   every sequence of the step fails;
//! - in **sampling** ([`isolate`] around it in `step`): every sequence of
//!   the step fails;
//! - anywhere else in a step or a command ([`run`]): the scheduler's state
//!   can no longer be trusted mid-way, so every request it holds fails and
//!   it carries on with an empty batch; if the panic lost pages (taken for
//!   a request but not yet recorded), session memory starts afresh, its
//!   prefix cache and pins dropped. A request the panicking code had in
//!   hand, in neither the queue nor the batch, sees its stream end without
//!   a final event (the gateway answers that with `internal_error`).
//!
//! Failing a request gives its pages and prefix lock back and caches
//! nothing (so no session pin is added); each caught panic is counted in
//! [`crate::messages::SchedulerStats::panics`] and logged with the request ids.

use std::any::Any;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::Poll;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::mpsc::{self, error::TryRecvError};

use super::{SchedulerState, StepOutcome, Work};
use crate::engine::EngineError;
use crate::messages::{ErrorKind, RequestId, SchedulerCommand};
use crate::session_memory::SessionMemory;

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

/// What woke a paused scheduler (a value that lives for one wake-up, so
/// its size does not matter).
#[allow(clippy::large_enum_variant)]
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
            Wake::Command(Some(c)) => guarded(&mut state, "a command", |s| s.handle(c)),
            Wake::Command(None) => break,
            Wake::Recheck => {}
        }
        if !drain(&mut state, &mut commands) {
            break;
        }
        outcome = StepOutcome::Ran;
        guarded(&mut state, "a step", |s| outcome = s.step());
    }
    tracing::debug!("scheduler stopped: every engine handle is gone");
}

/// Applies every queued command without waiting; false once every sender is gone.
fn drain(state: &mut SchedulerState, commands: &mut mpsc::Receiver<SchedulerCommand>) -> bool {
    loop {
        match commands.try_recv() {
            Ok(c) => guarded(state, "a command", |s| s.handle(c)),
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

/// Runs `f`; on a panic the message of its payload.
pub(super) fn isolate<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| panic_message(payload.as_ref()))
}

/// The text of a panic payload (`panic!` gives a `&str` or a `String`).
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("panic: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("panic: {s}")
    } else {
        "panic (no message)".into()
    }
}

/// Runs `f` on the state; a panic that escapes it fails every request the
/// scheduler holds (see the module docs).
fn guarded(state: &mut SchedulerState, what: &str, f: impl FnOnce(&mut SchedulerState)) {
    if let Err(message) = isolate(|| f(state)) {
        state.fail_everything(what, &message);
    }
}

/// What [`SchedulerState::forward_isolated`] ran.
pub(super) struct IsolatedForward {
    /// The work whose logits `result` holds (the plan, less what failed).
    pub plan: Vec<Work>,
    /// The forward's logits, or the error that fails all of `plan`.
    pub result: Result<Vec<f32>, EngineError>,
    /// Requests that failed on their own, with the message they get; failed
    /// by [`SchedulerState::fail_ids`] once the step's samples are taken.
    pub failed: Vec<(RequestId, String)>,
}

impl SchedulerState {
    /// Phase 4 with panics isolated: the batched forward over `plan`; if it
    /// panics, each work again alone from the state the step found (see
    /// the module docs).
    pub(super) fn forward_isolated(&mut self, plan: Vec<Work>) -> IsolatedForward {
        let lens: Vec<usize> = plan
            .iter()
            .map(|w| self.running[w.seq()].state.len)
            .collect();
        let prefill_before = self.stats.prefill_tokens;
        let message = match isolate(|| self.forward(&plan)) {
            Ok(result) => {
                return IsolatedForward {
                    plan,
                    result,
                    failed: Vec::new(),
                }
            }
            Err(message) => message,
        };
        self.stats.panics += 1;
        let ids: Vec<RequestId> = plan.iter().map(|w| self.running[w.seq()].id).collect();
        tracing::error!(requests = ?ids, %message, "the forward panicked");
        let failed_all = |why: &str| IsolatedForward {
            plan: Vec::new(),
            result: Ok(Vec::new()),
            failed: ids.iter().map(|&id| (id, why.to_string())).collect(),
        };
        if self.model.info().linear_layers > 0 || plan.len() == 1 {
            // One sequence is the culprit; a recurrent state cannot be rolled back.
            return failed_all(&format!(
                "the model failed on this request's step ({message})"
            ));
        }
        // Roll back and run each alone: the culprits fail, the rest go on.
        self.stats.prefill_tokens = prefill_before;
        let mut kept = Vec::with_capacity(plan.len());
        let mut logits = Vec::new();
        let mut failed = Vec::new();
        for (w, len) in plan.into_iter().zip(lens) {
            self.running[w.seq()].state.len = len;
            let id = self.running[w.seq()].id;
            match isolate(|| self.forward(&[w])) {
                Ok(Ok(rows)) => {
                    kept.push(w);
                    logits.extend(rows);
                }
                Ok(Err(e)) => failed.push((id, e.to_string())),
                Err(message) => {
                    self.stats.panics += 1;
                    tracing::error!(request = id, %message, "the forward panicked on this request alone");
                    failed.push((id, format!("the model failed on this request ({message})")));
                }
            }
        }
        IsolatedForward {
            plan: kept,
            result: Ok(logits),
            failed,
        }
    }

    /// Sampling panicked: every sequence of `plan` fails.
    pub(super) fn fail_sampling_panic(&mut self, plan: &[Work], message: &str) {
        self.stats.panics += 1;
        let ids: Vec<(RequestId, String)> = plan
            .iter()
            .map(|w| {
                let id = self.running[w.seq()].id;
                (
                    id,
                    format!("sampling failed on this request's step ({message})"),
                )
            })
            .collect();
        tracing::error!(requests = ?ids.iter().map(|i| i.0).collect::<Vec<_>>(), %message, "sampling panicked");
        self.fail_ids(ids);
    }

    /// Fails the running requests `failed` (by id, so earlier removals do
    /// not matter) with [`ErrorKind::InternalError`] and their message.
    pub(super) fn fail_ids(&mut self, failed: Vec<(RequestId, String)>) {
        for (id, message) in failed {
            if let Some(i) = self.running.iter().position(|r| r.id == id) {
                self.fail_running(i, ErrorKind::InternalError, message);
            }
        }
    }

    /// A panic escaped `what` (a step or a command): fails every running
    /// and waiting request, since the state they are in cannot be trusted.
    fn fail_everything(&mut self, what: &str, message: &str) {
        self.stats.panics += 1;
        let running: Vec<RequestId> = self.running.iter().map(|r| r.id).collect();
        let waiting: Vec<RequestId> = self.waiting.iter().map(|w| w.id).collect();
        tracing::error!(?running, ?waiting, %message, "{what} panicked; failing every request");
        let text = format!("the scheduler failed in {what} ({message})");
        while let Some(i) = self.running.len().checked_sub(1) {
            self.fail_running(i, ErrorKind::InternalError, text.clone());
        }
        let gone = self.waiting.len();
        for w in std::mem::take(&mut self.waiting) {
            self.refuse(w.events, ErrorKind::InternalError, text.clone());
        }
        self.gate.release(gone);
        // Nothing runs now, so every page must be free or cached. A panic
        // between taking a request's pages and recording them (admission,
        // finishing) loses them: start the memory afresh rather than serve
        // with pages that never come back. The prefix cache and session
        // pins go with it (later turns prefill again).
        if let Err(leak) = self.memory.check_quiescent() {
            tracing::error!(%leak, "session memory is inconsistent after the panic; starting it afresh");
            self.memory = SessionMemory::new(self.memory.config().clone());
        }
        if let Some(tx) = &self.publish {
            tx.send_replace(self.engine_stats());
        }
        self.deliver();
    }
}
