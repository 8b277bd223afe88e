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
    /// Values per int8 KV scale: a GQA head, or for MLA a common divisor of
    /// the latent and rope widths (divides `kv_width`; see
    /// [`caracal_kernels::paged`]).
    pub kv_segment: usize,
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

/// Embedding rows that replace the token embeddings of some of a batch
/// entry's new tokens: a media span (image or video chunk) whose placeholder
/// ids stand for the vision tower's output.
#[derive(Debug, Clone)]
pub struct EmbedSpan {
    /// Index into the entry's `tokens` of the first replaced token.
    pub offset: usize,
    /// The span's rows, `[n, hidden]` row-major (the whole media item).
    pub rows: Arc<[f32]>,
    /// First row of `rows` used here (a prefill chunk may start inside a span).
    pub first_row: usize,
    /// Rows used here, replacing `tokens[offset..offset + len]`.
    pub len: usize,
}

impl EmbedSpan {
    /// The parts of `spans` (offsets into a whole prompt) that fall inside
    /// the chunk `start..start + len`, with offsets relative to the chunk.
    pub fn within(spans: &[EmbedSpan], start: usize, len: usize) -> Vec<EmbedSpan> {
        let end = start + len;
        spans
            .iter()
            .filter_map(|m| {
                let lo = m.offset.max(start);
                let hi = (m.offset + m.len).min(end);
                (lo < hi).then(|| EmbedSpan {
                    offset: lo - start,
                    rows: m.rows.clone(),
                    first_row: m.first_row + (lo - m.offset),
                    len: hi - lo,
                })
            })
            .collect()
    }
}

/// One sequence's share of a batched forward.
pub struct SeqBatch<'a> {
    /// New tokens, appended at position `state.len`.
    pub tokens: &'a [u32],
    /// The sequence's cache state; advanced by the forward.
    pub state: &'a mut SeqState,
    /// Which logits to return.
    pub logits: LogitsMode,
    /// Media spans among `tokens` whose embeddings come from the vision
    /// tower instead of the embedding table (empty for text).
    pub embeds: &'a [EmbedSpan],
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

    /// The vision capability, for models with a vision tower.
    fn vision(&self) -> Option<&dyn VisionTower> {
        None
    }
}

/// One preprocessed media item for the vision tower: an image (`t = 1`) or a
/// video chunk of up to `temporal_merge` frames.
#[derive(Debug, Clone)]
pub struct VisionInput {
    /// `[t·h·w, 3, patch, patch]` patches, frame-major then raster order.
    pub pixel_values: Vec<f32>,
    /// Frames, patch rows and patch columns: `[t, h, w]`.
    pub grid_thw: [usize; 3],
}

/// Static facts about a vision tower.
#[derive(Debug, Clone)]
pub struct VisionInfo {
    /// Pixels per patch side (14).
    pub patch_size: usize,
    /// Spatial merge per side (2: each LM token is 2×2 patches).
    pub merge_size: usize,
    /// Most frames in one chunk (the temporal merge; 4).
    pub max_frames: usize,
    /// Width of each output row (the text model's hidden size).
    pub out_dim: usize,
    /// Placeholder id that media tokens are expanded to (`<|media_pad|>`).
    pub placeholder_id: u32,
}

/// Optional capability of vision-language models: the tower, its patch
/// merger and projector, from patches to rows of LM input embeddings.
pub trait VisionTower: Send + Sync {
    /// Static facts about the tower.
    fn info(&self) -> &VisionInfo;

    /// LM tokens one item of grid `[t, h, w]` becomes (`h·w / merge²`).
    fn num_tokens(&self, grid_thw: [usize; 3]) -> usize {
        let m = self.info().merge_size;
        grid_thw[1] * grid_thw[2] / (m * m)
    }

    /// Encodes several items in one packed pass (attention stays within each
    /// item). Returns per item `[num_tokens, out_dim]` rows, row-major.
    fn encode(&self, items: &[VisionInput]) -> Result<Vec<Vec<f32>>, EngineError>;
}

/// One routed expert's feed-forward network.
pub trait ExpertFfn: Send + Sync {
    /// `[n, hidden] → [n, hidden]` (unweighted).
    fn forward(&self, x: &[f32]) -> Vec<f32>;

    /// [`ExpertFfn::forward`] written into `out` (`[n, hidden]`); experts
    /// that can write their last product in place override it.
    fn forward_into(&self, x: &[f32], out: &mut [f32]) {
        out.copy_from_slice(&self.forward(x));
    }

