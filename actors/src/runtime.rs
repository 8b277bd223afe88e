//! Starting the runtime: SessionMemory, expert shards and the Scheduler,
//! each on its own thread, and the [`Engine`] handle that submits requests.
//!
//! ```text
//! Engine::submit(ValidRequest) ──AdmitRequest──► Scheduler (own arbiter)
//!        ◄────────── TokenEvent (bounded mpsc) ───────┘  │ MatchPrefix / CommitSequence
//!                                                        ▼
//!                                  SessionMemory (own thread)
//!                   Scheduler's forward ──RunExperts──► ExpertShard ×N (own threads)
//! ```

use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, Addr, Arbiter};
use tokio::sync::mpsc;

use crate::engine::{CausalLm, Detokenize};
use crate::expert_shard::ShardedExperts;
use crate::messages::{
    AdmitRequest, GetMemoryStats, GetSchedulerStats, MemoryStats, SchedulerStats, SubmitError,
    TokenEvent, ValidRequest,
};
use crate::scheduler::{Scheduler, SchedulerConfig, SchedulerState};
use crate::session_memory::{MemoryConfig, SessionMemory, SessionMemoryActor};

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

/// Pages that fit in `bytes` for `model` (at least enough for one full context).
pub fn pages_for(model: &dyn CausalLm, bytes: usize, page_size: usize) -> usize {
    let info = model.info();
    let per_page = (page_size * info.kv_width * info.kv_layers * 4).max(page_size * 4);
    (bytes / per_page).max(1)
}

/// Handle to a running engine.
#[derive(Clone)]
pub struct Engine {
    /// The scheduler actor.
    pub scheduler: Addr<Scheduler>,
    /// The session memory actor.
    pub memory: Addr<SessionMemoryActor>,
    /// Expert shards, when `ep > 1` and the model has MoE layers.
    pub shards: Option<Arc<ShardedExperts>>,
    /// Events buffered per request.
    credit: usize,
    /// Keeps the scheduler's thread alive.
    _arbiter: Arc<ArbiterGuard>,
}

/// Stops the scheduler's and session memory's arbiters when the last engine handle goes.
struct ArbiterGuard(Vec<Arbiter>);

impl Drop for ArbiterGuard {
    fn drop(&mut self) {
        for a in &self.0 {
            a.stop();
        }
    }
}

impl Engine {
    /// Starts the actors for `model`. Must be called inside a running actix `System`.
    pub fn start(
        model: Arc<dyn CausalLm>,
        cfg: EngineConfig,
        detok: Option<Arc<dyn Detokenize>>,
    ) -> Engine {
        let pages = pages_for(model.as_ref(), cfg.kv_cache_memory, cfg.scheduler.page_size);
        let mem_cfg = MemoryConfig {
            num_pages: pages,
            page_size: cfg.scheduler.page_size,
            session_ttl: cfg.session_ttl,
        };
        let memory_arbiter = Arbiter::new();
        let memory = SessionMemoryActor::start_in_arbiter(&memory_arbiter.handle(), move |_| {
            SessionMemoryActor(SessionMemory::new(mem_cfg))
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
        let mut state = SchedulerState::new(model, pages, cfg.scheduler.clone(), detok);
        state.set_forward_on_pool(shards.is_none());
        let arbiter = Arbiter::new();
        let mem = memory.clone();
        let scheduler =
            Scheduler::start_in_arbiter(&arbiter.handle(), move |_| Scheduler::new(state, mem));
        Engine {
            scheduler,
            memory,
            shards,
            credit: cfg.stream_credit.max(1),
            _arbiter: Arc::new(ArbiterGuard(vec![arbiter, memory_arbiter])),
        }
    }

    /// Submits a request; its events arrive on the returned receiver.
    /// Dropping the receiver cancels the request within one step.
    pub async fn submit(
        &self,
        request: ValidRequest,
    ) -> Result<mpsc::Receiver<TokenEvent>, SubmitError> {
        let (tx, rx) = mpsc::channel(self.credit);
        self.scheduler
            .send(AdmitRequest {
                request,
                events: tx,
            })
            .await
            .map_err(|_| SubmitError::Stopped)??;
        Ok(rx)
    }

    /// Scheduler counters.
    pub async fn scheduler_stats(&self) -> Option<SchedulerStats> {
        self.scheduler.send(GetSchedulerStats).await.ok()
    }

    /// Session memory counters.
    pub async fn memory_stats(&self) -> Option<MemoryStats> {
        self.memory.send(GetMemoryStats).await.ok()
    }
}
