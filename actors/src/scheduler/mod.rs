//! Scheduler: continuous batching with chunked prefill, owning session memory.
//!
//! Every step runs **one** batched forward over all scheduled sequences, in
//! named phases:
//!
//! 1. **deliver / reap**: retry events that met a full channel; drop
//!    requests whose client hung up (their pages and locks go back).
//! 2. **admit**: move waiting requests into the running batch (fewest
//!    running sequences per session first), looking up and locking their
//!    cached prefix in [`SessionMemory`], which the scheduler owns.
//! 3. **plan**: one [`Work::Decode`] for each running sequence whose client
//!    has room for a token (credit-based backpressure), then
//!    [`Work::Prefill`] chunks of admitted prompts up to the token budget
//!    (`--max-batch-tokens`, `--chunked-prefill-size`), so running streams
//!    keep flowing while long prompts are prefilled.
//! 4. **forward**: the model's batched pass over the plan.
//! 5. **sample**: KDA snapshots at page boundaries, then a token for every
//!    sequence that asked for logits, stop ids, stop strings
//!    ([`StopMatcher`], incremental) and length limits. A constrained
//!    sequence ([`crate::constraint`]) samples under its grammar's token
//!    mask — computed on the [`MaskPool`] while the forward ran, since it
//!    needs only the previous token — consumes the token, ends with `stop`
//!    when the grammar is complete, or alone with `constraint_violation`
//!    when it cannot go on. With jump-forward the run of tokens the grammar
//!    then forces is appended at once and fed to the next forward as one
//!    [`Work::Extend`] chunk instead of one decode step per token.
//! 6. **finish**: commit finished sequences to session memory (so the next
//!    turn finds them), publish the counters ([`EngineStats`]), then send
//!    the final events.
//!
//! Commands ([`SchedulerCommand`]) come from [`crate::runtime::Engine`]
//! over one bounded queue that the scheduler's thread ([`driver`]) drains
//! before every step, without the submitter ever waiting for a forward:
//! [`AdmitRequest`], [`CancelRequest`], [`SessionClosed`] and
//! [`crate::messages::DropPath`]. Events go to
//! each request's own bounded channel. A request whose receiver is dropped
//! is removed at the next step and its cache locks released; nothing it
//! produced is cached.
//!
//! [`SchedulerState`] holds all the logic and is tested directly (no
//! threads): see `actors/tests/scheduler.rs`.

pub mod driver;
mod guided;
mod logprobs;
mod outbox;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use caracal_kernels::paged::{KvDtype, KvPool};
use caracal_kernels::sampling::{apply_penalties, sample, Rng};
use caracal_kernels::threads::on_pool;
use tokio::sync::{mpsc, watch};

use crate::admission::AdmissionGate;
use crate::constraint::{Constraint, SeqConstraint};
use crate::engine::{
    CausalLm, Detokenize, EmbedSpan, EngineError, LinearState, LogitsMode, ModelInfo, SeqBatch,
    SeqState,
};
use crate::messages::{
    AdmitRequest, CacheReport, EngineStats, ErrorKind, MemoryStats, RequestId, SchedulerCommand,
    SchedulerStats, SubmitError, TokenEvent, ValidRequest, MAX_TOP_LOGPROBS,
};
use crate::radix::NodeId;
use crate::session_memory::{
    CommitSequence, MatchPrefix, MemoryConfig, MemoryError, ReleaseSequence, SessionMemory,
};
use crate::stop::StopMatcher;
use guided::{accept, Appended, End, MaskResult};
use outbox::{Delivery, Outbox};

/// Session pin lifetime when a scheduler creates its own session memory.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(600);

