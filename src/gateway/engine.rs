//! The gateway's only contact with the actor runtime.
//!
//! [`EngineHost`] runs the engine's actors in an actix `System` on a thread
//! of their own (the scheduler and session memory then start their own
//! arbiters), so the socket side — a multi-threaded tokio runtime — never
//! runs or waits on a forward pass: it only sends [`ValidRequest`]s to the
//! scheduler's mailbox and reads [`TokenEvent`]s from each request's
//! bounded channel. Dropping that receiver cancels the request within one
//! scheduler step. Every engine call the gateway makes goes through this
//! file, so a change of the engine's handle is a change here only.
//!
//! The host also holds the model's [`ConstraintFactory`] (token trie and
//! llguidance parser factory, built once at startup and shared by every
//! request) and the `--tool-call-constraint` switch ([`ConstraintSetup`]);
//! compiled constraints travel to the scheduler with their request
//! ([`EngineHost::submit_with`]).

use std::sync::Arc;

use caracal_actors::constraint::SeqConstraint;
use caracal_actors::engine::{CausalLm, Detokenize};
use caracal_actors::messages::{
    ErrorKind, MemoryStats, SchedulerStats, SubmitError, TokenEvent, ValidRequest,
};
use caracal_actors::runtime::{Engine, EngineConfig};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use super::error::ApiError;
use crate::constrain::ConstraintFactory;

/// Constrained decoding as the gateway serves it.
#[derive(Debug, Clone)]
pub struct ConstraintSetup {
    /// The model's factory; `None` serves no `response_format` schemas and
    /// leaves tool calls unconstrained.
    pub factory: Option<Arc<ConstraintFactory>>,
    /// Constrain tool calls to the declared tools and schemas
    /// (`--tool-call-constraint on`, the default); off parses them after
    /// the fact only.
    pub tool_calls: bool,
    /// Append the tokens a grammar forces without a step each (jump-forward).
    pub jump_forward: bool,
}

impl Default for ConstraintSetup {
    fn default() -> Self {
        ConstraintSetup {
            factory: None,
            tool_calls: true,
            jump_forward: true,
        }
    }
}

