//! # caracal-actors
//!
//! The runtime: independent actors that exchange messages, and the plain
//! state structs they wrap.
//!
//! The request pipeline, and who owns each stage:
//!
//! ```text
//! ClientEvent (gateway, src/)          client JSON / CLI line
//!   → ValidRequest (gateway)           validated: ids, SamplingParams, limits
//!   → AdmitRequest (Engine → Scheduler) bounded command queue; a waiting slot
//!                                      and an id taken on submission
//!   → ScheduledBatch (Scheduler)       one batched forward per step (a plan of
//!                                      `Work`): decode rows of running
//!                                      sequences + prefill chunks; prefixes
//!                                      looked up in the SessionMemory it owns
//!   → RunExperts (ExpertShard ×N)      routed MoE rows per shard, per layer
//!   → TokenEvent (back to the caller)  token / finished / error, over the
//!                                      request's own bounded channel
//! ```
//!
//! Modules:
//! - [`constraint`]: the per-sequence grammar capability ([`constraint::Constraint`])
//!   the scheduler masks, consumes and jumps forward with.
//! - [`engine`]: the model interface the scheduler drives ([`engine::CausalLm`]).
//! - [`messages`]: every cross-thread message, and nothing else.
//! - [`scheduler`]: continuous batching, chunked prefill, sampling,
//!   cancellation; owns session memory; [`scheduler::driver`] is its thread.
//! - [`admission`]: the waiting-request bound and request ids shared by the
//!   submitting side and the scheduler.
//! - [`session_memory`]: KV page pool accounting, radix prefix cache, KDA state
//!   snapshots, session pins (plain state owned by the scheduler).
//! - [`stop`]: incremental stop-string matching.
//! - [`expert_shard`]: per-device expert shards and the dispatcher that splits
//!   routed rows between them.
//! - [`pages`], [`radix`]: the plain data structures behind session memory.
//! - [`runtime`]: starts the threads and hands out an [`runtime::Engine`] handle.
//! - [`ingest`]: media decode and preprocessing on a CPU pool of its own.
//! - [`vision`]: the VisionEncoder (batched tower calls, content-hash cache in bytes).

pub mod admission;
pub mod constraint;
pub mod engine;
pub mod expert_shard;
pub mod ingest;
pub mod messages;
pub mod pages;
pub mod radix;
pub mod runtime;
pub mod scheduler;
pub mod session_memory;
pub mod stop;
pub mod vision;