/// Scheduler settings (CLI flags in parentheses).
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Sequences running at once (`--max-running-requests`, default 64).
    pub max_running_requests: usize,
    /// Tokens per batched forward, decode and prefill together (`--max-batch-tokens`, default 2048).
    pub max_batch_tokens: usize,
    /// Largest prefill chunk of one sequence per step (`--chunked-prefill-size`, default 512).
    pub chunked_prefill_size: usize,
    /// Requests waiting for admission before new ones get "overloaded" (`--max-waiting-requests`, default 256).
    pub max_waiting_requests: usize,
    /// Tokens per KV page (`--page-size`, default 16).
    pub page_size: usize,
    /// Extra KDA snapshots every N tokens, a multiple of the page size (`--state-checkpoint-interval`, default 512).
    pub state_checkpoint_interval: usize,
    /// How KV rows are stored (`--kv-cache-dtype`: the CLI's default is bf16;
    /// this struct's default keeps f32 rows, exact against the single-sequence path).
    pub kv_cache_dtype: KvDtype,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_running_requests: 64,
            max_batch_tokens: 2048,
            chunked_prefill_size: 512,
            max_waiting_requests: 256,
            page_size: 16,
            state_checkpoint_interval: 512,
            kv_cache_dtype: KvDtype::F32,
        }
    }
}

/// One running sequence's share of a step's forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// Feed the last sampled token of running sequence `seq` (index in the
    /// running batch) and sample the next.
    Decode {
        /// Index in the running batch.
        seq: usize,
    },
    /// Feed the last sampled token of running sequence `seq` and the run of
    /// tokens its grammar forced after it (jump-forward), then sample the next.
    Extend {
        /// Index in the running batch.
        seq: usize,
        /// Tokens fed: the sampled one and the forced ones.
        len: usize,
    },
    /// Feed prompt tokens `start..start + len` of running sequence `seq`;
    /// logits only when the chunk ends the prompt.
    Prefill {
        /// Index in the running batch.
        seq: usize,
        /// First prompt position of the chunk.
        start: usize,
        /// Tokens in the chunk.
        len: usize,
    },
}

impl Work {
    /// The running sequence this work belongs to.
    pub fn seq(&self) -> usize {
        match *self {
            Work::Decode { seq } | Work::Extend { seq, .. } | Work::Prefill { seq, .. } => seq,
        }
    }

    /// Tokens this work feeds.
    pub fn tokens(&self) -> usize {
        match *self {
            Work::Decode { .. } => 1,
            Work::Extend { len, .. } | Work::Prefill { len, .. } => len,
        }
    }
}

/// Checks what the scheduler needs of a request before it is queued.
pub fn validate_request(req: &ValidRequest, info: &ModelInfo) -> Result<(), SubmitError> {
    if req.prompt.is_empty() {
        return Err(SubmitError::Invalid("the prompt is empty".into()));
    }
    if req.prompt.len() >= info.max_position {
        return Err(SubmitError::PromptTooLong {
            prompt: req.prompt.len(),
            context: info.max_position,
        });
    }
    if let Some(k) = &req.cache_key {
        if k.len() != req.prompt.len() {
            return Err(SubmitError::Invalid(
                "cache_key must have one element per prompt token".into(),
            ));
        }
    }
    if req.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
        return Err(SubmitError::Invalid(format!(
            "top_logprobs must be at most {MAX_TOP_LOGPROBS}"
        )));
    }
    if !req.media.is_empty() && req.cache_key.is_none() {
        return Err(SubmitError::Invalid(
            "a prompt with media needs a cache_key that keys its spans by content".into(),
        ));
    }
    let mut end = 0;
    for m in &req.media {
        let inside = m.offset >= end && m.offset + m.len <= req.prompt.len();
        if m.len == 0 || !inside {
            return Err(SubmitError::Invalid(format!(
                "media span at {} (+{}) overlaps another or lies outside the {}-token prompt",
                m.offset,
                m.len,
                req.prompt.len()
            )));
        }
        end = m.offset + m.len;
    }
    Ok(())
}

/// A request waiting for admission.
struct Waiting {
    /// Its id.
    id: RequestId,
    /// The request.
    req: ValidRequest,
    /// Its client.
    events: mpsc::Sender<TokenEvent>,
    /// Its grammar, if any.
    constraint: Option<SeqConstraint>,
}

