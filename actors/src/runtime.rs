//! Starting the runtime: the scheduler (which owns session memory) and the
//! expert shards, each on threads of their own, and the [`Engine`] handle
//! that submits requests.
//!
//! ```text
//! Engine::submit(ValidRequest)                        Engine::memory_stats()
//!   │ AdmissionGate slot + id (full → overloaded)               ▲
//!   ▼                                                           │ EngineStats (watch,
//! command queue (bounded) ──► scheduler thread ─────────────────┘  published every step)
//!   Admit / Cancel / SessionClosed / DropPath │ owns SessionMemory (radix tree, pages, pins)
//!        ◄── TokenEvent (bounded mpsc per request)
//!                                    │ forward ──RunExperts──► ExpertShard ×N (own threads)
//! ```
//!
//! Nothing on the submitting side waits for a forward: a submission takes a
//! waiting slot and an id without locking anything the scheduler holds and
//! queues the request with `try_send` (offline callers may instead wait
//! for a slot: [`Engine::submit_queued`]); control commands wait for room
//! in the queue (bounded, never dropped); counters are read from the last
//! published snapshot.
//! Dropping the last `Engine` handle stops the scheduler after its current
//! step: requests still running see their stream end without `Finished`.

use std::sync::Arc;
use std::time::Duration;

use caracal_kernels::paged::KvDtype;
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio::sync::watch;

use crate::admission::AdmissionGate;
use crate::constraint::SeqConstraint;
use crate::engine::{CausalLm, Detokenize, ModelInfo};
use crate::expert_shard::ShardedExperts;
use crate::messages::{
    AdmitRequest, CancelRequest, DropPath, EngineStats, MemoryStats, RequestId, SchedulerCommand,
    SchedulerStats, SessionClosed, SubmitError, TokenEvent, ValidRequest,
};
use crate::scheduler::{driver, validate_request, SchedulerConfig, SchedulerState};
use crate::session_memory::{MemoryConfig, SessionMemory};

/// Command-queue slots beyond `max_waiting_requests`, for cancels and
/// session closes (admissions never take more than the waiting limit).
const CONTROL_SLOTS: usize = 64;

/// Runtime settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Scheduler settings.
    pub scheduler: SchedulerConfig,
    /// Bytes for the KV cache (`--kv-cache-memory`, default 1 GiB).
    pub kv_cache_memory: usize,
    /// Expert shards (`--ep`, default 1: experts run inside the forward).
    pub ep: usize,
    /// Events buffered per request before its decoding pauses (backpressure credit).
    pub stream_credit: usize,
    /// Session pin lifetime.
    pub session_ttl: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            scheduler: SchedulerConfig::default(),
            kv_cache_memory: 1 << 30,
            ep: 1,
            stream_credit: 64,
            session_ttl: Duration::from_secs(600),
        }
    }
}

/// Pages that fit in `bytes` for `model` with rows of `dtype` (at least one).
pub fn pages_for(model: &dyn CausalLm, bytes: usize, page_size: usize, dtype: KvDtype) -> usize {
    let info = model.info();
    let row = dtype.row_bytes(info.kv_width, info.kv_segment);
    let per_page = (page_size * row * info.kv_layers).max(page_size);
    (bytes / per_page).max(1)
}

/// An accepted submission.
#[derive(Debug)]
pub struct Submission {
    /// The request's id (for [`Engine::cancel`]).
    pub id: RequestId,
    /// Its events; dropping the receiver cancels the request within one step.
    pub events: mpsc::Receiver<TokenEvent>,
}

/// Handle to a running engine.
#[derive(Clone)]
pub struct Engine {
    /// The scheduler's command queue.
    commands: mpsc::Sender<SchedulerCommand>,
    /// Waiting slots and request ids, shared with the scheduler.
    gate: Arc<AdmissionGate>,
    /// Counters the scheduler publishes after every step.
    stats: watch::Receiver<EngineStats>,
    /// What requests are checked against before they are queued.
    info: Arc<ModelInfo>,
    /// Expert shards, when `ep > 1` and the model has MoE layers.
    pub shards: Option<Arc<ShardedExperts>>,
    /// Events buffered per request.
    credit: usize,
}

impl Engine {
    /// Starts the scheduler thread (and, for `ep > 1`, the expert shards,
    /// which must be started inside a running actix `System`).
    pub fn start(
        model: Arc<dyn CausalLm>,
        cfg: EngineConfig,
        detok: Option<Arc<dyn Detokenize>>,
    ) -> Engine {
        let pages = pages_for(
            model.as_ref(),
            cfg.kv_cache_memory,
            cfg.scheduler.page_size,
            cfg.scheduler.kv_cache_dtype,
        );
        let memory = SessionMemory::new(MemoryConfig {
            num_pages: pages,
            page_size: cfg.scheduler.page_size,
            session_ttl: cfg.session_ttl,
        });
        let shards = if cfg.ep > 1 {
            model.as_moe().map(|moe| {
                let sharded = Arc::new(ShardedExperts::start(moe.experts(), cfg.ep));
                moe.set_expert_dispatch(sharded.clone());
                sharded
            })
        } else {
            None
        };
        let info = Arc::new(model.info().clone());
        let limit = cfg.scheduler.max_waiting_requests;
        let mut state = SchedulerState::with_memory(model, memory, cfg.scheduler, detok);
        state.set_forward_on_pool(shards.is_none());
        let (stats_tx, stats) = watch::channel(state.engine_stats());
        state.publish_to(stats_tx);
        let gate = state.gate();
        let (commands, rx) = mpsc::channel(limit + CONTROL_SLOTS);
        driver::spawn(state, rx).expect("the OS lets the runtime start its scheduler thread");
        Engine {
            commands,
            gate,
            stats,
            info,
            shards,
            credit: cfg.stream_credit.max(1),
        }
    }

