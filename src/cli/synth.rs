//! `caracal synth --arch kimi_k3 --preset tiny OUT_DIR`: write a
//! deterministic random checkpoint in a published layout
//! ([`caracal::convert::synth`]).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use caracal::convert::synth::{synthesize, Arch, Preset, SynthOptions, DEFAULT_SEED};
use clap::Args;

/// Arguments of `caracal synth`.
#[derive(Args)]
pub struct SynthArgs {
    /// Architecture to write (`kimi_k3`).
    #[arg(long, default_value = "kimi_k3")]
    arch: String,
    /// Size preset (`tiny`: Kimi K3's structure, tens of MB; `small`: ~400 MB
    /// with K3's share of attention work, for timing).
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Seed of the weights; the same seed gives byte-identical files.
    #[arg(long, default_value_t = DEFAULT_SEED)]
    seed: u64,
    /// Folder to create (must be new or empty).
    out_dir: PathBuf,
}

/// Runs `caracal synth`.
pub fn run(a: SynthArgs) -> Result<()> {
    let opts = SynthOptions {
        arch: a.arch.parse::<Arch>()?,
        preset: a.preset.parse::<Preset>()?,
        seed: a.seed,
        progress: true,
    };
    let t0 = Instant::now();
    let summary = synthesize(&a.out_dir, &opts)
        .with_context(|| format!("synthesizing into {}", a.out_dir.display()))?;
    for (name, bytes) in &summary.files {
        println!("{:>12}  {name}", bytes);
    }
    println!(
        "{}: {} tensors, {:.1}M parameters, {:.1} MB in {:.1} s",
        a.out_dir.display(),
        summary.tensors,
        summary.parameters as f64 / 1e6,
        summary.bytes as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
