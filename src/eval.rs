//! `caracal eval ppl`: perplexity computed exactly the way llama.cpp's
//! `llama-perplexity` does, so the two numbers can be compared.
//!
//! Reference: `tools/perplexity/perplexity.cpp` (`perplexity()`,
//! `log_softmax()`, `process_logits()`) of llama.cpp 0c1e570, as vendored in
//! the PyPI sdist of `llama-cpp-python` 0.3.36. The procedure:
//!
//! 1. The text is read whole, one trailing `\n` is dropped (`-f` in
//!    `common/arg.cpp`), and it is tokenized with the model's special tokens
//!    added: a BOS id in front when the vocabulary says `add_bos`
//!    ([`tokenize_like_llama_cpp`]). Special-token text inside the document is
//!    matched by the HF tokenizer but not by llama.cpp (`parse_special =
//!    false`); plain prose has none.
//! 2. At least `2·ctx` tokens are required. The tokens are cut into
//!    `n_chunk = len / ctx` non-overlapping windows of `ctx` tokens (the tail
//!    is dropped; `--chunks` caps the count).
//! 3. Each window is evaluated from an empty cache. With `add_bos` its first
//!    token is replaced by BOS (the original id is restored afterwards).
//! 4. Only the second half is scored: with `first = ctx/2`, the logits at
//!    positions `first ..= ctx − 2` predict tokens `first + 1 ..= ctx − 1`,
//!    so each window contributes `ctx − 1 − first` terms.
//! 5. Each term is `−log_softmax(logits)[next]`, computed as llama.cpp does:
//!    the max in f32, `Σ expf(l − max)` accumulated in f64, and
//!    `(l[tok] − max) − ln(sum)` in f64. Sums of `nll` and `nll²` are f64.
//! 6. `PPL = exp(Σnll / count)`; the error estimate is
//!    `sqrt((mean(nll²) − mean(nll)²) / (count − 1)) · PPL`.
//!
//! llama.cpp evaluates several windows in one batch (`n_seq = n_batch/ctx`);
//! windows are independent sequences there, so evaluating them one after the
//! other gives the same numbers.

use std::time::{Duration, Instant};

use caracal_kernels::paged::{KvDtype, KvPool};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::generate::{forward_one, PAGE_SIZE, PREFILL_CHUNK};
use crate::models::{CausalLm, LogitsMode};
use crate::text::tokenizer::TextTokenizer;

/// Settings of [`perplexity`].
#[derive(Debug, Clone)]
pub struct PplOptions {
    /// Window length in tokens (`llama-perplexity -c`); default 512.
    pub ctx: usize,
    /// BOS id written over the first token of every window (llama.cpp does
    /// this when the vocabulary's `add_bos` is set); `None` leaves windows as they are.
    pub bos: Option<u32>,
    /// Evaluate at most this many windows (`--chunks`); `None` for all.
    pub max_chunks: Option<usize>,
    /// Draw a progress bar on stderr with the running estimate.
    pub progress: bool,
    /// How the windows' KV rows are stored (default f32, exact).
    pub kv_cache_dtype: KvDtype,
}

impl Default for PplOptions {
    fn default() -> Self {
        PplOptions {
            ctx: 512,
            bos: None,
            max_chunks: None,
            progress: false,
            kv_cache_dtype: KvDtype::F32,
        }
    }
}

/// The result of [`perplexity`].
#[derive(Debug, Clone, Serialize)]
pub struct PplReport {
    /// The perplexity, `exp(mean nll)`.
    pub ppl: f64,
    /// llama.cpp's "+/-" figure: standard error of the mean nll times `ppl`.
    pub ppl_stderr: f64,
    /// Mean negative log-likelihood (nats per token).
    pub mean_nll: f64,
    /// Window length.
    pub ctx: usize,
    /// Windows evaluated.
    pub chunks: usize,
    /// Tokens scored (`chunks · (ctx − 1 − ctx/2)`).
    pub scored: usize,
    /// Tokens of the whole text.
    pub text_tokens: usize,
    /// Running perplexity after each window (what llama.cpp prints as `[i]x`).
    pub running: Vec<f64>,
    /// Wall time of the forward passes and scoring.
    #[serde(skip)]
    pub elapsed: Duration,
    /// Tokens evaluated per second (`chunks · ctx / elapsed`).
    pub tokens_per_s: f64,
}

/// Tokenizes `text` the way `llama-perplexity -f FILE` does: one trailing
/// newline removed, BOS prepended when the tokenizer adds one. Returns the ids
/// and the BOS id to use for window starts (`Some` only when `add_bos`).
pub fn tokenize_like_llama_cpp(tok: &TextTokenizer, text: &str) -> Result<(Vec<u32>, Option<u32>)> {
    let text = text.strip_suffix('\n').unwrap_or(text);
    let ids = tok.encode(text)?;
    let bos = if tok.add_bos {
        tok.bos_token.as_deref().and_then(|b| tok.token_to_id(b))
    } else {
        None
    };
    Ok((ids, bos))
}

/// `−log p(tok)` from one row of logits, as llama.cpp's `log_softmax` computes it.
pub fn nll_llama_cpp(logits: &[f32], tok: usize) -> f64 {
    let max = logits.iter().copied().fold(logits[0], f32::max);
    let sum: f64 = logits.iter().map(|&l| (l - max).exp() as f64).sum();
    -(((logits[tok] - max) as f64) - sum.ln())
}

