//! Every message that crosses an actor or thread boundary, and nothing else.
//!
//! Each message is a plain struct named as a command or event. Commands to
//! the scheduler travel as a [`SchedulerCommand`] over one bounded queue
//! (the engine handle → the scheduler thread); events travel back over each
//! request's own bounded channel as [`TokenEvent`]s; counters come back as
//! a published [`EngineStats`] snapshot. Messages to expert shards are actix
//! messages with their reply type declared through `#[rtype]`.
//!
//! Kinds that clients see (finish reasons, error kinds, cache-miss reasons)
//! are enums with a stable `as_str()` spelling.

use std::fmt;

use actix::Message;
use caracal_kernels::sampling::SamplingParams;
use tokio::sync::mpsc;

use crate::constraint::SeqConstraint;
use crate::engine::EmbedSpan;

/// Identifies one request inside the scheduler (assigned when it is submitted).
pub type RequestId = u64;

/// When a request stops generating.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StopConditions {
    /// Ids that end generation (the model's EOS ids unless `ignore_eos`).
    pub ids: Vec<u32>,
    /// Strings that end generation when they appear in the output text.
    pub strings: Vec<String>,
}

/// A request the gateway has validated: the only thing the scheduler accepts.
#[derive(Debug, Clone, Default)]
pub struct ValidRequest {
    /// Session (agent connection) the request belongs to, for fairness and pins.
    pub session: Option<String>,
    /// Prompt token ids (media spans already expanded to placeholder ids).
    pub prompt: Vec<u32>,
    /// Radix key of the prompt when it differs from the ids (media spans keyed
    /// by content hash); `None` uses the ids.
    pub cache_key: Option<Vec<u64>>,
    /// Most new tokens.
    pub max_tokens: usize,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Stop ids and strings.
    pub stop: StopConditions,
    /// Log-probabilities to report per generated token: `None` for none,
    /// `Some(k)` for the sampled token's plus the `k` most likely (k ≤
    /// [`MAX_TOP_LOGPROBS`]). Computed from the model's raw logits (before
    /// penalties, temperature and grammar masks); a request that asks for
    /// them gets no jump-forward, so every token has its own.
    pub logprobs: Option<usize>,
    /// Media spans of the prompt: `offset` is the prompt index of the first
    /// placeholder, `rows` the tower's output for the whole item
    /// (`first_row` 0, `len` its token count). Needs a `cache_key` that keys
    /// those positions by content.
    pub media: Vec<EmbedSpan>,
}

/// Most alternatives a request may ask for per token (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Log-probabilities of one generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// Natural-log probability of the generated token.
    pub logprob: f32,
    /// The most likely tokens at this step, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Writes a kind enum as its stable spelling (JSON string).
macro_rules! serialize_as_str {
    ($t:ty) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop id or string was produced.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
}

impl FinishReason {
    /// OpenAI's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

serialize_as_str!(FinishReason);

/// Stable kind of a failed request, as clients see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The waiting queue is full.
    Overloaded,
    /// The request is malformed or cannot run on this model.
    InvalidRequest,
    /// The prompt does not fit the model's context.
    ContextLengthExceeded,
    /// The request needs more KV pages than the pool can ever free.
    KvCacheFull,
    /// The client cancelled the request (by id, or by closing its session).
    Cancelled,
    /// The engine is not running.
    EngineStopped,
    /// The model failed while running the request.
    InternalError,
    /// The request's grammar could not continue (its constraint failed);
    /// only that request ends.
    ConstraintViolation,
}

impl ErrorKind {
    /// The stable spelling (`overloaded`, `kv_cache_full`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::InvalidRequest => "invalid_request",
            ErrorKind::ContextLengthExceeded => "context_length_exceeded",
            ErrorKind::KvCacheFull => "kv_cache_full",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::EngineStopped => "engine_stopped",
            ErrorKind::InternalError => "internal_error",
            ErrorKind::ConstraintViolation => "constraint_violation",
        }
    }
}

serialize_as_str!(ErrorKind);

