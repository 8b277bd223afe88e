//! Runtime flags shared by `batch`, `bench` and (later) `serve`, named like
//! SGLang's / vLLM's.

use std::time::Duration;

use caracal_actors::runtime::EngineConfig;
use caracal_actors::scheduler::SchedulerConfig;
use clap::Args;

/// Scheduler, cache and expert-parallel settings.
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// Expert shards (threads owning disjoint experts); 1 runs experts inline.
    #[arg(long, default_value_t = 1)]
    pub ep: usize,
    /// Sequences decoding at once.
    #[arg(long, default_value_t = 64)]
    pub max_running_requests: usize,
    /// Tokens per batched forward (decode + prefill).
    #[arg(long, default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// Largest prefill chunk of one sequence per step.
    #[arg(long, default_value_t = 512)]
    pub chunked_prefill_size: usize,
    /// Requests that may wait for admission before new ones are refused as overloaded.
    #[arg(long, default_value_t = 256)]
    pub max_waiting_requests: usize,
    /// KV cache budget, e.g. 512MiB, 2GiB or a byte count.
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    pub kv_cache_memory: usize,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 16)]
    pub page_size: usize,
    /// KDA state snapshot every N tokens (hybrid models), besides turn ends.
    #[arg(long, default_value_t = 512)]
    pub state_checkpoint_interval: usize,
    /// Seconds a session's cached path stays pinned without use.
    #[arg(long, default_value_t = 600)]
    pub session_ttl: u64,
    /// How KV rows are stored: `bf16` (half the bytes of f32), `int8` (half
    /// of bf16, plus one f32 scale per token and head) or `f32`; attention
    /// always accumulates in f32.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "int8", "f32"])]
    pub kv_cache_dtype: String,
}

/// Size flags (`--kv-cache-memory`, `--max-body-bytes`, …) through the one size parser ([`caracal::units::parse_bytes`]).
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    caracal::units::parse_bytes(s)
        .map_err(|e| e.to_string())
        .and_then(|b| {
            usize::try_from(b)
                .map_err(|_| format!("`{s}` does not fit this machine's address space"))
        })
}

impl EngineArgs {
    /// The runtime configuration these flags describe.
    pub fn config(&self) -> EngineConfig {
        EngineConfig {
            scheduler: SchedulerConfig {
                max_running_requests: self.max_running_requests.max(1),
                max_batch_tokens: self.max_batch_tokens.max(1),
                chunked_prefill_size: self.chunked_prefill_size.max(1),
                max_waiting_requests: self.max_waiting_requests,
                page_size: self.page_size.max(1),
                state_checkpoint_interval: self.state_checkpoint_interval.max(1),
                // clap only lets the names `KvDtype` parses through.
                kv_cache_dtype: self.kv_cache_dtype.parse().unwrap_or_default(),
            },
            kv_cache_memory: self.kv_cache_memory,
            ep: self.ep.max(1),
            stream_credit: 64,
            session_ttl: Duration::from_secs(self.session_ttl),
        }
    }
}
