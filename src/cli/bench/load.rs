//! `caracal bench --url`: load against any OpenAI-compatible server.
//!
//! Two scenarios. `serving` sends `--num-prompts` random-word prompts per
//! concurrency level, at most `--concurrency` in flight, arriving as a
//! Poisson process of `--request-rate` per second (all at once when
//! infinite), and reports TTFT, ITL, E2E latency and output throughput.
//! `agent-loop` runs `--sessions` conversations at once, each of `--turns`
//! turns: after every answer the conversation grows by that answer (as an
//! assistant tool call) and a tool result of `--tool-result-len` words,
//! and the whole conversation is sent again, as agents do over Chat
//! Completions; it reports first-turn against follow-up TTFT and the share
//! of follow-up prompts the server reports as cached. With `--duration` the
//! agent loop becomes the soak of [`super::soak`] instead.
//!
//! Prompts are random common English words (about one token each with BPE
//! vocabularies); the prompt token counts reported are the server's own
//! (`usage.prompt_tokens`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use caracal_kernels::sampling::Rng;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::client::{Streamed, Target};
use super::soak;
use super::workload::{append_turn, words, Dist, LoadConfig, Scenario, Shape};

/// Error messages kept per report.
const KEPT_ERRORS: usize = 4;

/// Report of one concurrency level of the serving scenario.
#[derive(Debug, Clone, Serialize)]
pub struct LevelReport {
    /// Most requests in flight.
    pub concurrency: usize,
    /// Arrivals per second; `null` is infinite.
    pub request_rate: Option<f64>,
    /// Requests that finished.
    pub completed: usize,
    /// Requests that failed.
    pub failed: usize,
    /// The first few failure messages.
    pub errors: Vec<String>,
    /// Seconds from the first send to the last finish.
    pub duration_s: f64,
    /// Finished requests per second.
    pub request_throughput: f64,
    /// Prompt tokens the server reported, summed.
    pub prompt_tokens: usize,
    /// Mean prompt tokens per request.
    pub prompt_tokens_mean: f64,
    /// Output tokens, summed.
    pub output_tokens: usize,
    /// Output tokens per second of wall time.
    pub output_throughput: f64,
    /// Cached prompt tokens the server reported; `null` when it reports none.
    pub cached_tokens: Option<usize>,
    /// Time to first token.
    pub ttft_ms: Dist,
    /// Time between content deltas.
    pub itl_ms: Dist,
    /// Time per output token after the first: (E2E − TTFT) / (tokens − 1).
    pub tpot_ms: Dist,
    /// End-to-end latency.
    pub e2e_ms: Dist,
}

/// First turns or follow-ups of the agent-loop scenario.
#[derive(Debug, Clone, Serialize)]
pub struct TurnReport {
    /// Requests that finished.
    pub requests: usize,
    /// Time to first token.
    pub ttft_ms: Dist,
    /// Prompt tokens the server reported, summed.
    pub prompt_tokens: usize,
    /// Cached prompt tokens reported; `null` when the server reports none.
    pub cached_tokens: Option<usize>,
    /// cached_tokens / prompt_tokens; `null` when not reported.
    pub cached_share: Option<f64>,
}

/// Report of the agent-loop scenario.
#[derive(Debug, Clone, Serialize)]
pub struct AgentReport {
    /// Sessions run at once.
    pub sessions: usize,
    /// Turns per session.
    pub turns: usize,
    /// Turns that finished.
    pub completed: usize,
    /// Turns that failed (a failure ends its session).
    pub failed: usize,
    /// The first few failure messages.
    pub errors: Vec<String>,
    /// Seconds from the first send to the last finish.
    pub duration_s: f64,
    /// Output tokens, summed.
    pub output_tokens: usize,
    /// Output tokens per second of wall time.
    pub output_throughput: f64,
    /// Turn 1 of every session.
    pub first_turn: TurnReport,
    /// Turns 2.. of every session.
    pub follow_up: TurnReport,
    /// Time between content deltas, all turns.
    pub itl_ms: Dist,
    /// End-to-end latency, all turns.
    pub e2e_ms: Dist,
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
fn progress(len: usize, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{msg:>22} [{bar:40}] {pos}/{len} {elapsed_precise}")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(what.to_string());
    pb
}

/// Keeps the first few error messages.
fn keep_error(errors: &mut Vec<String>, e: &anyhow::Error) {
    if errors.len() < KEPT_ERRORS {
        errors.push(format!("{e:#}"));
    }
}

/// Runs `caracal bench --url`.
pub fn run(cfg: LoadConfig) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run_async(cfg))
}

