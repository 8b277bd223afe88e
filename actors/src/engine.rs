//! The interface between the runtime and the models it runs.
//!
//! The actors know nothing about architectures: a model is a [`CausalLm`]
//! that runs one batched forward over several sequences, each carrying its
//! [`SeqState`] (block table into the shared KV pool, length, recurrent
//! state). MoE models can also expose their routed experts through the
//! optional [`MoeModel`] capability so that expert shards can run them.

use std::sync::Arc;

use caracal_kernels::paged::KvPool;

/// Errors a model forward can raise.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The sequence would exceed the model's context length.
    #[error("sequence of {tokens} tokens exceeds the context length {context}")]
    ContextExceeded {
        /// Tokens the sequence would hold.
        tokens: usize,
        /// The model's limit.
        context: usize,
    },
    /// KV pages ran out.
    #[error(transparent)]
    Kernel(#[from] caracal_kernels::Error),
    /// A malformed batch or token.
    #[error("invalid input: {0}")]
    InvalidInput(String),
}

/// What the runtime needs to know about a loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// `model_type` from config.json.
    pub model_type: String,
    /// Logit width.
    pub vocab_size: usize,
    /// Largest position the model accepts (context length).
    pub max_position: usize,
    /// Layers that keep paged KV rows (GQA or MLA layers).
    pub kv_layers: usize,
    /// f32 values per token per KV layer.
    pub kv_width: usize,
    /// Layers with recurrent state (KDA).
    pub linear_layers: usize,
    /// Stop ids from generation_config.json / config.json.
    pub eos_ids: Vec<u32>,
    /// Parameters in the checkpoint.
    pub num_params: usize,
}

/// Recurrent state of one linear-attention (KDA) layer for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearState {
    /// Short-convolution history: `[channels, kernel - 1]` pre-conv inputs.
    pub conv: Vec<f32>,
    /// Delta-rule state: `[heads, k_dim, v_dim]`.
    pub recurrent: Vec<f32>,
}

/// Everything a sequence carries between forward calls.
#[derive(Debug, Clone, Default)]
pub struct SeqState {
    /// Pages of the KV pool holding this sequence's rows, in order.
    pub block_table: Vec<u32>,
    /// Tokens already processed (the position of the next token).
    pub len: usize,
    /// One entry per KDA layer, in layer order.
    pub linear: Vec<LinearState>,
}

/// Which logits a sequence wants back from a forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsMode {
    /// Only the last new token's (generation).
    Last,
    /// Every new token's (perplexity).
    All,
    /// None (a prefill chunk that is not the last one).
    None,
}

/// One sequence's share of a batched forward.
pub struct SeqBatch<'a> {
    /// New tokens, appended at position `state.len`.
    pub tokens: &'a [u32],
    /// The sequence's cache state; advanced by the forward.
    pub state: &'a mut SeqState,
    /// Which logits to return.
    pub logits: LogitsMode,
}

/// A decoder-only language model.
pub trait CausalLm: Send + Sync {
    /// Static facts about the model.
    fn info(&self) -> &ModelInfo;

    /// A fresh state for a new sequence (zeroed recurrent states).
    fn new_state(&self) -> SeqState;

    /// Runs the new tokens of every sequence in one batched pass, writing
    /// their KV rows into `cache` and advancing each state. Returns the
    /// requested logits rows, sequence by sequence, each `vocab_size` wide.
    fn forward(
        &self,
        cache: &mut KvPool,
        batch: &mut [SeqBatch<'_>],
    ) -> Result<Vec<f32>, EngineError>;

    /// The MoE capability, for models with routed experts.
    fn as_moe(&self) -> Option<&dyn MoeModel> {
        None
    }
}

/// One routed expert's feed-forward network.
pub trait ExpertFfn: Send + Sync {
    /// `[n, hidden] → [n, hidden]` (unweighted).
    fn forward(&self, x: &[f32]) -> Vec<f32>;
}

/// Runs the routed experts of one MoE layer for a batch of rows.
pub trait ExpertDispatch: Send + Sync {
    /// For each row `r` of `x` (`[n, hidden]`), returns
    /// `Σ_k w_k · expert_k(x_r)` over `choices[r] = [(expert, w), ...]`,
    /// summed in `choices` order so that results do not depend on where
    /// experts run.
    fn run(
        &self,
        moe_layer: usize,
        x: &[f32],
        hidden: usize,
        choices: &[Vec<(usize, f32)>],
    ) -> Vec<f32>;
}

/// Optional capability of MoE models: hand out experts, take a dispatcher.
pub trait MoeModel: Send + Sync {
    /// Routed experts of every MoE layer, in layer order.
    fn experts(&self) -> Vec<Vec<Arc<dyn ExpertFfn>>>;
    /// Routes all MoE layers' expert compute through `dispatch`.
    fn set_expert_dispatch(&self, dispatch: Arc<dyn ExpertDispatch>);
}

/// Computes `Σ_k w_k · expert_k(x_r)` for every row locally, grouping rows
/// by expert so each expert runs once; sums in `choices` order.
pub fn run_experts_local(
    experts: &[Arc<dyn ExpertFfn>],
    x: &[f32],
    hidden: usize,
    choices: &[Vec<(usize, f32)>],
) -> Vec<f32> {
    let outputs = expert_outputs(x, hidden, choices, |e| Some(experts[e].as_ref()));
    combine(&outputs, hidden, choices)
}

/// Per `(row, k)` unweighted expert outputs for the experts `get` returns
/// (`None` = not computed here).
pub fn expert_outputs<'a>(
    x: &[f32],
    hidden: usize,
    choices: &[Vec<(usize, f32)>],
    get: impl Fn(usize) -> Option<&'a dyn ExpertFfn>,
) -> Vec<Vec<Option<Vec<f32>>>> {
    let mut by_expert: std::collections::BTreeMap<usize, Vec<(usize, usize)>> = Default::default();
    for (r, c) in choices.iter().enumerate() {
        for (k, &(e, _)) in c.iter().enumerate() {
            by_expert.entry(e).or_default().push((r, k));
        }
    }
    let mut out: Vec<Vec<Option<Vec<f32>>>> = choices.iter().map(|c| vec![None; c.len()]).collect();
    for (e, items) in by_expert {
        let Some(expert) = get(e) else { continue };
        let mut xs = Vec::with_capacity(items.len() * hidden);
        for &(r, _) in &items {
            xs.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        let y = expert.forward(&xs);
        for (i, &(r, k)) in items.iter().enumerate() {
            out[r][k] = Some(y[i * hidden..(i + 1) * hidden].to_vec());
        }
    }
    out
}

/// Weighted sum of per-`(row, k)` outputs in `choices` order.
pub fn combine(
    outputs: &[Vec<Option<Vec<f32>>>],
    hidden: usize,
    choices: &[Vec<(usize, f32)>],
) -> Vec<f32> {
    let mut y = vec![0.0; choices.len() * hidden];
    for (r, c) in choices.iter().enumerate() {
        let row = &mut y[r * hidden..(r + 1) * hidden];
        for (k, &(_, w)) in c.iter().enumerate() {
            let o = outputs[r][k]
                .as_ref()
                .expect("every chosen expert produced an output");
            for (a, b) in row.iter_mut().zip(o) {
                *a += w * b;
            }
        }
    }
    y
}

/// Turns ids into text, for stop strings (implemented by the tokenizer).
pub trait Detokenize: Send + Sync {
    /// Decodes `ids` (special tokens skipped).
    fn decode(&self, ids: &[u32]) -> String;
}
