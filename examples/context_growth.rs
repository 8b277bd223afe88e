//! How the cost of one long session grows with its context, on the K3-shaped
//! default model (5 KDA + 2 MLA layers): one session is grown slice by slice
//! through the real engine (scheduler, chunked prefill, radix prefix cache,
//! paged bf16 KV rows), each slice a request whose prompt is the whole context
//! so far, so only the new slice is prefilled. Reported per slice: prefill
//! tokens/s of the slice, KV pages in use and their bytes, the process's
//! resident memory, and what `caracal plan` predicts for that many tokens
//! (MLA latent rows × tokens + the fixed KDA state). At the chosen depths it
//! also decodes a few tokens and reports decode tokens/s.
//!
//! Expected shape: KDA layers cost the same per token at any depth (their
//! state is fixed-size), MLA rows grow linearly, so KV bytes = plan bytes and
//! prefill/decode speed falls only with the MLA attention over the rows.
//!
//! ```text
//! cargo run --release --example context_growth -- [--tokens 262144] [--slice 16384]
//!     [--decode-at 16384,65536,262144] [--decode-tokens 32] [--model DIR] [--csv FILE]
//!     [--kv-cache-dtype bf16|int8|f32]
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use caracal::checkpoint::LoadOptions;
use caracal::models::CausalLm;
use caracal_actors::messages::{StopConditions, TokenEvent, ValidRequest};
use caracal_actors::runtime::{Engine, EngineConfig};
use caracal_actors::scheduler::SchedulerConfig;
use caracal_kernels::paged::KvDtype;
use caracal_kernels::sampling::SamplingParams;
use caracal_kernels::testing::Rng;

/// Command-line settings.
struct Args {
    tokens: usize,
    slice: usize,
    decode_at: Vec<usize>,
    decode_tokens: usize,
    model: Option<PathBuf>,
    csv: Option<PathBuf>,
    kv: KvDtype,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        tokens: 262_144,
        slice: 16_384,
        decode_at: vec![16_384, 65_536, 262_144],
        decode_tokens: 32,
        model: None,
        csv: None,
        kv: KvDtype::Bf16,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--tokens" => a.tokens = value()?.parse()?,
            "--slice" => a.slice = value()?.parse()?,
            "--decode-at" => {
                a.decode_at = value()?
                    .split(',')
                    .map(|s| s.trim().parse())
                    .collect::<Result<_, _>>()?
            }
            "--decode-tokens" => a.decode_tokens = value()?.parse()?,
            "--model" => a.model = Some(PathBuf::from(value()?)),
            "--csv" => a.csv = Some(PathBuf::from(value()?)),
            "--kv-cache-dtype" => {
                a.kv = value()?
                    .parse()
                    .map_err(|e: String| anyhow::anyhow!("--kv-cache-dtype: {e}"))?
            }
            other => bail!("unknown flag {other}"),
        }
    }
    if a.slice == 0 || a.tokens < a.slice {
        bail!("--slice must be >= 1 and <= --tokens");
    }
    Ok(a)
}

/// Resident memory of this process in bytes (`VmRSS`).
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).map(str::to_owned))
        })
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// What one request measured.
struct Run {
    /// Submit → first token, seconds.
    ttft: f64,
    /// First → last token, seconds.
    decode: f64,
    generated: usize,
    cached: usize,
}