async fn run_async(cfg: LoadConfig) -> Result<()> {
    let target = Arc::new(Target::parse(&cfg.url, cfg.api_key.clone())?);
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => {
            let v = target.get_json("/v1/models").await?;
            match v["data"][0]["id"].as_str() {
                Some(id) => id.to_string(),
                None => bail!(
                    "{} lists no model; pass --model NAME",
                    target.url("/v1/models")
                ),
            }
        }
    };
    let shape = Arc::new(Shape {
        endpoint: cfg.endpoint,
        model: model.clone(),
        max_tokens: cfg.output_len.max(1),
        ignore_eos: cfg.ignore_eos,
    });
    let mut rng = Rng::new(cfg.seed);
    // Warm-up, not measured: lazy initialisation on either side.
    let warm = shape.body(shape.first(words(&mut rng, 8)), 4);
    target.stream(shape.endpoint.path(), &warm).await?;
    let head = json!({
        "url": cfg.url,
        "model": model,
        "endpoint": cfg.endpoint,
        "scenario": cfg.scenario,
        "input_len": cfg.input_len,
        "output_len": cfg.output_len,
        "seed": cfg.seed,
    });
    match cfg.scenario {
        Scenario::Serving => {
            let mut levels = Vec::new();
            for &c in &cfg.concurrency {
                let prompts = (0..cfg.num_prompts)
                    .map(|_| shape.first(words(&mut rng, cfg.input_len)))
                    .collect();
                let r = serving_level(&target, &shape, prompts, c.max(1), &cfg, &mut rng).await;
                levels.push(r);
            }
            let completed: usize = levels.iter().map(|l| l.completed).sum();
            if cfg.json {
                let mut out = head;
                out["num_prompts"] = json!(cfg.num_prompts);
                out["levels"] = serde_json::to_value(&levels)?;
                println!("{out}");
            } else {
                print_levels(&target.url(shape.endpoint.path()), &model, &levels);
            }
            if completed == 0 {
                bail!("no request completed");
            }
        }
        Scenario::AgentLoop if cfg.soak.is_some() => {
            let spec = cfg.soak.clone().expect("matched Some");
            let r = soak::run(target.clone(), shape.clone(), &cfg, &spec, &mut rng).await?;
            if cfg.json {
                let mut out = head;
                out["tool_result_len"] = json!(cfg.tool_result_len);
                out["soak"] = serde_json::to_value(&r)?;
                println!("{out}");
            } else {
                soak::print(&target.url(shape.endpoint.path()), &model, &r);
            }
            if r.requests == 0 {
                bail!("no turn completed");
            }
        }
        Scenario::AgentLoop => {
            let r = agent_loop(&target, &shape, &cfg, &mut rng).await;
            if cfg.json {
                let mut out = head;
                out["tool_result_len"] = json!(cfg.tool_result_len);
                out["agent_loop"] = serde_json::to_value(&r)?;
                println!("{out}");
            } else {
                print_agent(&target.url(shape.endpoint.path()), &model, &r);
            }
            if r.completed == 0 {
                bail!("no turn completed");
            }
        }
    }
    Ok(())
}