    /// Queues a request without waiting for the scheduler: refused at once
    /// when it is invalid or `max_waiting_requests` are already waiting.
    pub fn try_submit(&self, request: ValidRequest) -> Result<Submission, SubmitError> {
        self.try_submit_with(request, None)
    }

    /// [`Engine::try_submit`] with a constraint on the request's output.
    pub fn try_submit_with(
        &self,
        request: ValidRequest,
        constraint: Option<SeqConstraint>,
    ) -> Result<Submission, SubmitError> {
        validate_request(&request, &self.info)?;
        self.gate.try_acquire()?;
        let (id, cmd, events) = self.admit_command(request, constraint);
        match self.commands.try_send(cmd) {
            Ok(()) => Ok(Submission { id, events }),
            Err(e) => {
                self.gate.release(1);
                Err(match e {
                    TrySendError::Full(_) => SubmitError::Overloaded {
                        waiting: self.gate.waiting(),
                        limit: self.gate.limit(),
                    },
                    TrySendError::Closed(_) => SubmitError::Stopped,
                })
            }
        }
    }

    /// Submits a request; its events arrive on the returned receiver.
    /// Dropping the receiver cancels the request within one step. Returns
    /// without waiting for the running forward (see [`Engine::try_submit`]).
    pub async fn submit(
        &self,
        request: ValidRequest,
    ) -> Result<mpsc::Receiver<TokenEvent>, SubmitError> {
        self.try_submit(request).map(|s| s.events)
    }

    /// Submits a request, waiting (in arrival order) for a waiting slot
    /// instead of answering "overloaded": for offline callers that hand
    /// over more requests than may wait at once (`caracal batch`).
    pub async fn submit_queued(&self, request: ValidRequest) -> Result<Submission, SubmitError> {
        self.submit_queued_with(request, None).await
    }

    /// [`Engine::submit_queued`] with a constraint on the request's output.
    pub async fn submit_queued_with(
        &self,
        request: ValidRequest,
        constraint: Option<SeqConstraint>,
    ) -> Result<Submission, SubmitError> {
        validate_request(&request, &self.info)?;
        self.gate.acquire().await?;
        let (id, cmd, events) = self.admit_command(request, constraint);
        if self.commands.send(cmd).await.is_err() {
            self.gate.release(1);
            return Err(SubmitError::Stopped);
        }
        Ok(Submission { id, events })
    }

    /// An id, the admit command and the receiver of a new request.
    fn admit_command(
        &self,
        request: ValidRequest,
        constraint: Option<SeqConstraint>,
    ) -> (RequestId, SchedulerCommand, mpsc::Receiver<TokenEvent>) {
        let id = self.gate.next_id();
        let (tx, rx) = mpsc::channel(self.credit);
        let cmd = SchedulerCommand::Admit(AdmitRequest {
            id,
            request,
            events: tx,
            constraint,
        });
        (id, cmd, rx)
    }

    /// Cancels request `id`: it ends with a `cancelled` error and caches
    /// nothing. Waits only for room in the command queue.
    pub async fn cancel(&self, id: RequestId) -> Result<(), SubmitError> {
        self.command(SchedulerCommand::Cancel(CancelRequest { id }))
            .await
    }

    /// An agent connection closed: cancels its requests and unpins its
    /// cached path. Waits only for room in the command queue.
    pub async fn close_session(&self, session: impl Into<String>) -> Result<(), SubmitError> {
        let session = session.into();
        self.command(SchedulerCommand::SessionClosed(SessionClosed { session }))
            .await
    }

    /// Releases the cached paths that agree with `path` through the page
    /// holding token `from` and that no request holds (unpinning `session`
    /// first when given); returns the pages freed.
    pub async fn drop_path(
        &self,
        session: Option<String>,
        path: Vec<u64>,
        from: usize,
    ) -> Result<usize, SubmitError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.command(SchedulerCommand::DropPath(DropPath {
            session,
            path,
            from,
            reply: Some(tx),
        }))
        .await?;
        rx.await.map_err(|_| SubmitError::Stopped)
    }

    async fn command(&self, cmd: SchedulerCommand) -> Result<(), SubmitError> {
        self.commands
            .send(cmd)
            .await
            .map_err(|_| SubmitError::Stopped)
    }

    /// The counters published after the scheduler's latest step, with the
    /// waiting count read live from the admission gate (`None` once the
    /// scheduler has stopped).
    pub fn stats(&self) -> Option<EngineStats> {
        if self.commands.is_closed() {
            return None;
        }
        let mut s = self.stats.borrow().clone();
        s.scheduler.waiting = self.gate.waiting();
        Some(s)
    }

    /// Scheduler counters, as of the latest step.
    pub async fn scheduler_stats(&self) -> Option<SchedulerStats> {
        self.stats().map(|s| s.scheduler)
    }

    /// Session memory counters, as of the latest step.
    pub async fn memory_stats(&self) -> Option<MemoryStats> {
        self.stats().map(|s| s.memory)
    }
}