/// Why part of a prompt did not come from the prefix cache. `Display` gives
/// the human-readable sentence; [`MissReason::as_str`] the stable kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissReason {
    /// Nothing is cached yet.
    CacheEmpty,
    /// The cache holds other prompts, none sharing a first page with this one.
    NoCachedPrefix,
    /// The prompt leaves the cached path partway.
    Diverged {
        /// Tokens that matched before the paths part.
        after: usize,
    },
    /// The uncached tail is shorter than a page (only whole pages are cached).
    PartialPage {
        /// Prompt tokens after the cached prefix.
        tail: usize,
        /// Tokens per page.
        page_size: usize,
    },
    /// A hybrid model's hit was cut back to the last KDA state snapshot.
    SnapshotBehind {
        /// Tokens whose KV is cached.
        cached: usize,
        /// Where the latest usable snapshot is.
        snapshot_at: usize,
    },
    /// A hybrid model's cached KV has no KDA state snapshot at all.
    NoSnapshot {
        /// Tokens whose KV is cached.
        cached: usize,
    },
}

impl MissReason {
    /// The stable kind (`cache_empty`, `prefix_diverged`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            MissReason::CacheEmpty => "cache_empty",
            MissReason::NoCachedPrefix => "no_cached_prefix",
            MissReason::Diverged { .. } => "prefix_diverged",
            MissReason::PartialPage { .. } => "partial_page",
            MissReason::SnapshotBehind { .. } => "snapshot_behind",
            MissReason::NoSnapshot { .. } => "no_snapshot",
        }
    }
}

impl fmt::Display for MissReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            MissReason::CacheEmpty => f.write_str("cache empty"),
            MissReason::NoCachedPrefix => f.write_str("no cached prefix"),
            MissReason::Diverged { after } => {
                write!(f, "prefix diverges from the cache after {after} tokens")
            }
            MissReason::PartialPage { tail, page_size } => write!(
                f,
                "last {tail} tokens are not a whole cached page (page size {page_size})"
            ),
            MissReason::SnapshotBehind {
                cached,
                snapshot_at,
            } => write!(
                f,
                "{cached} tokens cached but the last KDA state snapshot is at {snapshot_at}"
            ),
            MissReason::NoSnapshot { cached } => write!(
                f,
                "{cached} tokens cached but no KDA state snapshot covers them"
            ),
        }
    }
}

/// How much of a prompt came from the prefix cache, and why the rest missed.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CacheReport {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV (and KDA state) came from the cache.
    pub cached_tokens: usize,
    /// Why the uncached part missed (`None` when everything that can hit did).
    pub miss_reason: Option<MissReason>,
}

/// What a request streams back, over its own bounded channel.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenEvent {
    /// One generated token.
    Token {
        /// The id.
        id: u32,
        /// Its log-probabilities, when the request asked for them.
        logprob: Option<Box<TokenLogprob>>,
    },
    /// The request ended normally.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Tokens generated.
        completion_tokens: usize,
        /// Cache use of the prompt.
        cache: CacheReport,
    },
    /// The request failed; no further events follow.
    Error {
        /// Stable error kind.
        kind: ErrorKind,
        /// Human-readable message.
        message: String,
    },
}

/// Why a submission was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    /// The waiting queue is full.
    #[error("server overloaded: {waiting} requests already waiting (limit {limit})")]
    Overloaded {
        /// Requests waiting.
        waiting: usize,
        /// The limit (`--max-waiting-requests`).
        limit: usize,
    },
    /// The prompt leaves no room to generate within the model's context.
    #[error("prompt has {prompt} tokens, but the context length is {context}")]
    PromptTooLong {
        /// Prompt tokens.
        prompt: usize,
        /// The model's context length.
        context: usize,
    },
    /// The request cannot run on this model.
    #[error("{0}")]
    Invalid(String),
    /// The runtime is shutting down.
    #[error("the engine is not running")]
    Stopped,
}

impl SubmitError {
    /// The stable kind clients see.
    pub fn kind(&self) -> ErrorKind {
        match self {
            SubmitError::Overloaded { .. } => ErrorKind::Overloaded,
            SubmitError::PromptTooLong { .. } => ErrorKind::ContextLengthExceeded,
            SubmitError::Invalid(_) => ErrorKind::InvalidRequest,
            SubmitError::Stopped => ErrorKind::EngineStopped,
        }
    }
}

/// Scheduler command: queue a request; its events go to `events`.
#[derive(Debug)]
pub struct AdmitRequest {
    /// Id assigned on submission.
    pub id: RequestId,
    /// The validated request.
    pub request: ValidRequest,
    /// Where its events go; dropping the receiver cancels the request.
    pub events: mpsc::Sender<TokenEvent>,
    /// The grammar its output must follow, if any.
    pub constraint: Option<SeqConstraint>,
}

