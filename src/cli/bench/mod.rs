//! `caracal bench`: a load generator. Without `--url` it drives the runtime
//! in-process and reports time to first token, inter-token latency,
//! throughput and cache hit rate, comparing concurrency levels and
//! cached-history follow-ups side by side in one run. With `--url` it
//! loads any OpenAI-compatible server over HTTP instead ([`load`]: the
//! serving and agent-loop scenarios; [`client`]: the streamed requests;
//! [`soak`]: the agent loop for a duration, sampled into a CSV and a
//! [`plot`]).

mod client;
mod load;
mod plot;
mod soak;
mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use caracal::models::CausalLm;
use caracal_actors::messages::{StopConditions, TokenEvent, ValidRequest};
use caracal_actors::runtime::Engine;
use caracal_kernels::sampling::{Rng, SamplingParams};
use clap::Args;
use serde_json::json;

use super::engine_args::EngineArgs;

/// Arguments of `caracal bench`.
#[derive(Args)]
pub struct BenchArgs {
    /// Load this OpenAI-compatible server over HTTP (e.g. http://127.0.0.1:8000)
    /// instead of the runtime in-process.
    #[arg(long)]
    url: Option<String>,
    /// In-process: checkpoint folder (default: the built-in tiny Kimi K3 with
    /// random weights). With --url: the model name to send (default: the
    /// first of GET /v1/models).
    #[arg(long)]
    model: Option<String>,
    /// Requests per concurrency level.
    #[arg(long = "num-prompts", alias = "requests", default_value_t = 16)]
    requests: usize,
    /// Prompt length: random token ids in-process, random words with --url
    /// (the server's own prompt token counts are reported).
    #[arg(long, default_value_t = 128)]
    input_len: usize,
    /// Generated tokens per request (EOS ignored).
    #[arg(long, default_value_t = 64)]
    output_len: usize,
    /// Concurrency levels to run, comma-separated; ratios are against the first.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    concurrency: Vec<usize>,
    /// With --url: request arrivals per second (Poisson); inf sends them all at once.
    #[arg(long, default_value_t = f64::INFINITY)]
    request_rate: f64,
    /// With --url: the endpoint to call.
    #[arg(long, value_enum, default_value = "chat")]
    endpoint: workload::Endpoint,
    /// With --url: `Authorization: Bearer KEY`.
    #[arg(long)]
    api_key: Option<String>,
    /// With --url: independent requests (serving) or multi-turn sessions
    /// appending tool results (agent-loop).
    #[arg(long, value_enum, default_value = "serving")]
    scenario: workload::Scenario,
    /// agent-loop: sessions at once.
    #[arg(long, default_value_t = 16)]
    sessions: usize,
    /// agent-loop: turns per session.
    #[arg(long, default_value_t = 6)]
    turns: usize,
    /// agent-loop: words of each tool result.
    #[arg(long, default_value_t = 64)]
    tool_result_len: usize,
    /// With --url: let the server stop at EOS (default: `ignore_eos: true`).
    #[arg(long)]
    disable_ignore_eos: bool,
    /// Also measure a follow-up turn after this many tokens of cached history
    /// (vs the same new tokens without history); 0 skips it.
    #[arg(long, default_value_t = 0)]
    history: usize,
    /// With --url --scenario agent-loop: run the sessions for this long (30m,
    /// 120s, 1h), conversation after conversation, sampling the server (the soak).
    #[arg(long, value_parser = soak::parse_duration)]
    duration: Option<std::time::Duration>,
    /// Soak: time between samples (rows of the CSV).
    #[arg(long, value_parser = soak::parse_duration, default_value = "60s")]
    sample_interval: std::time::Duration,
    /// Soak: write the samples to this CSV file.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Soak: draw server RSS, KV pages and TTFT p99 over time into this PNG
    /// (960x720).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

/// Timings of one request.
#[derive(Debug, Clone)]
struct Sample {
    ttft: f64,
    itl: Vec<f64>,
    generated: usize,
    prompt: usize,
    cached: usize,
}

/// Aggregates of one scenario.
#[derive(Debug, Clone, serde::Serialize)]
struct Summary {
    name: String,
    requests: usize,
    wall_s: f64,
    output_tok_s: f64,
    ttft_mean_ms: f64,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    itl_mean_ms: f64,
    itl_p99_ms: f64,
    /// Aggregate decode rate while the streams decode: concurrency / mean ITL.
    decode_tok_s: f64,
    cache_hit_rate: f64,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn summarize(name: &str, samples: &[Sample], wall: f64, concurrency: usize) -> Summary {
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft * 1e3).collect();
    let mut itl: Vec<f64> = samples
        .iter()
        .flat_map(|s| s.itl.iter().map(|x| x * 1e3))
        .collect();
    let gen: usize = samples.iter().map(|s| s.generated).sum();
    let prompt: usize = samples.iter().map(|s| s.prompt).sum();
    let cached: usize = samples.iter().map(|s| s.cached).sum();
    let itl_mean = itl.iter().sum::<f64>() / itl.len().max(1) as f64;
    let mut s = Summary {
        name: name.into(),
        requests: samples.len(),
        wall_s: wall,
        output_tok_s: gen as f64 / wall.max(1e-9),
        ttft_mean_ms: ttft.iter().sum::<f64>() / ttft.len().max(1) as f64,
        ttft_p50_ms: pct(&mut ttft, 0.5),
        ttft_p99_ms: pct(&mut ttft, 0.99),
        itl_mean_ms: itl.iter().sum::<f64>() / itl.len().max(1) as f64,
        itl_p99_ms: pct(&mut itl, 0.99),
        decode_tok_s: 0.0,
        cache_hit_rate: cached as f64 / prompt.max(1) as f64,
    };
    s.decode_tok_s = if itl_mean > 0.0 {
        concurrency.min(samples.len()) as f64 * 1e3 / itl_mean
    } else {
        0.0
    };
    s
}

fn random_prompt(rng: &mut Rng, len: usize, vocab: usize) -> Vec<u32> {
    let lo = 16.min(vocab - 1);
    (0..len)
        .map(|_| lo as u32 + (rng.next_u64() % (vocab - lo) as u64) as u32)
        .collect()
}

fn request(prompt: Vec<u32>, max_tokens: usize, session: Option<String>) -> ValidRequest {
    ValidRequest {
        session,
        prompt,
        cache_key: None,
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop: StopConditions::default(),
        ..Default::default()
    }
}

async fn one(engine: &Engine, req: ValidRequest) -> Result<Sample> {
    let prompt = req.prompt.len();
    let t0 = Instant::now();
    let mut rx = engine.submit(req).await?;
    let (mut ttft, mut last, mut itl, mut generated) = (0.0, t0, Vec::new(), 0);
    while let Some(ev) = rx.recv().await {
        match ev {
            TokenEvent::Token { .. } => {
                let now = Instant::now();
                if generated == 0 {
                    ttft = (now - t0).as_secs_f64();
                } else {
                    itl.push((now - last).as_secs_f64());
                }
                last = now;
                generated += 1;
            }
            TokenEvent::Finished { cache, .. } => {
                return Ok(Sample {
                    ttft,
                    itl,
                    generated,
                    prompt,
                    cached: cache.cached_tokens,
                })
            }
            TokenEvent::Error { kind, message } => bail!("{kind}: {message}"),
        }
    }
    bail!("stream closed before the request finished")
}

/// Runs `reqs` keeping at most `conc` in flight.
async fn run_level(
    engine: &Engine,
    reqs: Vec<ValidRequest>,
    conc: usize,
) -> Result<(Vec<Sample>, f64)> {
    let t0 = Instant::now();
    let queue = Arc::new(std::sync::Mutex::new(reqs.into_iter()));
    let workers = (0..conc.max(1)).map(|_| {
        let queue = queue.clone();
        async move {
            let mut out = Vec::new();
            loop {
                let next = queue.lock().expect("bench queue lock").next();
                let Some(r) = next else { break };
                out.push(one(engine, r).await?);
            }
            Ok::<_, anyhow::Error>(out)
        }
    });
    let mut samples = Vec::new();
    for r in futures::future::join_all(workers).await {
        samples.extend(r?);
    }
    Ok((samples, t0.elapsed().as_secs_f64()))
}

/// Runs `caracal bench`.
pub fn run(a: BenchArgs, load: &caracal::checkpoint::LoadOptions) -> Result<()> {
    if a.duration.is_none() && (a.csv.is_some() || a.plot.is_some()) {
        bail!("--csv and --plot belong to the soak: add --duration");
    }
    if a.duration.is_some() && (a.url.is_none() || a.scenario != workload::Scenario::AgentLoop) {
        bail!("--duration runs the soak: it needs --url and --scenario agent-loop");
    }
    if let Some(url) = a.url.clone() {
        let soak = a.duration.map(|duration| workload::SoakConfig {
            duration,
            sample_interval: a.sample_interval,
            csv: a.csv.clone(),
            plot: a.plot.clone(),
        });
        return load::run(workload::LoadConfig {
            url,
            api_key: a.api_key,
            model: a.model,
            endpoint: a.endpoint,
            scenario: a.scenario,
            num_prompts: a.requests,
            input_len: a.input_len,
            output_len: a.output_len,
            concurrency: a.concurrency,
            request_rate: a.request_rate,
            sessions: a.sessions,
            turns: a.turns,
            tool_result_len: a.tool_result_len,
            ignore_eos: !a.disable_ignore_eos,
            seed: a.seed,
            json: a.json,
            soak,
        });
    }
    let model_dir = super::model_dir(a.model.clone().map(PathBuf::from))?;
    let loaded = super::load_model(&model_dir, load)?;
    let model: Arc<dyn CausalLm> = Arc::from(loaded.model);
    let info = model.info().clone();
    if a.input_len + a.output_len + a.history >= info.max_position {
        bail!(
            "history + input_len + output_len must stay below the context length {}",
            info.max_position
        );
    }
    let cfg = a.engine.config();
    let sys = actix::System::new();
    let summaries = sys.block_on(async move {
        let engine = Engine::start(model, cfg, None);
        let mut rng = Rng::new(a.seed);
        let mut out = Vec::new();
        // Warm-up: one short request so lazy initialisation is not measured.
        one(
            &engine,
            request(random_prompt(&mut rng, 8, info.vocab_size), 2, None),
        )
        .await?;
        for &c in &a.concurrency {
            let reqs = (0..a.requests)
                .map(|_| {
                    request(
                        random_prompt(&mut rng, a.input_len, info.vocab_size),
                        a.output_len,
                        None,
                    )
                })
                .collect();
            let (samples, wall) = run_level(&engine, reqs, c).await?;
            out.push(summarize(&format!("concurrency {c}"), &samples, wall, c));
        }
        if a.history > 0 {
            let (mut cold, mut warm) = (Vec::new(), Vec::new());
            for i in 0..a.requests.clamp(1, 8) {
                let history = random_prompt(&mut rng, a.history, info.vocab_size);
                let new = random_prompt(&mut rng, a.input_len, info.vocab_size);
                let session = Some(format!("bench-{i}"));
                // Turn 1 (not measured) leaves the history cached and pinned.
                one(&engine, request(history.clone(), 1, session.clone())).await?;
                let mut follow = history;
                follow.extend(&new);
                warm.push(one(&engine, request(follow, a.output_len.min(8), session)).await?);
                cold.push(one(&engine, request(new, a.output_len.min(8), None)).await?);
            }
            out.push(summarize(
                &format!(
                    "follow-up, {} cached history + {} new",
                    a.history, a.input_len
                ),
                &warm,
                1.0,
                1,
            ));
            out.push(summarize(
                &format!("no history, {} new", a.input_len),
                &cold,
                1.0,
                1,
            ));
        }
        Ok::<_, anyhow::Error>(out)
    })?;
    let base = summaries[0].output_tok_s;
    let base_decode = summaries[0].decode_tok_s;
    if a.json {
        println!(
            "{}",
            json!({"model": model_dir.display().to_string(), "scenarios": summaries})
        );
        return Ok(());
    }
    println!(
        "{:<44} {:>5} {:>9} {:>7} {:>10} {:>7} {:>9} {:>9} {:>8} {:>9}",
        "scenario",
        "reqs",
        "out tok/s",
        "ratio",
        "decode t/s",
        "ratio",
        "TTFT ms",
        "TTFT p99",
        "ITL ms",
        "cache hit"
    );
    for s in &summaries {
        let conc = s.name.starts_with("concurrency");
        let r1 = if conc {
            format!("{:.2}x", s.output_tok_s / base)
        } else {
            "-".into()
        };
        let r2 = if conc {
            format!("{:.2}x", s.decode_tok_s / base_decode.max(1e-9))
        } else {
            "-".into()
        };
        println!(
            "{:<44} {:>5} {:>9.1} {:>7} {:>10.1} {:>7} {:>9.2} {:>9.2} {:>8.2} {:>8.1}%",
            s.name,
            s.requests,
            s.output_tok_s,
            r1,
            s.decode_tok_s,
            r2,
            s.ttft_mean_ms,
            s.ttft_p99_ms,
            s.itl_mean_ms,
            s.cache_hit_rate * 100.0
        );
    }
    if a.history > 0 {
        let n = summaries.len();
        println!(
            "follow-up TTFT with {} cached tokens / without history: {:.2}x",
            a.history,
            summaries[n - 2].ttft_mean_ms / summaries[n - 1].ttft_mean_ms.max(1e-9)
        );
    }
    Ok(())
}
