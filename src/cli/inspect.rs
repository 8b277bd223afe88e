//! `caracal inspect PATH [--all] [--json]`: tensors, dtypes, bytes, and MXFP4
//! block-scale health of a checkpoint folder, or a summary of a `.gguf` file.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use caracal::checkpoint::inspect::{inspect, InspectReport};
use clap::Args;

/// Arguments of `caracal inspect`.
#[derive(Args)]
pub struct InspectArgs {
    /// Checkpoint folder or `.gguf` file.
    path: PathBuf,
    /// One line per tensor and per expert instead of the grouped summary.
    #[arg(long)]
    all: bool,
    /// Print the report as JSON (checkpoint folders only).
    #[arg(long)]
    json: bool,
}

/// Runs `caracal inspect`.
pub fn run(a: InspectArgs) -> Result<()> {
    let report = inspect(&a.path).with_context(|| format!("inspecting {}", a.path.display()))?;
    match (&report, a.json) {
        (InspectReport::Checkpoint(c), true) => println!("{}", serde_json::to_string_pretty(c)?),
        (InspectReport::Gguf(_), true) => bail!("--json is only available for checkpoint folders"),
        (InspectReport::Checkpoint(c), false) => print!("{}", c.render(a.all)),
        (InspectReport::Gguf(g), false) => print!("{g}"),
    }
    Ok(())
}