/// A running sequence.
struct Running {
    /// Its id.
    id: RequestId,
    /// The request.
    req: ValidRequest,
    /// Its client.
    out: Outbox,
    /// Block table, length and KDA state.
    state: SeqState,
    /// Radix key of prompt then generated tokens.
    key: Vec<u64>,
    /// Generated ids.
    generated: Vec<u32>,
    /// Tokens to feed at the next decode: the last sampled one, then any
    /// the grammar forced after it (empty: nothing to decode).
    pending: Vec<u32>,
    /// The node locked at admission.
    node: NodeId,
    /// Sampler.
    rng: Rng,
    /// Cache use of the prompt.
    cache: CacheReport,
    /// KDA states captured at page boundaries: `(tokens, states)`.
    snapshots: Vec<(usize, Vec<LinearState>)>,
    /// Latest page-boundary state seen while decoding (end-of-turn snapshot).
    decode_snapshot: Option<(usize, Vec<LinearState>)>,
    /// Stop-string matcher, when the request has stop strings and the
    /// scheduler a detokenizer.
    stop: Option<StopMatcher>,
    /// The grammar its output follows; lent to the [`MaskPool`] during a
    /// forward.
    constraint: Option<Box<dyn Constraint>>,
    /// Append forced runs without sampling them (jump-forward).
    jump_forward: bool,
}

impl Running {
    fn in_prefill(&self) -> bool {
        self.state.len < self.req.prompt.len()
    }
}

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOutcome {
    /// A forward ran.
    Ran,
    /// Work exists but none could run (clients not reading, or requests
    /// waiting for pages).
    Paused,
    /// Nothing to do.
    Idle,
}

/// All scheduling logic and the session memory it owns, free of threads.
pub struct SchedulerState {
    /// The model.
    model: Arc<dyn CausalLm>,
    /// The KV rows; page ids are handed out by `memory`.
    pool: KvPool,
    /// Page accounting, prefix cache, snapshots, pins (single owner).
    memory: SessionMemory,
    /// Settings.
    cfg: SchedulerConfig,
    /// Turns ids into text for stop strings.
    detok: Option<Arc<dyn Detokenize>>,
    /// Waiting-request bound and request ids, shared with the submitting side.
    gate: Arc<AdmissionGate>,
    /// Requests not yet admitted, in arrival order.
    waiting: VecDeque<Waiting>,
    /// The running batch.
    running: Vec<Running>,
    /// Clients of requests that left the scheduler whose last events still
    /// wait for room in their channel.
    closing: Vec<Outbox>,
    /// Counters.
    stats: SchedulerStats,
    /// Run each forward on a rayon worker ([`on_pool`]); off when expert
    /// shards compute on their own threads while the forward waits for them.
    forward_on_pool: bool,
    /// Where counters are published after every step.
    publish: Option<watch::Sender<EngineStats>>,
}

impl SchedulerState {
    /// A scheduler for `model` whose KV pool and session memory have
    /// `num_pages` pages (pins live [`DEFAULT_SESSION_TTL`]).
    pub fn new(
        model: Arc<dyn CausalLm>,
        num_pages: usize,
        cfg: SchedulerConfig,
        detok: Option<Arc<dyn Detokenize>>,
    ) -> Self {
        let memory = SessionMemory::new(MemoryConfig {
            num_pages,
            page_size: cfg.page_size,
            session_ttl: DEFAULT_SESSION_TTL,
        });
        Self::with_memory(model, memory, cfg, detok)
    }

    /// A scheduler that owns `memory`; the KV pool gets the same pages.
    /// The memory's page size wins over `cfg.page_size`.
    pub fn with_memory(
        model: Arc<dyn CausalLm>,
        memory: SessionMemory,
        mut cfg: SchedulerConfig,
        detok: Option<Arc<dyn Detokenize>>,
    ) -> Self {
        cfg.page_size = memory.page_size();
        let info = model.info().clone();
        let pool = KvPool::with_layout(
            info.kv_layers,
            memory.num_pages(),
            cfg.page_size,
            info.kv_width,
            info.kv_segment,
            cfg.kv_cache_dtype,
        )
        .externally_allocated();
        SchedulerState {
            model,
            pool,
            memory,
            gate: Arc::new(AdmissionGate::new(cfg.max_waiting_requests)),
            cfg,
            detok,
            waiting: VecDeque::new(),
            running: Vec::new(),
            closing: Vec::new(),
            stats: SchedulerStats::default(),
            forward_on_pool: true,
            publish: None,
        }
    }

    /// Whether each batched forward runs on a rayon worker (default). Turn it
    /// off when the model waits on other threads that use the pool (expert
    /// shards): a blocked worker could otherwise starve them.
    pub fn set_forward_on_pool(&mut self, on: bool) {
        self.forward_on_pool = on;
    }

