//! Every message that crosses an actor boundary, and nothing else.
//!
//! Each message is a plain struct named as a command or event, with its
//! reply type declared through `#[rtype]`. Replies that can fail carry a
//! typed error.

use actix::Message;
use caracal_kernels::sampling::SamplingParams;
use tokio::sync::mpsc;

use crate::engine::LinearState;
use crate::radix::NodeId;

/// Identifies one request inside the scheduler.
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
#[derive(Debug, Clone)]
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

/// How much of a prompt came from the prefix cache, and why the rest missed.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CacheReport {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV (and KDA state) came from the cache.
    pub cached_tokens: usize,
    /// Why the uncached part missed (empty when everything hit).
    pub miss_reason: String,
}

/// What a request streams back, over its own bounded channel.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenEvent {
    /// One generated token.
    Token {
        /// The id.
        id: u32,
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
        /// Stable error type (`overloaded`, `context_length_exceeded`, ...).
        kind: &'static str,
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
    /// The request cannot run on this model.
    #[error("{0}")]
    Invalid(String),
    /// The runtime is shutting down.
    #[error("the engine is not running")]
    Stopped,
}

/// Scheduler command: queue a request; tokens go to `events`.
#[derive(Message)]
#[rtype(result = "Result<RequestId, SubmitError>")]
pub struct AdmitRequest {
    /// The validated request.
    pub request: ValidRequest,
    /// Where its events go; dropping the receiver cancels the request.
    pub events: mpsc::Sender<TokenEvent>,
}

/// Scheduler command: run one step (sent by the scheduler to itself).
#[derive(Message)]
#[rtype(result = "()")]
pub struct RunStep;

/// Scheduler query: counters.
#[derive(Message)]
#[rtype(result = "SchedulerStats")]
pub struct GetSchedulerStats;

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
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Requests cancelled by their client.
    pub cancelled: u64,
    /// Requests finished.
    pub finished: u64,
}

/// SessionMemory command: find the cached prefix of `key`, lock it, and
/// reserve pages for `reserve_tokens` tokens in total. The answer goes back
/// over `reply` when one is given (the scheduler blocks on it between steps).
#[derive(Message, Debug)]
#[rtype(result = "Result<Admission, MemoryError>")]
pub struct MatchPrefix {
    /// Where the answer goes (besides the actix reply).
    pub reply: Option<std::sync::mpsc::SyncSender<Result<Admission, MemoryError>>>,
    /// Radix key of the prompt.
    pub key: Vec<u64>,
    /// The model has recurrent (KDA) layers: only snapshot boundaries hit.
    pub hybrid: bool,
    /// Tokens the sequence may grow to (prompt + max_tokens).
    pub reserve_tokens: usize,
}

/// The reply to [`MatchPrefix`].
#[derive(Debug, Clone)]
pub struct Admission {
    /// Prompt tokens served from cache (a multiple of the page size).
    pub cached_tokens: usize,
    /// The sequence's block table: cached pages, then fresh ones.
    pub pages: Vec<u32>,
    /// The locked radix node at the end of the cached prefix.
    pub node: NodeId,
    /// KDA state at `cached_tokens` (hybrid models with a hit).
    pub snapshot: Option<std::sync::Arc<Vec<LinearState>>>,
    /// Why the rest of the prompt missed.
    pub miss_reason: String,
}

/// SessionMemory errors.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MemoryError {
    /// Not enough pages even after evicting every unlocked prefix.
    #[error("KV cache full: {needed} pages needed, {available} obtainable")]
    OutOfPages {
        /// Pages needed.
        needed: usize,
        /// Pages free or evictable.
        available: usize,
    },
    /// A stale or unknown radix node.
    #[error("radix cache: {0}")]
    Radix(String),
}

/// SessionMemory command: a sequence finished; cache its tokens and pin the
/// session's path.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct CommitSequence {
    /// Key of every token whose KV was written (prompt + generated, in order).
    pub key: Vec<u64>,
    /// The sequence's block table.
    pub pages: Vec<u32>,
    /// The node locked at admission.
    pub node: NodeId,
    /// Session to pin, if any.
    pub session: Option<String>,
    /// KDA states captured at page-aligned boundaries: `(tokens, states)`.
    pub snapshots: Vec<(usize, Vec<LinearState>)>,
}

/// SessionMemory command: a sequence was cancelled or failed; drop its
/// references without caching anything it produced.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct ReleaseSequence {
    /// The sequence's block table.
    pub pages: Vec<u32>,
    /// The node locked at admission.
    pub node: NodeId,
}

/// SessionMemory query: occupancy counters.
#[derive(Message)]
#[rtype(result = "MemoryStats")]
pub struct GetMemoryStats;

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

/// ExpertShard command: run some rows of one MoE layer through this shard's
/// experts. The outputs go back over `reply` (a one-slot channel the
/// waiting forward blocks on), one per `items` pair.
#[derive(Message)]
#[rtype(result = "()")]
pub struct RunExperts {
    /// Where the outputs go.
    pub reply: std::sync::mpsc::SyncSender<Vec<Vec<f32>>>,
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