/// Scheduler command: stop a request now; nothing it produced is cached.
#[derive(Debug, Clone, PartialEq)]
pub struct CancelRequest {
    /// The request (unknown or finished ids are ignored).
    pub id: RequestId,
}

/// Scheduler command: an agent connection closed; its requests are
/// cancelled and its pinned cache path unpinned (evictable again).
#[derive(Debug, Clone, PartialEq)]
pub struct SessionClosed {
    /// The session, as in [`ValidRequest::session`].
    pub session: String,
}

/// Scheduler command: a session superseded a cached path (a live video
/// window moved on); every cached path that agrees with `path` through the
/// page holding token `from` and that no running request holds is removed now, so its pages are free at once rather than
/// at the next LRU eviction.
#[derive(Debug)]
pub struct DropPath {
    /// Unpin this session first (its pin lies on the path being dropped).
    pub session: Option<String>,
    /// Radix key of the superseded path (at least through the page holding `from`).
    pub path: Vec<u64>,
    /// Its first superseded token: paths agreeing with `path` through the page that
    /// holds it are dropped; pages before that page stay.
    pub from: usize,
    /// Gets the number of pages freed.
    pub reply: Option<tokio::sync::oneshot::Sender<usize>>,
}

/// Everything the scheduler's bounded command queue carries.
#[derive(Debug)]
pub enum SchedulerCommand {
    /// [`AdmitRequest`].
    Admit(AdmitRequest),
    /// [`CancelRequest`].
    Cancel(CancelRequest),
    /// [`SessionClosed`].
    SessionClosed(SessionClosed),
    /// [`DropPath`].
    DropPath(DropPath),
}

/// Scheduler counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerStats {
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Requests running.
    pub running: usize,
    /// Forward steps run.
    pub steps: u64,
    /// Prompt tokens computed (not served from cache).
    pub prefill_tokens: u64,
    /// Tokens generated (sampled and forced).
    pub generated_tokens: u64,
    /// Generated tokens a grammar forced (jump-forward), appended without
    /// a forward step of their own.
    pub forced_tokens: u64,
    /// Requests ended by their grammar failing (`constraint_violation`).
    pub constraint_failures: u64,
    /// Requests cancelled by their client.
    pub cancelled: u64,
    /// Requests finished.
    pub finished: u64,
    /// Panics caught in the scheduler (a model's forward, sampling, a
    /// step); the requests behind each ended with `internal_error`.
    pub panics: u64,
}

/// SessionMemory counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemoryStats {
    /// Pages in the pool.
    pub total_pages: usize,
    /// Pages free.
    pub free_pages: usize,
    /// Pages held by the radix tree.
    pub cached_pages: usize,
    /// Cached pages that could be evicted now.
    pub evictable_pages: usize,
    /// Sessions with a pinned path.
    pub pinned_sessions: usize,
    /// KDA snapshots stored.
    pub snapshots: usize,
    /// Prompt tokens looked up / served from cache, over all admissions.
    pub lookup_tokens: u64,
    /// Prompt tokens served from cache.
    pub hit_tokens: u64,
}

/// What the scheduler publishes after every step (and after every batch of
/// commands), so that stats are answered without waiting for a forward.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    /// Scheduler counters.
    pub scheduler: SchedulerStats,
    /// Session memory counters.
    pub memory: MemoryStats,
}

/// ExpertShard command: run some rows of one MoE layer through this shard's
/// experts. The outputs go back over `reply` (a one-slot channel the
/// waiting forward blocks on), one per `items` pair.
#[derive(Message)]
#[rtype(result = "()")]
pub struct RunExperts {
    /// Where the outputs go: `[items, hidden]`, one row per item, in order.
    pub reply: std::sync::mpsc::SyncSender<Vec<f32>>,
    /// MoE layer index.
    pub layer: usize,
    /// Row width.
    pub hidden: usize,
    /// The rows, `[n, hidden]`.
    pub rows: Vec<f32>,
    /// `(row, expert)` pairs to compute; the reply has one output per pair.
    pub items: Vec<(usize, usize)>,
}

/// ExpertShard query: how often each expert it owns was chosen.
#[derive(Message)]
#[rtype(result = "Vec<(usize, usize, u64)>")]
pub struct GetExpertCounts;
