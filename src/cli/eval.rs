//! `caracal eval ppl --model DIR --file TEXT [--ctx 512]`: perplexity the way
//! llama.cpp's `llama-perplexity` computes it (see `caracal::eval`).

use std::path::PathBuf;

use anyhow::{anyhow, Context, Result};
use caracal::eval::{perplexity, tokenize_like_llama_cpp, PplOptions};
use clap::{Args, Subcommand};

/// Arguments of `caracal eval`.
#[derive(Args)]
pub struct EvalArgs {
    #[command(subcommand)]
    what: EvalCommand,
}

/// Evaluations.
#[derive(Subcommand)]
enum EvalCommand {
    /// Perplexity over a text file, comparable with `llama-perplexity`.
    Ppl(PplArgs),
}

/// Arguments of `caracal eval ppl`.
#[derive(Args)]
struct PplArgs {
    /// Checkpoint folder (with tokenizer.json or tiktoken.model); default:
    /// the built-in tiny Kimi K3 (random weights).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Text file to score.
    #[arg(long)]
    file: PathBuf,
    /// Window length in tokens (`llama-perplexity -c`).
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Score at most this many windows (`llama-perplexity --chunks`).
    #[arg(long)]
    chunks: Option<usize>,
    /// Also print the report as one JSON line.
    #[arg(long)]
    json: bool,
    /// How KV rows are stored while scoring: `f32` (exact), `bf16` or
    /// `int8`, as `serve --kv-cache-dtype`.
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16", "int8"])]
    kv_cache_dtype: String,
}

/// Runs `caracal eval`.
pub fn run(a: EvalArgs, load: &caracal::checkpoint::LoadOptions) -> Result<()> {
    match a.what {
        EvalCommand::Ppl(p) => ppl(p, load),
    }
}

fn ppl(a: PplArgs, load: &caracal::checkpoint::LoadOptions) -> Result<()> {
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    let model_dir = super::model_dir(a.model.clone())?;
    let loaded = super::load_model(&model_dir, load)?;
    let tok = loaded
        .tokenizer
        .as_ref()
        .ok_or_else(|| anyhow!("{} has no tokenizer", model_dir.display()))?;
    let (tokens, bos) = tokenize_like_llama_cpp(tok, &text)?;
    eprintln!(
        "{}: {} tokens; {} windows of {} (scoring the second half of each); BOS at window start: {}",
        a.file.display(),
        tokens.len(),
        (tokens.len() / a.ctx.max(1)).min(a.chunks.unwrap_or(usize::MAX)),
        a.ctx,
        if bos.is_some() { "yes" } else { "no (add_bos is false)" }
    );
    let opts = PplOptions {
        ctx: a.ctx,
        bos,
        max_chunks: a.chunks,
        progress: true,
        kv_cache_dtype: a.kv_cache_dtype.parse().map_err(|e: String| anyhow!(e))?,
    };
    let r = perplexity(loaded.model.as_ref(), &tokens, &opts)?;
    let running: Vec<String> = r
        .running
        .iter()
        .enumerate()
        .map(|(i, p)| format!("[{}]{p:.4}", i + 1))
        .collect();
    println!("{}", running.join(","));
    println!(
        "Final estimate: PPL = {:.4} +/- {:.5} ({} windows, {} scored tokens, {:.1} s, {:.1} tokens/s)",
        r.ppl,
        r.ppl_stderr,
        r.chunks,
        r.scored,
        r.elapsed.as_secs_f64(),
        r.tokens_per_s
    );
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    }
    println!("perplexity: {:.4}", r.ppl);
    Ok(())
}