/// A running engine and the thread of its actix `System`.
pub struct EngineHost {
    /// The engine handle (cheap to clone, `Send`).
    engine: Engine,
    /// The actix system, stopped when the host is dropped.
    system: actix::System,
    /// Constrained decoding.
    constraints: ConstraintSetup,
    /// Constraint compiles in flight (at most `max_waiting_requests`, see
    /// [`EngineHost::compile_slot`]).
    compile_slots: Arc<Semaphore>,
    /// The system's thread, joined on drop.
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Engine counters for `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct EngineSnapshot {
    /// Scheduler counters (absent if the scheduler did not answer).
    pub scheduler: Option<SchedulerStats>,
    /// Session memory counters.
    pub memory: Option<MemoryStats>,
    /// Expert selection counts `[layer][expert]` with `--ep` > 1.
    pub expert_counts: Option<Vec<Vec<u64>>>,
}

impl EngineHost {
    /// Starts the engine's actors for `model` on a new thread, without
    /// constrained decoding.
    pub fn start(
        model: Arc<dyn CausalLm>,
        cfg: EngineConfig,
        detok: Option<Arc<dyn Detokenize>>,
    ) -> std::io::Result<EngineHost> {
        EngineHost::start_with(model, cfg, detok, ConstraintSetup::default())
    }

    /// Starts the engine's actors for `model` on a new thread, serving
    /// constrained decoding as `constraints` says.
    pub fn start_with(
        model: Arc<dyn CausalLm>,
        cfg: EngineConfig,
        detok: Option<Arc<dyn Detokenize>>,
        constraints: ConstraintSetup,
    ) -> std::io::Result<EngineHost> {
        let compile_slots = Arc::new(Semaphore::new(
            cfg.scheduler
                .max_waiting_requests
                .clamp(1, Semaphore::MAX_PERMITS),
        ));
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name("caracal-engine".into())
            .spawn(move || {
                let sys = actix::System::new();
                let engine = sys.block_on(async move { Engine::start(model, cfg, detok) });
                if tx.send((engine, actix::System::current())).is_ok() {
                    let _ = sys.run();
                }
            })?;
        let (engine, system) = rx.recv().map_err(|_| {
            std::io::Error::other("the engine thread ended before the engine started")
        })?;
        Ok(EngineHost {
            engine,
            system,
            constraints,
            compile_slots,
            thread: Some(thread),
        })
    }

    /// Queues a request; its events arrive on the returned receiver.
    pub async fn submit(
        &self,
        request: ValidRequest,
    ) -> Result<mpsc::Receiver<TokenEvent>, ApiError> {
        self.submit_with(request, None).await
    }

    /// Queues a request whose output follows `constraint`.
    pub async fn submit_with(
        &self,
        request: ValidRequest,
        constraint: Option<SeqConstraint>,
    ) -> Result<mpsc::Receiver<TokenEvent>, ApiError> {
        self.engine
            .try_submit_with(request, constraint)
            .map(|s| s.events)
            .map_err(submit_error)
    }

    /// A slot for compiling one request's output constraint, or
    /// `overloaded`. A grammar compiles on the blocking pool before the
    /// request reaches the admission gate, so without this bound a flood
    /// of requests with tools would queue compiles there without limit,
    /// only for most of them to be refused afterwards; at most as many
    /// compile at once as may wait for admission.
    pub fn compile_slot(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        self.compile_slots.clone().try_acquire_owned().map_err(|_| {
            ApiError::overloaded(
                "too many requests are compiling their output constraints; retry shortly",
            )
        })
    }

    /// Constrained decoding as served.
    pub fn constraints(&self) -> &ConstraintSetup {
        &self.constraints
    }

    /// Unpins `session`'s cached path and cancels its requests (a WebSocket
    /// session ended). A stopped engine has nothing left to unpin.
    pub async fn close_session(&self, session: &str) {
        let _ = self.engine.close_session(session).await;
    }

    /// Releases the cached paths that agree with `path` through the page
    /// holding token `from` and that no request holds (unpinning `session`
    /// first when given): a live video window moved on. Returns the pages
    /// freed (0 when the engine has stopped).
    pub async fn drop_path(&self, session: Option<&str>, path: Vec<u64>, from: usize) -> usize {
        self.engine
            .drop_path(session.map(String::from), path, from)
            .await
            .unwrap_or(0)
    }

    /// Current counters.
    pub async fn snapshot(&self) -> EngineSnapshot {
        let expert_counts = match &self.engine.shards {
            Some(s) => Some(s.counts().await),
            None => None,
        };
        EngineSnapshot {
            scheduler: self.engine.scheduler_stats().await,
            memory: self.engine.memory_stats().await,
            expert_counts,
        }
    }
}

/// Maps a refused submission to a client error.
fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::Overloaded { .. } => ApiError::overloaded(e.to_string()),
        SubmitError::Invalid(m) => ApiError::invalid("invalid_value", None, m),
        SubmitError::PromptTooLong { .. } => {
            ApiError::invalid("context_length_exceeded", None, e.to_string())
        }
        SubmitError::Stopped => ApiError::shutting_down(),
    }
}

/// Maps an engine error event to a client error.
pub fn event_error(kind: ErrorKind, message: String) -> ApiError {
    match kind {
        ErrorKind::Overloaded | ErrorKind::KvCacheFull => ApiError::overloaded(message),
        ErrorKind::ContextLengthExceeded => {
            ApiError::invalid("context_length_exceeded", None, message)
        }
        ErrorKind::InvalidRequest => ApiError::invalid("invalid_value", None, message),
        ErrorKind::EngineStopped => ApiError::shutting_down(),
        ErrorKind::Cancelled | ErrorKind::InternalError => ApiError::internal(message),
        ErrorKind::ConstraintViolation => ApiError {
            code: "constraint_violation",
            ..ApiError::internal(message)
        },
    }
}

impl Drop for EngineHost {
    fn drop(&mut self) {
        self.system.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
