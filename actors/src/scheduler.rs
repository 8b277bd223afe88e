//! Scheduler: continuous batching with chunked prefill.
//!
//! Every step runs **one** batched forward over all scheduled sequences:
//! one decode token for each running sequence whose client has room for it
//! (credit-based backpressure), then prefill chunks of admitted prompts up to
//! the token budget (`--max-batch-tokens`, `--chunked-prefill-size`), so
//! running streams keep flowing while long prompts are prefilled. Sequences
//! join and leave at every step.
//!
//! Takes [`AdmitRequest`] and [`GetSchedulerStats`]; sends [`TokenEvent`]s
//! to each request's own bounded channel and [`MatchPrefix`] /
//! [`CommitSequence`] / [`ReleaseSequence`] to SessionMemory. A request
//! whose event receiver is dropped is removed at the next step and its cache
//! locks released; nothing it produced is cached.
//!
//! The actor runs on its own arbiter thread: the forward blocks that thread,
//! never the sockets'. [`SchedulerState`] holds all logic and is tested
//! directly with an in-process [`MemoryPort`].

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use actix::{Actor, AsyncContext, Context, Handler, MessageResult};
use caracal_kernels::paged::KvPool;
use caracal_kernels::sampling::{apply_penalties, sample, Rng};
use caracal_kernels::threads::on_pool;
use tokio::sync::mpsc;

use crate::engine::{CausalLm, Detokenize, LinearState, LogitsMode, SeqBatch, SeqState};
use crate::messages::{
    Admission, AdmitRequest, CacheReport, CommitSequence, FinishReason, GetSchedulerStats,
    MatchPrefix, MemoryError, ReleaseSequence, RequestId, RunStep, SchedulerStats, SubmitError,
    TokenEvent, ValidRequest,
};
use crate::radix::NodeId;
use crate::session_memory::SessionMemory;

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
        }
    }
}

/// How the scheduler talks to session memory (the actor, or state in tests).
pub trait MemoryPort {
    /// [`MatchPrefix`].
    fn admit(&mut self, m: MatchPrefix) -> Result<Admission, MemoryError>;
    /// [`CommitSequence`].
    fn commit(&mut self, c: CommitSequence);
    /// [`ReleaseSequence`].
    fn release(&mut self, r: ReleaseSequence);
}

impl MemoryPort for SessionMemory {
    fn admit(&mut self, m: MatchPrefix) -> Result<Admission, MemoryError> {
        SessionMemory::admit(self, &m)
    }
    fn commit(&mut self, c: CommitSequence) {
        SessionMemory::commit(self, c)
    }
    fn release(&mut self, r: ReleaseSequence) {
        SessionMemory::release(self, r)
    }
}

/// A request waiting for admission.
struct Waiting {
    id: RequestId,
    req: ValidRequest,
    events: mpsc::Sender<TokenEvent>,
}

/// A running sequence.
struct Running {
    id: RequestId,
    req: ValidRequest,
    events: mpsc::Sender<TokenEvent>,
    /// Block table, length and KDA state.
    state: SeqState,
    /// Radix key of prompt then generated tokens.
    key: Vec<u64>,
    /// Generated ids.
    generated: Vec<u32>,
    /// Next token to feed during decode.
    pending: Option<u32>,
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
    /// Sequences exist but none could run (all paused by backpressure).
    Paused,
    /// Nothing to do.
    Idle,
}

/// All scheduling logic, free of actors and channels-of-actors.
pub struct SchedulerState {
    model: Arc<dyn CausalLm>,
    pool: KvPool,
    cfg: SchedulerConfig,
    detok: Option<Arc<dyn Detokenize>>,
    waiting: VecDeque<Waiting>,
    running: Vec<Running>,
    next_id: RequestId,
    stats: SchedulerStats,
    /// Run each forward on a rayon worker ([`on_pool`]); off when expert
    /// shards compute on their own threads while the forward waits for them.
    forward_on_pool: bool,
}

impl SchedulerState {
    /// A scheduler for `model` whose KV pool has `num_pages` pages (the same
    /// page ids as session memory).
    pub fn new(
        model: Arc<dyn CausalLm>,
        num_pages: usize,
        cfg: SchedulerConfig,
        detok: Option<Arc<dyn Detokenize>>,
    ) -> Self {
        let info = model.info().clone();
        let pool = KvPool::new(info.kv_layers, num_pages, cfg.page_size, info.kv_width)
            .externally_allocated();
        SchedulerState {
            model,
            pool,
            cfg,
            detok,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 1,
            stats: SchedulerStats::default(),
            forward_on_pool: true,
        }
    }

