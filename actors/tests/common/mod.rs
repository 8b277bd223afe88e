//! A small deterministic model for scheduler tests, and helpers.
//!
//! [`CountingLm`] keeps real state in the paged KV pool: every token's id is
//! written to its KV row, and the next id is a function of the ids read
//! back from the pool through the block table (and, for the hybrid form,
//! of a recurrent state that must agree with them). A sequence served a
//! wrong page, a page another sequence overwrote, or a stale KDA snapshot
//! therefore produces different tokens or an error, and [`expected`] gives
//! the right tokens without any runtime.

#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use caracal_actors::engine::{
    CausalLm, Detokenize, EngineError, LinearState, LogitsMode, ModelInfo, SeqBatch, SeqState,
};
use caracal_actors::messages::{StopConditions, ValidRequest};
use caracal_kernels::paged::KvPool;
use caracal_kernels::sampling::SamplingParams;

/// Logit width of the model.
pub const VOCAB: usize = 61;

/// A prompt holding this id makes the forward fail.
pub const POISON: u32 = 60;

/// Next id after a history of `len` ids summing to `sum`.
pub fn next_id(sum: u64, len: usize) -> u32 {
    ((sum * 31 + len as u64 * 7) % (VOCAB as u64 - 1)) as u32
}

/// The tokens `n` greedy steps produce after `prompt`.
pub fn expected(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut sum: u64 = prompt.iter().map(|&t| t as u64).sum();
    let mut out = Vec::new();
    for len in prompt.len()..prompt.len() + n {
        let t = next_id(sum, len);
        out.push(t);
        sum += t as u64;
    }
    out
}

/// Lets a test hold the first forward until it has done something.
pub struct ForwardGate {
    /// Whether the next forward stops at the barrier.
    armed: AtomicBool,
    /// Two parties: the forward and the test. The forward waits twice:
    /// once to say "I am running", once to be let go.
    barrier: Barrier,
}

impl ForwardGate {
    /// A gate that stops the next forward.
    pub fn armed() -> Arc<ForwardGate> {
        Arc::new(ForwardGate {
            armed: AtomicBool::new(true),
            barrier: Barrier::new(2),
        })
    }

    /// Returns once a forward is running (and held).
    pub fn wait_until_running(&self) {
        self.barrier.wait();
    }

    /// Lets the held forward finish.
    pub fn release(&self) {
        self.barrier.wait();
    }
}

/// The test model (see the module docs).
pub struct CountingLm {
    /// Static facts.
    info: ModelInfo,
    /// Holds the first forward, when set.
    gate: Option<Arc<ForwardGate>>,
    /// Forwards run.
    pub forwards: AtomicUsize,
}

impl CountingLm {
    /// A model with one KV layer; `hybrid` adds one recurrent layer.
    pub fn new(hybrid: bool) -> CountingLm {
        CountingLm {
            info: ModelInfo {
                model_type: "counting".into(),
                vocab_size: VOCAB,
                max_position: 512,
                kv_layers: 1,
                kv_width: 1,
                kv_segment: 1,
                linear_layers: usize::from(hybrid),
                eos_ids: Vec::new(),
                num_params: 0,
            },
            gate: None,
            forwards: AtomicUsize::new(0),
        }
    }

    /// The same model whose first forward waits at `gate`.
    pub fn gated(gate: Arc<ForwardGate>) -> CountingLm {
        CountingLm {
            gate: Some(gate),
            ..CountingLm::new(false)
        }
    }
}

impl CausalLm for CountingLm {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_state(&self) -> SeqState {
        SeqState {
            linear: (0..self.info.linear_layers)
                .map(|_| LinearState {
                    conv: Vec::new(),
                    recurrent: vec![0.0],
                })
                .collect(),
            ..SeqState::default()
        }
    }

    fn forward(
        &self,
        cache: &mut KvPool,
        batch: &mut [SeqBatch<'_>],
    ) -> Result<Vec<f32>, EngineError> {
        self.forwards.fetch_add(1, Ordering::SeqCst);
        if let Some(g) = &self.gate {
            if g.armed.swap(false, Ordering::SeqCst) {
                g.barrier.wait();
                g.barrier.wait();
            }
        }
        let mut logits = Vec::new();
        for s in batch.iter_mut() {
            if s.tokens.contains(&POISON) {
                return Err(EngineError::InvalidInput("poisoned prompt".into()));
            }
            let end = s.state.len + s.tokens.len();
            if end.div_ceil(cache.page_size) > s.state.block_table.len() {
                return Err(EngineError::InvalidInput(format!(
                    "{end} tokens do not fit {} pages",
                    s.state.block_table.len()
                )));
            }
            for (j, &t) in s.tokens.iter().enumerate() {
                cache.row_mut(0, &s.state.block_table, s.state.len + j)[0] = t as f32;
                if let Some(l) = s.state.linear.first_mut() {
                    l.recurrent[0] += t as f32;
                }
            }
            s.state.len = end;
            if s.logits == LogitsMode::None {
                continue;
            }
            let sum: f32 = (0..end)
                .map(|p| cache.row(0, &s.state.block_table, p)[0])
                .sum();
            if let Some(l) = s.state.linear.first() {
                if l.recurrent[0] != sum {
                    return Err(EngineError::InvalidInput(format!(
                        "recurrent state {} disagrees with the KV rows {sum}",
                        l.recurrent[0]
                    )));
                }
            }
            let mut row = vec![0.0; VOCAB];
            row[next_id(sum as u64, end) as usize] = 1.0;
            logits.extend(row);
        }
        Ok(logits)
    }
}

/// Id `i` decodes to the letter `'a' + i % 26`.
pub struct Letters;

impl Detokenize for Letters {
    fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&i| char::from(b'a' + (i % 26) as u8))
            .collect()
    }
}

/// A greedy request.
pub fn greedy(prompt: Vec<u32>, max_tokens: usize, session: Option<&str>) -> ValidRequest {
    ValidRequest {
        session: session.map(String::from),
        prompt,
        cache_key: None,
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop: StopConditions::default(),
        ..Default::default()
    }
}