    /// The waiting-request bound and id source, for the submitting side.
    pub fn gate(&self) -> Arc<AdmissionGate> {
        self.gate.clone()
    }

    /// Publishes [`EngineStats`] to `tx` after every step (and now).
    pub fn publish_to(&mut self, tx: watch::Sender<EngineStats>) {
        tx.send_replace(self.engine_stats());
        self.publish = Some(tx);
    }

    /// Queues a request, or refuses it when the queue is full or it cannot run.
    pub fn enqueue(
        &mut self,
        req: ValidRequest,
        events: mpsc::Sender<TokenEvent>,
    ) -> Result<RequestId, SubmitError> {
        self.enqueue_with(req, events, None)
    }

    /// Queues a request whose output follows `constraint`.
    pub fn enqueue_with(
        &mut self,
        req: ValidRequest,
        events: mpsc::Sender<TokenEvent>,
        constraint: Option<SeqConstraint>,
    ) -> Result<RequestId, SubmitError> {
        validate_request(&req, self.model.info())?;
        self.gate.try_acquire()?;
        let id = self.gate.next_id();
        self.waiting.push_back(Waiting {
            id,
            req,
            events,
            constraint,
        });
        Ok(id)
    }

    /// Applies one command from the queue.
    pub fn handle(&mut self, cmd: SchedulerCommand) {
        match cmd {
            SchedulerCommand::Admit(a) => self.queue_admitted(a),
            SchedulerCommand::Cancel(c) => {
                self.cancel(c.id);
            }
            SchedulerCommand::SessionClosed(s) => self.close_session(&s.session),
            SchedulerCommand::DropPath(d) => {
                let freed = self.memory.drop_path(d.session.as_deref(), &d.path, d.from);
                if let Some(reply) = d.reply {
                    let _ = reply.send(freed);
                }
            }
        }
    }

    /// A request that already holds a waiting slot (taken on submission).
    fn queue_admitted(&mut self, a: AdmitRequest) {
        match validate_request(&a.request, self.model.info()) {
            Ok(()) => self.waiting.push_back(Waiting {
                id: a.id,
                req: a.request,
                events: a.events,
                constraint: a.constraint,
            }),
            Err(e) => {
                self.gate.release(1);
                self.refuse(a.events, e.kind(), e.to_string());
            }
        }
    }