/// One concurrency level of the serving scenario.
async fn serving_level(
    target: &Arc<Target>,
    shape: &Arc<Shape>,
    prompts: Vec<Value>,
    concurrency: usize,
    cfg: &LoadConfig,
    rng: &mut Rng,
) -> LevelReport {
    let pb = progress(prompts.len(), &format!("concurrency {concurrency}"));
    let sem = Arc::new(Semaphore::new(concurrency));
    let mut set = JoinSet::new();
    let t0 = Instant::now();
    for p in prompts {
        if cfg.request_rate.is_finite() && cfg.request_rate > 0.0 {
            // Exponential gaps: a Poisson process of `request_rate` per second.
            let gap = -(1.0 - rng.next_f64()).ln() / cfg.request_rate;
            tokio::time::sleep(Duration::from_secs_f64(gap)).await;
        }
        let (target, shape, sem, pb) = (target.clone(), shape.clone(), sem.clone(), pb.clone());
        set.spawn(async move {
            let permit = sem.acquire_owned().await;
            let body = shape.body(p, shape.max_tokens);
            let r = target.stream(shape.endpoint.path(), &body).await;
            drop(permit);
            pb.inc(1);
            r
        });
    }
    let mut ok: Vec<Streamed> = Vec::new();
    let mut errors = Vec::new();
    let mut failed = 0;
    while let Some(joined) = set.join_next().await {
        match joined {
            Ok(Ok(s)) => ok.push(s),
            Ok(Err(e)) => {
                failed += 1;
                keep_error(&mut errors, &e);
            }
            Err(e) => {
                failed += 1;
                keep_error(&mut errors, &anyhow::anyhow!("request task: {e}"));
            }
        }
    }
    let duration = t0.elapsed().as_secs_f64().max(1e-9);
    pb.finish_and_clear();
    let prompt_tokens: usize = ok
        .iter()
        .map(|s| s.usage.map_or(0, |u| u.prompt_tokens))
        .sum();
    let output_tokens: usize = ok.iter().map(Streamed::output_tokens).sum();
    LevelReport {
        concurrency,
        request_rate: cfg.request_rate.is_finite().then_some(cfg.request_rate),
        completed: ok.len(),
        failed,
        errors,
        duration_s: duration,
        request_throughput: ok.len() as f64 / duration,
        prompt_tokens,
        prompt_tokens_mean: prompt_tokens as f64 / ok.len().max(1) as f64,
        output_tokens,
        output_throughput: output_tokens as f64 / duration,
        cached_tokens: cached_sum(ok.iter()),
        ttft_ms: Dist::of_secs(ok.iter().filter_map(|s| s.ttft)),
        itl_ms: Dist::of_secs(ok.iter().flat_map(|s| s.itl.iter().copied())),
        tpot_ms: Dist::of_secs(ok.iter().filter_map(|s| {
            let n = s.output_tokens();
            let ttft = s.ttft?;
            (n > 1).then(|| (s.e2e - ttft) / (n - 1) as f64)
        })),
        e2e_ms: Dist::of_secs(ok.iter().map(|s| s.e2e)),
    }
}

/// Sum of the reported cached tokens; `None` when no response reported any.
fn cached_sum<'a>(it: impl Iterator<Item = &'a Streamed>) -> Option<usize> {
    let mut seen = false;
    let mut sum = 0;
    for s in it {
        if let Some(c) = s.usage.and_then(|u| u.cached_tokens) {
            seen = true;
            sum += c;
        }
    }
    seen.then_some(sum)
}

/// One turn's result: its turn number (0-based) and what it measured.
type Turn = (usize, Result<Streamed>);

/// One agent session: `turns` requests, each carrying the whole conversation.
async fn session(
    target: Arc<Target>,
    shape: Arc<Shape>,
    id: usize,
    mut convo: Value,
    tool_results: Vec<String>,
    pb: ProgressBar,
) -> Vec<Turn> {
    let mut out = Vec::new();
    for (t, tool) in std::iter::once(None)
        .chain(tool_results.into_iter().map(Some))
        .enumerate()
    {
        if let Some(tool) = tool {
            let Some((_, Ok(prev))) = out.last() else {
                break;
            };
            let prev: &Streamed = prev;
            append_turn(&mut convo, shape.endpoint, &prev.text, &tool, id, t);
        }
        let body = shape.body(convo.clone(), shape.max_tokens);
        let r = target.stream(shape.endpoint.path(), &body).await;
        pb.inc(1);
        let failed = r.is_err();
        out.push((t, r));
        if failed {
            break;
        }
    }
    out
}

