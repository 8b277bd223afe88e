//! `caracal moeify IN_DIR OUT_DIR [--experts 8] [--top-k 2]
//! [--shared-fraction 0.33] [--variant copy|split]`: turn a dense `llama`
//! checkpoint into a Kimi K2-style MoE with the same output (see
//! `caracal::convert::moeify`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use caracal::convert::moeify::{moeify_checkpoint, MoeifyOptions, Variant};
use clap::{Args, ValueEnum};

/// How routed experts are made.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum VariantArg {
    /// Every expert copies all routed neurons; random router, any routing is exact.
    Copy,
    /// Experts are disjoint slices of the routed neurons; top_k = experts, equal weights.
    Split,
}

/// Arguments of `caracal moeify`.
#[derive(Args)]
pub struct MoeifyArgs {
    /// Dense `llama` checkpoint folder (f32/bf16/f16 safetensors).
    in_dir: PathBuf,
    /// Folder to write (created).
    out_dir: PathBuf,
    /// Routed experts per MoE layer (a power of two for `split`).
    #[arg(long, default_value_t = 8)]
    experts: usize,
    /// Experts per token (default 2 for `copy`; `split` uses all experts).
    #[arg(long)]
    top_k: Option<usize>,
    /// Fraction of each MLP's neurons that form the shared expert, in [0, 1).
    #[arg(long, default_value_t = 0.33)]
    shared_fraction: f64,
    /// How routed experts are made.
    #[arg(long, value_enum, default_value = "copy")]
    variant: VariantArg,
    /// routed_scaling_factor; must be a power of two so the scaled weights are exact.
    #[arg(long, default_value_t = 2.0)]
    routed_scaling_factor: f32,
    /// n_group for grouped top-k (default: 2 for `copy` when it fits, else 1).
    #[arg(long)]
    n_group: Option<usize>,
    /// topk_group (default: 1 for `copy`, n_group for `split`).
    #[arg(long)]
    topk_group: Option<usize>,
    /// Layers below this index keep the dense MLP.
    #[arg(long, default_value_t = 1)]
    first_k_dense_replace: usize,
    /// Seed of the random router (`copy`).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Largest output shard in GiB.
    #[arg(long, default_value_t = 2.0)]
    shard_gib: f64,
}

/// Runs `caracal moeify`.
pub fn run(a: MoeifyArgs) -> Result<()> {
    let opts = MoeifyOptions {
        experts: a.experts,
        top_k: a.top_k,
        shared_fraction: a.shared_fraction,
        variant: match a.variant {
            VariantArg::Copy => Variant::Copy,
            VariantArg::Split => Variant::Split,
        },
        routed_scaling_factor: a.routed_scaling_factor,
        n_group: a.n_group,
        topk_group: a.topk_group,
        first_k_dense_replace: a.first_k_dense_replace,
        seed: a.seed,
        max_shard_bytes: (a.shard_gib.max(0.001) * (1u64 << 30) as f64) as u64,
    };
    let report = moeify_checkpoint(&a.in_dir, &a.out_dir, &opts).with_context(|| {
        format!(
            "moeifying {} into {}",
            a.in_dir.display(),
            a.out_dir.display()
        )
    })?;
    println!("{report}");
    Ok(())
}
