//! `caracal plan`: memory plan for a model on given hardware.

use std::path::PathBuf;

use anyhow::Result;
use caracal::plan::{run_plan, PlanArgs};
use clap::Args;

/// Arguments of `caracal plan`.
#[derive(Args)]
pub struct PlanCliArgs {
    /// Checkpoint folder (reads config.json and safetensors headers only).
    #[arg(long, conflicts_with = "preset")]
    model: Option<PathBuf>,
    /// Built-in architecture: kimi-k3, kimi-k2, kimi-linear-48b.
    #[arg(long)]
    preset: Option<String>,
    /// Devices, e.g. 8xH200, 16xB200, 1xcpu (with --memory).
    #[arg(long, default_value = "8xH200")]
    devices: String,
    /// Memory per device, overriding the kind's (e.g. 139GiB).
    #[arg(long)]
    memory: Option<String>,
    /// Tokens per session.
    #[arg(long, default_value_t = 1_048_576)]
    context: u64,
    /// Weight format: mxfp4, bf16, fp8, q4_k_m (default: the checkpoint's own).
    #[arg(long)]
    weights: Option<String>,
    /// KV cache dtype: bf16, fp8, int8 or f32.
    #[arg(long)]
    kv_cache_dtype: Option<String>,
    /// Fraction of device memory to use (like vLLM's --gpu-memory-utilization).
    #[arg(long)]
    memory_utilization: Option<f64>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Runs `caracal plan`.
pub fn run(a: PlanCliArgs) -> Result<()> {
    let out = run_plan(&PlanArgs {
        model_dir: a.model,
        preset: a.preset,
        devices: Some(a.devices),
        memory: a.memory,
        context: Some(a.context),
        weights: a.weights,
        kv_cache: a.kv_cache_dtype,
        utilisation: a.memory_utilization,
        reserve: None,
        mla_cache_replicas: None,
        json: a.json,
    })?;
    println!("{out}");
    Ok(())
}