/// The agent-loop scenario.
async fn agent_loop(
    target: &Arc<Target>,
    shape: &Arc<Shape>,
    cfg: &LoadConfig,
    rng: &mut Rng,
) -> AgentReport {
    let (sessions, turns) = (cfg.sessions.max(1), cfg.turns.max(1));
    let pb = progress(sessions * turns, "agent-loop turns");
    let mut set = JoinSet::new();
    let t0 = Instant::now();
    for id in 0..sessions {
        let first = shape.first(words(rng, cfg.input_len));
        let tools = (1..turns)
            .map(|_| words(rng, cfg.tool_result_len))
            .collect();
        set.spawn(session(
            target.clone(),
            shape.clone(),
            id,
            first,
            tools,
            pb.clone(),
        ));
    }
    let (mut first, mut follow) = (Vec::new(), Vec::new());
    let mut errors = Vec::new();
    let mut failed = 0;
    while let Some(joined) = set.join_next().await {
        let turns = match joined {
            Ok(t) => t,
            Err(e) => {
                failed += 1;
                keep_error(&mut errors, &anyhow::anyhow!("session task: {e}"));
                continue;
            }
        };
        for (t, r) in turns {
            match r {
                Ok(s) if t == 0 => first.push(s),
                Ok(s) => follow.push(s),
                Err(e) => {
                    failed += 1;
                    keep_error(&mut errors, &e);
                }
            }
        }
    }
    let duration = t0.elapsed().as_secs_f64().max(1e-9);
    pb.finish_and_clear();
    let all = || first.iter().chain(follow.iter());
    let output_tokens: usize = all().map(Streamed::output_tokens).sum();
    AgentReport {
        sessions,
        turns,
        completed: first.len() + follow.len(),
        failed,
        errors,
        duration_s: duration,
        output_tokens,
        output_throughput: output_tokens as f64 / duration,
        first_turn: turn_report(&first),
        follow_up: turn_report(&follow),
        itl_ms: Dist::of_secs(all().flat_map(|s| s.itl.iter().copied())),
        e2e_ms: Dist::of_secs(all().map(|s| s.e2e)),
    }
}

/// Aggregates some turns.
fn turn_report(turns: &[Streamed]) -> TurnReport {
    let prompt: usize = turns
        .iter()
        .map(|s| s.usage.map_or(0, |u| u.prompt_tokens))
        .sum();
    let cached = cached_sum(turns.iter());
    TurnReport {
        requests: turns.len(),
        ttft_ms: Dist::of_secs(turns.iter().filter_map(|s| s.ttft)),
        prompt_tokens: prompt,
        cached_tokens: cached,
        cached_share: cached.map(|c| c as f64 / prompt.max(1) as f64),
    }
}

/// `mean / p50 / p99` in a table cell.
fn cell(d: &Dist) -> String {
    format!("{:.1}/{:.1}/{:.1}", d.mean, d.p50, d.p99)
}

fn print_levels(url: &str, model: &str, levels: &[LevelReport]) {
    println!("{url}, model `{model}`; latencies in ms as mean/p50/p99");
    println!(
        "{:>5} {:>6} {:>8} {:>9} {:>10} {:>7} {:>22} {:>20} {:>24}",
        "conc", "rate", "ok/fail", "prompt", "out tok/s", "req/s", "TTFT", "ITL", "E2E"
    );
    for l in levels {
        let rate = l
            .request_rate
            .map_or_else(|| "inf".to_string(), |r| format!("{r:.1}"));
        println!(
            "{:>5} {:>6} {:>8} {:>9.1} {:>10.1} {:>7.2} {:>22} {:>20} {:>24}",
            l.concurrency,
            rate,
            format!("{}/{}", l.completed, l.failed),
            l.prompt_tokens_mean,
            l.output_throughput,
            l.request_throughput,
            cell(&l.ttft_ms),
            cell(&l.itl_ms),
            cell(&l.e2e_ms),
        );
        for e in &l.errors {
            println!("      error: {e}");
        }
    }
}

fn print_agent(url: &str, model: &str, r: &AgentReport) {
    println!(
        "{url}, model `{model}`: agent loop, {} sessions x {} turns, {}/{} turns ok/failed, \
         {:.1} s, {:.1} output tok/s",
        r.sessions, r.turns, r.completed, r.failed, r.duration_s, r.output_throughput
    );
    println!(
        "{:<10} {:>6} {:>24} {:>10} {:>10} {:>8}",
        "turns", "reqs", "TTFT mean/p50/p99 ms", "prompt", "cached", "share"
    );
    for (name, t) in [("first", &r.first_turn), ("follow-up", &r.follow_up)] {
        println!(
            "{:<10} {:>6} {:>24} {:>10} {:>10} {:>8}",
            name,
            t.requests,
            cell(&t.ttft_ms),
            t.prompt_tokens,
            t.cached_tokens
                .map_or_else(|| "n/a".to_string(), |c| c.to_string()),
            t.cached_share
                .map_or_else(|| "n/a".to_string(), |s| format!("{:.1}%", s * 100.0)),
        );
    }
    if r.first_turn.ttft_ms.p50 > 0.0 {
        println!(
            "follow-up / first-turn TTFT p50: {:.2}x; ITL {} ms",
            r.follow_up.ttft_ms.p50 / r.first_turn.ttft_ms.p50,
            cell(&r.itl_ms)
        );
    }
    for e in &r.errors {
        println!("error: {e}");
    }
}