/// Perplexity of `model` over `tokens` in non-overlapping windows of
/// `opts.ctx` tokens, scoring the second half of each (see the module docs).
pub fn perplexity(model: &dyn CausalLm, tokens: &[u32], opts: &PplOptions) -> Result<PplReport> {
    let ctx = opts.ctx;
    let info = model.info();
    if ctx < 4 {
        return Err(Error::InvalidRequest(format!(
            "--ctx must be at least 4, got {ctx}"
        )));
    }
    if ctx > info.max_position {
        return Err(Error::InvalidRequest(format!(
            "--ctx {ctx} exceeds the model's context length {}",
            info.max_position
        )));
    }
    if tokens.len() < 2 * ctx {
        return Err(Error::InvalidRequest(format!(
            "perplexity with a context of {ctx} needs at least {} tokens; the text has {}",
            2 * ctx,
            tokens.len()
        )));
    }
    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= info.vocab_size) {
        return Err(Error::InvalidRequest(format!(
            "token id {bad} is outside the vocabulary (size {})",
            info.vocab_size
        )));
    }
    let n_chunk = (tokens.len() / ctx).min(opts.max_chunks.unwrap_or(usize::MAX));
    let first = ctx / 2;
    let vocab = info.vocab_size;
    let pb = if opts.progress {
        let pb = ProgressBar::new(n_chunk as u64);
        pb.set_style(
            ProgressStyle::with_template(
                "perplexity [{bar:40}] {pos}/{len} windows {elapsed} (eta {eta}) {msg}",
            )
            .expect("static progress template is valid")
            .progress_chars("=> "),
        );
        pb
    } else {
        ProgressBar::hidden()
    };
    let start = Instant::now();
    let (mut nll, mut nll2, mut count) = (0.0f64, 0.0f64, 0usize);
    let mut running = Vec::with_capacity(n_chunk);
    let pages = ctx.div_ceil(PAGE_SIZE) + 1;
    for i in 0..n_chunk {
        let mut window = tokens[i * ctx..(i + 1) * ctx].to_vec();
        if let Some(bos) = opts.bos {
            window[0] = bos;
        }
        let logits = window_logits(model, &window, first, pages, opts.kv_cache_dtype)?;
        // logits[r] is the row of position first + r; it predicts window[first + r + 1].
        let terms: Vec<f64> = (0..ctx - 1 - first)
            .into_par_iter()
            .map(|r| {
                nll_llama_cpp(
                    &logits[r * vocab..(r + 1) * vocab],
                    window[first + r + 1] as usize,
                )
            })
            .collect();
        for v in terms {
            nll += v;
            nll2 += v * v;
        }
        count += ctx - 1 - first;
        let ppl = (nll / count as f64).exp();
        running.push(ppl);
        pb.set_message(format!("ppl {ppl:.4}"));
        pb.inc(1);
    }
    pb.finish_and_clear();
    let elapsed = start.elapsed();
    let mean = nll / count as f64;
    let ppl = mean.exp();
    let var = nll2 / count as f64 - mean * mean;
    let stderr = if var > 0.0 && count > 1 {
        (var / (count - 1) as f64).sqrt() * ppl
    } else {
        0.0
    };
    Ok(PplReport {
        ppl,
        ppl_stderr: stderr,
        mean_nll: mean,
        ctx,
        chunks: n_chunk,
        scored: count,
        text_tokens: tokens.len(),
        running,
        elapsed,
        tokens_per_s: (n_chunk * ctx) as f64 / elapsed.as_secs_f64().max(1e-9),
    })
}

/// Runs one window from an empty cache and returns the logits of positions
/// `first ..` (row-major `[window.len() − first, vocab]`). The part before
/// `first` is run without logits; both parts go in pieces of at most
/// [`PREFILL_CHUNK`] tokens, as `generate` does.
fn window_logits(
    model: &dyn CausalLm,
    window: &[u32],
    first: usize,
    pages: usize,
    dtype: KvDtype,
) -> Result<Vec<f32>> {
    let info = model.info();
    let mut cache = KvPool::with_layout(
        info.kv_layers,
        if info.kv_layers > 0 { pages } else { 0 },
        PAGE_SIZE,
        info.kv_width,
        info.kv_segment,
        dtype,
    );
    let mut state = model.new_state();
    let mut out = Vec::with_capacity((window.len() - first) * info.vocab_size);
    for (part, mode) in [
        (&window[..first], LogitsMode::None),
        (&window[first..], LogitsMode::All),
    ] {
        for piece in part.chunks(PREFILL_CHUNK) {
            let logits = forward_one(model, &mut cache, &mut state, piece, mode)?;
            out.extend_from_slice(&logits);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_matches_an_f64_log_softmax() {
        let logits: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919 % 1000) as f32 / 100.0) - 3.0)
            .collect();
        for tok in [0usize, 17, 999] {
            let m = logits.iter().map(|&l| l as f64).fold(f64::MIN, f64::max);
            let lse = m + logits
                .iter()
                .map(|&l| (l as f64 - m).exp())
                .sum::<f64>()
                .ln();
            let want = lse - logits[tok] as f64;
            let got = nll_llama_cpp(&logits, tok);
            // f32 exps summed in f64: relative error ~1e-7 of the log-sum-exp.
            assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        }
    }
}