    /// Whether each batched forward runs on a rayon worker (default). Turn it
    /// off when the model waits on other threads that use the pool (expert
    /// shards): a blocked worker could otherwise starve them.
    pub fn set_forward_on_pool(&mut self, on: bool) {
        self.forward_on_pool = on;
    }

    /// Queues a request, or refuses it when the queue is full or it cannot run.
    pub fn enqueue(
        &mut self,
        req: ValidRequest,
        events: mpsc::Sender<TokenEvent>,
    ) -> Result<RequestId, SubmitError> {
        let ctx = self.model.info().max_position;
        if req.prompt.is_empty() {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        if req.prompt.len() >= ctx {
            return Err(SubmitError::Invalid(format!(
                "prompt has {} tokens, but the context length is {ctx}",
                req.prompt.len()
            )));
        }
        if let Some(k) = &req.cache_key {
            if k.len() != req.prompt.len() {
                return Err(SubmitError::Invalid(
                    "cache_key must have one element per prompt token".into(),
                ));
            }
        }
        if self.waiting.len() >= self.cfg.max_waiting_requests {
            return Err(SubmitError::Overloaded {
                waiting: self.waiting.len(),
                limit: self.cfg.max_waiting_requests,
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Waiting { id, req, events });
        Ok(id)
    }

    /// Counters.
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            ..self.stats.clone()
        }
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Runs one scheduling step: drop cancelled requests, admit, batch, forward, sample.
    pub fn step(&mut self, mem: &mut dyn MemoryPort) -> StepOutcome {
        self.drop_cancelled(mem);
        self.admit(mem);
        if self.running.is_empty() {
            return if self.waiting.is_empty() {
                StepOutcome::Idle
            } else {
                StepOutcome::Paused
            };
        }
        let plan = self.plan();
        if plan.is_empty() {
            return StepOutcome::Paused;
        }
        self.run(plan, mem);
        StepOutcome::Ran
    }

    fn drop_cancelled(&mut self, mem: &mut dyn MemoryPort) {
        let before = self.waiting.len();
        self.waiting.retain(|w| !w.events.is_closed());
        self.stats.cancelled += (before - self.waiting.len()) as u64;
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].events.is_closed() {
                let r = self.running.swap_remove(i);
                tracing::debug!(
                    request = r.id,
                    generated = r.generated.len(),
                    "cancelled by client"
                );
                mem.release(ReleaseSequence {
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

    fn admit(&mut self, mem: &mut dyn MemoryPort) {
        let info = self.model.info().clone();
        let hybrid = info.linear_layers > 0;
        while self.running.len() < self.cfg.max_running_requests {
            let Some(i) = self.pick_waiting() else { break };
            let w = &self.waiting[i];
            let key: Vec<u64> = w
                .req
                .cache_key
                .clone()
                .unwrap_or_else(|| w.req.prompt.iter().map(|&t| t as u64).collect());
            let reserve = (w.req.prompt.len() + w.req.max_tokens).min(info.max_position);
            match mem.admit(MatchPrefix {
                reply: None,
                key: key.clone(),
                hybrid,
                reserve_tokens: reserve,
            }) {
                Ok(adm) => {
                    let w = self.waiting.remove(i).expect("index from pick_waiting");
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
                    self.running.push(Running {
                        id: w.id,
                        req: w.req,
                        events: w.events,
                        state,
                        key,
                        generated: Vec::new(),
                        pending: None,
                        node: adm.node,
                        rng: Rng::new(seed),
                        cache,
                        snapshots: Vec::new(),
                        decode_snapshot: None,
                    });
                }
                Err(MemoryError::OutOfPages { needed, available }) if self.running.is_empty() => {
                    let w = self.waiting.remove(i).expect("index from pick_waiting");
                    let _ = w.events.try_send(TokenEvent::Error {
                        kind: "kv_cache_full",
                        message: format!("request needs {needed} KV pages but only {available} can ever be free; raise --kv-cache-memory or lower max_tokens"),
                    });
                }
                Err(_) => break,
            }
        }
    }

    /// Tokens each running sequence feeds this step: `(index, start, end)`
    /// into its prompt, or `(index, usize::MAX, _)` for a decode token.
    fn plan(&mut self) -> Vec<(usize, usize, usize)> {
        let mut budget = self.cfg.max_batch_tokens.max(1);
        let mut plan = Vec::new();
        for (i, r) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if r.pending.is_some() && r.events.capacity() > 0 {
                plan.push((i, usize::MAX, 0));
                budget -= 1;
            }
        }
        let hybrid = self.model.info().linear_layers > 0;
        let p = self.cfg.page_size;
        for (i, r) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if !r.in_prefill() {
                continue;
            }
            let start = r.state.len;
            let n = r.req.prompt.len();
            let mut end = (start + self.cfg.chunked_prefill_size.min(budget)).min(n);
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
            plan.push((i, start, end));
            budget -= end - start;
        }
        plan
    }

    fn run(&mut self, plan: Vec<(usize, usize, usize)>, mem: &mut dyn MemoryPort) {
        let inputs: Vec<(usize, Vec<u32>, LogitsMode)> = plan
            .iter()
            .map(|&(i, s, e)| {
                let r = &self.running[i];
                if s == usize::MAX {
                    (
                        i,
                        vec![r.pending.expect("planned decode has a pending token")],
                        LogitsMode::Last,
                    )
                } else {
                    self.stats.prefill_tokens += (e - s) as u64;
                    (
                        i,
                        r.req.prompt[s..e].to_vec(),
                        if e == r.req.prompt.len() {
                            LogitsMode::Last
                        } else {
                            LogitsMode::None
                        },
                    )
                }
            })
            .collect();
        let mut slots: Vec<Option<&mut Running>> = self.running.iter_mut().map(Some).collect();
        let mut batch = Vec::with_capacity(inputs.len());
        for (i, toks, mode) in &inputs {
            let r = slots[*i]
                .take()
                .expect("each sequence appears once in a plan");
            batch.push(SeqBatch {
                tokens: toks,
                state: &mut r.state,
                logits: *mode,
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
        drop(batch);
        self.stats.steps += 1;
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                let mut failed: Vec<usize> = inputs.iter().map(|(i, _, _)| *i).collect();
                failed.sort_unstable_by(|a, b| b.cmp(a));
                for i in failed {
                    let r = self.running.swap_remove(i);
                    let _ = r.events.try_send(TokenEvent::Error {
                        kind: "internal_error",
                        message: e.to_string(),
                    });
                    mem.release(ReleaseSequence {
                        pages: r.state.block_table,
                        node: r.node,
                    });
                }
                return;
            }
        };
        let vocab = self.model.info().vocab_size;
        let max_pos = self.model.info().max_position;
        let p = self.cfg.page_size;
        let interval = self.cfg.state_checkpoint_interval.max(p) / p * p;
        let hybrid = self.model.info().linear_layers > 0;
        let mut row = 0;
        let mut finished = Vec::new();
        for (i, _, mode) in &inputs {
            let r = &mut self.running[*i];
            if hybrid && r.state.len % p == 0 {
                let snap = r.state.linear.clone();
                let prompt_boundary = r.state.len <= r.req.prompt.len();
                if prompt_boundary || r.state.len % interval == 0 {
                    r.snapshots.push((r.state.len, snap));
                } else {
                    r.decode_snapshot = Some((r.state.len, snap));
                }
            }
            if *mode != LogitsMode::Last {
                continue;
            }
            let mut l = logits[row * vocab..(row + 1) * vocab].to_vec();
            row += 1;
            apply_penalties(&mut l, &r.req.prompt, &r.generated, &r.req.sampling);
            let tok = sample(&l, &r.req.sampling, &mut r.rng);
            r.generated.push(tok);
            r.key.push(tok as u64);
            self.stats.generated_tokens += 1;
            if r.events.try_send(TokenEvent::Token { id: tok }).is_err() {
                r.pending = None;
                continue; // closed: dropped at the next step
            }
            let stop_id = r.req.stop.ids.contains(&tok);
            let stop_str = !r.req.stop.strings.is_empty()
                && self.detok.as_ref().is_some_and(|d| {
                    let text = d.decode(&r.generated);
                    r.req.stop.strings.iter().any(|s| text.contains(s.as_str()))
                });
            let length = r.generated.len() >= r.req.max_tokens
                || r.req.prompt.len() + r.generated.len() >= max_pos;
            if stop_id || stop_str || length {
                finished.push((
                    *i,
                    if stop_id || stop_str {
                        FinishReason::Stop
                    } else {
                        FinishReason::Length
                    },
                ));
            } else {
                r.pending = Some(tok);
            }
        }
        finished.sort_unstable_by(|a, b| b.0.cmp(&a.0));
        for (i, reason) in finished {
            let mut r = self.running.swap_remove(i);
            tracing::debug!(
                request = r.id,
                generated = r.generated.len(),
                ?reason,
                "finished"
            );
            let done = TokenEvent::Finished {
                reason,
                completion_tokens: r.generated.len(),
                cache: r.cache.clone(),
            };
            let mut snapshots = std::mem::take(&mut r.snapshots);
            snapshots.extend(r.decode_snapshot.take());
            let len = r.state.len;
            r.key.truncate(len);
            // Commit before telling the client, so its next turn finds the cache.
            mem.commit(CommitSequence {
                key: r.key,
                pages: r.state.block_table,
                node: r.node,
                session: r.req.session,
                snapshots,
            });
            let _ = r.events.try_send(done);
            self.stats.finished += 1;
        }
    }
}

/// Memory port that messages the SessionMemory actor (its own thread) from
/// the scheduler's thread. Commands are queued with `try_send` (retrying
/// while the bounded mailbox is full); lookups wait on a one-slot reply
/// channel. One sender, one FIFO mailbox: a commit is always seen by the
/// lookups that follow it.
pub struct ActorMemory(pub actix::Addr<crate::session_memory::SessionMemoryActor>);

impl ActorMemory {
    fn push<M>(&self, mut msg: M) -> bool
    where
        M: actix::Message + Send + 'static,
        M::Result: Send,
        crate::session_memory::SessionMemoryActor: Handler<M>,
    {
        for _ in 0..100_000 {
            match self.0.try_send(msg) {
                Ok(()) => return true,
                Err(actix::prelude::SendError::Full(m)) => {
                    msg = m;
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
                Err(actix::prelude::SendError::Closed(_)) => return false,
            }
        }
        false
    }
}

impl MemoryPort for ActorMemory {
    fn admit(&mut self, mut m: MatchPrefix) -> Result<Admission, MemoryError> {
        let need = m.reserve_tokens;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        m.reply = Some(tx);
        if !self.push(m) {
            return Err(MemoryError::OutOfPages {
                needed: need,
                available: 0,
            });
        }
        rx.recv().unwrap_or(Err(MemoryError::OutOfPages {
            needed: need,
            available: 0,
        }))
    }
    fn commit(&mut self, c: CommitSequence) {
        self.push(c);
    }
    fn release(&mut self, r: ReleaseSequence) {
        self.push(r);
    }
}

/// The scheduler actor: [`SchedulerState`] plus a self-driven step loop.
pub struct Scheduler {
    /// The logic.
    pub state: SchedulerState,
    /// Session memory.
    pub memory: ActorMemory,
    /// A step is queued.
    stepping: bool,
}

impl Scheduler {
    /// Wraps a state and a memory address.
    pub fn new(
        state: SchedulerState,
        memory: actix::Addr<crate::session_memory::SessionMemoryActor>,
    ) -> Scheduler {
        Scheduler {
            state,
            memory: ActorMemory(memory),
            stepping: false,
        }
    }

    fn kick(&mut self, ctx: &mut Context<Self>) {
        if !self.stepping {
            self.stepping = true;
            ctx.notify(RunStep);
        }
    }
}

impl Actor for Scheduler {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.set_mailbox_capacity(1024);
    }
}

impl Handler<AdmitRequest> for Scheduler {
    type Result = Result<RequestId, SubmitError>;
    fn handle(&mut self, m: AdmitRequest, ctx: &mut Context<Self>) -> Self::Result {
        let id = self.state.enqueue(m.request, m.events)?;
        self.kick(ctx);
        Ok(id)
    }
}

impl Handler<RunStep> for Scheduler {
    type Result = ();
    fn handle(&mut self, _: RunStep, ctx: &mut Context<Self>) {
        match self.state.step(&mut self.memory) {
            StepOutcome::Ran => ctx.notify(RunStep),
            StepOutcome::Paused => {
                // Every runnable stream is waiting for its client: poll again shortly.
                ctx.run_later(std::time::Duration::from_millis(2), |_, ctx| {
                    ctx.notify(RunStep)
                });
            }
            StepOutcome::Idle => self.stepping = false,
        }
    }
}

impl Handler<GetSchedulerStats> for Scheduler {
    type Result = MessageResult<GetSchedulerStats>;
    fn handle(&mut self, _: GetSchedulerStats, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.state.stats())
    }
}