async fn run(engine: &Engine, prompt: Vec<u32>, max_tokens: usize) -> Result<Run> {
    let req = ValidRequest {
        session: Some("growth".into()),
        prompt,
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop: StopConditions::default(),
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut rx = engine.submit(req).await?;
    let (mut first, mut last, mut generated) = (None, t0, 0);
    while let Some(ev) = rx.recv().await {
        match ev {
            TokenEvent::Token { .. } => {
                let now = Instant::now();
                first.get_or_insert(now);
                last = now;
                generated += 1;
            }
            TokenEvent::Finished { cache, .. } => {
                let first = first.unwrap_or(last);
                return Ok(Run {
                    ttft: (first - t0).as_secs_f64(),
                    decode: (last - first).as_secs_f64(),
                    generated,
                    cached: cache.cached_tokens,
                });
            }
            TokenEvent::Error { kind, message } => bail!("{kind}: {message}"),
        }
    }
    bail!("the request's stream closed before it finished")
}

fn main() -> Result<()> {
    let a = parse_args()?;
    let dir = match a.model.clone() {
        Some(d) => d,
        None => caracal::convert::synth::default_model_dir()?,
    };
    let model: Arc<dyn CausalLm> =
        Arc::from(caracal::models::load_with(&dir, &LoadOptions::default())?);
    let info = model.info().clone();
    if a.tokens + a.decode_tokens >= info.max_position {
        bail!(
            "--tokens must stay below the context length {}",
            info.max_position
        );
    }
    let page_size = 16;
    let row_bytes = info.kv_layers * a.kv.row_bytes(info.kv_width, info.kv_segment);
    let kv_budget =
        (a.tokens + a.decode_tokens * a.decode_at.len() + 4 * page_size) * row_bytes * 2;
    let cfg = EngineConfig {
        scheduler: SchedulerConfig {
            max_batch_tokens: 2048,
            chunked_prefill_size: 2048,
            page_size,
            kv_cache_dtype: a.kv,
            ..Default::default()
        },
        kv_cache_memory: kv_budget.max(1 << 20),
        ..Default::default()
    };
    let mut rng = Rng::new(7);
    let lo = 16u32;
    let ids: Vec<u32> = (0..a.tokens)
        .map(|_| lo + (rng.next_u64() % (info.vocab_size as u64 - lo as u64)) as u32)
        .collect();
    println!(
        "model {} | {} KV layers x {} values per token = {} B/token ({:?}) | slice {} | chunk {}",
        dir.display(),
        info.kv_layers,
        info.kv_width,
        row_bytes,
        a.kv,
        a.slice,
        cfg.scheduler.chunked_prefill_size
    );
    let mut csv = String::from(
        "tokens,slice_prefill_tok_s,kv_pages_used,kv_bytes,plan_kv_bytes,rss_bytes,decode_tok_s\n",
    );
    let sys = actix::System::new();
    sys.block_on(async {
        let engine = Engine::start(model.clone(), cfg.clone(), None);
        // Warm-up (lazy initialisation is not measured); its path is replaced below.
        run(&engine, ids[..64].to_vec(), 2).await?;
        println!(
            "{:>8} {:>14} {:>10} {:>12} {:>12} {:>10} {:>10}",
            "tokens", "prefill tok/s", "KV pages", "KV MiB", "plan MiB", "RSS MiB", "decode t/s"
        );
        let mut len = 0;
        while len < a.tokens {
            let next = (len + a.slice).min(a.tokens);
            let r = run(&engine, ids[..next].to_vec(), 1).await?;
            let new = next - r.cached;
            let prefill = new as f64 / r.ttft;
            len = next;
            let decode = if a.decode_at.contains(&len) {
                let d = run(&engine, ids[..len].to_vec(), a.decode_tokens).await?;
                (d.generated > 1).then(|| (d.generated - 1) as f64 / d.decode)
            } else {
                None
            };
            let mem = engine.memory_stats().await.context("engine stopped")?;
            let used = mem.total_pages - mem.free_pages;
            let kv_bytes = used * page_size * row_bytes;
            let plan_bytes = len * row_bytes;
            let rss = rss_bytes();
            let mib = |b: usize| b as f64 / (1 << 20) as f64;
            println!(
                "{:>8} {:>14.0} {:>10} {:>12.2} {:>12.2} {:>10.1} {:>10}",
                len,
                prefill,
                used,
                mib(kv_bytes),
                mib(plan_bytes),
                mib(rss as usize),
                decode.map_or("-".into(), |d| format!("{d:.1}"))
            );
            csv.push_str(&format!(
                "{len},{prefill:.1},{used},{kv_bytes},{plan_bytes},{rss},{}\n",
                decode.map_or(String::new(), |d| format!("{d:.2}"))
            ));
        }
        Ok::<_, anyhow::Error>(())
    })?;
    if let Some(path) = a.csv {
        std::fs::write(&path, csv).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
