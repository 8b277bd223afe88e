//! Subcommands of the `caracal` binary. Each lives in its own file and turns
//! its arguments into calls on the library.

mod generate;

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
}

/// Parses the command line and runs the chosen subcommand.
pub fn run() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Generate(args) => generate::run(args),
    }
}
