//! One-off generation for a single sequence: prefill the prompt in chunks,
//! then decode token by token with the model's cache, timing both phases.
//! The server and `caracal batch` go through the scheduler instead; this is
//! the path of `caracal generate` and of the model tests.

use std::path::{Path, PathBuf};
use std::time::Instant;

use caracal_kernels::paged::KvPool;
use caracal_kernels::sampling::{apply_penalties, sample, Rng, SamplingParams};
use caracal_kernels::threads::on_pool;
use serde::Serialize;

use crate::checkpoint::LoadOptions;
use crate::error::{Error, Result};
use crate::models::{self, CausalLm, LogitsMode, SeqBatch, SeqState};
use crate::text::tokenizer::TextTokenizer;

/// Tokens per KV page used by single-sequence generation.
pub const PAGE_SIZE: usize = 16;

/// Longest prompt piece run in one forward during prefill (bounds activation memory).
pub const PREFILL_CHUNK: usize = 512;

/// A model folder loaded with its tokenizer.
pub struct LoadedModel {
    /// The folder.
    pub dir: PathBuf,
    /// The network.
    pub model: Box<dyn CausalLm>,
    /// The tokenizer, when the folder has one.
    pub tokenizer: Option<TextTokenizer>,
}

impl LoadedModel {
    /// Loads `dir` (config, weights, tokenizer if present) with the default
    /// [`LoadOptions`] (f32 activations for quantized weights).
    pub fn load(dir: &Path) -> Result<LoadedModel> {
        LoadedModel::load_with(dir, &LoadOptions::default())
    }

    /// Loads `dir` with `opts` (how quantized weights meet activations).
    pub fn load_with(dir: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
        if !dir.is_dir() {
            return Err(Error::io(
                dir,
                std::io::Error::new(std::io::ErrorKind::NotFound, "model folder does not exist"),
            ));
        }
        let model = models::load_with(dir, opts)?;
        let tokenizer = if TextTokenizer::exists_in(dir) {
            Some(TextTokenizer::from_dir(dir)?)
        } else {
            None
        };
        Ok(LoadedModel {
            dir: dir.to_path_buf(),
            model,
            tokenizer,
        })
    }
}

/// Why generation stopped (the runtime's type: `stop` / `length`).
pub use caracal_actors::messages::FinishReason;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Most new tokens.
    pub max_tokens: usize,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Ids that end generation (the model's EOS ids by default).
    pub stop_ids: Vec<u32>,
}

/// The result of one generation.
#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    /// Generated ids only (the stop id included when one ended generation).
    pub token_ids: Vec<u32>,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Why it stopped.
    pub finish_reason: FinishReason,
    /// Seconds spent in prefill (up to the first sampled token).
    pub prefill_seconds: f64,
    /// Seconds spent decoding the remaining tokens.
    pub decode_seconds: f64,
    /// Prompt tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Generated tokens per second after the first.
    pub decode_tokens_per_s: f64,
}

/// Runs prefill then decode for one sequence. `on_token` sees each new id.
pub fn generate(
    model: &dyn CausalLm,
    req: &GenerateRequest,
    mut on_token: impl FnMut(u32),
) -> Result<Generation> {
    let info = model.info();
    let n = req.prompt_ids.len();
    if n == 0 {
        return Err(Error::InvalidRequest("the prompt is empty".into()));
    }
    if n >= info.max_position {
        return Err(Error::PromptTooLong {
            prompt: n,
            context: info.max_position,
            max_tokens: req.max_tokens,
        });
    }
    let max_tokens = req.max_tokens.min(info.max_position - n);
    let pages = (n + max_tokens).div_ceil(PAGE_SIZE) + 1;
    let mut cache = KvPool::new(
        info.kv_layers,
        if info.kv_layers > 0 { pages } else { 0 },
        PAGE_SIZE,
        info.kv_width,
    );
    let mut state = model.new_state();
    let mut rng = req
        .sampling
        .seed
        .map(Rng::new)
        .unwrap_or_else(Rng::from_clock);
    let t0 = Instant::now();
    let mut logits = Vec::new();
    let chunks: Vec<&[u32]> = req.prompt_ids.chunks(PREFILL_CHUNK).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let mode = if i + 1 == chunks.len() {
            LogitsMode::Last
        } else {
            LogitsMode::None
        };
        logits = forward_one(model, &mut cache, &mut state, chunk, mode)?;
    }
    let mut out = Vec::new();
    let mut finish = FinishReason::Length;
    let mut prefill_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    while out.len() < max_tokens {
        apply_penalties(&mut logits, &req.prompt_ids, &out, &req.sampling);
        let next = sample(&logits, &req.sampling, &mut rng);
        if out.is_empty() {
            prefill_seconds = t0.elapsed().as_secs_f64();
        }
        out.push(next);
        on_token(next);
        if req.stop_ids.contains(&next) {
            finish = FinishReason::Stop;
            break;
        }
        if out.len() == max_tokens {
            break;
        }
        logits = forward_one(model, &mut cache, &mut state, &[next], LogitsMode::Last)?;
    }
    let decode_seconds = t1.elapsed().as_secs_f64();
    let decoded = out.len().saturating_sub(1);
    Ok(Generation {
        prompt_tokens: n,
        finish_reason: finish,
        prefill_seconds,
        decode_seconds,
        prefill_tokens_per_s: n as f64 / prefill_seconds.max(1e-9),
        decode_tokens_per_s: if decoded > 0 {
            decoded as f64 / decode_seconds.max(1e-9)
        } else {
            0.0
        },
        token_ids: out,
    })
}

/// One forward of a single sequence, run on a rayon worker so the kernels'
/// parallel calls skip the cross-thread hand-off (see
/// [`caracal_kernels::threads`]).
pub(crate) fn forward_one(
    model: &dyn CausalLm,
    cache: &mut KvPool,
    state: &mut SeqState,
    tokens: &[u32],
    logits: LogitsMode,
) -> Result<Vec<f32>> {
    Ok(on_pool(|| {
        model.forward(
            cache,
            &mut [SeqBatch {
                tokens,
                state,
                logits,
                embeds: &[],
            }],
        )
    })?)
}

/// Logits of every prompt position (teacher forcing), for perplexity and tests.
pub fn prompt_logits(model: &dyn CausalLm, ids: &[u32]) -> Result<Vec<f32>> {
    let info = model.info();
    let pages = ids.len().div_ceil(PAGE_SIZE) + 1;
    let mut cache = KvPool::new(
        info.kv_layers,
        if info.kv_layers > 0 { pages } else { 0 },
        PAGE_SIZE,
        info.kv_width,
    );
    let mut state = model.new_state();
    let mut all = Vec::with_capacity(ids.len() * info.vocab_size);
    for chunk in ids.chunks(PREFILL_CHUNK) {
        all.extend(forward_one(
            model,
            &mut cache,
            &mut state,
            chunk,
            LogitsMode::All,
        )?);
    }
    Ok(all)
}