    /// Hints the start of the expert's weights into the caches, just before
    /// [`ExpertFfn::forward_into`] runs it (a routed expert is chosen per
    /// token, so its weights are often in DRAM). No effect on results.
    fn prefetch(&self) {}
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

/// The `(row, expert)` pairs of one MoE step grouped by expert, as flat index
/// arrays (a counting sort by expert id): the rows of expert `experts[g]`
/// are slots `offsets[g]..offsets[g + 1]`, in the order the pairs came.
///
/// This is the layout of the grouped expert compute ([`run_groups`]): the
/// slots' input rows are gathered into one contiguous `[slots, hidden]`
/// buffer, every expert runs once over its own contiguous range (its weights
/// stream once per step), and outputs land in a `[slots, hidden]` buffer
/// that [`ExpertGroups::pair_slot`] indexes by pair.
#[derive(Debug, Clone, Default)]
pub struct ExpertGroups {
    /// Experts with at least one pair, ascending.
    pub experts: Vec<usize>,
    /// `experts.len() + 1` slot offsets.
    pub offsets: Vec<usize>,
    /// Input row of each slot.
    pub slot_row: Vec<usize>,
    /// Slot of each pair, in the order the pairs were given.
    pub pair_slot: Vec<usize>,
}

impl ExpertGroups {
    /// Groups `(row, expert)` pairs; the pair index is the iteration order.
    pub fn new(pairs: impl Iterator<Item = (usize, usize)> + Clone) -> ExpertGroups {
        let n_experts = pairs.clone().map(|(_, e)| e + 1).max().unwrap_or(0);
        let mut count = vec![0usize; n_experts + 1];
        let mut n_pairs = 0;
        for (_, e) in pairs.clone() {
            count[e + 1] += 1;
            n_pairs += 1;
        }
        let experts: Vec<usize> = (0..n_experts).filter(|&e| count[e + 1] > 0).collect();
        // count[e] becomes expert e's first slot (an exclusive prefix sum).
        for e in 0..n_experts {
            count[e + 1] += count[e];
        }
        let mut offsets = Vec::with_capacity(experts.len() + 1);
        offsets.extend(experts.iter().map(|&e| count[e]));
        offsets.push(n_pairs);
        let mut slot_row = vec![0; n_pairs];
        let mut pair_slot = Vec::with_capacity(n_pairs);
        for (r, e) in pairs {
            let s = count[e];
            count[e] += 1;
            slot_row[s] = r;
            pair_slot.push(s);
        }
        ExpertGroups {
            experts,
            offsets,
            slot_row,
            pair_slot,
        }
    }

    /// Every pair of `choices`, row-major, then `k`.
    pub fn from_choices(choices: &[Vec<(usize, f32)>]) -> ExpertGroups {
        ExpertGroups::new(
            choices
                .iter()
                .enumerate()
                .flat_map(|(r, c)| c.iter().map(move |&(e, _)| (r, e))),
        )
    }

    /// Total slots (pairs).
    pub fn slots(&self) -> usize {
        self.slot_row.len()
    }