    /// Stops request `id` now (waiting or running); it gets a `cancelled`
    /// error and caches nothing. False when no such request is here.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let message = "the request was cancelled".to_string();
        if let Some(i) = self.waiting.iter().position(|w| w.id == id) {
            let w = self.waiting.remove(i).expect("index from position");
            self.gate.release(1);
            self.stats.cancelled += 1;
            self.refuse(w.events, ErrorKind::Cancelled, message);
            return true;
        }
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
            self.stats.cancelled += 1;
            self.fail_running(i, ErrorKind::Cancelled, message);
            return true;
        }
        false
    }

    /// An agent connection closed: cancels its requests and unpins its
    /// cached path (it stays cached, but evictable).
    pub fn close_session(&mut self, session: &str) {
        let of_session = |s: &Option<String>| s.as_deref() == Some(session);
        let ids: Vec<RequestId> = self
            .waiting
            .iter()
            .filter(|w| of_session(&w.req.session))
            .map(|w| w.id)
            .chain(
                self.running
                    .iter()
                    .filter(|r| of_session(&r.req.session))
                    .map(|r| r.id),
            )
            .collect();
        for id in ids {
            self.cancel(id);
        }
        self.memory.unpin(session);
    }

    /// Counters.
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            waiting: self.gate.waiting(),
            running: self.running.len(),
            ..self.stats.clone()
        }
    }

    /// The session memory (page accounting, prefix cache).
    pub fn memory(&self) -> &SessionMemory {
        &self.memory
    }

    /// Session memory counters.
    pub fn memory_stats(&self) -> MemoryStats {
        self.memory.stats()
    }

    /// Scheduler and memory counters together.
    pub fn engine_stats(&self) -> EngineStats {
        EngineStats {
            scheduler: self.stats(),
            memory: self.memory.stats(),
        }
    }

    /// Whether any request is waiting, running, or owed a final event.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty() || !self.closing.is_empty()
    }

    /// Runs one scheduling step (see the module docs for its phases).
    pub fn step(&mut self) -> StepOutcome {
        let span = tracing::debug_span!("scheduler_step", step = self.stats.steps);
        let _entered = span.enter();
        // Tokens held back by a full channel go first, so they can be planned
        // after; final events wait until the counters below are published.
        for r in &mut self.running {
            r.out.flush();
        }
        self.reap_cancelled();
        self.admit();
        let plan = self.plan();
        let ran = !plan.is_empty();
        if ran {
            // The masks of this step's samples need only the tokens already
            // consumed: they are computed while the forward runs.
            let masks = self.start_masks(&plan);
            // A panic fails only the requests behind it (driver.rs).
            let run = self.forward_isolated(plan);
            let masks = self.join_masks(masks);
            match run.result {
                Ok(logits) => match driver::isolate(|| self.sample(&run.plan, &logits, masks)) {
                    Ok(ended) => self.finish(ended),
                    Err(message) => self.fail_sampling_panic(&run.plan, &message),
                },
                Err(e) => self.fail_plan(&run.plan, &e),
            }
            self.fail_ids(run.failed);
        }
        if let Some(tx) = &self.publish {
            tx.send_replace(self.engine_stats());
        }
        self.deliver();
        if ran {
            StepOutcome::Ran
        } else if self.has_work() {
            StepOutcome::Paused
        } else {
            StepOutcome::Idle
        }
    }

    /// Sends what fits of every queued event; forgets the clients of
    /// requests that left once their events are out (or they hung up).
    fn deliver(&mut self) {
        for r in &mut self.running {
            r.out.flush();
        }
        self.closing.retain_mut(|o| o.flush() == Delivery::Blocked);
    }

    /// Queues error `kind` for a request that never ran; it goes out with
    /// the step's other final events.
    fn refuse(&mut self, events: mpsc::Sender<TokenEvent>, kind: ErrorKind, message: String) {
        let mut out = Outbox::new(events);
        out.push(TokenEvent::Error { kind, message });
        self.closing.push(out);
    }

    /// Removes running sequence `i`, gives its pages and lock back without
    /// caching anything, and tells its client why.
    fn fail_running(&mut self, i: usize, kind: ErrorKind, message: String) {
        let r = self.running.swap_remove(i);
        self.memory.release(ReleaseSequence {
            pages: r.state.block_table,
            node: r.node,
        });
        let mut out = r.out;
        out.push(TokenEvent::Error { kind, message });
        self.closing.push(out);
    }

    /// Phase 1: drops requests whose client hung up.
    fn reap_cancelled(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|w| !w.events.is_closed());
        let gone = before - self.waiting.len();
        self.gate.release(gone);
        self.stats.cancelled += gone as u64;
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].out.is_closed() {
                let r = self.running.swap_remove(i);
                tracing::debug!(
                    request = r.id,
                    generated = r.generated.len(),
                    "cancelled by client"
                );
                self.memory.release(ReleaseSequence {
                    pages: r.state.block_table,
                    node: r.node,
                });
                self.stats.cancelled += 1;
            } else {
                i += 1;
            }
        }
    }

    /// Picks the next waiting request: the session with the fewest running
    /// sequences first, FIFO among equals.
    fn pick_waiting(&self) -> Option<usize> {
        let mut load: HashMap<&str, usize> = HashMap::new();
        for r in &self.running {
            *load
                .entry(r.req.session.as_deref().unwrap_or(""))
                .or_default() += 1;
        }
        (0..self.waiting.len()).min_by_key(|&i| {
            (
                load.get(self.waiting[i].req.session.as_deref().unwrap_or(""))
                    .copied()
                    .unwrap_or(0),
                i,
            )
        })
    }

    /// Phase 2: moves waiting requests into the running batch while there
    /// is room and session memory can reserve their pages.
    fn admit(&mut self) {
        let info = self.model.info().clone();
        let hybrid = info.linear_layers > 0;
        while self.running.len() < self.cfg.max_running_requests.max(1) {
            let Some(i) = self.pick_waiting() else { break };
            let w = &self.waiting[i];
            let key: Vec<u64> = w
                .req
                .cache_key
                .clone()
                .unwrap_or_else(|| w.req.prompt.iter().map(|&t| t as u64).collect());
            let reserve = (w.req.prompt.len() + w.req.max_tokens).min(info.max_position);
            let lookup = MatchPrefix {
                key: key.clone(),
                hybrid,
                reserve_tokens: reserve,
            };
            match self.memory.admit(&lookup) {
                Ok(adm) => {
                    let w = self.waiting.remove(i).expect("index from pick_waiting");
                    self.gate.release(1);
                    let mut state = self.model.new_state();
                    state.block_table = adm.pages;
                    state.len = adm.cached_tokens;
                    if let Some(snap) = adm.snapshot {
                        state.linear = (*snap).clone();
                    }
                    let seed = w
                        .req
                        .sampling
                        .seed
                        .unwrap_or(w.id.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                    let cache = CacheReport {
                        prompt_tokens: w.req.prompt.len(),
                        cached_tokens: adm.cached_tokens,
                        miss_reason: adm.miss_reason,
                    };
                    let stop = self
                        .detok
                        .as_ref()
                        .and_then(|_| StopMatcher::new(&w.req.stop.strings));
                    // Forced tokens have no logits: a request that wants
                    // log-probabilities samples every token.
                    let jump_forward = w.constraint.as_ref().is_some_and(|c| c.jump_forward)
                        && w.req.logprobs.is_none();
                    self.running.push(Running {
                        id: w.id,
                        req: w.req,
                        out: Outbox::new(w.events),
                        state,
                        key,
                        generated: Vec::new(),
                        pending: Vec::new(),
                        node: adm.node,
                        rng: Rng::new(seed),
                        cache,
                        snapshots: Vec::new(),
                        decode_snapshot: None,
                        stop,
                        constraint: w.constraint.map(|c| c.constraint),
                        jump_forward,
                    });
                }
                Err(MemoryError::OutOfPages { needed, available }) if self.running.is_empty() => {
                    let w = self.waiting.remove(i).expect("index from pick_waiting");
                    self.gate.release(1);
                    self.refuse(
                        w.events,
                        ErrorKind::KvCacheFull,
                        format!("request needs {needed} KV pages but only {available} can ever be free; raise --kv-cache-memory or lower max_tokens"),
                    );
                }
                // Pages come back when running sequences finish.
                Err(MemoryError::OutOfPages { .. }) => break,
                Err(e @ MemoryError::Radix(_)) => {
                    tracing::error!(request = w.id, "admission failed: {e}");
                    let w = self.waiting.remove(i).expect("index from pick_waiting");
                    self.gate.release(1);
                    self.refuse(w.events, ErrorKind::InternalError, e.to_string());
                }
            }
        }
    }

    /// Phase 3: the work the next forward runs: decode tokens first (for
    /// clients with room), then prefill chunks up to the token budget.
    pub fn plan(&self) -> Vec<Work> {
        let mut budget = self.cfg.max_batch_tokens.max(1);
        let mut plan = Vec::new();
        for (seq, r) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if r.pending.is_empty() || !r.out.has_room() {
                continue;
            }
            let len = r.pending.len();
            if len == 1 {
                plan.push(Work::Decode { seq });
            } else if len <= budget || plan.is_empty() {
                plan.push(Work::Extend { seq, len });
            } else {
                continue; // the forced run waits for a step with room
            }
            budget = budget.saturating_sub(len);
        }
        let hybrid = self.model.info().linear_layers > 0;
        let p = self.cfg.page_size;
        for (seq, r) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if !r.in_prefill() {
                continue;
            }
            let start = r.state.len;
            let n = r.req.prompt.len();
            let mut end = (start + self.cfg.chunked_prefill_size.max(1).min(budget)).min(n);
            if hybrid {
                // End chunks at snapshot boundaries so the KDA state there can be captured.
                let last_page = n / p * p;
                let interval = self.cfg.state_checkpoint_interval.max(p) / p * p;
                let next_interval = (start / interval + 1) * interval;
                for b in [last_page, next_interval] {
                    if b > start && b < end {
                        end = b;
                    }
                }
            }
            plan.push(Work::Prefill {
                seq,
                start,
                len: end - start,
            });
            budget -= end - start;
        }
        plan
    }

    /// Which logits `work` asks for.
    fn logits_mode(&self, work: &Work) -> LogitsMode {
        match *work {
            Work::Decode { .. } | Work::Extend { .. } => LogitsMode::Last,
            Work::Prefill { seq, start, len } => {
                if start + len == self.running[seq].req.prompt.len() {
                    LogitsMode::Last
                } else {
                    LogitsMode::None
                }
            }
        }
    }

    /// Phase 4: one batched forward over `plan`; logits rows in plan order
    /// for the work that asked for them.
    fn forward(&mut self, plan: &[Work]) -> Result<Vec<f32>, EngineError> {
        let inputs: Vec<(Vec<u32>, LogitsMode, Vec<EmbedSpan>)> = plan
            .iter()
            .map(|w| {
                let r = &self.running[w.seq()];
                let (tokens, embeds) = match *w {
                    Work::Decode { .. } | Work::Extend { .. } => (r.pending.clone(), Vec::new()),
                    Work::Prefill { start, len, .. } => (
                        r.req.prompt[start..start + len].to_vec(),
                        EmbedSpan::within(&r.req.media, start, len),
                    ),
                };
                (tokens, self.logits_mode(w), embeds)
            })
            .collect();
        self.stats.prefill_tokens += plan
            .iter()
            .filter(|w| matches!(w, Work::Prefill { .. }))
            .map(|w| w.tokens() as u64)
            .sum::<u64>();
        let mut slots: Vec<Option<&mut Running>> = self.running.iter_mut().map(Some).collect();
        let mut batch = Vec::with_capacity(inputs.len());
        for (w, (tokens, mode, embeds)) in plan.iter().zip(&inputs) {
            let r = slots[w.seq()]
                .take()
                .expect("each sequence appears once in a plan");
            batch.push(SeqBatch {
                tokens,
                state: &mut r.state,
                logits: *mode,
                embeds,
            });
        }
        // On a pool worker: the kernels' parallel calls then skip the
        // cross-thread round trip (see caracal_kernels::threads).
        let (model, pool) = (&self.model, &mut self.pool);
        let result = if self.forward_on_pool {
            on_pool(|| model.forward(pool, &mut batch))
        } else {
            model.forward(pool, &mut batch)
        };
        self.stats.steps += 1;
        result
    }

    /// A failed forward fails every sequence it carried.
    fn fail_plan(&mut self, plan: &[Work], e: &EngineError) {
        let mut failed: Vec<usize> = plan.iter().map(Work::seq).collect();
        failed.sort_unstable_by_key(|&i| std::cmp::Reverse(i));
        for i in failed {
            self.fail_running(i, ErrorKind::InternalError, e.to_string());
        }
    }

    /// Phase 5: snapshots, then one token for each work that asked for
    /// logits (under its grammar's mask, if any); returns the sequences
    /// that end, and how.
    fn sample(
        &mut self,
        plan: &[Work],
        logits: &[f32],
        mut masks: Vec<Option<MaskResult>>,
    ) -> Vec<(usize, End)> {
        let info = self.model.info();
        let (vocab, max_pos) = (info.vocab_size, info.max_position);
        let hybrid = info.linear_layers > 0;
        let p = self.cfg.page_size;
        let interval = self.cfg.state_checkpoint_interval.max(p) / p * p;
        // A forced run fits one forward with the sampled token before it.
        let max_forced = self.cfg.max_batch_tokens.max(2) - 1;
        let modes: Vec<LogitsMode> = plan.iter().map(|w| self.logits_mode(w)).collect();
        let mut row = 0;
        let mut ended = Vec::new();
        for (w, mode) in plan.iter().zip(modes) {
            let seq = w.seq();
            let r = &mut self.running[seq];
            r.pending.clear();
            if hybrid && r.state.len.is_multiple_of(p) {
                let snap = r.state.linear.clone();
                let prompt_boundary = r.state.len <= r.req.prompt.len();
                if prompt_boundary || r.state.len.is_multiple_of(interval) {
                    r.snapshots.push((r.state.len, snap));
                } else {
                    r.decode_snapshot = Some((r.state.len, snap));
                }
            }
            if mode != LogitsMode::Last {
                continue;
            }
            let raw = &logits[row * vocab..(row + 1) * vocab];
            row += 1;
            // A copy only when penalties or a mask change the logits.
            let changed = r.req.sampling.has_penalties() || r.constraint.is_some();
            let mut owned = Vec::new();
            if changed {
                owned.extend_from_slice(raw);
                apply_penalties(&mut owned, &r.req.prompt, &r.generated, &r.req.sampling);
            }
            if r.constraint.is_some() {
                match masks[seq].take() {
                    Some(Ok(mask)) if mask.count() > 0 => mask.apply(&mut owned),
                    Some(Ok(_)) => {
                        ended.push((
                            seq,
                            End::ConstraintFailed("the grammar allows no token here".into()),
                        ));
                        continue;
                    }
                    Some(Err(e)) => {
                        ended.push((seq, End::ConstraintFailed(e.to_string())));
                        continue;
                    }
                    None => {
                        ended.push((seq, End::ConstraintFailed("the token mask was lost".into())));
                        continue;
                    }
                }
            }
            let l = if changed { &owned[..] } else { raw };
            let tok = sample(l, &r.req.sampling, &mut r.rng);
            let lp = r
                .req
                .logprobs
                .map(|k| Box::new(logprobs::token_logprob(raw, tok, k)));
            let mut fed = vec![tok];
            let mut step = match accept(r, tok, lp, &self.detok, max_pos, false) {
                Ok(a) => a,
                Err(e) => {
                    ended.push((seq, End::ConstraintFailed(e)));
                    Appended::Failed
                }
            };
            if step == Appended::Continue && r.jump_forward {
                match r.constraint.as_mut().map(|c| c.forced_tokens()) {
                    Some(Ok(mut forced)) => {
                        forced.truncate(max_forced);
                        for f in forced {
                            match accept(r, f, None, &self.detok, max_pos, true) {
                                Ok(a) => step = a,
                                Err(e) => {
                                    step = Appended::Failed;
                                    ended.push((seq, End::ConstraintFailed(e)));
                                }
                            }
                            fed.push(f);
                            self.stats.forced_tokens += 1;
                            if step != Appended::Continue {
                                break;
                            }
                        }
                    }
                    Some(Err(e)) => {
                        step = Appended::Failed;
                        ended.push((seq, End::ConstraintFailed(e.to_string())));
                    }
                    None => {}
                }
            }
            self.stats.generated_tokens += fed.len() as u64;
            match step {
                Appended::Continue => r.pending = fed,
                Appended::Ended(reason) => ended.push((seq, End::Finished(reason))),
                Appended::Closed | Appended::Failed => {} // reaped next step / already listed
            }
        }
        ended
    }

    /// Phase 6: commits finished sequences to session memory and queues
    /// their `Finished` events (sent after the counters are published);
    /// sequences whose grammar failed end with an error and cache nothing.
    fn finish(&mut self, mut ended: Vec<(usize, End)>) {
        ended.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        for (i, end) in ended {
            let reason = match end {
                End::Finished(reason) => reason,
                End::ConstraintFailed(message) => {
                    tracing::debug!(request = self.running[i].id, %message, "grammar failed");
                    self.stats.constraint_failures += 1;
                    self.fail_running(i, ErrorKind::ConstraintViolation, message);
                    continue;
                }
            };
            let mut r = self.running.swap_remove(i);
            tracing::debug!(
                request = r.id,
                generated = r.generated.len(),
                ?reason,
                "finished"
            );
            let mut snapshots = std::mem::take(&mut r.snapshots);
            snapshots.extend(r.decode_snapshot.take());
            r.key.truncate(r.state.len);
            // Commit before telling the client, so its next turn finds the cache.
            self.memory.commit(CommitSequence {
                key: r.key,
                pages: r.state.block_table,
                node: r.node,
                session: r.req.session,
                snapshots,
            });
            self.stats.finished += 1;
            let mut out = r.out;
            out.push(TokenEvent::Finished {
                reason,
                completion_tokens: r.generated.len(),
                cache: r.cache,
            });
            self.closing.push(out);
        }
    }

    /// Clients the scheduler waits on to read (their channel is full).
    fn blocked_clients(&self) -> impl Iterator<Item = &mpsc::Sender<TokenEvent>> {
        self.running
            .iter()
            .map(|r| &r.out)
            .chain(&self.closing)
            .filter(|o| o.is_blocked())
            .map(|o| &o.events)
    }
}
