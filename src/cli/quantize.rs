//! `caracal quantize --to mxfp4 IN_DIR OUT_DIR [--experts-only]`: write an
//! MXFP4 copy of a checkpoint (see `caracal::convert::quantize`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use caracal::convert::quantize::{quantize_checkpoint, QuantizeOptions, ScaleRule, TableFormat};
use clap::{Args, ValueEnum};

/// Target formats of `caracal quantize`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Target {
    /// OCP MXFP4 (E2M1 codes, one E8M0 scale per 32 weights), compressed-tensors layout.
    Mxfp4,
}

/// How block scales are chosen.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ScaleArg {
    /// Least squared error among the OCP exponent and its neighbours (default).
    MinMse,
    /// The OCP reference exponent floor(log2(amax)) - 2, as llama.cpp does.
    Ocp,
}

/// Token-table formats.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum TableArg {
    /// As stored in the source.
    Keep,
    /// int8 per 32 values with an f32 scale.
    #[value(name = "q8_0")]
    Q8_0,
    /// MXFP4 like the linear weights.
    Mxfp4,
}

/// Arguments of `caracal quantize`.
#[derive(Args)]
pub struct QuantizeArgs {
    /// Target format.
    #[arg(long, value_enum, default_value = "mxfp4")]
    to: Target,
    /// Source checkpoint folder (bf16/f16/f32 safetensors).
    in_dir: PathBuf,
    /// Folder to write (created).
    out_dir: PathBuf,
    /// Quantize only routed expert weights (`*.experts.*`), as Kimi K3 ships.
    #[arg(long)]
    experts_only: bool,
    /// Format of the token embedding and lm_head: q8_0 (int8 per 32 values,
    /// near-lossless), mxfp4 (faster decode on small models with tied
    /// embeddings, lower quality) or keep. Ignored with --experts-only.
    #[arg(long, value_enum, default_value = "q8_0")]
    embeddings: TableArg,
    /// Block-scale rule.
    #[arg(long, value_enum, default_value = "min-mse")]
    scales: ScaleArg,
    /// Largest output shard in GiB.
    #[arg(long, default_value_t = 4.0)]
    shard_gib: f64,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

/// Runs `caracal quantize`.
pub fn run(a: QuantizeArgs) -> Result<()> {
    let Target::Mxfp4 = a.to;
    let opts = QuantizeOptions {
        experts_only: a.experts_only,
        embeddings: match a.embeddings {
            TableArg::Keep => TableFormat::Keep,
            TableArg::Q8_0 => TableFormat::Q8_0,
            TableArg::Mxfp4 => TableFormat::Mxfp4,
        },
        progress: !a.quiet,
        scale_rule: match a.scales {
            ScaleArg::MinMse => ScaleRule::MinMse,
            ScaleArg::Ocp => ScaleRule::Ocp,
        },
        max_shard_bytes: (a.shard_gib.max(0.001) * (1u64 << 30) as f64) as u64,
    };
    let report = quantize_checkpoint(&a.in_dir, &a.out_dir, &opts).with_context(|| {
        format!(
            "quantizing {} into {}",
            a.in_dir.display(),
            a.out_dir.display()
        )
    })?;
    print!("{report}");
    Ok(())
}