    /// The slots' input rows gathered from `x` (`[rows, hidden]`) into one
    /// `[slots, hidden]` buffer.
    pub fn gather(&self, x: &[f32], hidden: usize) -> Vec<f32> {
        let mut xs = Vec::with_capacity(self.slots() * hidden);
        for &r in &self.slot_row {
            xs.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        xs
    }
}

/// Runs every group's expert over its slots: `ys[slots] = expert(xs[slots])`,
/// both `[slots, hidden]` in slot order.
///
/// Experts are spread over the rayon pool, largest first. When no single
/// expert holds more than a thread's share of the slots (decode: top-k
/// experts of one or a few rows each), each expert runs serially on the
/// thread that took it ([`caracal_kernels::threads::serial`]), so a step costs
/// one fork-join instead of three per expert. A dominant expert (a long
/// prefill routed mostly to one expert) keeps its matmuls' own parallelism.
/// Either way every expert sees the same input rows in the same order and
/// the kernels compute them identically, so outputs do not depend on the
/// thread count or on which other experts run in the same call.
pub fn run_groups<'a, F>(
    groups: &ExpertGroups,
    expert: F,
    xs: &[f32],
    hidden: usize,
    ys: &mut [f32],
) where
    F: (Fn(usize) -> &'a dyn ExpertFfn) + Sync,
{
    use rayon::prelude::*;
    assert_eq!(xs.len(), groups.slots() * hidden, "run_groups: xs size");
    assert_eq!(ys.len(), groups.slots() * hidden, "run_groups: ys size");
    let mut tasks: Vec<(usize, &[f32], &mut [f32])> = Vec::with_capacity(groups.experts.len());
    let mut rest = ys;
    for (g, &e) in groups.experts.iter().enumerate() {
        let (a, b) = (groups.offsets[g] * hidden, groups.offsets[g + 1] * hidden);
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(b - a);
        rest = tail;
        tasks.push((e, &xs[a..b], mine));
    }
    let threads = rayon::current_num_threads().max(1);
    if tasks.len() <= 1 || threads == 1 {
        for (e, x, y) in tasks {
            expert(e).forward_into(x, y);
        }
        return;
    }
    tasks.sort_by_key(|t| std::cmp::Reverse(t.1.len()));
    let largest = tasks[0].1.len() / hidden.max(1);
    let serial = largest * threads <= groups.slots();
    // Each task also hints the next task's expert: rayon runs a split's
    // tasks in order on one thread, so that expert's weights (chosen per
    // token, mostly out of cache) arrive while this one computes. The tasks
    // stay one parallel loop, so a thread that is also running the shared
    // experts (`rayon::join` beside this group) takes fewer of them.
    let order: Vec<usize> = tasks.iter().map(|t| t.0).collect();
    tasks
        .into_par_iter()
        .enumerate()
        .for_each(|(i, (e, x, y))| {
            expert(e).prefetch();
            if let Some(&next) = order.get(i + 1) {
                expert(next).prefetch();
            }
            if serial {
                caracal_kernels::threads::serial(|| expert(e).forward_into(x, y));
            } else {
                expert(e).forward_into(x, y);
            }
        });
}

/// `Σ_k w_k · y_(r,k)` for every row, in `choices` order, where pair `p`
/// (row-major over `choices`) reads output row `slot(p)` of `ys`
/// (`[·, hidden]`). Starts each row from zero and adds the weighted rows
/// in turn, the same arithmetic wherever the outputs were computed.
pub fn combine(
    ys: &[f32],
    slot: impl Fn(usize) -> usize,
    hidden: usize,
    choices: &[Vec<(usize, f32)>],
) -> Vec<f32> {
    let mut y = vec![0.0; choices.len() * hidden];
    let mut p = 0;
    for (row, c) in y.chunks_exact_mut(hidden.max(1)).zip(choices) {
        for &(_, w) in c {
            let s = slot(p);
            for (a, b) in row.iter_mut().zip(&ys[s * hidden..(s + 1) * hidden]) {
                *a += w * b;
            }
            p += 1;
        }
    }
    y
}

/// Computes `Σ_k w_k · expert_k(x_r)` for every row locally as one grouped
/// operation ([`ExpertGroups`], [`run_groups`]); sums in `choices` order.
pub fn run_experts_local(
    experts: &[Arc<dyn ExpertFfn>],
    x: &[f32],
    hidden: usize,
    choices: &[Vec<(usize, f32)>],
) -> Vec<f32> {
    let groups = ExpertGroups::from_choices(choices);
    let xs = groups.gather(x, hidden);
    let mut ys = vec![0.0; xs.len()];
    run_groups(&groups, |e| experts[e].as_ref(), &xs, hidden, &mut ys);
    combine(&ys, |p| groups.pair_slot[p], hidden, choices)
}

/// The plain form of [`run_experts_local`], the oracle of the grouped path:
/// every `(row, k)` pair runs its expert on that one row, one after another.
pub fn run_experts_per_row(
    experts: &[Arc<dyn ExpertFfn>],
    x: &[f32],
    hidden: usize,
    choices: &[Vec<(usize, f32)>],
) -> Vec<f32> {
    let mut y = vec![0.0; choices.len() * hidden];
    for (r, c) in choices.iter().enumerate() {
        let xr = &x[r * hidden..(r + 1) * hidden];
        for &(e, w) in c {
            let o = experts[e].forward(xr);
            for (a, b) in y[r * hidden..(r + 1) * hidden].iter_mut().zip(&o) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_takes_the_part_of_each_span_it_covers() {
        let rows: Arc<[f32]> = Arc::from(vec![0.0f32; 8]);
        let media = vec![
            EmbedSpan {
                offset: 2,
                rows: rows.clone(),
                first_row: 0,
                len: 4,
            },
            EmbedSpan {
                offset: 9,
                rows,
                first_row: 0,
                len: 2,
            },
        ];
        let c = EmbedSpan::within(&media, 4, 4);
        assert_eq!(c.len(), 1);
        assert_eq!((c[0].offset, c[0].first_row, c[0].len), (0, 2, 2));
        let c = EmbedSpan::within(&media, 0, 12);
        assert_eq!(c.len(), 2);
        assert_eq!((c[1].offset, c[1].first_row, c[1].len), (9, 0, 2));
        assert!(EmbedSpan::within(&media, 6, 3).is_empty());
    }
}
