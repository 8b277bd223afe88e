//! One-off generation for a single sequence: prefill the prompt in chunks,
//! then decode token by token with the model's cache, timing both phases.
//! The server and `caracal batch` go through the scheduler instead; this is
//! the path of `caracal generate` and of the model tests.
//!
//! Media: [`splice_media`] runs the model's vision tower on preprocessed
//! items and expands each placeholder id of the prompt (`<|media_pad|>`) to
//! the item's token count; the returned [`EmbedSpan`]s go to
//! [`generate_with`] / [`prompt_logits_with`], which cut them along the
//! prefill chunks.

use std::path::{Path, PathBuf};
use std::time::Instant;

use caracal_kernels::paged::KvPool;
use caracal_kernels::sampling::{apply_penalties, sample, Rng, SamplingParams};
use caracal_kernels::threads::on_pool;
use serde::Serialize;

use crate::checkpoint::LoadOptions;
use crate::error::{Error, Result};
use crate::models::{self, CausalLm, EmbedSpan, LogitsMode, SeqBatch, SeqState, VisionInput};
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

/// A prompt with its media encoded and its placeholders expanded.
#[derive(Debug, Clone)]
pub struct MediaPrompt {
    /// The prompt ids, each placeholder replaced by one copy per media token.
    pub ids: Vec<u32>,
    /// The tower's rows over those copies, one span per item.
    pub spans: Vec<EmbedSpan>,
    /// LM tokens of each item, in order.
    pub media_tokens: Vec<usize>,
    /// The radix-cache key of `ids`: text ids widened, each media span keyed
    /// by its item's content hash ([`caracal_media::placeholder_keys`]).
    pub cache_key: Vec<u64>,
}

/// One encoded media item to splice into a prompt.
#[derive(Debug, Clone)]
pub struct EncodedMedia {
    /// Content hash of the item (the key of its span in the prefix cache).
    pub hash: u64,
    /// The tower's output, `[num_tokens, hidden]` row-major.
    pub rows: std::sync::Arc<[f32]>,
    /// LM tokens the item occupies.
    pub num_tokens: usize,
}

/// Expands the `i`-th occurrence of `placeholder` in `prompt` into
/// `items[i].num_tokens` copies covered by item `i`'s rows. The prompt must
/// hold exactly one placeholder per item.
pub fn expand_media(
    prompt: &[u32],
    placeholder: u32,
    items: &[EncodedMedia],
) -> Result<MediaPrompt> {
    let found = prompt.iter().filter(|&&t| t == placeholder).count();
    if found != items.len() {
        return Err(Error::InvalidRequest(format!(
            "the prompt has {found} media placeholders (id {placeholder}) for {} media items",
            items.len()
        )));
    }
    let total: usize = items.iter().map(|m| m.num_tokens).sum();
    let mut ids = Vec::with_capacity(prompt.len() + total);
    let mut cache_key = Vec::with_capacity(prompt.len() + total);
    let mut spans = Vec::with_capacity(items.len());
    let mut next = items.iter();
    for &t in prompt {
        if t != placeholder {
            ids.push(t);
            cache_key.push(u64::from(t));
            continue;
        }
        let m = next
            .next()
            .expect("one item per placeholder, counted above");
        spans.push(EmbedSpan {
            offset: ids.len(),
            rows: m.rows.clone(),
            first_row: 0,
            len: m.num_tokens,
        });
        ids.extend(std::iter::repeat_n(placeholder, m.num_tokens));
        cache_key.extend(caracal_media::placeholder_keys(m.hash, m.num_tokens));
    }
    Ok(MediaPrompt {
        ids,
        spans,
        media_tokens: items.iter().map(|m| m.num_tokens).collect(),
        cache_key,
    })
}

/// Encodes `items` with `model`'s vision tower (one packed pass) and expands
/// the prompt's placeholders over their rows ([`expand_media`]; the cache
/// key hashes each item's patches).
pub fn splice_media(
    model: &dyn CausalLm,
    prompt: &[u32],
    items: &[VisionInput],
) -> Result<MediaPrompt> {
    let tower = model.vision().ok_or_else(|| {
        Error::InvalidRequest(format!(
            "the model (`{}`) has no vision tower, so it takes no images",
            model.info().model_type
        ))
    })?;
    let placeholder = tower.info().placeholder_id;
    let found = prompt.iter().filter(|&&t| t == placeholder).count();
    if found != items.len() {
        return Err(Error::InvalidRequest(format!(
            "the prompt has {found} media placeholders (id {placeholder}) for {} media items",
            items.len()
        )));
    }
    let rows = on_pool(|| tower.encode(items))?;
    let encoded: Vec<EncodedMedia> = rows
        .into_iter()
        .zip(items)
        .map(|(r, it)| EncodedMedia {
            hash: patches_hash(&it.pixel_values),
            rows: r.into(),
            num_tokens: tower.num_tokens(it.grid_thw),
        })
        .collect();
    expand_media(prompt, placeholder, &encoded)
}

/// A content hash of preprocessed patches (for items that come without
/// their encoded bytes).
fn patches_hash(values: &[f32]) -> u64 {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    caracal_media::content_hash(&bytes)
}

/// Runs prefill then decode for one sequence. `on_token` sees each new id.
pub fn generate(
    model: &dyn CausalLm,
    req: &GenerateRequest,
    on_token: impl FnMut(u32),
) -> Result<Generation> {
    generate_with(model, req, &[], on_token)
}

/// [`generate`] with media rows over some prompt positions (`embeds`,
/// offsets into `req.prompt_ids`, e.g. from [`splice_media`]).
pub fn generate_with(
    model: &dyn CausalLm,
    req: &GenerateRequest,
    embeds: &[EmbedSpan],
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
        let spans = EmbedSpan::within(embeds, i * PREFILL_CHUNK, chunk.len());
        logits = forward_one_with(model, &mut cache, &mut state, chunk, mode, &spans)?;
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
    forward_one_with(model, cache, state, tokens, logits, &[])
}

/// [`forward_one`] with media rows over some of `tokens`.
fn forward_one_with(
    model: &dyn CausalLm,
    cache: &mut KvPool,
    state: &mut SeqState,
    tokens: &[u32],
    logits: LogitsMode,
    embeds: &[EmbedSpan],
) -> Result<Vec<f32>> {
    Ok(on_pool(|| {
        model.forward(
            cache,
            &mut [SeqBatch {
                tokens,
                state,
                logits,
                embeds,
            }],
        )
    })?)
}

/// Logits of every prompt position (teacher forcing), for perplexity and tests.
pub fn prompt_logits(model: &dyn CausalLm, ids: &[u32]) -> Result<Vec<f32>> {
    prompt_logits_with(model, ids, &[])
}

/// [`prompt_logits`] with media rows over some positions (see [`generate_with`]).
pub fn prompt_logits_with(
    model: &dyn CausalLm,
    ids: &[u32],
    embeds: &[EmbedSpan],
) -> Result<Vec<f32>> {
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
    for (i, chunk) in ids.chunks(PREFILL_CHUNK).enumerate() {
        let spans = EmbedSpan::within(embeds, i * PREFILL_CHUNK, chunk.len());
        all.extend(forward_one_with(
            model,
            &mut cache,
            &mut state,
            chunk,
            LogitsMode::All,
            &spans,
        )?);
    }
    Ok(all)
}
